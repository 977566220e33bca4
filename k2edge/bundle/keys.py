"""Ed25519 signing keys, trusted public keys, and the signature file (``manifest.sig``).

A key's id is the sha256 (hex) of its 32 raw public-key bytes; a signature file is JSON
``{"key_id": ..., "signature": base64}`` over the exact bytes of ``manifest.json``. Private keys are
PKCS#8 PEM (mode 0600), public keys SubjectPublicKeyInfo PEM, as ``openssl genpkey -algorithm
ed25519`` writes them, so either tool can make them.
"""

from __future__ import annotations

import base64
import binascii
import errno
import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from ..errors import first_line
from ..readfile import MAX_SECRET_BYTES, read_small
from .result import BundleError

__all__ = [
    "PRIVATE_KEY_NAME",
    "PUBLIC_KEY_NAME",
    "Signature",
    "TrustStore",
    "generate_keys",
    "key_id",
    "load_private_key",
    "load_public_key",
    "load_trust",
    "sign_manifest",
]

PRIVATE_KEY_NAME = "k2edge.key"
PUBLIC_KEY_NAME = "k2edge.pub"


def key_id(public_key: Ed25519PublicKey) -> str:
    """sha256 (hex) of the key's raw 32 bytes."""
    raw = public_key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return hashlib.sha256(raw).hexdigest()


def generate_keys(out_dir: str | os.PathLike) -> tuple[Path, Path, str]:
    """Write ``OUT/k2edge.key`` (PKCS#8 PEM, mode 0600) and ``OUT/k2edge.pub`` (SubjectPublicKeyInfo PEM).

    Returns:
        (private key path, public key path, key id).

    Raises:
        BundleError: a key file exists already (never overwritten) or the directory is not writable.
    """
    out = Path(out_dir)
    private, public = out / PRIVATE_KEY_NAME, out / PUBLIC_KEY_NAME
    for p in (private, public):
        if p.exists():
            raise BundleError(f"{p} exists; not overwriting a key (move it away or choose another --out)")
    key = Ed25519PrivateKey.generate()
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    pub = key.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    try:
        out.mkdir(mode=0o700, parents=True, exist_ok=True)  # a folder for secrets: nobody else lists it
        # created 0600 from the start: the key never exists with wider permissions
        fd = os.open(private, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(pem)
        os.chmod(private, 0o600)  # in case the umask or an ACL widened it
        fd = os.open(public, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        with os.fdopen(fd, "wb") as f:
            f.write(pub)
    except OSError as exc:
        raise BundleError(f"cannot write keys into {out}: {exc.strerror or first_line(exc)}") from None
    return private, public, key_id(key.public_key())


def load_private_key(path: str | os.PathLike) -> Ed25519PrivateKey:
    """An unencrypted Ed25519 private key (PKCS#8 PEM).

    Raises:
        BundleError: missing, unreadable, encrypted, or not an Ed25519 private key.
    """
    data = _read(path, "private key")
    try:
        key = serialization.load_pem_private_key(data, password=None)
    except TypeError:
        raise BundleError(f"{path}: the private key is encrypted; k2edge signs with an unencrypted PKCS#8 key "
                          "(keep it on an offline machine or in a vault)") from None
    except (ValueError, binascii.Error) as exc:
        raise BundleError(f"{path}: not a PEM private key ({first_line(exc)})") from None
    if not isinstance(key, Ed25519PrivateKey):
        raise BundleError(f"{path}: a {type(key).__name__.removeprefix('_')} key, not Ed25519 "
                          "(make one with k2edge keys generate)")
    return key


def load_public_key(path: str | os.PathLike) -> Ed25519PublicKey:
    """An Ed25519 public key (SubjectPublicKeyInfo PEM).

    Raises:
        BundleError: missing, unreadable, or not an Ed25519 public key.
    """
    data = _read(path, "public key")
    try:
        key = serialization.load_pem_public_key(data)
    except (ValueError, binascii.Error) as exc:
        raise BundleError(f"{path}: not a PEM public key ({first_line(exc)})") from None
    if not isinstance(key, Ed25519PublicKey):
        raise BundleError(f"{path}: not an Ed25519 public key (k2edge keys generate writes one)")
    return key


def _read(path, what: str) -> bytes:
    try:
        return read_small(path, MAX_SECRET_BYTES)
    except FileNotFoundError:
        raise BundleError(f"{what} {str(path)!r} does not exist") from None
    except OSError as exc:
        if exc.errno == errno.EFBIG:
            raise BundleError(f"{what} {str(path)!r}: not a PEM key (a key file is a few hundred bytes, this one "
                              f"{exc.strerror})") from None
        raise BundleError(f"{what} {str(path)!r}: cannot read ({exc.strerror})") from None


@dataclass(frozen=True)
class TrustStore:
    """The public keys a device trusts, by key id, with the file each came from."""

    keys: dict[str, Ed25519PublicKey]
    sources: dict[str, str]

    def __contains__(self, kid: str) -> bool:
        return kid in self.keys

    def __len__(self) -> int:
        return len(self.keys)

    def verify(self, kid: str, signature: bytes, message: bytes) -> bool:
        """True when ``signature`` is the trusted key ``kid``'s Ed25519 signature of ``message``."""
        try:
            self.keys[kid].verify(signature, message)
        except (InvalidSignature, KeyError):
            return False
        return True


def load_trust(paths: Iterable[str | os.PathLike]) -> TrustStore:
    """Load the trusted public keys (``[trust] keys`` or ``--trust``); removing a file revokes that key.

    Raises:
        BundleError: a file is missing or is not an Ed25519 public key.
    """
    keys, sources = {}, {}
    for p in paths:
        key = load_public_key(p)
        kid = key_id(key)
        keys[kid], sources[kid] = key, str(p)
    return TrustStore(keys, sources)


@dataclass(frozen=True)
class Signature:
    """The content of ``manifest.sig``."""

    key_id: str
    signature: bytes

    def to_bytes(self) -> bytes:
        body = {"key_id": self.key_id, "signature": base64.b64encode(self.signature).decode("ascii")}
        return (json.dumps(body, indent=2) + "\n").encode()

    @classmethod
    def parse(cls, data: bytes) -> "Signature":
        """Parse ``manifest.sig``.

        Raises:
            ValueError: not JSON with a hex ``key_id`` and a base64 64-byte ``signature``.
        """
        try:
            body = json.loads(data)
        except (UnicodeDecodeError, json.JSONDecodeError):
            raise ValueError("manifest.sig is not JSON") from None
        if not isinstance(body, dict) or not isinstance(body.get("key_id"), str) or not isinstance(body.get("signature"), str):
            raise ValueError('manifest.sig must be a JSON object {"key_id": hex, "signature": base64}')
        kid = body["key_id"].lower()
        if len(kid) != 64 or any(c not in "0123456789abcdef" for c in kid):
            raise ValueError("manifest.sig: key_id must be 64 hex digits (the sha256 of the raw public key)")
        try:
            sig = base64.b64decode(body["signature"], validate=True)
        except binascii.Error:
            raise ValueError("manifest.sig: signature is not valid base64") from None
        if len(sig) != 64:
            raise ValueError(f"manifest.sig: an Ed25519 signature has 64 bytes, this one {len(sig)}")
        return cls(kid, sig)


def sign_manifest(manifest_bytes: bytes, private_key: Ed25519PrivateKey) -> Signature:
    """Sign the exact bytes of ``manifest.json``."""
    return Signature(key_id(private_key.public_key()), private_key.sign(manifest_bytes))
