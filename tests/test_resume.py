"""Never lose work, and take it anywhere: exact resume, moves across strategies and world sizes,
--init_from, damaged checkpoints, kill -9 mid-save, preemption through the launchers.

One straight 10-step run per strategy (2 ranks, a checkpoint at steps 5 and 10) is at once the
reference curve and the checkpoint the other runs continue from, so most tests cost one launch.
The corpus is small: an epoch is 3 optimizer steps of 16 sequences, so every run crosses epoch
boundaries (a new shuffle) before and after the resume.
"""

import argparse
import hashlib
import json
import os
import pickle
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch

from llama_train import gpu
from llama_train.checkpoint.resuming import find_resume
from llama_train.errors import CheckpointError
from tests.trainer_utils import (
    BASE_FLAGS,
    ROOT,
    assert_close_curves,
    deepspeed_launcher,
    env,
    free_port,
    launch,
    read_metrics,
    run_helper,
    small_corpus,
)

pytestmark = pytest.mark.usefixtures("deepspeed_ops")  # tests/conftest.py

STEPS = 10
DUMP = "LLAMA_TRAIN_DUMP_STATE"  # the trainers write the engine's gathered state at saves and resumes
MOVE_RTOL = 1e-5  # another world size sums the same gradients in another order


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return small_corpus(tmp_path_factory.mktemp("corpus"))


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("data")


def flags(corpus, *extra: str) -> list[str]:
    """The runs of this module (global batch 4 x 2 x 2 = 16); `extra`: strings added at the end."""
    common = f"--data_split 90,10 --accumulation_steps 2 --max_steps {STEPS}"
    return ["--data_path", str(corpus), *common.split(), *" ".join(extra).split()]


def strategy_flags(name: str) -> str:
    return "" if name == "ddp" else f"--deepspeed_config ds_configs/{name}.json"


def launcher_of(name: str, nproc: int) -> str:
    """2 ranks: the user's launcher; 1: the bare script, as `python train_*.py`."""
    if nproc == 1:
        return "train_ddp.py" if name == "ddp" else "train_deepspeed.py"
    return "ddp" if name == "ddp" else "deepspeed"


def train_records(out) -> list[dict]:
    return [r for r in read_metrics(out) if r["event"] == "train"]


def checkpoint(out, step: int) -> Path:
    return Path(out) / "checkpoints" / f"step_{step:08d}"


@pytest.fixture(scope="module")
def straight(tmp_path_factory, corpus, data_dir):
    """name -> output_dir of its straight run (2 ranks, 10 steps, checkpoints at 5 and 10, the
    engine state dumped at each save), launched on first use."""
    runs = {}

    def get(name: str) -> Path:
        if name not in runs:
            out = tmp_path_factory.mktemp(f"straight_{name}")
            extra = flags(
                corpus, strategy_flags(name), "--save_interval 5 --resume auto"
            )  # nothing there yet
            proc = launch(launcher_of(name, 2), extra, out, data_dir, extra_env={DUMP: str(out / "dumps")})
            (out / "launch.log").write_text(proc.stdout + proc.stderr)
            runs[name] = out
        return runs[name]

    return get


def tree_digest(path: Path) -> str:
    h = hashlib.sha256()
    for f in sorted(p for p in path.rglob("*") if p.is_file()):
        h.update(f.relative_to(path).as_posix().encode() + f.read_bytes())
    return h.hexdigest()


# --- resuming: any other layout within float summation order (the same layout bit for bit: the
# preemption tests below resume it) ---


def test_resume_auto_starts_fresh_and_a_run_dir_resumes_from_its_latest(straight):
    """`--resume auto` on a new output_dir says it starts fresh and trains from step 1; `--resume
    OUTPUT_DIR` means that run's `latest` checkpoint; anything else is named."""
    out = straight("ddp")
    assert f"no checkpoint in {out / 'checkpoints'}, starting fresh" in (out / "launch.log").read_text()
    assert train_records(out)[0]["step"] == 1
    assert find_resume(str(out), "/another/run") == str(checkpoint(out, STEPS))
    with pytest.raises(CheckpointError, match="not a complete checkpoint .* nor a run's output_dir"):
        find_resume(str(out / "dumps"), "/another/run")


MOVES = [  # (from, to, ranks after): 2 ranks -> 1 doubles the accumulation, so the global batch stays
    ("zero2", "ddp", 1),
    ("ddp", "zero3", 2),
    ("zero1", "zero2", 1),
    ("zero3", "zero0", 1),
]


