"""The fault paths a real run meets: nothing wrong is trained on or saved, nothing saved is lost.

One non-finite gradient is injected at step NAN_STEP into rank 1's loss (LLAMA_TRAIN_TEST_SPIKE with
factor nan: a bad batch), with clipping off (--grad_clip 0), in the DDP twin, ZeRO-0, ZeRO-2 and
ZeRO-3 (fp32), and in the DDP twin and ZeRO-2 in bf16 (2 ranks, a checkpoint after every step). Every
run skips that update, goes on, and saves and exports only finite tensors; the loss curves of each
ZeRO run and its DDP twin stay identical after the skip (bf16: within bf16's precision).

One single-process run with --async_save (ASYNC_RUN) stops on non-finite steps while a save is still
being written, and is then resumed past its damaged last checkpoint."""

import glob
import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from llama_train.checkpoint.formats import safe_load
from llama_train.checkpoint.resuming import find_resume
from llama_train.checkpoint.store import saved_states, verify_checkpoint
from llama_train.checkpoint.weights import consolidated_state_dict, read_weights
from llama_train.config import build_parser, model_args, parse_args
from llama_train.distributed.ds_config import build_ds_config, load_ds_config
from llama_train.distributed.parallel import Layout
from llama_train.errors import LedgerError
from llama_train.model import ModelArgs
from llama_train.telemetry.ledger import check_against_checkpoints, read_ledger
from llama_train.train.evaluation import RUN_FILE, find_run_record
from tests.test_errors import fail
from tests.trainer_utils import BF16_TWIN_RTOL, ROOT, env, launch, nested_values, read_metrics

pytestmark = pytest.mark.usefixtures("deepspeed_ops")  # tests/conftest.py

NAN_STEP, LAST = 3, 6
COMMON = f"--max_steps {LAST} --grad_clip 0 --save_interval 1 --keep_last 20 --no-hash_checkpoints".split()
BF16 = ["--dtype", "bfloat16"]  # the debug model and 6 steps: cheap where CPU bf16 matmul is slow
KINDS = {
    "ddp": ("ddp", []),
    "zero0": ("deepspeed", ["--deepspeed_config", "ds_configs/zero0.json"]),
    "zero2": ("deepspeed", ["--deepspeed_config", "ds_configs/zero2.json"]),
    "zero3": ("deepspeed", ["--deepspeed_config", "ds_configs/zero3.json"]),
    "ddp_bf16": ("ddp", BF16),
    "zero2_bf16": ("deepspeed", ["--deepspeed_config", "ds_configs/zero2.json", *BF16]),
}
TWIN = {"zero0": "ddp", "zero2": "ddp", "zero3": "ddp", "zero2_bf16": "ddp_bf16"}  # each ZeRO run's DDP twin
HOOKS = {"LLAMA_TRAIN_TEST_SPIKE": f"{NAN_STEP}:1:nan"}


@pytest.fixture(scope="module")
def nan_runs(tmp_path_factory, shared_data):
    root = tmp_path_factory.mktemp("faults")
    out = {}
    for name, (kind, flags) in KINDS.items():
        run = root / name
        proc = launch(kind, [*COMMON, *flags], run, shared_data, extra_env=HOOKS, check=False)
        out[name] = {"dir": run, "proc": proc}
    return out


def nonfinite_tensors(run: Path) -> list[str]:
    bad = []
    for f in sorted(glob.glob(str(run / "checkpoints" / "step_*" / "**" / "*.pt"), recursive=True)):
        if f.endswith("rng_state.pt"):  # RNG states: no floating tensors, and not plain tensors to load
            continue
        for where, t in nested_values(safe_load(f)):  # read as every tool reads them
            if t.is_floating_point() and not torch.isfinite(t).all():
                bad.append(f"{f}{where}")
    for f in glob.glob(str(run / "hf" / "*.safetensors")):
        bad += [f"{f}/{k}" for k, t in safe_load(f).items() if not torch.isfinite(t).all()]
    return bad


