"""Clips around events, remuxed from a ring of the source's encoded packets (no re-encode), as
DeepStream's Smart Record does.

The reader thread hands every demuxed packet to the stream's :class:`PacketRing` (PyAV sources).
The ring keeps the newest packets back to the last keyframe at or before ``pre_s +`` :data:`LAG_S`
seconds ago, and never more than ``max_bytes``: its memory is bounded and reported
(:meth:`PacketRing.status`).

A clip is asked for (:meth:`PacketRing.request`, any thread) with its event's frame time on the
source's timeline. At the reader thread's next packet a :class:`_ClipWriter` opens an MP4 file in
the spool directory (its stream a copy of the source's, so nothing is decoded or encoded), writes
the ring's packets from the keyframe at or before ``event - pre_s``, then each new packet until one
comes after ``event + post_s``; then ``on_done`` gets the file. A source that goes away first ends
the clip there (``cut_short``). Muxing a packet is a copy into the page cache: the reader is not
slowed, and a clip being cut holds no memory of its own (many events at once cost disk, not RAM).
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

log = logging.getLogger(__name__)

MAX_RING_BYTES = 32 * 1024 * 1024  # a stream's packet ring never holds more (a 1080p camera at 8 Mb/s: 32 s)
# A clip is asked for once its event's frame is processed and its snapshot written, while the reader has
# demuxed on (the decoder's delay, the batch, the snapshot): the ring keeps this much beyond pre_s for that.
LAG_S = 2.0


@dataclass(frozen=True)
class ClipInfo:
    """A finished clip.

    Attributes:
        event_id: the event it is about.
        path: the MP4 in the spool directory (None when no clip could be made: ``reason`` says why).
        size: its bytes.
        start_s: its first packet's time on the source's timeline (a keyframe).
        end_s: its last frame's time.
        event_s: the event's frame time.
        packets: how many packets it holds.
        cut_short: the source went away before ``event + post_s``.
        reason: why there is no clip, or why it starts later than asked (None when all is well).
    """

    event_id: str
    path: Path | None
    size: int
    start_s: float | None
    end_s: float | None
    event_s: float
    packets: int
    cut_short: bool = False
    reason: str | None = None


@dataclass(slots=True)
class _Packet:
    data: bytes
    pts: int | None
    dts: int | None
    key: bool
    duration: int


class _ClipWriter:
    """One clip being written (the reader thread only)."""

    def __init__(self, av, template, time_base, event_id: str, event_s: float, end_s: float,
                 on_done: Callable[[ClipInfo], None], path: Path) -> None:
        self.av, self.time_base = av, time_base
        self.event_id, self.event_s, self.end_s, self.on_done = event_id, event_s, end_s, on_done
        self.path = path
        self.container = av.open(str(path), "w", format="mp4")
        self.stream = self.container.add_stream_from_template(template)
        self.origin: int | None = None  # the first packet's dts: the clip's time starts at 0
        self.start_s: float | None = None
        self.last_s: float | None = None
        self.count = 0
        self.note: str | None = None

    def add(self, p: _Packet) -> bool:
        """Mux one packet; True once the clip is complete (a packet after its end came)."""
        tb = float(self.time_base)
        t = (p.pts if p.pts is not None else p.dts) * tb if (p.pts is not None or p.dts is not None) else None
        if t is not None and self.count and t > self.end_s and (p.dts is None or p.dts * tb > self.end_s):
            return True
        if not self.count and not p.key:
            return False  # a clip starts at a keyframe: what comes before one cannot be decoded
        if self.origin is None:
            self.origin = p.dts if p.dts is not None else (p.pts or 0)
            self.start_s = t
        packet = self.av.Packet(p.data)
        packet.pts = None if p.pts is None else p.pts - self.origin
        packet.dts = None if p.dts is None else p.dts - self.origin
        packet.time_base = self.time_base
        packet.is_keyframe = p.key
        if p.duration:
            packet.duration = p.duration
        packet.stream = self.stream
        self.container.mux(packet)
        self.count += 1
        if t is not None:
            self.last_s = t if self.last_s is None else max(self.last_s, t)
        return False

    def finish(self, cut_short: bool = False) -> None:
        try:
            self.container.close()
            if not self.count:
                raise ValueError("no packets: the source sent none since the event")
            info = ClipInfo(self.event_id, self.path, self.path.stat().st_size, self.start_s, self.last_s, self.event_s,
                            self.count, cut_short, self.note)
        except Exception as exc:  # a muxer error, a full disk: the event keeps its snapshot, the clip says why
            self.path.unlink(missing_ok=True)
            why = str(exc) if isinstance(exc, ValueError) else f"the clip could not be written: {exc}"
            info = ClipInfo(self.event_id, None, 0, None, None, self.event_s, 0, cut_short, why)
        self.on_done(info)


class PacketRing:
    """One stream's ring of encoded packets and the clips being cut from it (see the module docstring).

    Args:
        spool: the directory clips are written to while they are cut (``<event_id>.mp4``).
        pre_s: seconds before an event a clip starts (at the keyframe at or before it).
        post_s: seconds after the event a clip ends.
        max_bytes: the most the ring holds.
    """

    def __init__(self, spool: Path, pre_s: float = 3.0, post_s: float = 5.0, max_bytes: int = MAX_RING_BYTES) -> None:
        self.spool = Path(spool)
        self.pre_s, self.post_s, self.max_bytes = float(pre_s), float(post_s), int(max_bytes)
        self._lock = threading.Lock()
        self._packets: deque[_Packet] = deque()
        self._bytes = 0
        self._requests: list[tuple[str, float, Callable[[ClipInfo], None]]] = []
        self._writers: list[_ClipWriter] = []
        self._av = self._template = self._time_base = None
        self.cut = self.cut_failed = 0  # clips cut in the spool, and asked for but not cut

    # the reader thread -----------------------------------------------------------------------------------
    def open(self, av, stream) -> None:
        """A capture opened: its stream is the template of the clips; the packets of an earlier one are dropped
        (and clips asked for since it closed fail: their packets are gone)."""
        self.close_capture()
        with self._lock:
            self._av, self._template, self._time_base = av, stream, stream.time_base
            self._packets.clear()
            self._bytes = 0

    def add(self, packet) -> None:
        """One demuxed packet (a PyAV ``Packet``, copied here)."""
        if packet.size == 0 or self._template is None:
            return
        p = _Packet(bytes(packet), packet.pts, packet.dts, bool(packet.is_keyframe), int(packet.duration or 0))
        with self._lock:
            self._packets.append(p)
            self._bytes += len(p.data)
            self._trim()
            requests, self._requests = self._requests, []
            preroll = list(self._packets) if requests else None
        for event_id, event_s, on_done in requests:
            self._open_writer(event_id, event_s, on_done, preroll[:-1])
        done = []
        for w in self._writers:
            try:
                if w.add(p):
                    done.append(w)
            except Exception as exc:
                w.note = f"the clip could not be written: {exc}"
                done.append(w)
        for w in done:
            self._writers.remove(w)
            self._finish(w)

    def close_capture(self) -> None:
        """The capture ends (a disconnect, a file's end; called before it is closed): clips asked for are cut
        from what the ring holds, and clips being written end here (``cut_short``). Clips asked for later,
        before the next capture opens, fail saying so."""
        with self._lock:
            requests, self._requests = self._requests, []
            preroll = list(self._packets)
            template, self._template = self._template, None
        if template is not None:
            self._template = template
            for event_id, event_s, on_done in requests:
                self._open_writer(event_id, event_s, on_done, preroll)
            self._template = None
        else:
            for event_id, event_s, on_done in requests:
                self.failed += 1
                on_done(ClipInfo(event_id, None, 0, None, None, event_s, 0, True, "no clip: the source closed before "
                                 "it could be cut"))
        writers, self._writers = self._writers, []
        for w in writers:
            self._finish(w, cut_short=True)

    # any thread --------------------------------------------------------------------------------------------
    def request(self, event_id: str, event_s: float, on_done: Callable[[ClipInfo], None]) -> None:
        """Ask for a clip around ``event_s`` (the event's frame time on the source's timeline); ``on_done``
        gets it on the reader thread once complete."""
        with self._lock:
            self._requests.append((event_id, float(event_s), on_done))

    def status(self) -> dict:
        """``{"ring_bytes", "ring_packets", "ring_s", "writing", "waiting", "cut", "cut_failed", "max_bytes"}``."""
        with self._lock:
            span = self._span()
            return {"ring_bytes": self._bytes, "ring_packets": len(self._packets), "ring_s": round(span, 3),
                    "writing": len(self._writers), "waiting": len(self._requests), "cut": self.cut,
                    "cut_failed": self.cut_failed, "max_bytes": self.max_bytes}

    # internals -----------------------------------------------------------------------------------------------
    def _seconds(self, p: _Packet) -> float | None:
        t = p.pts if p.pts is not None else p.dts
        return None if t is None else t * float(self._time_base)

    def _span(self) -> float:
        if not self._packets or self._time_base is None:
            return 0.0
        ts = [t for t in (self._seconds(self._packets[0]), self._seconds(self._packets[-1])) if t is not None]
        return max(ts) - min(ts) if len(ts) == 2 else 0.0

    def _trim(self) -> None:
        """Drop from the front while the next keyframe still lies at or before ``newest - pre_s - LAG_S`` (a
        clip asked for now, for an event up to LAG_S old, starts there), and whatever passes ``max_bytes``."""
        newest = self._seconds(self._packets[-1])
        while len(self._packets) > 1:
            if self._bytes > self.max_bytes:
                self._pop()
                continue
            nxt = next((i for i, p in enumerate(self._packets) if i and p.key), None)
            if nxt is None or newest is None:
                break
            t = self._seconds(self._packets[nxt])
            if t is None or t > newest - self.pre_s - LAG_S:
                break
            for _ in range(nxt):
                self._pop()

    def _pop(self) -> None:
        p = self._packets.popleft()
        self._bytes -= len(p.data)

    def _open_writer(self, event_id: str, event_s: float, on_done, preroll: list[_Packet]) -> None:
        start = event_s - self.pre_s
        keys = [i for i, p in enumerate(preroll) if p.key and (self._seconds(p) is not None)]
        at_or_before = [i for i in keys if self._seconds(preroll[i]) <= start + 1e-9]
        note = None
        if at_or_before:
            first = at_or_before[-1]
        elif keys:
            first = keys[0]
            note = (f"starts at {self._seconds(preroll[first]):.3f} s, later than {start:.3f} s: the ring held no "
                    "keyframe that early")
        else:
            first = None
        try:
            self.spool.mkdir(parents=True, exist_ok=True)
            w = _ClipWriter(self._av, self._template, self._time_base, event_id, event_s, event_s + self.post_s, on_done,
                            self.spool / f"{event_id}.mp4")
        except Exception as exc:
            self.failed += 1
            on_done(ClipInfo(event_id, None, 0, None, None, event_s, 0, False, f"the clip could not be started: {exc}"))
            return
        w.note = note
        done = False
        if first is not None:
            for p in preroll[first:]:
                if w.add(p):
                    done = True
                    break
        elif preroll:
            w.note = "the ring held no keyframe: the clip starts at the next one"
        if done:
            self._finish(w)
        else:
            self._writers.append(w)

    def _finish(self, w: _ClipWriter, cut_short: bool = False) -> None:
        told = w.on_done

        def counted(info: ClipInfo) -> None:
            if info.path is not None:
                self.cut += 1
            else:
                self.cut_failed += 1
            told(info)

        w.on_done = counted
        w.finish(cut_short)
