"""The batcher over its clients, on a real ONNX model: requests first, then one frame per stream, each
client finished with its own rows; the batcher itself never looks at what an item is."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from k2edge.config.schema import ModelConfig
from k2edge.service.batcher import OVERLAP_S, BatchClient, Batcher
from k2edge.service.runtime import ModelRuntime
from k2edge.telemetry import thermal_sampler


class Item:
    def __init__(self, tag: str, received: float = 0.0) -> None:
        self.tag, self.received, self.sample = tag, received, None


class Recorder(BatchClient):
    """A client that keeps what it was asked to do; ``holds`` and ``drains`` as given."""

    def __init__(self, cond, items=(), holds=False, drains=False, bad_stage=False) -> None:
        self.cond, self.items, self.holds, self.drains, self.bad_stage = cond, list(items), holds, drains, bad_stage
        self.finished: list[tuple[list[str], int]] = []  # (tags, rows) per batch
        self.failed: list[str] = []
        self.done = threading.Event()

    def ready(self):
        return bool(self.items)

    def oldest(self):
        return self.items[0].received

    def take(self, room):
        taken, self.items = self.items[:room], self.items[room:]
        return taken

    def stage(self, rt, items):
        if self.bad_stage:
            raise RuntimeError("cannot stage")
        for it in items:
            it.sample = np.zeros(rt.sample_shape, dtype=rt.input_dtype)
        return items

    def finish(self, rt, items, rows, started):
        assert not isinstance(rows, Exception), rows
        self.finished.append(([it.tag for it in items], {len(v) for v in rows.values()}.pop()))
        self.done.set()

    def fail(self, items, exc):
        self.failed += [it.tag for it in items]
        self.done.set()


@pytest.fixture(scope="module")
def runtime(demo_model):
    rt = ModelRuntime(ModelConfig(name="m", onnx=demo_model), 8, None, None)
    rt.activate()
    yield rt
    rt.deactivate()


def test_one_batch_takes_the_requests_first_then_the_frames_each_client_with_its_own_rows(runtime):
    """Three requests and two frames waiting, room for four: the batch is the three requests and one frame,
    each client gets exactly its rows; the left-over frame goes in the next batch."""
    cond = threading.Condition()
    requests = Recorder(cond, [Item(f"r{i}") for i in range(3)], holds=True, drains=True)
    frames = Recorder(cond, [Item("f0"), Item("f1")])
    b = Batcher("m", runtime, thermal_sampler(), [requests, frames], cond, 0.0)
    b.max_batch = 4  # the demo runtime's largest engine is 8; a smaller room shows the priority
    b.start()
    assert requests.done.wait(20) and frames.done.wait(20)
    b.stop()
    assert requests.finished == [(["r0", "r1", "r2"], 3)]
    # the two batches may run at once on the lanes' workers and finish in either order
    assert sorted(frames.finished) == [(["f0"], 1), (["f1"], 1)]
    assert not requests.failed and not frames.failed


def test_a_client_that_cannot_stage_fails_its_items_and_the_batcher_keeps_running(runtime):
    """A client's stage raising fails the items of that batch (each client told of its own) and the next batch runs."""
    cond = threading.Condition()
    bad = Recorder(cond, [Item("x")], holds=True, drains=True, bad_stage=True)
    b = Batcher("m", runtime, thermal_sampler(), [bad], cond, 0.0)
    b.start()
    assert bad.done.wait(20)
    assert bad.failed == ["x"] and not bad.finished
    bad.bad_stage, bad.done = False, threading.Event()
    with cond:
        bad.items.append(Item("y"))
        cond.notify()
    assert bad.done.wait(20)
    b.stop()
    assert bad.finished == [(["y"], 1)] and b.alive(max_age=5.0) is False  # stopped


