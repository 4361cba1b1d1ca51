"""The deployment's CURVE key pair: one file, readable by its owner only, shared by every node.

Across nodes the controller talks TCP, and anyone who can reach the leader's port could otherwise
vote in a remap. Every rank of one deployment holds the same key file: the leader serves CURVE with
that pair and admits exactly one client key, the same public key, so holding the file is what makes
a peer a rank. The file is ZMQ's own certificate text (`zmq.auth.load_certificate` reads it), no
pickle. `python -m vamp_sglang.controller keygen PATH` writes one; copy it to every node, keeping
mode 0600, in a directory only its owner (or root) can write.

What is parsed is what was checked (issue 19 item 13): the file is opened relative to its parent
directory's descriptor without following a symlink (and without blocking on a FIFO), the checks run
on the two descriptors' fstat, and the keys are read from the file's descriptor. A path swapped after
the check therefore changes nothing, and a parent another user could write (where they could swap
the file for theirs between our runs) is refused.
"""

import errno
import os
import stat
from dataclasses import dataclass

import zmq

from vamp_sglang.controller.ipc import ControllerError, check_private_stat

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
    os.close(_open_checked(path))


def _open_checked(path: str) -> int:
    """A read descriptor on the key file at `path`, after the file's and its directory's checks."""
    parent = os.path.dirname(path) or "."
    parent_fd = _open(path, parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        _check_parent(os.fstat(parent_fd), path, parent)
        fd = _open(path, os.path.basename(path), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, parent_fd)
    finally:
        os.close(parent_fd)
    try:
        check_private_stat(os.fstat(fd), path, "key file", is_dir=False, fix=f"chmod 600 {path}")
    except ControllerError:
        os.close(fd)
        raise
    return fd


def _open(path: str, name: str, flags: int, dir_fd: int | None = None) -> int:
    """`os.open` of the key file at `path` or of its directory; a failure says what to fix."""
    try:
        return os.open(name, flags | os.O_CLOEXEC, dir_fd=dir_fd)
    except FileNotFoundError:
        why = f"does not exist; make one with `python -m vamp_sglang.controller keygen {path}`"
    except OSError as exc:
        why = "must be a regular file, not a symlink" if exc.errno == errno.ELOOP else f"cannot be opened ({exc})"
    raise ControllerError(f"key file {path!r} {why}")


def _check_parent(info: os.stat_result, path: str, parent: str) -> None:
    """Whoever can write the directory can put their own key file at `path`."""
    if info.st_uid not in (os.getuid(), 0):
        raise ControllerError(f"key file {path!r} is in {parent!r}, which is owned by uid {info.st_uid}, who "
                              "could replace it; keep the key in a directory of yours")
    mode = stat.S_IMODE(info.st_mode)
    if mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise ControllerError(f"key file {path!r} is in {parent!r}, mode {mode:04o}: another user could replace "
                              f"it (chmod go-w {parent})")


def _parse_pair(text: bytes) -> tuple[bytes | None, bytes | None]:
    """The `public-key` and `secret-key` values of ZMQ certificate text (the first of each)."""
    keys: dict[bytes, bytes] = {}
    for line in text.splitlines():
        name, equals, value = line.partition(b"=")
        if equals and name.strip() in (b"public-key", b"secret-key"):
            keys.setdefault(name.strip(), value.strip(b" \t'\""))
    return keys.get(b"public-key"), keys.get(b"secret-key")


def load_key_file(path: str) -> DeploymentKey:
    """The pair in `path`, read from the descriptor `check_key_file`'s checks passed on; a file without
    both keys is refused."""
    with os.fdopen(_open_checked(path), "rb") as key_file:
        public, secret = _parse_pair(key_file.read())
    if public is None and secret is None:
        raise ControllerError(f"key file {path} is not a CURVE key pair (no public-key or secret-key line)")
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
