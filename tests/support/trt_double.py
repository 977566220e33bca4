"""A recording TEST DOUBLE of TensorRT 10 and pycuda, for hardware this machine does not have.

Nothing here is TensorRT or CUDA. It implements exactly the calls k2edge's TensorRT backend makes
(``k2edge/engine/trt_build.py``, ``trt_runtime.py``, ``tensorrt_backend.py``), records every one of
them in order in :attr:`TrtDouble.calls`, and behaves just enough like the real thing for contract
tests:

* ``OnnxParser.parse`` reads the real segment ONNX with ``onnx`` and makes one fake layer per node,
  named after the node, with TensorRT 10's ``[ONNX Layer: name]`` metadata;
* ``Builder.build_serialized_network`` places each layer on the GPU or the DLA the way TensorRT's
  rules read (default device, per-layer device types, ``can_run_on_DLA``, GPU fallback) and writes a
  fake serialized engine carrying a serialization version tag; ``Runtime.deserialize_cuda_engine``
  refuses a different tag with TensorRT's "Version tag does not match" error;
* the engine inspector reports DLA runs as ``{ForeignNode[first...last]}`` layers (no metadata) and
  DLA memory reformats as ``... to nvm`` / ``... from nvm``;
* execution produces real numbers: ``execute_async_v3`` runs the segment's ONNX model (the Q/DQ model
  for explicitly quantised GPU segments, the float model otherwise) with ONNX Runtime on the CPU,
  reading and writing fake device memory, rounding through FP16 for tensors whose I/O dtype was set
  to HALF. FP16/INT8 arithmetic of the GPU and the DLA is not emulated;
* ``can_run_on_DLA`` decides from its own table of TensorRT layers (``DLA_LAYERS``, written from the DLA
  notes of TensorRT 10.3's ``NvInfer.h`` and the docs' DLA table, independently of k2edge's rules): the
  parser maps each ONNX node to the layer the ONNX parser would make;
* a DLA build without ``GPU_FALLBACK`` fails when a network I/O tensor is not in a DLA-native format
  (FP16 ``CHW16``/``CHW4``, INT8 ``CHW32``/``CHW4``; FP32 linear needs a GPU reformat, NVIDIA/TensorRT#3438),
  and with ``DIRECT_IO`` any I/O tensor whose format the adjacent layer does not take natively fails the
  build; INT8 I/O without a calibrator fails as TensorRT does;
* DLA memory pools: not a power of two of at least 4 KiB fails the loadable compilation; a managed SRAM
  pool above Orin's 1 MiB per core is accepted as an upper bound and only 1 MiB is used (``effective_pools``);
* optimization profiles: an input whose ONNX dimension is symbolic parses as -1; a network with one needs at
  least one profile (``Builder.create_optimization_profile``, ``set_shape``, ``add_optimization_profile``), a DLA
  build refuses a profile whose min, opt and max differ (the DLA takes no dynamic dimensions); the engine
  reports its profiles (``get_tensor_profile_shape``), a context runs the profile selected with
  ``set_optimization_profile_async`` and refuses an input shape outside it; ``device_memory_size_v2`` is the
  double's own sum of the I/O bytes at the largest profile (TensorRT's figure is its activation memory);
* one logger: a builder or runtime made with a different logger than the first gets TensorRT's warning;
* pycuda's context stack is per thread: a CUDA call in a thread where no context was pushed raises
  ``LogicError: ... invalid device context``, ``Context.pop()`` with nothing pushed raises, and
  ``Context.detach()`` releases the primary context only from a thread where it is current or that
  retained it (pycuda ``cuda.hpp``); events record their flags;
* streams run on one executor thread, FIFO within a stream, honouring event waits, and — to expose
  missing waits — always run the most recently enqueued runnable operation first across streams.
  Copies read their source when they execute, not when enqueued, as DMA does. :meth:`FakeGpu.pause`
  holds all device work so tests can observe what was enqueued before anything finished.
"""

from __future__ import annotations

import hashlib
import importlib.machinery
import itertools
import json
import struct
import threading
import types
from enum import IntEnum

import numpy as np
import onnx

MAGIC = b"K2EDGE-FAKE-TRT-ENGINE\n"


class CudaError(RuntimeError):
    """pycuda.driver.Error stand-in: the base of the driver's errors."""


class LaunchError(CudaError):
    """pycuda.driver.LaunchError stand-in."""


class LogicError(CudaError):
    """pycuda.driver.LogicError stand-in (calls without a current context, invalid handles)."""


# ---------------------------------------------------------------------------------------------
# the fake device: memory, streams, events, an executor thread


class FakeGpu:
    def __init__(self, record):
        self._record = record
        self.cv = threading.Condition()
        self.memory: dict[int, np.ndarray] = {}
        self.streams: dict[int, object] = {}
        self._next_addr = 0x10000
        self._seq = itertools.count()
        self.paused = False
        self.error: BaseException | None = None
        self._stop = False
        self._busy = None
        self._thread = threading.Thread(target=self._run, name="fake-gpu", daemon=True)
        self._thread.start()

    # memory
    def alloc(self, nbytes: int, buffer: np.ndarray | None = None) -> int:
        with self.cv:
            addr = self._next_addr
            self._next_addr += (max(nbytes, 1) + 255) // 256 * 256 + 256
            self.memory[addr] = buffer if buffer is not None else np.zeros(max(nbytes, 1), np.uint8)
            return addr

    def view(self, addr: int) -> np.ndarray:
        try:
            return self.memory[addr]
        except KeyError:
            raise LaunchError(f"illegal address {addr:#x}") from None

    # streams
    def enqueue(self, stream, kind, fn=None, event=None, gen=0, label=()):
        with self.cv:
            stream.queue.append({"seq": next(self._seq), "kind": kind, "fn": fn, "event": event, "gen": gen, "label": label})
            self.cv.notify_all()

    def _runnable(self, op) -> bool:
        return op["kind"] != "wait" or op["event"].done_gen >= op["gen"]

    def _run(self):
        while True:
            with self.cv:
                while True:
                    if self._stop:
                        return
                    heads = [s.queue[0] for s in self.streams.values() if s.queue and self._runnable(s.queue[0])]
                    if heads and not self.paused:
                        break
                    self.cv.wait()
                op = max(heads, key=lambda o: o["seq"])  # newest first across streams: a missing wait shows
                stream = next(s for s in self.streams.values() if s.queue and s.queue[0] is op)
                self._busy = stream
            try:
                if op["fn"] is not None:
                    op["fn"]()
            except BaseException as exc:  # reported on the next synchronize, like a sticky CUDA error
                self.error = exc
            with self.cv:
                stream.queue.pop(0)
                if op["kind"] == "record":
                    op["event"].done_gen = max(op["event"].done_gen, op["gen"])
                self._busy = None
                self._record("done", op["kind"], *op["label"])
                self.cv.notify_all()

    def wait_until(self, predicate, what: str, timeout: float = 30.0):
        with self.cv:
            if not self.cv.wait_for(lambda: predicate() or self.error is not None, timeout=timeout):
                raise LaunchError(f"fake device timed out waiting for {what}")
            if self.error is not None:
                raise LaunchError(f"device work failed: {self.error}")

    def pause(self):
        with self.cv:
            self.paused = True

    def resume(self):
        with self.cv:
            self.paused = False
            self.cv.notify_all()

    def shutdown(self):
        with self.cv:
            self._stop = True
            self.cv.notify_all()
        self._thread.join(timeout=5)


