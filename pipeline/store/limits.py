"""Rate limits shared by every replica: requests and tokens per minute, per API key and per tenant.

Each limit is a sliding-window log in Redis (a sorted set of the admitted requests, or of the
settled token counts with their running sum), checked and updated by one Lua script on Redis's
clock, so N replicas share one budget exactly and no replica's clock matters. A window holds
``rpm * window / 60`` requests (and the same share of ``tpm``): in any ``window`` seconds, never
more than that is admitted, however the load is spread over the replicas.

Tokens are settled after the answer (prompt + completion of a generated answer; a cache hit
costs none). Before that, once its body is read, a chat request holds an estimate of them
(``reserve``), which its settlement replaces: a request is admitted while the tokens of the
last window, answers' and the estimates of requests in flight, are under the limit, so the last
admitted request may take the window past it by its own tokens, and the next waits.

Where a limit comes from, first found wins (0 is "no limit"):

    key      the key record's ``rpm``/``tpm``  >  the tenant record's ``key_rpm``/``key_tpm``
             >  ``limits.tenants.<t>.key_rpm``  >  ``limits.key_rpm``
    tenant   the tenant record's ``rpm``/``tpm``  >  ``limits.tenants.<t>.rpm``  >
             ``limits.tenant_rpm``

The key record is read with the key (``pipeline.store.keys``); the tenant record
(``{prefix}limits:tenant:<t>``, set by ``rag keys tenant-limits``) is read by the script itself.
When Redis cannot be reached the limiter fails open (admits, and says so on the span and in
``rag_ratelimit_degraded_total``) or closed (a 429 with ``Retry-After``), as configured: never
a 5xx.
"""

from __future__ import annotations

import asyncio
import math
import secrets
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Final

from pipeline.context import Principal
from pipeline.errors import PipelineError, StoreUnavailable, retry_after
from pipeline.store.kv import KeyValueStore
from pipeline.telemetry import metrics

# The largest limit per minute: a larger one (the CLI took any integer; 2^63 wrapped to a
# negative number in the script's reply and dropped the x-ratelimit-* headers) counts as this.
MAX_PER_MINUTE: Final = 10**12
KINDS: Final = ("requests", "tokens")
SCOPES: Final = ("key", "tenant")

# KEYS: key requests, tenant requests, key tokens, tenant tokens, tenant record.
# ARGV: mode ('admit' | 'reserve' | 'settle'), window ms, member id, tokens (reserve, settle),
# then the four limits as passed by the caller ('' where the caller has none: the tenant record
# or the defaults decide), then the four defaults (key rpm, key tpm, tenant rpm, tenant tpm; per
# window), then (settle) the member of the request's reservation, '' if none.
# The scale (window / 60 s) turns a per-minute limit into a per-window one.
# Returns: {admitted (1/0), refused limit index (0 if none), retry ms, then per limit in the
# order key requests, tenant requests, key tokens, tenant tokens: limit, used, reset ms}.
_SCRIPT: Final = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local window = tonumber(ARGV[2])
local scale = window / 60000
local record = redis.call('HMGET', KEYS[5], 'key_rpm', 'key_tpm', 'rpm', 'tpm')
local limits = {}
for i = 1, 4 do
  local chosen = ARGV[4 + i]
  if chosen == '' then chosen = record[i] end
  if not chosen or chosen == '' then chosen = ARGV[8 + i] end
  -- At most MAX_PER_MINUTE: past 2^63 the reply's integers wrap to negative numbers.
  local per_minute = math.min(tonumber(chosen) or 0, 1e12)
  limits[i] = 0
  if per_minute > 0 then limits[i] = math.max(1, math.floor(per_minute * scale)) end
