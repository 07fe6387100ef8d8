"""CPU facts -> decisions: which matrix units this CPU has, what torch makes of them, and what that
changes (`--dtype auto` on a CPU, the MFU peak, the test suite's header). The machines this project
runs on are not all the same CPU: an AMD EPYC has no bf16 or fp16 matrix units, an Intel Xeon of the
Sapphire Rapids class has AMX-BF16, and torch's bf16 matmul is ~400x slower than fp32 on the first
and ~6x faster on the second.

    python -m llama_train.cpu     # one line: model, ISA, torch's and DeepSpeed's view of bf16/fp16
"""

import functools
import os
import sys

import torch

ISA_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_fp16", "amx_bf16", "amx_fp16")  # /proc/cpuinfo names


@functools.cache
def cpuinfo() -> dict[str, str]:
    """The first processor's fields of /proc/cpuinfo ({} where there is none, e.g. macOS)."""
    try:
        with open("/proc/cpuinfo") as f:
            block = f.read().split("\n\n", 1)[0]
    except OSError:
        return {}
    return {k.strip(): v.strip() for k, _, v in (line.partition(":") for line in block.splitlines())}


def model_name() -> str:
    return cpuinfo().get("model name") or cpuinfo().get("Model") or "unknown CPU"


def isa(flags: str | None = None) -> list[str]:
    """The matrix-relevant instruction sets of ISA_FLAGS in `flags` (/proc/cpuinfo's line; this CPU's)."""
    present = set((cpuinfo().get("flags", "") if flags is None else flags).split())
    return [f for f in ISA_FLAGS if f in present]


def has_amx_bf16() -> bool:
    """bf16 tile matrix units (Intel AMX): where a bf16 matmul beats fp32 several times over."""
    return "amx_bf16" in isa()


def mkldnn_half_support() -> dict[str, bool]:
    """torch's own answer for bf16 / fp16 matmuls through oneDNN (what DeepSpeed's CPU accelerator
    reads for fp16: accelerator/cpu_accelerator.py, is_fp16_supported)."""
    ops = torch.ops.mkldnn
    return {"bf16": bool(ops._is_mkldnn_bf16_supported()), "fp16": bool(ops._is_mkldnn_fp16_supported())}


def auto_dtype() -> str:
    """`--dtype auto` on a CPU (llama_train.distributed.dist.choose_dtype): fp32 on every CPU, AMX
    included. Measured with the trainers (scripts/bench_cpu_dtype.py, docs/performance.md): without bf16
    units bf16 is far slower; on an AMX Xeon a bf16 step is 1.6x faster, but DDP and ZeRO-2 then differ
    by 3e-3 per step (fp32: 6e-7), beyond the suite's bf16 tolerance, and a run's numbers would depend
    on the CPU model. `--dtype bfloat16` is there for speed."""
    return "float32"


def describe() -> str:
    """'Intel(R) Xeon(R) Processor, 2 cores; avx2 avx512f ... amx_bf16; torch AVX512, oneDNN bf16 yes fp16 yes'."""
    half = mkldnn_half_support()
    return (
        f"{model_name()}, {os.cpu_count()} cores; ISA {' '.join(isa()) or 'none of ' + '/'.join(ISA_FLAGS)}; "
        f"torch kernels {torch.backends.cpu.get_cpu_capability()}, oneDNN bf16 {'yes' if half['bf16'] else 'no'} "
        f"fp16 {'yes' if half['fp16'] else 'no'}"
    )


if __name__ == "__main__":
    print(describe(), file=sys.stdout)
