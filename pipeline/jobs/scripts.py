"""The queue's Lua scripts: each state change of a job is one script, so it is atomic in Redis.

A Redis script is not rolled back when one of its commands fails, so each script does first
the command that can fail (XLEN, XADD on a key of the wrong type) and writes the job record
after it; a sorted set of the waiting lines found holding another type is damage, deleted
(logged by Redis) before it is written (``own_zset``), never a failure halfway. Every state
change after ``start`` checks the caller's lease: a worker whose job was taken over after the
visibility timeout can no longer write a result, so each job has at most one result.

Keys a script reaches beyond its ``KEYS`` are built from ``base`` (``{prefix}{jobs}:``), so they
share the ``{jobs}`` hash tag and live in the same Redis Cluster slot.

A value read back from Redis may have been written by another version, or damaged: a number
that does not parse, or reads as NaN, takes a default (``num(x, d)``; a nil in a comparison
would fail the script, and with it every call for that job, and ZADD refuses a NaN), and the
scripts that look at many jobs at once (the sweep, listings) read each with ``redis.pcall``, so
one key of the wrong type does not stop them for every tenant (``SETTLE_KEY`` too).

A queued job sits in two sorted sets scored by the time it expires (``queued``, for the sweep,
and ``queued:{tenant}``, for the tenant's limit and for revoking a key), from submit (or
requeue) until a worker starts it or it is cancelled or settled.

A job its key's token window had no room for waits outside the stream, in its key's *waiting
line* (``waiting:{line}``, scored by when the job was created: first come, first served;
``line`` is ``k:{key id}``, or ``t:{tenant}`` for a job stored without one), its record saying
which (``parked``) and naming no entry; while it waits it sits in ``parked`` (scored by its
expiry, for the sweep) instead of ``queued``, so the sweep's look for entries gone is never
blind behind it. ``waiting-lines`` scores each line by when its head may be let out (Redis's
clock: ``TIME``): after a refusal, when the window has room (``Retry-After``); while jobs are
out, a fallback time should their workers never say how they went. Letting a job out puts it
back in the stream (``promoted``, naming its line: it passes ``start`` although the line is not
empty). Once a job let out holds its tokens, or ends, its worker lets the next two out
(``NEXT``): a line whose window has room drains in doubling steps, even behind a backlog of
other work in the stream, and a line without room costs a try or two per ``Retry-After``. A job
of a key whose line is not empty joins it at ``start`` instead of running ahead of it. The
sweep puts every waiting job it looks at back in its line and the line on the schedule, should
either have been lost. No XADD trims (``MAXLEN``) except submit's, which refuses at the cap
before it could: a job already accepted never drops another's entry.
"""

from __future__ import annotations

from typing import Final

