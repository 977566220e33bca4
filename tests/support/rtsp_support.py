"""Real infrastructure for the RTSP stream tests: a test camera and a TCP proxy that misbehaves on cue.

    ok, why = rtsp_available()                   # gst-rtsp-server reachable from /usr/bin/python3?
    pytestmark = pytest.mark.skipif(not ok, reason=why)

    clip = write_h264(tmp_path / "clip.mp4", frames, fps=15, gop=15)
    with RtspServer(clip) as cam, TcpProxy("127.0.0.1", cam.port) as proxy:
        av.open(cam.url, options={"rtsp_transport": "tcp"}, timeout=(5, 2))     # straight to the camera
        av.open(proxy.url("cam"), options={"rtsp_transport": "tcp"}, ...)       # through the proxy
        proxy.stall(); proxy.resume()    # a wedged camera: connections open, no bytes either way
        proxy.cut()                      # every open connection closed; new ones still accepted
        proxy.refuse(True)               # new connections closed at once, until refuse(False)
        cam.stop(kill=True); cam.start() # a crash, then the camera back on the same port

The camera is ``rtsp_server.py`` run by Debian's python (GStreamer's RTSP server is reached through
``python3-gi``, which a venv does not see). It loops the clip forever in real time; every client gets
its own pipeline that starts at the clip's first frame, a keyframe, so the clip's GOP bounds nothing
at the start but is the keyframe spacing after it. Use TCP interleaved transport
(``rtsp_transport=tcp``): RTSP and RTP then share one connection, which the proxy carries.
"""

from __future__ import annotations

import functools
import os
import select
import signal
import socket
import subprocess
import tempfile
import threading
from pathlib import Path

from mqtt_support import free_port

__all__ = ["RtspServer", "TcpProxy", "free_port", "rtsp_available", "write_h264"]

SYSTEM_PYTHON = "/usr/bin/python3"
SERVER_SCRIPT = Path(__file__).with_name("rtsp_server.py")
_PROBE = """
import gi
gi.require_version("Gst", "1.0"); gi.require_version("GstRtspServer", "1.0")
from gi.repository import Gst, GstRtspServer
Gst.init(None)
missing = [e for e in ("appsrc", "qtdemux", "h264parse", "rtph264pay") if not Gst.ElementFactory.find(e)]
assert not missing, "GStreamer elements missing: " + ", ".join(missing)
"""


@functools.cache
def rtsp_available() -> tuple[bool, str]:
    """Whether the test camera can run here, and if not why (a skip reason)."""
    if not os.access(SYSTEM_PYTHON, os.X_OK):
        return False, f"no {SYSTEM_PYTHON} for the RTSP test server"
    probe = subprocess.run([SYSTEM_PYTHON, "-c", _PROBE], capture_output=True, text=True, timeout=60)
    if probe.returncode:
        last = (probe.stderr.strip().splitlines() or ["?"])[-1]
        return False, (f"no GStreamer RTSP server for {SYSTEM_PYTHON} ({last}); "
                       "apt-get install gir1.2-gst-rtsp-server-1.0 python3-gi")
    return True, ""


def write_h264(path: Path, frames, fps: int = 15, gop: int = 15) -> Path:
    """An H.264 MP4 of RGB frames (HxWx3 uint8, even sides), a keyframe at least every ``gop`` frames,
    no B-frames (decoding order is display order, as from most cameras)."""
    import av

    with av.open(str(path), "w") as out:
        stream = None
        for img in frames:
            if stream is None:
                stream = out.add_stream("libx264", rate=fps, options={"g": str(gop), "bf": "0"})
                stream.height, stream.width = img.shape[:2]
                stream.pix_fmt = "yuv420p"
            out.mux(stream.encode(av.VideoFrame.from_ndarray(img, format="rgb24")))
        out.mux(stream.encode())
    return path


