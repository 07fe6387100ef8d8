"""Reading every checkpoint format, safely: the one `torch.load` of the package is safe_load's.

    state dict file     .safetensors, or a .pt of name -> tensor (ours or transformers' names)
    ddp/ fsdp2/         model.pt + optimizer.pt (+ scheduler.pt): torch state dicts; optimizer index
                        -> name by the groups trainer_state.json records (FSDP2 writes them gathered)
    deepspeed-zero0     mp_rank_00_model_states.pt: the module and torch AdamW's state dict (fp32),
                        or the fp32 master groups of DeepSpeed's fp16/bf16 wrapper
    deepspeed-zero1/2   zero_pp_rank_*_optim_states.pt: flat fp32 partitions per group, params packed
                        in `param_shapes` order (+ alignment paddings), merged as zero_to_fp32 does
    deepspeed-zero3     every parameter partitioned on its own (ceil(numel / world) per rank)
    tensor parallel     mp_rank_XX_model_states.pt, one per TP rank: the shards concatenated along
                        the dimension they were cut (parallel.merge_tp_shards)
    pipeline parallel   layer_XX-model_states.pt, one per pipeline layer (parallel.merge_stages)

A checkpoint of any strategy reads as a `Reader` (open_checkpoint): per parameter name the fp32 weight
and its optimizer state under the optimizer's own keys, full tensors (AdamW's `exp_avg` / `exp_avg_sq`,
or what the optimizer's record in llama_train/optim/ keeps for the parameters it takes: the
strategy-neutral form each engine loads: Engine.load_neutral), files memory-mapped, so a rank holds
one merged parameter at a time, not the model. Converting what is read (transformers' names, shapes
checked against the flags' model, the tools' entry points) is weights.py's.

Every read is safe: safetensors, or `torch.load(weights_only=True)` with four plain DeepSpeed data
classes allowed (loss scalers, the ZeRO stage enum, a fragment address); the other files DeepSpeed
writes (model states with their ds_config, pipeline layers) hold tensors and plain data only. A file
holding anything else is refused without running it. The one load that unpickles fully is not here:
a same-layout DeepSpeed resume goes through DeepSpeed's own engine.load_checkpoint
(train_deepspeed.py), after every file's sha256 was checked against the checkpoint's manifest.
"""

import os
import pickle
import re
from bisect import bisect_right
from itertools import accumulate
from math import ceil

import torch

from llama_train.checkpoint.store import describe, form_of
from llama_train.distributed.parallel import merge_stages, merge_tp_shards
from llama_train.errors import CheckpointError
from llama_train.model import ModelArgs, Transformer
from llama_train.optim.adamw import ADAMW
from llama_train.optim.registry import optimizer_spec
from llama_train.optim.spec import OptimizerSpec


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
        reason = reason.split(" was not an allowed global")[0]  # not torch's advice to allow it
        raise CheckpointError(
            f"refused to load {path}: it holds Python objects other than tensors and plain data, which "
            f"could run code when unpickled ({reason[:200]}). Load only checkpoints from a trusted source"
        ) from None
    except (RuntimeError, EOFError) as e:
        first = (str(e).splitlines() or [""])[0]
        raise CheckpointError(f"cannot read {path}: {first[:200]} (truncated, or not a torch file)") from None


def load_state_dict_file(path: str) -> dict:
    if path.endswith(".safetensors"):
        from safetensors.torch import load_file

        return load_file(path)
    sd = safe_load(path, mmap=False)
    if not isinstance(sd, dict) or not all(torch.is_tensor(v) for v in sd.values()):
        raise CheckpointError(f"--init_from {path}: not a state dict (name -> tensor)")
    return sd


# --- model-parallel checkpoints: per-TP-rank modules, per-layer pipeline files ---

PIPELINE_LAYER_FILE = re.compile(r"layer_(\d+)-model_states\.pt")  # DeepSpeed's per-layer files
MODEL_STATES_FILE = "mp_rank_{:02d}_model_states.pt"  # one per tensor-parallel rank (or pipeline stage)


def checkpoint_kind(ckpt_dir: str) -> str | None:
    """Which model-parallel checkpoint `ckpt_dir` is: pipeline (per-layer files), tensor (a module
    file per TP rank), or None."""
    files = os.listdir(ckpt_dir)
    if any(PIPELINE_LAYER_FILE.fullmatch(f) for f in files):
        return "pipeline"
    if MODEL_STATES_FILE.format(1) in files and not any(f.startswith("layer_") for f in files):
        return "tensor"
    return None


