"""The test double's pycuda, held to the real pycuda on a GPU.

The TensorRT backend's tests run against ``trt_double``, whose ``pycuda.driver`` says what pycuda does with
contexts, events and page-locked memory (its docstring lists the claims). Each test here runs one scenario
against the double, always, and against the real ``pycuda.driver`` where pycuda and a CUDA device exist
(``-m gpu``; skipped elsewhere). A claim of the double that the real pycuda does not bear out fails on the
first machine with a GPU, instead of holding up tests that pass against behaviour no GPU has.

The primary context's state is read from the driver itself (``cuDevicePrimaryCtxGetState`` through
ctypes) on the real side, and from the double's retain count on the other.
"""

from __future__ import annotations

import ctypes
import threading

import numpy as np
import pytest

from trt_double import TrtDouble
from k2edge.engine.trt_cuda import primary_context, pushed, release_primary_contexts


class Driver:
    """A ``pycuda.driver``, the double's or the real one, and how to read its primary context."""

    def __init__(self, drv, active, release_leaked):
        self.drv = drv
        self.active = active  # () -> bool: is device 0's primary context retained by anyone?
        self.release_leaked = release_leaked  # () -> None: drop one retain a detach left behind


def _double_driver():
    double = TrtDouble()

    def release_leaked():
        double.primary_retains -= 1

    return double, Driver(double.driver, lambda: double.primary_retains > 0, release_leaked)


def _real_driver():
    try:
        import pycuda.driver as drv

        drv.init()
        if drv.Device.count() < 1:
            raise RuntimeError("no CUDA device")
        lib = ctypes.CDLL("libcuda.so.1")
    except Exception as exc:  # ImportError, or pycuda present without a driver or a device
        pytest.skip(f"needs pycuda and a CUDA device: {exc}")
    device = ctypes.c_int()
    assert lib.cuDeviceGet(ctypes.byref(device), 0) == 0

    def active() -> bool:
        flags, state = ctypes.c_uint(), ctypes.c_int()
        assert lib.cuDevicePrimaryCtxGetState(device, ctypes.byref(flags), ctypes.byref(state)) == 0
        return bool(state.value)

    def release_leaked():
        release = getattr(lib, "cuDevicePrimaryCtxRelease_v2", None) or lib.cuDevicePrimaryCtxRelease
        assert release(device) == 0

    return Driver(drv, active, release_leaked)


@pytest.fixture(params=["double", pytest.param("real", marks=pytest.mark.gpu)])
def cuda(request):
    if request.param == "real":
        yield _real_driver()
        release_primary_contexts()
        return
    double, driver = _double_driver()
    yield driver
    release_primary_contexts()
    double.shutdown()


def in_thread(fn):
    """``fn()`` on a new thread (a fresh pycuda context stack); its result, or its exception re-raised."""
    box: dict = {}

    def run():
        try:
            box["out"] = fn()
        except BaseException as exc:
            box["exc"] = exc

    t = threading.Thread(target=run)
    t.start()
    t.join(timeout=60)
    assert not t.is_alive(), "the thread did not finish"
    if "exc" in box:
        raise box["exc"]
    return box.get("out")


def test_a_cuda_call_without_a_current_context_is_refused(cuda):
    drv = cuda.drv
    for call in (drv.Event, drv.Stream, lambda: drv.mem_alloc(16), lambda: drv.pagelocked_empty((4,), np.float32)):
        with pytest.raises(drv.LogicError, match="invalid device context"):
            in_thread(call)
    with pytest.raises(drv.LogicError, match="cannot pop non-current context"):
        in_thread(drv.Context.pop)


def test_detach_releases_the_primary_context_only_where_it_is_current_or_was_retained(cuda):
    """Why ``trt_cuda`` pushes the context before it detaches it (the engine may be stopped from any thread)."""
    drv = cuda.drv
    release_primary_contexts()  # whatever an earlier test left for atexit
    assert not cuda.active()

    def retain():  # on this thread, which outlives the workers (a finished thread's id can be reused)
        return drv.Device(0).retain_primary_context()

    ctx = retain()
    assert cuda.active()
    in_thread(ctx.detach)  # neither current in that thread nor retained there: nothing is released
    assert cuda.active()
    with pytest.raises(drv.LogicError, match="cannot detach from invalid context"):
        in_thread(ctx.detach)
    cuda.release_leaked()
    assert not cuda.active()

    ctx = retain()
    in_thread(lambda: (ctx.push(), ctx.detach()))  # current there: released
    assert not cuda.active()

    ctx = retain()
    ctx.detach()  # the thread that retained it: released
    assert not cuda.active()

    in_thread(lambda: primary_context(drv))  # trt_cuda: retained on one worker ...
    assert cuda.active()
    assert in_thread(release_primary_contexts) == 1  # ... released from another
    assert not cuda.active()


def test_events_made_without_timing_cannot_be_timed(cuda):
    drv = cuda.drv

    def scenario():
        with pushed(drv, primary_context(drv)):
            stream = drv.Stream()
            out = []
            for flags in (drv.event_flags.DISABLE_TIMING, 0):
                start, end = drv.Event(flags), drv.Event(flags)
                start.record(stream)
                end.record(stream)
                end.synchronize()
                assert end.query()
                try:
                    out.append(end.time_since(start))
                except drv.LogicError as exc:  # kept as text: a traceback would keep the events past their context
                    out.append(f"LogicError: {exc}")
            return out

    untimed, timed = in_thread(scenario)
    assert isinstance(untimed, str) and untimed.startswith("LogicError") and "invalid resource handle" in untimed
    assert timed >= 0.0


def test_mapped_page_locked_memory_has_a_device_pointer(cuda):
    drv = cuda.drv

    def scenario():
        with pushed(drv, primary_context(drv)):
            mapped = drv.pagelocked_empty((256,), np.float32, mem_flags=drv.host_alloc_flags.DEVICEMAP)
            mapped[:] = 7.0
            device = drv.mem_alloc(mapped.nbytes)
            back = drv.pagelocked_empty((256,), np.float32)
            stream = drv.Stream()
            drv.memcpy_htod_async(device, mapped, stream)
            drv.memcpy_dtoh_async(back, device, stream)
            stream.synchronize()
            return int(mapped.base.get_device_pointer()), back.copy()

    pointer, back = in_thread(scenario)
    assert pointer != 0
    assert (back == 7.0).all()
