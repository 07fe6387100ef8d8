"""`--compile` in the real trainers (2 gloo ranks, fp32, debug preset): compiled per-step losses equal
eager DDP's (relative 1e-4) under DDP, ZeRO-0 and ZeRO-2 (that one with activation checkpointing; eager
ZeRO-2 gives DDP's losses within 1e-5 in fp32: tests/test_faults.py, tests/test_trainers.py),
compile time reported once and kept out of tok/s, the export unchanged; ZeRO-3 refused. Plus the
benchmarks' --compile plumbing, as pure functions.

Compiling costs: the runs share one inductor cache (a module tmp dir), so the first compiled run
compiles (cold) and the others load what it wrote.
"""

import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from llama_train.bench.matrix import parse_strategies, with_compiled
from llama_train.bench.overhead import parse_shapes, ratio_row
from llama_train.distributed.compile import compiler_problem
from llama_train.distributed.strategies import STRATEGIES
from tests.trainer_utils import BASE_FLAGS, ROOT, assert_close_curves, env, launch, losses, read_metrics

pytestmark = pytest.mark.usefixtures("deepspeed_ops")  # tests/conftest.py

STEPS = 10
WATCHDOG_S = 3  # far above a step of the debug model, below a cold compile (step 1, the first eval's)
RUNS = {  # name -> (launcher, flags); each compiled run is compared with the eager run of its strategy
    "ddp": ("ddp", []),
    "ddp_compiled": ("ddp", ["--compile", "--watchdog_s", str(WATCHDOG_S)]),  # the cold compile
    "zero0_compiled": ("deepspeed", ["--deepspeed_config=ds_configs/zero0.json", "--compile"]),
    "zero2_compiled": (
        "deepspeed",
        ["--deepspeed_config=ds_configs/zero2.json", "--compile", "--gradient_checkpointing"],
    ),
}
# each compiled run against eager DDP: eager ZeRO-0 and ZeRO-2 equal it in fp32 (one launch less)
EAGER_OF = {"ddp_compiled": "ddp", "zero0_compiled": "ddp", "zero2_compiled": "ddp"}


@pytest.fixture(scope="module")
def runs(tmp_path_factory, shared_data):
    """Every run once, in order, with one inductor cache for the module and the session's data cache."""
    out = {}
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path_factory.mktemp("inductor")))
        for name, (kind, flags) in RUNS.items():
            out[name] = tmp_path_factory.mktemp(name)
            extra = [*flags, "--max_steps", str(STEPS), "--eval_interval", "5"]
            proc = launch(kind, extra, out[name], shared_data, check=name != "ddp_compiled")
            (out[name] / "console.log").write_text(proc.stdout + proc.stderr)
            out[f"{name}_exit"] = proc.returncode
    return out


def test_the_watchdog_leaves_compilation_out(runs):
    """--compile --watchdog_s 3: the first step's compilation (cold cache) and the first evaluation's are
    not counted as a hang (before: the watchdog fired during step 1, exit 75, and a requeue compiled
    again), and the run finishes."""
    console = (runs["ddp_compiled"] / "console.log").read_text()
    assert runs["ddp_compiled_exit"] == 0 and "watchdog:" not in console, console[-3000:]
    (compiled,) = [r for r in read_metrics(runs["ddp_compiled"]) if r["event"] == "compile"]
    assert [r["step"] for r in read_metrics(runs["ddp_compiled"]) if r["event"] == "train"][-1] == STEPS
    print(f"step 1 compiled for {compiled['compile_s']:.1f} s under --watchdog_s {WATCHDOG_S}")


FIRST_LOAD = """
import sys, time, torch
from llama_train.ops.watchdog import Watchdog
assert "torch._dynamo" not in sys.modules  # --document_mask on a GPU without --compile: not loaded yet
with Watchdog(1.0, sys.argv[1], 0, 1) as dog:
    for step, _ in dog.steps((s, None) for s in (1, 2, 3)):
        if step == 1:  # the first forward compiles FlexAttention: torch._dynamo is loaded from now on
            double = torch.compile(lambda x: x * 2, backend="eager")
            double(torch.ones(2))
        if step == 2:  # the first evaluation recompiles (eval mode): 3 s, the watchdog's limit is 1 s
            from torch._dynamo.callback import callback_handler
            callback_handler.register_start_callback(lambda _: time.sleep(3))
            double(torch.ones(3, 3))
print("finished")
"""


