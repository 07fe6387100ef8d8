"""`make bench-gpu` (scripts/bench_gpu.py) on CPU with its tiny presets, from a venv built as `make setup`
builds one on a GPU image (SYSTEM_TORCH=1): the packages reached through a .pth, no torchrun or
deepspeed in its bin/. Four of its rows, launched as on a GPU (one rank each: ZeRO-2 and DDP, the
profiled 1b row, an A/B variant of a DeepSpeed config), and the report it writes. The budget's order,
skips and second pass, the rows that change a flag and the step time of a run whose every step is
probed are checked without launching."""

import json
import os
import site
import subprocess
import sys
from dataclasses import replace

import pytest

from llama_train.bench.gpu import (
    COMPILE_S,
    MARGIN_S,
    PRIOR_S,
    ROWS,
    expected_s,
    failed,
    merge_runs,
    row_setup,
    run_rows,
)
from llama_train.bench.gpu_report import GOALS
from llama_train.bench.matrix import Setup, trainer_flags
from llama_train.bench.runs import read_records, step_times
from tests.trainer_utils import ROOT, env

pytestmark = pytest.mark.usefixtures("deepspeed_ops")  # tests/conftest.py

CHOSEN = ["zero2", "ddp", "1b zero2", "zero2 with dim² buckets"]


