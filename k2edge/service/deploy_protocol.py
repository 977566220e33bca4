"""Deploy and rollback messages of the MQTT contract (pure: no network, no store, no engine).

A deploy (``{prefix}/models/deploy`` or ``k2edge/group/{group}/models/deploy``) carries either the
bundle itself, with content type ``application/x-tar`` or ``application/gzip`` (``allow_downgrade``
and the bundle's ``file`` name as user properties), or ``application/json``::

    {"url": "https://fleet.example/digits-1.3.0.k2b", "sha256": "<64 hex digits of the file>",
     "allow_downgrade": false}

A rollback (``{prefix}/models/rollback`` or the group's) is ``{"model": NAME}``. Every answer is::

    {"status": "deployed" | "rolled_back" | "refused" | "failed", "model", "version", "reason",
     "check", "device", "model_version", "previous", "running"}

``check`` is the store's or verification's status (``hash_mismatch``, ``not_newer``, ...), or
``int8_check`` when the new engines' INT8 accuracy check failed; a deploy answer carries the new engines' check
as ``int8_check`` (its status -- ``passed``, ``fallback``, ``inconclusive`` or ``failed`` --, measures with their
sample sizes and bounds, tolerance and the layers that fell back; null without INT8 layers);
``model_version`` is the version of ``model`` that runs once the answer is sent (the old one after
a refusal or failure), ``running`` every served model's (a bundle refused before its manifest could
be trusted names no model). A message without a Response Topic is answered on
``{prefix}/models/result``.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from typing import Annotated

import msgspec

DEPLOYED, ROLLED_BACK, REFUSED, FAILED = "deployed", "rolled_back", "refused", "failed"
ANSWER_STATUSES = (DEPLOYED, ROLLED_BACK, REFUSED, FAILED)
TAR_TYPES = ("application/x-tar", "application/gzip", "application/x-gzip")
_HEX64 = re.compile(r"^[0-9a-f]{64}\Z")
_NAME = re.compile(r"^[A-Za-z0-9_.:-]{1,128}\Z")


class ControlError(Exception):
    """A deploy or rollback message that cannot be carried out as sent (answered ``refused``)."""


@dataclass(frozen=True)
class DeployRequest:
    """A parsed deploy: the bundle's bytes, or where to fetch them and their sha256."""

    bundle: bytes | None = None
    url: str | None = None
    sha256: str | None = None
    allow_downgrade: bool = False
    file: str | None = None  # the bundle's file name, as the sender gave it (user property ``file``)

    @property
    def source(self) -> str:
        """Where the bundle came from, for a log line: its URL, its file name, or its size."""
        return self.url or self.file or f"{len(self.bundle or b'')} bytes"


@dataclass(frozen=True)
class RollbackRequest:
    model: str


class _UrlBody(msgspec.Struct, forbid_unknown_fields=True):
    url: Annotated[str, msgspec.Meta(min_length=9, max_length=4096)]
    sha256: str
    allow_downgrade: bool = False


class _RollbackBody(msgspec.Struct, forbid_unknown_fields=True):
    model: str


def _flag(user_properties: dict[str, str], key: str) -> bool:
    value = user_properties.get(key, "false").strip().lower()
    if value not in ("true", "false"):
        raise ControlError(f"user property {key} must be true or false, got {value[:40]!r}")
    return value == "true"


def _kind(payload: bytes, content_type: str) -> str:
    ctype = content_type.split(";")[0].strip().lower()
    if ctype in TAR_TYPES:
        return "bundle"
    if ctype in ("application/json", "text/json"):
        return "json"
    if ctype:
        raise ControlError(f"content type {ctype!r} is not a bundle: send application/x-tar, application/gzip, "
                           'or application/json {"url", "sha256"}')
    # no content type: tell by the bytes (gzip magic, tar's ustar magic, a JSON object)
    if payload[:2] == b"\x1f\x8b" or payload[257:262] == b"ustar":
        return "bundle"
    if payload.lstrip()[:1] == b"{":
        return "json"
    raise ControlError("the payload is neither a bundle (tar, gzip) nor JSON; set the content type")


def parse_deploy(payload: bytes, content_type: str | None, user_properties: dict[str, str]) -> DeployRequest:
    """Parse a deploy message.

    Raises:
        ControlError: what is wrong, in one sentence.
    """
    if not payload:
        raise ControlError("the deploy message is empty")
    if _kind(payload, content_type or "") == "bundle":
        name = user_properties.get("file")
        return DeployRequest(bundle=bytes(payload), allow_downgrade=_flag(user_properties, "allow_downgrade"),
                             file=name[:200] if name and name.isprintable() else None)
    try:
        body = msgspec.json.decode(payload, type=_UrlBody)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ControlError(f'a JSON deploy is {{"url": "https://...", "sha256": "<hex>", "allow_downgrade": false}}: {exc}') from None
    if not body.url.startswith("https://"):
        raise ControlError(f"url must be https:// (bundles are fetched over TLS), got {body.url[:80]!r}")
    if not _HEX64.match(body.sha256.lower()):
        raise ControlError(f"sha256 must be 64 hex digits (of the bundle file), got {body.sha256[:80]!r}")
    return DeployRequest(url=body.url, sha256=body.sha256.lower(), allow_downgrade=body.allow_downgrade)


def parse_rollback(payload: bytes) -> RollbackRequest:
    """Parse a rollback message (``{"model": NAME}``).

    Raises:
        ControlError: what is wrong, in one sentence.
    """
    try:
        body = msgspec.json.decode(payload, type=_RollbackBody)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ControlError(f'a rollback is {{"model": NAME}}: {exc}') from None
    if not _NAME.match(body.model):
        raise ControlError(f"model {body.model[:80]!r} is not a model name")
    return RollbackRequest(body.model)


def message_digest(kind: str, payload: bytes, response_topic: str | None, correlation: bytes | None) -> str:
    """What identifies one control message across redeliveries (the broker redelivers the same
    payload and properties)."""
    h = hashlib.sha256()
    for part in (kind.encode(), (response_topic or "").encode(), correlation or b"", payload):
        h.update(len(part).to_bytes(8, "little") + part)
    return h.hexdigest()[:32]


def answer_body(status: str, device: str, model: str | None = None, version: str | None = None, reason: str = "",
                check: str | None = None, model_version: str | None = None, previous: str | None = None,
                running: dict[str, str | None] | None = None) -> dict:
    """A deploy or rollback answer (see the module docstring)."""
    if status not in ANSWER_STATUSES:
        raise ValueError(f"answer status must be one of {ANSWER_STATUSES}, got {status!r}")
    return {"status": status, "model": model, "version": version, "reason": reason, "check": check, "device": device,
            "model_version": model_version, "previous": previous, "running": running or {}}
