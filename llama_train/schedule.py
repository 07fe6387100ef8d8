"""Warmup + cosine learning-rate schedule, as a LambdaLR both trainers (and DeepSpeed) step."""

import math

from torch.optim.lr_scheduler import LambdaLR


def lr_at(step: int, max_lr: float, min_lr: float, warmup_steps: int, total_steps: int) -> float:
    """LR for optimizer step `step` (0-based): linear warmup to max_lr, cosine down to min_lr."""
    warmup_steps = min(warmup_steps, max(total_steps - 1, 0))  # a short run still reaches its peak
    if step < warmup_steps:
        return max_lr * (step + 1) / warmup_steps
    if step >= total_steps:
        return min_lr
    progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
    return min_lr + 0.5 * (max_lr - min_lr) * (1.0 + math.cos(math.pi * progress))


def build_scheduler(optimizer, max_lr: float, min_lr: float, warmup_steps: int, total_steps: int) -> LambdaLR:
    """Scales every param group's base LR (which must be `max_lr`) by `lr_at(...) / max_lr`."""
    return LambdaLR(optimizer, lambda step: lr_at(step, max_lr, min_lr, warmup_steps, total_steps) / max_lr)
