"""The MQTT half of the peers (bench/peer_loop.py, bench/peer_detector.py): what a user writes around
their model with paho-mqtt. The model runs inside ``on_message``; its answer goes to the request's
Response Topic with its Correlation Data, QoS 1."""

import json
import socket

import paho.mqtt.client as mqtt
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties


def serve(host: str, port: int, topic: str, answer) -> None:
    """Subscribe to ``topic`` and answer each request with ``answer(request) -> dict``, forever."""

    def on_connect(client, userdata, flags, reason_code, properties):
        client.subscribe(topic, qos=1)

    def on_message(client, userdata, msg):
        body = answer(json.loads(msg.payload))
        props = Properties(PacketTypes.PUBLISH)
        props.CorrelationData = msg.properties.CorrelationData
        client.publish(msg.properties.ResponseTopic, json.dumps(body), qos=1, properties=props)

    client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, protocol=mqtt.MQTTv5)
    # The README tells users to set TCP_NODELAY: without it Nagle's algorithm holds every answer for
    # the previous packet's delayed ACK (~40 ms) and the comparison with k2edge would mean nothing.
    client.on_socket_open = lambda c, u, sock: sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    client.on_connect = on_connect
    client.on_message = on_message
    client.connect(host, int(port))
    client.loop_forever()
