"""Schema of ``[tracing]``: OpenTelemetry traces exported over OTLP/HTTP; present means on.

The standard ``OTEL_EXPORTER_OTLP_*`` and ``OTEL_TRACES_SAMPLER*`` variables override the table
(:func:`k2edge.tracing.otlp.resolve` applies them), so a fleet can point every device at a new
collector from a systemd drop-in without touching the TOML.
"""

from __future__ import annotations

from urllib.parse import urlsplit

from pydantic import Field, field_validator

from .tables import Strict as _Strict

__all__ = ["TracingSettings"]


class TracingSettings(_Strict):
    """Where spans go and how many are kept."""

    endpoint: str = Field("http://127.0.0.1:4318", description="the collector's OTLP/HTTP base URL; spans go to "
                          "<endpoint>/v1/traces")
    sample_ratio: float = Field(1.0, ge=0.0, le=1.0, description="share of the requests without a sampled traceparent "
                                "that start a trace; a request whose traceparent is sampled is always traced")
    frame_sample_rate: float = Field(0.0, ge=0.0, le=1.0, description="share of processed stream frames that get a "
                                     "span (0: none; each event still gets its own)")
    queue_size: int = Field(2048, ge=16, le=1_000_000, description="spans held for export; beyond it new spans are "
                            "dropped and counted (k2edge_trace_spans_dropped_total), never waited for")
    batch_size: int = Field(512, ge=1, le=100_000, description="most spans in one export request")
    export_interval_ms: float = Field(500.0, gt=0, le=60_000, description="how long spans wait for companions before "
                                      "they are exported")
    export_timeout_s: float = Field(2.0, gt=0, le=60, description="one export request's timeout (a collector that is "
                                    "down costs the exporter thread this, never a request)")
    service_name: str = Field("k2edge", min_length=1, description="the resource's service.name")

    @field_validator("endpoint")
    @classmethod
    def _endpoint(cls, v: str) -> str:
        parts = urlsplit(v)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"must be an http:// or https:// URL such as \"http://HOST:4318\", got {v!r}")
        return v.rstrip("/")