end
-- limits: 1 key rpm, 2 key tpm, 3 tenant rpm, 4 tenant tpm; logs: 1 key req, 2 tenant req,
-- 3 key tok, 4 tenant tok.
local limit_of = {limits[1], limits[3], limits[2], limits[4]}
local used = {}
local function prune(i)
  local log = KEYS[i]
  if i <= 2 then
    redis.call('ZREMRANGEBYSCORE', log, '-inf', now - window)
    return redis.call('ZCARD', log)
  end
  local sum_key = log .. ':sum'
  -- A log that expired took its tokens with it: a sum it outlived counts nothing (a release
  -- sets the sum's expiry anew, later than the log's).
  if redis.call('EXISTS', log) == 0 then
    redis.call('DEL', sum_key)
    return 0
  end
  local gone = redis.call('ZRANGEBYSCORE', log, '-inf', now - window)
  -- The sum caches the log's tokens. One this script cannot read (not a number, another
  -- type of key: another version's, or damage) is counted again from the log and rewritten,
  -- rather than failing the script, which would admit everything (fail open) until it expires.
  local stored = redis.pcall('GET', sum_key)  -- false when absent: 0; an error reply: a table
  local sum = stored == false and 0 or (type(stored) == 'string' and tonumber(stored) or nil)
  local recount = sum == nil
  if recount then
    sum = 0
    for _, member in ipairs(redis.call('ZRANGE', log, 0, -1)) do
      sum = sum + (tonumber(string.match(member, ':(%d+)$')) or 0)
    end
  end
  if #gone > 0 or recount then
    for _, member in ipairs(gone) do
      sum = sum - (tonumber(string.match(member, ':(%d+)$')) or 0)
    end
    redis.call('ZREMRANGEBYSCORE', log, '-inf', now - window)
    if sum < 0 or redis.call('ZCARD', log) == 0 then sum = 0 end
    redis.call('SET', sum_key, sum, 'PX', window)
  end
  return sum
end
for i = 1, 4 do
  if limit_of[i] > 0 then used[i] = prune(i) else used[i] = 0 end
end
local admitted = 1
local refused = 0
local retry = 0
-- Refuses the request when a limit in first..last is spent (or held by reservations): how
-- long until the oldest entries leave the window and free enough room.
local function check(first, last)
  for i = first, last do
    if limit_of[i] > 0 and used[i] >= limit_of[i] then
      local wait = window
      if i <= 2 then
        local rank = used[i] - limit_of[i]
        local oldest = redis.call('ZRANGE', KEYS[i], rank, rank, 'WITHSCORES')
        if #oldest > 0 then wait = tonumber(oldest[2]) + window - now end
      else
        local over = used[i] - limit_of[i]
        local entries = redis.call('ZRANGE', KEYS[i], 0, 999, 'WITHSCORES')
        for j = 1, #entries, 2 do
          over = over - (tonumber(string.match(entries[j], ':(%d+)$')) or 0)
          if over < 0 then wait = tonumber(entries[j + 1]) + window - now break end
        end
      end
      if admitted == 1 or wait > retry then retry = wait; refused = i end
      admitted = 0
    end
  end
