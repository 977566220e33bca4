"""``k2edge bundle create|sign|verify|inspect``: signed model bundles for fleet deployment."""

from __future__ import annotations

COMMAND = "bundle"
HELP = "create, sign, verify or inspect a signed model bundle (.k2b)"
ORDER = 116

from .common import add_json, print_json


def register(p) -> None:
    sub = p.add_subparsers(dest="action", metavar="ACTION", required=True, parser_class=type(p))
    create = sub.add_parser("create", help="bundle a model folder: the ONNX model, card, labels, calibration set, profiles")
    create.add_argument("model_dir", metavar="MODEL_DIR", help="the model's folder (or the .onnx file in it)")
    create.add_argument("--out", required=True, metavar="FILE.k2b", help="bundle file to write")
    create.add_argument("--version", default="1.0.0", metavar="V", help="semantic version of this release (default 1.0.0)")
    create.add_argument("--profile", "-p", action="append", default=[], metavar="P",
                        help="profile name or file to ship (repeatable; the first is the default)")
    create.add_argument("--name", metavar="NAME", help="model name (default: the folder's name); the daemon config's [[models]] name")
    create.add_argument("--key", metavar="PRIVATE.pem", help="sign it at once with this key")
    create.add_argument("--no-gzip", dest="gzip", action="store_false", help="write a plain tar")
    sign = sub.add_parser("sign", help="sign (or re-sign) a bundle after checking its files against its manifest")
    sign.add_argument("bundle", metavar="FILE.k2b")
    sign.add_argument("--key", required=True, metavar="PRIVATE.pem", help="Ed25519 private key (PKCS#8 PEM)")
    verify = sub.add_parser("verify", help="check signature, paths, files, hashes, limits and structure; "
                                           "prints 'verified NAME VERSION' or 'STATUS: detail'")
    verify.add_argument("bundle", metavar="FILE.k2b")
    verify.add_argument("--trust", action="append", default=[], metavar="PUBLIC.pub",
                        help="a trusted public key (repeatable)")
    verify.add_argument("--config", metavar="PATH", help="also trust the daemon config's [trust] keys and use its [deploy] limits")
    add_json(verify)
    inspect = sub.add_parser("inspect", help="show a bundle's manifest, signer and files, and whether its files match")
    inspect.add_argument("bundle", metavar="FILE.k2b")
    add_json(inspect)


def run(args) -> int:
    return {"create": _create, "sign": _sign, "verify": _verify, "inspect": _inspect}[args.action](args)


def _create(args) -> int:
    from ..bundle import create_bundle

    m = create_bundle(args.model_dir, args.out, version=args.version, profiles=args.profile, name=args.name,
                      key=args.key, compress=args.gzip)
    state = "signed" if args.key else "unsigned: sign it with k2edge bundle sign"
    print(f"created {args.out}: {m.name} {m.version}, {len(m.files)} files, {m.total_size} bytes ({state})")
    return 0


def _sign(args) -> int:
    from ..bundle import sign_bundle

    result = sign_bundle(args.bundle, args.key)
    print(f"signed {result.name} {result.version} with key {result.key_id}")
    return 0


def _verify(args) -> int:
    from dataclasses import replace

    from ..bundle import Limits, load_trust, verify_bundle
    from ..bundle.store import name_refusal
    from ..errors import K2EdgeError

    trust_paths, limits, allow_unsigned, served = list(args.trust), Limits(), False, None
    if args.config:
        from ..config import load_config

        cfg = load_config(args.config)
        if cfg.trust is not None:
            trust_paths += [str(p) for p in cfg.trust.keys]
            allow_unsigned = cfg.trust.allow_unsigned
        limits = Limits.from_settings(cfg.deploy)
        served = {m.name for m in cfg.models}  # a device with this config refuses a bundle for another model
    if not trust_paths and not allow_unsigned:
        raise K2EdgeError("give at least one --trust PUBLIC.pub (or --config with [trust] keys)")
    result = verify_bundle(args.bundle, load_trust(trust_paths), limits, allow_unsigned=allow_unsigned)
    wrong = name_refusal(result.name, served) if result.ok else None
    if wrong is not None:
        result = replace(result, status="bad_manifest", detail=wrong)
    if args.json:
        print_json(result.to_dict())
    else:
        print(result.line)
    return 0 if result.ok else 1


def _inspect(args) -> int:
    from ..bundle import Limits
    from ..bundle.inspect import inspect_bundle

    info = inspect_bundle(args.bundle, Limits.most())  # whether a device takes its size is the device's to say
    if args.json:
        print_json(info)
        return 0
    for key, value in info["summary"]:
        print(f"{key:<12} {value}")
    return 0
