"""Moving a run across strategies and world sizes: the strategy-neutral form written into a live
engine.

The neutral form, in memory: per parameter (by its name in the model) the fp32 weight and AdamW's
`exp_avg` / `exp_avg_sq` (or, for the parameters another optimizer takes, the state its record in
llama_train/optim/ keeps, whole tensors), plus AdamW's step count and the LR schedule. A `formats.Reader`
reads it from any of our checkpoints (llama_train/checkpoint/formats.py, the one safe reader); `load_into(engine,
reader)` writes it into a live engine of any kind: the DDP trainer's torch AdamW, DeepSpeed's ZeRO-0
AdamW (or its fp32 masters), ZeRO-1/2/3 (with or without CPU offload) through DeepSpeed's public
`safe_set_full_fp32_param` / `safe_set_full_optimizer_state`. Whether a resume goes this way or
through the engine's own loader is decided before any work, in resuming.resume_point.
"""

import os

import torch

from llama_train.checkpoint import resuming
from llama_train.checkpoint import store as ckpt
from llama_train.checkpoint.formats import Reader, neutral_loss_scale, open_checkpoint
from llama_train.checkpoint.identity import data_changes
from llama_train.checkpoint.weights import check_shapes
from llama_train.distributed.dist import print0
from llama_train.optim.registry import optimizer_spec
from llama_train.optim.spec import ADAMW_STATE, State

# --- writing the neutral form into a live engine ---


def is_deepspeed(engine) -> bool:
    return hasattr(engine, "zero_optimization_stage") and hasattr(engine, "global_steps")


def load_into(engine, reader: Reader, step: int):
    """Weights, optimizer state and step count, LR schedule of `reader` into `engine` (the DDP trainer's
    DDPEngine or a DeepSpeed engine of any stage); `step` = the trainer step reached. Collective."""
    check_shapes(reader.shapes(), expected_shapes(engine.module), what=f"checkpoint ({reader.kind})")
    if hasattr(engine, "load_source"):  # FSDP2 (ddp.FSDPEngine): full tensors in, sharded by torch
        engine.load_source(reader)
    elif not is_deepspeed(engine):
        _into_torch(engine.optimizer, _trained(engine.module, None), reader)
    elif any(hasattr(p, "ds_id") or hasattr(p, "_hp_mapping") for p in engine.module.parameters()):
        _into_partitioned(engine, reader)  # ZeRO-1/2/3 (and DeepSpeed's bf16 optimizer)
    else:  # ZeRO-0: torch AdamW over the module's parameters, or over fp32 masters (bf16/fp16)
        from llama_train.distributed.ds_compat import zero0_fp32_master

        masters = zero0_fp32_master(engine)
        optimizer = engine.optimizer.optimizer if masters else engine.optimizer
        _into_torch(optimizer, _trained(engine.module, masters or None), reader)
    _restore_schedule(engine.lr_scheduler, reader.lr_scheduler)
    restore_loss_scale(engine, reader.loss_scale)
    if is_deepspeed(engine):
        engine.global_steps, engine.global_samples = step, step * engine.train_batch_size()


def _trained(module, masters) -> list[tuple[str, torch.nn.Parameter, torch.Tensor]]:
    """(name, module parameter, the tensor the optimizer steps for it) for every parameter."""
    if masters is None:
        return [(n, p, p) for n, p in module.named_parameters()]
    return [(n, p, masters[id(p)]) for n, p in module.named_parameters()]


