"""Model parallelism for the DeepSpeed trainer, applied from outside the model (as torchtitan's
`parallelize_*` functions are): llama_train/model.py never meets a process group.

- tensor parallel (AutoTP, `"tensor_parallel": {"autotp_size": N}` in the ds_config): DeepSpeed
  splits the attention heads (wq/wk/wv by rows, wo by columns) and the SwiGLU hidden units
  (w1/w3 by rows, w2 by columns) over N ranks, and the output head by vocabulary rows (its logits
  gathered); the embedding and the norms stay whole on every rank. The specs are ds_config.TP_LAYER_SPECS.
- sequence parallel (Ulysses, `--sequence_parallel_size N`): each rank embeds 1/N of every
  sequence; DeepSpeed's DistributedAttention trades that slice for all of the sequence and 1/N of
  the heads around each attention core (all-to-all), and back.
- pipeline parallel (`--pipeline_parallel_size N`): the model re-expressed as a PipelineModule of
  embedding, blocks and norm+head layers (llama_train/distributed/pipeline.py), N stages.

Each is combined with data parallelism (ZeRO) over the remaining `world / N` ranks, one kind per
run. Every variant starts from the full `Transformer` (same seed, same init) and splits it, so
its first losses equal those of the data-parallel strategies.
"""

import re
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from llama_train.distributed.compile import refuse_zero3
from llama_train.distributed.ds_config import TP_LAYER_SPECS, zero_stage
from llama_train.distributed.pipeline import to_model_name, to_pipeline, train_batch
from llama_train.errors import ConfigError
from llama_train.model import CoreAttention, Transformer

__all__ = ["train_batch"]  # the trainer's pipeline step, with the rest of model parallelism


@dataclass(frozen=True)
class Layout:
    """How the ranks split: `tp x sp x pp` ranks hold one model replica, `dp` replicas."""

    world: int
    tp: int = 1
    sp: int = 1
    pp: int = 1

    @property
    def model_parallel(self) -> int:
        return self.tp * self.sp * self.pp

    @property
    def dp(self) -> int:
        return self.world // self.model_parallel

    @property
    def name(self) -> str | None:
        """Its short name (tp2, sp2, pp2), None for data parallelism alone."""
        sizes = {"tp": self.tp, "sp": self.sp, "pp": self.pp}
        return "-".join(f"{k}{v}" for k, v in sizes.items() if v > 1) or None

    def data_rank(self, rank: int) -> int:
        """Which data shard global rank `rank` reads. DeepSpeed's groups put the ranks of one
        replica next to each other for AutoTP (mesh (dp, tp)) and Ulysses (consecutive sequence
        groups), and the stages outermost for pipelines (topology (pipe, data)); `check_groups`
        verifies this against the groups DeepSpeed built."""
        return rank % self.dp if self.pp > 1 else rank // (self.tp * self.sp)


def tensor_parallel_size(config: dict, source: str) -> int:
    """`tensor_parallel.autotp_size` (0 or absent: off, i.e. 1)."""
    size = (config.get("tensor_parallel") or {}).get("autotp_size", 0) or 0
    if not isinstance(size, int) or size < 0:
        raise ConfigError(
            f'{source}: "tensor_parallel.autotp_size" must be a whole number >= 0, got {size!r}'
        )
    return max(1, size)


def plan_layout(args, margs, world: int, config: dict | None = None) -> Layout:
    """The run's layout: tensor parallel from the ds_config (`config`, as read; None for the DDP
    trainer), sequence and pipeline parallel from the flags (the DDP trainer has none of them). Every
    invalid combination is refused here, before any work, in one ConfigError."""
    path, config = getattr(args, "deepspeed_config", None), config or {}
    refuse_zero3(getattr(args, "compile", False), zero_stage(config))  # --compile cannot run under ZeRO-3
    layout = Layout(
        world,
        tp=tensor_parallel_size(config, path),
        sp=getattr(args, "sequence_parallel_size", 1),
        pp=getattr(args, "pipeline_parallel_size", 1),
    )
    problems = layout_problems(layout, margs, config, path or "ds_config") + feature_problems(layout, args)
    if problems:
        sep = "\n  - " if len(problems) > 1 else " "
        raise ConfigError("invalid parallel layout:" + sep + sep.join(problems))
    return layout


