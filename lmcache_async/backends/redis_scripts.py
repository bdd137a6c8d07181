"""The Lua scripts that keep a tenant's quota index in Redis (:mod:`.redis_tenants`).

Each runs atomically on the node of the index's hash slot and touches only its two keys
(``KEYS[1]``: the sorted set of members by last use, ``KEYS[2]``: the hash of their sizes
with the field ``~total``), so it is valid in a cluster; the chunks themselves, on other
nodes, are deleted by the client. Times are the server's (``TIME``), so the hosts sharing
an index agree on what was used last.
"""

from __future__ import annotations

from typing import Final

__all__ = ["FORGET", "RECORD", "TOUCH"]

RECORD: Final = """
local lru, sizes = KEYS[1], KEYS[2]
local quota, ttl = tonumber(ARGV[1]), tonumber(ARGV[2])
local clock = redis.call('TIME')
local now = tonumber(clock[1]) + tonumber(clock[2]) / 1000000
local total = tonumber(redis.call('HGET', sizes, '~total') or '0')
local function drop(member)
  local size = redis.call('HGET', sizes, member)
  if size then
    redis.call('HDEL', sizes, member)
    total = total - tonumber(size)
  end
end
if ttl > 0 then
  -- Last used before now - ttl means written before then too: expired already.
  local bound = string.format('(%.6f', now - ttl / 1000)
  local stale = redis.call('ZRANGEBYSCORE', lru, '-inf', bound, 'LIMIT', 0, 1000)
  for _, member in ipairs(stale) do
    drop(member)
    redis.call('ZREM', lru, member)
  end
end
local refused = {}
for i = 3, #ARGV, 2 do
  local member, size = ARGV[i], tonumber(ARGV[i + 1])
  if size > quota then
    refused[#refused + 1] = member
  else
    drop(member)
    redis.call('HSET', sizes, member, size)
    redis.call('ZADD', lru, now, member)
    total = total + size
  end
end
local evicted = {}
while total > quota do
  local popped = redis.call('ZPOPMIN', lru)
  if #popped == 0 then break end
  drop(popped[1])
  evicted[#evicted + 1] = popped[1]
end
local count = redis.call('ZCARD', lru)
if count == 0 then
  redis.call('DEL', lru, sizes)
  total = 0
else
  redis.call('HSET', sizes, '~total', total)
  if ttl > 0 then
    redis.call('PEXPIRE', lru, ttl)
    redis.call('PEXPIRE', sizes, ttl)
  end
end
return {evicted, refused, count, total}
"""
"""KEYS: lru, sizes. ARGV: quota bytes, TTL ms (0: none), then member, size pairs.
Returns the members evicted and refused (each larger than the quota), the count and the
bytes left."""

TOUCH: Final = """
local clock = redis.call('TIME')
local now = tonumber(clock[1]) + tonumber(clock[2]) / 1000000
local args = {}
for i = 1, #ARGV do
  args[#args + 1] = now
  args[#args + 1] = ARGV[i]
  if #args >= 1000 or i == #ARGV then
    redis.call('ZADD', KEYS[1], 'XX', unpack(args))
    args = {}
  end
end
return {redis.call('ZCARD', KEYS[1]), tonumber(redis.call('HGET', KEYS[2], '~total') or '0')}
"""
"""KEYS: lru, sizes. ARGV: members hit (those not indexed stay out). Returns the count and
bytes of the tenant."""

FORGET: Final = """
local total = tonumber(redis.call('HGET', KEYS[2], '~total') or '0')
for i = 1, #ARGV do
  local size = redis.call('HGET', KEYS[2], ARGV[i])
  if size then
    redis.call('HDEL', KEYS[2], ARGV[i])
    total = total - tonumber(size)
  end
  redis.call('ZREM', KEYS[1], ARGV[i])
end
local count = redis.call('ZCARD', KEYS[1])
if count == 0 then
  redis.call('DEL', KEYS[1], KEYS[2])
  total = 0
else
  redis.call('HSET', KEYS[2], '~total', total)
end
return {count, total}
"""
"""KEYS: lru, sizes. ARGV: members removed. Returns the count and bytes of the tenant."""