def test_the_watchdog_leaves_out_compilations_of_a_run_that_loads_the_compiler_after_it_starts(tmp_path):
    """--document_mask on a GPU without --compile: torch._dynamo is loaded by FlexAttention's first call,
    in the first step, after the watchdog started; the recompilation at the first evaluation still moves
    the deadline on (before: it counted as a hang, exit 75)."""
    proc = subprocess.run(
        [sys.executable, "-c", FIRST_LOAD, str(tmp_path)], cwd=ROOT, env=env(), capture_output=True, text=True
    )
    assert proc.returncode == 0 and proc.stdout.strip() == "finished", proc.stdout + proc.stderr[-3000:]


@pytest.mark.parametrize("name", list(EAGER_OF))
def test_compiled_losses_equal_eager(runs, name):
    compiled, eager = losses(runs[name]), losses(runs[EAGER_OF[name]])
    assert len(compiled) == STEPS
    assert_close_curves(compiled, eager, rtol=1e-4)
    evals = [
        [r["eval_loss"] for r in read_metrics(runs[n]) if r["event"] == "eval"]
        for n in (name, EAGER_OF[name])
    ]
    assert_close_curves(*evals, rtol=1e-4)  # eval mode compiles its own graphs


@pytest.mark.parametrize("name", list(EAGER_OF))
def test_compile_time_is_reported_once_and_left_out_of_throughput(runs, name):
    records = read_metrics(runs[name])
    (compile_rec,) = [r for r in records if r["event"] == "compile"]
    assert compile_rec["step"] == 1 and compile_rec["compile_s"] > 0 and compile_rec["compilations"] >= 2
    assert compile_rec["cache_hits"] + compile_rec["cache_misses"] >= 2
    console = (runs[name] / "console.log").read_text()
    assert console.count("compile: ") == 1 and "left out of tok/s and MFU" in console
    first = next(r for r in records if r["event"] == "train")
    # step 1 carried the compilation; what it reports is the step without it
    assert first["step_time_s"] < compile_rec["compile_s"] / 2, (first, compile_rec)


def test_first_compiled_run_fills_the_cache_for_the_next(runs):
    cold, warm = (
        [r for r in read_metrics(runs[n]) if r["event"] == "compile"][0]
        for n in ("ddp_compiled", "zero0_compiled")
    )
    assert cold["cache_misses"] > 0
    assert warm["cache_misses"] == 0 and warm["cache_hits"] > 0, warm  # the same block graphs, loaded
    assert warm["compile_s"] < cold["compile_s"]


def test_compiled_export_has_the_eager_names_and_weights(runs):
    eager, compiled = (load_file(runs[n] / "hf" / "model.safetensors") for n in ("ddp", "ddp_compiled"))
    assert eager.keys() == compiled.keys()  # nn.Module.compile() in place: no _orig_mod. prefixes
    for k in eager:
        assert torch.allclose(eager[k], compiled[k], rtol=1e-3, atol=1e-5), k


def test_zero3_with_compile_is_refused(tmp_path):
    paths = ["--data_output_path", str(tmp_path / "data"), "--output_dir", str(tmp_path / "out")]
    cmd = [sys.executable, "train_deepspeed.py", *BASE_FLAGS, *paths]
    cmd += ["--deepspeed_config", "ds_configs/zero3.json", "--compile"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert "--compile does not work with ZeRO stage 3" in proc.stderr and "ZeRO-0/1/2" in proc.stderr


def test_missing_cxx_compiler_is_named(monkeypatch):
    monkeypatch.setenv("CXX", "no-such-c++")
    assert "'no-such-c++' is not on PATH" in compiler_problem("cpu")
    assert compiler_problem("cuda") is None
    monkeypatch.delenv("CXX")
    assert compiler_problem("cpu") is None  # g++ is there on the machines that run this suite


def test_benchmark_compile_adds_a_twin_after_each_strategy_but_zero3():
    names = [s.name for s in with_compiled(parse_strategies("ddp,zero3,zero2,mine=my.json,zero2_compiled"))]
    assert names == ["ddp", "ddp_compiled", "zero3", "zero2", "mine", "zero2_compiled"]
    twin = parse_strategies("zero2_offload_compiled")[0]
    assert twin.ds_config == "ds_configs/zero2_offload.json" and twin.flags == ("--compile",)
    assert not any("zero3" in name and "--compile" in s.flags for name, s in STRATEGIES.items())


def test_overhead_shapes_and_ratio_spread():
    assert parse_shapes("25m:1x256, 125m:4x128") == [("25m", 1, 256), ("125m", 4, 128)]
    with pytest.raises(ValueError, match="PRESET:BATCHxSEQ"):
        parse_shapes("125m:4-256")
    row = ratio_row("x", mine=[1.0, 2.0, 1.0], theirs=[1.1, 1.8, 1.3], tokens=100)
    assert row["ratio"] == pytest.approx(1.1) and row["spread"] == pytest.approx([0.9, 1.3])