def feature_problems(layout: Layout, args) -> list[str]:
    """Features not combined with model parallelism (untested, or without a hook to use)."""
    problems = []
    if layout.name and getattr(args, "compile", False):
        problems.append(
            f"--compile with {layout.name} is not supported (the parallel wrappers replace the modules the "
            "compiled blocks trace; untested): drop --compile or the model parallelism"
        )
    why = {
        "sequence": "Ulysses splits each row over the ranks",
        "pipeline": "its stages pass only activations",
    }
    kind = "sequence" if layout.sp > 1 else "pipeline" if layout.pp > 1 else None
    if getattr(args, "document_mask", False) and kind:
        problems.append(
            f"--document_mask with {kind} parallel is not supported ({why[kind]}, not the rows' document "
            "boundaries): drop --document_mask, or use tensor parallel or data parallelism (ZeRO)"
        )
    if layout.pp > 1 and (getattr(args, "skip_loss_zscore", None) or getattr(args, "skip_grad_zscore", None)):
        problems.append(
            "--skip_loss_zscore / --skip_grad_zscore with pipeline parallel: the pipeline engine's train_batch "
            "has no place to skip an update before it is applied; drop the spike guard or use tensor or "
            "sequence parallelism"
        )
    return problems


def layout_problems(layout: Layout, margs, config: dict, source: str) -> list[str]:
    """Everything wrong with running `margs` in `layout` under the ds_config `config` (read from
    `source`), at once."""
    tp, sp, pp = layout.tp, layout.sp, layout.pp
    problems = [
        f"--{k}_parallel_size must be >= 1, got {v}" for k, v in (("sequence", sp), ("pipeline", pp)) if v < 1
    ]
    if problems:
        return problems
    kinds = [
        f"{what} parallel {n}" for what, n in (("tensor", tp), ("sequence", sp), ("pipeline", pp)) if n > 1
    ]
    if len(kinds) > 1:
        problems.append(
            f"{' and '.join(kinds)} cannot be combined (DeepSpeed 0.19.8: AutoTP replaces the engine's mpu "
            "with its own groups, dropping Ulysses' sequence groups, and a PipelineModule takes no mpu): "
            "choose one kind of model parallelism, data parallelism (ZeRO) fills the other ranks"
        )
    if layout.world % layout.model_parallel:
        problems.append(
            f"world size {layout.world} is not divisible by TP x SP x PP = {tp} x {sp} x {pp}: "
            f"launch a multiple of {layout.model_parallel} ranks"
        )
    heads = {"n_heads": margs.n_heads, "n_kv_heads": margs.kv_heads}
    for size, what, flag in (
        (tp, "tensor", f"tensor_parallel.autotp_size in {source}"),
        (sp, "sequence", "--sequence_parallel_size"),
    ):
        problems += [
            f"{name}={n} is not divisible by the {what} parallel size {size} ({flag}): each rank holds whole heads"
            for name, n in heads.items()
            if size > 1 and n % size
        ]
    if tp > 1:
        for name, n in (("the SwiGLU hidden size", margs.ffn_hidden_dim), ("vocab_size", margs.vocab_size)):
            if n % tp:
                problems.append(f"{name} {n} is not divisible by the tensor parallel size {tp}")
        if zero_stage(config) == 3:
            problems.append(
                f"tensor parallel with ZeRO stage 3 ({source}) is not supported: DeepSpeed 0.19.8's engine "
                "counts the data-parallel ranks of an AutoTP run differently under ZeRO-3 and stops in its batch "
                "check; use ZeRO-1 or ZeRO-2 with autotp_size (both give the same losses here)"
            )
    if sp > 1 and margs.max_seq_len % sp:
        problems.append(
            f"--max_seq_len {margs.max_seq_len} is not divisible by --sequence_parallel_size {sp}: "
            "every rank takes an equal slice of each sequence"
        )
    problems += pipeline_problems(pp, margs, config, source)
    return problems


