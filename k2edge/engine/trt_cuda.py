"""What a process holds once for TensorRT: the CUDA primary context and the TensorRT logger.

* **The primary context.** TensorRT's runtime API works in the device's primary context, so pycuda's
  buffers, streams and events must live there too. pycuda's context stack is per thread (a
  ``boost::thread_specific_ptr``) and its ``Context.detach()`` releases a context only when it is current
  in the calling thread or that thread created it; from any other thread it marks the context invalid and
  releases nothing [pycuda 2024.1 ``src/cpp/cuda.hpp``, ``context::detach``]. An engine deactivated from
  another thread than the one that activated it (the daemon swaps models from a worker) would leak one
  retain each time. So the context is retained once per process and device, and released once at exit,
  pushed first so that the releasing thread has it current.
* **The logger.** "The logger used to create an instance of IBuilder, IRuntime or IRefitter is used for all
  objects created through that interface. The logger must be valid until all objects created are released"
  and it "must be thread safe" [TensorRT 10.3 ``NvInferRuntimeBase.h``, ``ILogger``]. One logger per process
  lives as long as the process; it keeps errors per thread so that a build reports its own.

Nothing here imports tensorrt or pycuda: the modules are passed in.
"""

from __future__ import annotations

import atexit
import logging
import threading

log = logging.getLogger(__name__)

_LOCK = threading.Lock()
_PRIMARY: dict[tuple[object, int], object] = {}
_LOGGERS: dict[object, object] = {}
_AT_EXIT = False


def primary_context(cuda, device: int = 0):
    """The device's primary context, retained on first use and held until the process exits.

    Args:
        cuda: the ``pycuda.driver`` module.
        device: the CUDA device ordinal.

    Returns:
        the pycuda ``Context``; push it in each thread that makes CUDA calls (``with pushed(cuda, ctx)``).
    """
    global _AT_EXIT
    with _LOCK:
        ctx = _PRIMARY.get((cuda, device))
        if ctx is None:
            cuda.init()
            ctx = _PRIMARY[(cuda, device)] = cuda.Device(device).retain_primary_context()
            if not _AT_EXIT:
                atexit.register(release_primary_contexts)
                _AT_EXIT = True
        return ctx


def release_primary_contexts() -> int:
    """Release every primary context this process retained (at exit; tests call it directly).

    Returns:
        how many were released.
    """
    with _LOCK:
        held = list(_PRIMARY.items())
        _PRIMARY.clear()
    for (cuda, device), ctx in held:
        try:
            ctx.push()  # current in this thread, so detach() releases it whichever thread retained it
            ctx.detach()
        except Exception as exc:  # at exit the driver may already be gone; nothing is left to leak
            log.debug("releasing the primary context of device %d: %s", device, exc)
    return len(held)


class pushed:
    """``with pushed(cuda, ctx):`` makes ``ctx`` current in this thread and pops it afterwards."""

    def __init__(self, cuda, ctx):
        self._cuda, self._ctx = cuda, ctx

    def __enter__(self):
        self._ctx.push()
        return self._ctx

    def __exit__(self, *exc):
        self._cuda.Context.pop()


def process_logger(trt):
    """The one ``trt.ILogger`` of this process: forwards to Python logging, keeps errors per thread.

    Made inside a function: the class subclasses a TensorRT interface and tensorrt is optional.
    """
    with _LOCK:
        logger = _LOGGERS.get(trt)
        if logger is None:
            logger = _LOGGERS[trt] = _make_logger(trt)
        return logger


def _make_logger(trt):
    class _ProcessLogger(trt.ILogger):
        def __init__(self):
            trt.ILogger.__init__(self)
            self._local = threading.local()

        def log(self, severity, msg):
            level = _severity(severity)
            if level >= logging.ERROR:
                self._errors().append(str(msg))
            log.log(level if level >= logging.WARNING else logging.DEBUG, "TensorRT: %s", msg)

        def _errors(self) -> list[str]:
            errors = getattr(self._local, "errors", None)
            if errors is None:
                errors = self._local.errors = []
            return errors

        def take_errors(self) -> list[str]:
            """The errors TensorRT reported on this thread since the last call."""
            out = self._errors()
            self._local.errors = []
            return out

    return _ProcessLogger()


def _severity(severity) -> int:
    try:
        value = int(severity)  # INTERNAL_ERROR=0, ERROR=1, WARNING=2, INFO=3, VERBOSE=4
    except (TypeError, ValueError):
        value = 3
    return {0: logging.CRITICAL, 1: logging.ERROR, 2: logging.WARNING, 3: logging.INFO}.get(value, logging.DEBUG)
