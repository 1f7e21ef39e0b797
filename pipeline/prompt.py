"""How the prompt is laid out: a byte-stable prefix first, so vLLM's prefix cache can reuse it.

Order: the fixed instructions, then the retrieved sources (each tagged ``[document id]``), then
the caller's own messages. Any change to this layout must bump ``PROMPT_VERSION``, which is part
of the response-cache key.
"""

from __future__ import annotations

from typing import Any

from pipeline.context import Passage

PROMPT_VERSION = "1"

INSTRUCTIONS = (
    "You are a helpful assistant. Answer using the sources below when they are relevant, "
    "and cite each source you use by its id in square brackets, like [doc-1]. "
    "If the sources do not contain the answer, say so briefly."
)


def render_sources(passages: list[Passage], *, max_chars: int = 1200) -> str:
    lines = []
    for passage in passages:
        title = f"{passage.title}: " if passage.title else ""
        text = passage.text if len(passage.text) <= max_chars else passage.text[:max_chars] + " …"
        lines.append(f"[{passage.document_id}] {title}{text}")
    return "\n\n".join(lines)


def build_messages(messages: list[dict[str, Any]], passages: list[Passage]) -> list[dict[str, Any]]:
    """The messages sent to the model: the caller's, with the sources in a system message first."""
    if not passages:
        return messages
    system = f"{INSTRUCTIONS}\n\nSources:\n\n{render_sources(passages)}"
    return [{"role": "system", "content": system}, *messages]
