"""The deployment key file is read from the descriptor that passed the checks (issue 19 item 13): opened
without following a symlink, checked by fstat, parsed from that descriptor, in a directory no other
user can write. A path swapped after the check, or a directory where one could swap it, never yields a
key other than the one checked."""

import os
import stat
import threading

import pytest

from vamp_sglang.controller.ipc import ControllerError
from vamp_sglang.controller.keys import check_key_file, generate_key_file, load_key_file


@pytest.fixture
def key_dir(tmp_path):
    """A private directory holding the deployment's key and an impostor's."""
    directory = tmp_path / "keys"
    directory.mkdir(mode=0o700)
    real, impostor = str(directory / "vamp.key"), str(directory / "impostor.key")
    return directory, real, generate_key_file(real), impostor, generate_key_file(impostor)


def test_a_symlink_swapped_in_after_the_check_is_not_what_gets_loaded(key_dir, monkeypatch):
    directory, real, real_key, impostor, _ = key_dir
    swapped = []

    def swap_after(check):
        def checked(target, *args, **kwargs):
            info = check(target, *args, **kwargs)
            if stat.S_ISREG(info.st_mode) and not swapped:  # the key file passed: now swap the path
                link = str(directory / "swap.lnk")
                os.symlink(impostor, link)
                os.replace(link, real)
                swapped.append(target)
            return info
        return checked

    monkeypatch.setattr(os, "lstat", swap_after(os.lstat))
    monkeypatch.setattr(os, "fstat", swap_after(os.fstat))
    assert load_key_file(real) == real_key and swapped
    assert os.path.islink(real)
    with pytest.raises(ControllerError, match="must be a regular file, not a symlink"):
        load_key_file(real)  # the symlink itself is refused


@pytest.mark.parametrize("mode", [0o777, 0o1777, 0o770, 0o702])
def test_a_key_file_in_a_directory_others_can_write_is_refused(key_dir, mode):
    directory, real, *_ = key_dir
    directory.chmod(mode)
    for check in (check_key_file, load_key_file):
        with pytest.raises(ControllerError, match=f"is in {str(directory)!r}, mode {mode:04o}: another user could "
                                                  f"replace it \\(chmod go-w {directory}\\)"):
            check(real)
    directory.chmod(0o755)  # readable by others is fine: the file itself is 0600
    load_key_file(real)


def test_a_key_file_in_a_directory_another_user_owns_is_refused(key_dir, monkeypatch):
    """As root (CI) the directory is given to another uid. Elsewhere only root could do that, so the process
    takes another uid instead (`os.getuid`, which the check reads): the directory is then, to the check,
    another user's, and its owner is not root, whom the check trusts. Either way the stat checked is real."""
    directory, real, *_ = key_dir
    if os.getuid() == 0:
        os.chown(directory, 4321, -1)
    else:
        other = os.getuid() + 1
        monkeypatch.setattr(os, "getuid", lambda: other)
    owner = os.stat(directory).st_uid
    assert owner not in (0, os.getuid())
    with pytest.raises(ControllerError, match=f"is owned by uid {owner}, who could replace it"):
        load_key_file(real)


def test_a_fifo_at_the_path_is_refused_without_blocking(tmp_path):
    fifo = str(tmp_path / "vamp.key")
    os.mkfifo(fifo, 0o600)
    errors = []
    reader = threading.Thread(target=lambda: errors.append(pytest.raises(ControllerError, load_key_file, fifo)),
                              daemon=True)
    reader.start()
    reader.join(timeout=10)
    assert not reader.is_alive(), "opening a FIFO blocked until a writer came"
    assert "must be a regular file" in str(errors[0].value)
