"""Pipeline parallelism: the Transformer re-expressed as DeepSpeed PipelineModule layers
(embedding, one layer per block, norm + output head), and the trainer's step, evaluation and
export for a PipelineEngine.

The layers wrap the full model's own modules (built with the run's seed, then split), so the
initial weights are those of every other strategy. Layer i's parameters are named `i.<...>` by
PipelineModule; `to_model_name` maps them back to the Transformer's names.
"""

import sys

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from llama_train.model import Transformer, causal_lm_loss


class EmbeddingPipe(nn.Module):
    def __init__(self, model: Transformer):
        super().__init__()
        self.tok_embeddings = model.tok_embeddings

    def forward(self, input_ids):
        return self.tok_embeddings(input_ids)


class BlockPipe(nn.Module):
    """One TransformerBlock; the rotary table comes along (a non-persistent buffer, as in the model)."""

    def __init__(self, model: Transformer, i: int, gradient_checkpointing: bool):
        super().__init__()
        self.block, self.gradient_checkpointing = model.layers[i], gradient_checkpointing
        self.register_buffer("pos_cis", model.pos_cis, persistent=False)

    def forward(self, h):
        pos_cis = self.pos_cis[: h.shape[1]]
        if self.gradient_checkpointing and self.training:
            return checkpoint(self.block, h, pos_cis, use_reentrant=False)
        return self.block(h, pos_cis)


class HeadPipe(nn.Module):
    def __init__(self, model: Transformer):
        super().__init__()
        self.norm, self.output = model.norm, model.output

    def forward(self, h):
        return self.output(self.norm(h)).float()


def to_pipeline(model: Transformer, stages: int, gradient_checkpointing: bool = False):
    """A PipelineModule over `stages` ranks; layers are balanced by parameter count (DeepSpeed's
    "parameters" method), so the embedding and the head weigh as much as the blocks they displace."""
    from deepspeed.pipe import PipelineModule

    n = model.args.n_layers
    layers = [
        EmbeddingPipe(model),
        *(BlockPipe(model, i, gradient_checkpointing and model.args.checkpointed(i)) for i in range(n)),
        HeadPipe(model),
    ]
    return PipelineModule(layers, num_stages=stages, loss_fn=causal_lm_loss, partition_method="parameters")


def to_model_name(name: str) -> str:
    """PipelineModule parameter name -> Transformer name: `0.tok_embeddings.weight` ->
    `tok_embeddings.weight`, `3.block.attention.wq.weight` -> `layers.2.attention.wq.weight`,
    `5.norm.weight` -> `norm.weight`."""
    index, rest = name.split(".", 1)
    if rest.startswith("block."):
        return f"layers.{int(index) - 1}.{rest.removeprefix('block.')}"
    return rest


def is_pipeline(engine) -> bool:
    """A DeepSpeed PipelineEngine (checked without importing DeepSpeed into a DDP process)."""
    pipe = sys.modules.get("deepspeed.runtime.pipe.engine")
    return pipe is not None and isinstance(engine, pipe.PipelineEngine)


def train_batch(engine, micro_batches: list[dict], device, before_update=None) -> torch.Tensor:
    """One optimizer step: PipelineEngine.train_batch runs forward and backward of every
    micro-batch through the stages (1F1B schedule), reduces gradients over data-parallel replicas
    and steps; returns the mean loss over the micro-batches (and replicas), on every stage.
    `before_update()` runs where the other strategies take the memory record, after the last
    backward and before the update (an optimizer pre-step hook: train_batch has no gap)."""
    if before_update is not None:
        inner = getattr(
            engine.optimizer, "optimizer", engine.optimizer
        )  # the torch optimizer in a ZeRO wrapper

        def measure(*_):
            handle.remove()
            before_update()

        handle = inner.register_step_pre_hook(measure)
    match_shape(engine, micro_batches[0]["input_ids"].shape)
    batches = [(b["input_ids"].to(device), b["labels"].to(device)) for b in micro_batches]
    return engine.train_batch(iter(batches))


def match_shape(engine, shape):
    """The stages exchange activation shapes once and then reuse their buffers: a batch of another
    shape (an eval split's short last batch, or training after it) makes them exchange shapes anew."""
    if getattr(engine, "_llama_train_batch_shape", None) != tuple(shape):
        engine.reset_activation_shape()
        engine._llama_train_batch_shape = tuple(shape)


def eval_loss(engine, batch: dict) -> torch.Tensor:
    """The mean loss of one batch through the stages, on every stage."""
    match_shape(engine, batch["input_ids"].shape)
    return engine.eval_batch(iter([(batch["input_ids"], batch["labels"])]), num_micro_batches=1)