end
-- Logs tokens (a reservation or an answer's) as member:tokens in the token logs.
local function add_tokens(member, tokens)
  for i = 3, 4 do
    if limit_of[i] > 0 then
      redis.call('ZADD', KEYS[i], now, member .. ':' .. tokens)
      redis.call('PEXPIRE', KEYS[i], window)
      used[i] = used[i] + tokens
      redis.call('SET', KEYS[i] .. ':sum', used[i], 'PX', window)
    end
  end
end
local tokens = tonumber(ARGV[4]) or 0
if ARGV[1] == 'admit' then
  check(1, 4)
  if admitted == 1 then
    for i = 1, 2 do
      if limit_of[i] > 0 then
        redis.call('ZADD', KEYS[i], now, ARGV[3])
        redis.call('PEXPIRE', KEYS[i], window)
        used[i] = used[i] + 1
      end
    end
  end
elseif ARGV[1] == 'reserve' then
  check(3, 4)
  if admitted == 1 and tokens > 0 then add_tokens(ARGV[3], tokens) end
else
  -- settle: the request's reservation (if still in the window) gives way to what it spent.
  local held = ARGV[13] or ''
  if held ~= '' then
    local reserved = tonumber(string.match(held, ':(%d+)$')) or 0
    for i = 3, 4 do
      if limit_of[i] > 0 and redis.call('ZREM', KEYS[i], held) == 1 then
        used[i] = math.max(0, used[i] - reserved)
        redis.call('SET', KEYS[i] .. ':sum', used[i], 'PX', window)
      end
    end
  end
  if tokens > 0 then add_tokens(ARGV[3], tokens) end
end
local reply = {admitted, refused, math.max(0, retry)}
for i = 1, 4 do
  local reset = 0
  if limit_of[i] > 0 and used[i] > 0 then
    local newest = redis.call('ZRANGE', KEYS[i], -1, -1, 'WITHSCORES')
    if #newest > 0 then reset = math.max(0, tonumber(newest[2]) + window - now) end
  end
  table.insert(reply, limit_of[i])
  table.insert(reply, used[i])
  table.insert(reply, reset)
end
return reply
"""

# The order of the script's limits: (scope, kind).
ORDER: Final = (
    ("key", "requests"),
    ("tenant", "requests"),
    ("key", "tokens"),
    ("tenant", "tokens"),
)


@dataclass(frozen=True)
class LimitConfig:
    """Deployment defaults, per minute (0: no limit), and what happens while Redis is down."""

    key_rpm: int = 0
    key_tpm: int = 0
    tenant_rpm: int = 0
    tenant_tpm: int = 0
    tenants: Mapping[str, Mapping[str, int]] = field(default_factory=dict)
    window_seconds: float = 60.0
    fail_open: bool = True

    def defaults(self, tenant: str) -> tuple[int, int, int, int]:
        """Key rpm, key tpm, tenant rpm, tenant tpm for ``tenant`` from the settings."""
        own = self.tenants.get(tenant, {})
        return (
            own.get("key_rpm", self.key_rpm),
            own.get("key_tpm", self.key_tpm),
            own.get("rpm", self.tenant_rpm),
            own.get("tpm", self.tenant_tpm),
        )


@dataclass(frozen=True)
class Usage:
    """One limit as it stands: its size per window, what the window holds, when it empties."""

    scope: str
    kind: str
    limit: int
    used: int
    reset_ms: int

    @property
    def remaining(self) -> int:
        return max(0, self.limit - self.used)


@dataclass(frozen=True)
class Decision:
    admitted: bool
    usages: tuple[Usage, ...] = ()
    refused: Usage | None = None
    retry_after_ms: int = 0
    degraded: bool = False  # Redis could not be asked; admitted only because the limiter fails open

    def headers(self) -> dict[str, str]:
        """OpenAI's ``x-ratelimit-*`` headers, for the tighter of the key's and the tenant's
        limit of each kind; none for a kind without a limit."""
        headers: dict[str, str] = {}
        for kind in KINDS:
            bound = [u for u in self.usages if u.kind == kind and u.limit > 0]
            if not bound:
                continue
            tight = min(bound, key=lambda u: (u.remaining, -u.reset_ms))
            headers[f"x-ratelimit-limit-{kind}"] = str(tight.limit)
            headers[f"x-ratelimit-remaining-{kind}"] = str(tight.remaining)
            headers[f"x-ratelimit-reset-{kind}"] = duration(tight.reset_ms)
        return headers


@dataclass(frozen=True)
class Reservation:
    """Tokens a request holds in its token windows until it is settled: the log's member,
    ``<id>:<tokens>`` as the script stores it (and reads the tokens back from)."""

    member: str


class RateLimited(PipelineError):
    """A 429: the key's or the tenant's budget of requests or tokens for the window is spent
    (``rate_limit_exceeded``), or, failing closed, it cannot be checked
    (``rate_limit_unavailable``)."""

    status_code = 429
    error_type = "rate_limit_error"


def tenant_record(kv: KeyValueStore, prefix: str, tenant: str) -> str:
    """The name of ``tenant``'s limits record (``prefix``: the service's key prefix)."""
    return f"{prefix}limits:tenant:{kv.tag(tenant)}"


def duration(ms: int) -> str:
    """A wait as OpenAI's headers write it: ``20ms``, ``1.5s``, ``6m0s``."""
    if ms < 1000:
        return f"{ms}ms"
    seconds = ms / 1000
    if seconds < 60:
        return f"{seconds:.3f}".rstrip("0").rstrip(".") + "s"
    minutes, rest = divmod(round(seconds), 60)
    return f"{minutes}m{rest}s"


