"""A background task that reads Redis again and again, riding out Redis being away."""

from __future__ import annotations

import asyncio
import contextlib

from redis.exceptions import RedisError


class RedisFollower:
    """Runs `read_once` until stopped: `pause_s` after a read, `retry_s` after a failed one
    (which `read_failed` hears of first). Subclasses own what is read and kept."""

    pause_s = 0.0
    retry_s = 1.0

    def __init__(self, redis_url: str) -> None:
        import redis.asyncio as aioredis

        self._redis = aioredis.from_url(redis_url)
        self._task: asyncio.Task[None] | None = None

    async def read_once(self) -> None:
        raise NotImplementedError

    def read_failed(self, exc: Exception) -> None:
        """Called with what a failed read raised; the view read before stays in place."""

    def start(self) -> None:
        self._task = asyncio.create_task(self._follow())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        await self._redis.aclose()

    async def _follow(self) -> None:
        while True:
            try:
                await self.read_once()
            except (OSError, RedisError) as exc:
                self.read_failed(exc)
                await asyncio.sleep(self.retry_s)
                continue
            if self.pause_s:
                await asyncio.sleep(self.pause_s)
