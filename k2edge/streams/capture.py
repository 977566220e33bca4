"""Opening a source and decoding its frames: PyAV (FFmpeg, CPU decode) and GStreamer (NVDEC on a Jetson).

A :class:`Capture` yields ``(picture, pts)`` pairs (the decoded picture — an object with
``to_ndarray(format="rgb24")``, converted only for frames that are processed, or an ``(H, W, 3)``
uint8 array — and the frame's time in seconds on the source's timeline) until the source ends, and raises :class:`SourceError` when
it fails. Both backends bound every wait (open and read); the reader adds its own stall watchdog on
top, because a backend's timeouts are not always what they say (PyAV's read timeout notices a stall
only after about twice its value).

PyAV and GStreamer are imported only here, and only when a source is opened.
"""

from __future__ import annotations

import logging
from typing import Iterator, Protocol

import numpy as np

from ..errors import K2EdgeError
from .source import SourceSpec

log = logging.getLogger(__name__)

# RTSP: FFmpeg's default probing (analyzeduration 5 s) costs ~1.9 s per open here, a 0.1 s probe 0.2 s; a
# camera's stream parameters are in its SDP and first keyframe. No "fflags nobuffer": with it the keyframe
# read while probing is dropped and the first frame waits for the next keyframe (0.9 s here).
_RTSP_OPTIONS = {"rtsp_transport": "tcp", "analyzeduration": "100000", "probesize": "262144"}


class SourceError(K2EdgeError):
    """A source cannot be opened or read. ``permanent``: retrying cannot help (a missing file, no
    video stream, a backend this machine lacks)."""

    def __init__(self, message: str, permanent: bool = False) -> None:
        super().__init__(message)
        self.permanent = permanent


class Capture(Protocol):
    fps: float | None
    """The source's own frame rate, when it says."""
    corrupt: int
    """Packets that could not be decoded (skipped)."""

    def frames(self) -> Iterator[tuple[object, float]]:
        """Decoded pictures until the source ends. Raises :class:`SourceError`."""

    def close(self) -> None:
        """Release the source (idempotent)."""


def open_capture(spec: SourceSpec, backend: str, open_timeout_s: float, read_timeout_s: float) -> Capture:
    """Open ``spec`` with ``backend`` (``pyav`` or ``gstreamer``).

    Raises:
        SourceError: it cannot be opened (``permanent`` when retrying cannot help).
    """
    if backend == "gstreamer":
        return GstCapture(spec, open_timeout_s, read_timeout_s)
    return PyAVCapture(spec, open_timeout_s, read_timeout_s)


class PyAVCapture:
    """FFmpeg through PyAV; corrupt packets are counted and skipped, not fatal."""

    def __init__(self, spec: SourceSpec, open_timeout_s: float, read_timeout_s: float) -> None:
        try:
            import av
        except ImportError:
            raise SourceError("reading video needs PyAV: pip install 'k2edge[streams]'", permanent=True) from None
        self._av = av
        self.corrupt = 0
        options, fmt = {}, None
        if spec.kind == "rtsp":
            options = dict(_RTSP_OPTIONS)
        elif spec.kind == "v4l2":
            fmt = "v4l2"
        try:
            # the read timeout is halved: FFmpeg's interrupt fires after about twice it
            self.container = av.open(spec.target, format=fmt, options=options,
                                     timeout=(open_timeout_s, max(read_timeout_s / 2, 0.1)))
        except FileNotFoundError:
            raise SourceError(f"{spec.shown}: no such file", permanent=True) from None
        except av.error.ExitError:  # FFmpeg's interrupt: the open timeout
            raise SourceError(f"{spec.shown}: cannot open: no answer within {open_timeout_s:g} s") from None
        except av.error.FFmpegError as exc:
            if spec.kind == "file" and not isinstance(exc, OSError):  # read, and no format FFmpeg knows (not a refusal)
                raise SourceError(f"{spec.shown}: not a video PyAV can open ({_reason(exc)})", permanent=True) from None
            raise SourceError(f"{spec.shown}: cannot open: {_reason(exc)}", permanent=spec.kind == "file") from None
        except OSError as exc:
            raise SourceError(f"{spec.shown}: cannot open: {exc.strerror or exc}", permanent=spec.kind == "file") from None
        if not self.container.streams.video:
            self.close()
            raise SourceError(f"{spec.shown}: holds no video stream", permanent=spec.kind == "file")
        self.stream = self.container.streams.video[0]
        if self.stream.codec_context is None:
            self.close()
            raise SourceError(f"{spec.shown}: no decoder for its video codec", permanent=spec.kind == "file")
        self.stream.thread_type = "AUTO"
        rate = self.stream.average_rate or self.stream.guessed_rate
        self.fps = float(rate) if rate else None
        self._shown, self._read_timeout_s = spec.shown, read_timeout_s
        self.on_packet = None  # told of each demuxed packet before it is decoded (a clip's packet ring)

    def tap(self, ring, on_packet) -> None:
        """Hand this capture's packets to ``ring`` (a :class:`~k2edge.streams.evidence.clips.PacketRing`)
        through ``on_packet``; the ring takes this stream as its clips' template."""
        ring.open(self._av, self.stream)
        self.on_packet = on_packet

    def frames(self) -> Iterator[tuple[object, float]]:
        av, stream = self._av, self.stream
        base = float(stream.time_base) if stream.time_base else 0.0
        try:
            for packet in self.container.demux(stream):
                if self.on_packet is not None:
                    self.on_packet(packet)
                try:
                    decoded = packet.decode()
                except av.error.InvalidDataError:
                    self.corrupt += 1
                    continue
                for frame in decoded:
                    pts = frame.pts * base if frame.pts is not None else (frame.time or 0.0)
                    yield frame, float(pts)
        except av.error.ExitError:  # FFmpeg's interrupt: the read timeout
            raise SourceError(f"{self._shown}: stalled: no data for about {self._read_timeout_s:g} s") from None
        except av.error.FFmpegError as exc:
            raise SourceError(f"{self._shown}: {_reason(exc)}") from None
        except OSError as exc:
            raise SourceError(f"{self._shown}: {exc.strerror or exc}") from None

    def skip_nonref(self, on: bool) -> None:
        """Skip decoding non-reference frames (on), or decode every frame again; from the next packet on."""
        self.stream.codec_context.skip_frame = "NONREF" if on else "DEFAULT"

    def close(self) -> None:
        container, self.container = getattr(self, "container", None), None
        if container is not None:
            try:
                container.close()
            except Exception:  # closing a broken connection may raise; it is closed either way
                pass


