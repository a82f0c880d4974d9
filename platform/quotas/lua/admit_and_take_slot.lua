-- Admission and the pool's fair share in one atomic step and one round trip: `admit`, then, if the
-- request is admitted, the first try for its pool slot (`fair_acquire`, quotas/fairshare.py).
-- Both are defined above this text as local functions of (KEYS, ARGV) (quotas/scripts.py).
-- KEYS: admit's, then fq:<pool>.
-- ARGV[1] how many of KEYS are admit's, ARGV[2] how many arguments are admit's; then admit's
--       arguments, then fair_acquire's.
-- Returns admit's refusal {0, limit_hit, retry_after_s, headers_json}, or
-- {1, granted_max_tokens, headers_json, slot} with slot 1 (taken) or 0 (wait for one).
local nk, na = tonumber(ARGV[1]), tonumber(ARGV[2])
local admit_keys, admit_args, slot_args = {}, {}, {}
for i = 1, nk do admit_keys[i] = KEYS[i] end
for i = 1, na do admit_args[i] = ARGV[2 + i] end
for i = 3 + na, #ARGV do slot_args[#slot_args + 1] = ARGV[i] end
local admitted = admit(admit_keys, admit_args)
if admitted[1] ~= 1 then return admitted end
admitted[4] = fair_acquire({KEYS[nk + 1], KEYS[1]}, slot_args)
return admitted