@pytest.mark.parametrize("name", KINDS)
def test_nonfinite_update_is_skipped_not_fatal_and_never_saved(nan_runs, name):
    run, proc = nan_runs[name]["dir"], nan_runs[name]["proc"]
    assert proc.returncode == 0, f"{name} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    assert f"step {NAN_STEP}: skipped the update: non-finite gradient norm" in proc.stdout + proc.stderr
    train = [r for r in read_metrics(run) if r["event"] == "train"]
    assert [r["step"] for r in train] == list(range(1, LAST + 1))
    assert train[-1]["skipped_steps"] == 1
    assert len(glob.glob(str(run / "checkpoints" / "step_*"))) == LAST
    assert glob.glob(str(run / "hf" / "*.safetensors"))
    assert nonfinite_tensors(run) == []


@pytest.mark.parametrize("name", TWIN)
def test_loss_curves_stay_identical_across_the_skip(nan_runs, name):
    """ZeRO-0/2/3 against the DDP twin in fp32 (1e-5), ZeRO-2 against it in bf16 (the twins keep
    different things in bf16: BF16_TWIN_RTOL)."""
    curves = {}
    for run in (name, TWIN[name]):
        assert nan_runs[run]["proc"].returncode == 0, run
        curves[run] = [x["loss"] for x in read_metrics(nan_runs[run]["dir"]) if x["event"] == "train"]
    zero, ddp = curves[name], curves[TWIN[name]]
    for curve in (zero, ddp):
        assert math.isnan(curve[NAN_STEP - 1]) and all(
            math.isfinite(x) for i, x in enumerate(curve) if i != NAN_STEP - 1
        )
    rtol = BF16_TWIN_RTOL if "bf16" in name else 1e-5
    for step, (a, b) in enumerate(zip(zero, ddp), 1):
        if step != NAN_STEP:
            assert abs(a - b) <= rtol * abs(b), (name, step, a, b)


def shipped_config_without(section: str, tmp_path) -> str:
    config = json.loads(Path(ROOT / "ds_configs" / "zero2.json").read_text())
    del config[section]
    path = tmp_path / f"no_{section}.json"
    path.write_text(json.dumps(config))
    return str(path)


@pytest.mark.parametrize("dtype,section", [("bfloat16", "bf16"), ("float16", "fp16")])
def test_ds_config_without_precision_block_gets_the_one_the_flag_asks_for(tmp_path, dtype, section):
    path = shipped_config_without(section, tmp_path)
    args = parse_args(build_parser("t", deepspeed=True), ["--deepspeed_config", path, "--dtype", dtype])
    config = build_ds_config(load_ds_config(path), args, model_args(args), Layout(1), dtype)
    assert config[section]["enabled"] is True  # not an fp32 run recorded as bf16/fp16


def test_ds_config_without_optimizer_is_one_error_line_before_any_data_work(tmp_path):
    err = fail(
        "train_deepspeed.py",
        "--deepspeed_config",
        shipped_config_without("optimizer", tmp_path),
        tmp_path=tmp_path,
    )
    assert [line for line in err.splitlines() if line.startswith("error:")] == [
        f'error: {tmp_path}/no_optimizer.json: no "optimizer" block; the engine would be built without one. '
        'Add one as ds_configs/zero2.json has it ("type": "auto", filled from --optimizer; its "params" "auto")'
    ], err
    assert not (tmp_path / "data").exists() and not (tmp_path / "out" / "tokenizer").exists()


def test_a_checkpoint_directory_never_mixes_two_runs_files(tmp_path, shared_data):
    """A killed 4-rank save left step 4's directory with its shards (and a bf16 run's); the 2-rank
    requeue saves step 4 again: the checkpoint holds only its own files, and a stray shard copied into a
    complete checkpoint is not read (the world size and file prefix come from its trainer state)."""
    zero2 = "--deepspeed_config ds_configs/zero2.json --max_steps 4 --save_interval 2 --no-hash_checkpoints".split()
    out = tmp_path / "run"
    launch("deepspeed", [*zero2, "--stop_after_steps", "2"], out, shared_data)
    step2, step4 = out / "checkpoints" / "step_00000002", out / "checkpoints" / "step_00000004"
    shard = "{}zero_pp_rank_{}_mp_rank_00_optim_states.pt"
    step4.mkdir()  # what the killed 4-rank run (and a bf16 one before it) left behind
    for prefix, rank in (("", 2), ("", 3), ("bf16_", 0)):
        shutil.copy(step2 / shard.format("", rank % 2), step4 / shard.format(prefix, rank))
    launch("deepspeed", [*zero2, "--resume", "auto"], out, shared_data)
    assert sorted(p.name for p in step4.iterdir() if "optim_states" in p.name) == [
        shard.format("", 0),
        shard.format("", 1),
    ]
    state = verify_checkpoint(str(step4))
    assert not [f for f in state["files"] if "rank_2" in f or "rank_3" in f or "bf16_" in f]
    before = consolidated_state_dict(str(step4))[0]
    shutil.copy(step4 / shard.format("", 0), step4 / shard.format("", 2))  # a stray copy
    after = consolidated_state_dict(str(step4))[0]
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    exported = read_weights(str(out / "hf"), ModelArgs(**state["model"]))[0]  # written from the engine
    assert all(torch.equal(before[k], exported[k]) for k in exported)


