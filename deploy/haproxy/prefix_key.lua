-- radixserve router: the affinity key of a body with input texts (haproxy.cfg, rule 4).
--
-- Fetch `lua.radixserve_input_key`, from two variables the config fills with json_query:
--   txn.prefix_text  the first input, txn.prefix_next  the second input (unset for one input).
-- It returns what the request's inputs share, which is what the replicas' tries and prefix caches
-- share across requests: the longest common prefix of the first two inputs, at most MAX_KEY bytes,
-- cut back to just after its last line break when it has one past byte MIN_SHARED (templated
-- inputs differ per line: the cut keeps "template + query" and drops the few characters two
-- passages happen to start with, so every request of one query gets one key). When the first two
-- inputs share fewer than MIN_SHARED bytes, or there is one input, the key is the first
-- MIN_SHARED bytes of the first input (the rule without this file).
-- Invariant: the key is a function of the two inputs' bytes only, and costs O(MAX_KEY) per request.

local MIN_SHARED = 64
local MAX_KEY = 4096
local BLOCK = 64

-- Length of the longest common prefix of a and b, at most cap bytes.
local function shared_length(a, b, cap)
    local n = math.min(#a, #b, cap)
    local i = 0
    while i + BLOCK <= n and a:sub(i + 1, i + BLOCK) == b:sub(i + 1, i + BLOCK) do
        i = i + BLOCK
    end
    while i < n and a:byte(i + 1) == b:byte(i + 1) do
        i = i + 1
    end
    return i
end

-- The shared prefix cut after its last "\n" when that leaves at least MIN_SHARED bytes.
local function cut_at_line(prefix)
    local last = nil
    local from = MIN_SHARED
    while true do
        local at = prefix:find("\n", from, true)
        if at == nil then break end
        last, from = at, at + 1
    end
    if last ~= nil then
        return prefix:sub(1, last)
    end
    return prefix
end

local function input_key(txn)
    local first = txn:get_var("txn.prefix_text")
    if first == nil then
        return nil
    end
    first = tostring(first)  -- a number (token ids sent as input) keys by its text, as bytes() does
    if #first == 0 then
        return nil
    end
    local second = txn:get_var("txn.prefix_next")
    if second ~= nil then
        second = tostring(second)
        local n = shared_length(first, second, MAX_KEY)
        if n >= MIN_SHARED then
            return cut_at_line(first:sub(1, n))
        end
    end
    return first:sub(1, MIN_SHARED)
end

core.register_fetches("radixserve_input_key", input_key)
