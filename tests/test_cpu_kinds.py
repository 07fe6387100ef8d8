"""The CPUs this project runs on differ (an AMD EPYC without bf16/fp16 matrix units, an Intel Xeon with
AVX512-FP16 and AMX-BF16), and where torch's or DeepSpeed's capability flags change what runs, the
project decides (llama_train/cpu.py): each decision here with the flag forced both ways. Muon's
Newton-Schulz precision: tests/test_optimizers.py (test_newton_schulz_precision_is_ours_...)."""

import pytest
import torch

from llama_train import cpu
from llama_train.distributed.dist import check_engine_precision, choose_dtype
from llama_train.errors import ConfigError
from llama_train.telemetry.metrics import device_peak_flops

# /proc/cpuinfo flags (the matrix-relevant part, among others) of the two kinds seen
EPYC = "fpu sse sse2 ssse3 sse4_1 sse4_2 avx avx2 fma bmi2 sha_ni clzero"
XEON_AMX = (
    "fpu sse2 avx avx2 fma avx512f avx512bw avx512_vnni avx512_bf16 avx512_fp16 amx_bf16 amx_tile amx_int8"
)
KINDS = {"epyc": EPYC, "xeon-amx": XEON_AMX}


def test_the_units_of_both_cpu_kinds_are_read():
    assert cpu.isa(EPYC) == ["avx2"]
    assert cpu.isa(XEON_AMX) == ["avx2", "avx512f", "avx512_bf16", "avx512_fp16", "amx_bf16"]
    assert cpu.model_name() and cpu.describe().startswith(cpu.model_name())


@pytest.mark.parametrize("kind", KINDS)
def test_dtype_auto_on_a_cpu_is_the_measured_rule_on_either_kind(monkeypatch, kind):
    """The rule (llama_train.cpu.auto_dtype, measured by scripts/bench_cpu_dtype.py): fp32 on every CPU."""
    monkeypatch.setattr(cpu, "cpuinfo", lambda: {"flags": KINDS[kind], "model name": kind})
    assert cpu.has_amx_bf16() is (kind == "xeon-amx")
    assert choose_dtype("auto", "cpu") == cpu.auto_dtype() == "float32"
    assert choose_dtype("bfloat16", "cpu") == "bfloat16"  # asked for: bf16 on either kind


@pytest.mark.parametrize("fp16_supported", [True, False])
def test_deepspeed_fp16_where_the_cpu_has_none_is_refused_first(fp16_supported):
    """DeepSpeed's CPU accelerator has fp16 where torch's oneDNN has (a Xeon with AVX512-FP16), not on
    an EPYC, where DeepSpeed would refuse only after the data is built: refused at start-up, with the way out."""
    for dtype in ("float32", "bfloat16"):
        check_engine_precision(dtype, "cpu", fp16_supported)
    if fp16_supported:
        check_engine_precision("float16", "cpu", fp16_supported)
        return
    with pytest.raises(ConfigError, match="--dtype float16: DeepSpeed's cpu accelerator has no fp16") as e:
        check_engine_precision("float16", "cpu", fp16_supported)
    assert "use --dtype float32 or bfloat16, or train_ddp.py" in str(e.value)


def test_mfu_peak_on_a_cpu_is_the_matmul_of_the_dtype_that_runs(monkeypatch):
    """A bf16 run on AMX is measured against a bf16 matmul, not fp32's (several times slower there)."""
    monkeypatch.delenv("LLAMA_TRAIN_PEAK_TFLOPS", raising=False)
    for dtype, short in (("float32", "fp32"), ("bfloat16", "bf16")):
        peak, source = device_peak_flops(torch.device("cpu"), dtype)
        assert peak > 0 and source.startswith(f"measured CPU {short} matmul")


def test_the_dtype_benchmark_reports_medians_ratios_and_the_twins_agreement():
    """scripts/bench_cpu_dtype.py's arithmetic on made-up runs: per configuration the median over
    repeats, bf16 / fp32 per strategy, the twins' largest relative loss difference per dtype."""
    from llama_train.bench.dtype import summarize

    times = {("ddp", "float32"): [1.0, 3.0, 1.2], ("ddp", "bfloat16"): [0.5, 0.6, 2.0],
             ("zero2", "float32"): [2.0, 2.2, 2.1], ("zero2", "bfloat16"): [1.0, 1.1, 5.0]}  # fmt: skip
    losses = {"float32": [4.0, 3.0], "bfloat16": [4.0, 3.003]}
    rows = [
        {
            "strategy": s,
            "dtype": d,
            "repeat": r,
            "step_time_s": t,
            "tokens_per_s": 2048 / t,
            "losses": losses[d] if s == "zero2" else [4.0, 3.0],
        }  # fmt: skip
        for (s, d), ts in times.items()
        for r, t in enumerate(ts)
    ]
    out = summarize(rows)
    assert out["step_time_s"] == {"ddp/float32": 1.2, "ddp/bfloat16": 0.6, "zero2/float32": 2.1,
                                  "zero2/bfloat16": 1.1}  # fmt: skip
    assert out["bf16_over_fp32"] == pytest.approx({"ddp": 0.5, "zero2": 1.1 / 2.1})
    assert out["twin_loss_rel_diff"] == pytest.approx({"float32": 0.0, "bfloat16": 1e-3})
    with pytest.raises(RuntimeError, match="zero2 bfloat16: exit code 1"):
        summarize([*rows, {"strategy": "zero2", "dtype": "bfloat16", "repeat": 3, "error": "exit code 1"}])


def test_deepspeed_chooses_the_cpu_without_a_word():
    """Without a GPU, DeepSpeed's accelerator is the CPU's; importing llama_train names it (DS_ACCELERATOR)
    before any module imports DeepSpeed, so neither trainer, nor the DDP twin reading a checkpoint,
    prints DeepSpeed's "Setting accelerator to CPU" warning. A user's own DS_ACCELERATOR is kept."""
    import os
    import subprocess
    import sys

    from tests.trainer_utils import ROOT

    env = {k: v for k, v in os.environ.items() if k != "DS_ACCELERATOR"} | {"CUDA_VISIBLE_DEVICES": ""}
    read = "import llama_train.checkpoint.formats as f, os; f._deepspeed_data_classes(); print(os.environ['DS_ACCELERATOR'])"
    for cmd in (["train_deepspeed.py", "--help"], ["train_ddp.py", "--help"], ["-c", read]):
        proc = subprocess.run(
            [sys.executable, *cmd], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
        )
        assert proc.returncode == 0 and "Setting accelerator" not in proc.stdout + proc.stderr, (
            cmd,
            proc.stderr,
        )
    assert proc.stdout.split()[-1] == "cpu"
    own = "import llama_train, os; print(os.environ['DS_ACCELERATOR'])"
    mine = subprocess.run([sys.executable, "-c", own], cwd=ROOT, env=env | {"DS_ACCELERATOR": "cuda"},
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert mine.stdout.split()[-1] == "cuda"