@pytest.fixture(scope="module")
def resumed(nan_runs, tmp_path_factory, shared_data):
    """source -> a new output_dir whose first process resumed the source's step-4 checkpoint (DDP twin)."""
    out = {}
    for source in ("ddp", "zero2"):
        out[source] = tmp_path_factory.mktemp(f"resumed_{source}")
        ckpt = nan_runs[source]["dir"] / "checkpoints" / "step_00000004"
        launch("ddp", [*COMMON, "--resume", str(ckpt)], out[source], shared_data)
    return out


@pytest.mark.parametrize("source", ["ddp", "zero2"])
def test_skipped_steps_survive_a_resume(nan_runs, resumed, source):
    """The skipped-step count goes on from the checkpoint's, natively (DDP -> DDP) and through the
    neutral form (ZeRO-2 -> DDP); the resumed curve is the straight one."""
    resumed = [r for r in read_metrics(resumed[source]) if r["event"] == "train"]
    straight = [r for r in read_metrics(nan_runs["ddp"]["dir"]) if r["event"] == "train"]
    assert [r["step"] for r in resumed] == [5, 6]
    assert [r["skipped_steps"] for r in resumed] == [1, 1]
    for a, b in zip(resumed, straight[4:]):
        assert abs(a["loss"] - b["loss"]) <= 1e-5 * abs(b["loss"])


def test_a_run_whose_first_process_resumed_is_summarisable(resumed):
    """A branch (a new --output_dir started with --resume PATH, as docs/optimizers.md's WSD branch is)
    writes its `config` record, and scripts/summarize_run.py summarises it."""
    run = resumed["ddp"]
    (config,) = [r for r in read_metrics(run) if r["event"] == "config"]
    assert config["strategy"] == "ddp" and config["world_size"] == 2
    cmd = [sys.executable, "scripts/summarize_run.py", str(run), "--goodput"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "strategy        ddp x 2" in proc.stdout and "(step 5) ->" in proc.stdout, proc.stdout


def test_a_branch_runs_export_keeps_its_run_record(resumed):
    """A branch's metrics.jsonl begins with its `resume` record and holds its `config` record second:
    its export still names the run (llama_train_run.json), so scripts/eval_ppl.py finds the eval split
    from the export, the output_dir or a checkpoint, as for any run."""
    run = resumed["ddp"]
    assert read_metrics(run)[0]["event"] == "resume"
    (config,) = [r for r in read_metrics(run) if r["event"] == "config"]
    assert (run / "hf" / RUN_FILE).is_file()
    for where in (run / "hf", run, run / "checkpoints" / f"step_{LAST:08d}"):
        assert find_run_record(str(where)) == config, where


def summarize_ledger(run) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "scripts/summarize_run.py", str(run), "--ledger"]
    return subprocess.run(cmd, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=120)