class RateLimiter:
    def __init__(
        self,
        kv: KeyValueStore,
        config: LimitConfig,
        *,
        prefix: str = "rag:",
        record_ttl: float = 1.0,
    ) -> None:
        self.kv = kv
        self.config = config
        self.prefix = f"{prefix}ratelimit:"
        self.key_prefix = prefix
        self.window_ms = max(1, int(config.window_seconds * 1000))
        self.record_ttl = record_ttl
        self._records: dict[str, tuple[float, dict[str, str]]] = {}
        self._refreshing: set[str] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        self._script = kv.script(_SCRIPT)

    def _keys(self, principal: Principal) -> list[str]:
        # A key's logs name its tenant's slot on a cluster, beside the tenant's logs and record
        # (the script uses all five and their sums).
        key = f"{self.prefix}key:{self.kv.slot(principal.tenant)}{principal.key_id}"
        tenant = f"{self.prefix}tenant:{self.kv.tag(principal.tenant)}"
        return [
            f"{key}:req",
            f"{tenant}:req",
            f"{key}:tok",
            f"{tenant}:tok",
            self.tenant_record(principal.tenant),
        ]

    def tenant_record(self, tenant: str) -> str:
        return tenant_record(self.kv, self.key_prefix, tenant)

    async def admit(self, principal: Principal) -> Decision:
        """Admit one request of ``principal`` or say why not; never raises for Redis."""
        try:
            if not await self._limited(principal):
                return Decision(admitted=True)  # nothing to count: no script, no headers
            reply = await self._run("admit", principal, 0)
        except StoreUnavailable as exc:
            return self._unchecked(exc)
        decision = _decision(reply)
        if decision.refused is not None:
            metrics.ratelimit_refused(decision.refused.scope, decision.refused.kind)
        return decision

    def _unchecked(self, exc: StoreUnavailable) -> Decision:
        """The decision when Redis cannot be asked: admitted failing open, else refused."""
        mode = "open" if self.config.fail_open else "closed"
        metrics.ratelimit_degraded(mode)
        if self.config.fail_open:
            return Decision(admitted=True, degraded=True)
        return Decision(
            admitted=False, degraded=True, retry_after_ms=math.ceil(exc.retry_after_s * 1000)
        )

    async def _limited(self, principal: Principal, kinds: tuple[int, ...] = (0, 1)) -> bool:
        """Whether any limit of ``kinds`` (0 requests, 1 tokens) applies to ``principal``. The
        tenant record is read again at most once a second per tenant (a change made with
        ``rag keys tenant-limits`` applies within about a second where no other limit applied
        before)."""
        own = (principal.rpm, principal.tpm)
        if any(own[kind] for kind in kinds):
            return True
        defaults = self.config.defaults(principal.tenant)
        record = await self._tenant_record(principal.tenant)
        for kind in kinds:
            name = ("rpm", "tpm")[kind]
            key = own[kind]
            if key is None:
                key = int(record.get(f"key_{name}", 0) or defaults[kind])
            if key or int(record.get(name, 0) or defaults[2 + kind]):
                return True
        return False

    async def _tenant_record(self, tenant: str) -> dict[str, str]:
        """The tenant record as last read: read on first use, and again in the background once
        the copy is ``record_ttl`` old, so a slow Redis never holds a request for it
        (``record_ttl`` 0: read every time)."""
        cached = self._records.get(tenant)
        if cached is None or self.record_ttl <= 0:
            return await self._read_record(tenant)
        if time.monotonic() - cached[0] >= self.record_ttl and tenant not in self._refreshing:
            self._refreshing.add(tenant)
            task = asyncio.get_running_loop().create_task(self._refresh(tenant))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        return cached[1]

    async def aclose(self) -> None:
        """Wait for the tenant records being read again (before the store is closed)."""
        if self._tasks:
            await asyncio.wait(set(self._tasks), timeout=2.0)

    async def _refresh(self, tenant: str) -> None:
        try:
            await self._read_record(tenant)
        except StoreUnavailable:
            metrics.ratelimit_degraded("record_stale")  # the last copy stays in use
        finally:
            self._refreshing.discard(tenant)

    async def _read_record(self, tenant: str) -> dict[str, str]:
        fields = await self.kv.hgetall(self.tenant_record(tenant))
        record = {}
        for name, value in fields.items():
            try:
                record[name.decode()] = str(max(0, int(value)))
            except ValueError:
                continue  # a damaged field: the settings' default applies
        if len(self._records) >= 10_000:
            self._records.clear()
        self._records[tenant] = (time.monotonic(), record)
        return record

    async def reserve(
        self, principal: Principal, tokens: int
    ) -> tuple[Decision, Reservation | None]:
        """Hold ``tokens`` (a request's estimate, read from its body) in the key's and the
        tenant's token windows until the request is settled, or say why not: refused while
        what the window holds, answers and reservations, is at a limit. So the requests in
        flight when a key reaches its limit no longer all go through: the window goes past a
        limit by the last admitted request's estimate, and by what answers spend beyond their
        estimates. No script runs where no token limit applies; never raises for Redis."""
        try:
            if tokens <= 0 or not await self._limited(principal, kinds=(1,)):
                return Decision(admitted=True), None
            member = secrets.token_hex(8)
            reply = await self._run("reserve", principal, tokens, member=member)
        except StoreUnavailable as exc:
            return self._unchecked(exc), None
        decision = _decision(reply)
        if decision.refused is not None:
            metrics.ratelimit_refused(decision.refused.scope, decision.refused.kind)
            return decision, None
        return decision, Reservation(f"{member}:{tokens}")

    async def settle(
        self, principal: Principal, tokens: int, reservation: Reservation | None = None
    ) -> None:
        """Charge an answer's tokens to the key and the tenant, in place of the request's
        ``reservation``; lost (logged in the metric) when Redis cannot be reached (a
        reservation then leaves the window with its time)."""
        if tokens <= 0 and reservation is None:
            return
        try:
            await self._run(
                "settle", principal, tokens, held=reservation.member if reservation else ""
            )
        except StoreUnavailable:
            metrics.ratelimit_degraded("settle_lost")

    async def _run(
        self,
        mode: str,
        principal: Principal,
        tokens: int,
        *,
        member: str | None = None,
        held: str = "",
    ) -> list[int]:
        config = self.config
        member = member or secrets.token_hex(8)
        own = (
            "" if principal.rpm is None else principal.rpm,
            "" if principal.tpm is None else principal.tpm,
        )
        reply = await self.kv.run_script(
            "ratelimit",
            self._script,
            self._keys(principal),
            [
                mode,
                self.window_ms,
                member,
                tokens,
                *own,
                "",
                "",
                *config.defaults(principal.tenant),
                held,
            ],
        )
        return [int(value) for value in reply]


def refusal(decision: Decision, window_seconds: float = 60.0) -> RateLimited:
    """The 429 for a refused decision, with ``Retry-After`` and the limit headers."""
    headers = {**decision.headers(), **retry_after(decision.retry_after_ms / 1000)}
    refused = decision.refused
    if refused is None:
        return RateLimited(
            "Rate limits cannot be checked right now; retry later.",
            code="rate_limit_unavailable",
            headers=headers,
        )
    whose = "this API key" if refused.scope == "key" else "this tenant"
    return RateLimited(
        f"Rate limit reached for {refused.kind} of {whose}: {refused.limit} per "
        f"{window_seconds:g} s. Retry after the time in the Retry-After header.",
        code="rate_limit_exceeded",
        headers=headers,
    )


def _decision(reply: list[int]) -> Decision:
    admitted, refused_index, retry_ms = reply[0], reply[1], reply[2]
    usages = tuple(
        Usage(scope, kind, reply[3 + 3 * i], reply[4 + 3 * i], reply[5 + 3 * i])
        for i, (scope, kind) in enumerate(ORDER)
    )
    return Decision(
        admitted=bool(admitted),
        usages=usages,
        refused=usages[refused_index - 1] if refused_index else None,
        retry_after_ms=retry_ms,
    )
