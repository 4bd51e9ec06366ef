"""How a chunk lies in Redis: the fields of its hash, the namespace of a model, and the server-side
scripts that write, delete and count atomically.

The layout and the visibility rules these scripts implement are described in
:mod:`cacheblend_rag.store.backends.redis_store`; they live here, apart from the store's commands, so that the
Lua and the field names it spells out (``'m'``, ``<write_id>:<layer>``) sit side by side.
"""

from __future__ import annotations

import hashlib
from typing import Any, Sequence

import redis

from cacheblend_rag.store.errors import CorruptEntryError

MANIFEST_FIELD = b"m"

# KEYS[1] chunk hash; ARGV: field, value, pending expiry in seconds.
PUT_LAYER_SCRIPT = """
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
if redis.call('HEXISTS', KEYS[1], 'm') == 0 then
  redis.call('EXPIRE', KEYS[1], tonumber(ARGV[3]))
end
return 1
"""

# KEYS[1] chunk hash; ARGV: manifest, ttl (0: none), write id, number of layers.
# Returns 1 if stored, 0 if another manifest stands, -1 if a layer of this write is gone.
ADD_MANIFEST_SCRIPT = """
if redis.call('HEXISTS', KEYS[1], 'm') == 1 then return 0 end
for layer = 0, tonumber(ARGV[4]) - 1 do
  if redis.call('HEXISTS', KEYS[1], ARGV[3] .. ':' .. layer) == 0 then return -1 end
end
redis.call('HSET', KEYS[1], 'm', ARGV[1])
local ttl = tonumber(ARGV[2])
if ttl > 0 then redis.call('EXPIRE', KEYS[1], ttl) else redis.call('PERSIST', KEYS[1]) end
return 1
"""

def bounded_hgets(client: Any, fields: Sequence[tuple[bytes, bytes]], bound: int | None, what: str) -> list[Any]:
    """The values of ``(hash, field)`` pairs, asked in two pipelines: their sizes (``HSTRLEN``), then the values
    of those no larger than ``bound``. A value beyond it (planted, say: hundreds of megabytes) is never sent, so
    it cannot outlast the read timeout and open the breaker (reuse off for every request) again at every read;
    it is a :class:`CorruptEntryError` for its chunk, as a key of another type is. ``bound=None`` reads whole.

    Two round trips, not one script: a Lua script that checks and returns a value copies it once more inside
    the server, and cost a 45 MB blend's reads 80% more time on loopback (two pipelines: 6%). A value replaced
    by a larger one between the two pipelines is read whole (the read timeout still bounds that)."""
    sizes: list[Any] = [0] * len(fields)
    if bound is not None and fields:
        pipe = client.pipeline(transaction=False)
        for name, field in fields:
            pipe.hstrlen(name, field)
        sizes = pipe.execute(raise_on_error=False)
    out: list[Any] = [None] * len(fields)
    wanted = []
    for i, size in enumerate(sizes):
        if isinstance(size, Exception):
            out[i] = corrupt_if_wrong_type(size)
        elif bound is not None and size > bound:
            out[i] = CorruptEntryError(f"Redis holds a {what} of {size:,} bytes, more than any {what} of this "
                                       f"model ({bound:,}); not reading it (planted?)")
        else:
            wanted.append(i)
    if wanted:
        pipe = client.pipeline(transaction=False)
        for i in wanted:
            pipe.hget(*fields[i])
        for i, reply in zip(wanted, pipe.execute(raise_on_error=False)):
            out[i] = corrupt_if_wrong_type(reply) if isinstance(reply, Exception) else reply
    return out


# KEYS[1] chunk hash. Returns 1 if the chunk had a manifest. A key of another type (written by
# another program) is removed too: it can never be a chunk.
DELETE_SCRIPT = """
if redis.call('TYPE', KEYS[1]).ok ~= 'hash' then
  redis.call('UNLINK', KEYS[1])
  return 0
end
local had = redis.call('HEXISTS', KEYS[1], 'm')
redis.call('UNLINK', KEYS[1])
return had
"""

# KEYS[1] counters hash; ARGV: field, increment, ... Returns the hash's epoch ('' if it has none:
# it was just created) and the new totals, in order.
RECORD_SCRIPT = """
local result = {redis.call('HGET', KEYS[1], 'epoch') or ''}
for i = 1, #ARGV, 2 do
  result[#result + 1] = redis.call('HINCRBY', KEYS[1], ARGV[i], ARGV[i + 1])
end
return result
"""

# KEYS[1] counters hash; ARGV[1] epoch, then field, amount, ... Adds the amounts and sets the epoch,
# only if no epoch is set (so of several replicas that saw the hash evicted, one restores it).
RESTORE_SCRIPT = """
if redis.call('HSETNX', KEYS[1], 'epoch', ARGV[1]) == 0 then return 0 end
for i = 2, #ARGV, 2 do
  redis.call('HINCRBY', KEYS[1], ARGV[i], ARGV[i + 1])
end
return 1
"""


def model_namespace(fingerprint: str) -> str:
    """The key namespace of a model: 16 hex digits of its fingerprint's SHA-256."""
    return hashlib.sha256(fingerprint.encode()).hexdigest()[:16]


def corrupt_if_wrong_type(error: Exception) -> CorruptEntryError:
    """A key of another type under a chunk's name (another program's string or list) as a corrupt
    entry of that chunk; any other error is raised as it is."""
    if isinstance(error, redis.exceptions.ResponseError) and "WRONGTYPE" in str(error):
        return CorruptEntryError("the chunk's key holds a value of another type, not a chunk hash "
                                 "(another program wrote it)")
    raise error


def layer_field(write_id: str, layer: int) -> bytes:
    return f"{write_id}:{layer}".encode()