def merged_checkpoint_state(ckpt_dir: str) -> dict:
    """The full state dict of a tensor- or pipeline-parallel DeepSpeed checkpoint (its module
    weights: the fp32 master for fp32 runs). A bf16/fp16 run's fp32 master lives in per-rank
    optimizer shards that zero_to_fp32 cannot tell apart from data-parallel ones: refused, as rounding
    to the module's 16-bit weights would change the model silently. Its files hold plain data only
    (the ds_config is a dict): read like every other file, by safe_load."""
    meta = safe_load(os.path.join(ckpt_dir, MODEL_STATES_FILE.format(0)))
    config = meta.get("ds_config") or {}
    if any((config.get(k) or {}).get("enabled") for k in ("bf16", "fp16")):
        raise CheckpointError(
            f"{ckpt_dir}: a model-parallel checkpoint of a bf16/fp16 run keeps its fp32 master weights in "
            "per-rank optimizer shards that this exporter does not merge; use the run's own <output_dir>/hf "
            "export (written from the master weights), or resume and export with the trainer"
        )
    load = lambda f: safe_load(os.path.join(ckpt_dir, f))  # noqa: E731
    if checkpoint_kind(ckpt_dir) == "pipeline":
        layers = sorted(
            (int(m[1]), m[0]) for f in os.listdir(ckpt_dir) if (m := PIPELINE_LAYER_FILE.fullmatch(f))
        )
        return merge_stages([{f"{i}.{k}": v for k, v in load(f).items()} for i, f in layers])
    tp = len([f for f in os.listdir(ckpt_dir) if re.fullmatch(r"mp_rank_\d+_model_states\.pt", f)])
    return merge_tp_shards([load(MODEL_STATES_FILE.format(r))["module"] for r in range(tp)])


# --- readers: a checkpoint of any strategy in the neutral form, by parameter name ---


def neutral_loss_scale(saved) -> dict | None:
    """fp16's dynamic loss scaler in the neutral form, {"scale", "good_steps" (updates since the last
    overflow), "hysteresis" (DeepSpeed's only)}, from what a checkpoint or a live engine holds: the DDP
    trainer's GradScaler state dict, DeepSpeed ZeRO-1/2/3's DynamicLossScaler, ZeRO-0's FP16 optimizer
    state dict (or its LossScaleConfig). None for anything else (fp32/bf16: no scaler, a static scale)."""
    get = saved.get if isinstance(saved, dict) else lambda key, default=None: getattr(saved, key, default)
    if get("_growth_tracker") is not None:  # torch's GradScaler (empty when disabled: fp32/bf16)
        return {"scale": float(get("scale")), "good_steps": int(get("_growth_tracker"))}
    if not (get("dynamic") or get("dynamic_loss_scale")) or get("cur_scale") is None:
        return None
    good = int(get("cur_iter")) - int(get("last_overflow_iter", -1)) - 1
    out = {"scale": float(get("cur_scale")), "good_steps": good}
    if get("cur_hysteresis") is not None:
        out["hysteresis"] = int(get("cur_hysteresis"))
    return out


class Reader:
    """Per parameter name: {"fp32": weight, "exp_avg", "exp_avg_sq"}, or the fp32 weight and the state keys
    of the optimizer that took the parameter (`optimizer`: the run's record; absent for weights only).
    `step`: AdamW's update count (None:
    weights only); `lr_scheduler`: its state dict; `loss_scale`: fp16's dynamic loss scaler
    (neutral_loss_scale; None without one)."""

    kind = "weights"
    optimizer: OptimizerSpec = ADAMW
    step: int | None = None
    lr_scheduler: dict | None = None
    loss_scale: dict | None = None

    def shapes(self) -> dict[str, torch.Size]:
        raise NotImplementedError

    def tensors(self, name: str) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def weight(self, name: str) -> torch.Tensor:
        return self.tensors(name)["fp32"]


class TorchReader(Reader):
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
        out.update(
            {k: v.float() for k, v in self.moments.get(name, {}).items() if k in self.optimizer.state_keys}
        )
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


