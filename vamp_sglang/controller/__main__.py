"""`python -m vamp_sglang.controller keygen PATH`: write a deployment's CURVE key pair (mode 0600).

Copy the file to every node (keeping mode 0600) and pass it to each launcher as
`--vamp-controller-key-file PATH`. An existing file is never overwritten.
"""

import argparse
import sys

from vamp_sglang.controller.ipc import ControllerError
from vamp_sglang.controller.keys import generate_key_file

PROG = "python -m vamp_sglang.controller"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    keygen = commands.add_parser("keygen", help="write a new key pair to PATH (mode 0600, never overwrites)")
    keygen.add_argument("path", metavar="PATH")
    args = parser.parse_args(argv)
    try:
        key = generate_key_file(args.path)
    except (ControllerError, OSError) as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {args.path} (mode 0600, public key {key.public.decode()}); copy it to every node")
    return 0


if __name__ == "__main__":
    sys.exit(main())
