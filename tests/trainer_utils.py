"""Launch the real trainers (deepspeed / torchrun / plain python) from tests and read their metrics."""

import glob
import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from llama_train.bench.dtype import BF16_TWIN_RTOL  # noqa: F401  DDP vs ZeRO-2 bf16 losses: 1.3e-4 seen
from llama_train.distributed.dist import free_port
from llama_train.gpu import deepspeed_devices, launcher, launcher_env, nvidia_smi_gpus

ROOT = Path(__file__).resolve().parent.parent

# debug preset, tiny batches: a step takes milliseconds, so a run is dominated by start-up
BASE_FLAGS = (
    "--preset debug --max_seq_len 32 --batch_size 4 --learning_rate 3e-3 --warmup_steps 5 --log_interval 1 "
    "--eval_batches 4 --dtype float32"
).split()


def env(threads: int = 1) -> dict:
    """The trainers' environment in tests: these tests are about the CPU path (gloo, fp32), so GPUs
    are hidden (a GPU machine would otherwise run rank 1 on cuda:1, or on another job's GPU)."""
    e = dict(os.environ)
    e.update(OMP_NUM_THREADS=str(threads), PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false")
    e.update(CUDA_VISIBLE_DEVICES="", **launcher_env(""))  # DS_ACCELERATOR=cpu for DeepSpeed's ranks
    e.pop("WORLD_SIZE", None)
    return e


def deepspeed_launcher(nproc: int, port: int) -> list[str]:
    """`deepspeed` for `nproc` local ranks as the test environment asks (llama_train.gpu)."""
    args, _ = deepspeed_devices(nproc, env()["CUDA_VISIBLE_DEVICES"], nvidia_smi_gpus())
    return [*launcher("deepspeed"), *args, "--master_port", str(port)]


def launch(
    kind: str,
    flags: list[str],
    output_dir,
    data_dir,
    nproc: int = 2,
    timeout: int = 600,
    check=True,
    extra_env=None,
):
    """Run a trainer as a user would; returns the CompletedProcess (output captured). `extra_env`:
    variables added to the trainers' environment."""
    common = [*BASE_FLAGS, "--data_output_path", str(data_dir), "--output_dir", str(output_dir), *flags]
    port = free_port()
    if kind == "ddp":
        cmd = [*launcher("torchrun"), *f"--nproc_per_node {nproc} --master_port {port} train_ddp.py".split()]
    elif kind == "deepspeed":
        cmd = [*deepspeed_launcher(nproc, port), "train_deepspeed.py"]
    else:  # a single process without any launcher
        cmd = [sys.executable, kind]
    proc = subprocess.run(
        cmd + common, cwd=ROOT, env=env() | (extra_env or {}), capture_output=True, text=True, timeout=timeout
    )
    if check and proc.returncode != 0:
        raise AssertionError(
            f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
        )
    # DeepSpeed's shared-memory allreduce buffers (~69 MB a rank) are released, not left in RAM
    assert not glob.glob(f"/dev/shm/deepspeed_allreduce_buffer_*_{port}_*"), "shm buffers left behind"
    return proc


def run_helper(cmd: list[str], timeout: int = 300) -> str:
    """Run a command (e.g. a tests/helpers script) from the repository root; its stdout."""
    proc = subprocess.run(cmd, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout


def read_metrics(output_dir) -> list[dict]:
    with open(Path(output_dir) / "metrics.jsonl") as f:
        return [json.loads(line) for line in f]


def losses(output_dir) -> list[float]:
    return [r["loss"] for r in read_metrics(output_dir) if r["event"] == "train"]


def assert_close_curves(a: list[float], b: list[float], rtol: float = 1e-4):
    assert len(a) == len(b), (len(a), len(b))
    worst = max(abs(x - y) / abs(y) for x, y in zip(a, b))
    assert worst <= rtol, f"max relative loss difference {worst:.2e} > {rtol}\n{a}\n{b}"


def nested_values(x, key: str = "", numbers: bool = False):
    """(key path, value) for every tensor (and with `numbers`, every int/float) nested in a loaded
    checkpoint object: dict keys as /name, list items as [i]."""
    if isinstance(x, torch.Tensor):
        yield key, x
    elif isinstance(x, dict):
        for k, v in x.items():
            yield from nested_values(v, f"{key}/{k}", numbers)
    elif isinstance(x, list | tuple):
        for i, v in enumerate(x):
            yield from nested_values(v, f"{key}[{i}]", numbers)
    elif numbers and isinstance(x, int | float):
        yield key, x


def small_corpus(directory) -> Path:
    """12 short documents of the built-in corpus (400 characters each) as `directory`/small.jsonl: ~60
    train sequences of 33 tokens, so an epoch is a few optimizer steps."""
    from utils.data.sources import resolve_sources

    path = Path(directory) / "small.jsonl"
    docs = [doc[:400] for doc, _ in zip(resolve_sources(["builtin"])[0].documents(), range(12))]
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    return path
