"""Throughput, MFU, memory and the metrics.jsonl writer.

MFU = achieved model FLOP/s (PaLM-style count, `Transformer.flops_per_token`) / device peak.
The peak comes from a table of known GPUs (dense bf16/fp16 tensor-core, fp32 for fp32 runs),
or, on CPU, from an fp32 matmul measured in this process -- reported with `peak_source`
so nobody mistakes one for the other.
"""

import json
import os
import resource
import time

import torch

# dense peak TFLOP/s per GPU (no sparsity): (bf16/fp16, tf32-or-fp32)
GPU_PEAK_TFLOPS = {
    "H200": (989.0, 494.0),
    "H100": (989.0, 494.0),  # SXM; PCIe is lower, matched by "H100 PCIe" below
    "H100 PCIe": (756.0, 378.0),
    "A100": (312.0, 156.0),
    "A10G": (125.0, 31.2),
    "L40S": (362.0, 91.6),
    "L4": (121.0, 30.3),
    "V100": (125.0, 15.7),
    "RTX 4090": (165.0, 82.6),
    "RTX 3090": (71.0, 35.6),
}


def measure_cpu_matmul_flops(n: int = 2048, repeats: int = 3) -> float:
    """Best-of-`repeats` fp32 matmul FLOP/s with this process's thread count (n=2048: ~17 GFLOP a
    try, long enough that a moment's load elsewhere does not decide the figure)."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b  # warm up the BLAS
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best


def device_peak_flops(device: torch.device, dtype: str) -> tuple[float, str]:
    """(peak FLOP/s, where the number comes from)."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key in sorted(GPU_PEAK_TFLOPS, key=len, reverse=True):  # most specific name first
            if key in name:
                low, high = GPU_PEAK_TFLOPS[key]
                return (low if dtype != "float32" else high) * 1e12, f"table:{key}:{dtype}"
        return float("nan"), f"unknown GPU {name!r}: no MFU"
    return measure_cpu_matmul_flops(), f"measured CPU fp32 matmul ({torch.get_num_threads()} threads)"


def peak_memory_bytes(device: torch.device) -> int:
    """CUDA max allocated on GPU; peak RSS of this process on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


class MetricsWriter:
    """Appends one JSON object per line to <output_dir>/metrics.jsonl (global rank 0 only)."""

    def __init__(self, output_dir: str, rank: int):
        self.path = os.path.join(output_dir, "metrics.jsonl")
        self.enabled = rank == 0
        if self.enabled:
            os.makedirs(output_dir, exist_ok=True)

    def write(self, event: str, **fields):
        if not self.enabled:
            return
        with open(self.path, "a") as f:
            f.write(json.dumps({"event": event, **fields, "time": time.time()}) + "\n")


def format_step(rec: dict, total_steps: int) -> str:
    """One uniform log line: step | loss | lr | norm | ms | tok/s | MFU | memory."""
    norm = "n/a" if rec["grad_norm"] is None else f"{rec['grad_norm']:.3f}"
    return (
        f"step {rec['step']:>6}/{total_steps} | loss {rec['loss']:.4f} | lr {rec['lr']:.2e} | norm {norm}"
        f" | {rec['step_time_s'] * 1000:8.1f} ms | {rec['tokens_per_s']:>9,.0f} tok/s"
        f" | MFU {rec['mfu'] * 100:5.1f}% | mem {rec['peak_mem_bytes'] / 2**30:.2f} GiB"
    )


# --- model-state memory: what a rank actually holds, next to the ZeRO paper's formula ---

# bytes per parameter (param, grad, optimizer state K) -- ZeRO paper, mixed-precision Adam:
# fp16/bf16 params and grads, K = 12 (fp32 master copy + Adam m + v). For fp32 training the
# fp32 params are the master copy: 4 + 4 + 8 (m + v).
STATE_BYTES = {"mixed": (2, 2, 12), "float32": (4, 4, 8)}


def expected_model_state_bytes(stage: int, num_params: int, world: int, dtype: str) -> float:
    """ZeRO paper, per rank: DDP/ZeRO-0 (2+2+K)P, ZeRO-1 (2+2)P + KP/N, ZeRO-2 2P + (2+K)P/N,
    ZeRO-3 (2+2+K)P/N (fp32: 4, 4, 8 instead of 2, 2, 12). `stage` 0 for DDP."""
    p, g, k = STATE_BYTES["float32" if dtype == "float32" else "mixed"]
    replicated, sharded = {0: (p + g + k, 0), 1: (p + g, k), 2: (p, g + k), 3: (0, p + g + k)}[stage]
    return num_params * (replicated + sharded / world)


def _walk_into(obj) -> bool:
    """Optimizer-side objects whose attributes may hold state tensors (not modules or groups)."""
    module = type(obj).__module__
    return module.startswith(("deepspeed.runtime", "torch.optim")) and not isinstance(obj, torch.nn.Module)


def held_tensor_bytes(named_roots: dict) -> dict[str, int]:
    """Bytes of distinct tensor storages reachable from each group of roots, in order; a storage
    counts once, under the first group that reaches it (params and grads, then optimizer state,
    then whatever else the engine holds: ZeRO flat buffers, fp32 partitions, gradient buckets).
    Buffers that live only in C++ (DDP's gradient buckets) are invisible here."""
    seen_obj, seen_storage, out = set(), set(), {}
    for name, roots in named_roots.items():
        total, stack = 0, list(roots)
        while stack:
            obj = stack.pop()
            if id(obj) in seen_obj:
                continue
            seen_obj.add(id(obj))
            if isinstance(obj, torch.Tensor):
                stack.extend(t for t in (obj.grad, getattr(obj, "ds_tensor", None)) if t is not None)
                storage = obj.untyped_storage()
                key = (storage.data_ptr(), str(obj.device))
                if storage.data_ptr() and key not in seen_storage:
                    seen_storage.add(key)
                    total += storage.nbytes()
            elif isinstance(obj, dict):
                stack.extend(obj.values())
            elif isinstance(obj, list | tuple | set):
                stack.extend(obj)
            elif _walk_into(obj):
                stack.extend(vars(obj).values())
        out[name] = total
    return out
