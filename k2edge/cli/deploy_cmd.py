"""``k2edge deploy``: send a signed model bundle to a device or a fleet group over MQTT 5."""

from __future__ import annotations

from .control import add_target

COMMAND = "deploy"
HELP = "deploy a signed model bundle to a device or a fleet group over MQTT and print each answer"
ORDER = 117


def register(p) -> None:
    p.add_argument("bundle", metavar="FILE.k2b", help="the signed bundle (k2edge bundle create ... --key)")
    p.add_argument("--allow-downgrade", action="store_true", help="deploy even if the version is not newer than the running one")
    p.add_argument("--url", metavar="HTTPS_URL",
                   help="send this URL instead of the bytes: the device fetches it over HTTPS and checks it against "
                        "FILE.k2b's sha256 (for bundles larger than the broker carries)")
    add_target(p, timeout=600.0)


def run(args) -> int:
    import json
    from pathlib import Path

    from ..errors import K2EdgeError
    from ..readfile import file_sha256
    from .control import send, target

    target(args, "deploy")
    if args.url is not None and not args.url.startswith("https://"):
        raise K2EdgeError(f"--url must be https://, got {args.url!r}")
    path = Path(args.bundle)
    if not path.exists():
        raise K2EdgeError(f"bundle {args.bundle!r} does not exist")
    _refuse_what_a_device_would(args.bundle)  # before reading it whole: a gigabyte that is no bundle stops here
    try:
        if args.url is not None:  # the device fetches it: only its hash goes, read a block at a time
            body = {"url": args.url, "sha256": file_sha256(path), "allow_downgrade": args.allow_downgrade}
            return send(args, "deploy", json.dumps(body).encode(), "application/json")
        data = path.read_bytes()
    except OSError as exc:
        raise K2EdgeError(f"bundle {args.bundle!r}: cannot read ({exc.strerror})") from None
    ctype = "application/gzip" if data[:2] == b"\x1f\x8b" else "application/x-tar"
    props = {"file": path.name, **({"allow_downgrade": "true"} if args.allow_downgrade else {})}
    return send(args, "deploy", data, ctype, props)


def _refuse_what_a_device_would(bundle: str) -> None:
    """Fail here, before the fleet is asked, when the file is no bundle at all: not a tar archive, or without a
    readable manifest. Whether its files match the manifest and its signer is trusted the devices judge, and
    audit: a tampered bundle is still sent, so that its refusal is on record where it was meant to run."""
    from ..bundle import Limits
    from ..bundle.inspect import inspect_bundle
    from ..errors import K2EdgeError

    info = inspect_bundle(bundle, Limits.most())  # BundleError: not a tar archive; its size is each device's to judge
    if info["manifest"] is None:
        raise K2EdgeError(f"bundle {bundle!r} is not a k2edge bundle: {info['manifest_error']} "
                          "(make one with k2edge bundle create)")
