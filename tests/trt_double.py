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


class LaunchError(RuntimeError):
    """pycuda.driver.LaunchError stand-in."""


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

    class Stream:
        def __init__(self, flags=0):
            self.handle = next(ids)
            self.queue: list = []
            with gpu.cv:
                gpu.streams[self.handle] = self
            rec("cuda.Stream", self.handle)

        def synchronize(self):
            rec("stream.synchronize", self.handle)
            gpu.wait_until(lambda: not self.queue and gpu._busy is not self, f"stream {self.handle}")

        def is_done(self):
            return not self.queue

        def wait_for_event(self, evt):
            rec("stream.wait_for_event", self.handle, evt.id)
            gpu.enqueue(self, "wait", event=evt, gen=evt.pending_gen, label=(self.handle, evt.id))

    default_stream = Stream()

    class Event:
        def __init__(self, flags=0):
            self.id = next(ids)
            self.pending_gen = 0
            self.done_gen = 0

        def record(self, stream=None):
            stream = stream or default_stream
            self.pending_gen += 1
            rec("event.record", self.id, stream.handle)
            gpu.enqueue(stream, "record", event=self, gen=self.pending_gen, label=(self.id, stream.handle))
            return self

        def synchronize(self):
            rec("event.synchronize", self.id)
            gen = self.pending_gen
            gpu.wait_until(lambda: self.done_gen >= gen, f"event {self.id}")
            return self

        def query(self):
            return self.done_gen >= self.pending_gen

    class DeviceAllocation:
        def __init__(self, nbytes):
            self.nbytes = nbytes
            self.addr = gpu.alloc(nbytes)

        def __int__(self):
            return self.addr

        def free(self):
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
        alloc = PagelockedHostAllocation(tuple(shape), dtype, mem_flags)
        arr = np.asarray(alloc)
        rec("cuda.pagelocked_empty", id(arr.base), tuple(shape), np.dtype(dtype).name, mem_flags)
        return arr

    def mem_alloc(nbytes):
        alloc = DeviceAllocation(int(nbytes))
        rec("cuda.mem_alloc", alloc.addr, int(nbytes))
        return alloc

    def memcpy_htod_async(dest, src, stream=None):
        stream = stream or default_stream
        addr, host = int(dest), src  # read when the copy runs, as DMA does

        def run():
            flat = np.ascontiguousarray(host).view(np.uint8).reshape(-1)
            gpu.view(addr)[: flat.size] = flat

        rec("cuda.memcpy_htod_async", addr, id(src.base), stream.handle)
        gpu.enqueue(stream, "htod", run, label=(addr, id(src.base), stream.handle))

    def memcpy_dtoh_async(dest, src, stream=None):
        stream = stream or default_stream
        addr = int(src)

        def run():
            out = dest.view(np.uint8).reshape(-1)
            out[:] = gpu.view(addr)[: out.size]

        rec("cuda.memcpy_dtoh_async", id(dest.base), addr, stream.handle)
        gpu.enqueue(stream, "dtoh", run, label=(addr, stream.handle))

    class Context:
        def __init__(self):
            self.pushed = 0

        def push(self):
            self.pushed += 1

        @staticmethod
        def pop():
            return None

        def detach(self):
            rec("cuda.Context.detach")

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
    drv.LaunchError, drv.Error = LaunchError, LaunchError
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

        @property
        def format(self):
            return TensorFormat(self._formats.bit_length() - 1)

    class ILayer:
        def __init__(self, node):
            self.name, self.type, self.metadata = node.name, node.op_type, f"[ONNX Layer: {node.name}]"
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
            shapes = {v.name: tuple(x.dim_value for x in v.type.tensor_type.shape.dim) for v in list(g.input) + list(g.output)}
            net = self.network
            net.model, net.name = model, g.name
            net.inputs = [ITensor(v.name, shapes[v.name]) for v in g.input if v.name not in inits]
            net.outputs = [ITensor(v.name, shapes[v.name]) for v in g.output]
            net.layers = [ILayer(n) for n in g.node]
            return True

        num_errors = property(lambda self: len(self.errors))

        def get_error(self, i):
            return self.errors[i]

    class IBuilderConfig:
        def __init__(self):
            self.flags, self.pools, self.device_types = set(), {}, {}
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
            return layer.name not in d.dla_refuses

        def set_memory_pool_limit(self, pool, size):
            rec("config.set_memory_pool_limit", pool.name, int(size))
            self.pools[pool.name] = int(size)

        @property
        def int8_calibrator(self):
            return self._calibrator

        @int8_calibrator.setter
        def int8_calibrator(self, calibrator):
            rec("config.int8_calibrator", type(calibrator).__mro__[1].__name__)
            self._calibrator = calibrator

    class Builder:
        def __init__(self, logger):
            self.logger = logger

        num_DLA_cores = property(lambda self: d.dla_cores)

        def create_network(self, flags=0):
            return INetworkDefinition()

        def create_builder_config(self):
            return IBuilderConfig()

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
            cache = None
            if config.int8_calibrator is not None:
                cache = config.int8_calibrator.read_calibration_cache()
                if cache is None and config.int8_calibrator.get_batch(["input"]) is None:
                    self.logger.log(ILogger.Severity.ERROR, "Calibration failure occurred with no scaling factors detected")
                    return None
            build = {
                "network": network.name, "default_device": config.default_device_type.name,
                "dla_core": config.DLA_core if dla else None, "flags": sorted(config.flags), "pools": dict(config.pools),
                "gpu_layers": sorted(n for n, dt in config.device_types.items() if dt.name == "GPU"),
                "layer_precision": {l.name: l.precision.name for l in network.layers if l.precision is not None},
                "io": {t.name: {"shape": list(t.shape), "dtype": t.dtype.name, "format": t.format.name,
                                "mode": "INPUT" if t in network.inputs else "OUTPUT"}
                       for t in network.inputs + network.outputs},
                "calibration_cache": cache.decode() if cache is not None else None,
                "placement": placement, "serialization_version": d.serialization_version,
                "verbosity": config.profiling_verbosity.name,
            }
            d.builds.append(build)
            header = json.dumps(build, sort_keys=True).encode()
            return MAGIC + struct.pack("<I", len(header)) + header + network.model.SerializeToString()

    class Runtime:
        def __init__(self, logger):
            self.logger, self._core = logger, 0

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
            self.engine, self.addresses, self.shapes = engine, {}, {}

        def set_input_shape(self, name, shape):
            rec("context.set_input_shape", self.engine.header["network"], name, tuple(shape))
            self.shapes[name] = tuple(shape)
            return True

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

            def run():
                feeds = {}
                for t in engine.session.get_inputs():
                    io = engine.io[t.name]
                    dtype = _NP[DataType[io["dtype"]]]
                    n = int(np.prod(io["shape"]))
                    feeds[t.name] = gpu.view(addresses[t.name])[: n * np.dtype(dtype).itemsize].view(dtype) \
                        .reshape(io["shape"]).astype(np.float32)
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

            def flush():
                if run:
                    layers.append({"Name": "{ForeignNode[%s...%s]}" % (run[0], run[-1]), "LayerType": "ForeignNode"})
                    run.clear()

            for name, kind, device in self.engine.header["placement"]:
                if device == "DLA":
                    run.append(name)
                    continue
                flush()
                layers.append({"Name": name, "LayerType": kind, "Metadata": f"[ONNX Layer: {name}]"})
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
    return trt


class TrtDouble:
    """The test double: fake ``tensorrt``, ``pycuda`` and ``pycuda.driver`` modules plus controls.

    Controls: ``version`` (``trt.__version__``), ``serialization_version`` (the tag in engines),
    ``dla_cores``, ``compute_capability``, ``dla_refuses`` (node names ``can_run_on_DLA`` rejects),
    ``gpu.pause()`` / ``gpu.resume()``. Observations: ``calls`` (every call in order) and ``builds``
    (what each ``build_serialized_network`` was configured with).
    """

    def __init__(self, version: str = "10.3.0.30"):
        self.version = version
        self.serialization_version = 239
        self.dla_cores = 2
        self.compute_capability = (8, 7)
        self.dla_refuses: set[str] = set()
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