@torch.no_grad()
def _into_torch(optimizer, params, reader: Reader):
    """A torch optimizer over full tensors: copy the weights, then load each parameter's state (what its
    group holds: the reader's optimizer record's group_state) through torch's own load_state_dict
    (which places `step` as the fused kernel wants it)."""
    index = {id(t): i for i, t in enumerate(t for g in optimizer.param_groups for t in g["params"])}
    kinds = {id(t): reader.optimizer.group_state(g) for g in optimizer.param_groups for t in g["params"]}
    state = {}
    for name, param, stepped in params:
        tensors = reader.tensors(name)
        stepped.copy_(tensors["fp32"])
        param.copy_(tensors["fp32"])  # the module's copy (bf16/fp16: rounded, as DeepSpeed keeps it)
        if reader.step is not None:
            state[index[id(stepped)]] = _state_of(tensors, reader.step, kinds[id(stepped)])
    if reader.step is not None:
        groups = optimizer.state_dict()["param_groups"]
        optimizer.load_state_dict({"state": state, "param_groups": groups})
        _set_group_step(optimizer, reader.step)


def _state_of(tensors: dict, step: int, kind: State) -> dict:
    """One parameter's optimizer state from its neutral form, as `kind` keeps it: its keys (zeros for
    one the checkpoint lacks) and the step count where it has one (AdamW's)."""
    counted = {"step": torch.tensor(float(step))} if kind.step else {}
    return {**counted, **{k: _or_zeros(tensors, k) for k in kind.keys}}


def _or_zeros(tensors: dict, key: str) -> torch.Tensor:
    """One state tensor of a parameter; zeros where the checkpoint has none yet (every update so far
    skipped: a NaN, fp16 overflows), as DeepSpeed's and torch's first step create it."""
    return tensors[key] if key in tensors else torch.zeros_like(tensors["fp32"])


@torch.no_grad()
def _into_partitioned(engine, reader: Reader):
    """ZeRO-1/2/3: the optimizer's state is created in its own format (zeros; ZeRO-1/2's state kept
    whole_under_zero as read), then every parameter's fp32 master and partitioned state (ZeRO-3: all of
    it) are set through DeepSpeed's public setters, each rank keeping its partition; the module's
    weights follow."""
    from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state

    from llama_train.distributed import ds_compat

    names = {id(p): n for n, p in engine.module.named_parameters()}

    def whole(params, key: str) -> torch.Tensor:  # ZeRO-1/2: whole matrices, one after another
        return torch.cat([_or_zeros(reader.tensors(names[id(p)]), key).flatten() for p in params])

    ds_compat.create_optimizer_state(engine, reader.step or 0, reader.optimizer.group_state, whole)
    stage3 = engine.zero_optimization_stage() == 3
    for name, param in engine.module.named_parameters():
        tensors = reader.tensors(name)
        if stage3:
            ds_compat.zero3_set_full(engine.optimizer, param, tensors)
            _set_zero3_module_param(param, tensors["fp32"])
            continue
        safe_set_full_fp32_param(param, tensors["fp32"])
        # whole state came with the state; a checkpoint whose every fp16 step overflowed has none: zeros
        for key in sorted(set(tensors) - {"fp32", *reader.optimizer.whole_keys}):
            safe_set_full_optimizer_state(param, tensors[key], key)
        param.data.copy_(tensors["fp32"])
    _set_group_step(engine.optimizer, reader.step or 0)


def _set_zero3_module_param(param, value: torch.Tensor):
    """The module's own (partitioned) copy of a ZeRO-3 parameter, through DeepSpeed's public gather:
    every rank holds the full value, rank 0's is re-partitioned on exit."""
    import deepspeed

    with deepspeed.zero.GatheredParameters([param], modifier_rank=0):
        param.data.copy_(value)


def _set_group_step(optimizer, step: int):
    """Optimizers that count steps per group (DeepSpeed's FusedAdam) rather than per parameter."""
    for group in optimizer.param_groups:
        if "step" in group:
            group["step"] = step


def reapply_schedule(scheduler):
    """The LR of the next update from this run's schedule at the restored position, not the one the
    checkpoint stored: the same number when the flags are unchanged (LambdaLR's own arithmetic), the
    branch's when --max_steps / --lr_schedule / --decay_steps changed (docs/optimizers.md, branching)."""
    step = scheduler.last_epoch
    groups = scheduler.optimizer.param_groups
    for group, base, schedule in zip(groups, scheduler.base_lrs, scheduler.lr_lambdas):
        group["lr"] = base * schedule(step)
    scheduler._last_lr = [group["lr"] for group in groups]


