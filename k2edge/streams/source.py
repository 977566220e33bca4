"""Video source URIs (jetson-inference's style), pure: what a source is, how it is shown, who reads it.

==========================  =======  ==========================================================
URI                         live     read by
==========================  =======  ==========================================================
``file:///path.mp4``        no       PyAV (FFmpeg); played at the file's own rate by the daemon
``rtsp://[u:p@]host/path``  yes      PyAV over RTSP/TCP (GStreamer on a Jetson: ``backend = "gstreamer"``)
``v4l2:///dev/video0``      yes      PyAV's v4l2 input (GStreamer ``v4l2src`` on a Jetson)
``csi://0``                 yes      GStreamer ``nvarguscamerasrc`` (Jetson only)
``gst:<pipeline>``          yes      GStreamer; the pipeline ends in ``appsink name=sink``
==========================  =======  ==========================================================

Credentials in an RTSP URI are the one secret a source holds: :attr:`SourceSpec.shown` is the URI
without them, and nothing else about a source is ever logged, published or used as a label.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from urllib.parse import quote, unquote, urlsplit, urlunsplit

SCHEMES = ("file", "rtsp", "rtsps", "v4l2", "csi", "gst")
LIVE = {"rtsp", "rtsps", "v4l2", "csi", "gst"}


@dataclass(frozen=True)
class SourceSpec:
    """One parsed source.

    Attributes:
        kind: ``file``, ``rtsp`` (``rtsps`` too), ``v4l2``, ``csi`` or ``gst``.
        target: what the backend opens: a file path, the RTSP URL with its credentials, a device
            path, a sensor id or a pipeline.
        shown: the URI as logs and status show it (credentials replaced by ``***``).
        live: a camera: its end is a disconnect, and only the newest frame counts.
    """

    kind: str
    target: str = field(repr=False)
    shown: str
    live: bool

    def __str__(self) -> str:
        return self.shown


def redact(uri: str) -> str:
    """``uri`` with any ``user:password@`` replaced by ``***@`` (any scheme, malformed ones too)."""
    scheme, sep, rest = uri.partition("://")
    if not sep:
        return uri
    # the credentials end at the last "@" before any query or fragment (a password may hold "/" or ":")
    end = min((i for i in (rest.find("?"), rest.find("#")) if i >= 0), default=len(rest))
    at = rest.rfind("@", 0, end)
    if at < 0 or "/" in rest[:at] and scheme.lower() == "file":
        return uri
    return f"{scheme}://***@{rest[at + 1:]}"


def parse_source(uri: str, password: str | None = None) -> SourceSpec:
    """Parse a source URI.

    Args:
        uri: the ``source`` of a ``[[streams]]`` entry or of ``k2edge watch``.
        password: replaces the password in an RTSP URI (``password_file``).

    Raises:
        ValueError: an unknown scheme or a malformed URI; the message never holds a password.
    """
    uri = uri.strip()
    shown = redact(uri)
    if uri.startswith("gst:"):
        pipeline = uri[4:].strip()
        if not pipeline:
            raise ValueError("gst: needs a GStreamer pipeline after it, ending in an appsink named sink")
        return SourceSpec("gst", pipeline, shown, True)
    scheme, sep, _ = uri.partition("://")
    scheme = scheme.lower()
    if not sep or scheme not in SCHEMES:
        raise ValueError(f"source {shown!r}: expected file:///path, rtsp://host/path, v4l2:///dev/videoN, csi://N or "
                         "gst:<pipeline>")
    parts = urlsplit(uri)
    if scheme == "file":
        if parts.netloc not in ("", "localhost"):  # file://clip.mp4: a path relative to wherever the daemon runs
            raise ValueError(f"source {shown!r}: file:// takes an absolute path, file:///absolute/path.mp4 (three "
                             "slashes)")
        path = unquote(parts.path)
        if not path:
            raise ValueError(f"source {shown!r}: no file path (file:///absolute/path.mp4)")
        return SourceSpec("file", path, shown, False)
    if scheme in ("rtsp", "rtsps"):
        if shown != uri and "@" not in parts.netloc:
            raise ValueError(f"source {shown!r}: the credentials hold '/', '?' or '#': percent-encode them (%2F, %3F, "
                             "%23) or put the password in password_file")
        if not parts.hostname:
            raise ValueError(f"source {shown!r}: no host (rtsp://[user:pass@]host[:port]/path)")
        try:
            parts.port  # noqa: B018 - validates the port
        except ValueError:
            raise ValueError(f"source {shown!r}: the port is not a number in 1..65535") from None
        target = uri
        if password is not None:
            user = parts.username or ""
            host = parts.hostname if ":" not in parts.hostname else f"[{parts.hostname}]"
            netloc = f"{quote(user, safe='')}:{quote(password, safe='')}@{host}" + (f":{parts.port}" if parts.port else "")
            target = urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))
        return SourceSpec("rtsp", target, shown, True)
    if scheme == "v4l2":
        device = parts.path or parts.netloc
        if not device:
            raise ValueError(f"source {shown!r}: no device (v4l2:///dev/video0)")
        return SourceSpec("v4l2", device if device.startswith("/") else f"/dev/{device}", shown, True)
    sensor = (parts.netloc or parts.path.strip("/"))
    if not (sensor.isascii() and sensor.isdigit()):
        raise ValueError(f"source {shown!r}: csi:// takes a sensor id, e.g. csi://0")
    return SourceSpec("csi", sensor, shown, True)


def backend_for(spec: SourceSpec, backend: str = "auto") -> str:
    """``pyav`` or ``gstreamer`` for a source; ``auto`` takes GStreamer only where PyAV cannot go.

    Raises:
        ValueError: the backend cannot read this kind of source.
    """
    if backend == "auto":
        return "gstreamer" if spec.kind in ("csi", "gst") else "pyav"
    if backend == "pyav" and spec.kind in ("csi", "gst"):
        raise ValueError(f"source {spec.shown!r}: {spec.kind} sources are read by GStreamer (backend = \"gstreamer\")")
    return backend