class RtspServer:
    """The test camera: ``rtsp://127.0.0.1:<port>/<mount>`` serving ``video_path`` in a loop.

    Args:
        video_path: an MP4 with an H.264 track (``write_h264``).
        port: the TCP port; None takes a free one at the first start and keeps it for restarts.
        mount: the stream's path in the URL.
    """

    READY_S = 20.0

    def __init__(self, video_path: Path | str, port: int | None = None, mount: str = "cam") -> None:
        self.video_path, self.port, self.mount = Path(video_path), port, mount.strip("/")
        self.proc: subprocess.Popen | None = None
        self._log = tempfile.NamedTemporaryFile(prefix="rtsp_server-", suffix=".log")

    @property
    def url(self) -> str:
        return f"rtsp://127.0.0.1:{self.port}/{self.mount}"

    def start(self) -> "RtspServer":
        """Start the server (again: on the same port) and wait until it listens.

        Raises:
            RuntimeError: it exited or did not say READY within READY_S; the message has its stderr.
        """
        assert self.proc is None, "already running"
        self._log.seek(0)
        self._log.truncate()
        cmd = [SYSTEM_PYTHON, str(SERVER_SCRIPT), "--file", str(self.video_path),
               "--port", str(self.port or 0), "--mount", self.mount]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=self._log, text=True)
        ready, _, _ = select.select([self.proc.stdout], [], [], self.READY_S)
        line = self.proc.stdout.readline() if ready else ""
        if not line.startswith("READY "):
            self.stop(kill=True)
            self._log.seek(0)
            err = self._log.read().decode(errors="replace").strip()[-2000:]
            raise RuntimeError(f"rtsp_server did not start ({'exited' if ready else 'no READY in time'}): {err}")
        self.port = int(line.split()[1].rsplit(":", 1)[1].split("/")[0])
        return self

    def stop(self, kill: bool = False) -> None:
        """SIGTERM and wait; ``kill=True`` sends SIGKILL instead (a crash: no RTSP goodbye)."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL if kill else signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc.stdout.close()
        self.proc = None

    def __enter__(self) -> "RtspServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
        self._log.close()


class _Link:
    """One proxied connection: the client's socket and ours to the target."""

    def __init__(self, client: socket.socket, upstream: socket.socket) -> None:
        self.socks = (client, upstream)
        self.closed = False
        self._lock = threading.Lock()

    def close(self) -> None:
        with self._lock:
            if self.closed:
                return
            self.closed = True
        for s in self.socks:
            try:
                s.shutdown(socket.SHUT_RDWR)  # wakes the pump blocked in recv or sendall
            except OSError:
                pass
            s.close()


class TcpProxy:
    """A loopback TCP proxy to ``target_host:target_port`` whose faults tests switch on and off.

    Each connection gets two threads, one per direction; ``stall()`` makes them hold what they have
    read and read no more, so the kernel buffers fill and both ends see an open, silent connection.
    """

    def __init__(self, target_host: str, target_port: int) -> None:
        self.target = (target_host, target_port)
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(0.1)
        self.port = self._listener.getsockname()[1]
        self._links: set[_Link] = set()
        self._lock = threading.Lock()
        self._flowing = threading.Event()
        self._flowing.set()
        self._refusing = False
        self._closing = False
        self._acceptor = threading.Thread(target=self._accept_loop, name="tcp-proxy", daemon=True)
        self._acceptor.start()

    def url(self, mount: str = "cam") -> str:
        return f"rtsp://127.0.0.1:{self.port}/{mount.strip('/')}"

    @property
    def connections(self) -> int:
        """How many proxied connections are open now."""
        with self._lock:
            return len(self._links)

    def cut(self) -> None:
        """Close every open connection; new ones are still accepted."""
        with self._lock:
            links, self._links = self._links, set()
        for link in links:
            link.close()

    def refuse(self, on: bool = True) -> None:
        """While on, close each new connection as soon as it is accepted."""
        self._refusing = on

    def stall(self) -> None:
        """Stop forwarding in both directions; connections stay open."""
        self._flowing.clear()

    def resume(self) -> None:
        self._flowing.set()

    def close(self) -> None:
        self._closing = True
        self._flowing.set()
        self._acceptor.join()
        self._listener.close()
        self.cut()

    def __enter__(self) -> "TcpProxy":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _accept_loop(self) -> None:
        while not self._closing:
            try:
                client, _ = self._listener.accept()
            except TimeoutError:
                continue
            client.settimeout(None)
            if self._refusing:
                client.close()
                continue
            try:
                upstream = socket.create_connection(self.target, timeout=5)
                upstream.settimeout(None)
            except OSError:
                client.close()  # the target is down: the client sees its connection closed
                continue
            link = _Link(client, upstream)
            with self._lock:
                self._links.add(link)
            for src, dst in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(link, src, dst), daemon=True).start()

    def _pump(self, link: _Link, src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                while not self._flowing.wait(0.05):
                    if link.closed:
                        return
                dst.sendall(data)
        except OSError:
            pass
        finally:
            with self._lock:
                self._links.discard(link)
            link.close()
