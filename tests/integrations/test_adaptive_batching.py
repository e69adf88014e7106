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

from prefect_ml.integrations.serving import AdaptiveBatcher

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


class ThreadRecordingModel:
    """Records, per call, its batch and whether it ran on the event loop's own thread; an item
    named "slow" makes its call last ``slow_s``."""

    def __init__(self, slow_s: float = 0.0) -> None:
        self.slow_s = slow_s
        self.loop_thread = threading.get_ident()
        self.calls: list[tuple[list[str], bool]] = []

    def __call__(self, items: list[str]) -> list[str]:
        self.calls.append((list(items), threading.get_ident() == self.loop_thread))
        if "slow" in items:
            threading.Event().wait(self.slow_s)
        if "bad" in items:
            raise ValueError("the model cannot take bad")
        return [item.upper() for item in items]


def test_a_fast_model_runs_on_the_event_loop_after_its_first_call_and_still_batches() -> None:
    async def scenario() -> None:
        model = ThreadRecordingModel()
        batcher = AdaptiveBatcher(model, max_batch_size=8, inline_below_s=3600)
        assert await batcher.submit("a") == "A"  # nothing measured yet: the thread
        assert await batcher.submit("b") == "B"  # the last call was fast: on the loop
        queued = [batcher.submit(item) for item in "cde"]  # all queued before the model runs
        assert await asyncio.gather(*queued) == ["C", "D", "E"]
        assert model.calls == [(["a"], False), (["b"], True), (["c", "d", "e"], True)]
        assert (batcher.stats.batches, batcher.stats.inline_batches) == (3, 2)
        batcher.close()

    run(scenario())


def test_a_call_slower_than_the_inline_bound_sends_the_next_one_to_the_thread() -> None:
    async def scenario() -> None:
        model = ThreadRecordingModel(slow_s=1.2)
        batcher = AdaptiveBatcher(model, max_batch_size=8, inline_below_s=1.0)
        for item in ("a", "b", "slow", "c", "d"):
            assert await batcher.submit(item) == item.upper()
        on_loop = [inline for _, inline in model.calls]
        assert on_loop == [False, True, True, False, True]  # "c" followed the 1.2 s call
        batcher.close()

    run(scenario())


def test_an_inline_call_that_raises_fails_its_batch_only_and_the_batcher_keeps_serving() -> None:
    async def scenario() -> None:
        model = ThreadRecordingModel()
        batcher = AdaptiveBatcher(model, max_batch_size=8, inline_below_s=3600)
        assert await batcher.submit("a") == "A"
        with pytest.raises(ValueError, match="cannot take bad"):
            await batcher.submit("bad")
        assert await batcher.submit("b") == "B"
        assert [inline for _, inline in model.calls] == [False, True, True]
        batcher.close()

    run(scenario())


def test_with_no_inline_bound_every_call_runs_in_the_thread() -> None:
    async def scenario() -> None:
        model = ThreadRecordingModel()
        batcher = AdaptiveBatcher(model, max_batch_size=8)
        for item in "abc":
            assert await batcher.submit(item) == item.upper()
        assert [inline for _, inline in model.calls] == [False, False, False]
        assert batcher.stats.inline_batches == 0
        batcher.close()

    run(scenario())


def test_a_retired_batcher_answers_what_is_queued_then_its_consumer_ends() -> None:
    """A version unloaded while requests wait for it (serving._versions): they are answered,
    and nothing keeps the batcher (and its model) alive afterwards."""

    async def scenario() -> None:
        model = GatedModel(asyncio.get_running_loop())
        batcher = AdaptiveBatcher(model, max_batch_size=8)
        first = batcher.submit("a")
        await model.running()
        queued = [batcher.submit("b"), batcher.submit("c")]
        batcher.retire()
        model.gate.set()
        assert [await first, *[await f for f in queued]] == ["A", "B", "C"]
        consumer = batcher._consumer
        assert consumer is not None
        await asyncio.wait_for(consumer, timeout=5)  # ended, not waiting for more
        late = batcher.submit("d")  # a request that held the version before it was unloaded
        assert await late == "D"
        assert model.batches == [["a"], ["b", "c"], ["d"]]

    run(scenario())
