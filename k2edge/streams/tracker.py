"""ByteTrack (Zhang et al., "ByteTrack: Multi-Object Tracking by Associating Every Detection Box",
ECCV 2022): per-stream multi-object tracking by IoU, pure numpy plus scipy's assignment solver.

Each track carries a constant-velocity Kalman filter on ``(cx, cy, aspect, h)`` (SORT / ByteTrack's
filter and noise weights). An update associates in ByteTrack's stages:

1. detections scoring at least ``high`` against every confirmed track, tracked or lost, by IoU
   (a pair needs IoU >= ``match_iou``);
2. the detections scoring between ``low`` and ``high`` against the tracks still tracked and
   unmatched (IoU >= 0.5, ByteTrack's second-stage threshold);
3. the remaining detections that could start a track against the tentative tracks (born last
   frame; IoU >= 0.3); a tentative track that misses is dropped at once, as ByteTrack drops its
   unconfirmed tracks.

Then every detection still unmatched, best first: one that overlaps a detection already given a
track this frame by IoU >= ``duplicate_iou`` (the same object under a second label) takes that
track's id and starts nothing ("one object, one track"); otherwise one scoring at least
``new_track`` starts a track; otherwise it gets :data:`UNTRACKED`. With the card's score threshold
as ``new_track``, every detection the daemon publishes (only those above it) has a track id; the
cost of that is measured in :class:`ByteTracker`'s notes. On the first update every track starts
confirmed, as in ByteTrack.

Ids start at 1, are unique per tracker and never reused. A track's label is the label it was
detected under most often over its last :data:`LABEL_WINDOW` matched detections (ties: the most
recent), not over its whole life: after an identity switch the label follows the object now there.
Association of a tracked object is class-agnostic (a detector that reads one digit as 6 in one
frame and 5 in the next still follows one object), but a track missed in the last
:data:`RELABEL_GAP` updates or more is found again only by a detection whose label is in its window: an
object that appears where another vanished starts its own track instead of inheriting the
vanished one's id, label and zones. A shorter miss (two objects overlapping, the detector
flickering between their labels) is not gated: on tests/test_tracker.py's crossing video at
``new_track`` 0.25, gating every lost track measured IDF1 0.847 against 0.903 ungated; gating
after 2 missed updates 0.894, with MOTA 0.974 against 0.958 and 3 ID switches against 6.

Time is in seconds (each update's ``t``, the frame's capture time): a track unmatched for more
than ``max_lost_s`` ends, whatever the frame rate or the frames dropped meanwhile, and the filter
predicts as many frames ahead as the update's ``frames`` says were decoded since the last one (the
daemon's frame indices count the frames it did not process), so an object moving while frames were
dropped is looked for where it went, not one frame on (8 dropped frames split 2 or 3 of the 5 digits of
the crossing video into two tracks each). Counting frames, not seconds: frames that arrive in a burst
after a network stall are still one frame apart each. A track born
after the first update is tentative until its second detection (:attr:`TrackState.confirmed`);
the analytics ignore tentative tracks.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from .._lazy import LazyModule

__all__ = ["UNTRACKED", "ByteTracker", "KalmanBoxFilter", "TrackState", "TrackUpdate", "box_iou"]

_optimize = LazyModule("scipy.optimize", "pip install 'k2edge[streams]'")

UNTRACKED = 0  # the id of a detection that joined no track (ids start at 1)
LABEL_WINDOW = 10  # a track's label: the most frequent over its last this many matched detections
NOMINAL_FPS = 30.0  # an update without a time is 1 / NOMINAL_FPS s after the previous one
RELABEL_GAP = 2  # a track missed in this many updates or more is found again only under a label it had lately
MAX_STEPS = 300  # the most frames one update predicts (a longer gap ends every track anyway)

_SECOND_STAGE_IOU = 0.5  # ByteTrack's second association: cost 1 - IoU <= 0.5
_TENTATIVE_IOU = 0.3     # ByteTrack's unconfirmed-track association: cost <= 0.7


def box_iou(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """(n, m) IoU of ``x1 y1 x2 y2`` boxes ``a`` (n, 4) and ``b`` (m, 4); 0 where a union is empty."""
    a = np.asarray(a, dtype=np.float64).reshape(-1, 4)
    b = np.asarray(b, dtype=np.float64).reshape(-1, 4)
    w = np.clip(np.minimum(a[:, None, 2], b[None, :, 2]) - np.maximum(a[:, None, 0], b[None, :, 0]), 0, None)
    h = np.clip(np.minimum(a[:, None, 3], b[None, :, 3]) - np.maximum(a[:, None, 1], b[None, :, 1]), 0, None)
    inter = w * h
    area_a = (a[:, 2] - a[:, 0]) * (a[:, 3] - a[:, 1])
    area_b = (b[:, 2] - b[:, 0]) * (b[:, 3] - b[:, 1])
    union = area_a[:, None] + area_b[None, :] - inter
    return np.divide(inter, union, out=np.zeros_like(inter), where=union > 0)


def _to_xyah(box: np.ndarray) -> np.ndarray:
    w, h = box[2] - box[0], max(box[3] - box[1], 1e-6)
    return np.array([(box[0] + box[2]) / 2, (box[1] + box[3]) / 2, w / h, h])


def _to_xyxy(xyah: np.ndarray) -> np.ndarray:
    """(n, 4+) Kalman means -> (n, 4) ``x1 y1 x2 y2``."""
    cx, cy, a, h = xyah[:, 0], xyah[:, 1], xyah[:, 2], xyah[:, 3]
    w = a * h
    return np.stack([cx - w / 2, cy - h / 2, cx + w / 2, cy + h / 2], axis=1)


class KalmanBoxFilter:
    """Constant-velocity Kalman filter on ``(cx, cy, aspect, h)`` and their velocities, one frame a
    step; noise proportional to the box height (SORT / DeepSORT / ByteTrack's ``KalmanFilter``)."""

    _POS = 1 / 20    # position noise, relative to the height
    _VEL = 1 / 160   # velocity noise, relative to the height

    def __init__(self) -> None:
        self._F = np.eye(8)
        self._F[:4, 4:] = np.eye(4)
        self._H = np.eye(4, 8)

    def initiate(self, xyah: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Mean (8,) and covariance (8, 8) of a new track at measurement ``xyah``."""
        h = xyah[3]
        std = np.array([2 * self._POS * h, 2 * self._POS * h, 1e-2, 2 * self._POS * h,
                        10 * self._VEL * h, 10 * self._VEL * h, 1e-5, 10 * self._VEL * h])
        return np.r_[xyah, np.zeros(4)], np.diag(std ** 2)

    def predict(self, means: np.ndarray, covs: np.ndarray, steps: int = 1) -> tuple[np.ndarray, np.ndarray]:
        """``steps`` frames ahead for (n, 8) means and (n, 8, 8) covariances at once (each step as one frame
        without a detection: the noise grows with each)."""
        for _ in range(steps):
            h = means[:, 3]
            one, tiny, small = np.ones_like(h), np.full_like(h, 1e-5), np.full_like(h, 1e-2)
            std = np.stack([self._POS * h, self._POS * h, small * one, self._POS * h,
                            self._VEL * h, self._VEL * h, tiny, self._VEL * h], axis=1)
            q = np.einsum("ni,ij->nij", std ** 2, np.eye(8))
            means = means @ self._F.T
            covs = self._F @ covs @ self._F.T + q
        return means, covs

    def update(self, mean: np.ndarray, cov: np.ndarray, xyah: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Correct one track's state with its measurement ``xyah``."""
        h = mean[3]
        r = np.diag(np.array([self._POS * h, self._POS * h, 1e-1, self._POS * h]) ** 2)
        s = self._H @ cov @ self._H.T + r
        gain = np.linalg.solve(s, self._H @ cov).T  # cov H^T S^-1 (S and cov symmetric)
        mean = mean + gain @ (xyah - self._H @ mean)
        cov = cov - gain @ s @ gain.T
        return mean, cov


@dataclass(frozen=True)
class TrackState:
    """A track as it stands after an update that matched it.

    Attributes:
        id: the track id (>= 1).
        label: the label it was detected under most often over its last :data:`LABEL_WINDOW` matched
            detections (ties: the most recent).
        box: ``(x1, y1, x2, y2)`` of its detection this frame, source pixels.
        anchor: ``(x, y)`` bottom-centre of ``box``: ``((x1 + x2) / 2, y2)``; zones and lines use it.
        score: its detection's score this frame.
        born: True on the frame the track started.
        confirmed: False while the track is tentative (born this update after the first one and
            not matched since): zones and lines raise no event for it.
    """

    id: int
    label: str
    box: tuple[float, float, float, float]
    anchor: tuple[float, float]
    score: float
    born: bool
    confirmed: bool = True


@dataclass(frozen=True)
class TrackUpdate:
    """What one :meth:`ByteTracker.update` did.

    Attributes:
        ids: (N,) int64, per input row the id of the track it joined, :data:`UNTRACKED` (0) for none.
        active: the tracks matched (or born) this frame, by id.
        removed: ids of the tracks ended this update (lost too long, or tentative and missed), ascending.
    """

    ids: np.ndarray
    active: list[TrackState]
    removed: list[int]


_TENTATIVE, _TRACKED, _LOST = "tentative", "tracked", "lost"


@dataclass
class _Track:
    id: int
    mean: np.ndarray
    cov: np.ndarray
    state: str
    born: int         # the update it started
    last_seen: float  # the time (s) it was last matched
    last_update: int  # the update it was last matched
    recent: deque = field(default_factory=lambda: deque(maxlen=LABEL_WINDOW))  # its last labels, oldest first

    @property
    def label(self) -> str:
        votes: dict[str, tuple[int, int]] = {}  # label -> (count, position of its latest)
        for i, label in enumerate(self.recent):
            votes[label] = (votes.get(label, (0, 0))[0] + 1, i)
        return max(votes.items(), key=lambda kv: kv[1])[0]  # most votes, then most recent


class ByteTracker:
    """Multi-object tracking of one stream's detections, one :meth:`update` per processed frame.

    Args:
        high: detections scoring at least this enter the first association (ByteTrack's
            ``track_thresh``).
        low: detections scoring below this are not associated at all (ByteTrack drops them).
        new_track: an unmatched detection scoring at least this starts a track (pass the model's
            score threshold so every published detection gets an id).
        match_iou: the least IoU of a first-stage match (ByteTrack's ``match_thresh`` 0.8 is the
            cost ``1 - IoU``).
        max_lost_s: a track unmatched for more than this many seconds ends (ByteTrack's
            ``track_buffer``, 30 frames, at 30 fps).
        duplicate_iou: an unmatched detection overlapping one already given a track this frame by
            at least this takes that track's id instead of starting one.

    The defaults are ByteTrack's (``track_thresh`` 0.5, low 0.1, ``match_thresh`` 0.8,
    ``track_buffer`` 30) except ``new_track``: ByteTrack starts tracks at ``track_thresh + 0.1``; here
    0.5, since the demo detector scores a clearly visible digit 0.58 or more (5th percentile on
    tests/support/stream_videos.py's crossing video, median 0.94) and lower boxes are mostly two
    overlapping digits seen as one. On that video (tests/test_tracker.py) ``new_track`` 0.5 gives
    MOTA 0.98, IDF1 0.99 and no ID switch; 0.25 (the demo card's score threshold) gives every
    detection an id at the cost of 3 ID switches (MOTA 0.974, IDF1 0.894) where two digits overlap.

    Raises:
        ValueError: thresholds out of range.
    """

    def __init__(self, *, high: float = 0.5, low: float = 0.1, new_track: float = 0.5, match_iou: float = 0.2,
                 max_lost_s: float = 1.0, duplicate_iou: float = 0.7) -> None:
        for name, value in (("high", high), ("low", low), ("new_track", new_track), ("match_iou", match_iou),
                            ("duplicate_iou", duplicate_iou)):
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"tracker {name} must be between 0 and 1, got {value}")
        if low > high:
            raise ValueError(f"tracker low ({low}) must not exceed high ({high})")
        if match_iou <= 0 or duplicate_iou <= 0:
            raise ValueError("tracker match_iou and duplicate_iou must be above 0")
        if not max_lost_s >= 0:
            raise ValueError(f"tracker max_lost_s must be a number of seconds >= 0, got {max_lost_s}")
        self.high, self.low, self.new_track = high, low, new_track
        self.match_iou, self.max_lost_s, self.duplicate_iou = match_iou, float(max_lost_s), duplicate_iou
        self._kf = KalmanBoxFilter()
        self._tracks: list[_Track] = []
        self._next_id = 1
        self._frame = 0
        self._time: float | None = None

    @property
    def tracks(self) -> int:
        """How many tracks are alive (tracked, tentative or lost)."""
        return len(self._tracks)

    def end_all(self) -> list[int]:
        """End every track (a source outage longer than ``max_lost_s``); their ids, ascending."""
        ids = sorted(t.id for t in self._tracks)
        self._tracks = []
        return ids

    def update(self, boxes: np.ndarray, scores: np.ndarray, labels: Sequence[str], t: float | None = None,
               frames: int | None = None) -> TrackUpdate:
        """Associate one frame's detections with the tracks, start and end tracks.

        Args:
            boxes: (N, 4) ``x1 y1 x2 y2`` in source pixels.
            scores: (N,) detection scores.
            labels: N labels.
            t: the frame's time in seconds (any clock that only goes forward: the daemon passes the
                frame's monotonic capture time); None: 1 / :data:`NOMINAL_FPS` after the previous update.
            frames: how many of the source's frames this one is after the previous update (the daemon passes the
                difference of their frame indices, which count the frames decoded and not processed); the filter
                predicts that many frames ahead. None: one (ByteTrack's one step an update).

        Returns:
            The :class:`TrackUpdate`: an id per input row, the tracks matched this frame, the ids ended.

        Raises:
            ValueError: the shapes do not agree.
        """
        boxes = np.asarray(boxes, dtype=np.float64).reshape(-1, 4) if len(boxes) else np.zeros((0, 4))
        scores = np.asarray(scores, dtype=np.float64).reshape(-1)
        if len(boxes) != len(scores) or len(labels) != len(scores):
            raise ValueError(f"tracker update: {len(boxes)} boxes, {len(scores)} scores and {len(labels)} labels "
                             "must be as many")
        self._frame += 1
        if t is None:
            t = 0.0 if self._time is None else self._time + 1.0 / NOMINAL_FPS
        self._time = float(t)
        self._predict(int(min(max(frames, 1), MAX_STEPS)) if frames is not None else 1)
        n = len(scores)
        owner = np.full(n, -1, dtype=np.int64)  # det -> index into self._tracks
        matched: set[int] = set()

        def associate(dets: np.ndarray, tracks: list[int], min_iou: float) -> None:
            if not len(dets) or not tracks:
                return
            predicted = _to_xyxy(np.stack([self._tracks[t].mean for t in tracks]))
            iou = box_iou(boxes[dets], predicted)
            for j, t in enumerate(tracks):  # a track lost a while is found again only under a label it had lately
                track = self._tracks[t]
                if track.state == _LOST and self._frame - track.last_update > RELABEL_GAP:
                    known = set(track.recent)
                    iou[[labels[d] not in known for d in dets], j] = 0.0
            for i, j in _assign(1.0 - iou, 1.0 - min_iou):
                owner[dets[i]] = tracks[j]
                matched.add(tracks[j])

        order = np.argsort(-scores, kind="stable")
        confirmed = [t for t, tr in enumerate(self._tracks) if tr.state != _TENTATIVE]
        associate(order[scores[order] >= self.high], confirmed, self.match_iou)
        tracked = [t for t in confirmed if t not in matched and self._tracks[t].state == _TRACKED]
        second = order[(scores[order] >= self.low) & (scores[order] < self.high)]
        associate(second[owner[second] < 0], tracked, _SECOND_STAGE_IOU)
        tentative = [t for t, tr in enumerate(self._tracks) if tr.state == _TENTATIVE]
        starters = order[(owner[order] < 0) & (scores[order] >= max(self.low, min(self.high, self.new_track)))]
        associate(starters, tentative, _TENTATIVE_IOU)

        ids = np.zeros(n, dtype=np.int64)
        primary = np.zeros(n, dtype=bool)  # the detection that updates its track (not a duplicate)
        for d in order:
            if owner[d] >= 0:
                self._correct(self._tracks[owner[d]], boxes[d], labels[d])
                primary[d] = True
        for d in order:  # unmatched, best first: a duplicate of a placed detection, a new track, or nothing
            if owner[d] >= 0:
                continue
            placed = np.flatnonzero(primary)
            if len(placed):
                iou = box_iou(boxes[d:d + 1], boxes[placed])[0]
                best = int(np.argmax(iou))
                if iou[best] >= self.duplicate_iou:
                    owner[d] = owner[placed[best]]
                    continue
            if scores[d] >= max(self.new_track, self.low):
                owner[d] = self._start(boxes[d], labels[d])
                matched.add(int(owner[d]))
                primary[d] = True
        for d in np.flatnonzero(owner >= 0):
            ids[d] = self._tracks[owner[d]].id

        active = []
        for d in np.flatnonzero(primary):
            tr = self._tracks[owner[d]]
            x1, y1, x2, y2 = (float(v) for v in boxes[d])
            active.append(TrackState(id=tr.id, label=tr.label, box=(x1, y1, x2, y2), anchor=((x1 + x2) / 2, y2),
                                     score=float(scores[d]), born=tr.born == self._frame,
                                     confirmed=tr.state != _TENTATIVE))
        active.sort(key=lambda s: s.id)
        removed = self._retire(matched)
        return TrackUpdate(ids=ids, active=active, removed=removed)

    def _predict(self, steps: int) -> None:
        if not self._tracks:
            return
        means = np.stack([t.mean for t in self._tracks])
        covs = np.stack([t.cov for t in self._tracks])
        lost = np.array([t.state == _LOST for t in self._tracks])
        means[lost, 7] = 0.0  # a lost track's height stops changing (as ByteTrack)
        means, covs = self._kf.predict(means, covs, steps)
        for t, m, c in zip(self._tracks, means, covs):
            t.mean, t.cov = m, c

    def _correct(self, track: _Track, box: np.ndarray, label: str) -> None:
        track.mean, track.cov = self._kf.update(track.mean, track.cov, _to_xyah(box))
        track.state = _TRACKED  # a tentative track is confirmed, a lost one found again
        track.last_seen, track.last_update = self._time, self._frame
        track.recent.append(label)

    def _start(self, box: np.ndarray, label: str) -> int:
        mean, cov = self._kf.initiate(_to_xyah(box))
        # on the first frame there is nothing to confirm against: tracks start confirmed (as ByteTrack)
        state = _TRACKED if self._frame == 1 else _TENTATIVE
        track = _Track(id=self._next_id, mean=mean, cov=cov, state=state, born=self._frame, last_seen=self._time,
                       last_update=self._frame)
        track.recent.append(label)
        self._next_id += 1
        self._tracks.append(track)
        return len(self._tracks) - 1

    def _retire(self, matched: set[int]) -> list[int]:
        keep, removed = [], []
        for t, track in enumerate(self._tracks):
            if t not in matched:
                if track.state == _TENTATIVE or self._time - track.last_seen > self.max_lost_s:
                    removed.append(track.id)
                    continue
                track.state = _LOST
            keep.append(track)
        self._tracks = keep
        return sorted(removed)


def _assign(cost: np.ndarray, limit: float) -> list[tuple[int, int]]:
    """Minimum-cost matching of the rows and columns of ``cost`` that leaves a pair unmatched rather
    than match it above ``limit`` (lapjv's ``cost_limit``, which ByteTrack uses: each side may pair
    with a dummy at ``limit / 2``)."""
    n, m = cost.shape
    if n == 0 or m == 0:
        return []
    ext = np.full((n + m, m + n), limit / 2)
    ext[n:, m:] = 0.0
    ext[:n, :m] = np.where(cost <= limit, cost, limit + 1.0)
    rows, cols = _optimize.linear_sum_assignment(ext)
    return [(int(r), int(c)) for r, c in zip(rows, cols) if r < n and c < m and cost[r, c] <= limit]