def _reason(exc) -> str:
    return (getattr(exc, "strerror", None) or str(exc)).strip()


def gst_pipeline(spec: SourceSpec) -> str:
    """The GStreamer pipeline for a source: hardware decode (NVDEC) into an appsink that keeps only
    the newest buffer (``drop=true max-buffers=1``)."""
    to_rgb = "nvvidconv ! video/x-raw,format=BGRx ! videoconvert ! video/x-raw,format=RGB"
    sink = "appsink name=sink drop=true max-buffers=1 sync=false emit-signals=false"
    if spec.kind == "gst":
        return spec.target
    if spec.kind == "rtsp":
        return f"rtspsrc location=\"{spec.target}\" protocols=tcp latency=0 ! decodebin ! {to_rgb} ! {sink}"
    if spec.kind == "file":
        return f"filesrc location=\"{spec.target}\" ! decodebin ! {to_rgb} ! {sink}"
    if spec.kind == "v4l2":
        return f"v4l2src device={spec.target} ! videoconvert ! video/x-raw,format=RGB ! {sink}"
    return (f"nvarguscamerasrc sensor-id={spec.target} ! video/x-raw(memory:NVMM) ! nvvidconv ! "
            f"video/x-raw,format=BGRx ! videoconvert ! video/x-raw,format=RGB ! {sink}")


def _without_gi(spec: SourceSpec) -> str:
    """Why ``spec`` cannot be read where python3-gi is missing, and what would read it: PyAV only for the kinds it
    reads (a ``backend = "gstreamer"`` stream); a CSI camera only on a Jetson."""
    if spec.kind == "csi":
        from ..engine.probe import l4t_release

        where = ("this machine is not a Jetson" if l4t_release() is None
                 else "this venv cannot import python3-gi (make it with --system-site-packages)")
        return f"{spec.shown}: a CSI camera is read by GStreamer's nvarguscamerasrc through JetPack's python3-gi; {where}"
    need = ("the GStreamer backend needs python3-gi with GStreamer 1.0 (JetPack has it; make the venv with "
            "--system-site-packages)")
    return need if spec.kind == "gst" else need + '; on other machines use backend = "pyav"'


class GstCapture:
    """GStreamer through JetPack's ``python3-gi`` (make the venv with ``--system-site-packages``).
    Checked on a Jetson by ``tools/jetson-selftest``; refused with one message where ``gi`` is missing."""

    def __init__(self, spec: SourceSpec, open_timeout_s: float, read_timeout_s: float) -> None:
        try:
            import gi

            gi.require_version("Gst", "1.0")
            from gi.repository import Gst
        except (ImportError, ValueError):
            raise SourceError(_without_gi(spec), permanent=True) from None
        Gst.init(None)
        self._gst, self.corrupt, self.fps, self._shown = Gst, 0, None, spec.shown
        self._read_ns = int(read_timeout_s * 1e9)
        try:
            self.pipeline = Gst.parse_launch(gst_pipeline(spec))
        except Exception as exc:  # GLib.Error: an element this machine lacks (nvv4l2decoder off a Jetson)
            detail = str(exc).replace(spec.target, spec.shown) if spec.kind != "gst" else str(exc)
            raise SourceError(f"{spec.shown}: GStreamer pipeline: {detail}", permanent=True) from None
        self.sink = self.pipeline.get_by_name("sink")
        if self.sink is None:
            raise SourceError(f"{spec.shown}: the pipeline needs an appsink named sink", permanent=True)
        self.pipeline.set_state(Gst.State.PLAYING)
        ok, _, _ = self.pipeline.get_state(int(open_timeout_s * 1e9))
        if ok == Gst.StateChangeReturn.FAILURE:
            self.close()
            raise SourceError(f"{spec.shown}: GStreamer could not start the pipeline")

    def frames(self) -> Iterator[tuple[np.ndarray, float]]:
        Gst = self._gst
        while self.pipeline is not None:
            sample = self.sink.emit("try-pull-sample", self._read_ns)
            if sample is None:
                if self.sink.get_property("eos"):
                    return
                raise SourceError(f"{self._shown}: no frame within {self._read_ns / 1e9:g} s")
            buf, caps = sample.get_buffer(), sample.get_caps().get_structure(0)
            w, h = caps.get_value("width"), caps.get_value("height")
            ok, info = buf.map(Gst.MapFlags.READ)
            if not ok:
                self.corrupt += 1
                continue
            try:
                stride = len(info.data) // h
                rgb = np.frombuffer(info.data, np.uint8).reshape(h, stride)[:, : w * 3].reshape(h, w, 3).copy()
            finally:
                buf.unmap(info)
            yield rgb, buf.pts / 1e9 if buf.pts != Gst.CLOCK_TIME_NONE else 0.0

    def close(self) -> None:
        pipeline, self.pipeline = getattr(self, "pipeline", None), None
        if pipeline is not None:
            pipeline.set_state(self._gst.State.NULL)