def live_loss_scaler(engine):
    """The engine's dynamic fp16 loss scaler, or None (fp32/bf16, a static scale): the DDP trainer's
    GradScaler, DeepSpeed ZeRO-1/2/3's DynamicLossScaler or ZeRO-0's LossScaleConfig."""
    scaler = getattr(engine, "scaler", None)  # ddp.DDPEngine
    if scaler is not None:
        return scaler if scaler.is_enabled() else None
    opt = getattr(engine, "optimizer", None)
    scaler = getattr(opt, "loss_scaler", None) or getattr(opt, "loss_scale_config", None)
    return scaler if neutral_loss_scale(scaler) else None


def loss_scale_of(engine) -> dict | None:
    """The live engine's fp16 loss scaler in the neutral form (formats.neutral_loss_scale), or None."""
    scaler = live_loss_scaler(engine)
    if isinstance(scaler, torch.amp.GradScaler):
        return neutral_loss_scale(scaler.state_dict())
    return neutral_loss_scale(scaler) if scaler is not None else None


def restore_loss_scale(engine, saved: dict | None):
    """A checkpoint's fp16 loss scale (neutral form) into the engine's dynamic scaler, whichever trainer
    wrote it: the scale, the good steps since the last overflow (when the scale grows next) and
    DeepSpeed's hysteresis. Nothing when either side has no dynamic scaler (fp32/bf16)."""
    scaler = live_loss_scaler(engine)
    if saved is None or scaler is None:
        return
    if isinstance(scaler, torch.amp.GradScaler):
        state = scaler.state_dict()
        state.update(scale=saved["scale"], _growth_tracker=saved["good_steps"] % state["growth_interval"])
        scaler.load_state_dict(state)
        return
    scaler.cur_scale = saved["scale"]
    scaler.last_overflow_iter = scaler.cur_iter - 1 - saved["good_steps"]
    if hasattr(scaler, "cur_hysteresis"):
        scaler.cur_hysteresis = saved.get("hysteresis", scaler.delayed_shift)


def _restore_schedule(scheduler, state: dict | None):
    """The LR schedule's position, and the LR its optimizer's groups use for the next step."""
    if state is None:
        return
    scheduler.load_state_dict(state)
    for group, lr in zip(scheduler.optimizer.param_groups, scheduler.get_last_lr()):
        group["lr"] = lr


# --- what a checkpoint records about its optimizer, and gathered state for comparisons ---


def optimizer_groups(engine) -> list[list[str]] | None:
    """Parameter names per optimizer group, in order, where the optimizer holds whole parameters
    (the DDP trainer, DeepSpeed ZeRO-0): what turns optimizer.pt's indices back into names."""
    module = engine.module
    names = {id(p): n for n, p in module.named_parameters()}
    optimizer = engine.optimizer
    if is_deepspeed(engine):
        from llama_train.distributed.ds_compat import zero0_fp32_master

        if engine.zero_optimization_stage() != 0:
            return None
        masters = zero0_fp32_master(engine)
        if masters:
            names = {id(masters[id(p)]): n for n, p in module.named_parameters()}
            optimizer = engine.optimizer.optimizer
    return [[names[id(p)] for p in g["params"]] for g in optimizer.param_groups]


