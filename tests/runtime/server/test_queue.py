"""RequestQueue on its own: FIFO order, the bound, cancellation, errors (real threads)."""
from __future__ import annotations

import asyncio
import threading

import pytest

from runtime.server.queue import QueueClosed, QueueFull, RequestQueue


def _run(coro):
    return asyncio.run(asyncio.wait_for(coro, timeout=30))


async def _drain(job) -> list:
    return [item async for item in job]


async def _until(predicate) -> None:
    while not predicate():
        await asyncio.sleep(0.005)


def test_jobs_run_one_at_a_time_in_submission_order() -> None:
    order: list[int] = []
    active = []

    def work(i: int):
        def run(cancel: threading.Event):
            active.append(i)
            assert len(active) == 1, "two jobs ran at once"
            order.append(i)
            yield i
            active.remove(i)
        return run

    async def main():
        queue = RequestQueue(max_waiting=8)
        jobs = [queue.submit(work(i)) for i in range(5)]
        results = await asyncio.gather(*(_drain(j) for j in jobs))
        queue.close()
        return results

    assert _run(main()) == [[0], [1], [2], [3], [4]]
    assert order == [0, 1, 2, 3, 4]


def test_bound_counts_waiting_jobs_only() -> None:
    release = threading.Event()

    def blocking(cancel: threading.Event):
        yield "started"
        release.wait(10)
        yield "done"

    def quick(cancel: threading.Event):
        yield "quick"

    async def main():
        queue = RequestQueue(max_waiting=1)
        running = queue.submit(blocking)
        items = running.__aiter__()
        assert await items.__anext__() == "started"
        assert queue.stats().running == 1
        waiting = queue.submit(quick)              # one may wait
        with pytest.raises(QueueFull):
            queue.submit(quick)                    # a second may not
        assert queue.stats().waiting == 1
        release.set()
        assert [x async for x in items] == ["done"]
        assert await _drain(waiting) == ["quick"]
        await _until(lambda: queue.stats().running == 0)
        assert await _drain(queue.submit(quick)) == ["quick"]
        queue.close()

    _run(main())


def test_cancelling_stops_the_running_job_and_skips_a_waiting_one() -> None:
    ran: list[str] = []
    stopped = threading.Event()

    def endless(cancel: threading.Event):
        ran.append("endless")
        try:
            while True:
                yield "tick"
                if cancel.wait(0.001):
                    return
        finally:
            stopped.set()

    def never(cancel: threading.Event):
        ran.append("never")
        yield "should not run"

    def after(cancel: threading.Event):
        ran.append("after")
        yield "after"

    async def main():
        queue = RequestQueue(max_waiting=4)
        first = queue.submit(endless)
        skipped = queue.submit(never)
        last = queue.submit(after)
        async for _ in first:      # the consumer leaves after one item and cancels its job,
            break                  # as a handler does when its client goes away
        first.cancel.set()
        skipped.cancel.set()
        assert await _drain(last) == ["after"]
        assert await _drain(skipped) == []
        queue.close()

    _run(main())
    assert stopped.is_set()
    assert ran == ["endless", "after"]


def test_a_failing_job_raises_in_its_consumer_and_the_queue_goes_on() -> None:
    def broken(cancel: threading.Event):
        yield 1
        raise ValueError("engine exploded")

    def fine(cancel: threading.Event):
        yield 2

    async def main():
        queue = RequestQueue(max_waiting=4)
        bad, good = queue.submit(broken), queue.submit(fine)
        with pytest.raises(ValueError, match="engine exploded"):
            await _drain(bad)
        assert await _drain(good) == [2]
        queue.close()
        with pytest.raises(QueueClosed):
            queue.submit(fine)

    _run(main())


def test_a_waiting_job_whose_client_left_leaves_the_queue_at_once() -> None:
    release = threading.Event()
    ran: list[str] = []

    def blocking(cancel: threading.Event):
        yield "started"
        release.wait(10)

    def waiter(name: str):
        def run(cancel: threading.Event):
            ran.append(name)
            yield name
        return run

    async def main():
        queue = RequestQueue(max_waiting=2)
        running = queue.submit(blocking).__aiter__()
        assert await running.__anext__() == "started"
        left_a, left_b = queue.submit(waiter("a")), queue.submit(waiter("b"))
        with pytest.raises(QueueFull):
            queue.submit(waiter("x"))
        left_a.cancel.set()                 # both clients disconnect while waiting
        left_b.cancel.set()
        assert queue.stats().waiting == 0   # at once, not when the running job ends
        stays = [queue.submit(waiter("c")), queue.submit(waiter("d"))]
        assert queue.stats().waiting == 2
        release.set()
        assert [await _drain(j) for j in stays] == [["c"], ["d"]]
        assert await _drain(left_a) == [] and await _drain(left_b) == []
        queue.close()

    _run(main())
    assert ran == ["c", "d"]


def test_a_reservation_holds_a_place_until_submitted_or_released() -> None:
    """A request being prepared holds its place (counted as waiting): the next one past the
    bound is refused before any of its work; the place becomes the job, or is given back."""
    release = threading.Event()

    def blocking(cancel: threading.Event):
        release.wait(10)
        yield "done"

    async def main():
        queue = RequestQueue(max_waiting=1)
        running = queue.submit(blocking)
        await _until(lambda: queue.stats().running == 1)
        place = queue.reserve()
        assert queue.stats().waiting == 1
        with pytest.raises(QueueFull):
            queue.reserve()
        with pytest.raises(QueueFull):
            queue.submit(blocking)
        place.release()
        place.release()                            # a second release does nothing
        assert queue.stats().waiting == 0
        with queue.reserve() as place:             # the job takes the place it holds
            job = queue.submit(lambda cancel: iter(["after"]), place)
        assert queue.stats().waiting == 1          # (leaving the block gives nothing back)
        with pytest.raises(QueueFull):
            queue.reserve()
        release.set()
        results = await asyncio.gather(_drain(running), _drain(job))
        assert queue.stats().waiting == 0
        queue.close()
        with pytest.raises(QueueClosed):
            queue.reserve()
        return results

    assert _run(main()) == [["done"], ["after"]]


def test_a_reservation_on_an_idle_worker_is_not_waiting() -> None:
    """With a worker idle, a place is taken without counting against max_waiting=0."""
    async def main():
        queue = RequestQueue(max_waiting=0, workers=2)
        first, second = queue.reserve(), queue.reserve()
        with pytest.raises(QueueFull):
            queue.reserve()
        jobs = [queue.submit(lambda cancel: iter([1]), first),
                queue.submit(lambda cancel: iter([2]), second)]
        results = await asyncio.gather(*(_drain(j) for j in jobs))
        queue.close()
        return results

    assert _run(main()) == [[1], [2]]