@pytest.mark.parametrize(("src", "dst", "nproc"), MOVES)
def test_a_move_continues_the_curve_and_carries_the_optimizer_state(
    tmp_path, corpus, data_dir, straight, src, dst, nproc
):
    ref, out = straight(src), tmp_path / "moved"
    source = checkpoint(ref, 5)
    digest = tree_digest(source)
    extra = flags(corpus, strategy_flags(dst), f"--accumulation_steps {4 // nproc} --resume {source}")
    proc = launch(
        launcher_of(dst, nproc), extra, out, data_dir, nproc=nproc, extra_env={DUMP: str(out / "dumps")}
    )
    log = proc.stdout + proc.stderr
    assert "converted: fp32 weights, AdamW moments and step, LR schedule" in log
    assert f"x2 ranks (float32) -> {'ddp' if dst == 'ddp' else 'deepspeed-' + dst} x{nproc} rank" in log
    want, got = train_records(ref)[5:], train_records(out)
    assert [r["step"] for r in got] == list(range(6, STEPS + 1))
    assert_close_curves([r["loss"] for r in got], [r["loss"] for r in want], rtol=MOVE_RTOL)
    assert [r["lr"] for r in got] == pytest.approx([r["lr"] for r in want], rel=1e-12)
    # the state the new engine holds is the one the old engine saved, read through each engine's
    # own accessors (DeepSpeed's safe_get_full_fp32_param / safe_get_full_optimizer_state, gathered)
    before, after = (
        torch.load(p, weights_only=True) for p in (ref / "dumps/saved_5.pt", out / "dumps/resumed_5.pt")
    )
    assert set(before) == set(after) and len(before) == 21
    for name, tensors in before.items():
        for key in ("fp32", "exp_avg", "exp_avg_sq"):
            assert torch.equal(after[name][key], tensors[key]), (name, key)
    (record,) = [r for r in read_metrics(out) if r["event"] == "resume"]
    assert record["from"]["world_size"] == 2 and record["to"]["world_size"] == nproc and not record["native"]
    assert tree_digest(source) == digest  # the source checkpoint is only read


def test_our_zero_checkpoint_readers_agree_with_deepspeeds_own_tools(straight, tmp_path):
    """Weights against DeepSpeed's zero_to_fp32, AdamW moments against its ds_to_universal
    converter (which reads our checkpoints: they are saved with the universal checkpoint info)."""
    from deepspeed.checkpoint.ds_to_universal import main as ds_to_universal
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    from llama_train.checkpoint.formats import open_checkpoint
    from llama_train.checkpoint.store import verify_checkpoint

    for name in ("zero2", "zero3"):
        path = checkpoint(straight(name), 5)
        source = open_checkpoint(str(path), verify_checkpoint(str(path)))
        oracle = get_fp32_state_dict_from_zero_checkpoint(str(path.parent), tag=path.name)
        assert all(torch.equal(source.weight(n), oracle[n].float()) for n in source.shapes())
        universal = tmp_path / name / "step_5"
        ds_to_universal(
            argparse.Namespace(
                input_folder=str(path), output_folder=str(universal), num_extract_workers=1,
                num_merge_workers=1, keep_temp_folder=False, strict=True, inject_missing_state=False,
            )
        )  # fmt: skip
        for n, shape in source.shapes().items():
            for key in ("exp_avg", "exp_avg_sq"):
                theirs = torch.load(universal / "zero" / n / f"{key}.pt", weights_only=True)
                theirs = theirs["param"] if isinstance(theirs, dict) else theirs  # ZeRO-3: a bare tensor
                assert torch.equal(source.tensors(n)[key], theirs.float().view(shape)), (name, n, key)


def test_moves_into_offloaded_and_bf16_engines(straight):
    """The engines not launched above: ZeRO-2/3 with the optimizer on the CPU (DeepSpeedCPUAdam,
    which counts steps as an int) and bf16 ZeRO-0/2 (fp32 masters beside bf16 weights). Loaded, each
    holds exactly the checkpoint's state; it steps; DeepSpeed's own save of it reads back the same."""
    out = run_helper([sys.executable, "tests/helpers/move_probe.py", str(checkpoint(straight("zero2"), 5))])
    (line,) = [line for line in out.splitlines() if line.startswith("PROBE ")]
    facts = json.loads(line[len("PROBE ") :])
    assert set(facts) == {"zero2_offload", "zero3_offload", "zero0_bf16", "zero2_bf16"}
    for name, f in facts.items():
        assert f["loaded"] == {"fp32": 0.0, "exp_avg": 0.0, "exp_avg_sq": 0.0}, name
        assert f["step"] == 6 and 0 < f["loss"] < 10, name  # AdamW's count went on from the checkpoint's 5
        assert f["reread"] == {"fp32": 0.0, "exp_avg": 0.0, "exp_avg_sq": 0.0}, name


