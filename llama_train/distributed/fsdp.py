"""FSDP2 (torch's `fully_shard`) for the torch-native trainer: `torchrun train_ddp.py --fsdp`.

What it does, and how it lines up with DDP and ZeRO-3 (docs/fsdp.md has the long form):

- Sharding: every TransformerBlock is its own FSDP unit, then the root (embedding, final norm, output
  head). Parameters, gradients and AdamW state are split over the ranks as ZeRO-3 splits them
  (16 Psi / N of model state); a block's parameters are all-gathered for its forward, freed, gathered
  again for its backward, and its gradients reduce-scattered. FSDP2 keeps the root's parameters
  gathered from forward to backward (it does not reshard the root after forward).
- Buffers are neither sharded nor communicated: the complex64 rotary table `pos_cis` stays a plain
  tensor on every rank (DDP must be told to ignore it; FSDP2 never touches it).
- Precision: an fp32 run shards fp32 weights and computes in fp32; bf16/fp16 runs keep fp32 sharded
  weights and AdamW state, gather the parameters in bf16/fp16 and reduce-scatter gradients in fp32
  (MixedPrecisionPolicy), instead of DDP's autocast. fp16 keeps DDP's GradScaler.
- Offload (--fsdp_offload): CPUOffloadPolicy, parameters, gradients and AdamW state on the host;
  the step runs there.
- The step is DDPEngine's (llama_train/train/engines/torch_engine.py: FSDPEngine): accumulation without communication
  through set_requires_gradient_sync(False) on all but the last micro-batch (DDP's no_sync),
  clip_grad_norm_ over the sharded gradients (a DTensor: the norm of the whole gradient), fused
  AdamW over DTensors with the same `found_inf` skip.
- Checkpoints are gathered full state, written as the DDP trainer writes its own (model.pt,
  optimizer.pt with torch's per-index state, scheduler.pt, scaler.pt): a DDP and an FSDP2 checkpoint
  are the same files, loaded natively by either at any world size, and read by DeepSpeed through the
  neutral form (llama_train/checkpoint/portable.py) like any DDP checkpoint.
"""

import os

import torch

# torch.distributed.fsdp and .checkpoint are imported where used: ~0.4 s that config.py (which
# checks this module's flags) and a DDP or DeepSpeed run should not pay

PARAM_DTYPES = {"float32": None, "bfloat16": torch.bfloat16, "float16": torch.float16}


def fsdp_problems(args) -> list[str]:
    """What --fsdp cannot honour (config.validate lists these with every other problem)."""
    fsdp, problems = getattr(args, "fsdp", False), []
    if getattr(args, "fsdp_offload", False) and not fsdp:
        problems.append("--fsdp_offload needs --fsdp")
    if not fsdp:
        return problems
    if args.find_unused_parameters:
        problems.append(
            "--find_unused_parameters is DDP's and has no meaning under --fsdp (FSDP2 reduce-scatters "
            "whatever gradients exist): drop one of them"
        )
    if "WORLD_SIZE" not in os.environ:
        problems.append(
            "--fsdp shards over a process group: start with `torchrun --nproc_per_node N train_ddp.py --fsdp`"
        )
    return problems


def wrap_fsdp(model: torch.nn.Module, device: torch.device, dtype: str, offload: bool) -> torch.nn.Module:
    """`model` on `device`, sharded: fully_shard on every TransformerBlock, then on the root."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    model = model.to(device)
    policy = MixedPrecisionPolicy(param_dtype=PARAM_DTYPES[dtype], reduce_dtype=torch.float32)
    kwargs = {"mp_policy": policy}
    if offload:  # pinned host memory needs an accelerator to pin for
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=device.type == "cuda")
    for block in model.layers:
        fully_shard(block, **kwargs)
    return fully_shard(model, **kwargs)


# --- full state: what a checkpoint holds, in the DDP trainer's format ---


def _options(**kwargs):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, **kwargs)


def full_model_state(model) -> dict[str, torch.Tensor]:
    """Collective: the full fp32 state dict on rank 0 (empty elsewhere), on the CPU."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    return get_model_state_dict(model, options=_options(cpu_offload=True))  # only rank 0's host


def full_optimizer_state(model, optimizer) -> dict:
    """Collective: the optimizer's full state on rank 0 as torch.optim's own state_dict() numbers
    it (parameters by index, in group order), i.e. what a DDP run's optimizer.pt holds."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    named = get_optimizer_state_dict(model, optimizer, options=_options(cpu_offload=True))
    if not named:  # ranks other than 0
        return {}
    names = [n for g in named["param_groups"] for n in g["params"]]
    index = {n: i for i, n in enumerate(names)}
    return {
        "state": {index[n]: s for n, s in named["state"].items()},
        "param_groups": [{**g, "params": [index[n] for n in g["params"]]} for g in named["param_groups"]],
    }


def load_full_state(model, optimizer, weights: dict, optim_state: dict | None, groups: list[list[str]]):
    """Collective: full tensors (every rank holds them, as a DDP resume does) into the sharded model
    and optimizer; `optim_state` in torch's per-index form (optimizer.pt), `groups` the parameter
    names per optimizer group that turn indices into names."""
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    set_model_state_dict(model, weights, options=_options())
    if optim_state is None:
        return
    names = [n for g in groups for n in g]
    named = {
        "state": {names[i]: s for i, s in optim_state["state"].items()},
        "param_groups": [
            {**g, "params": [names[i] for i in g["params"]]} for g in optim_state["param_groups"]
        ],
    }
    set_optimizer_state_dict(model, optimizer, named, options=_options())


# --- communication: FSDP2's collectives, counted as comm.py counts DDP's and DeepSpeed's ---


def count_fsdp(model: torch.nn.Module, counter):
    """Count every FSDP unit's all-gathers (the gathered tensor) and reduce-scatters (the tensor
    reduced) through FSDP2's public hooks for custom collectives (set_custom_all_gather /
    set_custom_reduce_scatter), with torch's default collectives behind them. The classes passed are
    torch 2.13's defaults, subclassed (torch does not export them): the same calls, counted; the
    benchmark test notices when they stop being called (no bytes)."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllGather, DefaultReduceScatter

    def counted(base, op: str):
        class Counted(base):
            def __call__(self, output_tensor, input_tensor, group, *args, **kwargs):
                if not counter.active:
                    return super().__call__(output_tensor, input_tensor, group, *args, **kwargs)
                counted_tensor = output_tensor if op == "all_gather" else input_tensor
                size = counted_tensor.numel() * counted_tensor.element_size()
                counter.add_collective(op, size, group.size())
                if counter.timer is None:
                    return super().__call__(output_tensor, input_tensor, group, *args, **kwargs)
                with counter.timer.phase("comm_wait"):  # gloo: the host blocks in the collective
                    return super().__call__(output_tensor, input_tensor, group, *args, **kwargs)

        return Counted()

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_custom_all_gather(counted(DefaultAllGather, "all_gather"))
            module.set_custom_reduce_scatter(counted(DefaultReduceScatter, "reduce_scatter"))


def is_fsdp(model) -> bool:
    return type(model).__module__.startswith("torch.distributed.fsdp")  # fully_shard's FSDP<Class>