def gathered_state(engine) -> dict:
    """Collective: {name: {"fp32", "exp_avg", "exp_avg_sq"}} of the live engine, full tensors on
    CPU, read through the engine's own accessors (DeepSpeed's safe_get_full_*); for comparisons."""
    out, masters = {}, {}
    if is_deepspeed(engine):
        from llama_train.distributed.ds_compat import relink_hp_optimizer_state, zero0_fp32_master

        relink_hp_optimizer_state(engine)
        masters = zero0_fp32_master(engine)
    optimizer = engine.optimizer.optimizer if masters else engine.optimizer
    for name, p in engine.module.named_parameters():
        if is_deepspeed(engine) and engine.zero_optimization_stage() > 0:
            from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

            t = {"fp32": safe_get_full_fp32_param(p)}
            t.update({k: safe_get_full_optimizer_state(p, k) for k in ADAMW_STATE.keys})
        else:
            stepped = masters.get(id(p), p)
            state = optimizer.state.get(stepped, {})
            t = {"fp32": stepped, **{k: state.get(k) for k in ADAMW_STATE.keys}}
        t = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in t.items()}  # FSDP2's DTensors
        out[name] = {k: None if v is None else v.detach().float().cpu().clone() for k, v in t.items()}
    return out


def dump_state(engine, label: str, rank: int):
    """$LLAMA_TRAIN_DUMP_STATE=DIR: write the gathered state (gathered_state) to DIR/<label>.pt,
    for comparing the engine before a save with the engine after a resume. Collective."""
    where = os.environ.get("LLAMA_TRAIN_DUMP_STATE")
    if not where:
        return
    state = gathered_state(engine)
    if rank == 0:
        os.makedirs(where, exist_ok=True)
        torch.save(state, os.path.join(where, f"{label}.pt"))


# --- shapes: what may be loaded into which model ---


def expected_shapes(module) -> dict[str, torch.Size]:
    """Full parameter shapes of a (possibly ZeRO-3-partitioned) module, by name."""
    return {n: getattr(p, "ds_shape", p.shape) for n, p in module.named_parameters()}


# --- what the trainers call: resuming ---


def load_neutral(engine, start: "resuming.Resume"):
    """Load `start` into `engine` through the neutral form, whatever wrote it. Collective."""
    load_into(engine, open_checkpoint(start.path, start.state), start.step)


def resumed(engine, args, start: "resuming.Resume", meta: dict, plan, rank: int) -> int:
    """After loading `start` into `engine`: the skipped-step count, RNG (restored rank by rank, or
    reseeded when the world size changed), one log line saying what moved how, a `resume` metrics record. Returns the step."""
    was, now, as_saved = start.form, meta["layout"], start.native
    engine.skipped_steps = start.state.get("skipped_steps", engine.skipped_steps)  # native or converted
    reapply_schedule(engine.lr_scheduler)  # this run's schedule (e.g. a WSD branch's decay) from this step on
    if was.get("world_size") == now["world_size"]:
        resuming.restore_rng(start.path, rank)
        rng = "RNG restored rank by rank"
    else:
        resuming.reseed(args.seed, start.step, rank)
        rng = "RNG reseeded from (seed, step, rank) for the new world size"
    state = optimizer_spec(args.optimizer).carries
    how = "as saved" if as_saved else f"converted: fp32 weights, {state} and step, LR schedule"
    if scaler := loss_scale_of(engine):  # fp16: the scale it goes on with, the checkpoint's
        how += f"; fp16 loss scale {scaler['scale']:g}"
    moved = f"{ckpt.describe(was)} -> {ckpt.describe(now)}, {how}" if was != now else how
    data = f"data at epoch {plan.start.epoch}, sample {plan.start.consumed} of {plan.num_samples}"
    before = start.state.get("global_batch", plan.global_batch)
    if before != plan.global_batch:
        data += f" (global batch {before} -> {plan.global_batch}; the LR schedule stays in optimizer steps)"
    if changed := data_changes(start.state.get("data"), meta["data"]):  # --allow_data_change
        data += f"; data changed ({'; '.join(changed)}): its new order from that sample count on"
    print0(f"resumed from {start.path} at step {start.step} ({moved}); {data}; {rng}", rank=rank)
    if rank == 0:
        from llama_train.telemetry.metrics import MetricsWriter

        record = {
            "step": start.step,
            "checkpoint": start.path,
            "from": was,
            "to": now,
            "native": as_saved,
        }
        MetricsWriter(args.output_dir, rank).write("resume", **record)
    dump_state(engine, f"resumed_{start.step}", rank)
    return start.step