def test_a_branch_runs_ledger_reads_its_parents_steps_and_passes(nan_runs, resumed):
    """A branch (a new --output_dir whose first process resumed step 4 of another run) is a run of its own
    (its own id): its ledger check reads steps 1-4 from the parent's ledger, beside the checkpoint it
    resumed, and its own steps 5-6, and passes; the parent's ledger given as the branch's is refused as
    another run's."""
    branch, parent = resumed["ddp"], nan_runs["ddp"]["dir"]
    proc = summarize_ledger(branch)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    (first,) = [json.loads(line) for line in (branch / "ledger.jsonl").read_text().splitlines()[:1]]
    (theirs,) = [json.loads(line) for line in (parent / "ledger.jsonl").read_text().splitlines()[:1]]
    assert first["run"] != theirs["run"] and first["parent"]["run"] == theirs["run"]
    assert (
        f"branch of     run {theirs['run']} at its step 4 ({parent}/checkpoints/step_00000004); steps 1-4 from "
        f"its ledger {parent}/ledger.jsonl" in proc.stdout
    ), proc.stdout
    assert "train_ddp.py x2, fresh start, steps 1-4 (run " in proc.stdout
    assert "train_ddp.py x2, resumed at step 4, steps 5-6\n" in proc.stdout and "missing" not in proc.stdout
    theirs_path = str(parent / "ledger.jsonl")  # as summarize_run.py --ledger PATH checks it (exit 2)
    with pytest.raises(LedgerError, match="is the ledger of run .*, not of this output_dir's run"):
        check_against_checkpoints(theirs_path, read_ledger(theirs_path), saved_states(str(branch)))


# --- --async_save: a stop with a save in flight, each checkpoint's own state, a damaged `latest` ---

ASYNC_LAST = 8
ASYNC_FLAGS = (
    f"--max_steps {ASYNC_LAST} --save_interval 1 --keep_last 20 --async_save --max_nonfinite_steps 2 "
    "--skip_loss_zscore 1e9 --spike_window 3 --resume auto"  # the spike guard on, never skipping
).split()
ASYNC_HOOKS = {
    "LLAMA_TRAIN_TEST_SPIKE": "6:0:nan,7:0:nan",  # the second non-finite step in a row stops the run
    "LLAMA_TRAIN_TEST_SAVE_DELAY_AT_STEP": "3,6",  # these saves are still written while training goes on
    "LLAMA_TRAIN_TEST_SAVE_DELAY_S": "2",
}


@pytest.fixture(scope="module")
def async_run(tmp_path_factory, shared_data):
    """One process (`python train_ddp.py`), --async_save, a checkpoint every step; stopped at step 7 by
    --max_nonfinite_steps while step 6's checkpoint is still being written."""
    root = tmp_path_factory.mktemp("async")
    run = root / "run"
    proc = launch("train_ddp.py", ASYNC_FLAGS, run, shared_data, nproc=1, extra_env=ASYNC_HOOKS, check=False)
    (root / "stopped.log").write_text(proc.stdout + proc.stderr)
    return {"dir": run, "stopped": proc}


def test_a_stop_on_nonfinite_steps_finishes_the_async_save_in_flight(async_run):
    """The guard's own stop says the last checkpoint is intact: it is step 6's, written while step 7
    trained, complete and named by `latest`."""
    proc, run = async_run["stopped"], async_run["dir"]
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert [line for line in proc.stderr.splitlines() if line.startswith("error:")] == [
        "error: 2 optimizer steps in a row had non-finite gradients (the last at step 7); stopping. The last "
        "checkpoint is intact: lower --learning_rate or --grad_clip and resume from it"
    ]
    latest = find_resume("auto", str(run))
    assert latest == str(run / "checkpoints" / "step_00000006"), sorted(os.listdir(run / "checkpoints"))
    assert verify_checkpoint(latest)["step"] == 6


def test_each_async_checkpoint_holds_the_spike_window_of_its_own_step(async_run):
    """The trainer state is copied at the save step: step 3's checkpoint, written while step 4 trained,
    holds the spike guard's window of steps 1-3 (its last 3 finite losses), not 2-4."""
    run = async_run["dir"]
    losses = {r["step"]: r["loss"] for r in read_metrics(run) if r["event"] == "train"}
    for step in range(1, 7):
        state = verify_checkpoint(str(run / "checkpoints" / f"step_{step:08d}"))
        finite = [losses[s] for s in range(1, step + 1) if math.isfinite(losses[s])]
        assert state["spike_guard"]["losses"] == finite[-3:], step


