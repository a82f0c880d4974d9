-- Admission: check and reserve every limit of every scope of one request, atomically.
-- KEYS[1] resv:<rid>   KEYS[2] resv:deadlines   KEYS[3..] scope prefixes (q:t:<tenant>, q:k:<key>)
-- ARGV: rid, prompt_tokens, max_tokens, implicit (1: max_tokens was not asked for and may be lowered),
--       period id, period end (unix s), hold seconds, check_only (1: decide, reserve nothing),
--       least_grant (the fewest completion tokens an implicit max_tokens may be lowered to: one per
--       choice of n), clock offset (seconds added to Redis's clock: 0 but in tests, core/clock.py),
--       then per scope: rpm, input_tpm, output_tpm, concurrency, budget, budget_seed (-1: no limit)
-- Returns {1, granted_max_tokens, headers_json} or {0, limit_hit, retry_after_s, headers_json}.
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000 + tonumber(ARGV[10])
local minute = math.floor(now / 60)
local window_reset = 60 - (now - minute * 60)
local rid = ARGV[1]
local prompt = tonumber(ARGV[2])
local want = tonumber(ARGV[3])
local implicit = ARGV[4] == '1'
local period = ARGV[5]
local period_end = tonumber(ARGV[6])
local hold = tonumber(ARGV[7])
local check_only = ARGV[8] == '1'
local least_grant = tonumber(ARGV[9])
local budget_ttl = math.max(60, math.floor(period_end - now) + 40 * 86400)

local scopes = {}
for i = 3, #KEYS do
  local a = 10 + (i - 3) * 6
  local p = KEYS[i]
  local s = {p = p, rpm = tonumber(ARGV[a + 1]), itpm = tonumber(ARGV[a + 2]), otpm = tonumber(ARGV[a + 3]),
             conc = tonumber(ARGV[a + 4]), budget = tonumber(ARGV[a + 5])}
  s.k_rpm, s.k_itpm, s.k_otpm = p .. ':rpm:' .. minute, p .. ':itpm:' .. minute, p .. ':otpm:' .. minute
  s.k_conc, s.k_bud = p .. ':conc', p .. ':bud:' .. period
  redis.call('ZREMRANGEBYSCORE', s.k_conc, '-inf', now)
  s.n_rpm = tonumber(redis.call('GET', s.k_rpm) or '0')
  s.n_itpm = tonumber(redis.call('GET', s.k_itpm) or '0')
  s.n_otpm = tonumber(redis.call('GET', s.k_otpm) or '0')
  s.n_conc = redis.call('ZCARD', s.k_conc)
  if s.budget >= 0 then
    local used = redis.call('GET', s.k_bud)
    if not used then
      used = ARGV[a + 6]
      redis.call('SET', s.k_bud, used, 'EX', budget_ttl)
    end
    s.n_bud = tonumber(used)
  end
  scopes[#scopes + 1] = s
end

-- The tightest scope of each limit, for the x-ratelimit-* headers: {limit, remaining, reset_s}.
local function headers(granted)
  local h = {}
  local function put(name, limit, remaining, reset)
    if limit < 0 then return end
    remaining = math.max(0, remaining)
    if h[name] == nil or remaining < h[name][2] then h[name] = {limit, remaining, reset} end
  end
  for _, s in ipairs(scopes) do
    put('requests', s.rpm, s.rpm - s.n_rpm, window_reset)
    put('input_tokens', s.itpm, s.itpm - s.n_itpm, window_reset)
    put('output_tokens', s.otpm, s.otpm - s.n_otpm, window_reset)
    put('concurrency', s.conc, s.conc - s.n_conc, 0)
    if s.budget >= 0 then put('budget_tokens', s.budget, s.budget - s.n_bud, period_end - now) end
  end
  return cjson.encode(h)
end

local function refuse(limit, retry)
  return {0, limit, tostring(math.max(1, math.ceil(retry))), headers()}
end

for _, s in ipairs(scopes) do
  if s.conc >= 0 and s.n_conc >= s.conc then return refuse('concurrency', 1) end
  if s.rpm >= 0 and s.n_rpm + 1 > s.rpm then return refuse('requests', window_reset) end
  if s.itpm >= 0 and s.n_itpm + prompt > s.itpm then return refuse('input_tokens', window_reset) end
  if s.budget >= 0 and s.n_bud + prompt + 1 > s.budget then return refuse('budget_tokens', period_end - now) end
end

-- Completion tokens: reserve max_tokens; an implicit max_tokens is lowered to what is left, but not
-- below least_grant (a request of n choices needs a token for each).
local grant = want
for _, s in ipairs(scopes) do
  if s.otpm >= 0 and s.n_otpm + grant > s.otpm then
    if not implicit or s.otpm - s.n_otpm < least_grant then return refuse('output_tokens', window_reset) end
    grant = s.otpm - s.n_otpm
  end
  if s.budget >= 0 and s.n_bud + prompt + grant > s.budget then
    if not implicit or s.budget - s.n_bud - prompt < least_grant then
      return refuse('budget_tokens', period_end - now)
    end
    grant = s.budget - s.n_bud - prompt
  end
end

-- A check (before the request's tokens are counted exactly) decides as admission would, and stops here.
if check_only then return {1, grant, headers()} end

local resv = {'n', #scopes, 'm', minute, 'in', prompt, 'out', grant}
for i, s in ipairs(scopes) do
  redis.call('INCR', s.k_rpm)
  redis.call('EXPIRE', s.k_rpm, 120)
  redis.call('INCRBY', s.k_itpm, prompt)
  redis.call('EXPIRE', s.k_itpm, 120)
  redis.call('INCRBY', s.k_otpm, grant)
  redis.call('EXPIRE', s.k_otpm, 120)
  redis.call('ZADD', s.k_conc, now + hold, rid)
  redis.call('EXPIRE', s.k_conc, hold)
  s.n_rpm, s.n_itpm, s.n_otpm, s.n_conc = s.n_rpm + 1, s.n_itpm + prompt, s.n_otpm + grant, s.n_conc + 1
  local charged = ''
  if s.budget >= 0 then
    redis.call('INCRBY', s.k_bud, prompt + grant)
    s.n_bud = s.n_bud + prompt + grant
    charged = period
  end
  resv[#resv + 1] = 'p' .. i
  resv[#resv + 1] = s.p
  resv[#resv + 1] = 'b' .. i
  resv[#resv + 1] = charged
end
redis.call('HSET', KEYS[1], unpack(resv))
redis.call('EXPIRE', KEYS[1], hold + 600)
redis.call('ZADD', KEYS[2], now + hold, rid)
return {1, grant, headers()}
