"""A balancer without Lua: optimistic WATCH / MULTI / EXEC transactions, the obvious way to
share counts through Redis without scripts. Every acquire reads all counts, picks the least
loaded (random tie-break) and commits; a concurrent commit to the counts aborts it (WatchError)
and it starts over. Release is a plain HINCRBY -1 (no transaction needed).
"""

from __future__ import annotations

import random

import redis.asyncio
from redis.exceptions import WatchError


class WatchMultiBalancer:
    def __init__(self, client: redis.asyncio.Redis, name: str) -> None:
        self._client = client
        self.load = f"naive:{{{name}}}:load"
        self.sticky = f"naive:{{{name}}}:sticky"
        self.retries = 0

    async def add_servers(self, server_ids: list[str]) -> None:
        await self._client.hset(self.load, mapping=dict.fromkeys(server_ids, 0))

    async def acquire_server(self, request_id: str) -> str:
        async with self._client.pipeline(transaction=True) as pipe:
            while True:
                try:
                    await pipe.watch(self.load)
                    sid = await pipe.hget(self.sticky, request_id)
                    counts = await pipe.hgetall(self.load)
                    if sid is None or sid not in counts:
                        low = min(int(c) for c in counts.values())
                        sid = random.choice([s for s, c in counts.items() if int(c) == low])
                    pipe.multi()
                    pipe.hincrby(self.load, sid, 1)
                    pipe.hset(self.sticky, request_id, sid)
                    await pipe.execute()
                    return sid
                except WatchError:
                    self.retries += 1

    async def release_server(self, server_id: str) -> None:
        await self._client.hincrby(self.load, server_id, -1)