def test_resume_auto_falls_back_past_a_damaged_latest_checkpoint(async_run, tmp_path, shared_data):
    """`latest` names a checkpoint that fails its size check (a node crash before its pages reached the
    disk): --resume auto resumes from the newest one that verifies, with one warning line naming the
    one it skipped and why; --resume PATH of the damaged one still refuses it."""
    run = shutil.copytree(async_run["dir"], tmp_path / "run")
    latest = Path(find_resume("auto", str(run)))
    model = latest / "model.pt"
    model.write_bytes(model.read_bytes()[:100])
    previous = int(latest.name.split("_")[1]) - 1
    named = ["--resume", str(latest)]
    refused = launch("train_ddp.py", named, tmp_path / "other", shared_data, nproc=1, check=False)
    assert refused.returncode == 2 and f"{model} is truncated" in refused.stderr, refused.stderr[-2000:]
    proc = launch("train_ddp.py", ASYNC_FLAGS, run, shared_data, nproc=1)
    warnings = [line for line in (proc.stdout + proc.stderr).splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and str(latest) in warnings[0] and "truncated" in warnings[0], warnings
    assert f"step_{previous:08d}" in warnings[0]
    records = read_metrics(run)
    since = max(i for i, r in enumerate(records) if r["event"] == "resume")
    assert records[since]["step"] == previous
    steps = [r["step"] for r in records[since:] if r["event"] == "train"]
    assert steps == list(range(previous + 1, ASYNC_LAST + 1))
    assert verify_checkpoint(find_resume("auto", str(run)))["step"] == ASYNC_LAST


def test_planner_counts_zero1_bf16_full_size_fp32_gradients():
    """ZeRO-1 with bf16 weights accumulates in fp32 (ds_config.precision_defaults), so DeepSpeed 0.19.8
    runs its BF16_Optimizer, which keeps a full-size fp32 gradient buffer (4 bytes x every parameter,
    on every rank); the partition it steps is a view into it."""
    from llama_train.plan.memory import Sharding, transient_buffers

    numels = [1000, 3000]
    got = transient_buffers(Sharding("zero1", stage=1), "bfloat16", numels, 8, 0, "gpu")
    assert sum(b for _, b in got) == 4 * sum(numels), got
    fp32 = transient_buffers(Sharding("zero1", stage=1), "float32", numels, 8, 0, "gpu")
    bucket = 4 * 5e8  # the reduce bucket, DeepSpeed's default size when the config names none
    assert sum(b for _, b in fp32) == 4 * 4000 + 4 * 4000 / 8 + bucket  # full grads + fp32 partition + bucket


def test_compile_time_is_left_out_of_tokens_per_second_once():
    """A compile span is subtracted from the step timer once, even when it started after the point
    the timer moves to (a timer not reset between log lines, --log_interval > 1)."""
    from types import SimpleNamespace

    from llama_train.distributed.compile import CompileClock

    clock, log = CompileClock(False), SimpleNamespace(t0=0.0)
    clock.enabled, clock.reported = True, True  # the spans below stand for dynamo's callbacks
    clock.spans = [(12.0, 22.0)]
    clock.exclude_from(log, 1)
    assert log.t0 == 10.0
    clock.exclude_from(log, 2)  # no compilation in step 2
    assert log.t0 == 10.0
    clock.spans.append((30.0, 31.5))
    clock.exclude_from(log, 3)
    assert log.t0 == 11.5


def test_comm_record_of_a_model_parallel_run_expects_its_data_parallel_groups_bytes():
    """A rank of a tensor/pipeline-parallel run exchanges gradients for the part of the model it holds
    with its data-parallel peers only: tp2 on 2 ranks (dp 1) expects no 2 Psi; tp2 x dp2 expects the
    data-parallel volume of half the model."""
    from llama_train.plan.comm import expected_run_comm_bytes

    record = {"num_params": 1000, "world_size": 2, "dtype": "float32", "strategy": "deepspeed-tp2-zero1"}
    assert expected_run_comm_bytes(1, {**record, "layout": {"tp": 2, "sp": 1, "pp": 1, "dp": 1}}) == {}
    four = {**record, "world_size": 4, "layout": {"tp": 2, "sp": 1, "pp": 1, "dp": 2}}
    assert expected_run_comm_bytes(1, four) == {"reduce_scatter": 500 * 4, "all_gather": 500 * 4}
    ddp = {**record, "strategy": "ddp", "layout": {"tp": 1, "sp": 1, "pp": 1, "dp": 2}}
    assert expected_run_comm_bytes(0, ddp) == {"all_reduce": 2 * 1000 * 4}  # unchanged without model parallel