def pipeline_problems(pp: int, margs, config: dict, source: str) -> list[str]:
    if pp <= 1:
        return []
    problems, stage = [], zero_stage(config)
    if config.get("wall_clock_breakdown"):
        problems.append(
            f'pipeline parallel with "wall_clock_breakdown": true in {source} stops at the first backward: '
            "DeepSpeed 0.19.8 starts the backward timer twice on a pipeline stage ('bwd_microstep timer has "
            "already been started'; docs/parallelism.md 'Pipeline parallel'); set it to false"
        )
    if stage >= 2:
        problems.append(
            f"pipeline parallel needs ZeRO stage 0 or 1, {source} has stage {stage}: ZeRO-2/3 partition "
            "gradients, which the pipeline engine accumulates across micro-batches itself (DeepSpeed's "
            "PipelineEngine asserts it); use ds_configs/zero1.json"
        )
    if margs.n_layers + 2 < pp:
        problems.append(
            f"--pipeline_parallel_size {pp} is more than the model's {margs.n_layers + 2} pipeline layers "
            "(embedding, blocks, norm+head)"
        )
    if margs.tie_embeddings:
        problems.append(
            "--tie_embeddings with pipeline parallel is not supported: the embedding and the output head "
            "live on different stages (DeepSpeed's TiedLayerSpec would keep them in sync; not built here)"
        )
    return problems


# --- applying a layout ---


def parallelize(model: Transformer, layout: Layout, gradient_checkpointing: bool) -> nn.Module:
    """The model this rank hands to deepspeed.initialize: the full Transformer for tensor parallel
    (the ds_config's layer specs, ds_config.TP_LAYER_SPECS, tell the engine how to shard it), its
    attention wrapped for sequence parallel, a PipelineModule of this rank's stage for pipeline
    parallel."""
    if layout.sp > 1:
        return sequence_parallel(model, sequence_group(layout.sp))
    if layout.pp > 1:
        return to_pipeline(model, layout.pp, gradient_checkpointing)
    return model


def mpu(layout: Layout):
    """The `mpu` deepspeed.initialize needs: Ulysses' groups (gradients summed over each sequence
    group, averaged over data-parallel replicas, ZeRO partitioned over both); None otherwise (AutoTP
    builds its own groups, a PipelineModule brings its topology)."""
    if layout.sp > 1:
        from deepspeed.runtime.sequence_parallel import parallel_state_sp

        return parallel_state_sp
    return None


