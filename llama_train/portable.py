"""Moving a run across strategies and world sizes, and starting a run from existing weights.

One strategy-neutral form, in memory: per parameter (by its name in the model) the fp32 weight and
AdamW's `exp_avg` / `exp_avg_sq`, plus AdamW's step count and the LR schedule. A `Source` reads it
from any of our checkpoints, one parameter at a time (files are memory-mapped, so a rank holds one
merged parameter at a time, not the model):

    ddp/ fsdp2/     model.pt + optimizer.pt (torch state dicts; optimizer index -> name by the
                    groups trainer_state.json records; FSDP2 writes them gathered: llama_train/fsdp.py)
    deepspeed-zero0 mp_rank_00_model_states.pt: the module and torch AdamW's state dict (fp32), or
                    the fp32 master groups of DeepSpeed's fp16/bf16 wrapper
    deepspeed-zero1/2  zero_pp_rank_*_optim_states.pt: flat fp32 partitions per group, params packed
                    in `param_shapes` order (+ alignment paddings), merged as zero_to_fp32 merges them
    deepspeed-zero3 every parameter partitioned on its own (ceil(numel / world) per rank)

or weights alone (`--init_from`: an HF directory, one of our exports, a .safetensors/.pt state dict
or any checkpoint). `load_into(engine, source)` writes it into a live engine of any kind: the DDP
trainer's torch AdamW, DeepSpeed's ZeRO-0 AdamW (or its fp32 masters), ZeRO-1/2/3 (with or without
CPU offload) through DeepSpeed's public `safe_set_full_fp32_param` / `safe_set_full_optimizer_state`.

Every read is safe: safetensors, or `torch.load(weights_only=True)` with three plain DeepSpeed data
classes allowed (loss scaler, ZeRO stage enum, fragment address). A file holding anything else is
refused without running it.
"""

import glob
import os
import pickle
from math import ceil

import torch

from llama_train import checkpoint as ckpt
from llama_train.checkpoint import CheckpointError
from llama_train.dist import print0
from llama_train.model import ModelArgs, Transformer

MOMENTS = ("exp_avg", "exp_avg_sq")
FULL_STATE = {"ddp", "fsdp2"}  # the DDP trainer's strategies: full state dicts, the same files


def _deepspeed_data_classes() -> list:
    """The non-tensor objects DeepSpeed 0.19 pickles into its checkpoints: plain data, no code."""
    try:
        from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
        from deepspeed.runtime.zero.config import ZeroStageEnum
        from deepspeed.utils.tensor_fragment import fragment_address
    except ImportError:  # no DeepSpeed: DDP checkpoints hold none of them
        return []
    return [LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address]


def safe_load(path: str, mmap: bool = True):
    """torch.load that never runs code from the file (weights_only), memory-mapped by default."""
    try:
        with torch.serialization.safe_globals(_deepspeed_data_classes()):
            return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as e:
        lines = str(e).splitlines()
        reason = next((line.strip() for line in lines if "Unsupported" in line), lines[0] if lines else "")
        raise CheckpointError(
            f"refused to load {path}: it holds Python objects other than tensors and plain data, which "
            f"could run code when unpickled ({reason[:200]}). Load only checkpoints from a trusted source"
        ) from None
    except (RuntimeError, EOFError) as e:
        first = (str(e).splitlines() or [""])[0]
        raise CheckpointError(f"cannot read {path}: {first[:200]} (truncated, or not a torch file)") from None


# --- sources: a checkpoint (or weights) by parameter name ---


class Source:
    """Per parameter name: {"fp32": weight, "exp_avg", "exp_avg_sq"} (moments absent for weights
    only). `step`: AdamW's update count (None: weights only); `lr_scheduler`: its state dict."""

    kind = "weights"
    step: int | None = None
    lr_scheduler: dict | None = None

    def shapes(self) -> dict[str, torch.Size]:
        raise NotImplementedError

    def tensors(self, name: str) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def weight(self, name: str) -> torch.Tensor:
        return self.tensors(name)["fp32"]


