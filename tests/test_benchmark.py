"""scripts/benchmark.py: a 5-strategy matrix on the debug preset, launched as users launch it, plus
fast checks of the pieces in llama_train/bench/ (strategy parsing, failure capture, medians,
memory-gap explanations). On the matrix's runs: bytes per step against the ZeRO paper, the time
split against the step time, the memory planner against each rank's peak, with and without
activation checkpointing, the losses against DDP's, the report's tables and labels, and the
planner's ranking checked against the measured step times.

The matrices (ddp, zero1, zero2, zero3, fsdp2 and an unknown strategy; ddp and zero3 with
checkpointing; one short run each) are the slow part: seven real 2-rank launches, about two minutes
on 2 CPU cores.
"""

import csv
import json
import subprocess
import sys

import pytest

from llama_train.bench import runs as bench_runs
from llama_train.bench.gaps import explain_gap
from llama_train.bench.matrix import Entry, Setup, parse_strategies, trainer_command
from llama_train.bench.summary import NUMERIC, median_run
from llama_train.model import ModelArgs, preset
from llama_train.plan.memory import fsdp_units
from llama_train.telemetry.metrics import expected_model_state_bytes
from llama_train.telemetry.timing import PHASES
from tests.trainer_utils import ROOT, env, read_metrics

pytestmark = pytest.mark.usefixtures("deepspeed_ops")  # tests/conftest.py

MATRIX = [
    "ddp",
    "zero1",
    "zero2",
    "zero3",
    "fsdp2",
    "nope",
]  # "nope" is not a strategy: its row must carry the error
CHECKPOINTED = ["ddp", "zero3"]