def check_groups(engine, layout: Layout, rank: int):
    """The groups DeepSpeed built place this rank where `Layout.data_rank` assumed (the sampler
    was built from it): a DeepSpeed that orders its groups differently stops here, not with
    silently wrong data."""
    if layout.tp > 1:
        from deepspeed.utils import groups

        found = (groups.get_tensor_model_parallel_world_size(), groups.get_data_parallel_rank())
    elif layout.pp > 1:
        found = (engine.grid.get_pipe_parallel_world_size(), engine.grid.get_data_parallel_rank())
    elif layout.sp > 1:
        group = mpu(layout).get_sequence_parallel_group()
        found = (dist.get_world_size(group), dist.get_global_rank(group, 0) // layout.sp)
    else:
        return
    want = (layout.model_parallel, layout.data_rank(rank))
    if found != want:
        raise RuntimeError(
            f"rank {rank}: DeepSpeed's groups give (model-parallel size, data rank) {found}, expected {want}"
        )


# --- sequence parallel (Ulysses) ---


def sequence_group(sp: int):
    """Ulysses' process groups (consecutive ranks form a sequence group), created once."""
    from deepspeed.runtime.sequence_parallel import parallel_state_sp

    parallel_state_sp.initialize_sequence_parallel(sp)
    return parallel_state_sp.get_sequence_parallel_group()


class UlyssesAttention(nn.Module):
    """A CoreAttention run over the whole sequence for 1/N of the heads: DeepSpeed's
    DistributedAttention all-to-alls q/k/v from (B, T/N, H) to (B, T, H/N) and the output back.
    GQA keeps its groups: query heads and their kv head land on the same rank."""

    def __init__(self, core: CoreAttention, group):
        super().__init__()
        from deepspeed.sequence.layer import DistributedAttention

        self.inner = core  # registered, so .to() and train()/eval() still reach it
        self.dist_attn = DistributedAttention(core, group, scatter_idx=2, gather_idx=1)

    def forward(self, xq, xk, xv, mask=None):
        if mask is not None:  # plan_layout refuses --document_mask with sequence parallel
            raise ValueError("a document mask cannot be split over sequence-parallel ranks")
        return self.dist_attn(xq, xk, xv, 0)  # batch first: (B, T, H, hd)


class _SumOverGroup(torch.autograd.Function):
    """All-reduce sum forward, identity backward: each rank's loss becomes the group's total, while
    its gradient stays its own share (the engine sums gradients over the sequence group)."""

    @staticmethod
    def forward(ctx, x, group):
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def sequence_parallel(model: Transformer, group) -> Transformer:
    """Ulysses on `model`, in place: every forward takes this rank's slice of the sequence (of a
    full batch, as all strategies are given), rotary positions are those of the slice within the
    full sequence, attention runs through UlyssesAttention, and the loss is the mean over all of the
    sequence's tokens (counted once), the same value on every rank of the group."""
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    counts = {}

    def take_slice(module, args, kwargs):
        ids = kwargs.pop("input_ids") if "input_ids" in kwargs else args[0]
        labels = kwargs.pop("labels", args[1] if len(args) > 1 else None)
        T = ids.shape[1] // size
        if ids.shape[1] % size:
            raise ValueError(
                f"sequence length {ids.shape[1]} does not split over {size} sequence-parallel ranks"
            )
        local = {"input_ids": ids[:, rank * T : (rank + 1) * T]}
        if labels is not None:
            local["labels"] = labels[:, rank * T : (rank + 1) * T]
            counts.update(total=(labels != -100).sum(), local=(local["labels"] != -100).sum())
        return (), {**kwargs, **local}

    def global_loss(module, args, kwargs, output):
        if "labels" not in kwargs:
            return output
        logits, loss = output
        return logits, _SumOverGroup.apply(loss * counts["local"], group) / counts["total"]

    def full_positions(block, args):
        h, _, *mask = args
        T = h.shape[1]
        return h, model.pos_cis[rank * T : (rank + 1) * T], *mask

    model.register_forward_pre_hook(take_slice, with_kwargs=True)
    model.register_forward_hook(global_loss, with_kwargs=True)
    for layer in model.layers:
        layer.register_forward_pre_hook(full_positions)
        layer.attention.core = UlyssesAttention(layer.attention.core, group)
    return model


# --- gathering the full model (export) ---


def gather_full_state(state: dict, layout: Layout, rank: int) -> dict | None:
    """Collective: on rank 0 the full state dict under the Transformer's names, from every rank's
    `state` (its parameters by the engine module's names; only rank 0's matters unless the layout
    splits the weights: tensor or pipeline parallel); None elsewhere."""
    if layout.tp * layout.pp == 1:
        return state if rank == 0 else None
    parts = [None] * dist.get_world_size() if rank == 0 else None
    dist.gather_object(state, parts, dst=0)
    if rank != 0:
        return None
    if layout.pp > 1:  # stage s of the first replica is rank s * dp (topology axes pipe, data)
        return merge_stages(parts[:: layout.dp])
    return merge_tp_shards(parts[: layout.tp])  # the first replica's TP group: ranks 0..tp-1


def merge_tp_shards(shards: list[dict]) -> dict:
    """Tensor-parallel shards (TP rank order) -> full weights: split ones concatenated along the
    dimension they were cut (tp_split_dim), replicated ones taken once."""
    out = {}
    for name, first in shards[0].items():
        dim = tp_split_dim(name)
        out[name] = first if dim is None else torch.cat([s[name] for s in shards], dim=dim)
    return out


def tp_split_dim(name: str) -> int | None:
    """The dimension AutoTP cut parameter `name` along by ds_config.TP_LAYER_SPECS: a column split
    divides the output rows (0), a row split the input columns (1); None: whole on every rank."""
    for spec in TP_LAYER_SPECS:
        if any(re.fullmatch(pattern, name) for pattern in spec["patterns"]):
            return 0 if spec["partition_type"] == "column" else 1
    return None


def merge_stages(stages: list[dict]) -> dict:
    """Pipeline stages' state dicts (PipelineModule names) -> one Transformer state dict."""
    return {to_model_name(k): v for stage in stages for k, v in stage.items()}