class TorchSource(Source):
    """Full tensors by name: a state dict, and optionally a torch optimizer's state dict whose
    groups hold the parameters `group_names` names, in order."""

    def __init__(self, weights: dict, optimizer: dict | None = None, group_names=None, lr_scheduler=None):
        self.weights, self.lr_scheduler = weights, lr_scheduler
        self.moments, self.step = {}, None
        if optimizer is not None:
            ids = [i for g in optimizer["param_groups"] for i in g["params"]]
            names = [n for g in group_names for n in g]
            if len(ids) != len(names):
                raise CheckpointError(
                    f"the optimizer state holds {len(ids)} parameters, the model {len(names)}: not this model's"
                )
            self.moments = {n: optimizer["state"].get(i, {}) for n, i in zip(names, ids)}
            steps = {_step_count(s["step"]) for s in self.moments.values() if "step" in s}
            self.step = max(steps) if steps else 0

    def shapes(self):
        names = self.moments or self.weights
        return {n: self.weights[n].shape for n in names}

    def tensors(self, name):
        out = {"fp32": self.weights[name].float()}
        out.update({k: v.float() for k, v in self.moments.get(name, {}).items() if k in MOMENTS})
        return out


def _step_count(step) -> int:
    return int(step.item()) if torch.is_tensor(step) else int(step)


def _slice(parts: list[torch.Tensor], start: int, length: int) -> torch.Tensor:
    """Elements start .. start+length of the concatenation of `parts`, copying only those."""
    out, offset = [], 0
    for p in parts:
        lo, hi = max(start, offset), min(start + length, offset + p.numel())
        if lo < hi:
            out.append(p[lo - offset : hi - offset])
        offset += p.numel()
    return torch.cat(out) if len(out) > 1 else out[0].clone()


class ZeroSource(Source):
    """DeepSpeed ZeRO-1/2/3 shards: every rank's optimizer file, memory-mapped; a parameter is
    merged from the ranks' pieces when asked for."""

    def __init__(self, ckpt_dir: str):
        files = sorted(glob.glob(os.path.join(ckpt_dir, "*zero_pp_rank_*_optim_states.pt")), key=_rank_of)
        self.world = len(files)
        self.ranks = [safe_load(f)["optimizer_state_dict"] for f in files]
        model_file = _model_states_file(ckpt_dir)
        model = safe_load(model_file)
        self.lr_scheduler, self.param_shapes = model.get("lr_scheduler"), model["param_shapes"]
        first = self.ranks[0]
        self.stage3 = "fp32_flat_groups" in first
        base = first["optimizer_state_dict" if self.stage3 else "base_optimizer_state"]
        steps = [_step_count(s["step"]) for s in base["state"].values() if "step" in s]
        groups = [g.get("step") for g in base["param_groups"] if "step" in g]
        self.step = max(steps or [_step_count(s) for s in groups] or [0])
        self._where = self._layout_zero3() if self.stage3 else self._layout_flat()

    def _layout_flat(self) -> dict:
        """name -> (group, offset in the group's merged flat vector, shape)."""
        paddings = self.ranks[0].get("param_alignment_paddings")
        where = {}
        for g, shapes in enumerate(self.param_shapes):
            offset = 0
            for i, (name, shape) in enumerate(shapes.items()):
                where[name] = (g, offset, torch.Size(shape))
                offset += torch.Size(shape).numel() + (paddings[g][i] if paddings else 0)
        return where

    def _layout_zero3(self) -> dict:
        """name -> (offset in every rank's flat vector, partition numel, shape)."""
        where, offset = {}, 0
        for shapes in self.param_shapes:
            for name, shape in shapes.items():
                part = ceil(torch.Size(shape).numel() / self.world)
                where[name] = (offset, part, torch.Size(shape))
                offset += part
        return where

    def _flat(self, rank: int, key: str) -> list[torch.Tensor]:
        """This rank's flat tensors per group (ZeRO-3: sub-group) for fp32 or a moment."""
        sd = self.ranks[rank]
        if key == "fp32":
            return sd["fp32_flat_groups" if self.stage3 else "single_partition_of_fp32_groups"]
        state = sd["optimizer_state_dict" if self.stage3 else "base_optimizer_state"]["state"]
        return [state[g][key] for g in sorted(state)]

    def shapes(self):
        return {name: w[-1] for name, w in self._where.items()}

    def tensors(self, name):
        keys = ("fp32", *MOMENTS) if self.step else ("fp32",)
        return {key: self._merged(name, key) for key in keys}

    def weight(self, name):
        return self._merged(name, "fp32")

    def _merged(self, name: str, key: str) -> torch.Tensor:
        if self.stage3:
            offset, part, shape = self._where[name]
            pieces = [_slice(self._flat(r, key), offset, part) for r in range(self.world)]
            return torch.cat(pieces)[: shape.numel()].view(shape).float()
        group, offset, shape = self._where[name]
        parts = [self._flat(r, key)[group] for r in range(self.world)]
        return _slice(parts, offset, shape.numel()).view(shape).float()


