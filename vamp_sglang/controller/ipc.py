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
    try:
        info = os.lstat(ipc_dir)
    except FileNotFoundError:
        raise ControllerError(f"ipc_dir {ipc_dir!r} does not exist; create it with make_private_ipc_dir()") from None
    if stat.S_ISLNK(info.st_mode) or not stat.S_ISDIR(info.st_mode):
        raise ControllerError(f"ipc_dir {ipc_dir!r} must be a directory, not a symlink or a file")
    if info.st_uid != os.getuid():
        raise ControllerError(f"ipc_dir {ipc_dir!r} is owned by uid {info.st_uid}, not by us (uid {os.getuid()})")
    mode = stat.S_IMODE(info.st_mode)
    if mode & 0o077:
        raise ControllerError(f"ipc_dir {ipc_dir!r} has mode {mode:04o}; it must be private (0700)")


def leader_socket_path(ipc_dir: str, group_id: int) -> str:
    """One leader socket per TP group: DP or PP replicas each run their own rank 0."""
    path = os.path.join(ipc_dir, f"vamp-ctl-{group_id}.sock")
    if len(os.fsencode(path)) > MAX_UNIX_PATH_BYTES:
        raise ControllerError(f"ipc_dir {ipc_dir!r} is too long for a unix socket path "
                              f"({len(os.fsencode(path))} > {MAX_UNIX_PATH_BYTES} bytes)")
    return path