# --- damaged checkpoints are named, whatever strategy resumes them ---


def _truncate(ckpt: Path):
    path = ckpt / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    path.write_bytes(path.read_bytes()[:100])
    return "zero_pp_rank_1_mp_rank_00_optim_states.pt is truncated or missing (100 of"


def _flip(ckpt: Path):
    path = ckpt / "mp_rank_00_model_states.pt"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    return "mp_rank_00_model_states.pt is corrupted"


def _half_written(ckpt: Path):
    (ckpt / "trainer_state.json").unlink()  # killed before the state that completes it was written
    return "not a complete checkpoint (no trainer_state.json in it"


@pytest.mark.parametrize("damage", [_truncate, _flip, _half_written])
def test_a_damaged_checkpoint_is_named_under_another_strategy(tmp_path, corpus, data_dir, straight, damage):
    ckpt = tmp_path / "copy"
    shutil.copytree(checkpoint(straight("zero2"), 5), ckpt)
    expected = damage(ckpt)
    extra = flags(corpus, f"--accumulation_steps 4 --resume {ckpt}")
    proc = launch("train_ddp.py", extra, tmp_path / "run", data_dir, nproc=1, check=False)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr and expected in proc.stderr


def same_files(a: Path, b: Path):
    """Two checkpoints hold the same files, byte for byte, and the same manifest. RNG states aside: the
    host's Python and torch generators are also drawn from outside training (start-up), so a resumed
    process's differ from a straight run's; nothing in training draws from them (checkpoint.reseed)."""
    names = sorted(p.name for p in a.iterdir())
    assert names == sorted(p.name for p in b.iterdir())
    for name in set(names) - {"trainer_state.json", "rng_state.pt"}:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    files = [json.loads((c / "trainer_state.json").read_text())["files"] for c in (a, b)]
    for f in files:
        f.pop("rng_state.pt")
    assert files[0] == files[1]


def test_kill_during_a_sync_save_keeps_previous_checkpoint(tmp_path, corpus, data_dir, straight):
    """kill -9 while step 4's checkpoint is written by a sync save (the default; the test hook sleeps
    after the files, before trainer_state.json completes it): `latest` still names step 2, and
    `--resume auto` continues from there to the straight run's losses (one process accumulating 4
    micro-batches: the same global batch)."""
    out, one = tmp_path / "killed", flags(corpus, "--accumulation_steps 4 --save_interval 2")
    cmd = [sys.executable, "train_ddp.py", *BASE_FLAGS, *one]
    cmd += ["--data_output_path", str(data_dir), "--output_dir", str(out)]
    e = env() | {"LLAMA_TRAIN_TEST_SAVE_DELAY_AT_STEP": "4", "LLAMA_TRAIN_TEST_SAVE_DELAY_S": "600"}
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=e, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
    )
    try:
        assert any("test hook: sleeping mid-save at step 4" in line for line in proc.stdout)
    finally:
        proc.kill()  # SIGKILL
        proc.wait()
    shard_dir = checkpoint(out, 4).with_name("step_00000004.tmp")
    assert (shard_dir / "model.pt").exists() and not (shard_dir / "trainer_state.json").exists()
    assert (out / "checkpoints" / "latest").read_text().strip() == "step_00000002"
    launch("train_ddp.py", [*one, "--resume", "auto"], out, data_dir, nproc=1)
    resumed = train_records(out)[-(STEPS - 2) :]  # the killed process logged steps 1-4 before
    assert [r["step"] for r in resumed] == list(range(3, STEPS + 1))
    straight_losses = [r["loss"] for r in train_records(straight("ddp"))][2:]
    assert_close_curves([r["loss"] for r in resumed], straight_losses, rtol=MOVE_RTOL)
    assert not shard_dir.exists() and (out / "checkpoints" / "latest").read_text().strip() == "step_00000010"


