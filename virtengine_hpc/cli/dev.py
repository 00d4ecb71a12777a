"""``virtengine-hpc dev``: the local development helpers (demo, keys, stopping the demo worker)."""

from __future__ import annotations

import argparse
from pathlib import Path

from virtengine_hpc.signing import Signer, public_key_b64, write_private_key


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    dev = sub.add_parser("dev", help="local development helpers")
    dsub = dev.add_subparsers(dest="action", metavar="ACTION", required=True)
    demo = dsub.add_parser("demo", help="run the sample jobs end to end on the local dev server (make demo)")
    demo.add_argument("--temporal-address", default="127.0.0.1:7233")
    demo.add_argument("--ui-port", type=int, default=8233)
    demo.set_defaults(func=_demo)
    stop = dsub.add_parser("stop-worker", help="stop the demo's background worker")
    stop.set_defaults(func=_stop)
    keygen = dsub.add_parser("keygen", help="create an Ed25519 provider signing key (PKCS#8 PEM, mode 0600)")
    keygen.add_argument("path", type=Path)
    keygen.set_defaults(func=_keygen)


def _demo(args: argparse.Namespace) -> int:
    from virtengine_hpc.demo import run_demo

    return run_demo(args.temporal_address, args.ui_port)


def _stop(args: argparse.Namespace) -> int:
    from virtengine_hpc.demo import stop_worker

    print("demo worker stopped" if stop_worker() else "no demo worker running")
    return 0


def _keygen(args: argparse.Namespace) -> int:
    try:
        key = write_private_key(args.path)
    except FileExistsError:
        print(f"error: {args.path} exists; refusing to overwrite a key")
        return 2
    signer = Signer(key)
    print(f"wrote {args.path} (mode 0600)")
    print(f"public key (base64): {public_key_b64(signer.public_key)}")
    print(f"key id: {signer.key_id}")
    print(f"export PROVIDER_SIGNING_KEY_PATH={args.path}")
    return 0
