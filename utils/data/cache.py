"""Build a directory once per content key, across processes and hosts, safely.

Local rank 0 (or -1) builds into a temp directory and renames it into place, under a file lock
so two builders of one key end with one copy; the manifest, written last, marks it complete.
Other local ranks poll for the manifest: files, not a collective, so a slow build times nothing
out. Used for the tokenized dataset (data_utils) and trained tokenizers (tokenizer).
"""

import fcntl
import hashlib
import json
import logging
import os
import re
import secrets
import shutil
import socket
import time
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path

from llama_train.errors import CacheError, CacheWaitTimeout

logger = logging.getLogger(__name__)

MANIFEST = "manifest.json"
DEFAULT_WAIT_TIMEOUT_S = 24 * 3600  # non-zero local ranks wait this long for rank 0's build


def sha256_json(data) -> str:
    """sha256 of a canonical JSON encoding: the same in every process, unlike hash()."""
    return hashlib.sha256(json.dumps(data, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def read_manifest(cache_dir: Path) -> dict:
    return json.loads((Path(cache_dir) / MANIFEST).read_text())


def _host() -> str:
    return re.sub(r"[^A-Za-z0-9.]", "_", socket.gethostname())


@contextmanager
def _file_lock(path: Path):
    """An exclusive POSIX lock (lockf, not flock): it belongs to this process only, so forked
    tokenizer workers never hold it, and the kernel drops it when the process dies."""
    with open(path, "a+b") as f:
        fcntl.lockf(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.lockf(f, fcntl.LOCK_UN)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


def _remove_stale_temps(final_dir: Path) -> None:
    """Delete temp dirs that builders on this host left when they died (SIGKILL, OOM). Only this
    host's: on a shared file system a live builder elsewhere is not ours to judge."""
    prefix = f".{final_dir.name}.tmp-{_host()}-"
    for tmp in final_dir.parent.glob(prefix + "*"):
        pid = tmp.name[len(prefix) :].split("-")[0]
        if pid.isdigit() and int(pid) != os.getpid() and not _pid_alive(int(pid)):
            shutil.rmtree(tmp, ignore_errors=True)  # garbage either way; failing to delete it is harmless


def _write_durably(path: Path, data: dict) -> None:
    with open(path, "w") as f:
        f.write(json.dumps(data, indent=2, sort_keys=True) + "\n")
        f.flush()
        os.fsync(f.fileno())


def _wait_for(manifest: Path, what: str) -> None:
    """Poll for `manifest` (written last by the builder); warn now and then, give up after
    $LLAMA_TRAIN_DATA_WAIT_TIMEOUT seconds. Files, not a barrier: a slow build times nothing out."""
    timeout = float(os.environ.get("LLAMA_TRAIN_DATA_WAIT_TIMEOUT", DEFAULT_WAIT_TIMEOUT_S))
    start = time.monotonic()
    delay, notice_at = 0.05, start + 60
    while not manifest.is_file():
        waited = time.monotonic() - start
        if waited > timeout:
            raise CacheWaitTimeout(
                f"waited {waited:.0f}s for local rank 0 to build the {what} at {manifest.parent}; see its log "
                "for an error, or raise LLAMA_TRAIN_DATA_WAIT_TIMEOUT (seconds) for a very large corpus"
            )
        if time.monotonic() >= notice_at:
            logger.warning(
                "still waiting (%.0fs) for local rank 0 to build the %s at %s", waited, what, manifest.parent
            )
            notice_at += 300
        time.sleep(delay)
        delay = min(delay * 1.5, 2.0)


def build_once(final_dir: Path, build: Callable[[Path], dict], local_rank: int, what: str) -> dict:
    """Make `final_dir` exist and be complete; return its manifest.

    Local rank 0 (or -1, not distributed) calls `build(tmp_dir)`, which writes its files into the
    empty `tmp_dir` and returns the manifest; the manifest is written last and `tmp_dir` renamed
    to `final_dir`, so `final_dir/manifest.json` existing means complete. A lock file serializes
    builders of one key (several rank-0 processes, nodes on a shared file system); a builder
    that still loses a rename race keeps the winner's copy. Other local ranks wait for the file."""
    final_dir = Path(final_dir)
    manifest = final_dir / MANIFEST
    if manifest.is_file():
        return read_manifest(final_dir)
    if local_rank > 0:
        _wait_for(manifest, what)
        return read_manifest(final_dir)
    final_dir.parent.mkdir(parents=True, exist_ok=True)
    with _file_lock(final_dir.with_name(f".{final_dir.name}.lock")):
        if manifest.is_file():  # another builder finished while we waited for the lock
            return read_manifest(final_dir)
        if final_dir.exists():
            raise CacheError(
                f"{final_dir} exists without {MANIFEST}; it was not written by this code: delete it"
            )
        _remove_stale_temps(final_dir)
        tmp = final_dir.with_name(f".{final_dir.name}.tmp-{_host()}-{os.getpid()}-{secrets.token_hex(4)}")
        tmp.mkdir()
        try:
            _write_durably(tmp / MANIFEST, build(tmp))
            _rename_into_place(tmp, final_dir)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp)
    return read_manifest(final_dir)


def _rename_into_place(tmp: Path, final_dir: Path) -> None:
    try:
        os.rename(tmp, final_dir)  # atomic; fails if final_dir exists and is not empty
    except OSError:
        if not (final_dir / MANIFEST).is_file():
            raise
        logger.info("%s was built concurrently by another process; using that copy", final_dir)
