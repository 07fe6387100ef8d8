"""Held-out loss and perplexity, the same for every strategy."""

import math

import torch

from llama_train.dist import all_reduce_mean, to_device
from llama_train.pipeline import eval_loss, is_pipeline


@torch.no_grad()
def evaluate(engine, loader, device: torch.device, max_batches: int) -> tuple[float, float]:
    """Token-weighted mean eval loss over ranks, and its perplexity. `engine` is anything called
    as engine(input_ids=..., labels=...) -> (logits, loss) with .train()/.eval(): DeepSpeed's
    engine or the DDP trainer's."""
    engine.eval()
    total, count = 0.0, 0
    for i, batch in enumerate(loader):
        if 0 <= max_batches <= i:
            break
        batch = to_device(batch, device)
        if is_pipeline(engine):  # the loss comes out of the last stage
            loss = eval_loss(engine, batch)
        else:
            _, loss = engine(**batch)
        n = int((batch["labels"] != -100).sum())
        total, count = total + loss.item() * n, count + n
    engine.train()
    total, count = all_reduce_mean([total, count], device)
    loss = total / max(count, 1)
    return loss, math.exp(min(loss, 50.0))
