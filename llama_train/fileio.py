"""Files that are whole or absent: written to a temp name, fsynced, renamed into place.

A reader (or a run resumed after kill -9) sees the old content or the new, never a prefix.
"""

import os


def atomic_write(path: str, text: str):
    """Replace `path` with `text`: temp file beside it, fsync, os.replace."""
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w", newline="") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
