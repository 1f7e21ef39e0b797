"""The built-in tools that need no network: calculator, clock, the user's profile, and a search
over the caller's own documents.

The profile and the search act for the caller only: the tenant and the user come from the
request's principal (through ``ToolContext``), never from the arguments a model wrote, and the
search's schema has no property that could name another tenant.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Final

from pipeline.tools.base import Tool, ToolContext
from pipeline.tools.calculator import calculator_tool
from pipeline.tools.clock import clock_tool

if TYPE_CHECKING:
    from pipeline.sources.search import PassageSearch

MAX_SEARCH_RESULTS: Final = 10
SNIPPET_CHARS: Final = 240
PROFILE_TTL: Final = 60  # real-time features (requests in the last hour) change within minutes


def _show(value: Any) -> str:
    if isinstance(value, list | tuple | set | frozenset):
        return ", ".join(str(v) for v in value) or "none"
    return str(value)


async def _profile(arguments: dict[str, Any], context: ToolContext) -> str:
    features = await context.features()
    known = {
        name: value
        for name, value in sorted(features.values.items())
        if name not in features.defaulted and value not in (None, "")
    }
    if not known:
        return "Nothing is known about this user's profile yet (every feature is at its default)."
    lines = [f"- {name}: {_show(value)}" for name, value in known.items()]
    version = f" (feature set {features.version})" if features.version else ""
    return "The user's profile" + version + ":\n" + "\n".join(lines)


def profile_tool(*, timeout_s: float = 1.0, max_concurrency: int = 64) -> Tool:
    return Tool(
        name="profile",
        description="The calling user's profile: plan, language, usage and other features.",
        parameters={"type": "object", "properties": {}, "additionalProperties": False},
        function=_profile,
        timeout_s=timeout_s,
        max_concurrency=max_concurrency,
        cache_ttl=PROFILE_TTL,
    )


def _snippet(text: str) -> str:
    flat = " ".join(text.split())
    return flat if len(flat) <= SNIPPET_CHARS else flat[:SNIPPET_CHARS].rsplit(" ", 1)[0] + " …"


def search_tool(
    search: PassageSearch, *, timeout_s: float = 5.0, max_concurrency: int = 16
) -> Tool:
    """A search of the caller's documents (``PassageSearch``, the app's one)."""
    # Here, not at the top: the settings read BUILTIN_TOOL_NAMES from this module to check
    # RAG_TOOLS__TENANTS, and a `rag keys` command should not load retrieval for that. A caller
    # with a `search` has the module loaded already.
    from pipeline.sources.search import viewer_of

    async def run(arguments: dict[str, Any], context: ToolContext) -> str:
        tenant = context.principal.tenant  # the caller's, never an argument
        query = str(arguments["query"])
        if not search.has_index(tenant):
            return "The caller has no documents indexed yet."
        result = await search.search(
            tenant,
            query,
            top_k=int(arguments.get("top_k", 5)),
            viewer=viewer_of(context.principal),  # the caller's access lists, as in retrieve
            # Callers of one memo scope searching for the same text at once share an embedding.
            embed_scope=search.memo_scope(context.principal),
        )
        context.index_versions.add(result.version)  # checked against the cache key's
        if not result.hits:
            return f"No passage of the caller's documents matches {query[:80]!r}."
        lines = [
            f"[{hit.document_id}] {hit.title + ': ' if hit.title else ''}{_snippet(hit.text)}"
            for hit in result.hits
        ]
        return "\n".join(lines)

    return Tool(
        name="search_documents",
        description="Search the caller's own documents; returns ids, titles and short snippets.",
        parameters={
            "type": "object",
            "properties": {
                "query": {"type": "string", "minLength": 1, "maxLength": 1000},
                "top_k": {"type": "integer", "minimum": 1, "maximum": MAX_SEARCH_RESULTS},
            },
            "required": ["query"],
            "additionalProperties": False,
        },
        function=run,
        timeout_s=timeout_s,
        max_concurrency=max_concurrency,
    )


# Every built-in's name (the search only exists with retrieval), for settings that name tools.
BUILTIN_TOOL_NAMES = ("calculator", "clock", "profile", "search_documents")


def builtin_tools(
    search: PassageSearch | None = None, *, timeout_s: float = 2.0, max_concurrency: int = 64
) -> list[Tool]:
    """The built-ins; the search only when there is retrieval to search with."""
    tools = [
        calculator_tool(timeout_s=timeout_s, max_concurrency=max_concurrency),
        clock_tool(timeout_s=timeout_s, max_concurrency=max_concurrency),
        profile_tool(timeout_s=timeout_s, max_concurrency=max_concurrency),
    ]
    if search is not None:
        tools.append(search_tool(search, timeout_s=timeout_s, max_concurrency=max_concurrency))
    return tools