# ---------------------------------------------------------------------------------------------
# pycuda.driver


def _make_pycuda(d: "TrtDouble"):
    gpu, rec = d.gpu, d.record
    drv = types.ModuleType("pycuda.driver")
    drv.__spec__ = importlib.machinery.ModuleSpec("pycuda.driver", None)
    ids = itertools.count(1)
    tls = threading.local()

    def stack() -> list:
        if not hasattr(tls, "stack"):
            tls.stack = []
        return tls.stack

    def need_context(call: str) -> None:
        # pycuda: every driver call needs a context current in the calling thread
        if not any(c.valid for c in stack()):
            d.context_errors.append((call, threading.current_thread().name))
            raise LogicError(f"{call} failed: invalid device context")

    class event_flags(IntEnum):  # CUevent_flags values
        DEFAULT = 0
        BLOCKING_SYNC = 1
        DISABLE_TIMING = 2
        INTERPROCESS = 4

    class Stream:
        def __init__(self, flags=0):
            need_context("cuStreamCreate")
            self.handle = next(ids)
            self.queue: list = []
            with gpu.cv:
                gpu.streams[self.handle] = self
            rec("cuda.Stream", self.handle)

        def synchronize(self):
            need_context("cuStreamSynchronize")
            rec("stream.synchronize", self.handle)
            gpu.wait_until(lambda: not self.queue and gpu._busy is not self, f"stream {self.handle}")

        def is_done(self):
            return not self.queue

        def wait_for_event(self, evt):
            need_context("cuStreamWaitEvent")
            rec("stream.wait_for_event", self.handle, evt.id)
            gpu.enqueue(self, "wait", event=evt, gen=evt.pending_gen, label=(self.handle, evt.id))

    class _DefaultStream(Stream):
        def __init__(self):  # the legacy default stream exists without a context
            self.handle, self.queue = 0, []
            with gpu.cv:
                gpu.streams[0] = self

    default_stream = _DefaultStream()

    class Event:
        def __init__(self, flags=0):
            need_context("cuEventCreate")
            self.id = next(ids)
            self.flags = int(flags)
            self.pending_gen = 0
            self.done_gen = 0
            rec("cuda.Event", self.id, self.flags)

        def record(self, stream=None):
            need_context("cuEventRecord")
            stream = stream or default_stream
            self.pending_gen += 1
            rec("event.record", self.id, stream.handle)
            gpu.enqueue(stream, "record", event=self, gen=self.pending_gen, label=(self.id, stream.handle))
            return self

        def synchronize(self):
            need_context("cuEventSynchronize")
            rec("event.synchronize", self.id)
            gen = self.pending_gen
            gpu.wait_until(lambda: self.done_gen >= gen, f"event {self.id}")
            return self

        def query(self):
            return self.done_gen >= self.pending_gen

        def time_since(self, event):
            need_context("cuEventElapsedTime")
            if (self.flags | event.flags) & event_flags.DISABLE_TIMING:  # CUDA_ERROR_INVALID_HANDLE
                raise LogicError("cuEventElapsedTime failed: invalid resource handle")
            return 0.0

    class DeviceAllocation:
        def __init__(self, nbytes):
            self.nbytes = nbytes
            self.addr = gpu.alloc(nbytes)

        def __int__(self):
            return self.addr

        def free(self):
            need_context("cuMemFree")
            rec("cuda.free", self.addr)

    class PagelockedHostAllocation:
        """What ``pagelocked_empty(...).base`` is: exposes get_device_pointer() for mapped memory."""

        def __init__(self, shape, dtype, flags):
            dtype = np.dtype(dtype)
            self.flags = flags
            self.raw = np.zeros(int(np.prod(shape, dtype=np.int64)) * dtype.itemsize, np.uint8)
            self.__array_interface__ = {"data": (self.raw.ctypes.data, False), "shape": tuple(shape),
                                        "typestr": dtype.str, "version": 3}
            self._device = gpu.alloc(self.raw.nbytes, self.raw) if flags & host_alloc_flags.DEVICEMAP else None

        def get_device_pointer(self):
            if self._device is None:
                raise LaunchError("get_device_pointer on memory allocated without DEVICEMAP")
            rec("host.get_device_pointer", self._device)
            return self._device

    class host_alloc_flags:
        PORTABLE, DEVICEMAP, WRITECOMBINED = 1, 2, 4

    def pagelocked_empty(shape, dtype, order="C", mem_flags=0):
        need_context("cuMemHostAlloc")
        alloc = PagelockedHostAllocation(tuple(shape), dtype, mem_flags)
        arr = np.asarray(alloc)
        rec("cuda.pagelocked_empty", id(arr.base), tuple(shape), np.dtype(dtype).name, mem_flags)
        return arr

    def mem_alloc(nbytes):
        need_context("cuMemAlloc")
        alloc = DeviceAllocation(int(nbytes))
        rec("cuda.mem_alloc", alloc.addr, int(nbytes))
        return alloc

    def memcpy_htod_async(dest, src, stream=None):
        need_context("cuMemcpyHtoDAsync")
        stream = stream or default_stream
        addr, host = int(dest), src  # read when the copy runs, as DMA does

        def run():
            flat = np.ascontiguousarray(host).view(np.uint8).reshape(-1)
            gpu.view(addr)[: flat.size] = flat

        rec("cuda.memcpy_htod_async", addr, id(src.base), stream.handle)
        gpu.enqueue(stream, "htod", run, label=(addr, id(src.base), stream.handle))

    def memcpy_dtoh_async(dest, src, stream=None):
        need_context("cuMemcpyDtoHAsync")
        stream = stream or default_stream
        addr = int(src)

        def run():
            out = dest.view(np.uint8).reshape(-1)
            out[:] = gpu.view(addr)[: out.size]

        rec("cuda.memcpy_dtoh_async", id(dest.base), addr, stream.handle)
        gpu.enqueue(stream, "dtoh", run, label=(addr, stream.handle))

    class Context:
        """A retained primary context: per-thread stack semantics as pycuda's cuda.hpp has them."""

        def __init__(self):
            self.valid = True
            self.thread = threading.get_ident()
            d.primary_retains += 1

        def push(self):
            stack().append(self)

        @staticmethod
        def pop():
            if not stack():
                raise LogicError("context::pop failed: invalid device context - cannot pop non-current context")
            stack().pop()

        def detach(self):
            if not self.valid:
                raise LogicError("context::detach failed: invalid device context - cannot detach from invalid context")
            current = bool(stack()) and stack()[-1] is self
            if current or self.thread == threading.get_ident():
                d.primary_retains -= 1
                rec("cuda.primary_release")
            else:  # pycuda: "this context's managing thread has exited": nothing is released
                rec("cuda.Context.detach.noop")
            self.valid = False
            if current:
                stack().pop()

    class Device:
        def __init__(self, number):
            self.number = number

        @staticmethod
        def count():
            return 1

        def compute_capability(self):
            return d.compute_capability

        def name(self):
            return "Fake Orin (test double)"

        def retain_primary_context(self):
            rec("cuda.Device.retain_primary_context", self.number)
            return Context()

    drv.Stream, drv.Event, drv.Device, drv.Context = Stream, Event, Device, Context
    drv.host_alloc_flags, drv.pagelocked_empty, drv.mem_alloc = host_alloc_flags, pagelocked_empty, mem_alloc
    drv.memcpy_htod_async, drv.memcpy_dtoh_async = memcpy_htod_async, memcpy_dtoh_async
    drv.event_flags = event_flags
    drv.LaunchError, drv.LogicError, drv.Error = LaunchError, LogicError, CudaError
    drv.init = lambda flags=0: rec("cuda.init")
    drv.get_version = lambda: (12, 6, 0)
    drv.get_driver_version = lambda: 12060
    pkg = types.ModuleType("pycuda")
    pkg.__spec__ = importlib.machinery.ModuleSpec("pycuda", None, is_package=True)
    pkg.__path__ = []
    pkg.driver = drv
    pkg.VERSION_TEXT = pkg.__version__ = "2024.1 (test double)"
    return pkg, drv


