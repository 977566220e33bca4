"""Signed model bundles: manifest, Ed25519 signatures, safe extraction, installed versions, audit records.

    from k2edge.bundle import Limits, ModelStore, load_trust, verify_bundle

    trust = load_trust(["/etc/k2edge/trust/ops.pub"])
    print(verify_bundle("digits-1.2.0.k2b", trust).line)     # verified digits 1.2.0 | STATUS: detail
    store = ModelStore(state_dir, trust, Limits(max_bundle_bytes=64 << 20))
    result = store.install(payload)                          # verify + unpack; nothing else changes
    if result.ok:
        ...build engines from result.paths["model"], swap...
        store.activate(result.name, result.version)

Refusals are results, never exceptions (see :mod:`k2edge.bundle.result` for the statuses).
"""

from .archive import Limits
from .audit import AuditLog, audit_record
from .create import create_bundle, sign_bundle
from .keys import TrustStore, generate_keys, key_id, load_private_key, load_public_key, load_trust
from .manifest import Manifest
from .result import CHECK_ORDER, FAILED, STORE_REFUSALS, SUCCESS, VERIFIED, BundleError, BundleResult
from .semver import Version, parse_version
from .store import DamagedState, ModelStore
from .verify import verify_bundle, verify_directory

__all__ = [
    "AuditLog",
    "BundleError",
    "BundleResult",
    "CHECK_ORDER",
    "DamagedState",
    "FAILED",
    "Limits",
    "Manifest",
    "ModelStore",
    "STORE_REFUSALS",
    "SUCCESS",
    "TrustStore",
    "VERIFIED",
    "Version",
    "audit_record",
    "create_bundle",
    "generate_keys",
    "key_id",
    "load_private_key",
    "load_public_key",
    "load_trust",
    "parse_version",
    "sign_bundle",
    "verify_bundle",
    "verify_directory",
]
