"""Shared by every test module: where DeepSpeed's JIT-built ops live, and building them once."""

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

import llama_train  # noqa: F401  first: names DeepSpeed's accelerator before anything imports DeepSpeed

ROOT = Path(__file__).resolve().parent.parent

# DeepSpeed's ops are built into this venv rather than ~/.cache/torch_extensions: a checkout's tests
# never wait on another checkout's build (or on its stale lock), and a fresh clone builds its own.
os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(Path(sys.prefix) / "torch_extensions"))


def machine_lines() -> list[str]:
    """What the suite runs on, so a failure on another machine can be traced: the CPU and its matrix
    units as torch and DeepSpeed see them (they change what runs: llama_train/cpu.py), the versions."""
    from importlib.metadata import version

    import torch
    from deepspeed.accelerator import get_accelerator

    from llama_train import cpu
    from llama_train.optim.muon import ns_dtype

    acc = get_accelerator()
    yes = {True: "yes", False: "no"}
    packages = ("torch", "deepspeed", "transformers", "sentencepiece")
    return [
        f"machine: {cpu.describe()}",
        f"DeepSpeed accelerator {acc.device_name()}: bf16 {yes[bool(acc.is_bf16_supported())]}, "
        f"fp16 {yes[bool(acc.is_fp16_supported())]}; --dtype auto on CPU: {cpu.auto_dtype()}; "
        f"Muon Newton-Schulz on CPU: {str(ns_dtype('cpu')).removeprefix('torch.')}",
        f"versions: python {sys.version.split()[0]}, "
        + ", ".join(f"{p} {version(p)}" for p in packages)
        + f" (torch {torch.__version__}, {torch.get_num_threads()} threads)",
    ]


def pytest_sessionstart(session):
    """The machine lines above every run's output, also under -q (which hides pytest's own header)."""
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        for line in machine_lines():
            reporter.write_line(line)


@pytest.fixture(scope="session")
def shared_data(tmp_path_factory):
    """One --data_output_path for the session's runs of the built-in corpus: tokenizers and token caches
    are keyed by what built them (utils/data), so a module's runs reuse what an earlier module built
    (the built-in corpus's tokenizer and token cache take ~7 s to build). A test about building, or
    one that must see no cache, keeps its own directory."""
    return tmp_path_factory.mktemp("shared-data")


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
