"""The stream peer: the loop a user writes instead of a k2edge ``[[streams]]`` entry (bench/bench_streams.py).

One process per stream: PyAV decodes the video and the loop sleeps until each frame's time (the
file played at its own rate, as the daemon's ``file://`` camera stand-in plays it), then runs the
model on that frame: the card's letterbox (k2edge's ``Preprocess``, so both sides stage the same
pixels), an ONNX Runtime session with default options, the YOLOv8 decode with per-class NMS
(k2edge's ``decode``, so both sides decode alike), and one JSON message per frame published with
paho-mqtt at QoS 0. The file loops; frame times keep counting across loops.

``captured_at`` is the Unix time the frame was due: when a camera would have captured it. A loop
that falls behind decodes late frames at once (no sleep) and processes them in order, so the
frame's age grows with the backlog, as it does behind a real camera's socket.

    python bench/peer_stream.py HOST PORT TOPIC VIDEO MODEL.onnx CARD.toml STREAM [INTRA_OP_THREADS]

``INTRA_OP_THREADS`` (bench_streams.py ``--peer-threads``): a tuned peer; without it ONNX Runtime's
defaults (a thread per core, spinning while it waits for work).
"""

import json
import socket
import sys
import time
from pathlib import Path

import av
import onnxruntime as ort
import paho.mqtt.client as mqtt

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from k2edge.config.card import load_card  # noqa: E402
from k2edge.tasks import Preprocess, decode  # noqa: E402

host, port, topic, video, model, card_file, stream = sys.argv[1:8]
card = load_card(card_file)
pre = Preprocess.from_card(card)
labels = Path(card.labels).read_text().split() if card.labels else []
options = ort.SessionOptions()
if len(sys.argv) > 8:
    options.intra_op_num_threads = int(sys.argv[8])
session = ort.InferenceSession(model, options)  # default options unless told, as a user writes it
input_name = session.get_inputs()[0].name

client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, protocol=mqtt.MQTTv5)
client.on_socket_open = lambda c, u, sock: sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
client.connect(host, int(port))
client.loop_start()

index, start, offset = 0, None, 0.0
while True:
    with av.open(video) as container:
        vs = container.streams.video[0]
        vs.thread_type = "AUTO"
        base, last = float(vs.time_base), 0.0
        period = 1.0 / float(vs.average_rate)
        for frame in container.decode(vs):
            pts = frame.pts * base
            if start is None:
                start = time.time() - pts
            image = frame.to_ndarray(format="rgb24")  # decoded before its time, as k2edge's reader does
            due = start + offset + pts
            wait = due - time.time()
            if wait > 0:
                time.sleep(wait)
            x, geometry = pre.stage_mapped(image)
            out = session.run(None, {input_name: x[None]})[0]
            dets = decode(out, card.detection, [geometry])[0]
            body = {"stream": stream, "frame": index, "pts": round(pts, 6), "captured_at": due,
                    "detections": dets.to_list(labels)}
            client.publish(topic, json.dumps(body), qos=0)
            index, last = index + 1, pts
        offset += last + period