def _rank_of(path: str) -> int:
    return int(os.path.basename(path).split("zero_pp_rank_")[1].split("_")[0])


def _model_states_file(ckpt_dir: str) -> str:
    """DeepSpeed's model-states file (ZeRO-3 writes one per rank; rank 0's names all parameters)."""
    for name in ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_model_states.pt"):
        if os.path.exists(os.path.join(ckpt_dir, name)):
            return os.path.join(ckpt_dir, name)
    raise CheckpointError(f"{ckpt_dir}: no DeepSpeed model states file (mp_rank_00_model_states.pt) in it")


def _zero0_source(ckpt_dir: str, state: dict) -> TorchSource:
    """DeepSpeed without ZeRO: the module and the optimizer in one file. fp32: torch AdamW's state
    dict over the module's parameters; bf16/fp16: DeepSpeed's wrapper holds fp32 master groups and
    the inner AdamW's state over them."""
    sd = safe_load(os.path.join(ckpt_dir, "mp_rank_00_model_states.pt"))
    optimizer, weights, groups = sd.get("optimizer"), dict(sd["module"]), _group_names(state)
    if optimizer and "fp32_groups" in optimizer:  # the fp16/bf16 wrapper: masters by group order
        names = groups or _match_groups(optimizer["fp32_groups"], state["model"])
        weights.update({n: t for g, ts in zip(names, optimizer["fp32_groups"]) for n, t in zip(g, ts)})
        optimizer, groups = optimizer.get("optimizer_state_dict"), names
    elif optimizer:
        groups = groups or _match_groups(
            [[optimizer["state"][i]["exp_avg"] for i in g["params"]] for g in optimizer["param_groups"]],
            state["model"],
        )
    return TorchSource(weights, optimizer, groups, sd.get("lr_scheduler"))


def _group_names(state: dict) -> list[list[str]] | None:
    return state.get("optimizer_groups")


def _match_groups(groups: list[list[torch.Tensor]], model: dict) -> list[list[str]]:
    """Names of optimizer groups saved without them (checkpoints from before `optimizer_groups`
    was recorded): our AdamW groups rebuilt on a meta model, either --decay_all_params, matched by shape."""
    from llama_train.optim import param_groups

    with torch.device("meta"):
        net = Transformer(ModelArgs(**model))
    names = {id(p): n for n, p in net.named_parameters()}
    shapes = [[tuple(t.shape) for t in g] for g in groups]
    for decay_all in (False, True):
        ours = [g["params"] for g in param_groups(net, 0.0, decay_all) if g["params"]]
        if [[tuple(p.shape) for p in g] for g in ours] == shapes:
            return [[names[id(p)] for p in g] for g in ours]
    raise CheckpointError("cannot match the checkpoint's optimizer groups to the model's parameters")


