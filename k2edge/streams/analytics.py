"""Zones and lines over tracks (pure): a stream's tracks in, events and counts out.

Everything is in source pixels (x right, y down) and anchored at a track's box bottom-centre
(:attr:`TrackState.anchor`), where an object meets the ground.

* A zone is a simple polygon (a self-intersecting one is refused: its inside is ambiguous); a
  track is inside when its anchor is (ray casting; a point on an edge may fall either way,
  consistently). ``zone_enter`` when a track's anchor moves in, or when a track
  starts inside; ``zone_leave`` when it moves out, or when a track inside ends.
* A line is the segment from ``start`` to ``end``. With ``c = (end - start) x (anchor - start)``
  (the 2-D cross product), a track crosses it when ``c`` changes sign and the anchor's path
  since its previous processed position meets the segment; ``"in"`` when ``c`` goes from negative
  to positive, ``"out"`` the other way. ``c == 0`` (touching the line) keeps the side the track
  came from, so touching and going back is no crossing and touching then going on is one.
  A track first seen on the line takes its side from its first position off it.

Only confirmed tracks (:attr:`TrackState.confirmed`) are followed: a tentative track, born this
frame and perhaps a detector's one-frame mistake, raises nothing; once confirmed it is followed
from its position then (a track confirmed inside a zone enters it).

Events come out in a stable order: by track id; per track its zone events (zones in their given
order) then its line crossings (lines in order); then the ``zone_leave`` of the tracks ended this
update, by id.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Iterable, Sequence

from .tracker import TrackState

__all__ = ["Analytics", "Line", "Zone", "frame_warnings", "segment_crossing"]

Point = tuple[float, float]


def _point(p, what: str) -> Point:
    try:
        x, y = p
        return float(x), float(y)
    except (TypeError, ValueError):
        raise ValueError(f"{what}: a point is [x, y], got {p!r}") from None


@dataclass(frozen=True)
class Zone:
    """A named polygon in source pixels.

    Raises:
        ValueError: no name, fewer than 3 points, a point that is not ``[x, y]``, or edges that cross
            or touch each other (a self-intersecting polygon).
    """

    name: str
    points: tuple[Point, ...]

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("a zone needs a name")
        pts = tuple(_point(p, f"zone {self.name!r}") for p in self.points)
        if len(pts) > 3 and pts[0] == pts[-1]:
            pts = pts[:-1]  # a closed ring (GeoJSON's way): the polygon closes itself anyway
        if len(pts) < 3:
            raise ValueError(f"zone {self.name!r} needs at least 3 points, got {len(pts)}")
        repeated = next((p for i, p in enumerate(pts) if p == pts[(i + 1) % len(pts)]), None)
        if repeated is not None:
            raise ValueError(f"zone {self.name!r} repeats the point {list(repeated)} (an edge of no length): give each "
                             "corner once")
        crossing = _self_intersection(pts)
        if crossing is not None:
            i, j = crossing
            n = len(pts)
            raise ValueError(f"zone {self.name!r} intersects itself: edge {list(pts[i])}-{list(pts[(i + 1) % n])} "
                             f"meets edge {list(pts[j])}-{list(pts[(j + 1) % n])} (list the points in order around the area)")
        object.__setattr__(self, "points", pts)

    def contains(self, p: Point) -> bool:
        """Whether ``p`` is inside the polygon (ray casting along +x)."""
        x, y = p
        inside = False
        pts = self.points
        for (x1, y1), (x2, y2) in zip(pts, pts[1:] + pts[:1]):
            if (y1 > y) != (y2 > y) and x < x1 + (y - y1) * (x2 - x1) / (y2 - y1):
                inside = not inside
        return inside


@dataclass(frozen=True)
class Line:
    """A named segment from ``start`` to ``end`` in source pixels; ``"in"`` is crossing from the
    side where ``(end - start) x (p - start) < 0`` to the side where it is > 0 (with y down: from
    the left of the direction start -> end to its right as drawn on screen).

    Raises:
        ValueError: no name, a point that is not ``[x, y]``, or ``start == end``.
    """

    name: str
    start: Point
    end: Point

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("a line needs a name")
        start, end = _point(self.start, f"line {self.name!r}"), _point(self.end, f"line {self.name!r}")
        if start == end:
            raise ValueError(f"line {self.name!r}: start and end are the same point {list(start)}")
        object.__setattr__(self, "start", start)
        object.__setattr__(self, "end", end)

    def side(self, p: Point) -> float:
        """``c = (end - start) x (p - start)``: < 0 one side, > 0 the other, 0 on the line."""
        (sx, sy), (ex, ey) = self.start, self.end
        return (ex - sx) * (p[1] - sy) - (ey - sy) * (p[0] - sx)


def _cross(o: Point, a: Point, b: Point) -> float:
    return (a[0] - o[0]) * (b[1] - o[1]) - (a[1] - o[1]) * (b[0] - o[0])


def _segments_meet(p1: Point, p2: Point, q1: Point, q2: Point) -> bool:
    """Whether two closed segments share a point (touching and collinear overlap count)."""
    d1, d2, d3, d4 = _cross(q1, q2, p1), _cross(q1, q2, p2), _cross(p1, p2, q1), _cross(p1, p2, q2)
    if ((d1 > 0) != (d2 > 0) and d1 != 0 and d2 != 0) and ((d3 > 0) != (d4 > 0) and d3 != 0 and d4 != 0):
        return True

    def on(a: Point, b: Point, c: Point) -> bool:  # c on segment a-b, given collinear
        return min(a[0], b[0]) <= c[0] <= max(a[0], b[0]) and min(a[1], b[1]) <= c[1] <= max(a[1], b[1])

    return ((d1 == 0 and on(q1, q2, p1)) or (d2 == 0 and on(q1, q2, p2)) or (d3 == 0 and on(p1, p2, q1))
            or (d4 == 0 and on(p1, p2, q2)))


def _self_intersection(pts: tuple[Point, ...]) -> tuple[int, int] | None:
    """The first pair of edges ``(i, j)`` (edge i runs from point i to point i + 1) that meet where they
    should not: non-adjacent edges sharing any point, or adjacent ones folding back onto each other."""
    n = len(pts)
    edges = [(pts[i], pts[(i + 1) % n]) for i in range(n)]
    for i in range(n):
        if edges[i][0] == edges[i][1]:
            return i, i  # a repeated point: a zero-length edge
        for j in range(i + 1, n):
            adjacent = j == i + 1 or (i == 0 and j == n - 1)
            if not adjacent:
                if _segments_meet(*edges[i], *edges[j]):
                    return i, j
            else:  # adjacent edges share one end; they must not overlap beyond it (a fold back)
                (a, b), (c, d) = edges[i], edges[j]
                shared = b if b == c else a
                far_i, far_j = (a if shared == b else b), (d if shared == c else c)
                if _cross(shared, far_i, far_j) == 0 and ((far_i[0] - shared[0]) * (far_j[0] - shared[0])
                                                          + (far_i[1] - shared[1]) * (far_j[1] - shared[1])) > 0:
                    return i, j
    return None


def frame_warnings(zones: Sequence[Zone], lines: Sequence[Line], width: int, height: int) -> list[str]:
    """What is wrong with ``zones`` and ``lines`` on a ``width`` x ``height`` frame: one line each for a
    zone or line with points outside it (wholly outside: it can never fire; partly: part of it can
    never be reached), naming the points. Empty when everything lies in the frame."""

    def outside(p: Point) -> bool:
        return not (0 <= p[0] <= width and 0 <= p[1] <= height)

    out = []
    size = f"the {width}x{height} frame"
    for what, name, pts in ([("zone", z.name, z.points) for z in zones]
                            + [("line", ln.name, (ln.start, ln.end)) for ln in lines]):
        off = [p for p in pts if outside(p)]
        if not off:
            continue
        shown = ", ".join(f"[{p[0]:g}, {p[1]:g}]" for p in off[:4]) + (", ..." if len(off) > 4 else "")
        if what == "zone":
            xs, ys = [p[0] for p in pts], [p[1] for p in pts]
            whole = max(xs) < 0 or min(xs) > width or max(ys) < 0 or min(ys) > height
        else:
            whole = len(off) == 2 and not any(_segments_meet(pts[0], pts[1], a, b) for a, b in _frame_edges(width, height))
        extent = "lies wholly outside" if whole else "has points outside"
        out.append(f"{what} {name!r} {extent} {size} ({shown}): "
                   + ("it can never fire; was it drawn for another resolution?" if whole
                      else "that part can never be reached"))
    return out


def _frame_edges(width: int, height: int) -> list[tuple[Point, Point]]:
    c = [(0.0, 0.0), (float(width), 0.0), (float(width), float(height)), (0.0, float(height))]
    return [(c[i], c[(i + 1) % 4]) for i in range(4)]


def segment_crossing(line: Line, p0: Point, p1: Point) -> bool:
    """Whether the path ``p0 -> p1`` meets the segment of ``line`` (closed: touching counts; the
    caller decides by the sides whether it is a crossing)."""
    c0, c1 = line.side(p0), line.side(p1)
    if (c0 > 0 and c1 > 0) or (c0 < 0 and c1 < 0):
        return False
    (ax, ay), (bx, by) = line.start, line.end
    dx, dy = p1[0] - p0[0], p1[1] - p0[1]
    d_a = dx * (ay - p0[1]) - dy * (ax - p0[0])
    d_b = dx * (by - p0[1]) - dy * (bx - p0[0])
    if d_a == 0 and d_b == 0:  # the path runs along the line: it meets it where their extents overlap
        t = [(q[0] - ax) * (bx - ax) + (q[1] - ay) * (by - ay) for q in (p0, p1)]
        length = (bx - ax) ** 2 + (by - ay) ** 2
        return max(t) >= 0 and min(t) <= length
    return (d_a <= 0 <= d_b) or (d_b <= 0 <= d_a)


@dataclass
class _Follow:
    label: str
    anchor: Point
    zones: set[str] = field(default_factory=set)
    sides: dict[str, int] = field(default_factory=dict)  # line -> -1 / +1 (absent: on the line so far)


def _sign(c: float) -> int:
    return (c > 0) - (c < 0)


class Analytics:
    """One stream's zones and lines, following its tracks from update to update.

    Args:
        zones: the zones (names unique).
        lines: the lines (names unique).

    Raises:
        ValueError: a name used twice.
    """

    def __init__(self, zones: Iterable[Zone] = (), lines: Iterable[Line] = ()) -> None:
        self.zones: tuple[Zone, ...] = tuple(zones)
        self.lines: tuple[Line, ...] = tuple(lines)
        for kind, items in (("zone", self.zones), ("line", self.lines)):
            names = [i.name for i in items]
            dup = sorted({n for n in names if names.count(n) > 1})
            if dup:
                raise ValueError(f"{kind} names must be unique; {', '.join(map(repr, dup))} is used twice")
        self._follow: dict[int, _Follow] = {}
        self._entered = {z.name: Counter() for z in self.zones}
        self._crossed = {ln.name: {"in": Counter(), "out": Counter()} for ln in self.lines}

    def update(self, active: Sequence[TrackState], removed: Sequence[int] = ()) -> list[dict]:
        """Follow the tracks matched this frame and forget those ended.

        Args:
            active: the tracks matched this frame (:attr:`TrackUpdate.active`); tentative ones are ignored.
            removed: ids of the tracks ended (:attr:`TrackUpdate.removed`).

        Returns:
            The events, in the module's stable order: ``{"event": "zone_enter" | "zone_leave",
            "track_id", "label", "zone"}`` and ``{"event": "line_cross", "track_id", "label",
            "line", "direction": "in" | "out"}``.
        """
        events: list[dict] = []
        for track in sorted(active, key=lambda t: t.id):
            if track.confirmed:  # a tentative track is not followed: it raises nothing
                events += self._move(track)
        for tid in sorted(set(removed)):
            follow = self._follow.pop(tid, None)
            if follow is not None:
                events += [self._zone_event("zone_leave", tid, follow.label, z.name)
                           for z in self.zones if z.name in follow.zones]
        return events

    def _move(self, track: TrackState) -> list[dict]:
        anchor = (float(track.anchor[0]), float(track.anchor[1]))
        follow = self._follow.get(track.id)
        events: list[dict] = []
        if follow is None:
            follow = self._follow[track.id] = _Follow(track.label, anchor)
            previous = None
        else:
            previous = follow.anchor
            follow.label, follow.anchor = track.label, anchor
        for zone in self.zones:
            inside = zone.contains(anchor)
            if inside and zone.name not in follow.zones:
                follow.zones.add(zone.name)
                self._entered[zone.name][track.label] += 1
                events.append(self._zone_event("zone_enter", track.id, track.label, zone.name))
            elif not inside and zone.name in follow.zones:
                follow.zones.discard(zone.name)
                events.append(self._zone_event("zone_leave", track.id, track.label, zone.name))
        for line in self.lines:
            side = _sign(line.side(anchor))
            if side == 0:
                continue  # on the line: keep the side it came from
            was = follow.sides.get(line.name)
            follow.sides[line.name] = side
            if was is None or was == side or previous is None or not segment_crossing(line, previous, anchor):
                continue
            direction = "in" if side > 0 else "out"
            self._crossed[line.name][direction][track.label] += 1
            events.append({"event": "line_cross", "track_id": track.id, "label": track.label, "line": line.name,
                           "direction": direction})
        return events

    @staticmethod
    def _zone_event(kind: str, tid: int, label: str, zone: str) -> dict:
        return {"event": kind, "track_id": tid, "label": label, "zone": zone}

    def counts(self) -> dict:
        """``{"zones": {zone: {"inside": {label: n}, "entered": {label: n}}}, "lines": {line: {"in":
        {label: n}, "out": {label: n}}}}``: tracks inside now (by their current label), and totals
        since the start."""
        inside = {z.name: Counter() for z in self.zones}
        for follow in self._follow.values():
            for name in follow.zones:
                inside[name][follow.label] += 1
        return {
            "zones": {z.name: {"inside": dict(sorted(inside[z.name].items())),
                               "entered": dict(sorted(self._entered[z.name].items()))} for z in self.zones},
            "lines": {ln.name: {d: dict(sorted(self._crossed[ln.name][d].items())) for d in ("in", "out")}
                      for ln in self.lines},
        }
