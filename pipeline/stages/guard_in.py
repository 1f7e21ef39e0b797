"""The input guardrails: before the cache, every text the model will read is checked against
the tenant's policy, whatever the message's role (system and developer messages included),
whichever text part carries it (``pipeline.model.messages.TEXT_PARTS``; the schema refuses the
others), and the names and arguments of earlier tool calls too.

- Size first, cheaply: at most ``max_input_chars`` characters (it bounds every check below,
  whatever the tokenizer makes of the text: 40,000 newlines are a handful of tokens) and
  ``max_input_tokens`` tokens, counted over everything.
- PII (email, phone, card, IBAN, IP, national ids): per kind, block with a 400 whose code names
  the rule (``pii.email``), or redact: the messages are replaced by their redacted copies, so
  the cache key, the request log, retrieval, the spans and the model only ever see the tokens.
  Tool-call arguments are JSON: their string values are redacted, so they stay JSON.
- Prompt injection (rules over the text as written and as decoded, de-obfuscated): blocked with
  a 400 naming the rule (``injection.override``), by default, in every role. System and
  developer messages (usually the tenant's own) are judged by the rules that mean an attack
  even there, unless the tenant's policy says otherwise (``GuardPolicy.system_messages``). The
  similarity of the query embedding to known attacks is checked later, in
  ``guard_similarity``, where retrieval's embedding of the query is to hand.

A request with more than ``OFFLOAD_CHARS`` of text is checked in a worker thread, so a large
request holds the event loop no longer than a small one. Decisions (rule, action, score) go on
the span; the text never does.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import Any, Generic, NoReturn, TypeVar

import orjson

from pipeline.context import ChatParams, RequestContext
from pipeline.errors import InvalidRequest
from pipeline.guards.injection import InjectionDecision, InjectionDetector, decide
from pipeline.guards.pii import PiiFinding, find_pii, redact
from pipeline.guards.policy import GuardPolicy, PolicyBook
from pipeline.kept import Kept
from pipeline.model.messages import is_text_part
from pipeline.model.salt import MemoScope
from pipeline.model.tokens import TokenCounter
from pipeline.runner import StageSpec
from pipeline.telemetry import attributes as attr

MEMO_CHARS = 256  # longer texts are remembered by a digest
# PII findings the memo keeps in all (~150 bytes each: ~10 MB), whatever the texts hold; and
# the injection rules' signals (~150 bytes each: a text can fire 300, 48 KB).
MEMO_FINDINGS = 65_536
MEMO_SIGNALS = 65_536
OFFLOAD_CHARS = 8192
OPERATOR_ROLES = frozenset({"system", "developer"})
OPERATOR_ATTACKS = frozenset(
    {
        "injection.role_marker",
        "injection.delimiter",
        "injection.encoded",
        "injection.persona",
        "injection.new_instructions",
    }
)
# Letters-only and de-leeted views: an attack only where the plain text hid the phrase.
OBFUSCATED_VIEWS = frozenset({"compact", "leet"})

Message = dict[str, Any]
T = TypeVar("T")


class Blocked(InvalidRequest):
    """A request refused by a guardrail; ``code`` names the rule."""

    def __init__(self, message: str, rule: str, param: str = "messages") -> None:
        super().__init__(message, param=param, code=rule)


def message_texts(message: Message) -> Iterator[str]:
    """Every text of a message the model reads: content (string or text parts), the author's
    name, and the names and arguments of the tool calls it holds."""
    content = message.get("content")
    if isinstance(content, str):
        yield content
    elif isinstance(content, list):
        yield from (str(p.get("text") or "") for p in content if is_text_part(p))
    if isinstance(message.get("name"), str):
        yield message["name"]
    for call in message.get("tool_calls") or ():
        function = call.get("function") if isinstance(call, dict) else None
        if isinstance(function, dict):
            yield from (str(function.get(k) or "") for k in ("name", "arguments"))


def map_texts(message: Message, change: Callable[[str], str]) -> Message:
    """A copy of ``message`` with ``change`` applied to every text the model reads (tool-call
    arguments through ``map_json_strings``, so they stay JSON)."""
    out = dict(message)
    content = message.get("content")
    if isinstance(content, str):
        out["content"] = change(content)
    elif isinstance(content, list):
        out["content"] = [
            {**p, "text": change(str(p.get("text") or ""))} if is_text_part(p) else p
            for p in content
        ]
    if isinstance(message.get("name"), str):
        out["name"] = change(message["name"])
    if message.get("tool_calls"):
        calls = []
        for call in message["tool_calls"]:
            function = dict(call.get("function") or {})
            if isinstance(function.get("arguments"), str):
                function["arguments"] = map_json_strings(function["arguments"], change)
            calls.append({**call, "function": function})
        out["tool_calls"] = calls
    return out


def tool_texts(tool: dict[str, Any]) -> Iterator[str]:
    """Every text of a function the caller offers that the model reads (chat templates render
    the tools into the prompt): its name, its description, every string of its schema."""
    function = tool.get("function")
    if not isinstance(function, dict):
        return
    for field in ("name", "description"):
        if isinstance(function.get(field), str):
            yield function[field]
    stack = [function.get("parameters")]
    while stack:
        value = stack.pop()
        if isinstance(value, str):
            yield value
        elif isinstance(value, dict):
            yield from (k for k in value if isinstance(k, str))
            stack.extend(value.values())
        elif isinstance(value, list):
            stack.extend(value)


def map_tool(tool: dict[str, Any], change: Callable[[str], str]) -> dict[str, Any]:
    """A copy of an offered function with ``change`` applied to its description and the
    strings of its schema (its name is an identifier: ``[A-Za-z0-9_-]``, checked for attacks,
    never rewritten)."""
    function = tool.get("function")
    if not isinstance(function, dict):
        return tool
    out = dict(function)
    if isinstance(function.get("description"), str):
        out["description"] = change(function["description"])
    if function.get("parameters") is not None:
        out["parameters"], _ = _map_strings(function["parameters"], change)
    return {**tool, "function": out}


def all_texts(params: ChatParams) -> Iterator[str]:
    """Every text of a request the model reads: its messages' and its offered functions'."""
    for message in params.messages:
        yield from message_texts(message)
    for tool in params.tools:
        yield from tool_texts(tool)


def map_json_strings(text: str, change: Callable[[str], str]) -> str:
    """``change`` applied to every string (keys and values) of JSON ``text``; ``text`` that is
    not JSON, or nested too deeply to write back as JSON, is changed as a whole."""
    try:
        value = orjson.loads(text)
    except orjson.JSONDecodeError:
        return change(text)
    changed, any_change = _map_strings(value, change)
    if not any_change:
        return text
    try:
        return orjson.dumps(changed).decode()
    except orjson.JSONEncodeError:  # deeper than orjson writes (it reads deeper than it writes)
        return change(text)


def _map_strings(value: Any, change: Callable[[str], str]) -> tuple[Any, bool]:
    """A copy of a parsed JSON value with ``change`` applied to its strings, and whether any
    changed. Iterative: arguments arrive as a string, which the body's depth limit does not see
    into (a 1.3 KB body nested 500 levels deep made the recursive version raise)."""
    root: list[Any] = [None]
    stack: list[tuple[Any, Any, Any]] = [(value, root, 0)]
    changed = False
    while stack:
        source, parent, key = stack.pop()
        out: Any
        if isinstance(source, str):
            out = change(source)
            changed = changed or out != source
        elif isinstance(source, list):
            out = [None] * len(source)
            stack.extend((item, out, index) for index, item in enumerate(source))
        elif isinstance(source, dict):
            out = {}
            for name, item in source.items():
                new_name = change(name)
                changed = changed or new_name != name
                out[new_name] = None
                stack.append((item, out, new_name))
        else:
            out = source
        parent[key] = out
    return root[0], changed


class TextMemo(Generic[T]):
    """What ``compute`` made of each of the last ``size`` texts, kept by the text itself when
    short and by a 128-bit digest of it when longer (so the memo holds no long text), with at
    most ``budget`` of the values' ``weight`` in all (``pipeline.kept``: a PII scan's findings,
    of which 4,096 texts packed with addresses kept 0.35 GB). Safe to call from the event loop
    and a worker thread at once.

    Entries are per memo scope (``pipeline.model.salt.MemoScope``: the tenant, and the access
    scope where its index has access lists): a request never finds another scope's, so how
    fast it is judged says nothing of what other tenants, or callers who may see what it may
    not, sent. ``compute`` is given the text and its scope."""

    def __init__(
        self,
        compute: Callable[[str, str], T],
        size: int = 4096,
        *,
        weight: Callable[[T], int] | None = None,
        budget: int | None = None,
    ) -> None:
        self.compute = compute
        self.weight = weight
        self.kept: Kept[tuple[str, str | bytes], T] = Kept(size, budget=budget)

    def __call__(self, text: str, scope: str) -> T:
        key: tuple[str, str | bytes] = (scope, text)
        if len(text) > MEMO_CHARS:
            raw = text.encode("utf-8", "surrogatepass")  # a JSON string may hold lone surrogates
            key = (scope, hashlib.blake2b(raw, digest_size=16).digest())
        return self.kept.remembered(key, lambda: self.compute(text, scope), self.weight)


class GuardInput:
    spec = StageSpec.of("guard_in", reads={"principal", "params"}, writes={"params", "key_parts"})

    def __init__(
        self,
        policies: PolicyBook,
        detector: InjectionDetector,
        counter: TokenCounter,
        memo_scope: MemoScope,
    ) -> None:
        self.policies = policies
        self.detector = detector
        self.counter = counter
        self.memo_scope = memo_scope  # whose memo a request's verdicts go in
        # The rules and the PII scan are most of this stage's cost (~150 µs for a short
        # question, ~1.7 ms for 2,400 characters) and their verdicts depend on the text alone:
        # a text seen again (an application's system prompt on every request, a conversation's
        # earlier turns, a question asked again) is judged once.
        self._judged: TextMemo[InjectionDecision] = TextMemo(
            lambda text, _: detector.check(text),
            weight=lambda decision: len(decision.signals),
            budget=MEMO_SIGNALS,
        )
        self._pii: TextMemo[tuple[PiiFinding, ...]] = TextMemo(
            lambda text, _: tuple(find_pii(text)), weight=len, budget=MEMO_FINDINGS
        )
        # The length check's token counts too: the biggest share of a request's own CPU in a
        # profile once the verdicts were kept (a regex pass over every prompt's text).
        self._tokens: TextMemo[int] = TextMemo(
            lambda text, scope: counter.for_scope(scope).count(text)
        )

    async def __call__(self, ctx: RequestContext) -> RequestContext:
        policy = self.policies.for_tenant(ctx.caller.tenant)
        ctx.key_parts["guard"] = policy.cache_token
        ctx.annotate(**{attr.GUARD_POLICY: policy.cache_token})
        chars = sum(len(t) for t in all_texts(ctx.params))
        if chars > policy.input_chars:
            raise Blocked(
                f"The messages and tools hold {chars} characters; this service accepts at most "
                f"{policy.input_chars}.",
                "input_too_long",
            )
        scope = self.memo_scope(ctx.caller)
        if chars > OFFLOAD_CHARS:
            await asyncio.to_thread(self._check, ctx, policy, scope)
        else:
            self._check(ctx, policy, scope)
        return ctx

    def _check(self, ctx: RequestContext, policy: GuardPolicy, scope: str) -> None:
        self._check_length(ctx, policy, scope)

        def guard(text: str) -> str:
            return self._guard_text(text, policy, ctx, scope)

        messages = [map_texts(m, guard) for m in ctx.params.messages]
        tools = [map_tool(t, guard) for t in ctx.params.tools]
        if messages != ctx.params.messages or tools != ctx.params.tools:
            ctx.params = replace(ctx.params, messages=messages, tools=tools)
        if policy.injection == "block":
            self._check_injection(ctx, policy, scope)

    def _check_length(self, ctx: RequestContext, policy: GuardPolicy, scope: str) -> None:
        tokens = sum(self._tokens(text, scope) for text in all_texts(ctx.params))
        ctx.annotate(**{attr.GUARD_INPUT_TOKENS: tokens})
        if tokens > policy.max_input_tokens:
            raise Blocked(
                f"The messages and tools hold {tokens} tokens; this service accepts at most "
                f"{policy.max_input_tokens}.",
                "input_too_long",
            )

    def _guard_text(self, text: str, policy: GuardPolicy, ctx: RequestContext, scope: str) -> str:
        findings = self._pii(text, scope)
        if not findings:
            return text
        verdict = policy.pii_verdict(findings)
        ctx.annotate(
            **{
                attr.GUARD_PII_KINDS: sorted({f.kind for f in findings}),
                attr.GUARD_PII_ACTION: verdict.action,
            }
        )
        if verdict.action == "block":
            raise Blocked(
                f"The request holds personal data this service does not accept ({verdict.rule}).",
                verdict.rule or "pii",
            )
        return redact(text, verdict.redact) if verdict.redact else text

    def _check_injection(self, ctx: RequestContext, policy: GuardPolicy, scope: str) -> None:
        # Offered functions are the application's, as system messages are, and are exempt when
        # those are; but no rule reads an operator's own policy there ("never reveal..."), so
        # every rule judges them.
        if policy.system_messages != "off":
            for index, tool in enumerate(ctx.params.tools):
                for text in tool_texts(tool):
                    decision = self._judged(text, scope)
                    if decision.flagged:
                        refuse_injection(ctx, decision, param=f"tools.{index}")
        for index, message in enumerate(ctx.params.messages):
            operator = message.get("role") in OPERATOR_ROLES
            if operator and policy.system_messages == "off":
                continue
            for text in message_texts(message):
                decision = self._judged(text, scope)
                if operator and policy.system_messages == "attacks":
                    decision = attacks_only(decision, self.detector.threshold)
                if decision.flagged:
                    refuse_injection(ctx, decision, param=f"messages.{index}")


def attacks_only(decision: InjectionDecision, threshold: float) -> InjectionDecision:
    """The decision on the signals that mean an attack even in an operator's own prompt:
    template markers, fake delimiters, jailbreak personas, injected "new instructions", and
    anything found in a smuggled view of the text (decoded; or de-obfuscated, where the plain
    text said nothing)."""
    if not decision.signals:
        return decision
    plain = {s.rule for s in decision.signals if s.view == "plain"}
    kept = [
        s
        for s in decision.signals
        if (s.rule in OPERATOR_ATTACKS and s.view == "plain")
        or (s.view in OBFUSCATED_VIEWS and not plain)
        or (s.view != "plain" and s.view not in OBFUSCATED_VIEWS)
    ]
    return decide(kept, threshold, decision.similarity)


def refuse_injection(
    ctx: RequestContext, decision: InjectionDecision, param: str = "messages"
) -> NoReturn:
    """Record a flagged decision (rule and score) on the stage and refuse the request with a 400
    whose code names the rule."""
    ctx.annotate(
        **{attr.GUARD_INJECTION_RULE: decision.rule, attr.GUARD_INJECTION_SCORE: decision.score}
    )
    raise Blocked(
        "The request looks like an attempt to override the assistant's instructions "
        f"({decision.rule}).",
        decision.rule or "injection",
        param,
    )
