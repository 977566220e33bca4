"""Shared fixtures: the demo model and data, an isolated engine cache, small hand-built graphs."""

from __future__ import annotations

import sys
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
