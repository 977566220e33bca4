"""Shared fixtures: the demo model and data, an isolated engine cache, small hand-built graphs, and
the daemon tests' real infrastructure (a mosquitto broker per test, daemons as subprocesses)."""

from __future__ import annotations

import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "models" / "digits"
sys.path.insert(0, str(Path(__file__).parent / "support"))  # the tests' helpers: tests/support/*.py


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path_factory, monkeypatch):
    """Every test gets the session's cache dir unless it asks for its own; never ~/.cache."""
    monkeypatch.setenv("K2EDGE_CACHE_DIR", str(_session_cache(tmp_path_factory)))


_CACHE: list[Path] = []


def _session_cache(factory) -> Path:
    if not _CACHE:
        _CACHE.append(factory.mktemp("k2edge-cache"))
    return _CACHE[0]


@pytest.fixture
def cache_dir(tmp_path) -> Path:
    """A fresh, empty engine cache for tests that inspect the cache itself."""
    return tmp_path / "cache"


@pytest.fixture(scope="session")
def demo_model() -> Path:
    return DEMO / "model.onnx"


@pytest.fixture(scope="session")
def demo_eval():
    from k2edge.model.datasets import open_dataset

    return open_dataset(DEMO / "eval.npz")


@pytest.fixture(scope="session")
def demo_batch() -> np.ndarray:
    """A few real demo images staged as model inputs (batch 1 each)."""
    from k2edge.model.ingest import normalise
    from k2edge.tasks.preprocess import Preprocess

    nm = normalise(DEMO / "model.onnx")
    pre = Preprocess.for_model(nm.metadata(), nm.graph.shape("input"))
    with np.load(DEMO / "eval.npz") as d:
        x = d["x"][:8]
    return np.stack([pre.stage(img)[None] for img in x])  # (8, 1, 1, 32, 32)


# the daemon against a real broker ------------------------------------------------------------------
@pytest.fixture
def broker(tmp_path):
    """mosquitto with persistence on a free loopback port."""
    from mqtt_support import Broker

    b = Broker(tmp_path / "broker").start()
    yield b
    b.stop()


SLOW_TARGET_S = 0.1  # the least one request to the slow model takes, on whatever machine runs the tests


@dataclass(frozen=True)
class SlowModel:
    """A conv chain made as deep, on the machine running the tests, as makes one batch-1 request take at
    least ``SLOW_TARGET_S`` (and at most three times that); ``seconds`` is its measured time (the fastest of
    several runs through the daemon's own engine settings), so tests size their load from it instead of
    assuming a speed."""

    path: Path
    convs: int
    seconds: float
    input_shape: tuple[int, ...] = (3, 96, 96)

    def model(self, name: str = "slow") -> dict:
        """The daemon config's model entry."""
        return {"name": name, "onnx": self.path, "profile": "cpu-dev"}

    def requests_for(self, seconds: float) -> int:
        """How many requests, run one after another, take at least ``seconds`` of inference."""
        return max(1, math.ceil(seconds / self.seconds))


_SLOW_KEY = pytest.StashKey[SlowModel]()


def _seconds_per_request(path: Path, cache: Path, runs: int = 5) -> float:
    from k2edge.engine.engine import Engine

    x = {"x": np.zeros((1, *SlowModel.input_shape), np.float32)}
    with Engine.build(path, "cpu-dev", cache_dir=cache, spinning=False) as engine:  # as the daemon builds it
        assert all(np.isfinite(y).all() for y in engine.infer(x).values()), "the slow model's outputs overflow"
        times = []
        for _ in range(runs):
            t0 = time.perf_counter()
            engine.infer(x)
            times.append(time.perf_counter() - t0)
    return min(times)  # the fastest: the machine at its quietest, so "at least" holds when it is quieter still


@pytest.fixture(scope="session")
def slow_model(tmp_path_factory, pytestconfig) -> SlowModel:
    """The slow model, sized here and now: a chain as deep as makes one request take between
    ``SLOW_TARGET_S`` and three times that (well inside the 1 s deadlines the tests give it)."""
    import onnx

    import graphs

    folder = tmp_path_factory.mktemp("slow")
    convs, seconds, tried = 2, 0.0, []
    for _ in range(8):
        path = folder / f"slow-{convs}.onnx"
        if not path.exists():
            onnx.save(graphs.conv_chain(n_convs=convs, channels=64, size=SlowModel.input_shape[-1], he_init=True), str(path))
        seconds = _seconds_per_request(path, folder / "cache")
        tried.append(f"{convs} convs: {seconds * 1e3:.1f} ms")
        if SLOW_TARGET_S <= seconds <= 3 * SLOW_TARGET_S:
            break
        # aim for 1.5x the target: the time per conv is linear in depth, give or take the machine's noise
        convs = min(1000, max(1, round(convs * 1.5 * SLOW_TARGET_S / seconds)))
    else:
        if seconds < SLOW_TARGET_S:
            pytest.fail(f"cannot make a slow model on this machine ({'; '.join(tried)})")
    slow = SlowModel(path, int(path.stem.split("-")[1]), seconds)
    pytestconfig.stash[_SLOW_KEY] = slow
    return slow


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    slow = config.stash.get(_SLOW_KEY, None)
    if slow is not None:
        terminalreporter.write_line(f"slow_model: {slow.convs} convs, {slow.seconds * 1e3:.1f} ms per request "
                                    f"(measured on this machine; target >= {SLOW_TARGET_S * 1e3:.0f} ms)")


@pytest.fixture
def run_daemon(tmp_path, broker):
    """Start ``k2edge serve`` against ``broker``; by default wait until its status says online."""
    from mqtt_support import DIGITS, Client, DaemonProcess, write_config

    started = []

    def start(models=(DIGITS,), device="t1", wait=True, env=None, verbose=False, **kw):
        since = time.time()
        cfg = write_config(tmp_path / f"{device}-{len(started)}.toml", broker.port, list(models), device=device, **kw)
        d = DaemonProcess(cfg, tmp_path / f"{device}-{len(started)}.log", env, verbose=verbose).start()
        started.append(d)
        if wait:
            watcher = Client(broker.port).connect()
            try:  # online, or the daemon exited (a refused config): its output says why, at once
                watcher.wait_for(lambda c: d.proc.poll() is not None or any(
                    s.get("state") == "online" and s.get("device") == device and s.get("time", 0) >= since
                    for s in c.statuses), 120)
            except TimeoutError:
                raise AssertionError(d.output()) from None
            finally:
                watcher.close()
            if d.proc.poll() is not None:
                raise AssertionError(f"the daemon exited ({d.proc.returncode}) before it was online:\n{d.output()}")
        return d

    yield start
    for d in started:
        d.kill()