def checkpoint_source(ckpt_dir: str, state: dict) -> Source:
    """The neutral form of one of our checkpoints (verified before: trainer_state.json is `state`)."""
    if os.path.exists(os.path.join(ckpt_dir, "model.pt")):  # the DDP trainer's
        weights = safe_load(os.path.join(ckpt_dir, "model.pt"))
        optimizer = safe_load(os.path.join(ckpt_dir, "optimizer.pt"))
        scheduler = safe_load(os.path.join(ckpt_dir, "scheduler.pt"))
        groups = _group_names(state) or _match_groups(
            [[optimizer["state"][i]["exp_avg"] for i in g["params"]] for g in optimizer["param_groups"]],
            state["model"],
        )
        source = TorchSource(weights, optimizer, groups, scheduler)
    elif glob.glob(os.path.join(ckpt_dir, "*zero_pp_rank_*_optim_states.pt")):
        source = ZeroSource(ckpt_dir)
    elif os.path.exists(os.path.join(ckpt_dir, "mp_rank_00_model_states.pt")):
        source = _zero0_source(ckpt_dir, state)
    else:
        raise CheckpointError(f"{ckpt_dir}: neither a DDP nor a DeepSpeed checkpoint (no model files in it)")
    source.kind = describe(state.get("layout") or {"strategy": state.get("strategy"), **state})
    return source


def describe(layout: dict) -> str:
    """'deepspeed-zero2 x2 ranks (float32, optimizer offloaded)' for log lines."""
    world = layout.get("world_size")
    text = f"{layout.get('strategy')} x{world} rank{'s' if world != 1 else ''}"
    extras = [layout["dtype"]] if layout.get("dtype") else []
    extras += [f"{what} offloaded" for what in ("optimizer", "params") if layout.get(f"offload_{what}")]
    return text + (f" ({', '.join(extras)})" if extras else "")


# --- writing the neutral form into a live engine ---


def is_deepspeed(engine) -> bool:
    return hasattr(engine, "zero_optimization_stage") and hasattr(engine, "global_steps")


def load_into(engine, source: Source, step: int):
    """Weights, AdamW moments and step count, LR schedule of `source` into `engine` (the DDP trainer's
    DDPEngine or a DeepSpeed engine of any stage); `step` = the trainer step reached. Collective."""
    check_shapes(source.shapes(), expected_shapes(engine.module), what=f"checkpoint ({source.kind})")
    if hasattr(engine, "load_source"):  # FSDP2 (ddp.FSDPEngine): full tensors in, sharded by torch
        engine.load_source(source)
    elif not is_deepspeed(engine):
        _into_torch(engine.optimizer, _trained(engine.module, None), source)
    elif any(hasattr(p, "ds_id") or hasattr(p, "_hp_mapping") for p in engine.module.parameters()):
        _into_partitioned(engine, source)  # ZeRO-1/2/3 (and DeepSpeed's bf16 optimizer)
    else:  # ZeRO-0: torch AdamW over the module's parameters, or over fp32 masters (bf16/fp16)
        from llama_train.ds_compat import zero0_fp32_master

        masters = zero0_fp32_master(engine)
        optimizer = engine.optimizer.optimizer if masters else engine.optimizer
        _into_torch(optimizer, _trained(engine.module, masters or None), source)
    _restore_schedule(engine.lr_scheduler, source.lr_scheduler)
    if is_deepspeed(engine):
        engine.global_steps, engine.global_samples = step, step * engine.train_batch_size()


def _trained(module, masters) -> list[tuple[str, torch.nn.Parameter, torch.Tensor]]:
    """(name, module parameter, the tensor the optimizer steps for it) for every parameter."""
    if masters is None:
        return [(n, p, p) for n, p in module.named_parameters()]
    return [(n, p, masters[id(p)]) for n, p in module.named_parameters()]


@torch.no_grad()
def _into_torch(optimizer, params, source: Source):
    """A torch optimizer over full tensors: copy the weights, then load AdamW's state through
    torch's own load_state_dict (which places `step` as the fused kernel wants it)."""
    index = {id(t): i for i, t in enumerate(t for g in optimizer.param_groups for t in g["params"])}
    state = {}
    for name, param, stepped in params:
        tensors = source.tensors(name)
        stepped.copy_(tensors["fp32"])
        param.copy_(tensors["fp32"])  # the module's copy (bf16/fp16: rounded, as DeepSpeed keeps it)
        if source.step is not None:
            moments = {k: tensors.get(k, torch.zeros_like(tensors["fp32"])) for k in MOMENTS}
            state[index[id(stepped)]] = {"step": torch.tensor(float(source.step)), **moments}
    if source.step is not None:
        groups = optimizer.state_dict()["param_groups"]
        optimizer.load_state_dict({"state": state, "param_groups": groups})
        _set_group_step(optimizer, source.step)