def system_venv(root) -> str:
    """A venv like the one `make setup` makes on a GPU image: this Python's site-packages (torch,
    DeepSpeed, ...) through a .pth, the checkout through another (what pip install -e adds), nothing
    installed into it and no pip: its bin/ holds python only. Its python's path."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root)], check=True, timeout=120)
    python = str(root / "bin" / "python")
    where = [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]
    purelib = subprocess.run(where, capture_output=True, text=True, check=True).stdout.strip()
    with open(os.path.join(purelib, "_system_site.pth"), "w") as f:
        f.write("\n".join(site.getsitepackages()) + "\n")
    with open(os.path.join(purelib, "_llama_train.pth"), "w") as f:
        f.write(f"{ROOT}\n")
    return python


@pytest.fixture(scope="module")
def bench(tmp_path_factory, shared_data):
    venv, out = tmp_path_factory.mktemp("sysvenv"), tmp_path_factory.mktemp("bench_gpu")
    python = system_venv(venv)
    assert not {"torchrun", "deepspeed", "pip"} & set(os.listdir(venv / "bin"))
    cmd = [
        python, "scripts/bench_gpu.py", "--tiny", "--rows", ",".join(CHOSEN), "--output_dir", str(out),
        "--data_output_path", str(shared_data), "--budget_s", "1200", "--passes", "1",
    ]  # fmt: skip
    path = os.pathsep.join(
        p for p in os.environ["PATH"].split(os.pathsep) if not os.path.exists(f"{p}/torchrun")
    )
    proc = subprocess.run(
        cmd, cwd=ROOT, env=env() | {"PATH": path}, capture_output=True, text=True, timeout=1500
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out, json.loads((out / "results.json").read_text()), (out / "results.md").read_text(), python


def test_rows_run_in_order_from_a_venv_without_launcher_scripts(bench):
    out, results, _, python = bench
    rows = {r["strategy"]: r for r in results["rows"]}
    assert [r["strategy"] for r in results["rows"]] == [r.name for r in ROWS if r.name in CHOSEN]
    assert all(r.get("error") is None and r["tokens_per_s"] > 0 and r["mfu"] > 0 for r in rows.values())
    assert rows["zero2"]["preset"] == "debug" and rows["1b zero2"]["preset"] == "tiny"
    assert rows["zero2"]["trainer_strategy"] == "deepspeed-zero2" and rows["ddp"]["trainer_strategy"] == "ddp"
    assert rows["zero2 with dim² buckets"]["base"] == "zero2"
    config = json.loads((out / "configs" / "zero2_with_dim2_buckets.json").read_text())
    assert config["zero_optimization"]["reduce_bucket_size"] == 64 * 64  # the debug preset's dim²
    assert results["torch"] and results["deepspeed"] and results["commit"] and results["device"] == "cpu"
    for name in (
        "ddp",
        "1b zero2",
    ):  # python -m torch.distributed.run / deepspeed.launcher.runner, the venv's
        command = (out / rows[name]["run_dir"] / "command.txt").read_text().split()
        assert command[command.index("-m") - 1] == python and command[0] in (python, "env"), command


def test_runs_log_every_few_steps_and_write_no_final_checkpoint(bench):
    out, results, _, _ = bench
    for r in results["rows"]:
        records = read_records(out / r["run_dir"] / "metrics.jsonl")
        train = [x for x in records if x["event"] == "train"]
        assert [x["step"] for x in train] == [2, 4, 6]  # --log_interval 2: the host waits every other step
        assert r["timed_from"] == "unprobed steps" and r["timed_steps"] == 2
        assert (
            not [x for x in records if x["event"] == "save"]
            and not (out / r["run_dir"] / "checkpoints").exists()
        )
    tiny_1b = json.loads((out / "runs" / "1b_zero2_w1_r0" / "metrics.jsonl").read_text().splitlines()[0])
    assert tiny_1b["args"]["accumulation_steps"] == 2  # the anchors' accumulation, shrunk


def test_report_has_the_tables_goals_time_and_profile(bench):
    _, results, text, _ = bench
    assert "| zero2 | debug |" in text and "| ddp | debug |" in text and "| 1b zero2 | tiny |" in text
    assert "| zero2 with dim² buckets | zero2 |" in text
    assert "- 125m ZeRO-2 step time / DDP's: **" in text  # measured: both rows ran
    assert "- 125m DDP --compile MFU: not measured (ddp with --compile: row not run)" in text
    assert "Top cpu_ops of the profiled step" in text and "Attention cpu_ops (SDPA's choice): " in text
    assert "aten::" in text.split("## Profile")[1]
    assert f"= {results['total_s']:.0f} s." in text and results["budget_s"] == 1200


def test_the_goals_rows_run_first():
    goals = {name for name, *_ in GOALS}
    assert {r.name for r in ROWS[: len(goals) + 1]} == goals | {"ddp"}  # the ZeRO-2/DDP ratio needs both
    assert [r.name for r in ROWS[:3]] == ["zero2", "ddp", "1b zero2"]


def test_a_compiled_rows_estimate_includes_its_compilation():
    (compiled,) = [r for r in ROWS if r.name == "ddp with --compile"]
    assert expected_s(compiled, []) == PRIOR_S["125m"] + COMPILE_S["125m"]
    done = [{"strategy": "zero2", "size": "125m", "flags": [], "wall_s": 20.0}]
    assert expected_s(compiled, done) == 20.0 + COMPILE_S["125m"]
    done.append({"strategy": "1b zero2 with --compile", "size": "1b", "flags": ["--compile"], "wall_s": 99.0})
    assert (
        expected_s(compiled, done) == 20.0 + COMPILE_S["125m"]
    )  # another size's compilation: not this one's
    done.append({"strategy": compiled.name, "size": "125m", "flags": ["--compile"], "wall_s": 50.0})
    assert expected_s(compiled, done) == 50.0  # its own run


class Clock:
    """Seconds that pass only when a run takes them (the runs below take `walls[name]` each)."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def fake_runs(clock: Clock, walls: dict, hang: str | None = None):
    """A stand-in for run_one that returns each run's row at once, having advanced `clock` by the
    wall time the row takes; `hang` never ends, so the budget's timeout kills it (exit code -9)."""

    def run(strategy, world, repeat, setup):
        name = strategy.name
        took = setup.timeout if name == hang else walls[name]
        clock.now += took
        row = {"strategy": name, "world_size": 1, "repeat": repeat, "wall_s": took}
        if name == hang:
            return {**row, "error": f"exit code -9: benchmark: killed after --timeout {setup.timeout} s"}
        step = 0.01 * (1 + repeat)
        return {**row, "step_time_s": step, "tokens_per_s": 1 / step, "tokens_per_s_per_device": 1 / step,
                "flops_per_token": 1.0, "peak_flops": 1.0, "peak_mem_bytes": 1, "mfu": 0.0}  # fmt: skip

    return run