# Helpers shared by the scripts below (prepended to those that use them).
_HELPERS: Final = """
local function drop_entry(stream, group, entry)
  if entry and entry ~= '' then
    redis.call('XACK', stream, group, entry)
    redis.call('XDEL', stream, entry)
  end
end

-- The job's fields, or nil when its key holds something else than a hash (WRONGTYPE).
local function fields_of(job, ...)
  local h = redis.pcall('HMGET', job, ...)
  if h.err then return nil end
  return h
end

-- Out of every queued set: it runs, or will never run. A job let out of its waiting line that
-- never runs lets the next out at once (score 0: due).
local function unqueue(base, job, id)
  redis.call('ZREM', base .. 'queued', id)
  redis.call('ZREM', base .. 'parked', id)
  local h = redis.call('HMGET', job, 'tenant', 'parked', 'promoted')
  if h[1] then redis.call('ZREM', base .. 'queued:' .. h[1], id) end
  if h[2] then
    redis.pcall('ZREM', base .. 'waiting:' .. h[2], id)
    redis.call('HDEL', job, 'parked')
  end
  if h[3] then
    redis.pcall('ZADD', base .. 'waiting-lines', 'XX', 0, h[3])
    redis.call('HDEL', job, 'promoted')
  end
end

-- A key of the waiting lines holding something else than a sorted set is damage: deleted, so
-- that writing it cannot fail a script halfway (whatever waited in it is found again by the
-- sweep, from the jobs' own records).
local function own_zset(key)
  local t = redis.call('TYPE', key).ok
  if t ~= 'zset' and t ~= 'none' then
    redis.log(redis.LOG_WARNING, 'rag jobs: ' .. key .. ' held a ' .. t .. ', deleted')
    redis.call('DEL', key)
  end
end

-- A number read back from a record, `d` where it does not parse or is NaN (Lua's tonumber
-- reads 'nan', and ZADD refuses it as a score).
local function num(x, d)
  local n = tonumber(x)
  if n == nil or n ~= n then return d end
  return n
end

-- Seconds on Redis's clock: the lines' times never depend on the workers' clocks.
local function now_s()
  local t = redis.call('TIME')
  return tonumber(t[1]) + tonumber(t[2]) / 1000000
end

-- The waiting line of a job's key (its tenant's for a job stored without a key id).
local function line_of(key_id, tenant)
  if key_id and key_id ~= '' then return 'k:' .. key_id end
  return 't:' .. (tenant or '')
end

-- Let the oldest job still waiting in `line` out into the stream; the line is then due again
-- `fallback` seconds later (its worker lets the next out sooner). Jobs no longer waiting
-- (cancelled, settled) are dropped on the way; an empty line is forgotten. Returns 1 when a
-- job went out, else 0. Its callers have made sure `waiting-lines` is a sorted set.
local function let_out(base, line, fallback)
  local waiting = base .. 'waiting:' .. line
  local lines = base .. 'waiting-lines'
  own_zset(waiting)
  local out = 0
  for _ = 1, 100 do
    local head = redis.call('ZPOPMIN', waiting)
    if #head == 0 then
      redis.call('ZREM', lines, line)
      return 0
    end
    local job = base .. 'job:' .. head[1]
    local h = fields_of(job, 'status', 'parked', 'expires')
    if h and h[1] == 'queued' and h[2] == line then
      local entry = redis.call('XADD', base .. 'stream', '*', 'id', head[1])
      local expires = num(redis.call('ZSCORE', base .. 'parked', head[1]), num(h[3], 0))
      redis.call('HSET', job, 'entry', entry, 'promoted', line)
      redis.call('HDEL', job, 'parked')
      redis.call('ZREM', base .. 'parked', head[1])
      redis.call('ZADD', base .. 'queued', expires, head[1])
      out = 1
      break
    end
  end
  redis.call('ZADD', lines, now_s() + tonumber(fallback), line)  -- (100 gone: the rest later)
  return out
end

-- A queued job that will never run: failed with `err`, its entry acknowledged and deleted.
-- A job with a webhook gets a fresh entry (XADD first: it is what can fail), through which a
-- worker delivers it; returns true then.
local function settle(base, group, job, id, now, ttl, err)
  local stream = base .. 'stream'
  local owed = redis.call('HEXISTS', job, 'webhook_url') == 1
  local fresh = false
  if owed then
    fresh = redis.call('XADD', stream, '*', 'id', id)  -- replaces its entry: trims no one
  end
  drop_entry(stream, group, redis.call('HGET', job, 'entry'))
  redis.call('HSET', job, 'status', 'failed', 'finished', now, 'error', err, 'lease', '')
  unqueue(base, job, id)
  if owed then
    redis.call('HSET', job, 'webhook_state', 'pending', 'entry', fresh)
    return true
  end
  redis.call('HDEL', job, 'entry')
  redis.call('EXPIRE', job, ttl)
  return false
end
"""

# KEYS: job, stream, tenant index, idempotency key, user index, queued, tenant's queued
# ARGV: 1 id, 2 score (µs), 3 idempotency ttl, 4 "1" when an idempotency key is given,
#       5 job key prefix, 6 index cut-off score, 7 stream cap, 8 tenant's queued cap,
#       9 expires (s), 10 now (s), then the record's field/value pairs
# Returns {0, id} (the job of a repeated idempotency key), {1, id} (queued),
#         {2, length} (the stream is at its cap), {3, queued} (the tenant is at its cap).
SUBMIT: Final = """
if ARGV[4] == '1' then
  local existing = redis.call('GET', KEYS[4])
  if existing and redis.call('EXISTS', ARGV[5] .. existing) == 1 then
    return {0, existing}
  end
end
local length = redis.call('XLEN', KEYS[2])
if length >= tonumber(ARGV[7]) then return {2, length} end
redis.call('ZREMRANGEBYSCORE', KEYS[7], '-inf', '(' .. ARGV[10])
local queued = redis.call('ZCARD', KEYS[7])
if queued >= tonumber(ARGV[8]) then return {3, queued} end
local entry = redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[7], '*', 'id', ARGV[1])
redis.call('HSET', KEYS[1], 'entry', entry, 'expires', ARGV[9], unpack(ARGV, 11))
redis.call('ZADD', KEYS[3], ARGV[2], ARGV[1])
redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', '(' .. ARGV[6])
redis.call('ZADD', KEYS[5], ARGV[2], ARGV[1])
redis.call('ZREMRANGEBYSCORE', KEYS[5], '-inf', '(' .. ARGV[6])
redis.call('ZADD', KEYS[6], ARGV[9], ARGV[1])
redis.call('ZADD', KEYS[7], ARGV[9], ARGV[1])
if ARGV[4] == '1' then
  redis.call('SET', KEYS[4], ARGV[1], 'EX', ARGV[3])
end
return {1, ARGV[1]}
"""

