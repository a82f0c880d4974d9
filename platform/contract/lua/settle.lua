-- Settle: replace a request's reservation by its actual usage. Idempotent: the reservation record
-- is consumed, so a second settle of the same request (a replayed result) changes nothing.
-- KEYS[1] resv:<rid>   KEYS[2] resv:deadlines
-- ARGV: rid, actual prompt tokens, actual completion tokens. Returns 1 if settled now, 0 if already.
local r = redis.call('HGETALL', KEYS[1])
if #r == 0 then return 0 end
redis.call('DEL', KEYS[1])
redis.call('ZREM', KEYS[2], ARGV[1])
local h = {}
for i = 1, #r, 2 do h[r[i]] = r[i + 1] end
local d_in = tonumber(ARGV[2]) - tonumber(h['in'])
local d_out = tonumber(ARGV[3]) - tonumber(h['out'])
local function adjust(key, delta)
  -- A window that has already rolled over stays as it was counted.
  if delta ~= 0 and redis.call('EXISTS', key) == 1 then redis.call('INCRBY', key, delta) end
end
for i = 1, tonumber(h['n']) do
  local p = h['p' .. i]
  redis.call('ZREM', p .. ':conc', ARGV[1])
  adjust(p .. ':itpm:' .. h['m'], d_in)
  adjust(p .. ':otpm:' .. h['m'], d_out)
  if h['b' .. i] ~= '' then adjust(p .. ':bud:' .. h['b' .. i], d_in + d_out) end
end
if h['fq'] then
  -- Give the pool slot back (fair share).
  if redis.call('ZREM', h['fq'] .. ':run', h['fm']) == 1 then
    redis.call('HINCRBY', h['fq'] .. ':per', h['ft'], -1)
  end
end
return 1