# ---------------------------------------------------------------------------------------------
# what the DLA runs, as TensorRT 10.3 decides it for the layers the ONNX parser makes. Written from the
# DLA notes of NvInfer.h 10.3 and the docs' DLA table, independently of k2edge/dla/rules.py.

ORIN_SRAM = 1 << 20
_ATTR_DEFAULTS = {"pads": [0, 0, 0, 0], "strides": [1, 1], "dilations": [1, 1], "group": 1}


class _NodeView:
    """An ONNX node with shapes and constants, as the fake parser hands it to the DLA table."""

    def __init__(self, node, shapes, consts):
        self.op = node.op_type
        self.attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        self.inputs, self.outputs = list(node.input), list(node.output)
        self.shapes, self.consts = shapes, consts

    def attr(self, key, default=None):
        value = self.attrs.get(key, _ATTR_DEFAULTS.get(key, default))
        return value.decode() if isinstance(value, bytes) else value

    def shape(self, i=0):
        return self.shapes.get(self.inputs[i], ())

    def const(self, i):
        return self.consts.get(self.inputs[i]) if i < len(self.inputs) and self.inputs[i] else None


def _in(values, lo, hi):
    return all(lo <= int(v) <= hi for v in values)


def _dla_conv(n):  # IConvolutionLayer
    w = n.const(1)
    return (w is not None and w.ndim == 4 and _in(w.shape[2:], 1, 32) and _in(n.attr("strides"), 1, 8)
            and _in(n.attr("pads"), 0, 31) and all(p < w.shape[2 + i % 2] for i, p in enumerate(n.attr("pads")))
            and _in(n.attr("dilations"), 1, 32) and 1 <= w.shape[0] <= 8192 and n.attr("group") <= 8192)


def _dla_deconv(n):  # IDeconvolutionLayer
    w = n.const(1)
    ok = lambda v: _in(v, 1, 32) or sorted(int(x) for x in v) in ([1, 64], [1, 96], [1, 128])  # noqa: E731
    return (w is not None and w.ndim == 4 and ok(w.shape[2:]) and ok(n.attr("strides")) and not any(n.attr("pads"))
            and n.attr("group") == 1 and _in(n.attr("dilations"), 1, 1))


def _dla_pool(n):  # IPoolingLayer: kMAX / kAVERAGE
    k = n.attr("kernel_shape", [])
    return len(k) == 2 and _in(k, 1, 8) and _in(n.attr("strides"), 1, 16) and _in(n.attr("pads"), 0, 7)


def _dla_clip(n):  # IActivationLayer kCLIP as the clipped ReLU of the docs: alpha 0, beta [1, 127]
    lo, hi = n.const(1), n.const(2)
    return lo is not None and hi is not None and float(lo) == 0.0 and 1 <= float(hi) <= 127


def _dla_eltwise(n):  # IElementWiseLayer: kSUM, kPROD, kMAX, kMIN, kSUB
    return len(n.inputs) == 2


def _dla_reduce_max(n):  # IReduceLayer: MAX over any of C, H, W
    axes = n.attr("axes", [2, 3] if n.op == "GlobalMaxPool" else None)
    return axes is not None and all(int(a) % 4 != 0 for a in axes)


