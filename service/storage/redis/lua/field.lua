-- A stored memory field (service/domain/fields.py, StoredField): "~<expires_at>|<written_at>|<json>" with both
-- times in base 36, or "<expires_at>|<written_at>|<json>" in decimal as releases before it wrote them.
-- parse(packed) gives {packed, expires_at as a decimal string (for PEXPIREAT and ZADD), expires_at,
-- written_at}, or nil when it is neither form.
local function base36(digits)
  -- tonumber(s, 36) alone would take a leading '-' through strtoul and wrap it around
  if string.sub(digits, 1, 1) == '-' then
    return -tonumber(string.sub(digits, 2), 36)
  end
  return tonumber(digits, 36)
end

local function parse(packed)
  local e, w = string.match(packed, '^~(%-?[0-9a-z]+)|(%-?[0-9a-z]+)|')
  if e then
    local expires_at = base36(e)
    return {packed, string.format('%.0f', expires_at), expires_at, base36(w)}
  end
  e, w = string.match(packed, '^(%-?%d+)|(%-?%d+)|')
  if not e then
    return nil
  end
  return {packed, e, tonumber(e), tonumber(w)}
end