def test_kill_during_an_async_save_keeps_previous_checkpoint(tmp_path, corpus, data_dir, straight):
    """--async_save, kill -9 while step 4's checkpoint is written in the background (the test hook sleeps
    in the writer thread: shards on disk, no marker) and training has gone on past it: `latest` still
    names step 2, and `--resume auto` continues from there to the same losses as an uninterrupted sync
    run, its final checkpoint the same bytes."""
    out, zero2 = tmp_path / "killed", strategy_flags("zero2") + " --async_save"
    launcher = [*deepspeed_launcher(2, free_port()), "train_deepspeed.py"]
    paths = ["--data_output_path", str(data_dir), "--output_dir", str(out)]
    cmd = [*launcher, *BASE_FLAGS, *flags(corpus, zero2, "--save_interval 2"), *paths]
    e = env() | {"LLAMA_TRAIN_TEST_SAVE_DELAY_AT_STEP": "4", "LLAMA_TRAIN_TEST_SAVE_DELAY_S": "600"}
    quiet = {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL}
    proc = subprocess.Popen(cmd, cwd=ROOT, env=e, start_new_session=True, **quiet)
    shard_dir = checkpoint(out, 4).with_name("step_00000004.tmp")  # written there, renamed when complete
    metrics, deadline = out / "metrics.jsonl", time.time() + 300
    while not (metrics.exists() and '"step": 5,' in metrics.read_text()) and proc.poll() is None:
        assert time.time() < deadline
        time.sleep(0.2)
    time.sleep(1.0)  # the writer threads sleep in the injected delay; the next save (6) waits for them
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert any(shard_dir.iterdir())  # training went on while step 4 was being written
    assert (out / "checkpoints" / "latest").read_text().strip() == "step_00000002"
    assert not (shard_dir / "trainer_state.json").exists() and not checkpoint(out, 4).exists()

    launch("deepspeed", flags(corpus, zero2, "--save_interval 2 --resume auto"), out, data_dir)
    resumed = train_records(out)[-(STEPS - 2) :]  # the killed run logged steps 1-5 (or 6) before
    assert [r["step"] for r in resumed] == list(range(3, STEPS + 1))
    assert [r["loss"] for r in resumed] == [r["loss"] for r in train_records(straight("zero2"))][2:]
    kept = sorted(p.name for p in (out / "checkpoints").iterdir() if p.name.startswith("step_"))
    assert kept == ["step_00000006", "step_00000008", "step_00000010"]  # --keep_last 3
    same_files(checkpoint(out, STEPS), checkpoint(straight("zero2"), STEPS))


# --- starting a new run from existing weights ---


def test_init_from_an_export_starts_where_the_export_ended(tmp_path, corpus, data_dir, straight):
    export = straight("ddp") / "hf"
    proc = launch("ddp", flags(corpus, f"--max_steps 2 --init_from {export}"), tmp_path, data_dir)
    assert f"initialised from HF directory {export}" in proc.stdout + proc.stderr
    evals = {
        out: [r for r in read_metrics(out) if r["event"] == "eval"] for out in (straight("ddp"), tmp_path)
    }
    first = evals[tmp_path][0]
    assert first["step"] == 0  # evaluated before the first step
    assert first["eval_loss"] == pytest.approx(evals[straight("ddp")][-1]["eval_loss"], rel=1e-6)
    assert [r["step"] for r in train_records(tmp_path)] == [1, 2]  # a new run: step 0, fresh schedule


