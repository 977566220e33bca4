"""The peer: the MQTT inference loop a user writes instead of running k2edge (bench/bench_peer.py).

    python bench/peer_loop.py HOST PORT TOPIC MODEL.onnx LABELS.txt
"""

import base64
import json
import socket
import sys

import numpy as np
import onnxruntime as ort
import paho.mqtt.client as mqtt
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

host, port, topic, model, labels_file = sys.argv[1:6]
session = ort.InferenceSession(model)  # default options, as a user writes it
input_name = session.get_inputs()[0].name
labels = open(labels_file).read().split()


def on_connect(client, userdata, flags, reason_code, properties):
    client.subscribe(topic, qos=1)


def on_message(client, userdata, msg):
    req = json.loads(msg.payload)
    t = req["tensor"]
    x = np.frombuffer(base64.b64decode(t["data"]), dtype=np.float32).reshape(t["shape"])
    logits = session.run(None, {input_name: x[None]})[0][0]
    p = np.exp(logits - logits.max())
    p /= p.sum()
    top = [{"index": int(i), "label": labels[i], "score": float(p[i])} for i in np.argsort(-p)[:5]]
    props = Properties(PacketTypes.PUBLISH)
    props.CorrelationData = msg.properties.CorrelationData
    answer = {"id": req["id"], "status": "ok", "top_k": top}
    client.publish(msg.properties.ResponseTopic, json.dumps(answer), qos=1, properties=props)


client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, protocol=mqtt.MQTTv5)
# The README tells users to set TCP_NODELAY: without it Nagle's algorithm holds every answer for
# the previous packet's delayed ACK (~40 ms) and the comparison with k2edge would mean nothing.
client.on_socket_open = lambda c, u, sock: sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
client.on_connect = on_connect
client.on_message = on_message
client.connect(host, int(port))
client.loop_forever()