def run_benchmark(out, strategies: list[str], data, *flags: str) -> subprocess.CompletedProcess:
    cmd = [
        sys.executable, "scripts/benchmark.py", "--strategies", ",".join(strategies), "--world_sizes", "2",
        "--preset", "debug", "--steps", "6", "--warmup_steps", "2", "--repeats", "1", "--max_seq_len", "32",
        "--batch_size", "4", "--output_dir", str(out), "--data_output_path", str(data), *flags,
    ]  # fmt: skip
    return subprocess.run(cmd, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def matrix(tmp_path_factory, shared_data):
    out = tmp_path_factory.mktemp("bench")
    return out, run_benchmark(out, MATRIX, shared_data)


@pytest.fixture(scope="module")
def checkpointed(matrix, shared_data):
    out = matrix[0] / "checkpointed"
    proc = run_benchmark(out, CHECKPOINTED, shared_data, "--trainer_args=--gradient_checkpointing")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads((out / "results.json").read_text())


def test_matrix_writes_agreeing_outputs(matrix):
    out, proc = matrix
    assert proc.returncode == 1, proc.stdout + proc.stderr  # 1: a configuration failed, the rest ran
    for name in ("results.json", "results.csv", "results.md", "throughput.png", "memory.png", "timing.png"):
        assert (out / name).stat().st_size > 0, name
    rows = json.loads((out / "results.json").read_text())
    assert [r["strategy"] for r in rows] == MATRIX
    with open(out / "results.csv") as f:
        table = list(csv.DictReader(f))
    markdown = (out / "results.md").read_text()
    assert markdown.split("| strategy |")[1] in proc.stdout  # the printed table is the file's
    for row, line in zip(rows, table):
        assert line["strategy"] == row["strategy"] and int(line["world_size"]) == row["world_size"] == 2
        for key in ("tokens_per_s", "step_time_s", "mfu", "final_loss", "model_state_bytes", "comm_bytes"):
            if row[key] is None:
                assert line[key] == "", key
            else:
                assert float(line[key]) == pytest.approx(row[key]), key
        if row["tokens_per_s"] is not None:
            assert f"| {row['strategy']} | 2 | {row['tokens_per_s']:,.0f} |" in markdown


def test_matrix_runs_measure_like_with_like(matrix):
    out, _ = matrix
    ddp, _, zero2, _, _, _ = json.loads((out / "results.json").read_text())
    for row, stage in ((ddp, 0), (zero2, 2)):
        assert row["error"] is None and row["runs"] == 1 and row["zero_stage"] == stage
        assert row["tokens_per_s"] > 0 and row["step_time_s"] > 0 and row["mfu"] > 0
        assert row["tokens_per_s_per_device"] == pytest.approx(row["tokens_per_s"] / 2)
        assert row["peak_mem_bytes"] > row["model_state_bytes"] > 0
        assert row["expected_model_state_bytes"] == expected_model_state_bytes(
            stage, row["num_params"], 2, "float32"
        )
        assert row["repeats"][0]["timed_steps"] == 2  # 6 steps, the first 2 left out, 4 and 6 probed
    assert ddp["num_params"] == zero2["num_params"]
    assert zero2["final_loss"] == pytest.approx(ddp["final_loss"], rel=1e-4)  # same model, data, batch
    assert ddp["step_time_vs_ddp"] == 1.0
    assert ddp["gap_explanation"] is None  # DDP holds exactly 16 B/param
    assert "fp32 master copy" in zero2["gap_explanation"]  # 12.x B/param vs the paper's 10


def test_matrix_reports_a_failed_configuration(matrix):
    out, proc = matrix
    failed = json.loads((out / "results.json").read_text())[-1]
    assert failed["strategy"] == "nope" and failed["runs"] == 0
    assert "unknown strategy 'nope'" in failed["error"] and failed["tokens_per_s"] is None
    assert "**failed**" in (out / "results.md").read_text()
    assert "nope x2 #1 failed" in proc.stderr


# bytes per step in units of Psi (params x 4 B, fp32), as measured and documented (docs/memory.md: "What ZeRO
# costs, read together"; docs/fsdp.md): the paper's figure for DDP; DeepSpeed's ZeRO-1/2 all-reduce
# the gradients (+1 Psi); ZeRO-3 keeps its gathered parameters from forward to backward (-1 Psi);
# FSDP2 keeps its root unit (embedding, final norm, output: 40% of the debug preset) gathered
ROOT_PSI = fsdp_units(preset("debug", max_seq_len=32))[0] / 164_160
MEASURED_PSI = {"ddp": 2.0, "zero1": 3.0, "zero2": 3.0, "zero3": 2.0, "fsdp2": 3.0 - ROOT_PSI}
PAPER_PSI = {"ddp": 2.0, "zero1": 2.0, "zero2": 2.0, "zero3": 3.0, "fsdp2": 3.0}
WHY = {"zero1": "use_multi_rank_bucket_allreduce", "zero2": "use_multi_rank_bucket_allreduce",
       "zero3": "keeps the gathered parameters from forward to backward", "fsdp2": "keeps its root unit"}  # fmt: skip


def test_matrix_counts_bytes_as_the_paper_and_says_why_they_differ(matrix):
    out, _ = matrix
    for row in json.loads((out / "results.json").read_text())[:-1]:
        psi, name = 4 * row["num_params"], row["strategy"]
        assert row["expected_comm_bytes"] == PAPER_PSI[name] * psi, name
        assert row["comm_bytes"] == pytest.approx(MEASURED_PSI[name] * psi, rel=1e-3), name  # + norms' bytes
        assert row["comm_vs_paper"] == pytest.approx(MEASURED_PSI[name] / PAPER_PSI[name], rel=1e-3)
        assert row["comm_backend"] == "gloo"
        if name in ("zero1", "zero2"):  # buckets hold the largest parameter: a handful of reductions a step,
            assert row["comm_calls_by_op"]["all_reduce"] <= 9, row[
                "comm_calls_by_op"
            ]  # not 21 (one a parameter)
        if name == "ddp":
            assert row["comm_bytes_by_op"] == {"all_reduce": 2 * psi} and row["comm_explanation"] is None
        else:
            assert WHY[name] in row["comm_explanation"] and "other collectives" not in row["comm_explanation"]
    zero3 = json.loads((out / "results.json").read_text())[3]
    assert zero3["comm_bytes_by_op"]["reduce_scatter"] == 4 * zero3["num_params"]  # the gradients, once


def test_matrix_time_split_sums_to_the_step_time(matrix):
    out, _ = matrix
    for name in MATRIX[:-1]:
        records = read_metrics(out / "runs" / f"{name}_w2_r0")
        train = {r["step"]: r for r in records if r["event"] == "train"}
        timing = [r for r in records if r["event"] == "timing"]
        assert [r["step"] for r in timing] == [2, 4, 6], name  # --probe_interval 2, every rank
        assert [train[s]["probed_steps"] for s in (2, 3, 4)] == [[2], [], [4]], name
        assert [train[s]["timed_steps"] for s in (2, 3, 4)] == [0, 1, 0], name
        assert train[4]["step_time_s"] == train[3]["step_time_s"], name  # from the unprobed step
        for r in timing[1:]:
            parts = [r[f"{phase}_s"] for phase in PHASES]
            assert (
                all(p[0] >= 0 for p in parts) and min(r["forward_s"] + r["backward_s"] + r["optimizer_s"]) > 0
            )
            total = sum(p[0] for p in parts)  # rank 0's, against rank 0's wall clock
            assert total == pytest.approx(r["wall_s"], rel=0.05) and r["probe_s"] > 0, (name, r)
            assert r["slowest_rank"] in (0, 1) and len(r["peak_mem_bytes"]) == 2
    table = (out / "results.md").read_text()
    assert "Where a step's time goes, on the slowest rank" in table and "| comm wait |" in table


def assert_planned_within(rows: list[dict], tolerance: float = 0.15):
    for row in rows:
        for rank, peak in enumerate(row["peak_mem_bytes_per_rank"]):
            assert abs(row["planned_peak_mem_bytes"] / peak - 1) <= tolerance, (row["strategy"], rank, peak)


def test_matrix_report_divergence_labels_and_advice(matrix):
    """Every row's largest per-step loss difference from DDP (they compute the same thing); Markdown
    tables with header delimiter rows and at most 10 columns; each file labelled with machine, date
    and commit; the planner's ranking checked against the measured step times, in the printed text."""
    out, proc = matrix
    rows = json.loads((out / "results.json").read_text())
    assert rows[0]["loss_diff_vs_ddp"] == 0.0
    for row in rows[1:-1]:
        assert row["loss_diff_vs_ddp"] <= 1e-5, row["strategy"]  # fp32: the same losses
        assert len(row["losses"]) == 6 and row["final_loss"] == row["losses"][-1]
    markdown = (out / "results.md").read_text()
    lines = markdown.splitlines()
    heads = [i for i, line in enumerate(lines) if line.startswith("| strategy | ranks |")]
    assert len(heads) == 4  # speed, memory, bytes, time split
    for i in heads:
        columns = lines[i].count("|") - 1
        assert columns <= 10 and lines[i + 1] == "|" + "---|" * columns, lines[i]
    assert "| step time / DDP |" in markdown and "| max loss diff vs DDP |" in markdown
    label = lines[2]
    assert label.startswith("Machine: ") and "Date: " in label and "Commit: " in label
    with open(out / "results.csv") as f:
        first = next(csv.DictReader(f))
    assert all(first[k] == rows[0][k] and rows[0][k] for k in ("machine", "date", "commit"))
    ranked = [r for r in rows[:-1] if r.get("planner_rank")]
    assert len(ranked) == 5 and sorted(r["measured_rank"] for r in ranked) == [1, 2, 3, 4, 5]
    assert ranked[0]["planner_rank"] == 1  # DDP: the fastest expected step on this CPU, it fits
    verdict = "**they agree**" if ranked[0]["pick_agrees"] else "**they disagree**"
    advice = markdown.split("Which to pick")[1]
    assert verdict in advice and "1. ddp fits with" in advice and advice.split("Failed:")[0] in proc.stdout


def test_planner_predicts_each_ranks_peak_memory(matrix, checkpointed):
    out, _ = matrix
    assert_planned_within(json.loads((out / "results.json").read_text())[:-1])
    assert_planned_within(checkpointed)  # with activation checkpointing
    assert all(ModelArgs(**row["model"]).gradient_checkpointing for row in checkpointed)


def test_a_crashing_trainer_is_reported_with_its_stderr(tmp_path, monkeypatch):
    crash = (
        "import sys; print('step 1 ok'); sys.stderr.write('Traceback\\nRuntimeError: boom\\n'); sys.exit(3)"
    )
    monkeypatch.setattr(bench_runs, "trainer_command", lambda *a: [sys.executable, "-c", crash])
    setup = Setup(output_dir=str(tmp_path), steps=3)
    row = bench_runs.run_one(Entry("zero2", "ds_configs/zero2.json"), 2, 0, setup)
    assert row["error"] == "exit code 3: Traceback\nRuntimeError: boom"
    summary = median_run([row, {**row, "repeat": 1}])
    assert summary["runs"] == 0 and summary["tokens_per_s"] is None and "2/2 runs failed" in summary["error"]


def test_parse_strategies_registry_custom_and_unknown():
    ddp, custom, unknown = parse_strategies("ddp, mine=cfg/x.json,zero9")
    assert (ddp.ds_config, ddp.error) == (None, None)
    assert (custom.name, custom.ds_config, custom.error) == ("mine", "cfg/x.json", None)
    assert "unknown strategy 'zero9'" in unknown.error
    assert [s.name for s in Setup().strategies] == [
        "ddp", "zero0", "zero1", "zero2", "zero3", "zero2_offload", "zero3_offload", "fsdp2", "fsdp2-offload",
    ]  # fmt: skip
    static = parse_strategies("ddp_static")[0]
    assert "--no-find_unused_parameters" in trainer_command(static, 2, 1234)


def test_stderr_tail_drops_progress_bars_and_duplicate_rank_lines():
    text = "a\nerror: bad flag\nerror: bad flag\rtrain:  50%| 1/2 [00:01<00:01, 1.0it/s]\n\nlast\n"
    assert bench_runs.stderr_tail(text) == "a\nerror: bad flag\nlast"


def test_median_run_takes_medians_over_the_runs_that_worked():
    base = {"strategy": "zero1", "world_size": 2, "breakdown": {}, "expected_model_state_bytes": 1.0}
    runs = [{**base, "repeat": i, **dict.fromkeys(NUMERIC, float(v))} for i, v in enumerate((3, 1, 2))]
    runs.append({**base, "repeat": 3, "error": "exit code 1: x"})
    out = median_run(runs)
    assert out["runs"] == 3 and out["step_time_s"] == 2.0 and out["tokens_per_s"] == 2.0
    assert out["error"].startswith("1/4 runs failed; run 4: exit code 1")


def test_zero3_gap_is_explained_by_master_copy_and_reduce_bucket():
    P, world = 25_000_000, 2
    row = {
        "strategy": "zero3", "world_size": world, "zero_stage": 3, "dtype": "float32", "num_params": P,
        "largest_param_numel": 4_000_000, "expected_model_state_bytes": 8 * P,
        "model_state_bytes": 8 * P + 2 * P + 200_000_000,
        "breakdown": {"params_and_grads": 2 * P, "optimizer_state": 4 * P, "engine_buffers": 4 * P + 200_000_000},
    }  # fmt: skip
    text = explain_gap(row, {"zero_optimization": {"stage": 3, "reduce_bucket_size": 5e7}})
    assert "fp32 master copy" in text and "reduce_bucket_size 5e+07 elements x 4 B" in text
    assert "other engine buffers" not in text  # the two known causes account for all of it
    assert explain_gap({**row, "model_state_bytes": 8.5 * P}, {}) is None  # within 10%