@torch.no_grad()
def _into_partitioned(engine, source: Source):
    """ZeRO-1/2/3: AdamW's state is created in the optimizer's own format (zeros), then every
    parameter's fp32 master and moments are set through DeepSpeed's public setters, each rank
    keeping its partition; the module's (low-precision) weights follow."""
    from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state

    from llama_train import ds_compat

    ds_compat.create_adam_state(engine, source.step or 0)
    stage3 = engine.zero_optimization_stage() == 3
    for name, param in engine.module.named_parameters():
        tensors = source.tensors(name)
        if stage3:
            ds_compat.zero3_set_full(engine.optimizer, param, tensors)
            _set_zero3_module_param(param, tensors["fp32"])
            continue
        safe_set_full_fp32_param(param, tensors["fp32"])
        for key in MOMENTS:
            safe_set_full_optimizer_state(param, tensors[key], key)
        param.data.copy_(tensors["fp32"])
    _set_group_step(engine.optimizer, source.step or 0)


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


def _restore_schedule(scheduler, state: dict | None):
    """The LR schedule's position, and the LR its optimizer's groups use for the next step."""
    if state is None:
        return
    scheduler.load_state_dict(state)
    for group, lr in zip(scheduler.optimizer.param_groups, scheduler.get_last_lr()):
        group["lr"] = lr


# --- what a run's checkpoints record about their layout, and gathered state for comparisons ---


def layout_of(engine, strategy: str, world: int, dtype: str) -> dict:
    """What a checkpoint's files depend on: loading is DeepSpeed's (or torch's) own only when
    this is unchanged; otherwise the state goes through the neutral form."""
    offload = {}
    if is_deepspeed(engine):
        offload = {
            "offload_optimizer": engine.zero_offload_optimizer() is not None,
            "offload_params": engine.zero_offload_param() is not None,
        }
    elif getattr(engine, "offloaded", False):  # FSDP2's CPUOffloadPolicy: params, grads, AdamW state
        offload = {"offload_optimizer": True, "offload_params": True}
    return {"strategy": strategy, "world_size": world, "dtype": dtype, **offload}


def optimizer_groups(engine) -> list[list[str]] | None:
    """Parameter names per optimizer group, in order, where the optimizer holds whole parameters
    (the DDP trainer, DeepSpeed ZeRO-0): what turns optimizer.pt's indices back into names."""
    module = engine.module
    names = {id(p): n for n, p in module.named_parameters()}
    optimizer = engine.optimizer
    if is_deepspeed(engine):
        from llama_train.ds_compat import zero0_fp32_master

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
        from llama_train.ds_compat import relink_hp_optimizer_state, zero0_fp32_master

        relink_hp_optimizer_state(engine)
        masters = zero0_fp32_master(engine)
    optimizer = engine.optimizer.optimizer if masters else engine.optimizer
    for name, p in engine.module.named_parameters():
        if is_deepspeed(engine) and engine.zero_optimization_stage() > 0:
            from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

            t = {"fp32": safe_get_full_fp32_param(p)}
            t.update({k: safe_get_full_optimizer_state(p, k) for k in MOMENTS})
        else:
            stepped = masters.get(id(p), p)
            state = optimizer.state.get(stepped, {})
            t = {"fp32": stepped, **{k: state.get(k) for k in MOMENTS}}
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


def check_shapes(have: dict, want: dict, what: str):
    """Refuse, naming every parameter that is missing, extra or shaped otherwise."""
    problems = [
        f"{n}: {what} {tuple(have[n])}, model {tuple(s)}"
        for n, s in want.items()
        if n in have and tuple(have[n]) != tuple(s)
    ]
    problems += [f"{n}: missing from the {what}" for n in want if n not in have]
    problems += [f"{n}: in the {what}, not in the model" for n in have if n not in want]
    if problems:
        raise CheckpointError(
            f"the {what} does not fit the model the flags describe:\n  - " + "\n  - ".join(problems)
        )


# --- what the trainers call: the checkpoint record, resuming, consolidated weights ---


