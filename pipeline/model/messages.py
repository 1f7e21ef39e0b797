"""One way to read the text of chat messages, for the cache key, retrieval, routing and the
guardrails alike.

A message's content is a string or a list of parts. The part types the upstream renders as
text are ``TEXT_PARTS`` (``text``, and the ``input_text``/``output_text`` of newer clients);
the request schema refuses every other type, so nothing reaches the model that the guardrails
did not read. Text parts are joined with a newline, as vLLM joins them when it renders the chat
template, so two requests that the model sees identically read identically here too.
"""

from __future__ import annotations

from typing import Any, Final

TEXT_PARTS: Final = frozenset({"text", "input_text", "output_text"})


def is_text_part(part: Any) -> bool:
    if not isinstance(part, dict):
        return False
    kind = part.get("type")
    return isinstance(kind, str) and kind in TEXT_PARTS  # a dict or list is unhashable


def content_text(content: Any) -> str | None:
    """The text of a message's content; None when it holds parts that are not text."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        if not all(is_text_part(p) for p in content):
            return None
        return "\n".join(str(p.get("text") or "") for p in content)
    return None if content is not None else ""


def text_of(content: Any) -> str:
    """The text parts of a message's content, joined; other parts are left out."""
    if isinstance(content, list):
        content = [p for p in content if is_text_part(p)]
    return content_text(content) or ""


def last_user_text(messages: list[dict[str, Any]]) -> str:
    """The last user message's text (what retrieval searches for and the router reads)."""
    for message in reversed(messages):
        if message.get("role") == "user":
            return text_of(message.get("content"))
    return ""
