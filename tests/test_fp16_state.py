"""fp16 state survives (issue 24, item 7): a spike skip leaves the loss scaler as a kept step would, in
both trainers; moves between strategies carry the scaler through the neutral form (ZeRO-2 -> DDP,
ZeRO-2 -> ZeRO-1, DDP -> ZeRO-2); a checkpoint whose every step overflowed moves to ZeRO-1.

DeepSpeed's real fp16 optimizers and dynamic loss scaler run on the CPU accelerator behind the test
switch LLAMA_TRAIN_TEST_CPU_FP16=1 (ds_compat.allow_cpu_fp16_for_tests): only its fp16 check is bypassed.
One process each (no launcher), debug model: four short launches share the module fixture.

Run A (ZeRO-2, shipped zero2.json: hysteresis 2) gets NaN losses at steps 1-2 (two overflows: the
scale halves once, 65536 -> 32768, no AdamW state yet) and a x2 loss spike at step 5, which the spike
guard skips. Run B (the DDP twin) resumes A's step-2 checkpoint and meets the same spike at step 5.
Run C (ZeRO-1) resumes A's step-2 checkpoint; run D (ZeRO-2) resumes B's last one. Run E (FSDP2, 2
ranks under torchrun) gets a NaN loss on rank 1 at every step from NAN_FROM on."""

import re

import pytest

from llama_train.checkpoint.formats import neutral_loss_scale, safe_load
from llama_train.telemetry.ledger import ledger_report, read_ledger, report_lines
from tests.trainer_utils import launch, read_metrics

pytestmark = pytest.mark.usefixtures("deepspeed_ops")  # tests/conftest.py

SPIKE, LAST = 5, 6
NAN_FROM = 2  # run E: rank 1's loss is NaN from this step on
FP16 = "--dtype float16 --save_interval 1 --keep_last 20 --no-hash_checkpoints --no_export".split()
GUARD = "--spike_window 2 --skip_loss_zscore 20".split()
ZERO = {k: ["--deepspeed_config", f"ds_configs/zero{k}.json"] for k in (1, 2)}
CPU_FP16 = {"LLAMA_TRAIN_TEST_CPU_FP16": "1"}


def step_dir(run, step: int):
    return run / "checkpoints" / f"step_{step:08d}"


def saved_scale(run, step: int) -> dict:
    """The loss scaler a checkpoint holds, in the neutral form, whichever trainer wrote it."""
    ckpt = step_dir(run, step)
    if (ckpt / "scaler.pt").exists():
        return neutral_loss_scale(safe_load(str(ckpt / "scaler.pt")))
    shard = safe_load(str(ckpt / "zero_pp_rank_0_mp_rank_00_optim_states.pt"))
    return neutral_loss_scale(shard["optimizer_state_dict"]["loss_scaler"])


def resumed_scale(proc) -> float:
    (scale,) = re.findall(r"^resumed from .*; fp16 loss scale (\S+)\)", proc.stdout, re.M)
    return float(scale)


@pytest.fixture(scope="module")
def fp16_runs(tmp_path_factory, shared_data):
    root = tmp_path_factory.mktemp("fp16")
    runs = {}

    def run(name, script, flags, spikes=""):
        hooks = {**CPU_FP16, "LLAMA_TRAIN_TEST_SPIKE": spikes}
        proc = launch(script, [*FP16, *flags], root / name, shared_data, extra_env=hooks)
        runs[name] = {"dir": root / name, "proc": proc}

    a_spikes = f"1:0:nan,2:0:nan,{SPIKE}:0:2"
    run("A", "train_deepspeed.py", [*ZERO[2], *GUARD, "--max_steps", str(LAST)], a_spikes)
    resume_a = ["--resume", str(step_dir(root / "A", 2))]
    run("B", "train_ddp.py", [*GUARD, *resume_a, "--max_steps", str(LAST)], f"{SPIKE}:0:2")
    run("C", "train_deepspeed.py", [*ZERO[1], *resume_a, "--max_steps", "3"])
    resume_b = ["--resume", str(step_dir(root / "B", LAST))]
    run("D", "train_deepspeed.py", [*ZERO[2], *resume_b, "--max_steps", str(LAST + 1)])
    nans = ",".join(f"{s}:1:nan" for s in range(NAN_FROM, LAST + 1))
    hooks = {**CPU_FP16, "LLAMA_TRAIN_TEST_SPIKE": nans}
    e_flags = [*FP16, "--fsdp", "--max_steps", str(LAST), "--max_nonfinite_steps", "3"]
    proc = launch("ddp", e_flags, root / "E", shared_data, extra_env=hooks, check=False)
    runs["E"] = {"dir": root / "E", "proc": proc}
    return runs


