"""``AdaptiveBatcher`` on a real event loop with a real worker thread: which requests share a
model call, and what a failure or a cancellation does to the others.

The "model" blocks on a ``threading.Event`` until the test lets it finish, so "requests that
arrive while the model runs" are exactly the ones the test submits before releasing it."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
from typing import Any

import pytest

from prefect_ml.integrations.adaptive_batching import AdaptiveBatcher

pytestmark = pytest.mark.timeout(60)  # a batcher that held a request for company would hang


class GatedModel:
    """Records each batch it is called with; each call waits until the test opens the gate."""

    def __init__(self, loop: asyncio.AbstractEventLoop, fail_on: str | None = None) -> None:
        self.loop, self.fail_on = loop, fail_on
        self.batches: list[list[str]] = []
        self.gate = threading.Event()
        self.started = asyncio.Event()

    def __call__(self, items: list[str]) -> list[str]:
        self.batches.append(list(items))
        self.loop.call_soon_threadsafe(self.started.set)
        self.gate.wait()
        if self.fail_on in items:
            raise ValueError(f"the model cannot take {self.fail_on}")
        return [item.upper() for item in items]

    async def running(self) -> None:
        """Until a call has started (then re-arms for the next one)."""
        await self.started.wait()
        self.started.clear()


def run(test: Coroutine[Any, Any, None]) -> None:
    asyncio.run(test)


def test_a_lone_request_runs_at_once_even_with_a_wait_allowed_under_load() -> None:
    async def scenario() -> None:
        model = GatedModel(asyncio.get_running_loop())
        batcher = AdaptiveBatcher(model, max_batch_size=32, max_wait_s=3600)
        model.gate.set()
        first = batcher.submit("a")
        await model.running()  # dispatched with nothing else queued, no hour-long wait
        assert await first == "A"
        second = batcher.submit("b")  # the model is idle again: at once as well
        assert await second == "B"
        assert model.batches == [["a"], ["b"]]
        batcher.close()

    run(scenario())


def test_requests_that_arrive_while_the_model_runs_share_the_next_calls_up_to_the_limit() -> None:
    async def scenario() -> None:
        model = GatedModel(asyncio.get_running_loop())
        batcher = AdaptiveBatcher(model, max_batch_size=3)
        first = batcher.submit("a")
        await model.running()
        later = [batcher.submit(item) for item in "bcdef"]
        model.gate.set()
        assert await asyncio.gather(first, *later) == list("ABCDEF")
        assert model.batches == [["a"], ["b", "c", "d"], ["e", "f"]]
        assert (batcher.stats.batches, batcher.stats.requests) == (3, 6)
        batcher.close()

    run(scenario())


def test_an_exception_fails_every_request_of_its_batch_and_no_other() -> None:
    async def scenario() -> None:
        model = GatedModel(asyncio.get_running_loop(), fail_on="c")
        batcher = AdaptiveBatcher(model, max_batch_size=2)
        first = batcher.submit("a")
        await model.running()
        b, c, d = (batcher.submit(item) for item in "bcd")
        model.gate.set()
        outcomes = await asyncio.gather(first, b, c, d, return_exceptions=True)
        assert model.batches == [["a"], ["b", "c"], ["d"]]
        assert outcomes[0] == "A" and outcomes[3] == "D"
        for failed in outcomes[1:3]:
            assert isinstance(failed, ValueError) and "cannot take c" in str(failed)
        assert await batcher.submit("e") == "E"  # the batcher keeps serving
        batcher.close()

    run(scenario())


def test_a_wrong_number_of_results_fails_the_batch_with_a_message() -> None:
    async def scenario() -> None:
        batcher: AdaptiveBatcher[str, str] = AdaptiveBatcher(lambda items: [], max_batch_size=4)
        with pytest.raises(RuntimeError, match="returned 0 results for 1 requests"):
            await batcher.submit("a")
        batcher.close()

    run(scenario())


def test_a_cancelled_request_leaves_its_batch_and_the_others_are_answered() -> None:
    async def scenario() -> None:
        model = GatedModel(asyncio.get_running_loop())
        batcher = AdaptiveBatcher(model, max_batch_size=2)
        first = batcher.submit("a")
        await model.running()
        b, c, d = (batcher.submit(item) for item in "bcd")
        waiter = asyncio.ensure_future(c)
        await asyncio.sleep(0)
        waiter.cancel()  # a client that went away while its request was queued
        model.gate.set()
        assert await asyncio.gather(first, b, d) == ["A", "B", "D"]
        assert c.cancelled()
        assert model.batches == [["a"], ["b", "d"]]  # "c" took no place in a batch
        batcher.close()

    run(scenario())


def test_a_request_cancelled_while_its_batch_runs_does_not_fail_the_rest() -> None:
    async def scenario() -> None:
        model = GatedModel(asyncio.get_running_loop())
        batcher = AdaptiveBatcher(model, max_batch_size=4)
        first = batcher.submit("a")
        await model.running()
        b, c = batcher.submit("b"), batcher.submit("c")
        model.gate.set()
        await first
        await model.running()  # ["b", "c"] is in the model now
        b.cancel()
        assert await c == "C"
        assert model.batches == [["a"], ["b", "c"]]
        assert await batcher.submit("d") == "D"
        batcher.close()

    run(scenario())


def test_a_wait_under_load_fills_a_batch_that_formed_while_the_model_was_busy() -> None:
    async def scenario() -> None:
        model = GatedModel(asyncio.get_running_loop())
        batcher = AdaptiveBatcher(model, max_batch_size=3, max_wait_s=3600)
        first = batcher.submit("a")
        await model.running()
        b = batcher.submit("b")  # queued while "a" runs: the batch waits for company
        model.gate.set()
        assert await first == "A"
        c, d = batcher.submit("c"), batcher.submit("d")  # fill it, then one for the next
        assert await asyncio.gather(b, c, d) == ["B", "C", "D"]
        assert model.batches == [["a"], ["b", "c", "d"]]
        batcher.close()

    run(scenario())


def test_close_cancels_what_is_queued() -> None:
    async def scenario() -> None:
        model = GatedModel(asyncio.get_running_loop())
        batcher = AdaptiveBatcher(model, max_batch_size=1)
        first = batcher.submit("a")
        await model.running()
        queued = batcher.submit("b")
        batcher.close()
        model.gate.set()
        with pytest.raises(asyncio.CancelledError):
            await queued
        with pytest.raises(asyncio.CancelledError):
            await first  # its consumer was stopped while the call ran

    run(scenario())
