"""The fallback timer: jobs due together go in one call, in time order; a reply is given once."""

from __future__ import annotations

import threading
import time

from k2edge.deadline import clock
from k2edge.service.fallback import FallbackTimer, Settled


def test_jobs_due_together_are_fired_in_one_call_in_time_order_and_later_ones_wait():
    """Two jobs already due are handed over together (earliest first); one due later comes in a call of its own."""
    calls, fired = [], threading.Event()

    def fire(jobs):
        calls.append([job for _, job in jobs])
        if sum(len(c) for c in calls) == 3:
            fired.set()

    timer = FallbackTimer(fire)
    now = clock()
    timer.arm(now - 0.2, "b")
    timer.arm(now - 0.5, "a")
    timer.arm(now + 0.3, "c")
    timer.start()
    assert fired.wait(10)
    timer.stop()
    assert calls == [["a", "b"], ["c"]]
    assert timer.margin() >= 2 * 0.5  # the earliest of the first call was due half a second before it ran


def test_a_reply_from_two_places_is_claimed_once():
    """Eight threads race to claim one reply: exactly one wins."""
    settled, wins, go = Settled(), [], threading.Barrier(8)

    def race():
        go.wait()
        if settled.claim():
            wins.append(threading.get_ident())

    threads = [threading.Thread(target=race) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(wins) == 1 and settled.taken


def test_a_timer_observes_late_deliveries_and_arms_later_jobs_earlier():
    """A reply delivered 40 ms after its job was due widens the margin to twice that."""
    timer = FallbackTimer(lambda jobs: None)
    assert timer.margin() == 0.0
    timer.observe(0.04)
    timer.observe(0.01)
    assert abs(timer.margin() - 0.08) < 1e-9


def test_a_late_delivery_moves_the_jobs_already_waiting_earlier_but_never_before_their_floor():
    """Jobs armed in a burst fire by the margin their predecessors taught the timer, not the one they were armed with."""
    fired, first = [], threading.Event()

    def fire(jobs):
        fired.extend(job for _, job in jobs)
        first.set()

    timer = FallbackTimer(fire)
    now = clock()
    timer.arm(now + 600, "early", floor=now)
    timer.arm(now + 600, "held", floor=now + 300)
    timer.start()
    assert not first.wait(0.2)  # nothing is due yet
    timer.observe(300.0)  # a reply reached the broker 300 s late: every job now fires 600 s early
    assert first.wait(10)
    timer.stop()
    assert fired == ["early"]  # "held" keeps its floor, 300 s away


def test_the_jobs_fired_are_let_go_at_once():
    """The timer's thread kept its last batch of fired jobs until another job fired (possibly never): their requests,
    local answers and the engines a held local answer keeps through a deploy stayed alive with them."""
    import gc
    import weakref

    class Job:
        pass

    fired = threading.Event()
    timer = FallbackTimer(lambda due: fired.set())
    timer.start()
    try:
        job = Job()
        gone = weakref.ref(job)
        timer.arm(clock() + 0.05, job)
        del job
        assert fired.wait(30)
        end = time.monotonic() + 30
        while gone() is not None and time.monotonic() < end:  # the thread records the lateness, then lets go
            time.sleep(0.01)
            gc.collect()
        assert gone() is None
    finally:
        timer.stop()