class _Payload:
    """Unpickling this creates a file: what a malicious checkpoint would do with os.system."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_init_from_refuses_a_pickle_that_would_run_code(tmp_path, corpus, data_dir):
    marker, payload = tmp_path / "pwned", tmp_path / "weights.pt"
    with open(payload, "wb") as f:
        pickle.dump({"tok_embeddings.weight": _Payload(str(marker))}, f)
    proc = launch(
        "train_ddp.py",
        flags(corpus, f"--init_from {payload}"),
        tmp_path / "run",
        data_dir,
        nproc=1,
        check=False,
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert f"refused to load {payload}" in proc.stderr
    assert not marker.exists()


# --- preemption: a signal to the launcher, its process group or a rank ---


def _run_until_saving(cmd: list[str], at_step: int = 2):
    """Start `cmd` (a new session) and return once it sleeps inside step `at_step`'s save (a test
    hook), with the processes below it: a signal now arrives mid-run."""
    e = env() | {"LLAMA_TRAIN_TEST_SAVE_DELAY_AT_STEP": str(at_step), "LLAMA_TRAIN_TEST_SAVE_DELAY_S": "2"}
    proc = subprocess.Popen(
        cmd,
        cwd=ROOT,
        env=e,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    output = []
    for line in proc.stdout:
        output.append(line)
        if "test hook: sleeping mid-save" in line:
            return proc, psutil.Process(proc.pid).children(recursive=True), output
    proc.wait()
    raise AssertionError("".join(output)[-3000:])


def _alive(procs) -> list[int]:
    out = []
    for p in procs:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p.pid)
        except psutil.NoSuchProcess:
            pass
    return out


@pytest.mark.parametrize(("name", "how"), [("zero2", "SIGTERM to the launcher"), ("ddp", "Ctrl-C")])
def test_preempting_the_launcher_saves_exits_zero_and_resumes_bitwise(
    tmp_path, corpus, data_dir, straight, name, how
):
    """Through llama_train.launch (what scripts/run_*.sh start): every rank finishes its step, one
    checkpoint is saved, nothing is left running, exit 0; --resume auto (the same layout) gives the
    straight run's losses, LRs, gradient norms, final eval loss and last checkpoint bit for bit."""
    out, port = tmp_path / "run", free_port()
    if name == "ddp":
        launcher = [
            *gpu.launcher("torchrun"),
            "--nproc_per_node",
            "2",
            "--master_port",
            str(port),
            "train_ddp.py",
        ]
    else:
        launcher = [*deepspeed_launcher(2, port), "train_deepspeed.py"]
    paths = ["--data_output_path", str(data_dir), "--output_dir", str(out)]
    mode = "--async_save" if name == "ddp" else ""  # the stop waits for step 2's save in flight
    cmd = [
        sys.executable,
        "-m",
        "llama_train.launch",
        *launcher,
        *BASE_FLAGS,
        *flags(corpus, strategy_flags(name), "--save_interval 2", mode),  # saves do not change the curve
        *paths,
    ]
    proc, below, output = _run_until_saving(cmd)
    if how == "Ctrl-C":
        os.killpg(proc.pid, signal.SIGINT)  # the terminal's foreground process group
    else:
        os.kill(proc.pid, signal.SIGTERM)
    output = "".join(output) + proc.communicate(timeout=300)[0]
    assert proc.returncode == 0, output[-3000:]
    assert not _alive(below), "a process outlived the launcher"
    assert "stopped after step" in output and "send it again" not in output
    assert "[INFO]" not in output  # the front quiets the deepspeed launcher (--log_level=error)
    last = train_records(out)[-1]["step"]
    assert 2 < last < STEPS and (out / "checkpoints" / "latest").read_text().strip() == f"step_{last:08d}"
    assert not (out / "hf").exists()  # an interrupted run does not export

    resume = flags(corpus, strategy_flags(name), "--resume auto", mode)
    resumed = launch(launcher_of(name, 2), resume, out, data_dir)
    assert "(as saved)" in resumed.stdout + resumed.stderr  # the same layout: native, no conversion
    got, want = train_records(out), train_records(straight(name))
    assert [r["step"] for r in got] == list(range(1, STEPS + 1))
    for key in ("loss", "lr", "grad_norm"):  # same data position, sampler epoch, optimizer/LR state, RNG
        assert [r[key] for r in got] == [r[key] for r in want], key
    evals = [
        [r["eval_loss"] for r in read_metrics(o) if r["event"] == "eval"][-1] for o in (straight(name), out)
    ]
    assert evals[0] == evals[1]
    same_files(checkpoint(out, STEPS), checkpoint(straight(name), STEPS))  # --async_save: as the sync run's


def test_a_plain_deepspeed_killed_by_sigterm_leaves_ranks_that_save_and_exit(tmp_path, corpus, data_dir):
    """Without llama_train.launch, SIGTERM kills `deepspeed` at once (143, DeepSpeed's own code);
    its ranks notice their launcher is gone and save and exit instead of training on as orphans."""
    out = tmp_path / "run"
    paths = ["--data_output_path", str(data_dir), "--output_dir", str(out)]
    launcher = [*deepspeed_launcher(2, free_port()), "train_deepspeed.py"]
    extra = flags(corpus, strategy_flags("zero2"), "--max_steps 100000 --save_interval 2")
    cmd = [*launcher, *BASE_FLAGS, *extra, *paths]
    proc, below, _ = _run_until_saving(cmd)
    os.kill(proc.pid, signal.SIGTERM)
    proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGTERM
    deadline = time.time() + 120
    while _alive(below) and time.time() < deadline:
        time.sleep(0.5)
    assert not _alive(below), "ranks trained on as orphans"
    last = train_records(out)[-1]["step"]
    assert (out / "checkpoints" / "latest").read_text().strip() == f"step_{last:08d}"


@pytest.mark.parametrize("script", ["train_ddp.py", "train_deepspeed.py"])
def test_sigterm_finishes_step_saves_and_exits_zero(tmp_path, corpus, data_dir, script):
    """A single process: SIGTERM mid-run -> the step finishes, a checkpoint is saved, exit 0; the
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
