"""The RTSP test infrastructure itself: the test camera, its crash and return, and the faulty proxy.

The measurements a stream reader needs (open time by probing options, what a dead server or a wedged
connection looks like to PyAV) are printed as ``rtsp fact:`` lines; run with ``-s`` to see them.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from rtsp_support import RtspServer, TcpProxy, free_port, rtsp_available, write_h264

av = pytest.importorskip("av")
pytestmark = pytest.mark.skipif(not rtsp_available()[0], reason=rtsp_available()[1])

FPS, FRAMES = 15, 30  # a 2 s clip: the loop shows within a short test
TCP = {"rtsp_transport": "tcp"}
QUICK = {**TCP, "analyzeduration": "100000", "probesize": "32768"}


def fact(text: str) -> None:
    print(f"rtsp fact: {text}")


@pytest.fixture(scope="module")
def clip(tmp_path_factory):
    """A white bar moving right 8 px a frame over black, 160x120."""
    def frame(i):
        img = np.zeros((120, 160, 3), np.uint8)
        img[:, 8 * i % 160:8 * i % 160 + 8] = 255
        return img
    return write_h264(tmp_path_factory.mktemp("rtsp") / "clip.mp4", (frame(i) for i in range(FRAMES)), fps=FPS)


def bar_x(frame) -> int:
    return int(frame.to_ndarray(format="gray")[60].argmax())


def open_timed(url: str, options: dict, timeout=(5, 2)):
    t0 = time.monotonic()
    container = av.open(url, options=options, timeout=timeout)
    return container, time.monotonic() - t0


def read_until_end(frames, limit_s: float) -> tuple[str, float]:
    """Read until the iteration stops; how it stopped ('ended', an exception's name) and after how long."""
    t0 = time.monotonic()
    try:
        for _ in frames:
            if time.monotonic() - t0 > limit_s:
                return "still reading", time.monotonic() - t0
    except Exception as exc:  # noqa: BLE001 - which exception PyAV raises is the question
        return f"{type(exc).__name__}: {exc}", time.monotonic() - t0
    return "ended", time.monotonic() - t0


def test_camera_serves_the_clip_from_its_first_frame(clip):
    """Direct and through the proxy, a client decodes the clip from frame 0, a keyframe."""
    with RtspServer(clip) as cam, TcpProxy("127.0.0.1", cam.port) as proxy:
        assert cam.url == f"rtsp://127.0.0.1:{cam.port}/cam"
        for url, options in ((cam.url, TCP), (cam.url, QUICK), (proxy.url("cam"), QUICK)):
            container, open_s = open_timed(url, options)
            with container:
                first = next(container.decode(video=0))
                assert first.key_frame and (first.width, first.height) == (160, 120)
                assert bar_x(first) < 8
            fact(f"av.open {'via proxy' if url != cam.url else 'direct'} with {options}: {open_s:.2f} s")


def test_camera_loops_in_real_time(clip):
    """Past the clip's end the stream goes on, at about the clip's frame rate."""
    with RtspServer(clip) as cam, av.open(cam.url, options=QUICK, timeout=(5, 2)) as container:
        frames = container.decode(video=0)
        xs = [bar_x(next(frames)) for _ in range(FRAMES + 5)]
        t0 = time.monotonic()
        for _ in range(FPS):
            next(frames)
        second = time.monotonic() - t0
    assert xs[FRAMES] < 8 and xs[FRAMES + 4] > xs[FRAMES]  # frame 0 again, moving on
    fact(f"{FPS} frames ({FPS} fps clip) took {second:.2f} s after {FRAMES + 5} frames")
    assert second > 0.5


@pytest.mark.parametrize("kill", [False, True], ids=["sigterm", "sigkill"])
def test_a_stopped_camera_ends_the_read(clip, kill):
    """A camera gone away ends the client's read, quietly or with an error, within the read timeout."""
    with RtspServer(clip) as cam, av.open(cam.url, options=QUICK, timeout=(5, 1)) as container:
        frames = container.decode(video=0)
        next(frames)
        cam.stop(kill=kill)
        how, after = read_until_end(frames, limit_s=10)
    fact(f"server {'SIGKILL' if kill else 'SIGTERM'}: the read {how} after {after:.2f} s")
    assert how != "still reading"


def test_a_restarted_camera_opens_again_on_its_port(clip):
    """Down, opening fails at once; back on the same port, a client opens it again."""
    with RtspServer(clip) as cam:
        port = cam.port
        cam.stop(kill=True)
        t0 = time.monotonic()
        with pytest.raises(av.error.FFmpegError) as down:
            av.open(cam.url, options=QUICK, timeout=(5, 1))
        fact(f"open with the server down: {type(down.value).__name__} after {time.monotonic() - t0:.2f} s")
        t0 = time.monotonic()
        cam.start()
        started = time.monotonic() - t0
        with av.open(cam.url, options=QUICK, timeout=(5, 2)) as container:
            assert next(container.decode(video=0)).key_frame
        fact(f"restart on the same port: server READY in {started:.2f} s, "
             f"first frame {time.monotonic() - t0:.2f} s after the restart began")
        assert cam.port == port


def test_a_stalled_proxy_makes_the_read_time_out(clip):
    """Connections open but silent: the read waits, and PyAV's read timeout ends the wait."""
    with RtspServer(clip) as cam, TcpProxy("127.0.0.1", cam.port) as proxy:
        container = av.open(proxy.url(), options=QUICK, timeout=(5, 1))
        frames = container.decode(video=0)
        next(frames)
        proxy.stall()
        outcome = []
        reader = threading.Thread(target=lambda: outcome.append(read_until_end(frames, limit_s=15)), daemon=True)
        reader.start()
        reader.join(timeout=30)  # bounds the test even if PyAV's timeout never fires
        proxy.resume()
        assert outcome, "the read on a stalled connection did not return within 30 s"
        how, after = outcome[0]
        fact(f"stalled connection, timeout=(5, 1): the read {how} after {after:.2f} s")
        assert how != "still reading" and proxy.connections == 1
        container.close()


def test_proxy_cut_and_refuse(clip):
    """cut() ends the open connection but not new ones; refuse() turns new ones away until lifted."""
    with RtspServer(clip) as cam, TcpProxy("127.0.0.1", cam.port) as proxy:
        with av.open(proxy.url(), options=QUICK, timeout=(5, 1)) as container:
            frames = container.decode(video=0)
            next(frames)
            proxy.cut()
            how, after = read_until_end(frames, limit_s=10)
        fact(f"proxy cut: the read {how} after {after:.2f} s")
        assert how != "still reading"
        proxy.refuse(True)
        with pytest.raises(av.error.FFmpegError):
            av.open(proxy.url(), options=QUICK, timeout=(2, 1))
        proxy.refuse(False)
        with av.open(proxy.url(), options=QUICK, timeout=(5, 2)) as container:
            assert next(container.decode(video=0)).key_frame


def test_rtsp_server_reports_a_bad_file(tmp_path):
    """A file with no H.264 track: start() fails with the server's own message."""
    bad = tmp_path / "bad.mp4"
    bad.write_bytes(b"not a video")
    with pytest.raises(RuntimeError, match="cannot read"):
        RtspServer(bad, port=free_port()).start()
