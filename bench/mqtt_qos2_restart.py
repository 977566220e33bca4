"""Why k2edge answers at QoS 1: QoS 2 publishes across a broker restart, measured.

A persistent paho client publishes 300 messages (3 ms apart) at QoS 1 and at QoS 2 to a persistent
subscriber through a mosquitto with ``persistence true``; the broker restarts (down 0.5 s) 0.2 s
in. Prints, per QoS, how many arrived, how many twice, how many never — though the publisher saw
every one acknowledged. Here (mosquitto 2.0.11, paho-mqtt 2.2): QoS 1 delivered all 300, a few of
them twice; QoS 2 lost about a third, every other message after the restart.

    python bench/mqtt_qos2_restart.py
"""

from __future__ import annotations

import sys
import tempfile
import threading
import time
from pathlib import Path

import paho.mqtt.client as mqtt
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "support"))
from mqtt_support import Broker  # noqa: E402  (the tests' real mosquitto)


def run(qos: int, n: int = 300) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        broker = Broker(Path(tmp) / "broker").start()
        got: list[int] = []
        acked: set[int] = set()

        def client(cid: str, subscribe: str | None = None) -> mqtt.Client:
            c = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=cid, protocol=mqtt.MQTTv5)
            props = Properties(PacketTypes.CONNECT)
            props.SessionExpiryInterval = 600
            if subscribe:
                c.on_connect = lambda cl, u, f, rc, p: cl.subscribe(subscribe, qos=1)
                c.on_message = lambda cl, u, m: got.append(int(m.payload))
            c.reconnect_delay_set(0.1, 0.5)
            c.connect("127.0.0.1", broker.port, clean_start=False, properties=props)
            c.loop_start()
            return c

        sub = client(f"sub-{qos}", "qos/test")
        time.sleep(0.3)
        pub = client(f"pub-{qos}")
        pub.on_publish = lambda cl, u, mid, rc, p: acked.add(mid)

        def send():
            for i in range(n):
                pub.publish("qos/test", str(i), qos=qos)
                time.sleep(0.003)

        sender = threading.Thread(target=send)
        sender.start()
        time.sleep(0.2)
        broker.restart(down_s=0.5)
        sender.join()
        time.sleep(5.0)
        for c in (pub, sub):
            c.disconnect()
            c.loop_stop()
        broker.stop()
    return {"acknowledged": len(acked), "arrived": len(set(got)), "twice": len(got) - len(set(got)),
            "lost": n - len(set(got))}


def main() -> int:
    print("mosquitto persistence true, restart (down 0.5 s) while 300 messages are published")
    for qos in (1, 2):
        r = run(qos)
        print(f"QoS {qos}: acknowledged {r['acknowledged']}, arrived {r['arrived']}, twice {r['twice']}, lost {r['lost']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
