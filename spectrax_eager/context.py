"""`spx.scope` / `spx.context`: values bound for the duration of a block, read anywhere below it.

`with spx.scope(mask=m, training=False): model(x)` makes `spx.scope.get("mask")`
return `m` in any code the block calls (inner blocks shadow outer ones; the
binding is per thread and per asyncio task). Under `spx.jit`, array values are
inputs of the compiled program (a new array is not a new program) and the other
values are part of its cache key (a new value is a new program), so a jitted
call always sees the values bound at the call.
"""

from ._scope.frames import active, get, partition, scope, snapshot

__all__ = ["active", "get", "partition", "scope", "snapshot"]