def _dla_resize(n):  # IResizeLayer: the parser's settings must be one of the DLA combinations, no output dims
    if len(n.inputs) > 3 and n.inputs[3]:
        return False  # setOutputDimensions()
    scales = n.const(2)
    if scales is None or len(scales) != 4 or list(scales[:2]) != [1, 1] or any(v != int(v) for v in scales[2:]):
        return False
    mode, coord = n.attr("mode", "nearest"), n.attr("coordinate_transformation_mode", "half_pixel")
    rounding = n.attr("nearest_mode", "round_prefer_floor")
    if mode == "nearest":
        return (coord, rounding) in {("asymmetric", "floor"), ("half_pixel", "round_prefer_floor"),
                                     ("half_pixel", "round_prefer_ceil")} and _in(scales[2:], 1, 32)
    return mode == "linear" and coord in ("half_pixel", "pytorch_half_pixel") and _in(scales[2:], 1, 4)


def _dla_slice(n):  # ISliceLayer (Split): not the first dimension, stride 1
    return int(n.attr("axis", 0)) % 4 != 0


DLA_LAYERS = {  # ONNX op -> (TensorRT layer, check)
    "Conv": ("CONVOLUTION", _dla_conv),
    "ConvTranspose": ("DECONVOLUTION", _dla_deconv),
    "MaxPool": ("POOLING", _dla_pool),
    "AveragePool": ("POOLING", _dla_pool),
    "Relu": ("ACTIVATION", None),
    "Sigmoid": ("ACTIVATION", None),
    "Tanh": ("ACTIVATION", None),
    "LeakyRelu": ("ACTIVATION", None),
    "Clip": ("ACTIVATION", _dla_clip),
    "BatchNormalization": ("SCALE", None),
    "Add": ("ELEMENTWISE", _dla_eltwise),
    "Sub": ("ELEMENTWISE", _dla_eltwise),
    "Mul": ("ELEMENTWISE", _dla_eltwise),
    "Max": ("ELEMENTWISE", _dla_eltwise),
    "Min": ("ELEMENTWISE", _dla_eltwise),
    "Concat": ("CONCATENATION", lambda n: int(n.attr("axis", 1)) % 4 == 1 and len([i for i in n.inputs if i]) >= 2),
    "Split": ("SLICE", _dla_slice),
    "Resize": ("RESIZE", _dla_resize),
    "Softmax": ("SOFTMAX", lambda n: int(n.attr("axis", -1)) % 4 != 0),
    "Abs": ("UNARY", None),
    "GlobalMaxPool": ("REDUCE", _dla_reduce_max),
    "ReduceMax": ("REDUCE", _dla_reduce_max),
    "PRelu": ("PARAMETRIC_RELU", lambda n: n.const(1) is not None),
    "LRN": ("LRN", lambda n: n.attr("size") in (3, 5, 7, 9)),
}


def dla_capable(n: _NodeView) -> bool:
    """can_run_on_DLA for the layer the ONNX parser makes from ``n``: listed, 4-D ("2D only"), within limits."""
    entry = DLA_LAYERS.get(n.op)
    if entry is None:
        return False
    tensors = [t for t in n.inputs + n.outputs if t and t not in n.consts]
    if any(len(n.shapes.get(t, ())) != 4 for t in tensors):
        return False
    if any(n.shapes[t][0] > 4096 or max(n.shapes[t][1:]) > 8192 for t in tensors):
        return False
    check = entry[1]
    return check is None or bool(check(n))


# DLA-native I/O formats per data type ("For DLA usage, this format maps to the native feature format for
# FP16 / INT8", NvInferRuntimeBase.h 10.3; kCHW4 deprecated but accepted).
_DLA_NATIVE = {"HALF": {"CHW16", "CHW4", "DLA_LINEAR", "DLA_HWC4"}, "INT8": {"CHW32", "CHW4", "DLA_LINEAR", "DLA_HWC4"}}


def _pool_ok(size: int) -> bool:
    return size >= 4096 and size & (size - 1) == 0


# ---------------------------------------------------------------------------------------------
# tensorrt


class DataType(IntEnum):
    FLOAT = 0
    HALF = 1
    INT8 = 2
    INT32 = 3
    BOOL = 4


class TensorFormat(IntEnum):  # TensorRT's values
    LINEAR = 0
    CHW2 = 1
    HWC8 = 2
    CHW4 = 3
    CHW16 = 4
    CHW32 = 5
    DHWC8 = 6
    CDHW32 = 7
    HWC = 8
    DLA_LINEAR = 9
    DLA_HWC4 = 10
    HWC16 = 11


_NP = {DataType.FLOAT: np.float32, DataType.HALF: np.float16, DataType.INT8: np.int8, DataType.INT32: np.int32,
       DataType.BOOL: np.bool_}
_VECTOR = {TensorFormat.CHW16: 16, TensorFormat.CHW32: 32, TensorFormat.CHW4: 4, TensorFormat.CHW2: 2}


def _enum(name, *members):
    return IntEnum(name, {m: i for i, m in enumerate(members)})


