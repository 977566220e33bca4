"""The evidence stage's parts without the daemon: a snapshot drawn and encoded (decoded back with Pillow),
the media store's files, budget and age limit, the evidence thread's bounded queue."""

from __future__ import annotations

import io
import threading
import time

import numpy as np
import pytest
from PIL import Image

from k2edge.streams.evidence import EvidenceWorker, MediaStore, render_snapshot
from k2edge.streams.evidence.snapshot import BOX_COLOUR


def _magenta(img: np.ndarray) -> np.ndarray:
    img = img.astype(np.int32)
    return (img[..., 0] - img[..., 1] > 60) & (img[..., 2] - img[..., 1] > 60)


def test_a_snapshot_shows_the_box_where_the_event_says_and_leaves_the_frame_alone():
    frame = np.full((240, 320, 3), 220, np.uint8)
    before = frame.copy()
    event = {"event": "line_cross", "track_id": 3, "label": "7", "line": "door", "box": [100.0, 60.0, 140.0, 120.0]}
    snap = render_snapshot(frame, event, zones=[("dock", [(0, 0), (50, 0), (50, 50)])], lines=[("door", (200, 0), (200, 240))])
    assert np.array_equal(frame, before)
    img = np.asarray(Image.open(io.BytesIO(snap.jpeg)).convert("RGB"))
    assert (snap.width, snap.height) == (320, 240) and img.shape == (240, 320, 3) and snap.jpeg[:2] == b"\xff\xd8"
    m = _magenta(img)
    assert BOX_COLOUR == (255, 0, 255)
    assert m[60:62, 103:138].mean() > 0.9 and m[118:120, 103:138].mean() > 0.9  # top and bottom sides
    assert m[63:117, 100:102].mean() > 0.9 and m[63:117, 138:140].mean() > 0.9  # left and right
    assert m[70:110, 110:130].mean() == 0 and m[150:, :].mean() == 0  # inside the box and elsewhere: the frame
    assert not _magenta(img[:, 195:205]).any()  # the line is drawn, in another colour
    assert (np.abs(img[100:140, 198:202].astype(int) - 220).max() > 60)


def test_a_snapshot_refuses_what_is_not_an_rgb_frame():
    with pytest.raises(ValueError, match="uint8 frame"):
        render_snapshot(np.zeros((10, 10), np.uint8), {"box": [0, 0, 1, 1]})


def test_the_media_store_writes_whole_files_named_by_event_id(tmp_path):
    store = MediaStore(tmp_path / "media")
    assert not (tmp_path / "media").exists()  # made at the first write
    eid = "ab" * 16
    path = store.write(eid, "jpg", b"\xff\xd8data")
    assert path == tmp_path / "media" / f"{eid}.jpg" and store.read(eid, "jpg") == b"\xff\xd8data"
    assert [p.name for p in (tmp_path / "media").iterdir()] == [f"{eid}.jpg"]  # no temporary left
    assert store.read("cd" * 16, "jpg") is None
    for bad in ("../../etc/passwd", "AB" * 16, "ab" * 15):
        with pytest.raises(ValueError, match="not an event id"):
            store.path_for(bad, "jpg")
        assert store.read(bad, "jpg") is None


def test_the_evidence_queue_refuses_at_once_when_full_and_finishes_its_jobs_when_stopped():
    release, started, done = threading.Event(), threading.Event(), []

    def handle(job):
        started.set()
        release.wait(30)
        done.append(job)

    worker = EvidenceWorker(handle, size=2)
    worker.start()
    assert worker.submit(1)
    assert started.wait(30)  # the first job is taken (and blocks): now the queue holds 2
    assert worker.submit(2) and worker.submit(3)
    assert not worker.submit(4)  # full: refused without waiting
    release.set()
    assert worker.stop(30) and done == [1, 2, 3]
    assert not worker.submit(5)


