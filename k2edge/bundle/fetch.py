"""Fetching a bundle over HTTPS for a deploy that names a URL (httpx, bounded, hash-checked).

The body is read as a stream and refused as soon as it passes the size limit; its sha256 must
equal the one the deploy request gave before anything else looks at it (the signature inside is
checked afterwards, as for a bundle sent over MQTT). ``[deploy] ca_file`` replaces the system's
certificate authorities for fleets that serve bundles from a private CA.
"""

from __future__ import annotations

import hashlib
import os
import ssl

from ..errors import K2EdgeError, first_line

__all__ = ["FetchError", "fetch_bundle"]


class FetchError(K2EdgeError):
    """The bundle could not be fetched; ``status`` is ``failed`` (network, TLS, HTTP), ``too_large``
    or ``hash_mismatch`` (the bytes are not the ones the request named)."""

    def __init__(self, status: str, detail: str) -> None:
        super().__init__(detail)
        self.status, self.detail = status, detail


def fetch_bundle(url: str, sha256: str, max_bytes: int, ca_file: str | os.PathLike | None = None,
                 timeout_s: float = 60.0) -> bytes:
    """GET ``url`` (https only) and return its bytes once their sha256 matches.

    Args:
        url: an ``https://`` URL; redirects are followed only to ``https://``.
        sha256: hex sha256 of the bundle file.
        max_bytes: ``[deploy] max_bundle_bytes``.
        ca_file: PEM certificate authorities to trust instead of the system's.
        timeout_s: per network operation (connect, each read).

    Raises:
        FetchError: see the class.
    """
    import httpx

    if not url.startswith("https://"):
        raise FetchError("failed", f"only https:// URLs are fetched, not {url[:80]!r}")
    try:
        verify: ssl.SSLContext | bool = ssl.create_default_context(cafile=str(ca_file)) if ca_file else True
    except (OSError, ssl.SSLError) as exc:
        raise FetchError("failed", f"deploy.ca_file {str(ca_file)!r}: {first_line(exc)}") from None
    digest, body = hashlib.sha256(), bytearray()

    def https_only(request) -> None:  # every request, redirects included, before it is sent
        if request.url.scheme != "https":
            raise FetchError("failed", f"{url} redirects to {str(request.url)[:80]}, which is not https")

    try:
        with httpx.Client(verify=verify, timeout=httpx.Timeout(timeout_s, connect=min(timeout_s, 15.0)),
                          follow_redirects=True, max_redirects=5, event_hooks={"request": [https_only]}) as client:
            with client.stream("GET", url) as resp:
                if resp.status_code != 200:
                    raise FetchError("failed", f"{url}: HTTP {resp.status_code} {resp.reason_phrase}")
                length = resp.headers.get("content-length", "")
                if length.isascii() and length.isdigit() and int(length) > max_bytes:
                    raise FetchError("too_large", f"{url} is {int(length)} bytes; the limit is {max_bytes} "
                                                  "(deploy.max_bundle_bytes)")
                for chunk in resp.iter_bytes():
                    body += chunk
                    if len(body) > max_bytes:
                        raise FetchError("too_large", f"{url} sends more than {max_bytes} bytes (deploy.max_bundle_bytes)")
                    digest.update(chunk)
    except httpx.HTTPError as exc:
        raise FetchError("failed", f"cannot fetch {url}: {first_line(exc) or type(exc).__name__}") from None
    except (OSError, ssl.SSLError) as exc:
        raise FetchError("failed", f"cannot fetch {url}: {first_line(exc)}") from None
    if digest.hexdigest() != sha256.lower():
        raise FetchError("hash_mismatch", f"{url}: sha256 {digest.hexdigest()[:16]}... differs from the request's "
                                          f"{sha256[:16]}...")
    return bytes(body)
