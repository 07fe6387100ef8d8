"""Shared by every test module: where DeepSpeed's JIT-built ops live, and building them once."""

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# DeepSpeed's ops are built into this venv rather than ~/.cache/torch_extensions: a checkout's tests
# never wait on another checkout's build (or on its stale lock), and a fresh clone builds its own.
os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(Path(sys.prefix) / "torch_extensions"))


@pytest.fixture(scope="session")
def deepspeed_ops():
    """Build DeepSpeed's CPU ops (shm allreduce, cpu_adam) once, before any timed launch: a launch
    killed by its timeout in mid-build would leave a lock that hangs every later launch."""
    from llama_train.distributed.ds_compat import warn_stale_build_locks

    for lock in warn_stale_build_locks():  # left by an interrupted earlier session
        os.remove(lock)
    start = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "tests/helpers/build_deepspeed_ops.py"],
        capture_output=True,
        text=True,
        timeout=1200,
        cwd=ROOT,
    )
    assert proc.returncode == 0, (
        f"building DeepSpeed's ops failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    )
    print(
        f"\nDeepSpeed ops ready in {time.perf_counter() - start:.0f} s ({os.environ['TORCH_EXTENSIONS_DIR']})"
    )
