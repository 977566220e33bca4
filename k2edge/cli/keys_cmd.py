"""``k2edge keys generate|show``: Ed25519 signing keys for model bundles."""

from __future__ import annotations

COMMAND = "keys"
HELP = "make an Ed25519 signing key pair for model bundles, or show a key's id"
ORDER = 115


def register(p) -> None:
    sub = p.add_subparsers(dest="action", metavar="ACTION", required=True, parser_class=type(p))
    gen = sub.add_parser("generate", help="write DIR/k2edge.key (PKCS#8 PEM, mode 0600) and DIR/k2edge.pub")
    gen.add_argument("--out", required=True, metavar="DIR", help="folder for the key pair (created if missing)")
    show = sub.add_parser("show", help="print a key's id (sha256 of the raw public key), as audit records show it")
    show.add_argument("key", metavar="KEY", help="a public (.pub) or private (.key) PEM file")


def run(args) -> int:
    from ..bundle import BundleError, generate_keys, key_id, load_private_key, load_public_key

    if args.action == "generate":
        private, public, kid = generate_keys(args.out)
        print(f"private key {private} (mode 0600: keep it off the devices)")
        print(f"public key  {public} (install it in /etc/k2edge/trust/ on the devices)")
        print(f"key id      {kid}")
        return 0
    try:
        public = load_public_key(args.key)
    except BundleError:
        if args.key.endswith(".pub"):  # meant as a public key: say what is wrong with it as one
            raise
        public = load_private_key(args.key).public_key()
    print(key_id(public))
    return 0
