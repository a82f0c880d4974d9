-- Fair share of a saturated pool: take one of its `capacity` slots, unless the pool is full or
-- another waiting tenant is further below its weighted share (fewer slots per unit of weight).
-- KEYS[1] fq:<pool> prefix   KEYS[2] resv:<rid>
-- ARGV: tenant id, rid, weight, capacity, hold seconds, waiter freshness seconds, was_waiting (1/0)
-- Returns 1 (slot taken, recorded in the reservation so settle gives it back) or 0 (wait and retry).
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local run, per, wait, waitn, wt = KEYS[1] .. ':run', KEYS[1] .. ':per', KEYS[1] .. ':wait',
  KEYS[1] .. ':waitn', KEYS[1] .. ':wt'
local tid, rid = ARGV[1], ARGV[2]
local weight, capacity = tonumber(ARGV[3]), tonumber(ARGV[4])
local hold, fresh, was_waiting = tonumber(ARGV[5]), tonumber(ARGV[6]), ARGV[7] == '1'

-- Slots of requests nobody settled (a crashed gateway) expire.
for _, m in ipairs(redis.call('ZRANGEBYSCORE', run, '-inf', now)) do
  redis.call('ZREM', run, m)
  redis.call('HINCRBY', per, string.match(m, '^(%d+):'), -1)
end
redis.call('ZREMRANGEBYSCORE', wait, '-inf', now - fresh)

if redis.call('EXISTS', KEYS[2]) == 0 then return -1 end  -- the reservation is gone: nothing to run

local mine = tonumber(redis.call('HGET', per, tid) or '0')
local function register()
  if not was_waiting then redis.call('HINCRBY', waitn, tid, 1) end
  redis.call('ZADD', wait, now, tid)
  redis.call('HSET', wt, tid, weight)
  return 0
end
if redis.call('ZCARD', run) >= capacity then return register() end
for _, other in ipairs(redis.call('ZRANGE', wait, 0, -1)) do
  if other ~= tid and tonumber(redis.call('HGET', waitn, other) or '0') > 0 then
    local theirs = tonumber(redis.call('HGET', per, other) or '0')
    local their_weight = tonumber(redis.call('HGET', wt, other) or '1')
    if theirs * weight < mine * their_weight then return register() end
  end
end
local member = tid .. ':' .. rid
redis.call('ZADD', run, now + hold, member)
redis.call('HINCRBY', per, tid, 1)
redis.call('HSET', KEYS[2], 'fq', KEYS[1], 'fm', member, 'ft', tid)
if was_waiting and tonumber(redis.call('HINCRBY', waitn, tid, -1)) < 0 then redis.call('HSET', waitn, tid, 0) end
return 1