class ZeroReader(Reader):
    """DeepSpeed ZeRO-1/2/3 shards: every rank's optimizer file, memory-mapped; a parameter is
    merged from the ranks' pieces when asked for. A parameter's optimizer state is what its group
    holds: partitioned like the fp32 weights (AdamW's moments), or, for the `optimizer`'s whole_keys,
    whole matrices at ZeRO-1/2 (_whole_layout; ZeRO-3 partitions them like the weights)."""

    def __init__(self, files: list[str], ckpt_dir: str, optimizer: OptimizerSpec = ADAMW):
        self.optimizer = optimizer
        self.world = len(files)  # zero_shard_files: the checkpoint's own ranks
        self.ranks = [safe_load(f)["optimizer_state_dict"] for f in files]
        model_file = _model_states_file(ckpt_dir)
        model = safe_load(model_file)
        self.lr_scheduler, self.param_shapes = model.get("lr_scheduler"), model["param_shapes"]
        first = self.ranks[0]
        self.stage3 = "fp32_flat_groups" in first
        base = self._base(0)
        steps = [_step_count(s["step"]) for s in base["state"].values() if "step" in s]
        groups = [g.get("step") for g in base["param_groups"] if "step" in g]
        self.step = max(steps or [_step_count(s) for s in groups] or [0])
        self.loss_scale = neutral_loss_scale(first.get("loss_scaler"))
        self._where = self._layout_zero3() if self.stage3 else self._layout_flat()
        self._whole = {} if self.stage3 else self._whole_layout()

    def _base(self, rank: int) -> dict:
        """The inner optimizer's state dict on `rank` (state by group, or ZeRO-3 sub-group, index)."""
        return self.ranks[rank]["optimizer_state_dict" if self.stage3 else "base_optimizer_state"]

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
        """name -> (sub-group, offset in every rank's flat vector, partition numel, shape)."""
        ends = list(accumulate(t.numel() for t in self.ranks[0]["fp32_flat_groups"]))
        where, offset = {}, 0
        for shapes in self.param_shapes:
            for name, shape in shapes.items():
                part = ceil(torch.Size(shape).numel() / self.world)
                where[name] = (bisect_right(ends, offset), offset, part, torch.Size(shape))
                offset += part
        return where

    def _whole_layout(self) -> dict:
        """ZeRO-1/2, a group whose state is kept whole (the optimizer's whole_keys): every rank holds the
        whole state of each matrix its partition touches, one after another in group order (DeepSpeed
        0.19.8's get_flat_partition, not offloaded); name -> (the first such rank, start in its buffer)."""
        out = {}
        for g, shapes in enumerate(self.param_shapes):
            if not set(self.optimizer.whole_keys) & set(self._base(0)["state"].get(g, {})):
                continue
            size = self.ranks[0]["single_partition_of_fp32_groups"][g].numel()
            for r in range(self.world):
                start = 0
                for name in shapes:
                    _, offset, shape = self._where[name]
                    if offset < (r + 1) * size and offset + shape.numel() > r * size:
                        out.setdefault(name, (r, start))
                        start += shape.numel()
        return out

    def _flat(self, rank: int, key: str) -> list[torch.Tensor]:
        """This rank's flat tensors per group (ZeRO-3: sub-group) for fp32 or a state key; a group
        without that key (one optimizer's half beside AdamW's) stands in with its length only, never read."""
        sd = self.ranks[rank]
        fp32 = sd["fp32_flat_groups" if self.stage3 else "single_partition_of_fp32_groups"]
        if key == "fp32":
            return fp32
        state = self._base(rank)["state"]
        return [state.get(g, {}).get(key, torch.zeros(()).expand(t.numel())) for g, t in enumerate(fp32)]

    def shapes(self):
        return {name: w[-1] for name, w in self._where.items()}

    def tensors(self, name):
        group = self._where[name][0]
        held = self._base(0)["state"].get(group, {}) if self.step else {}
        return {
            key: self._merged(name, key)
            for key in ("fp32", *(k for k in self.optimizer.state_keys if k in held))
        }

    def weight(self, name):
        return self._merged(name, "fp32")

    def _merged(self, name: str, key: str) -> torch.Tensor:
        if self.stage3:
            _, offset, part, shape = self._where[name]
            pieces = [_slice(self._flat(r, key), offset, part) for r in range(self.world)]
            return torch.cat(pieces)[: shape.numel()].view(shape).float()
        group, offset, shape = self._where[name]
        if key in self.optimizer.whole_keys:
            rank, start = self._whole[name]
            return self._flat(rank, key)[group].narrow(0, start, shape.numel()).view(shape).float()
        parts = [self._flat(r, key)[group] for r in range(self.world)]
        return _slice(parts, offset, shape.numel()).view(shape).float()


def zero_shard_files(ckpt_dir: str, state: dict) -> list[str] | None:
    """The ZeRO optimizer shards of the run that wrote `ckpt_dir`, one per rank, named from its trainer
    state (world size; dtype: DeepSpeed's "bf16_" prefix), never globbed: a file another run left
    there (another world size or dtype) is not read. None when it has no ZeRO shards."""
    form = form_of(state)
    dtype, world = form.get("dtype"), form.get("world_size") or 1
    prefixes = ["bf16_" if dtype == "bfloat16" else ""] if dtype else ["", "bf16_"]  # older: not recorded
    for prefix in prefixes:
        files = [
            os.path.join(ckpt_dir, f"{prefix}zero_pp_rank_{r}_mp_rank_00_optim_states.pt")
            for r in range(world)
        ]
        if os.path.exists(files[0]):
            return files
    return None