# KEYS: the tenant's submit bucket.  ARGV: tokens per second, burst.
# A token bucket on Redis's clock (every API replica shares it, whatever their clocks say).
# Returns {1, '0'} (taken) or {0, seconds until a token is free}.
TAKE: Final = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local rate, burst = tonumber(ARGV[1]), tonumber(ARGV[2])
local b = redis.call('HMGET', KEYS[1], 'tokens', 'at')
local tokens = tonumber(b[1]) or burst
local at = tonumber(b[2]) or now
tokens = math.min(burst, tokens + math.max(0, now - at) * rate)
if tokens < 1 then return {0, tostring((1 - tokens) / rate)} end
redis.call('HSET', KEYS[1], 'tokens', tostring(tokens - 1), 'at', tostring(now))
redis.call('EXPIRE', KEYS[1], math.ceil(burst / rate) + 1)
return {1, '0'}
"""

_ACK = """
local function ack()
  redis.call('XACK', KEYS[2], ARGV[1], ARGV[2])
  redis.call('XDEL', KEYS[2], ARGV[2])
end
"""

# KEYS: job, stream.  ARGV: 1 group, 2 entry, 3 lease, 4 now, 5 base, 6 result ttl,
#                           7 the error of an expired job (JSON)
# Returns {kind, attempts}: run, exhausted, deliver (a finished job whose webhook is owed),
# or gone / stale / cancelled / done / expired / waiting (acknowledged here: nothing to do;
# waiting: it joined its key's waiting line). A run let out of a waiting line also names it
# (its worker lets the next out: ``NEXT``).
START: Final = (
    _HELPERS
    + _ACK
    + """
local h = fields_of(KEYS[1], 'status', 'attempts', 'max_attempts', 'webhook_state', 'entry',
                   'lease', 'expires', 'id', 'promoted', 'key_id', 'tenant', 'created',
                   'from_line')
local status = h and h[1]
if not status then ack() return {'gone', 0} end  -- a key of another type is no job either
if h[5] and h[5] ~= ARGV[2] then ack() return {'stale', 0} end
if not h[5] and status == 'queued' then ack() return {'stale', 0} end  -- in a waiting line
if status == 'cancelled' then ack() return {'cancelled', 0} end
local attempts = num(h[2], 0)
if status == 'running' and h[6] == ARGV[3] then  -- a retried call
  return {'run', attempts, h[13] or ''}
end
if status == 'succeeded' or status == 'failed' then
  if h[4] == 'pending' then
    redis.call('HSET', KEYS[1], 'lease', ARGV[3])
    return {'deliver', attempts}
  end
  ack()
  return {'done', attempts}
end
-- An expiry that does not parse is none: the sweep still expires the job by its queued score.
if status == 'queued' and num(h[7], math.huge) < tonumber(ARGV[4]) then
  if settle(ARGV[5], ARGV[1], KEYS[1], h[8], ARGV[4], ARGV[6], ARGV[7]) then
    return {'settled', attempts}  -- a fresh entry delivers its webhook
  end
  return {'expired', attempts}
