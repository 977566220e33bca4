"""The TensorRT/pycuda test double checked against the real APIs: TensorRT 10.3.0's Python bindings (imported
through stub libraries, tests/support/api_check.py) and pycuda 2024.1.2's sources.

The downloads are cached (``$K2EDGE_TEST_CACHE``, default ``~/.cache/k2edge-tests``); the tests skip, with the
reason printed, only when there is no C compiler or no package index. A self-check shows that the comparison
catches a wrong name, a wrong parameter list and a wrong enum value put into a copy of the double.
"""

from __future__ import annotations

from enum import IntEnum
from pathlib import Path

import pytest

import api_check
from trt_double import TrtDouble

ROOT = Path(__file__).resolve().parents[1]
BACKEND = sorted((ROOT / "k2edge" / "engine").glob("trt_*.py")) + [ROOT / "k2edge" / "engine" / "tensorrt_backend.py"]


@pytest.fixture(scope="module")
def real_trt():
    try:
        return api_check.real_tensorrt()
    except api_check.Unavailable as exc:
        pytest.skip(f"cannot load the real TensorRT 10.3 bindings: {exc}")


@pytest.fixture(scope="module")
def pycuda_names():
    try:
        return api_check.pycuda_names(api_check.pycuda_sources())
    except api_check.Unavailable as exc:
        pytest.skip(f"cannot read pycuda's sources: {exc}")


@pytest.fixture
def double():
    d = TrtDouble()
    yield d
    d.shutdown()


def test_the_real_bindings_are_tensorrt_10_3(real_trt):
    assert real_trt.__version__ == "10.3.0"
    assert {"Builder", "IBuilderConfig", "Runtime", "OnnxParser", "ICudaEngine"} <= set(dir(real_trt))


def test_every_name_signature_and_enum_of_the_double_is_real(double, real_trt):
    """Classes, methods, properties and enum members of the double exist in TensorRT 10.3, each method's
    parameters fit a real pybind overload, and TensorFormat/DataType values are TensorRT's."""
    assert api_check.check_tensorrt(double.tensorrt, real_trt) == []


def test_every_trt_attribute_the_backend_touches_is_real(real_trt):
    """``trt.X.Y`` spelled in the backend's modules, and the names it looks up with getattr, resolve in 10.3."""
    from k2edge.engine.trt_build import _PRECISION
    from k2edge.engine.trt_spec import FP16_CUT, INT8_CUT, POOLS

    names = api_check.backend_trt_names(BACKEND)
    assert {"BuilderFlag.DIRECT_IO", "BuilderFlag.GPU_FALLBACK", "DeviceType.DLA"} <= names
    names |= {f"MemoryPoolType.{p}" for p in POOLS.values()}
    names |= {f"TensorFormat.{fmt}" for _, fmt in (FP16_CUT, INT8_CUT)} | set(_PRECISION.values())
    assert [n for n in sorted(names) if not api_check.resolve(real_trt, n)] == []


def test_pycuda_names_of_the_double_are_in_pycuda(double, pycuda_names):
    """Functions, classes, methods and flag names of the double's pycuda.driver exist in pycuda 2024.1.2."""
    assert {"retain_primary_context", "compute_capability"} <= pycuda_names["Device"]
    assert {"DISABLE_TIMING", "BLOCKING_SYNC"} <= pycuda_names["event_flags"]
    assert api_check.check_pycuda(double.driver, pycuda_names) == []


def _wrong_name(d):
    d.tensorrt.IBuilderConfig.dla_core = property(lambda self: 0)  # tutorials' spelling; TensorRT's is DLA_core
    return "trt.IBuilderConfig.dla_core does not exist"


def _wrong_parameters(d):
    d.tensorrt.IBuilderConfig.set_memory_pool_limit = lambda self, pool: None
    return "trt.IBuilderConfig.set_memory_pool_limit(self, pool) fits no overload"


def _wrong_value(d):
    members = {m.name: m.value for m in d.tensorrt.TensorFormat}
    d.tensorrt.TensorFormat = IntEnum("TensorFormat", {**members, "CHW32": 6, "DHWC8": 5})
    return "trt.TensorFormat.CHW32 is 5 in TensorRT, 6 in the double"


@pytest.mark.parametrize("mutate", [_wrong_name, _wrong_parameters, _wrong_value])
def test_self_check_a_mistake_in_the_double_is_caught(double, real_trt, mutate):
    """The comparison is not vacuous: a copy of the double with one mistake fails it, naming the mistake."""
    expected = mutate(double)
    problems = api_check.check_tensorrt(double.tensorrt, real_trt)
    assert any(p.startswith(expected) for p in problems), problems


def test_self_check_a_wrong_pycuda_name_is_caught(double, pycuda_names):
    double.driver.Stream.wait_event = lambda self, evt: None  # pycuda's is wait_for_event
    assert api_check.check_pycuda(double.driver, pycuda_names) == ["pycuda.driver.Stream.wait_event does not exist"]