@pytest.mark.parametrize("name", ["A", "B"])
def test_a_spike_skip_leaves_the_fp16_loss_scale_as_it_was(fp16_runs, name):
    run, out = fp16_runs[name]["dir"], fp16_runs[name]["proc"].stdout
    assert f"step {SPIKE}: skipped the update: loss" in out, out[-3000:]
    before, after = saved_scale(run, SPIKE - 1), saved_scale(run, SPIKE)
    assert before["scale"] == 32768  # A's two overflows halved it once (hysteresis 2)
    # a kept step for the scaler: same scale, one more good step, DeepSpeed's hysteresis not spent
    assert after == {**before, "good_steps": before["good_steps"] + 1}
    train = {r["step"]: r for r in read_metrics(run) if r["event"] == "train"}
    assert train[SPIKE + 1]["loss"] < train[SPIKE]["loss"] / 1.5  # the spike was not trained on


@pytest.mark.parametrize("name", ["A", "B"])
def test_the_ledger_names_the_samples_of_skipped_updates_as_read_not_applied(fp16_runs, name):
    """Run A's updates at steps 1-2 (NaN losses: fp16 overflows, DeepSpeed ZeRO-2) and at step 5 (the spike
    guard) were left out, and run B's (the DDP twin, a branch from A's step 2) at step 5: the sample
    ledger names those steps' samples as read but not applied, and the verdict counts them out."""
    run = fp16_runs[name]["dir"]
    records = read_ledger(str(run / "ledger.jsonl"))
    report = ledger_report(records, [r for r in records if r["event"] == "start"][-1]["run"])
    lines = report_lines(report)
    assert [line.split(" sample(s): ")[0] for line in lines if line.startswith("  not applied")] == [
        "  not applied   steps 1-2: 8",
        f"  not applied   step {SPIKE}: 4",
    ], lines
    assert lines[-1] == (
        f"verdict         every sample up to step {LAST} seen exactly once, applied exactly once but the 12 of "
        f"steps 1-2, {SPIKE} (updates skipped, above): 12 of 24 samples applied"
    ), lines


def test_moves_between_strategies_carry_the_fp16_loss_scaler(fp16_runs):
    a, b = fp16_runs["A"]["dir"], fp16_runs["B"]["dir"]
    assert saved_scale(a, 2)["scale"] == 32768  # not the 65536 every fresh scaler starts from
    assert resumed_scale(fp16_runs["B"]["proc"]) == 32768  # ZeRO-2 -> DDP
    assert resumed_scale(fp16_runs["C"]["proc"]) == 32768  # ZeRO-2 -> ZeRO-1
    assert saved_scale(fp16_runs["C"]["dir"], 3)["hysteresis"] == saved_scale(a, 3)["hysteresis"]
    assert resumed_scale(fp16_runs["D"]["proc"]) == saved_scale(b, LAST)["scale"]  # DDP -> ZeRO-2
    assert (
        saved_scale(fp16_runs["D"]["dir"], LAST + 1)["good_steps"] == saved_scale(b, LAST)["good_steps"] + 1
    )


def test_a_checkpoint_whose_every_step_overflowed_moves_to_zero1(fp16_runs):
    a, c = fp16_runs["A"], fp16_runs["C"]
    shard = safe_load(str(step_dir(a["dir"], 2) / "zero_pp_rank_0_mp_rank_00_optim_states.pt"))
    assert shard["optimizer_state_dict"]["base_optimizer_state"]["state"] == {}  # no AdamW state yet
    assert "KeyError" not in c["proc"].stderr
    train = [r for r in read_metrics(c["dir"]) if r["event"] == "train"]
    assert [r["step"] for r in train] == [3]
    (a3,) = [r["loss"] for r in read_metrics(a["dir"]) if r["event"] == "train" and r["step"] == 3]
    assert abs(train[0]["loss"] - a3) < 1e-2  # the same weights (never updated) and batch as A's step 3


def test_a_persistent_nan_loss_in_fp16_stops_the_run(fp16_runs):
    """A non-finite loss is not the loss scaler's to absorb: it counts towards --max_nonfinite_steps
    with the usual skip line in fp16 too, in DeepSpeed (run A: steps 1-2) and in FSDP2 (run E: rank 1's
    loss NaN from step 2 on stops the run at step 4, before saving it; before: it trained on, scale
    halving, and exited 0)."""
    out = fp16_runs["A"]["proc"].stdout
    for step in (1, 2):
        assert f"step {step}: skipped the update: non-finite gradient norm ({step} in a row;" in out, out[
            -3000:
        ]
    proc, run = fp16_runs["E"]["proc"], fp16_runs["E"]["dir"]
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]  # torchrun: a rank exited 2
    errors = {line for line in proc.stderr.splitlines() if line.startswith("error:")}
    assert errors == {
        f"error: 3 optimizer steps in a row had non-finite gradients (the last at step {NAN_FROM + 2}); "
        "stopping. The last checkpoint is intact: lower --learning_rate or --grad_clip and resume from it"
    }, proc.stderr[-3000:]
    for step in range(NAN_FROM, NAN_FROM + 3):
        assert (
            f"step {step}: skipped the update: non-finite gradient norm ({step - NAN_FROM + 1} in a row;"
            in proc.stdout
        )
    assert (run / "checkpoints" / "latest").read_text().strip() == f"step_{NAN_FROM + 1:08d}"
    assert saved_scale(run, NAN_FROM + 1)["scale"] == 2.0**14  # the scaler's own halving, twice
