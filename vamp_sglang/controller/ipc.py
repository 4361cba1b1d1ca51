"""The private directory that holds the controller's ipc sockets, and the endpoint inside it.

Anyone who can connect to the leader's socket can vote in a remap, so the sockets live in a
directory only we can enter (mode 0700, owned by our uid, not a symlink). The launcher makes one
per server with `make_private_ipc_dir()` and passes it to SGLang's processes in the environment.
"""

import os
import stat
import tempfile

MAX_UNIX_PATH_BYTES = 107  # sockaddr_un.sun_path is 108 bytes including the NUL


class ControllerError(RuntimeError):
    """The controller cannot be set up safely; the message names the bad setting."""


def make_private_ipc_dir() -> str:
    """A fresh 0700 directory for one server's controller sockets (the launcher removes it at exit)."""
    path = tempfile.mkdtemp(prefix="vamp-ctl-")
    os.chmod(path, 0o700)
    return path


def check_private_dir(ipc_dir: str) -> None:
    """Refuse a directory that another user could enter or replace."""
    check_private(ipc_dir, "ipc_dir", is_dir=True, missing_hint="create it with make_private_ipc_dir()",
                  fix="0700")


def check_private(path: str, what: str, is_dir: bool, missing_hint: str, fix: str) -> None:
    """Refuse a path another user could read, replace or own: it must be ours, not a symlink, mode 0?00."""
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        raise ControllerError(f"{what} {path!r} does not exist; {missing_hint}") from None
    check_private_stat(info, path, what, is_dir, fix)


def check_private_stat(info: os.stat_result, path: str, what: str, is_dir: bool, fix: str) -> None:
    """`check_private`'s checks on a stat result already taken (an open descriptor's fstat)."""
    kind, other, is_kind = ("directory", "a file", stat.S_ISDIR) if is_dir else ("regular file", "a directory",
                                                                                 stat.S_ISREG)
    if stat.S_ISLNK(info.st_mode) or not is_kind(info.st_mode):
        raise ControllerError(f"{what} {path!r} must be a {kind}, not a symlink or {other}")
    if info.st_uid != os.getuid():
        raise ControllerError(f"{what} {path!r} is owned by uid {info.st_uid}, not by us (uid {os.getuid()})")
    mode = stat.S_IMODE(info.st_mode)
    if mode & 0o077:
        raise ControllerError(f"{what} {path!r} has mode {mode:04o}; it must be private ({fix})")


def leader_socket_path(ipc_dir: str, group_id: int) -> str:
    """One leader socket per TP group: DP or PP replicas each run their own rank 0."""
    path = os.path.join(ipc_dir, f"vamp-ctl-{group_id}.sock")
    if len(os.fsencode(path)) > MAX_UNIX_PATH_BYTES:
        raise ControllerError(f"ipc_dir {ipc_dir!r} is too long for a unix socket path "
                              f"({len(os.fsencode(path))} > {MAX_UNIX_PATH_BYTES} bytes)")
    return path