def test_the_media_budget_removes_the_oldest_first_and_counts_what_went(tmp_path):
    """30 media of 1,000 bytes into a 10,000-byte budget: the newest 10 stay, the 20 oldest went (budget)."""
    store = MediaStore(tmp_path / "media", max_bytes=10_000)
    ids = [f"{i:032x}" for i in range(30)]
    for eid in ids:
        store.write(eid, "jpg", bytes(1000))
        assert store.status()["bytes"] <= 10_000
    kept = sorted(p.stem for p in (tmp_path / "media").iterdir())
    assert kept == ids[20:]
    st = store.status()
    assert st["files"] == 10 and st["bytes"] == 10_000 and st["removed"] == {"budget": 20, "age": 0}
    with pytest.raises(ValueError, match="larger than the whole media budget"):
        store.write("f" * 32, "jpg", bytes(10_001))
    st = store.status()  # refused, and said so: the budget is too small for this medium
    assert st["failed"] == 1 and st["degraded"] == ("a 10001-byte medium is larger than the whole media budget "
                                                    "([storage] max_bytes 10000)"), st
    # a new store over the same directory counts what is there (an earlier run's media)
    again = MediaStore(tmp_path / "media", max_bytes=5_000)
    again.write("e" * 32, "jpg", bytes(1000))
    assert sorted(p.stem for p in (tmp_path / "media").iterdir()) == sorted(ids[26:] + ["e" * 32])


def test_media_past_the_age_limit_go(tmp_path):
    store = MediaStore(tmp_path / "media", max_age_s=3600)
    store.write("a" * 32, "jpg", b"x")
    assert store.purge() == 0 and store.read("a" * 32, "jpg") == b"x"
    assert store.purge(now=time.time() + 3601) == 1 and store.read("a" * 32, "jpg") is None
    assert store.status()["removed"] == {"budget": 0, "age": 1}


def test_a_media_write_that_fails_says_so_until_one_succeeds(tmp_path):
    (tmp_path / "media").write_text("a file where the directory should be")
    store = MediaStore(tmp_path / "media")
    with pytest.raises(OSError):
        store.write("a" * 32, "jpg", b"x")
    st = store.status()
    assert st["failed"] == 1 and st["degraded"].startswith(f"cannot write media to {tmp_path / 'media'}")
    (tmp_path / "media").unlink()
    store.write("a" * 32, "jpg", b"x")
    assert store.status()["degraded"] is None


def _demux(path):
    """The file's packets as (packet, its time in s), with the open container and stream."""
    av = pytest.importorskip("av")
    container = av.open(str(path))
    stream = container.streams.video[0]
    return av, container, stream


