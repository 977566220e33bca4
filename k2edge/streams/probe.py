"""What this machine offers the stream backends (``k2edge doctor``): PyAV with its FFmpeg, and
GStreamer through ``gi`` with the Jetson's NVDEC elements. Every import is tried here, never at
module import, and a missing piece is a value in the report, not an error."""

from __future__ import annotations

NVDEC_ELEMENTS = ("nvv4l2decoder", "nvvidconv")  # the Jetson's hardware decoder, and its converter to system memory


def video_report() -> dict:
    """``{"pyav": {"version", "ffmpeg", "h264"}, "gstreamer": {"gi", "version", "elements": {name: bool}}}``;
    a piece that is missing is None (``elements`` empty without GStreamer)."""
    pyav = {"version": None, "ffmpeg": None, "h264": None}
    try:
        import av

        pyav["version"] = av.__version__
        lib = getattr(av, "library_versions", {}).get("libavcodec")
        pyav["ffmpeg"] = "libavcodec " + ".".join(map(str, lib)) if lib else None
        try:
            av.codec.Codec("h264", "r")
            pyav["h264"] = True
        except Exception:  # an FFmpeg built without the decoder
            pyav["h264"] = False
    except ImportError:
        pass
    gst = {"gi": None, "version": None, "elements": {}}
    try:
        import gi

        gst["gi"] = getattr(gi, "__version__", "present")
        gi.require_version("Gst", "1.0")
        from gi.repository import Gst

        Gst.init(None)
        gst["version"] = Gst.version_string()
        gst["elements"] = {name: Gst.ElementFactory.find(name) is not None for name in NVDEC_ELEMENTS}
    except (ImportError, ValueError):  # no gi, or gi without GStreamer 1.0's typelib
        pass
    return {"pyav": pyav, "gstreamer": gst}
