"""Errors of the cloud bridge; all are :class:`k2edge.errors.K2EdgeError`.

Messages never hold the API key: the SDK's exceptions carry the request (and its
``Authorization`` header), so they are summarised, scrubbed, and not chained.
"""

from __future__ import annotations

from ..errors import K2EdgeError

__all__ = [
    "CloudError",
    "CloudConfigError",
    "CloudUnavailable",
    "CloudTimeout",
    "CloudRateLimited",
    "CloudQuotaError",
    "CloudAuthError",
    "CloudRejected",
    "BreakerOpen",
    "OutboxError",
    "CallNotStarted",
]


class CloudError(K2EdgeError):
    """Any failure to get an answer from the K2 server.

    Attributes:
        retryable: a later try may succeed (outage, timeout, rate limit) — deferrable requests wait
            in the outbox; False for a request the server will never accept (bad image, auth, quota).
        status: the HTTP status when there was one.
        attempts: HTTP attempts made.
    """

    retryable = True

    def __init__(self, message: str, *, status: int | None = None, attempts: int = 0) -> None:
        super().__init__(message)
        self.status = status
        self.attempts = attempts


class CloudConfigError(CloudError):
    """The cloud settings or the API key source are wrong (missing key file, unset variable)."""

    retryable = False


class CloudUnavailable(CloudError):
    """The server could not be reached, or answered 5xx after the retries."""


class CloudTimeout(CloudUnavailable):
    """No answer within the request's deadline (or the client timeout)."""


class CloudRateLimited(CloudUnavailable):
    """429 after the retries, or a Retry-After beyond the deadline."""


class CloudQuotaError(CloudError):
    """429 saying the account's quota or billing is exhausted: retrying does not help."""

    retryable = False


class CloudAuthError(CloudError):
    """401/403: the key is wrong or lacks access."""

    retryable = False


class CloudRejected(CloudError):
    """A 4xx other than 401/403/429: the server refuses this request (bad image, unknown model)."""

    retryable = False


class BreakerOpen(CloudUnavailable):
    """The circuit breaker is open: no call was made."""


class OutboxError(K2EdgeError):
    """The outbox database cannot be opened or written."""


class CallNotStarted(K2EdgeError):
    """The daemon began to stop while a request waited for a concurrency slot: no call was made, and the request
    is the caller's to hand back (its outbox row answers it at the next start)."""