end
local base = ARGV[5]
if status == 'queued' and not h[9] then
  -- Its key has jobs waiting for room in its token window: it waits behind them (a line whose
  -- time was lost is made due, so that it is never stranded).
  local line = line_of(h[10], h[11])
  local waiting = base .. 'waiting:' .. line
  own_zset(waiting)
  if redis.call('EXISTS', waiting) == 1 then
    own_zset(base .. 'waiting-lines')
    redis.call('ZADD', waiting, num(h[12], 0), h[8])
    redis.call('ZADD', base .. 'waiting-lines', 'NX', 0, line)
    ack()
    redis.call('HDEL', KEYS[1], 'entry')
    redis.call('HSET', KEYS[1], 'parked', line)
    -- its expiry as the sweep knows it (the record's may not parse)
    local expires = num(redis.call('ZSCORE', base .. 'queued', h[8]), num(h[7], 0))
    redis.call('ZREM', base .. 'queued', h[8])
    redis.call('ZADD', base .. 'parked', expires, h[8])
    return {'waiting', attempts}
  end
end
local line = h[9] or ''
redis.call('HDEL', KEYS[1], 'promoted')  -- its worker lets the next out, not unqueue
redis.call('HSET', KEYS[1], 'from_line', line)  -- for a retried call
redis.call('HSET', KEYS[1], 'lease', ARGV[3])
unqueue(base, KEYS[1], h[8])
if attempts >= num(h[3], 1) then
  if line ~= '' then redis.call('ZADD', base .. 'waiting-lines', 'XX', 0, line) end
  return {'exhausted', attempts}
end
attempts = attempts + 1
redis.call('HSET', KEYS[1], 'status', 'running', 'attempts', attempts, 'started', ARGV[4])
return {'run', attempts, line}
"""
)

# KEYS: job, stream.  ARGV: group, entry, lease, status, now, ttl, field, payload
# Returns 0 (lease lost), 1 (finished), 2 (finished; a webhook is owed, the entry stays pending)
FINISH: Final = (
    _ACK
    + """
if redis.call('HGET', KEYS[1], 'lease') ~= ARGV[3] then return 0 end
redis.call('HSET', KEYS[1], 'status', ARGV[4], 'finished', ARGV[5], ARGV[7], ARGV[8])
if redis.call('HEXISTS', KEYS[1], 'webhook_url') == 1 then
  redis.call('HSET', KEYS[1], 'webhook_state', 'pending')
  return 2
end
redis.call('EXPIRE', KEYS[1], ARGV[6])
ack()
return 1
"""
)

# KEYS: job, stream.  ARGV: group, entry, lease, webhook state, ttl, deliveries (JSON)
# The state and the attempts that led to it are written together, so they always agree.
SETTLE_WEBHOOK: Final = (
    _ACK
    + """
if redis.call('HGET', KEYS[1], 'lease') ~= ARGV[3] then return 0 end
redis.call('HSET', KEYS[1], 'webhook_state', ARGV[4], 'deliveries', ARGV[6])
redis.call('EXPIRE', KEYS[1], ARGV[5])
ack()
return 1
"""
)

# KEYS: job.  ARGV: lease, deliveries (JSON).  Returns 0 when the lease is lost: another worker
# took the delivery over, and only its record counts.
RECORD_DELIVERIES: Final = """
if redis.call('HGET', KEYS[1], 'lease') ~= ARGV[1] then return 0 end
redis.call('HSET', KEYS[1], 'deliveries', ARGV[2])
return 1
"""

# KEYS: job, stream.  ARGV: 1 group, 2 entry, 3 lease, 4 last error (JSON or ''),
#                           5 "1" to refund the attempt, 6 base, 7 expires (s)
REQUEUE: Final = (
    _ACK
    + """
if redis.call('HGET', KEYS[1], 'lease') ~= ARGV[3] then return 0 end
local h = redis.call('HMGET', KEYS[1], 'id', 'tenant')
local entry = redis.call('XADD', KEYS[2], '*', 'id', h[1])  -- replaces its entry: trims no one
ack()
redis.call('HSET', KEYS[1], 'status', 'queued', 'entry', entry, 'lease', '', 'expires', ARGV[7])
redis.call('ZADD', ARGV[6] .. 'queued', ARGV[7], h[1])
redis.call('ZADD', ARGV[6] .. 'queued:' .. h[2], ARGV[7], h[1])
if ARGV[4] ~= '' then redis.call('HSET', KEYS[1], 'last_error', ARGV[4]) end
if ARGV[5] == '1' then redis.call('HINCRBY', KEYS[1], 'attempts', -1) end
return 1
"""
)

# KEYS: job, stream.  ARGV: 1 group, 2 entry, 3 lease, 4 base, 5 seconds until its line may
#                           be tried again, 6 now (s), 7 queued ttl (s)
# A job its worker took but may not run yet (its key's token window is full): queued again as
# it was before ``start`` (its attempt given back, its expiry kept), out of the stream, at its
# place in its key's waiting line, which is tried again ARGV[5] seconds from now. Returns 0
# when the lease was lost, else 1.
PARK: Final = (
    _HELPERS
    + _ACK
    + """
if redis.call('HGET', KEYS[1], 'lease') ~= ARGV[3] then return 0 end
local base = ARGV[4]
local h = redis.call('HMGET', KEYS[1], 'id', 'tenant', 'expires', 'key_id', 'created', 'attempts')
local line = line_of(h[4], h[2])
local waiting = base .. 'waiting:' .. line
own_zset(waiting)
own_zset(base .. 'waiting-lines')
local expires = num(h[3], tonumber(ARGV[6]) + tonumber(ARGV[7]))
local attempts = math.max(0, num(h[6], 1) - 1)
-- The sorted sets first: should one fail, the job is still running under this lease.
redis.call('ZADD', waiting, num(h[5], 0), h[1])
redis.call('ZADD', base .. 'parked', expires, h[1])
redis.call('ZADD', base .. 'queued:' .. h[2], expires, h[1])
redis.call('ZADD', base .. 'waiting-lines', now_s() + tonumber(ARGV[5]), line)
ack()
redis.call('HDEL', KEYS[1], 'entry', 'from_line')
redis.call('HSET', KEYS[1], 'status', 'queued', 'lease', '', 'expires', tostring(expires),
           'attempts', attempts, 'parked', line)
if attempts == 0 then redis.call('HDEL', KEYS[1], 'started') end
return 1
"""
)

# KEYS: waiting-lines.  ARGV: 1 base, 2 most lines, 3 seconds after which a line whose head went
#                            out is due again should its worker never say how it went
# Lets the head of each line that is due out into the stream. Returns how many went out.
PROMOTE: Final = (
    _HELPERS
    + """
own_zset(KEYS[1])
local lines = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now_s(), 'LIMIT', 0, tonumber(ARGV[2]))
local out = 0
for _, line in ipairs(lines) do
  out = out + let_out(ARGV[1], line, ARGV[3])
