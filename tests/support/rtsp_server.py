#!/usr/bin/python3
"""A test camera: serve an H.264 MP4 as an endless RTSP stream on 127.0.0.1, in real time.

Run by Debian's own python (it has ``gi``; the venv does not), through ``rtsp_support.RtspServer``:

    /usr/bin/python3 tests/support/rtsp_server.py --file clip.mp4 --port 8554 --mount cam

The file is demuxed once into memory; each client gets its own pipeline (the factory is not shared)
that plays the file's access units from the first one, a keyframe, and loops them forever with
timestamps that keep rising, so a client decodes from its first packet and the stream never ends.
Not shared, so a client that stops reading (a stalled proxy) backs up its own pipeline only. The
encoded frames pass through untouched (no decoder or encoder needed): the file's GOP is the stream's. Prints ``READY rtsp://127.0.0.1:<port>/<mount>`` once listening; exits 0 on
SIGTERM or SIGINT. ``--port 0`` takes a free port (the READY line says which).
"""

import argparse
import signal
import sys

import gi

gi.require_version("Gst", "1.0")
gi.require_version("GstRtspServer", "1.0")
from gi.repository import GLib, Gst, GstRtspServer  # noqa: E402

# appsrc -> payloader: the demuxed stream is already avc/au, which rtph264pay takes as it is. SPS/PPS
# go in the SDP only (config-interval=0): every client starts at the clip's first keyframe anyway, and
# with them repeated in-band (-1) FFmpeg decodes every keyframe twice
LAUNCH = "( appsrc name=src format=time is-live=false ! rtph264pay name=pay0 pt=96 config-interval=0 )"
_F = Gst.BufferCopyFlags
COPY = _F.FLAGS | _F.TIMESTAMPS | _F.META | _F.MEMORY


def load_clip(path: str) -> tuple[Gst.Caps, list[Gst.Buffer], int]:
    """The file's H.264 caps, its access units in decoding order and its frame duration (ns)."""
    # the appsink keeps every sample and does not hold EOS back until they are pulled
    pipe = Gst.parse_launch("filesrc name=file ! qtdemux ! h264parse ! video/x-h264,stream-format=avc,alignment=au "
                            "! appsink name=sink sync=false wait-on-eos=false")
    pipe.get_by_name("file").set_property("location", path)
    sink = pipe.get_by_name("sink")
    pipe.set_state(Gst.State.PLAYING)
    end = pipe.get_bus().timed_pop_filtered(30 * Gst.SECOND, Gst.MessageType.ERROR | Gst.MessageType.EOS)
    caps, units = None, []
    while (sample := sink.emit("try-pull-sample", 0)) is not None:
        caps = caps or sample.get_caps()
        units.append(sample.get_buffer())
    pipe.set_state(Gst.State.NULL)
    if end is None or end.type == Gst.MessageType.ERROR or not units:
        reason = end.parse_error()[0].message if end and end.type == Gst.MessageType.ERROR else "no H.264 video track"
        raise SystemExit(f"rtsp_server: cannot read {path}: {reason}")
    ok, num, den = caps.get_structure(0).get_fraction("framerate")
    frame_ns = Gst.util_uint64_scale(Gst.SECOND, den, num) if ok and num > 0 else units[0].duration
    return caps, units, frame_ns


class LoopingClip(GstRtspServer.RTSPMediaFactory):
    """A factory whose every media plays the clip from its start, looping, one access unit per need-data."""

    def __init__(self, caps: Gst.Caps, units: list[Gst.Buffer], frame_ns: int) -> None:
        super().__init__()
        self.caps, self.units, self.period = caps, units, frame_ns * len(units)
        self.set_launch(LAUNCH)
        self.set_shared(False)
        self.connect("media-configure", self._on_media_configure)

    def _on_media_configure(self, _factory, media) -> None:
        src = media.get_element().get_child_by_name("src")
        src.set_property("caps", self.caps)
        src.connect("need-data", self._on_need_data, {"next": 0})

    def _on_need_data(self, src, _length, state) -> None:
        loop, i = divmod(state["next"], len(self.units))
        state["next"] += 1
        # a new buffer sharing the memory (a GBoxed copy() would be the same buffer, changed in place)
        unit = self.units[i].copy_region(COPY, 0, self.units[i].get_size())
        shift = loop * self.period
        unit.pts = self.units[i].pts + shift
        unit.dts = self.units[i].dts + shift if self.units[i].dts != Gst.CLOCK_TIME_NONE else unit.pts
        src.emit("push-buffer", unit)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--file", required=True, help="an MP4 with an H.264 video track")
    ap.add_argument("--port", type=int, default=8554, help="TCP port on 127.0.0.1 (0: any free port)")
    ap.add_argument("--mount", default="cam", help="the stream's path: rtsp://127.0.0.1:PORT/MOUNT")
    args = ap.parse_args()

    Gst.init(None)
    server = GstRtspServer.RTSPServer()
    server.set_address("127.0.0.1")
    server.set_service(str(args.port))
    server.get_mount_points().add_factory("/" + args.mount.strip("/"), LoopingClip(*load_clip(args.file)))
    if server.attach(None) == 0:
        print(f"rtsp_server: cannot listen on 127.0.0.1:{args.port}", file=sys.stderr)
        return 1

    loop = GLib.MainLoop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        GLib.unix_signal_add(GLib.PRIORITY_DEFAULT, sig, loop.quit)
    print(f"READY rtsp://127.0.0.1:{server.get_bound_port()}/{args.mount.strip('/')}", flush=True)
    loop.run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
