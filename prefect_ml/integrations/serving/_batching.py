"""Adaptive batching: a request that finds the model idle runs at once; requests that arrive
while the model runs go through it together in the next call.

Ray Serve's ``@serve.batch`` (Ray 2.60) starts a batch timer at the first request and forms the
next batch eagerly, before the model is free: a lone request waits out the timer for company that
never comes, and with a zero timer the batches under load are small. Here one consumer per batcher
takes whatever is queued, up to ``max_batch_size``, each time the model is free. A slow model runs
in the batcher's own thread, so the event loop keeps receiving and validating requests meanwhile; a
model whose last call took under ``inline_below_s`` runs on the event loop itself, because for a
sub-millisecond call the hand-off to the thread and back costs more than the call (requests that
arrive during it wait in their sockets and join the next batch all the same).
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Generic, NamedTuple, TypeVar

Item = TypeVar("Item")
Result = TypeVar("Result")


class _Pending(NamedTuple, Generic[Item, Result]):
    item: Item
    future: asyncio.Future[Result]


@dataclass
class BatchStats:
    """What a batcher has run so far: model calls and the requests they answered."""

    batches: int = 0
    requests: int = 0
    inline_batches: int = 0  # of ``batches``: run on the event loop, not in the thread


class AdaptiveBatcher(Generic[Item, Result]):
    """Runs ``run_batch`` over the items submitted, as few calls as the load allows.

    Contract: ``run_batch(items)`` returns one result per item, in order; it runs in this
    batcher's thread, one call at a time. A batch is formed each time the model is free, from
    everything queued (oldest first, at most ``max_batch_size``); a request that finds the queue
    empty and the model idle is dispatched at once, never held for company. ``max_wait_s`` > 0
    lets a batch that formed while the model was busy but is not full wait up to that long for
    more requests before it runs (0, the default: never wait). While the last call took less than
    ``inline_below_s``, the next runs on the event loop instead of the thread (0, the default:
    always the thread; the first call always runs in the thread). An exception of ``run_batch``
    fails every request of that batch with it, and only those; a cancelled request is dropped
    from its batch before the call, and the others are not affected.
    """

    def __init__(
        self,
        run_batch: Callable[[list[Item]], list[Result]],
        *,
        max_batch_size: int,
        max_wait_s: float = 0.0,
        inline_below_s: float = 0.0,
        name: str = "batch",
    ) -> None:
        if max_batch_size < 1 or max_wait_s < 0 or inline_below_s < 0:
            raise ValueError(
                f"max_batch_size {max_batch_size} < 1, or max_wait_s {max_wait_s} or "
                f"inline_below_s {inline_below_s} < 0"
            )
        self.max_batch_size, self.max_wait_s = max_batch_size, max_wait_s
        self.inline_below_s = inline_below_s
        self.stats = BatchStats()
        self._last_call_s = math.inf  # nothing measured yet: the first call runs in the thread
        self._run_batch = run_batch
        self._queue: deque[_Pending[Item, Result]] = deque()
        self._arrived = asyncio.Event()
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"prefect-ml-{name}")
        self._consumer: asyncio.Task[None] | None = None
        self._retired = False

    def submit(self, item: Item) -> asyncio.Future[Result]:
        """Queue ``item`` now; the future resolves with its result (cancel it to withdraw)."""
        loop = asyncio.get_running_loop()
        if self._consumer is None or self._consumer.done():
            self._consumer = loop.create_task(self._consume())
        future: asyncio.Future[Result] = loop.create_future()
        self._queue.append(_Pending(item, future))
        self._arrived.set()
        return future

    def close(self) -> None:
        """Stop the consumer and cancel what is still queued; a running call finishes alone."""
        if self._consumer is not None:
            self._consumer.cancel()
        while self._queue:
            self._queue.popleft().future.cancel()
        self._thread.shutdown(wait=False)

    def retire(self) -> None:
        """Stop once what is queued has run (a request that held the model before it was let
        go still gets its answer); the thread ends with the last reference to the batcher."""
        self._retired = True
        self._arrived.set()

    async def _consume(self) -> None:
        while True:
            await self._arrival()
            if self._retired and not self._queue:
                return
            batch = self._take()  # the model was idle: what is queued runs at once
            while batch:
                await self._run(batch)
                if self.max_wait_s and 0 < len(self._queue) < self.max_batch_size:
                    await self._company()  # queued while the model ran: it may wait for more
                batch = self._take()

    async def _arrival(self) -> None:
        """Until something is queued (at once if something is), or the batcher retired."""
        while not self._queue and not self._retired:
            self._arrived.clear()
            await self._arrived.wait()

    async def _company(self) -> None:
        try:
            async with asyncio.timeout(self.max_wait_s):
                while len(self._queue) < self.max_batch_size:
                    self._arrived.clear()
                    await self._arrived.wait()
        except TimeoutError:
            pass

    def _take(self) -> list[_Pending[Item, Result]]:
        batch: list[_Pending[Item, Result]] = []
        while self._queue and len(batch) < self.max_batch_size:
            pending = self._queue.popleft()
            if not pending.future.done():  # a cancelled request takes no place in the batch
                batch.append(pending)
        return batch

    async def _run(self, batch: list[_Pending[Item, Result]]) -> None:
        items = [pending.item for pending in batch]
        try:
            if self._last_call_s < self.inline_below_s:
                self.stats.inline_batches += 1
                results = self._timed_call(items)
            else:
                loop = asyncio.get_running_loop()
                results = await loop.run_in_executor(self._thread, self._timed_call, items)
            if len(results) != len(items):
                raise RuntimeError(
                    f"the batch function returned {len(results)} results for {len(items)} requests"
                )
        except asyncio.CancelledError:
            for pending in batch:
                pending.future.cancel()
            raise
        except Exception as exc:
            for pending in batch:
                if not pending.future.done():
                    pending.future.set_exception(exc)
            return
        finally:
            self.stats.batches += 1
            self.stats.requests += len(items)
        for pending, result in zip(batch, results, strict=True):
            if not pending.future.done():
                pending.future.set_result(result)

    def _timed_call(self, items: list[Item]) -> list[Result]:
        started = time.perf_counter()
        try:
            return self._run_batch(items)
        finally:
            self._last_call_s = time.perf_counter() - started
