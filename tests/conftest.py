"""Shared fixtures: the demo model and data, an isolated engine cache, small hand-built graphs, and
the daemon tests' real infrastructure (a mosquitto broker per test, daemons as subprocesses)."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "models" / "digits"
sys.path.insert(0, str(Path(__file__).parent))  # tests/zoo.py, tests/graphs.py


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


@pytest.fixture(scope="module")
def slow_model(tmp_path_factory) -> Path:
    """A deliberately heavy conv chain (~100 ms per request here) for queueing and draining tests."""
    import onnx

    import graphs

    path = tmp_path_factory.mktemp("slow") / "slow.onnx"
    onnx.save(graphs.conv_chain(n_convs=6, channels=64, size=96), str(path))
    return path


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
            try:
                watcher.wait_for(lambda c: any(s.get("state") == "online" and s.get("device") == device
                                               and s.get("time", 0) >= since for s in c.statuses), 120)
            except TimeoutError:
                raise AssertionError(d.output()) from None
            finally:
                watcher.close()
        return d

    yield start
    for d in started:
        d.kill()
