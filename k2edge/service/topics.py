"""Topic names of the MQTT contract (pure)."""

from __future__ import annotations

POOL_PREFIX = "k2edge/pool"
GROUP_PREFIX = "k2edge/group"


def request_filter(prefix: str) -> str:
    return f"{prefix}/infer/+"


def shared_filter(group: str) -> str:
    return f"$share/{group}/{POOL_PREFIX}/infer/+"


def status_topic(prefix: str) -> str:
    return f"{prefix}/status"


def telemetry_topic(prefix: str) -> str:
    return f"{prefix}/telemetry"


def result_topic(prefix: str, request_id: str) -> str:
    return f"{prefix}/result/{request_id}"


def errors_topic(prefix: str) -> str:
    """Where the answer goes when a request gives neither a Response Topic nor a usable id (an error, mostly: a payload
    whose id cannot be read; also the answer to a well-formed request that gave neither)."""
    return f"{prefix}/errors"


def deploy_topic(prefix: str) -> str:
    return f"{prefix}/models/deploy"


def rollback_topic(prefix: str) -> str:
    return f"{prefix}/models/rollback"


def group_deploy_topic(group: str) -> str:
    """A fleet group's deploys: every member subscribes normally (a shared subscription would reach one)."""
    return f"{GROUP_PREFIX}/{group}/models/deploy"


def group_rollback_topic(group: str) -> str:
    return f"{GROUP_PREFIX}/{group}/models/rollback"


def control_result_topic(prefix: str) -> str:
    """Where a deploy or rollback answer goes when the request gives no Response Topic."""
    return f"{prefix}/models/result"


def audit_topic(prefix: str) -> str:
    return f"{prefix}/audit"


def stream_detections_topic(prefix: str, stream: str) -> str:
    """A stream's detections, one message per processed frame (QoS 0)."""
    return f"{prefix}/streams/{stream}/detections"


def stream_events_topic(prefix: str, stream: str) -> str:
    """A stream's events: zone_enter, zone_leave, line_cross, stream_up, stream_down, stream_ended (QoS 1)."""
    return f"{prefix}/streams/{stream}/events"


def stream_snapshots_topic(prefix: str, stream: str) -> str:
    """A stream's event snapshots: raw JPEG, content type ``image/jpeg``, the ``event_id`` in a user property (QoS 1)."""
    return f"{prefix}/streams/{stream}/snapshots"


def control_kind(topic: str) -> str | None:
    """``deploy`` or ``rollback`` for a model lifecycle topic (a device's or a group's), else None."""
    for kind in ("deploy", "rollback"):
        if topic.endswith(f"/models/{kind}"):
            return kind
    return None


def model_of(topic: str) -> str | None:
    """The model name of a request topic (``.../infer/{model}``), else None."""
    head, sep, model = topic.rpartition("/infer/")
    return model if sep and model and "/" not in model else None


def valid_level(value: str) -> bool:
    """True when ``value`` can be one topic level: non-empty, no wildcards, no separator, no NUL."""
    return (bool(value) and "+" not in value and "#" not in value and "/" not in value and "\x00" not in value
            and len(value.encode("utf-8", "surrogatepass")) <= 256)


def publishable(topic: str) -> bool:
    """True when ``topic`` is a topic name one can publish to: non-empty, no wildcards, no NUL."""
    return bool(topic) and "+" not in topic and "#" not in topic and "\x00" not in topic and len(topic) <= 16383
