"""The queue's Lua scripts: each state change of a job is one script, so it is atomic in Redis.

A Redis script is not rolled back when one of its commands fails, so each script does first
the command that can fail (XADD) and writes the job record after it. Every state change after
``start`` checks the caller's lease: a worker whose job was taken over after the visibility
timeout can no longer write a result, so each job has at most one result.
"""

from __future__ import annotations

from typing import Final

# KEYS: job, stream, tenant index, idempotency key
# ARGV: id, score (µs), idempotency ttl, "1" when an idempotency key is given, job key prefix,
#       index cut-off score, then the record's field/value pairs
SUBMIT: Final = """
if ARGV[4] == '1' then
  local existing = redis.call('GET', KEYS[4])
  if existing and redis.call('EXISTS', ARGV[5] .. existing) == 1 then
    return {0, existing}
  end
end
local entry = redis.call('XADD', KEYS[2], '*', 'id', ARGV[1])
redis.call('HSET', KEYS[1], 'entry', entry, unpack(ARGV, 7))
redis.call('ZADD', KEYS[3], ARGV[2], ARGV[1])
redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', '(' .. ARGV[6])
if ARGV[4] == '1' then
  redis.call('SET', KEYS[4], ARGV[1], 'EX', ARGV[3])
end
return {1, ARGV[1]}
"""

_ACK = """
local function ack()
  redis.call('XACK', KEYS[2], ARGV[1], ARGV[2])
  redis.call('XDEL', KEYS[2], ARGV[2])
end
"""

# KEYS: job, stream.  ARGV: group, entry, lease, now
# Returns {kind, attempts}: run, exhausted, deliver (a finished job whose webhook is owed),
# or gone / stale / cancelled / done (acknowledged here: nothing to do).
START: Final = (
    _ACK
    + """
local h = redis.call('HMGET', KEYS[1], 'status', 'attempts', 'max_attempts', 'webhook_state',
                     'entry', 'lease')
local status = h[1]
if not status then ack() return {'gone', 0} end
if h[5] and h[5] ~= ARGV[2] then ack() return {'stale', 0} end
if status == 'cancelled' then ack() return {'cancelled', 0} end
local attempts = tonumber(h[2] or '0')
if status == 'running' and h[6] == ARGV[3] then return {'run', attempts} end  -- a retried call
if status == 'succeeded' or status == 'failed' then
  if h[4] == 'pending' then
    redis.call('HSET', KEYS[1], 'lease', ARGV[3])
    return {'deliver', attempts}
  end
  ack()
  return {'done', attempts}
end
redis.call('HSET', KEYS[1], 'lease', ARGV[3])
if attempts >= tonumber(h[3] or '1') then
  return {'exhausted', attempts}
end
attempts = attempts + 1
redis.call('HSET', KEYS[1], 'status', 'running', 'attempts', attempts, 'started', ARGV[4])
return {'run', attempts}
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

# KEYS: job, stream.  ARGV: group, entry, lease, webhook state, ttl
SETTLE_WEBHOOK: Final = (
    _ACK
    + """
if redis.call('HGET', KEYS[1], 'lease') ~= ARGV[3] then return 0 end
redis.call('HSET', KEYS[1], 'webhook_state', ARGV[4])
redis.call('EXPIRE', KEYS[1], ARGV[5])
ack()
return 1
"""
)

# KEYS: job, stream.  ARGV: group, entry, lease, last error (JSON or ''), "1" to refund the attempt
REQUEUE: Final = (
    _ACK
    + """
if redis.call('HGET', KEYS[1], 'lease') ~= ARGV[3] then return 0 end
local entry = redis.call('XADD', KEYS[2], '*', 'id', redis.call('HGET', KEYS[1], 'id'))
ack()
redis.call('HSET', KEYS[1], 'status', 'queued', 'entry', entry, 'lease', '')
if ARGV[4] ~= '' then redis.call('HSET', KEYS[1], 'last_error', ARGV[4]) end
if ARGV[5] == '1' then redis.call('HINCRBY', KEYS[1], 'attempts', -1) end
return 1
"""
)

# KEYS: job.  ARGV: tenant, now, ttl.  Returns 'missing', 'cancelled' or the status it has.
CANCEL: Final = """
local h = redis.call('HMGET', KEYS[1], 'tenant', 'status')
if h[1] ~= ARGV[1] then return 'missing' end
if h[2] ~= 'queued' then return h[2] end
redis.call('HSET', KEYS[1], 'status', 'cancelled', 'finished', ARGV[2])
redis.call('EXPIRE', KEYS[1], ARGV[3])
return 'cancelled'
"""

# KEYS: tenant index.  ARGV: job key prefix, after (id or ''), limit, most ids to examine
# Returns {0} for an unknown cursor, else {1, has_more, job1 fields, job2 fields, ...}.
# Ids whose record expired are skipped (and trimmed from the index by age at submit).
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
    local fields = redis.call('HGETALL', ARGV[1] .. id)
    if #fields > 0 then
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