def run_meta(args, record: dict, engine, split=None) -> dict:
    """What every checkpoint of this run records beside its state (trainer_state.json); `split`: the
    run's llama_train.parallel.Layout."""
    layout = layout_of(engine, record["strategy"], record["world_size"], record["dtype"])
    return {
        **ckpt.run_shape(args, record["world_size"], split),
        "model": record["model"],
        "strategy": record["strategy"],
        "layout": layout,
        "optimizer_groups": optimizer_groups(engine),
    }


def native(start: "ckpt.Resume", meta: dict) -> bool:
    """Whether `start` loads with the engine's own loader: DeepSpeed's files fit only the same
    stage, world size, dtype and offload; the DDP trainer's full state dicts (DDP's or FSDP2's) fit
    either of them at any world size."""
    was, now = start.layout, meta["layout"]
    was_split, now_split = start.state.get("model_parallel"), meta.get("model_parallel")
    if (was_split or now_split) and (was_split != now_split or was != now):
        raise CheckpointError(
            f"cannot resume from {start.path}: model_parallel: checkpoint {was_split!r}, now {now_split!r} "
            f"(world size {was.get('world_size')}, now {now['world_size']}): a tensor-, sequence- or "
            "pipeline-parallel run continues only in the layout and world size it was saved in; to change "
            "them, export it (scripts/export_hf.py) and start a new run from it with --init_from"
        )
    return was == now or {was.get("strategy"), now["strategy"]} <= FULL_STATE


def load_neutral(engine, start: "ckpt.Resume"):
    """Load `start` into `engine` through the neutral form, whatever wrote it. Collective."""
    load_into(engine, checkpoint_source(start.path, start.state), start.step)


def resumed(engine, args, start: "ckpt.Resume", meta: dict, plan, rank: int) -> int:
    """After loading `start` into `engine`: RNG (restored rank by rank, or reseeded when the world
    size changed), one log line saying what moved how, a `resume` metrics record. Returns the step."""
    was, now, as_saved = start.layout, meta["layout"], native(start, meta)
    if was.get("world_size") == now["world_size"]:
        ckpt.restore_rng(start.path, rank)
        rng = "RNG restored rank by rank"
    else:
        ckpt.reseed(args.seed, start.step, rank)
        rng = "RNG reseeded from (seed, step, rank) for the new world size"
    how = "as saved" if as_saved else "converted: fp32 weights, AdamW moments and step, LR schedule"
    moved = f"{describe(was)} -> {describe(now)}, {how}" if was != now else how
    data = f"data at epoch {plan.start.epoch}, sample {plan.start.consumed} of {plan.num_samples}"
    before = start.state.get("global_batch", plan.global_batch)
    if before != plan.global_batch:
        data += f" (global batch {before} -> {plan.global_batch}; the LR schedule stays in optimizer steps)"
    print0(f"resumed from {start.path} at step {start.step} ({moved}); {data}; {rng}", rank=rank)
    if rank == 0:
        from llama_train.metrics import MetricsWriter

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


def consolidated_state_dict(ckpt_dir: str) -> tuple[dict, dict]:
    """(full fp32 state dict, the run's model args as a dict) of any of our checkpoints, read
    safely (for export, evaluation, generation)."""
    state = ckpt.verify_checkpoint(ckpt_dir)
    return checkpoint_weights(ckpt_dir, state)[0], state["model"]


def checkpoint_weights(ckpt_dir: str, state: dict) -> tuple[dict, str]:
    """(full fp32 state dict, what kind of checkpoint) of a verified checkpoint of any strategy:
    tensor-parallel shards and pipeline stages merged, ZeRO partitions through the neutral form."""
    from llama_train import parallel  # DeepSpeed's pipeline module, only for these

    if kind := parallel.checkpoint_kind(ckpt_dir):
        try:
            sd = parallel.merged_checkpoint_state(ckpt_dir)
        except ValueError as e:
            raise CheckpointError(str(e)) from None
        return {k: v.float() for k, v in sd.items()}, f"{kind} parallel"
    source = checkpoint_source(ckpt_dir, state)
    sd = {name: source.weight(name) for name in source.shapes()}
    if state["model"].get("tie_embeddings") and "tok_embeddings.weight" in sd:
        sd["output.weight"] = sd["tok_embeddings.weight"]
    return sd, source.kind
