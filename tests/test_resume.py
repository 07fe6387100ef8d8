"""Never lose work: exact resume across an epoch boundary, kill -9 mid-save, damaged checkpoints.

A small corpus makes an epoch 3-4 optimizer steps long, so a 10-step run crosses epoch
boundaries (new DistributedSampler shuffle) on both sides of the interruption.
"""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from tests.trainer_utils import BASE_FLAGS, ROOT, deepspeed_launcher, env, free_port, launch, read_metrics
from utils.data.sources import resolve_sources

pytestmark = pytest.mark.usefixtures("deepspeed_ops")  # tests/conftest.py

STEPS = 10


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """~40 documents of the built-in corpus as a .jsonl: a few thousand tokens."""
    path = tmp_path_factory.mktemp("corpus") / "small.jsonl"
    docs = []
    for doc in resolve_sources(["builtin"])[0].documents():
        docs.append(doc[:400])
        if len(docs) == 40:
            break
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    return path


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("data")


def flags(corpus, *extra: str) -> list[str]:
    """The runs of this module; `extra`: command-line strings added at the end."""
    common = f"--data_split 90,10 --accumulation_steps 2 --max_steps {STEPS}"
    return ["--data_path", str(corpus), *common.split(), *" ".join(extra).split()]


def train_records(out) -> list[dict]:
    return [r for r in read_metrics(out) if r["event"] == "train"]


ZERO2 = "--deepspeed_config ds_configs/zero2.json"


def trainer(kind: str) -> tuple[str, str]:
    return ("deepspeed", ZERO2) if kind == "deepspeed" else ("ddp", "")


@pytest.mark.parametrize("kind", ["deepspeed", "ddp"])
def test_stop_and_resume_gives_identical_losses(tmp_path, corpus, data_dir, kind):
    launcher, extra = trainer(kind)
    straight, split = tmp_path / "straight", tmp_path / "split"
    launch(launcher, flags(corpus, extra), straight, data_dir)
    first = launch(launcher, flags(corpus, extra, "--stop_after_steps 5"), split, data_dir)
    assert "stopped after step 5" in first.stdout + first.stderr
    assert not (split / "hf").exists()  # an interrupted run does not export
    launch(launcher, flags(corpus, extra, "--resume auto"), split, data_dir)

    want, got = train_records(straight), train_records(split)
    assert [r["step"] for r in got] == list(range(1, STEPS + 1))
    # bitwise: same data position, sampler epoch, optimizer/LR state and RNG after the resume
    assert [r["loss"] for r in got] == [r["loss"] for r in want]
    assert [r["lr"] for r in got] == [r["lr"] for r in want]
    assert [r["grad_norm"] for r in got] == [r["grad_norm"] for r in want]
    evals = [r["eval_loss"] for r in read_metrics(split) if r["event"] == "eval"]
    assert evals[-1] == [r["eval_loss"] for r in read_metrics(straight) if r["event"] == "eval"][-1]


def test_kill_during_save_keeps_previous_checkpoint(tmp_path, corpus, data_dir):
    """kill -9 while step 4's checkpoint is half written: `latest` still names step 2, and
    `--resume auto` continues from there to the same final losses as an uninterrupted run."""
    out, straight = tmp_path / "killed", tmp_path / "straight"
    launch("deepspeed", flags(corpus, ZERO2), straight, data_dir)
    launcher = [*deepspeed_launcher(2, free_port()), "train_deepspeed.py"]
    paths = ["--data_output_path", str(data_dir), "--output_dir", str(out)]
    cmd = [*launcher, *BASE_FLAGS, *flags(corpus, ZERO2, "--save_interval 2"), *paths]
    e = env() | {"LLAMA_TRAIN_TEST_SAVE_DELAY_AT_STEP": "4", "LLAMA_TRAIN_TEST_SAVE_DELAY_S": "600"}
    quiet = {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL}
    proc = subprocess.Popen(cmd, cwd=ROOT, env=e, start_new_session=True, **quiet)
    shard_dir = out / "checkpoints" / "step_00000004"
    deadline = time.time() + 300
    while (
        not (shard_dir.exists() and any(shard_dir.iterdir()))
        and proc.poll() is None
        and time.time() < deadline
    ):
        time.sleep(0.2)
    time.sleep(1.0)  # inside the injected delay: shards on disk, checkpoint not complete
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert (out / "checkpoints" / "latest").read_text().strip() == "step_00000002"
    assert not (shard_dir / "trainer_state.json").exists()

    launch("deepspeed", flags(corpus, ZERO2, "--save_interval 2 --resume auto"), out, data_dir)
    resumed = train_records(out)[-(STEPS - 2) :]  # the killed run logged steps 1-4 before
    assert [r["step"] for r in resumed] == list(range(3, STEPS + 1))
    assert [r["loss"] for r in resumed] == [r["loss"] for r in train_records(straight)][2:]
    kept = sorted(p.name for p in (out / "checkpoints").iterdir() if p.name.startswith("step_"))
    assert kept == ["step_00000006", "step_00000008", "step_00000010"]  # --keep_last 3


def _resume_error(tmp_path, corpus, data_dir, damage) -> str:
    out = tmp_path / "run"
    launch("ddp", flags(corpus, "--max_steps 2"), out, data_dir)
    damage(out / "checkpoints" / "step_00000002")
    proc = launch(
        "train_ddp.py", flags(corpus, "--max_steps 4 --resume auto"), out, data_dir, nproc=1, check=False
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    return proc.stderr


def test_truncated_checkpoint_file_is_named(tmp_path, corpus, data_dir):
    def truncate(ckpt):
        path = ckpt / "optimizer.pt"
        path.write_bytes(path.read_bytes()[:100])

    err = _resume_error(tmp_path, corpus, data_dir, truncate)
    assert "optimizer.pt is truncated or missing (100 of" in err


def test_corrupted_checkpoint_file_is_named(tmp_path, corpus, data_dir):
    def flip(ckpt):
        path = ckpt / "model.pt"
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0xFF
        path.write_bytes(bytes(data))

    err = _resume_error(tmp_path, corpus, data_dir, flip)
    assert "model.pt is corrupted" in err


def test_resume_with_other_world_size_is_refused(tmp_path, corpus, data_dir):
    err = _resume_error(tmp_path, corpus, data_dir, lambda ckpt: None)
    assert "world_size: checkpoint 2, now 1" in err


@pytest.mark.parametrize("script", ["train_ddp.py", "train_deepspeed.py"])
def test_sigterm_finishes_step_saves_and_exits_zero(tmp_path, corpus, data_dir, script):
    """Preemption: SIGTERM mid-run -> the step finishes, a checkpoint is saved, exit 0; the
    saved step is the last logged one, and `latest` names it."""
    out = tmp_path / "run"
    paths = ["--data_output_path", str(data_dir), "--output_dir", str(out)]
    cmd = [sys.executable, script, *BASE_FLAGS, *flags(corpus, "--max_steps 100000"), *paths]
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    metrics = out / "metrics.jsonl"
    deadline = time.time() + 300
    while (not metrics.exists() or metrics.read_text().count('"train"') < 3) and time.time() < deadline:
        assert proc.poll() is None, proc.stdout.read()[-3000:]
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    output = proc.communicate(timeout=300)[0]
    assert proc.returncode == 0, output[-3000:]
    assert "SIGTERM: finishing this step" in output and "checkpoint saved" in output
    last = train_records(out)[-1]["step"]
    assert (out / "checkpoints" / "latest").read_text().strip() == f"step_{last:08d}"
