"""Files that are whole or absent: written to a temp name, fsynced, renamed into place (the rename
fsynced too).

A reader (or a run resumed after kill -9) sees the old content or the new, never a prefix.

Directory fsync is best-effort where the file system says it has none: Linux returns EINVAL (some
FUSE file systems ENOTSUP) for fsync on a directory of a mount that does not implement it (older
CIFS/SMB, WSL's Windows shares, some Ceph and FUSE mounts), as borg, restic, rocksdb and leveldb
tolerate. Such an error is warned about once per file system and the write goes on; any error from a
file's fsync, and EIO from a directory's, is raised.
"""

import errno
import os
import stat
import sys

NO_DIRECTORY_FSYNC = {errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP}  # "not on this mount", not a failure
_warned_devices: set[int] = set()


def atomic_write(path: str, text: str):
    """Replace `path` with `text`: temp file beside it, fsync, os.replace, fsync of the directory (the
    rename itself reaches the disk)."""
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w", newline="") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_path(os.path.dirname(path) or ".")


def fsync_path(path: str):
    """fsync a file or a directory (a directory's entries: files created or renamed in it)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError as e:
        info = os.fstat(fd)
        if e.errno not in NO_DIRECTORY_FSYNC or not stat.S_ISDIR(info.st_mode):
            raise
        _warn_once(path, info.st_dev, e)
    finally:
        os.close(fd)


def _warn_once(path: str, device: int, e: OSError):
    if device not in _warned_devices:
        _warned_devices.add(device)
        print(
            f"warning: {path}: this file system does not fsync directories ({e.strerror}); files are still "
            "fsynced and renamed into place in order, but a power loss just after a save may undo its last "
            "rename (docs/reliability.md)",
            file=sys.stderr,
            flush=True,
        )


def fsync_tree(root: str):
    """fsync every file and directory under `root`, `root` last."""
    for d, _, files in os.walk(root, topdown=False):
        for name in files:
            fsync_path(os.path.join(d, name))
        fsync_path(d)
