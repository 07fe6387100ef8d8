"""Files that are whole or absent: written to a temp name, fsynced, renamed into place (the rename
fsynced too).

A reader (or a run resumed after kill -9) sees the old content or the new, never a prefix.
"""

import os


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
    finally:
        os.close(fd)


def fsync_tree(root: str):
    """fsync every file and directory under `root`, `root` last."""
    for d, _, files in os.walk(root, topdown=False):
        for name in files:
            fsync_path(os.path.join(d, name))
        fsync_path(d)
