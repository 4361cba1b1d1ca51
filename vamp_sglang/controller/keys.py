"""The deployment's CURVE key pair: one file, readable by its owner only, shared by every node.

Across nodes the controller talks TCP, and anyone who can reach the leader's port could otherwise
vote in a remap. Every rank of one deployment holds the same key file: the leader serves CURVE with
that pair and admits exactly one client key, the same public key, so holding the file is what makes
a peer a rank. The file is ZMQ's own certificate text (`zmq.auth.load_certificate` reads it), no
pickle. `python -m vamp_sglang.controller keygen PATH` writes one; copy it to every node, keeping
mode 0600.
"""

import os
from dataclasses import dataclass

import zmq
from zmq.auth import load_certificate

from vamp_sglang.controller.ipc import ControllerError, check_private

Z85_KEY_CHARS = 40  # a 32-byte Curve25519 key in Z85


@dataclass(frozen=True, repr=False)
class DeploymentKey:
    """The pair as Z85 bytes; repr leaves the secret out of logs and tracebacks."""

    public: bytes
    secret: bytes

    def __repr__(self) -> str:
        return f"DeploymentKey(public={self.public[:8].decode()}...)"


def generate_key_file(path: str) -> DeploymentKey:
    """Write a fresh pair to `path` (created 0600, never over an existing file: that would split a deployment)."""
    public, secret = zmq.curve_keypair()
    text = ("#   VAMP rank-controller CURVE key pair (ZeroMQ secret certificate format)\n"
            "#   Every node of one deployment needs this file; keep it mode 0600.\n"
            "metadata\ncurve\n"
            f"    public-key = \"{public.decode()}\"\n"
            f"    secret-key = \"{secret.decode()}\"\n")
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    except FileExistsError:
        raise ControllerError(f"{path} exists; refusing to overwrite a deployment's key") from None
    with os.fdopen(fd, "w") as out:
        os.fchmod(fd, 0o600)  # O_CREAT's mode is cut by the umask, never widened; be explicit anyway
        out.write(text)
    return DeploymentKey(public, secret)


def check_key_file(path: str) -> None:
    """Refuse a key file another user could read, replace or own (the error names the fix)."""
    check_private(path, "key file", is_dir=False, fix=f"chmod 600 {path}",
                  missing_hint=f"make one with `python -m vamp_sglang.controller keygen {path}`")


def load_key_file(path: str) -> DeploymentKey:
    """The pair in `path`, after `check_key_file`; a file without both keys is refused."""
    check_key_file(path)
    try:
        public, secret = load_certificate(path)
    except (OSError, ValueError) as exc:
        raise ControllerError(f"key file {path} is not a CURVE key pair ({exc})") from None
    for name, key in (("public-key", public), ("secret-key", secret)):
        if key is None or len(key) != Z85_KEY_CHARS:
            raise ControllerError(f"key file {path} has no valid {name} (expected {Z85_KEY_CHARS} Z85 "
                                  "characters); make a new one with keygen")
    try:
        derived = zmq.curve_public(secret)
    except (zmq.ZMQError, ValueError) as exc:
        raise ControllerError(f"key file {path} has an invalid secret-key ({exc})") from None
    if derived != public:
        raise ControllerError(f"key file {path}: the public-key does not belong to the secret-key")
    return DeploymentKey(public, secret)
