"""The input guardrails: before the cache, the caller's messages are checked against the
tenant's policy.

- PII (email, phone, card, IBAN, IP, national ids): per kind, block with a 400 whose code names
  the rule (``pii.email``), or redact: the messages are replaced by their redacted copies, so
  the cache key, the request log, retrieval, the spans and the model only ever see the tokens.
- Prompt injection in the user's messages (rules over the text as written and as decoded,
  de-obfuscated): blocked with a 400 naming the rule (``injection.override``), by default.
  The similarity of the query embedding to known attacks is checked later, in ``guard_similar``,
  where retrieval's embedding of the query is to hand and a cache hit has not paid for it.
- A maximum number of input tokens.

Decisions (rule, action, score) go on the span; the text never does.
"""

from __future__ import annotations

from dataclasses import replace
from functools import lru_cache
from typing import Any, NoReturn

from pipeline import attributes as attr
from pipeline.context import RequestContext
from pipeline.errors import InvalidRequest
from pipeline.guards.injection import InjectionDecision, InjectionDetector
from pipeline.guards.pii import find_pii, redact
from pipeline.guards.policy import GuardPolicy, PolicyBook
from pipeline.messages import text_of
from pipeline.runner import FailurePolicy
from pipeline.tokens import TokenCounter

CHECKED_ROLES = frozenset({"user"})
MEMO_CHARS = 2000


class Blocked(InvalidRequest):
    """A request refused by a guardrail; ``code`` names the rule."""

    def __init__(self, message: str, rule: str) -> None:
        super().__init__(message, param="messages", code=rule)


class GuardInput:
    name = "guard_in"
    reads = frozenset({"principal", "params"})
    writes = frozenset({"params", "key_parts"})
    policy: FailurePolicy = "fatal"

    def __init__(
        self, policies: PolicyBook, detector: InjectionDetector, counter: TokenCounter
    ) -> None:
        self.policies = policies
        self.detector = detector
        self.counter = counter
        # The rules are most of this stage's cost (~150 µs for a short question) and their
        # verdict depends on the text alone: a question asked again (a cache hit, most often)
        # is judged once. Short texts only, so the memo stays small.
        self._judged = lru_cache(maxsize=4096)(detector.check)

    def _injection(self, text: str) -> InjectionDecision:
        return self._judged(text) if len(text) <= MEMO_CHARS else self.detector.check(text)

    async def __call__(self, ctx: RequestContext) -> RequestContext:
        policy = self.policies.for_tenant(ctx.caller.tenant)
        ctx.key_parts["guard"] = policy.cache_token
        ctx.annotate(**{attr.GUARD_POLICY: policy.cache_token})
        self._check_length(ctx, policy)
        messages = [self._redacted(message, policy, ctx) for message in ctx.params.messages]
        if messages != ctx.params.messages:
            ctx.params = replace(ctx.params, messages=messages)
        if policy.injection == "block":
            self._check_injection(ctx)
        return ctx

    def _check_length(self, ctx: RequestContext, policy: GuardPolicy) -> None:
        texts = [text_of(m.get("content")) for m in ctx.params.messages]
        tokens = sum(self.counter.count_many(texts))
        ctx.annotate(**{attr.GUARD_INPUT_TOKENS: tokens})
        if tokens > policy.max_input_tokens:
            raise Blocked(
                f"The messages hold {tokens} tokens; this service accepts at most "
                f"{policy.max_input_tokens}.",
                "input_too_long",
            )

    def _redacted(
        self, message: dict[str, Any], policy: GuardPolicy, ctx: RequestContext
    ) -> dict[str, Any]:
        content = message.get("content")
        if isinstance(content, str):
            return {**message, "content": self._guard_text(content, policy, ctx)}
        if isinstance(content, list):
            parts = [
                {**p, "text": self._guard_text(str(p.get("text") or ""), policy, ctx)}
                if isinstance(p, dict) and p.get("type") == "text"
                else p
                for p in content
            ]
            return {**message, "content": parts}
        return message

    def _guard_text(self, text: str, policy: GuardPolicy, ctx: RequestContext) -> str:
        findings = find_pii(text)
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

    def _check_injection(self, ctx: RequestContext) -> None:
        for message in ctx.params.messages:
            if message.get("role") not in CHECKED_ROLES:
                continue
            decision = self._injection(text_of(message.get("content")))
            if decision.flagged:
                refuse_injection(ctx, decision)


def refuse_injection(ctx: RequestContext, decision: InjectionDecision) -> NoReturn:
    """Record a flagged decision (rule and score) on the stage and refuse the request with a 400
    whose code names the rule."""
    ctx.annotate(
        **{attr.GUARD_INJECTION_RULE: decision.rule, attr.GUARD_INJECTION_SCORE: decision.score}
    )
    raise Blocked(
        "The request looks like an attempt to override the assistant's instructions "
        f"({decision.rule}).",
        decision.rule or "injection",
    )
