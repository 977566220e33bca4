"""The peer: the MQTT inference loop a user writes instead of running k2edge (bench/bench_peer.py):
the model inside paho's ``on_message`` (bench/peer_mqtt.py).

    python bench/peer_loop.py HOST PORT TOPIC MODEL.onnx LABELS.txt
"""

import base64
import sys

import numpy as np
import onnxruntime as ort

from peer_mqtt import serve

host, port, topic, model, labels_file = sys.argv[1:6]
session = ort.InferenceSession(model)  # default options, as a user writes it
input_name = session.get_inputs()[0].name
labels = open(labels_file).read().split()


def answer(req):
    t = req["tensor"]
    x = np.frombuffer(base64.b64decode(t["data"]), dtype=np.float32).reshape(t["shape"])
    logits = session.run(None, {input_name: x[None]})[0][0]
    p = np.exp(logits - logits.max())
    p /= p.sum()
    top = [{"index": int(i), "label": labels[i], "score": float(p[i])} for i in np.argsort(-p)[:5]]
    return {"id": req["id"], "status": "ok", "top_k": top}


serve(host, port, topic, answer)