def test_a_lone_item_on_an_idle_engine_with_lanes_runs_in_the_callers_thread(demo_model):
    """An engine with a worker per core (threads_per_lane 0): take_idle() still gives a lone item to its caller's
    thread, which finishes it before run() returns without any lane running it; the next batch goes to the lanes."""
    rt = ModelRuntime(ModelConfig(name="m", onnx=demo_model), 8, None, None, threads_per_lane=0)
    rt.activate()
    try:
        cond = threading.Condition()
        client = Recorder(cond)
        b = Batcher("m", rt, thermal_sampler(), [client], cond, 0.0)
        b.start()
        assert b.take_idle()
        caller = threading.get_ident()
        ran_in = []
        real_infer = rt.infer

        def infer(samples):
            ran_in.append(threading.get_ident())
            return real_infer(samples)

        rt.infer = infer
        b.run([(client, [Item("lone")])], inline=True)
        assert client.finished == [(["lone"], 1)] and ran_in == [caller]
        assert sum(lane.runs for lane in rt.engines[1].lanes()) == 0
        client.done.clear()
        with cond:
            client.items.append(Item("queued"))
            cond.notify()
        assert client.done.wait(20)
        b.stop()
        assert [tags for tags, _ in client.finished] == [["lone"], ["queued"]]
    finally:
        rt.deactivate()


class SlowStaging(Recorder):
    """Staging that takes ``seconds`` (as decoding a batch of JPEGs does)."""

    seconds = 0.005

    def stage(self, rt, items):
        import time

        time.sleep(self.seconds)
        return super().stage(rt, items)


def test_a_quick_model_runs_its_batches_here_unless_staging_them_took_long_enough_for_the_workers_to_pay(demo_model):
    """A model quick enough to run its batches on the batcher's thread still gives a batch to the lanes' workers when
    staging it took OVERLAP_S or more: the next batch is then staged while this one runs (the demo detector's JPEG
    requests, 1.41x the peer against 1.22x all inline in bench_peer)."""
    rt = ModelRuntime(ModelConfig(name="m", onnx=demo_model), 8, None, None, threads_per_lane=0)
    rt.activate()
    try:
        if len(rt.lanes()) < 2:
            pytest.skip("one core: one lane, nothing to hand a batch to")
        rt.batch1_s = 0.0  # as quick as a model gets
        cond = threading.Condition()
        client = SlowStaging(cond)
        b = Batcher("m", rt, thermal_sampler(), [client], cond, 0.0)
        assert b.inline and b.slots == len(rt.lanes()) + 1
        assert b.runs_here(0.0) and b.runs_here(OVERLAP_S / 2) and not b.runs_here(OVERLAP_S)
        b.start()
        with cond:
            client.items += [Item("a"), Item("b")]
            cond.notify()
        assert client.done.wait(20)
        b.stop()
        assert client.finished == [(["a", "b"], 2)]
        assert sum(lane.runs for lane in rt.engines[1].lanes()) >= 1  # a worker ran it
    finally:
        rt.deactivate()


def test_a_local_answer_held_for_later_outlives_a_swap_that_deactivates_its_engines(demo_model, tmp_path):
    """In the hot state a request decided before inference carries its local answer, to run later, into the cloud
    hand-off (the fallback at its deadline, or on a cloud failure). A deploy meanwhile swaps the batcher to the new
    version and deactivates the old one: the held answer still runs on the engines it was staged for (it used to
    raise 'backend is not active', answered as an internal error), and they are released once it is gone."""
    import functools
    import gc

    from k2edge.service.request_path import run_one

    cache = tmp_path / "cache"
    old = ModelRuntime(ModelConfig(name="m", onnx=demo_model), 4, None, cache).activate()
    new = ModelRuntime(ModelConfig(name="m", onnx=demo_model), 4, None, cache, version="2").activate()
    cond = threading.Condition()
    batcher = Batcher("m", old, thermal_sampler(), [], cond, 0.0)
    batcher.start()
    try:
        sample, geometry = old.stage(None, np.zeros(old.sample_shape, dtype=old.input_dtype), 10**7)
        item = type("Item", (), {})()
        item.sample, item.geometry, item.req, item.result = sample, geometry, type("Req", (), {"top_k": None})(), None
        later = old.held(functools.partial(run_one, old, item))
        assert batcher.swap(new, 30.0) is old
        old.deactivate()  # what the deploy does once the swap is done
        engines = list(old._all())
        assert all(e.active for e in engines)  # held: not released yet
        local = later()
        assert local.top_k and item.result is not None
        del later
        gc.collect()
        assert not any(e.active for e in engines)  # the last held answer gone: released
        plain = ModelRuntime(ModelConfig(name="m", onnx=demo_model), 4, None, cache).activate()
        plain.deactivate()  # nothing held: released at once
        assert not any(e.active for e in plain._all())
    finally:
        batcher.stop()
        new.deactivate()