def test_a_clip_is_remuxed_from_the_ring_starting_at_a_keyframe_before_pre_s_and_covering_the_event(tmp_path):
    """A keyframe each second (15 fps): an event at 3.0 s with pre_s 1.5 and post_s 1.0 gives a clip from the
    keyframe at 1.0 s to 4.0 s: it decodes with PyAV, starts at a keyframe, holds the source's packets byte for
    byte (no re-encode); the ring keeps about pre_s plus a keyframe interval, and says so."""
    from stream_videos import MovingDigit, make_video

    from k2edge.streams.evidence.clips import LAG_S, PacketRing

    make_video(tmp_path / "v.mp4", frames=90, fps=15, gop=15, objects=[MovingDigit("3", (60, 60), (2, 0))])
    av, container, stream = _demux(tmp_path / "v.mp4")
    tb = float(stream.time_base)
    ring, done, source = PacketRing(tmp_path / "spool", pre_s=1.5, post_s=1.0), [], []
    ring.open(av, stream)
    spans = []
    for packet in container.demux(stream):
        if packet.size == 0:
            continue
        source.append((bytes(packet), packet.pts * tb, bool(packet.is_keyframe)))
        ring.add(packet)
        spans.append(ring.status()["ring_s"])
        if len(source) == 46:  # about the frame at 3.0 s has been demuxed: the event
            ring.request("e" * 32, 3.0, done.append)
    ring.close_capture()
    container.close()
    (info,) = done
    assert info.path == tmp_path / "spool" / f"{'e' * 32}.mp4" and info.size == info.path.stat().st_size > 0
    assert not info.cut_short and info.reason is None and info.start_s == pytest.approx(1.0)
    data = info.path.read_bytes()
    assert info.end_s >= 4.0 - 1e-6 and info.event_s == 3.0
    with av.open(io.BytesIO(data)) as clip:
        packets = [p for p in clip.demux(video=0) if p.size]
        assert packets[0].is_keyframe
        clip_bytes = [bytes(p) for p in packets]
    with av.open(io.BytesIO(data)) as clip:
        times = sorted(float(f.pts * f.time_base) for f in clip.decode(video=0))
    first = next(i for i, (_, t, key) in enumerate(source) if key and abs(t - 1.0) < 1e-6)
    assert clip_bytes == [data for data, _, _ in source[first:first + len(clip_bytes)]]  # remuxed, not re-encoded
    covered = {round(info.start_s + t - times[0], 3) for t in times}  # the clip's frames on the source's timeline
    assert {round(k / 15, 3) for k in range(15, 61)} <= covered  # 1.0 s .. 4.0 s: the event's frame (3.0 s) inside
    st = ring.status()
    assert st["cut"] == 1 and st["cut_failed"] == 0 and st["ring_bytes"] > 0 and st["max_bytes"] == 32 * 1024 * 1024
    assert max(spans) <= 1.5 + LAG_S + 1.0 + 1e-6  # pre_s, the lag allowed, one keyframe interval at most


def test_a_clip_cut_short_by_the_source_ending_says_so(tmp_path):
    from stream_videos import MovingDigit, make_video

    from k2edge.streams.evidence.clips import PacketRing

    make_video(tmp_path / "v.mp4", frames=30, fps=15, gop=15, objects=[MovingDigit("3", (60, 60), (2, 0))])
    av, container, stream = _demux(tmp_path / "v.mp4")
    ring, done = PacketRing(tmp_path / "spool", pre_s=0.5, post_s=5.0), []
    ring.open(av, stream)
    for i, packet in enumerate(p for p in container.demux(stream) if p.size):
        ring.add(packet)
        if i == 20:
            ring.request("e" * 32, 20 / 15, done.append)
    ring.close_capture()
    container.close()
    (info,) = done
    assert info.cut_short and info.path.stat().st_size and info.start_s == 0.0 and info.end_s < 20 / 15 + 5.0  # keyframe 0 s: at or before 0.83 s


def test_an_empty_ring_reports_nothing_held():
    from k2edge.streams.evidence.clips import PacketRing

    assert PacketRing("/nonexistent").status() == {"ring_bytes": 0, "ring_packets": 0, "ring_s": 0.0, "writing": 0, "waiting": 0,
                                     "cut": 0, "cut_failed": 0, "max_bytes": 32 * 1024 * 1024}


def test_a_clip_cut_in_the_spool_is_moved_into_the_store_within_its_budget(tmp_path):
    store = MediaStore(tmp_path / "media", max_bytes=3000)
    store.write("a" * 32, "jpg", bytes(2000))
    spool = tmp_path / "media" / "cutting"
    spool.mkdir(parents=True)
    (spool / "clip.mp4").write_bytes(bytes(1500))
    path = store.adopt("b" * 32, "mp4", spool / "clip.mp4")
    assert path.read_bytes() == bytes(1500) and not (spool / "clip.mp4").exists()
    assert store.read("a" * 32, "jpg") is None and store.status()["removed"]["budget"] == 1  # the older one made room
    (spool / "big.mp4").write_bytes(bytes(3001))
    with pytest.raises(ValueError, match="larger than the whole media budget"):
        store.adopt("c" * 32, "mp4", spool / "big.mp4")
    assert not (spool / "big.mp4").exists()
    assert store.status()["failed"] == 1 and "3001-byte medium" in store.status()["degraded"]