def test_the_budget_skips_what_it_cannot_hold_and_a_second_pass_repeats_the_rest(tmp_path):
    """Rows of 40 s in a 200 s budget: the goals' first three run, the compiled one (40 + 60 s expected)
    does not start with 80 s left, the next eager row does; the second pass repeats the first,
    giving its spread; a row still running when the budget ends is a skip, and none of it a failure."""
    rows = [r for r in ROWS if r.name in ("zero2", "ddp", "1b zero2", "ddp with --compile", "zero1")]
    clock, walls = Clock(), {"zero2": 40.0, "ddp": 40.0, "1b_zero2": 40.0, "zero1": 40.0}
    runs = run_rows(rows, Setup(output_dir=str(tmp_path)), True, 200.0, say=lambda _: None,
                    run=fake_runs(clock, walls), clock=clock)  # fmt: skip
    order = [(r["strategy"], r.get("repeat")) for r in runs]
    assert order == [("zero2", 0), ("ddp", 0), ("1b zero2", 0), ("ddp with --compile", None), ("zero1", 0)]
    (skip,) = [r for r in runs if r.get("error")]
    assert skip["error"] == "skipped: expected 100 s + 30 s, 80 s of the 200 s budget left" and not failed(
        runs
    )
    assert MARGIN_S == 30.0 and clock.now == 160.0  # 40 s left: no second pass fits

    clock = Clock()
    runs = run_rows(rows[:2], Setup(output_dir=str(tmp_path)), True, 1000.0, say=lambda _: None,
                    run=fake_runs(clock, walls), clock=clock)  # fmt: skip
    merged = merge_runs(rows[:2], runs)
    assert [(r["strategy"], r["repeat"]) for r in runs] == [
        ("zero2", 0),
        ("ddp", 0),
        ("zero2", 1),
        ("ddp", 1),
    ]
    assert [r["runs"] for r in merged] == [2, 2] and merged[0]["step_time_s"] == pytest.approx(0.015)
    assert merged[0]["spread"] == pytest.approx(0.01 / 0.015)

    clock = Clock()
    runs = run_rows(rows[:2], Setup(output_dir=str(tmp_path)), True, 110.0, say=lambda _: None,
                    run=fake_runs(clock, walls, hang="ddp"), clock=clock)  # fmt: skip
    assert runs[1]["error"] == "skipped: the budget ended 70 s into it" and not failed(runs)
    assert failed([{**runs[1], "error": "exit code 1: out of memory"}])


def test_a_row_flag_comes_last_and_an_all_probed_run_is_timed_from_its_probed_steps(tmp_path):
    (row,) = [r for r in ROWS if r.name == "zero2 with probe every step"]
    strategy, setup = row_setup(row, Setup(output_dir=str(tmp_path)), tiny=True)
    flags = trainer_flags(setup, tmp_path)
    assert flags[-2:] == ["--probe_interval", "1"] and strategy.ds_config == "ds_configs/zero2.json"
    assert "--no_final_checkpoint" in flags and flags[flags.index("--log_interval") + 1] == "2"
    records = [{"event": "train", "step": s, "step_time_s": 9.0, "timed_steps": 0} for s in (1, 2, 3)]
    records += [{"event": "timing", "step": s, "wall_s": s / 10, "probe_s": 0.01} for s in (1, 2, 3)]
    times, source = step_times(records, warmup=1)
    assert times == pytest.approx([0.21, 0.31]) and source == "probed steps"
    (today,) = [r for r in ROWS if r.name == "1b zero2 at 4 x 2048"]
    _, setup = row_setup(today, replace(Setup(), output_dir=str(tmp_path)), tiny=False)
    flags = trainer_flags(setup, tmp_path)
    assert flags[flags.index("--accumulation_steps") + 1] == "4" and flags[-4:] == [
        "--batch_size", "4", "--accumulation_steps", "1"
    ]  # fmt: skip


def test_a_row_that_would_pass_the_budget_is_skipped(tmp_path):
    rows = run_rows(ROWS[:2], Setup(output_dir=str(tmp_path)), tiny=True, budget_s=1.0, say=lambda _: None)
    assert [r["error"] for r in rows] == ["skipped: expected 45 s + 30 s, 1 s of the 1 s budget left"] * 2
