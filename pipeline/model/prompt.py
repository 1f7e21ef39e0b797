"""How the prompt is laid out: the longest byte-stable prefix first, so vLLM's prefix cache can
reuse it across requests, users and questions.

Order, from the most shared to the least: the fixed instructions (the same bytes for every
tenant, user and request), then the retrieved sources in a canonical order (by document id,
then chunk id; never by score, so that a different question which retrieves the same passages
renders them identically), then the user's personalisation line, then the results of planned
tools, then the caller's own messages. Any change to this layout must bump ``PROMPT_VERSION``,
which is part of the response-cache key.

The order is the prompt's only: ``ctx.passages`` (the response's ``rag.sources``, whose places
citations number) stays ranked. The model sees each source tagged by its document id, never by
a number, so nothing it can cite depends on where a source sits.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pipeline.context import Features, Passage, ToolRun

# 3: sources in canonical order before the personal line (was: personal line, ranked sources).
PROMPT_VERSION = "3"

INSTRUCTIONS = (
    "You are a helpful assistant. Answer using the sources below when they are relevant, "
    "and cite each source you use by its id in square brackets, like [doc-1]. "
    "If the sources do not contain the answer, say so briefly."
)
SOURCES_HEADING = "Sources:"
PERSONAL_HEADING = "About the user:"
TOOLS_HEADING = "Tool results:"
# Between two sections of the system message, and between two sources.
SEPARATOR = "\n\n"

LANGUAGES = {
    "en": "English",
    "pt": "Portuguese",
    "es": "Spanish",
    "fr": "French",
    "de": "German",
    "it": "Italian",
    "nl": "Dutch",
}


# The most of one passage's text a prompt holds (citations cite only what it held).
SOURCE_CHARS = 1200


def canonical(passages: Sequence[Passage]) -> list[Passage]:
    """The passages in the prompt's order: by document id, then chunk id (stable for ties)."""
    return sorted(passages, key=lambda p: (p.document_id, p.chunk_id))


def render_source(passage: Passage, *, max_chars: int = SOURCE_CHARS) -> str:
    """One source as the prompt shows it: ``[document id] title: text``."""
    title = f"{passage.title}: " if passage.title else ""
    text = passage.text if len(passage.text) <= max_chars else passage.text[:max_chars] + " …"
    return f"[{passage.document_id}] {title}{text}"


def render_sources(passages: Sequence[Passage], *, max_chars: int = SOURCE_CHARS) -> str:
    """The sources, in canonical order, separated by blank lines."""
    return SEPARATOR.join(render_source(p, max_chars=max_chars) for p in canonical(passages))


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


def system_prompt(
    passages: Sequence[Passage], *, personal: str = "", tool_runs: Sequence[ToolRun] = ()
) -> str:
    """Our system message: instructions, sources, the personal line, tool results."""
    sections = [INSTRUCTIONS]
    if passages:
        sections.append(f"{SOURCES_HEADING}{SEPARATOR}{render_sources(passages)}")
    if personal:
        sections.append(f"{PERSONAL_HEADING} {personal}")
    if tool_runs:
        sections.append(f"{TOOLS_HEADING}\n{render_tool_results(tool_runs)}")
    return SEPARATOR.join(sections)


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
    content = system_prompt(passages, personal=personal, tool_runs=tool_runs)
    return [{"role": "system", "content": content}, *messages]
