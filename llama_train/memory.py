"""Memory: what a rank holds in model state (params, grads, optimizer state, engine buffers),
measured from its tensors, next to the ZeRO paper's formula; and the process's peak memory."""

import resource

import torch

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


def peak_memory_bytes(device: torch.device) -> int:
    """CUDA max allocated on GPU; peak RSS of this process on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def model_state_bytes(params, optimizer) -> dict[str, int]:
    """This rank's model-state bytes by category: params and grads, the optimizer's state, and
    other buffers the optimizer (a ZeRO wrapper) holds. Call between backward and the step."""
    inner = getattr(optimizer, "optimizer", optimizer)  # the torch optimizer inside a ZeRO wrapper
    roots = {
        "params_and_grads": list(params),
        "optimizer_state": [inner.state],
        "engine_buffers": [optimizer],
    }
    return held_tensor_bytes(roots)


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