end
return out
"""
)

# KEYS: waiting-lines.  ARGV: 1 base, 2 line, 3 the fallback as in PROMOTE (s)
# A job let out of ``line`` holds its tokens, or has ended: the next two are let out now (a
# line with room drains in doubling steps, even behind a backlog in the stream). Returns how
# many went out.
NEXT: Final = (
    _HELPERS
    + """
own_zset(KEYS[1])
if not redis.call('ZSCORE', KEYS[1], ARGV[2]) then return 0 end  -- gone: nothing waits
local out = let_out(ARGV[1], ARGV[2], ARGV[3])
if out == 1 then out = out + let_out(ARGV[1], ARGV[2], ARGV[3]) end
return out
"""
)

# KEYS: job.  ARGV: tenant, now, ttl, user ('' for any user of the tenant), base.
# Returns 'missing', 'cancelled' or the status it has. The entry stays: ``start`` acknowledges
# it when a worker reads it.
CANCEL: Final = (
    _HELPERS
    + """
local h = redis.call('HMGET', KEYS[1], 'tenant', 'status', 'user', 'id')
if h[1] ~= ARGV[1] then return 'missing' end
if ARGV[4] ~= '' and h[3] ~= ARGV[4] then return 'missing' end
if h[2] ~= 'queued' then return h[2] end
redis.call('HSET', KEYS[1], 'status', 'cancelled', 'finished', ARGV[2])
unqueue(ARGV[5], KEYS[1], h[4])
redis.call('EXPIRE', KEYS[1], ARGV[3])
return 'cancelled'
"""
)

# KEYS: queued.  ARGV: 1 base, 2 group, 3 now, 4 result ttl, 5 most jobs to look at,
#                      6 the error of an expired job, 7 the error of a job whose entry is gone
# Settles queued jobs past their expiry (in the stream or in a waiting line: ``parked``), and
# queued jobs (among the oldest in the stream) whose stream entry is gone (trimmed by the
# cap). An id whose job key is not a hash is dropped from ``queued`` or ``parked`` (its
# tenant's set trims it by score at the next submit). Returns {expired, dropped, unreadable}.
SWEEP: Final = (
    _HELPERS
    + """