def _model_states_file(ckpt_dir: str) -> str:
    """DeepSpeed's model-states file (ZeRO-3 writes one per rank; rank 0's names all parameters)."""
    for name in ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_model_states.pt"):
        if os.path.exists(os.path.join(ckpt_dir, name)):
            return os.path.join(ckpt_dir, name)
    raise CheckpointError(f"{ckpt_dir}: no DeepSpeed model states file (mp_rank_00_model_states.pt) in it")


def _zero0_reader(ckpt_dir: str, state: dict) -> TorchReader:
    """DeepSpeed without ZeRO: the module and the optimizer in one file. fp32: torch AdamW's state
    dict over the module's parameters; bf16/fp16: DeepSpeed's wrapper holds fp32 master groups and
    the inner AdamW's state over them."""
    sd = safe_load(os.path.join(ckpt_dir, "mp_rank_00_model_states.pt"))
    optimizer, weights, groups = sd.get("optimizer"), dict(sd["module"]), _group_names(state)
    scaler = None
    if optimizer and "fp32_groups" in optimizer:  # the fp16/bf16 wrapper: masters by group order
        names = groups or _match_groups(optimizer["fp32_groups"], state["model"])
        weights.update({n: t for g, ts in zip(names, optimizer["fp32_groups"]) for n, t in zip(g, ts)})
        scaler, optimizer, groups = (
            neutral_loss_scale(optimizer),
            optimizer.get("optimizer_state_dict"),
            names,
        )
    elif optimizer:
        groups = groups or _match_groups(
            [[optimizer["state"][i]["exp_avg"] for i in g["params"]] for g in optimizer["param_groups"]],
            state["model"],
        )
    reader = TorchReader(weights, optimizer, groups, sd.get("lr_scheduler"))
    reader.loss_scale = scaler
    return reader


def _group_names(state: dict) -> list[list[str]] | None:
    return state.get("optimizer_groups")


def _match_groups(groups: list[list[torch.Tensor]], model: dict) -> list[list[str]]:
    """Names of optimizer groups saved without them (checkpoints from before `optimizer_groups`
    was recorded): our AdamW groups rebuilt on a meta model, either --decay_all_params, matched by shape."""
    from llama_train.optim.adamw import param_groups

    with torch.device("meta"):
        net = Transformer(ModelArgs(**model))
    names = {id(p): n for n, p in net.named_parameters()}
    shapes = [[tuple(t.shape) for t in g] for g in groups]
    for decay_all in (False, True):
        ours = [g["params"] for g in param_groups(net, 0.0, decay_all) if g["params"]]
        if [[tuple(p.shape) for p in g] for g in ours] == shapes:
            return [[names[id(p)] for p in g] for g in ours]
    raise CheckpointError("cannot match the checkpoint's optimizer groups to the model's parameters")


def open_checkpoint(ckpt_dir: str, state: dict) -> Reader:
    """The neutral form of one of our checkpoints (verified before: trainer_state.json is `state`)."""
    spec = optimizer_spec(state.get("optimizer", "adamw"))  # whose state it holds, by parameter
    if os.path.exists(os.path.join(ckpt_dir, "model.pt")):  # the DDP trainer's
        weights = safe_load(os.path.join(ckpt_dir, "model.pt"))
        optimizer = safe_load(os.path.join(ckpt_dir, "optimizer.pt"))
        scheduler = safe_load(os.path.join(ckpt_dir, "scheduler.pt"))
        groups = _group_names(state) or _match_groups(
            [[optimizer["state"][i]["exp_avg"] for i in g["params"]] for g in optimizer["param_groups"]],
            state["model"],
        )
        reader = TorchReader(weights, optimizer, groups, scheduler)
        scaler_file = os.path.join(ckpt_dir, "scaler.pt")
        reader.loss_scale = (
            neutral_loss_scale(safe_load(scaler_file)) if os.path.exists(scaler_file) else None
        )
    elif shards := zero_shard_files(ckpt_dir, state):
        reader = ZeroReader(shards, ckpt_dir, spec)
    elif os.path.exists(os.path.join(ckpt_dir, "mp_rank_00_model_states.pt")):
        reader = _zero0_reader(ckpt_dir, state)
    else:
        raise CheckpointError(f"{ckpt_dir}: neither a DDP nor a DeepSpeed checkpoint (no model files in it)")
    reader.kind = describe(state.get("layout") or {"strategy": state.get("strategy"), **state})
    reader.optimizer = spec
    return reader
