"""`make bench-gpu` (scripts/bench_gpu.py) on CPU with its tiny presets: three of its rows, launched as
on a GPU (one rank each: a strategy, an A/B variant of its DeepSpeed config, the profiled 1b row), and
the report it writes. The budget's skipping, the rows that change a flag and the step time of a run
whose every step is probed are checked without launching."""

import json
import subprocess
import sys

import pytest

from llama_train.bench.gpu import ROWS, row_setup, run_rows
from llama_train.bench.matrix import Setup, trainer_flags
from llama_train.bench.runs import step_times
from tests.trainer_utils import ROOT, env

pytestmark = pytest.mark.usefixtures("deepspeed_ops")  # tests/conftest.py

CHOSEN = ["zero2", "1b zero2", "zero2 with dim² buckets"]


@pytest.fixture(scope="module")
def bench(tmp_path_factory, shared_data):
    out = tmp_path_factory.mktemp("bench_gpu")
    cmd = [
        sys.executable, "scripts/bench_gpu.py", "--tiny", "--rows", ",".join(CHOSEN), "--output_dir", str(out),
        "--data_output_path", str(shared_data), "--budget_s", "1200",
    ]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out, json.loads((out / "results.json").read_text()), (out / "results.md").read_text()


def test_rows_run_in_order_with_their_changes(bench):
    out, results, _ = bench
    rows = {r["strategy"]: r for r in results["rows"]}
    assert [r["strategy"] for r in results["rows"]] == [r.name for r in ROWS if r.name in CHOSEN]
    assert all(r.get("error") is None and r["tokens_per_s"] > 0 and r["mfu"] > 0 for r in rows.values())
    assert rows["zero2"]["preset"] == "debug" and rows["1b zero2"]["preset"] == "tiny"
    assert rows["zero2"]["timed_from"] == "unprobed steps"
    assert rows["zero2 with dim² buckets"]["base"] == "zero2"
    config = json.loads((out / "configs" / "zero2_with_dim2_buckets.json").read_text())
    assert config["zero_optimization"]["reduce_bucket_size"] == 64 * 64  # the debug preset's dim²
    assert results["torch"] and results["deepspeed"] and results["commit"] and results["device"] == "cpu"
    assert (out / rows["1b zero2"]["run_dir"] / "metrics.jsonl").exists()


def test_report_has_the_tables_goals_and_profile(bench):
    _, _, text = bench
    assert "| zero2 | debug |" in text and "| 1b zero2 | tiny |" in text
    assert "| zero2 with dim² buckets | zero2 |" in text
    assert "- 125m ZeRO-2 step time / DDP's: not measured (ddp: row not run)" in text
    assert "Top cpu_ops of the profiled step" in text and "Attention cpu_ops (SDPA's choice): " in text
    assert "aten::" in text.split("## Profile")[1]


def test_a_row_flag_comes_last_and_an_all_probed_run_is_timed_from_its_probed_steps(tmp_path):
    (row,) = [r for r in ROWS if r.name == "zero2 with probe every step"]
    strategy, setup = row_setup(row, Setup(output_dir=str(tmp_path)), tiny=True)
    flags = trainer_flags(setup, tmp_path)
    assert flags[-2:] == ["--probe_interval", "1"] and strategy.ds_config == "ds_configs/zero2.json"
    records = [{"event": "train", "step": s, "step_time_s": 9.0, "timed_steps": 0} for s in (1, 2, 3)]
    records += [{"event": "timing", "step": s, "wall_s": s / 10, "probe_s": 0.01} for s in (1, 2, 3)]
    times, source = step_times(records, warmup=1)
    assert times == pytest.approx([0.21, 0.31]) and source == "probed steps"


def test_a_row_that_would_pass_the_budget_is_skipped(tmp_path):
    rows = run_rows(ROWS[:2], Setup(output_dir=str(tmp_path)), tiny=True, budget_s=1.0, say=lambda _: None)
    assert [r["error"] for r in rows] == ["skipped: the 1 s budget"] * 2
