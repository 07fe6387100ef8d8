"""Crash-safe publish (issue 24): a process killed inside checkpoint.publish, while it replaces an
older save of the same step, leaves a checkpoint that `latest` names and `--resume auto` finds."""

import errno
import json
import os
import signal
import stat
import subprocess
import sys

import pytest

from llama_train.checkpoint.resuming import find_resume
from llama_train.checkpoint.store import publish, verify_checkpoint
from llama_train.fileio import atomic_write
from tests.trainer_utils import ROOT

TAG = "step_00000004"
PUBLISH = f"from llama_train.checkpoint.store import publish; publish({{root!r}}, {TAG!r}, 5, 0)"


def complete(path, marker: str):
    os.makedirs(path)
    with open(os.path.join(path, "weights"), "w") as f:
        f.write(marker)
    atomic_write(
        os.path.join(path, "trainer_state.json"),
        json.dumps({"step": 4, "files": {"weights": {"bytes": len(marker)}}}),
    )


def test_a_kill_inside_publish_keeps_the_step_latest_names(tmp_path):
    root = tmp_path / "checkpoints"
    complete(root / TAG, "old")  # step 4 published once, `latest` names it
    atomic_write(str(root / "latest"), TAG)
    complete(root / f"{TAG}.tmp", "new")  # its requeue wrote step 4 again and publishes it
    env = {**os.environ, "LLAMA_TRAIN_TEST_PUBLISH_DELAY_AT": TAG, "LLAMA_TRAIN_TEST_SAVE_DELAY_S": "60"}
    proc = subprocess.Popen(
        [sys.executable, "-c", PUBLISH.format(root=str(root))],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert "test hook: sleeping" in proc.stdout.readline()
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    found = find_resume("auto", str(tmp_path))
    assert found == str(root / TAG)
    assert verify_checkpoint(found)["step"] == 4
    assert (root / TAG / "weights").read_text() == "old"  # the older save of step 4, back in place
    publish(str(root), TAG, 5, 0)  # the requeue's next save of step 4 publishes cleanly
    assert (root / TAG / "weights").read_text() == "new"
    assert sorted(p.name for p in root.iterdir()) == ["latest", TAG]


def test_checkpoint_files_and_directories_reach_the_disk_before_latest_moves(tmp_path, monkeypatch):
    """A node crash after `latest` moved must not leave it naming files still in the page cache: every
    file of the checkpoint, its directory, and the checkpoints directory (the rename) are fsynced before
    `latest` is replaced, and `latest`'s own rename after (sync and async saves alike)."""
    import torch

    from llama_train.checkpoint import store as ckpt
    from llama_train.checkpoint.async_save import Saver

    synced = []
    real_fsync = os.fsync

    def fsync(fd):
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    root = tmp_path / "checkpoints"
    for step, async_save in ((1, False), (2, True)):
        synced.clear()
        tag = ckpt.tag_for(step)
        files = lambda tmp: {os.path.join(tmp, n): {"w": torch.ones(3)} for n in ("model.pt", "optimizer.pt")}  # noqa: E731
        with Saver(async_save, hashes=True, keep_last=3, rank=0, world=1, timeout_s=60) as saver:
            saver.save(str(root), tag, files, {"step": step})
        final = root / tag
        latest = next(i for i, p in enumerate(synced) if os.path.basename(p).startswith("latest.tmp"))
        before = synced[:latest]
        wanted = [final / n for n in ("model.pt", "optimizer.pt", "rng_state.pt", "trainer_state.json")]
        for path in wanted:  # written under <tag>.tmp, fsynced there or after the rename
            assert str(path) in before or str(path).replace(tag, tag + ".tmp") in before, (path, synced)
        assert str(final) in before or str(final) + ".tmp" in before, synced  # the checkpoint's entries
        assert str(root) in before and str(root) in synced[latest + 1 :], synced  # its rename, then latest's


def refusing_directory_fsync(monkeypatch, code: int = errno.EINVAL, files_too: bool = False) -> list:
    """os.fsync as on a mount whose directories do not implement fsync (older CIFS/SMB, WSL shares, some
    Ceph/FUSE mounts): OSError `code` for a directory fd (and for files with `files_too`). Returns the
    list of paths refused."""
    real, refused = os.fsync, []

    def fsync(fd):
        if stat.S_ISDIR(os.fstat(fd).st_mode) or files_too:
            refused.append(os.readlink(f"/proc/self/fd/{fd}"))
            raise OSError(code, os.strerror(code))
        return real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    return refused


def test_a_mount_that_refuses_directory_fsync_still_publishes_checkpoints(tmp_path, monkeypatch, capsys):
    """EINVAL/ENOTSUP from fsync on a directory is the mount saying it has no directory fsync: the
    checkpoint is published (`latest` written), atomic_write returns for a file that is in place, and
    --report_to csv starts; an EIO on a directory, or any error on a file, still raises."""
    import torch

    from llama_train.checkpoint import store as ckpt
    from llama_train.checkpoint.async_save import Saver
    from llama_train.telemetry.reporting import CSVWriter

    for code in (errno.EINVAL, errno.ENOTSUP):
        refused = refusing_directory_fsync(monkeypatch, code)
        root = tmp_path / f"checkpoints-{code}"
        for step, async_save in ((1, False), (2, True)):
            files = lambda tmp: {os.path.join(tmp, "model.pt"): {"w": torch.ones(3)}}  # noqa: E731
            with Saver(async_save, hashes=True, keep_last=3, rank=0, world=1, timeout_s=60) as saver:
                saver.save(str(root), ckpt.tag_for(step), files, {"step": step})
            assert (root / "latest").read_text() == ckpt.tag_for(step) and refused
            assert verify_checkpoint(str(root / ckpt.tag_for(step)))["step"] == step
        atomic_write(str(tmp_path / "x.json"), "{}")
        CSVWriter(str(tmp_path), 0).close()
    warned = [line for line in capsys.readouterr().err.splitlines() if "fsync" in line]
    assert len(warned) == 1 and warned[0].startswith("warning: "), warned  # said once, not per save
    refusing_directory_fsync(monkeypatch, errno.EIO)  # a real I/O error: never ignored
    with pytest.raises(OSError, match="Input/output error"):
        atomic_write(str(tmp_path / "y.json"), "{}")
    refusing_directory_fsync(monkeypatch, errno.EINVAL, files_too=True)  # a file's fsync: never ignored
    with pytest.raises(OSError, match="Invalid argument"):
        atomic_write(str(tmp_path / "z.json"), "{}")
