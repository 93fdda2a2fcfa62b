"""Run many episodes at once in one asyncio event loop, and keep a failing environment
from taking the producer down.

``EnvPool.run`` keeps up to ``concurrency`` jobs in flight, drawn from a (possibly
endless) iterator, and yields each job's result as it completes; a job that raises or
overruns its ``timeout`` yields an ``EpisodeError`` and the pool goes on. ``call_env``
runs one blocking environment method in a thread under a timeout and names what went
wrong ("env_crash", "timeout"), for the agent to record as the episode's finish_reason.
A timed-out environment thread cannot be killed; it is abandoned, and ``asyncio.run``
waits for it at exit (environments that can hang should do their slow work in the
sandbox, which kills).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any, AsyncIterator, Awaitable, Callable, Iterable

log = logging.getLogger(__name__)


@dataclass
class EpisodeError:
    reason: str  # "env_crash" or "timeout"
    error: BaseException | None


async def call_env(fn: Callable, *args: Any, timeout: float) -> tuple[Any, str | None]:
    """(fn(*args), None), or (None, "timeout" | "env_crash")."""
    if timeout <= 0:
        return None, "timeout"
    try:
        return await asyncio.wait_for(asyncio.to_thread(fn, *args), timeout), None
    except asyncio.TimeoutError:
        return None, "timeout"
    except Exception as e:  # the environment's own failure, whatever it is
        log.warning("environment %s failed: %r", getattr(fn, "__qualname__", fn), e)
        return None, "env_crash"


class EnvPool:
    def __init__(self, concurrency: int = 64, timeout: float | None = None) -> None:
        if concurrency < 1:
            raise ValueError("concurrency must be >= 1")
        self.concurrency, self.timeout = concurrency, timeout

    async def run(self, jobs: Iterable[Callable[[], Awaitable[Any]]]) -> AsyncIterator[Any]:
        jobs = iter(jobs)
        running: set[asyncio.Task] = set()
        while True:
            while len(running) < self.concurrency:
                job = next(jobs, None)
                if job is None:
                    break
                running.add(asyncio.ensure_future(asyncio.wait_for(job(), self.timeout)))
            if not running:
                return
            done, running = await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                yield self._result(task)

    @staticmethod
    def _result(task: asyncio.Task) -> Any:
        try:
            return task.result()
        except asyncio.TimeoutError as e:
            return EpisodeError("timeout", e)
        except Exception as e:
            log.exception("episode failed")
            return EpisodeError("env_crash", e)
