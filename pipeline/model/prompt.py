"""How the prompt is laid out: a byte-stable prefix first, so vLLM's prefix cache can reuse it.

Order: the fixed instructions (the same bytes for every tenant, user and request), then the
user's personalisation line, then the retrieved sources (each tagged ``[document id]``), then
the results of planned tools, then the caller's own messages. Any change to this layout must
bump ``PROMPT_VERSION``, which is part of the response-cache key.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pipeline.context import Features, Passage, ToolRun

PROMPT_VERSION = "2"

INSTRUCTIONS = (
    "You are a helpful assistant. Answer using the sources below when they are relevant, "
    "and cite each source you use by its id in square brackets, like [doc-1]. "
    "If the sources do not contain the answer, say so briefly."
)

LANGUAGES = {
    "en": "English",
    "pt": "Portuguese",
    "es": "Spanish",
    "fr": "French",
    "de": "German",
    "it": "Italian",
    "nl": "Dutch",
}


def render_sources(passages: Sequence[Passage], *, max_chars: int = 1200) -> str:
    lines = []
    for passage in passages:
        title = f"{passage.title}: " if passage.title else ""
        text = passage.text if len(passage.text) <= max_chars else passage.text[:max_chars] + " …"
        lines.append(f"[{passage.document_id}] {title}{text}")
    return "\n\n".join(lines)


def render_tool_results(runs: Sequence[ToolRun], *, max_chars: int = 2000) -> str:
    lines = []
    for run in runs:
        text = run.content if len(run.content) <= max_chars else run.content[:max_chars] + " …"
        status = "" if run.status == "ok" else f" ({run.status})"
        lines.append(f"[tool {run.name}]{status} {text}")
    return "\n".join(lines)


def personalisation(features: Features) -> str:
    """One line about the user, from the features that shape an answer (none: empty)."""
    parts = []
    language = features.get("language")
    if isinstance(language, str) and language and "language" not in features.defaulted:
        parts.append(f"Answer in {LANGUAGES.get(language.lower(), language)}.")
    tier = features.get("tier")
    if isinstance(tier, str) and tier and "tier" not in features.defaulted:
        parts.append(f"The user is on the {tier} plan.")
    return " ".join(parts)


def build_messages(
    messages: list[dict[str, Any]],
    passages: Sequence[Passage],
    *,
    personal: str = "",
    tool_runs: Sequence[ToolRun] = (),
) -> list[dict[str, Any]]:
    """The messages sent to the model: ours in one system message first, then the caller's."""
    if not passages and not personal and not tool_runs:
        return messages
    sections = [INSTRUCTIONS]
    if personal:
        sections.append(f"About the user: {personal}")
    if passages:
        sections.append(f"Sources:\n\n{render_sources(passages)}")
    if tool_runs:
        sections.append(f"Tool results:\n{render_tool_results(tool_runs)}")
    return [{"role": "system", "content": "\n\n".join(sections)}, *messages]