def _make_tensorrt(d: "TrtDouble"):
    rec, gpu = d.record, d.gpu
    trt = types.ModuleType("tensorrt")
    trt.__spec__ = importlib.machinery.ModuleSpec("tensorrt", None)
    trt.__version__ = d.version
    trt.DataType, trt.TensorFormat = DataType, TensorFormat
    trt.float32, trt.float16, trt.int8, trt.int32 = DataType.FLOAT, DataType.HALF, DataType.INT8, DataType.INT32
    trt.nptype = lambda dt: _NP[DataType(dt)]
    trt.BuilderFlag = _enum("BuilderFlag", "FP16", "INT8", "GPU_FALLBACK", "PREFER_PRECISION_CONSTRAINTS",
                            "OBEY_PRECISION_CONSTRAINTS", "DIRECT_IO")
    trt.DeviceType = _enum("DeviceType", "GPU", "DLA")
    trt.MemoryPoolType = _enum("MemoryPoolType", "WORKSPACE", "DLA_MANAGED_SRAM", "DLA_LOCAL_DRAM", "DLA_GLOBAL_DRAM")
    trt.TensorIOMode = _enum("TensorIOMode", "NONE", "INPUT", "OUTPUT")
    trt.ProfilingVerbosity = _enum("ProfilingVerbosity", "LAYER_NAMES_ONLY", "NONE", "DETAILED")
    trt.LayerInformationFormat = _enum("LayerInformationFormat", "ONELINE", "JSON")

    class ILogger:
        Severity = _enum("Severity", "INTERNAL_ERROR", "ERROR", "WARNING", "INFO", "VERBOSE")

        def __init__(self):
            pass

    class IInt8EntropyCalibrator2:
        def __init__(self):
            pass

    class ITensor:
        def __init__(self, name, shape, dtype=DataType.FLOAT):
            self.name, self.shape, self._dtype, self._formats = name, tuple(shape), dtype, 1 << TensorFormat.LINEAR

        @property
        def dtype(self):
            return self._dtype

        @dtype.setter
        def dtype(self, value):
            rec("tensor.dtype", self.name, DataType(value).name)
            self._dtype = DataType(value)

        @property
        def allowed_formats(self):
            return self._formats

        @allowed_formats.setter
        def allowed_formats(self, mask):
            rec("tensor.allowed_formats", self.name, TensorFormat(int(mask).bit_length() - 1).name)
            self._formats = int(mask)

        def _format(self):  # the double's bookkeeping: the one format allowed
            return TensorFormat(self._formats.bit_length() - 1)

    class ILayer:
        def __init__(self, node, view):
            self.name, self.type, self.metadata = node.name, node.op_type, f"[ONNX Layer: {node.name}]"
            self.view = view
            self._precision = None

        @property
        def precision(self):
            return self._precision

        @precision.setter
        def precision(self, value):
            rec("layer.precision", self.name, DataType(value).name)
            self._precision = DataType(value)

    class INetworkDefinition:
        def __init__(self):
            self.layers, self.inputs, self.outputs, self.model, self.name = [], [], [], None, "network"

        num_layers = property(lambda self: len(self.layers))
        num_inputs = property(lambda self: len(self.inputs))
        num_outputs = property(lambda self: len(self.outputs))

        def get_layer(self, i):
            return self.layers[i]

        def get_input(self, i):
            return self.inputs[i]

        def get_output(self, i):
            return self.outputs[i]

    class OnnxParser:
        def __init__(self, network, logger):
            self.network, self.errors = network, []

        def parse(self, data):
            model = onnx.load_from_string(bytes(data))
            g = model.graph
            rec("parser.parse", g.name)
            inits = {t.name for t in g.initializer}
            shapes = {v.name: tuple(x.dim_value if x.HasField("dim_value") else -1 for x in v.type.tensor_type.shape.dim)
                      for v in list(g.input) + list(g.output)}
            net = self.network
            net.model, net.name = model, g.name
            net.inputs = [ITensor(v.name, shapes[v.name]) for v in g.input if v.name not in inits]
            net.outputs = [ITensor(v.name, shapes[v.name]) for v in g.output]
            shapes = {v.name: tuple(x.dim_value for x in v.type.tensor_type.shape.dim)
                      for v in list(g.input) + list(g.value_info) + list(g.output)}
            consts = {t.name: onnx.numpy_helper.to_array(t) for t in g.initializer}
            net.layers = [ILayer(n, _NodeView(n, shapes, consts)) for n in g.node]
            return True

        num_errors = property(lambda self: len(self.errors))

        def get_error(self, i):
            return self.errors[i]

    class IOptimizationProfile:
        def __init__(self):
            self.shapes = {}

        def set_shape(self, input, min, opt, max):  # noqa: A002 - TensorRT's parameter names
            rec("profile.set_shape", input, tuple(min), tuple(opt), tuple(max))
            self.shapes[input] = (tuple(min), tuple(opt), tuple(max))

        def get_shape(self, input):  # noqa: A002
            return list(self.shapes.get(input, ()))

    class IBuilderConfig:
        def __init__(self):
            self.flags, self.pools, self.device_types = set(), {}, {}
            self.profiles, self.calibration_profile = [], None
            self._default, self._core, self._calibrator = trt.DeviceType.GPU, 0, None
            self.profiling_verbosity = trt.ProfilingVerbosity.LAYER_NAMES_ONLY

        def set_flag(self, flag):
            rec("config.set_flag", flag.name)
            self.flags.add(flag.name)

        def get_flag(self, flag):
            return flag.name in self.flags

        @property
        def default_device_type(self):
            return self._default

        @default_device_type.setter
        def default_device_type(self, value):
            rec("config.default_device_type", value.name)
            self._default = value

        @property
        def DLA_core(self):  # noqa: N802 - TensorRT's spelling
            return self._core

        @DLA_core.setter
        def DLA_core(self, value):  # noqa: N802
            rec("config.DLA_core", int(value))
            self._core = int(value)

        def set_device_type(self, layer, device):
            rec("config.set_device_type", layer.name, device.name)
            self.device_types[layer.name] = device

        def get_device_type(self, layer):
            return self.device_types.get(layer.name, self._default)

        def can_run_on_DLA(self, layer):  # noqa: N802
            rec("config.can_run_on_DLA", layer.name)
            return dla_capable(layer.view) and layer.name not in d.dla_refuses

        def set_memory_pool_limit(self, pool, size):
            rec("config.set_memory_pool_limit", pool.name, int(size))
            self.pools[pool.name] = int(size)

        def add_optimization_profile(self, profile):
            rec("config.add_optimization_profile", len(self.profiles))
            self.profiles.append(profile)
            return len(self.profiles) - 1

        num_optimization_profiles = property(lambda self: len(self.profiles))

        def set_calibration_profile(self, profile):
            rec("config.set_calibration_profile", self.profiles.index(profile) if profile in self.profiles else -1)
            self.calibration_profile = profile
            return True

        @property
        def int8_calibrator(self):
            return self._calibrator

        @int8_calibrator.setter
        def int8_calibrator(self, calibrator):
            rec("config.int8_calibrator", type(calibrator).__mro__[1].__name__)
            self._calibrator = calibrator

    def check_logger(logger, what):
        # TensorRT keeps the first logger for the process; another one only gets a warning
        if d.logger is None:
            d.logger = logger
        elif logger is not d.logger:
            d.other_loggers += 1
            d.logger.log(ILogger.Severity.WARNING, f"The logger passed into {what} differs from one already provided for an "
                       "existing builder, runtime, or refitter. Uses of the global logger, returned by "
                       "nvinfer1::getLogger(), will return the existing value.")

    class Builder:
        def __init__(self, logger):
            self.logger = logger
            check_logger(logger, "createInferBuilder")

        num_DLA_cores = property(lambda self: d.dla_cores)

        def create_network(self, flags=0):
            return INetworkDefinition()

        def create_builder_config(self):
            return IBuilderConfig()

        def create_optimization_profile(self):
            return IOptimizationProfile()

        def build_serialized_network(self, network, config):
            rec("builder.build_serialized_network", network.name)
            dla = config.default_device_type == trt.DeviceType.DLA
            placement = []
            for layer in network.layers:
                device = config.get_device_type(layer).name if dla else "GPU"
                if device == "DLA" and not config.can_run_on_DLA(layer):
                    if "GPU_FALLBACK" not in config.flags:
                        self.logger.log(ILogger.Severity.ERROR, f"{layer.name} cannot run on DLA and GPU fallback is off")
                        return None
                    device = "GPU"
                placement.append((layer.name, layer.type, device))
            if any(dev == "DLA" for _, _, dev in placement) and not config.flags & {"FP16", "INT8"}:
                self.logger.log(ILogger.Severity.ERROR, "DLA requires FP16 or INT8 precision")
                return None
            dynamic = [t.name for t in network.inputs if any(x < 0 for x in t.shape)]
            if dynamic and not config.profiles:
                self.logger.log(ILogger.Severity.ERROR, f"Network has dynamic or shape inputs ({dynamic[0]}), but no "
                                "optimization profile has been defined.")
                return None
            for k, prof in enumerate(config.profiles):
                for name in dynamic:
                    if name not in prof.shapes:
                        self.logger.log(ILogger.Severity.ERROR, f"optimization profile {k} has no shape for {name}")
                        return None
                    lo, opt, hi = prof.shapes[name]
                    if dla and not lo == opt == hi:
                        self.logger.log(ILogger.Severity.ERROR, f"DLA does not support dynamic dimensions: profile {k} of "
                                        f"{name} has min {lo}, opt {opt}, max {hi}")
                        return None
            fail = self._check_io_and_pools(network, config, placement)
            if fail:
                self.logger.log(ILogger.Severity.ERROR, fail)
                return None
            effective = dict(config.pools)
            if dla and effective.get("DLA_MANAGED_SRAM", ORIN_SRAM) > ORIN_SRAM:
                # "the pool size serves only as an upper bound"; Orin has 1 MiB of SRAM per DLA core
                self.logger.log(ILogger.Severity.WARNING, f"DLA_MANAGED_SRAM of {effective['DLA_MANAGED_SRAM']} bytes exceeds "
                                f"the {ORIN_SRAM} bytes of SRAM a DLA core has; using at most {ORIN_SRAM}")
                effective["DLA_MANAGED_SRAM"] = ORIN_SRAM
            cache = None
            if config.int8_calibrator is not None:
                cache = config.int8_calibrator.read_calibration_cache()
                if cache is None and config.int8_calibrator.get_batch(["input"]) is None:
                    self.logger.log(ILogger.Severity.ERROR, "Calibration failure occurred with no scaling factors detected")
                    return None
            build = {
                "runs_in": _runs_in(network, config, cache),
                "network": network.name, "default_device": config.default_device_type.name,
                "dla_core": config.DLA_core if dla else None, "flags": sorted(config.flags), "pools": dict(config.pools),
                "gpu_layers": sorted(n for n, dt in config.device_types.items() if dt.name == "GPU"),
                "layer_precision": {l.name: l.precision.name for l in network.layers if l.precision is not None},
                "io": {t.name: {"shape": list(t.shape), "dtype": t.dtype.name, "format": t._format().name,
                                "mode": "INPUT" if t in network.inputs else "OUTPUT"}
                       for t in network.inputs + network.outputs},
                "calibration_cache": cache.decode() if cache is not None else None, "effective_pools": effective,
                "reformats": self._reformats,
                "profiles": [{n: [list(s) for s in prof.shapes[n]] for n in dynamic} for prof in config.profiles],
                "placement": placement, "serialization_version": d.serialization_version,
                "verbosity": config.profiling_verbosity.name,
            }
            d.builds.append(build)
            header = json.dumps(build, sort_keys=True).encode()
            return MAGIC + struct.pack("<I", len(header)) + header + network.model.SerializeToString()

    def _runs_in(network, config, cache):
        """The precision each layer runs in, as TensorRT decides it: its constraint, else INT8 where INT8 is on and
        its input has a range (a calibration cache line) or comes out of a DequantizeLinear, else FP16 if on."""
        ranged = {line.rpartition(": ")[0] for line in (cache.decode() if cache else "").splitlines()[1:]}
        dq = {o for n in network.model.graph.node if n.op_type == "DequantizeLinear" for o in n.output}
        out = {}
        for layer in network.layers:
            first = next(iter(layer.view.inputs), "")
            if layer.precision is not None:
                out[layer.name] = layer.precision.name
            elif "INT8" in config.flags and (first in ranged or first in dq):
                out[layer.name] = "INT8"
            else:
                out[layer.name] = "HALF" if "FP16" in config.flags else "FLOAT"
        return out

    def _native_for(layer, config):
        """The (dtype, formats) a DLA layer reads and writes without a reformat."""
        int8 = "INT8" in config.flags and layer.precision in (None, DataType.INT8)
        return ("INT8", _DLA_NATIVE["INT8"]) if int8 else ("HALF", _DLA_NATIVE["HALF"])

    def _check_io_and_pools(self, network, config, placement):
        """What makes TensorRT refuse a build: pools, I/O reformats without GPU fallback or with DIRECT_IO, INT8 I/O
        without a scale. Returns the error text, or None."""
        self._reformats = []
        device = {name: dev for name, _, dev in placement}
        if any(dev == "DLA" for dev in device.values()):
            for pool, size in config.pools.items():
                if pool.startswith("DLA_") and not _pool_ok(size):
                    return (f"DLA loadable compilation failed: {pool} of {size} bytes is not a power of 2 of at least "
                            f"4 KiB")
        for t in network.inputs + network.outputs:
            if t.dtype == DataType.INT8 and config.int8_calibrator is None:
                return (f"{t.name}: input/output with DataType Int8 in network without Q/DQ layers must have dynamic range "
                        f"set when no calibrator is used.")
            adjacent = [l for l in network.layers if (t.name in l.view.inputs if t in network.inputs else t.name in l.view.outputs)]
            for layer in adjacent:
                if device.get(layer.name) != "DLA":
                    continue
                dtype, formats = _native_for(layer, config)
                if t.dtype.name == dtype and t._format().name in formats:
                    continue
                self._reformats.append(t.name)
                if "DIRECT_IO" in config.flags and t.allowed_formats != 1 << TensorFormat.LINEAR:
                    return (f"I/O reformatting for region {t.name}, formats [{t.dtype.name}:{t._format().name}] -> "
                            f"[{dtype}:DLA native]; BuilderFlag::kDIRECT_IO specified but no conformant implementation exists")
                if "GPU_FALLBACK" not in config.flags:
                    return (f"{t.name} ({t.dtype.name}:{t._format().name}) is not a DLA-native format: its reformat runs on the "
                            f"GPU and GPU fallback is off")
        return None

    Builder._check_io_and_pools = _check_io_and_pools

    class Runtime:
        def __init__(self, logger):
            self.logger, self._core = logger, 0
            check_logger(logger, "createInferRuntime")

        @property
        def DLA_core(self):  # noqa: N802
            return self._core

        @DLA_core.setter
        def DLA_core(self, value):  # noqa: N802
            rec("runtime.DLA_core", int(value))
            self._core = int(value)

        def deserialize_cuda_engine(self, data):
            data = bytes(data)
            rec("runtime.deserialize_cuda_engine", hashlib.sha256(data).hexdigest())
            if not data.startswith(MAGIC):
                self.logger.log(ILogger.Severity.ERROR, "IRuntime::deserializeCudaEngine: Error Code 1: Serialization "
                                "(Serialization assertion magicTagRead == kMAGIC_TAG failed.Magic tag does not match)")
                return None
            n = struct.unpack("<I", data[len(MAGIC):len(MAGIC) + 4])[0]
            header = json.loads(data[len(MAGIC) + 4:len(MAGIC) + 4 + n])
            if header["serialization_version"] != d.serialization_version:
                self.logger.log(ILogger.Severity.ERROR, (
                    "IRuntime::deserializeCudaEngine: Error Code 1: Serialization (Serialization assertion "
                    "stdVersionRead == kSERIALIZATION_VERSION failed.Version tag does not match. Note: Current Version: "
                    f"{d.serialization_version}, Serialized Engine Version: {header['serialization_version']})"))
                return None
            return ICudaEngine(header, data[len(MAGIC) + 4 + n:])

    class ICudaEngine:
        def __init__(self, header, model_bytes):
            import onnxruntime

            self.header, self.io = header, header["io"]
            self.names = [k for k, v in self.io.items() if v["mode"] == "INPUT"] + \
                         [k for k, v in self.io.items() if v["mode"] == "OUTPUT"]
            opts = onnxruntime.SessionOptions()
            opts.intra_op_num_threads = 1
            opts.log_severity_level = 3
            self.session = onnxruntime.InferenceSession(model_bytes, sess_options=opts, providers=["CPUExecutionProvider"])

        num_io_tensors = property(lambda self: len(self.names))
        num_optimization_profiles = property(lambda self: max(1, len(self.header.get("profiles", []))))

        def get_tensor_profile_shape(self, name, profile_index):
            return [tuple(s) for s in self.header["profiles"][profile_index][name]]

        @property
        def device_memory_size_v2(self):
            largest = {}
            for prof in self.header.get("profiles", []):
                for n, (_, _, hi) in prof.items():
                    largest[n] = max(largest.get(n, 0), int(hi[0]))
            total = 0
            for n, io in self.io.items():
                shape = [largest.get(n, max(largest.values(), default=1)) if x < 0 else x for x in io["shape"]]
                total += int(np.prod(shape)) * np.dtype(_NP[DataType[io["dtype"]]]).itemsize
            return total

        def get_tensor_name(self, i):
            return self.names[i]

        def get_tensor_mode(self, name):
            return trt.TensorIOMode[self.io[name]["mode"]]

        def get_tensor_shape(self, name):
            return tuple(self.io[name]["shape"])

        def get_tensor_dtype(self, name):
            return DataType[self.io[name]["dtype"]]

        def get_tensor_format(self, name):
            return TensorFormat[self.io[name]["format"]]

        def get_tensor_vectorized_dim(self, name):
            return 1 if TensorFormat[self.io[name]["format"]] in _VECTOR else -1

        def get_tensor_components_per_element(self, name):
            return _VECTOR.get(TensorFormat[self.io[name]["format"]], 1)

        def get_tensor_bytes_per_component(self, name):
            return np.dtype(_NP[DataType[self.io[name]["dtype"]]]).itemsize if self.get_tensor_vectorized_dim(name) >= 0 else -1

        def create_execution_context(self):
            return IExecutionContext(self)

        def create_engine_inspector(self):
            return EngineInspector(self)

    class IExecutionContext:
        def __init__(self, engine):
            self.engine, self.addresses, self.shapes, self.profile = engine, {}, {}, 0

        def set_optimization_profile_async(self, profile_index, stream_handle):
            rec("context.set_optimization_profile_async", self.engine.header["network"], int(profile_index), stream_handle)
            if not 0 <= profile_index < self.engine.num_optimization_profiles:
                return False
            self.profile = int(profile_index)
            return True

        active_optimization_profile = property(lambda self: self.profile)

        def set_input_shape(self, name, shape):
            rec("context.set_input_shape", self.engine.header["network"], name, tuple(shape))
            profiles = self.engine.header.get("profiles", [])
            if profiles and name in profiles[self.profile]:
                lo, _, hi = profiles[self.profile][name]
                if not all(a <= s <= b for a, s, b in zip(lo, shape, hi)):
                    return False  # TensorRT logs the error and refuses the shape
            self.shapes[name] = tuple(shape)
            return True

        def get_tensor_shape(self, name):
            if name in self.shapes:
                return self.shapes[name]
            shape = self.engine.io[name]["shape"]
            batch = next((s[0] for s in self.shapes.values()), -1)  # the double's outputs follow the inputs' batch
            return tuple(batch if x < 0 else x for x in shape)

        def set_tensor_address(self, name, ptr):
            rec("context.set_tensor_address", self.engine.header["network"], name, int(ptr))
            self.addresses[name] = int(ptr)
            return True

        def execute_async_v3(self, stream_handle):
            engine, name = self.engine, self.engine.header["network"]
            rec("context.execute_async_v3", name, stream_handle)
            stream = gpu.streams.get(int(stream_handle))
            if stream is None or set(engine.names) - set(self.addresses):
                return False
            addresses = dict(self.addresses)  # captured at enqueue time, as TensorRT does
            shapes = dict(self.shapes)
            if any(x < 0 for n in engine.names if engine.io[n]["mode"] == "INPUT" for x in shapes.get(n, engine.io[n]["shape"])):
                return False  # run-time dimensions never set

            def run():
                feeds = {}
                for t in engine.session.get_inputs():
                    io = engine.io[t.name]
                    dtype = _NP[DataType[io["dtype"]]]
                    shape = shapes.get(t.name, io["shape"])
                    n = int(np.prod(shape))
                    feeds[t.name] = gpu.view(addresses[t.name])[: n * np.dtype(dtype).itemsize].view(dtype) \
                        .reshape(shape).astype(np.float32)
                names = [o.name for o in engine.session.get_outputs()]
                for out_name, value in zip(names, engine.session.run(names, feeds)):
                    io = engine.io[out_name]
                    raw = np.ascontiguousarray(value.astype(_NP[DataType[io["dtype"]]])).view(np.uint8).reshape(-1)
                    gpu.view(addresses[out_name])[: raw.size] = raw

            gpu.enqueue(stream, "execute", run, label=(name, stream.handle))
            return True

    class EngineInspector:
        def __init__(self, engine):
            self.engine = engine

        def get_engine_information(self, fmt):
            rec("inspector.get_engine_information", self.engine.header["network"], trt.LayerInformationFormat(fmt).name)
            layers, run = [], []
            runs_in = self.engine.header.get("runs_in", {})
            formats = {"INT8": "Int8 NC/32HW32", "HALF": "Half", "FLOAT": "Row major linear FP32"}

            def inputs(layer):  # the data type the layer reads, as the DETAILED inspector reports it
                return [{"Name": f"{layer}:0", "Format/Datatype": formats[runs_in[layer]]}] if layer in runs_in else []

            def flush():
                if run:
                    layers.append({"Name": "{ForeignNode[%s...%s]}" % (run[0], run[-1]), "LayerType": "ForeignNode",
                                   "Inputs": inputs(run[0])})
                    run.clear()

            for name, kind, device in self.engine.header["placement"]:
                if device == "DLA":
                    run.append(name)
                    continue
                flush()
                layers.append({"Name": name, "LayerType": kind, "Metadata": f"[ONNX Layer: {name}]", "Inputs": inputs(name)})
            flush()
            if self.engine.header["default_device"] == "DLA":
                io = self.engine.io
                layers = [{"Name": f"{t} to nvm", "LayerType": "Reformat"} for t in io if io[t]["mode"] == "INPUT"] + layers + \
                         [{"Name": f"{t} from nvm", "LayerType": "Reformat"} for t in io if io[t]["mode"] == "OUTPUT"]
            return json.dumps({"Layers": layers, "Bindings": list(self.engine.names)})

    trt.ILogger, trt.Logger, trt.IInt8EntropyCalibrator2 = ILogger, ILogger, IInt8EntropyCalibrator2
    trt.Builder, trt.OnnxParser, trt.Runtime = Builder, OnnxParser, Runtime
    trt.INetworkDefinition, trt.IBuilderConfig, trt.ICudaEngine = INetworkDefinition, IBuilderConfig, ICudaEngine
    trt.IExecutionContext, trt.EngineInspector = IExecutionContext, EngineInspector
    trt.ITensor, trt.ILayer = ITensor, ILayer
    return trt


