"""The fallback timer: jobs due together go in one call, in time order; a reply is given once."""

from __future__ import annotations

import threading

from k2edge.deadline import clock
from k2edge.service.fallback import FallbackTimer, Settled


def test_jobs_due_together_are_fired_in_one_call_in_time_order_and_later_ones_wait():
    """Two jobs already due are handed over together (earliest first); one due later comes in a call of its own."""
    calls, fired = [], threading.Event()

    def fire(jobs):
        calls.append(list(jobs))
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
