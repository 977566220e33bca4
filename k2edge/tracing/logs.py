"""Log lines joined to traces: a line logged while a span is current (a request's cloud call, a deploy)
ends with ``[trace_id=… span_id=…]``, the ids a trace viewer searches by."""

from __future__ import annotations

import logging

from .tracer import current_span

__all__ = ["TraceLogFilter", "install", "uninstall"]


class TraceLogFilter(logging.Filter):
    """Adds ``trace_id`` / ``span_id`` to records logged under a current span (and to their message, once,
    so any formatter shows them)."""

    def filter(self, record: logging.LogRecord) -> bool:
        span = current_span()
        if span is not None and not hasattr(record, "trace_id"):
            ctx = span.get_span_context()
            record.trace_id, record.span_id = f"{ctx.trace_id:032x}", f"{ctx.span_id:016x}"
            record.msg = f"{record.msg} [trace_id={record.trace_id} span_id={record.span_id}]"
        return True


_FILTER = TraceLogFilter()


def install(logger: logging.Logger | None = None) -> None:
    """Put the filter on every handler of ``logger`` (the root logger's by default: handler filters see the
    records of every logger that propagates to them)."""
    for h in (logger or logging.getLogger()).handlers:
        if _FILTER not in h.filters:
            h.addFilter(_FILTER)


def uninstall(logger: logging.Logger | None = None) -> None:
    for h in (logger or logging.getLogger()).handlers:
        h.removeFilter(_FILTER)