local base, now, limit = ARGV[1], ARGV[3], tonumber(ARGV[5])
local stream = base .. 'stream'
local expired, dropped, unreadable = 0, 0, 0
-- The jobs of `set` (queued or parked) past their expiry.
local function expire(set)
  for _, id in ipairs(redis.call('ZRANGEBYSCORE', set, '-inf', now, 'LIMIT', 0, limit)) do
    local job = base .. 'job:' .. id
    local h = fields_of(job, 'status')
    if not h then
      redis.call('ZREM', set, id)
      unreadable = unreadable + 1
    elseif h[1] == 'queued' then
      settle(base, ARGV[2], job, id, now, ARGV[4], ARGV[6])
      expired = expired + 1
    else
      unqueue(base, job, id)
    end
  end
end
expire(KEYS[1])
local ids = redis.call('ZRANGE', KEYS[1], 0, limit - 1)
for _, id in ipairs(ids) do
  local job = base .. 'job:' .. id
  local h = fields_of(job, 'status', 'entry', 'parked')
  if not h then
    redis.call('ZREM', KEYS[1], id)
    unreadable = unreadable + 1
  elseif h[1] ~= 'queued' then
    unqueue(base, job, id)
  elseif h[3] then
    -- in its key's waiting line: no entry, and none lost
  elseif not h[2] or #redis.call('XRANGE', stream, h[2], h[2]) == 0 then
    settle(base, ARGV[2], job, id, now, ARGV[4], ARGV[7])
    dropped = dropped + 1
  end
end
-- Waiting jobs (the soonest to expire) back in their lines, and their lines on the schedule,
-- should either have been lost (a failover, a damaged key deleted): nothing waits unseen.
own_zset(base .. 'waiting-lines')
for _, id in ipairs(redis.call('ZRANGE', base .. 'parked', 0, limit - 1)) do
  local h = fields_of(base .. 'job:' .. id, 'status', 'parked', 'created')
  if h and h[1] == 'queued' and h[2] then
    local waiting = base .. 'waiting:' .. h[2]
    own_zset(waiting)
    redis.call('ZADD', waiting, 'NX', num(h[3], 0), id)
    redis.call('ZADD', base .. 'waiting-lines', 'NX', 0, h[2])
  end
end
expire(base .. 'parked')
return {expired, dropped, unreadable}
"""
)

# KEYS: the tenant's queued.  ARGV: 1 base, 2 group, 3 now, 4 result ttl, 5 key id,
#                                   6 the error of a job whose key was revoked
# Settles the queued jobs that the revoked key submitted. Returns how many.
SETTLE_KEY: Final = (
    _HELPERS
    + """
local base = ARGV[1]
local settled = 0
for _, id in ipairs(redis.call('ZRANGE', KEYS[1], 0, -1)) do
  local job = base .. 'job:' .. id
  local h = fields_of(job, 'status', 'key_id')
  if h and h[1] == 'queued' and h[2] == ARGV[5] then
    settle(base, ARGV[2], job, id, ARGV[3], ARGV[4], ARGV[6])
    settled = settled + 1
  end
end
return settled
"""
)

# KEYS: an index (the tenant's, or one user's).  ARGV: job key prefix, after (id or ''),
# limit, most ids to examine.
# Returns {0} for an unknown cursor, else {1, has_more, job1 fields, job2 fields, ...}.
# Ids whose record expired, or whose key holds something else than a hash, are skipped (and
# trimmed from the index by age at submit).
LIST: Final = """
local limit = tonumber(ARGV[3])
local budget = tonumber(ARGV[4])
local pos = 0
if ARGV[2] ~= '' then
  local rank = redis.call('ZREVRANK', KEYS[1], ARGV[2])
  if not rank then return {0} end
  pos = rank + 1
end
local out = {1, 0}
local found = 0
while found <= limit and budget > 0 do
  local ids = redis.call('ZREVRANGE', KEYS[1], pos, pos + limit)
  if #ids == 0 then break end
  for _, id in ipairs(ids) do
    budget = budget - 1
    local fields = redis.pcall('HGETALL', ARGV[1] .. id)
    if not fields.err and #fields > 0 then
      found = found + 1
      if found <= limit then table.insert(out, fields) else out[2] = 1 end
    end
    if found > limit or budget <= 0 then break end
  end
  pos = pos + #ids
end
if budget <= 0 and found <= limit then out[2] = 1 end
return out
"""

# KEYS: stream.  ARGV: group, then the entries to acknowledge and delete (entries no worker can
# read: they name no job).
DROP_ENTRIES: Final = """
redis.call('XACK', KEYS[1], ARGV[1], unpack(ARGV, 2))
redis.call('XDEL', KEYS[1], unpack(ARGV, 2))
return 1
"""