class TrtDouble:
    """The test double: fake ``tensorrt``, ``pycuda`` and ``pycuda.driver`` modules plus controls.

    Controls: ``version`` (``trt.__version__``), ``serialization_version`` (the tag in engines),
    ``dla_cores``, ``compute_capability``, ``dla_refuses`` (node names ``can_run_on_DLA`` rejects on top of
    the table), ``gpu.pause()`` / ``gpu.resume()``. Observations: ``calls`` (every call in order), ``builds``
    (what each ``build_serialized_network`` was configured with), ``other_loggers`` (builders or runtimes made
    with a second logger), ``primary_retains`` (primary contexts retained and not released),
    ``context_errors`` (CUDA calls made without a current context).
    """

    def __init__(self, version: str = "10.3.0.30"):
        self.version = version
        self.serialization_version = 239
        self.dla_cores = 2
        self.compute_capability = (8, 7)
        self.dla_refuses: set[str] = set()
        self.logger = None
        self.other_loggers = 0
        self.primary_retains = 0
        self.context_errors: list[tuple[str, str]] = []
        self.calls: list[tuple] = []
        self.builds: list[dict] = []
        self._lock = threading.Lock()
        self.gpu = FakeGpu(self.record)
        self.pycuda, self.driver = _make_pycuda(self)
        self.tensorrt = _make_tensorrt(self)

    def record(self, *call) -> None:
        with self._lock:
            self.calls.append(call)

    def install(self, monkeypatch) -> "TrtDouble":
        """Put the fakes in ``sys.modules`` (monkeypatch removes them again after the test)."""
        import sys

        monkeypatch.setitem(sys.modules, "tensorrt", self.tensorrt)
        monkeypatch.setitem(sys.modules, "pycuda", self.pycuda)
        monkeypatch.setitem(sys.modules, "pycuda.driver", self.driver)
        return self

    def find(self, name: str) -> list[tuple]:
        """Calls named ``name``, in order."""
        with self._lock:
            return [c for c in self.calls if c[0] == name]

    def index(self, predicate) -> list[int]:
        with self._lock:
            return [i for i, c in enumerate(self.calls) if predicate(c)]

    def shutdown(self) -> None:
        self.gpu.shutdown()
