-- Settle a finished request from its usage entry in the ledger buffer, in one round trip: `settle`
-- (defined above this text as a local function of (KEYS, ARGV), contract/settle.py) with the
-- entry's prompt and completion tokens.
-- KEYS[1] ledger:pending   KEYS[2] resv:<rid>   KEYS[3] resv:deadlines   ARGV[1] rid
-- Returns settle's result (1 settled now, 0 settled already), or -1 when the request has no entry.
local raw = redis.call('HGET', KEYS[1], ARGV[1])
if not raw then return -1 end
local usage = cjson.decode(raw)
return settle({KEYS[2], KEYS[3]}, {ARGV[1], usage.prompt_tokens, usage.completion_tokens})
