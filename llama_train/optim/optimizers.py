"""The optimizer --optimizer names (its record: llama_train/optim/registry.py) and the LR schedules
(warmup + cosine, warmup-stable-decay), shared by both trainers (DeepSpeed steps the same LambdaLR)."""

import math

import torch
from torch.optim.lr_scheduler import LambdaLR

from llama_train.optim.registry import optimizer_spec


def build_optimizer(model: torch.nn.Module, args) -> torch.optim.Optimizer:
    """The DDP trainer's optimizer for --optimizer, as its record builds it (AdamW: adamw.build_adamw)."""
    return optimizer_spec(args.optimizer).build(model, args)


def _warmup(step: int, max_lr: float, warmup_steps: int, total_steps: int) -> tuple[float | None, int]:
    """(the warmup LR of `step`, or None past warmup; the warmup length, capped so a short run
    still reaches its peak)."""
    warmup_steps = min(warmup_steps, max(total_steps - 1, 0))
    return (max_lr * (step + 1) / warmup_steps if step < warmup_steps else None), warmup_steps


def lr_at(step: int, max_lr: float, min_lr: float, warmup_steps: int, total_steps: int) -> float:
    """LR for the optimizer update with 0-based index `step` (LambdaLR's count): linear warmup to
    max_lr, cosine down to min_lr."""
    lr, warmup_steps = _warmup(step, max_lr, warmup_steps, total_steps)
    if lr is not None:
        return lr
    if step >= total_steps:
        return min_lr
    progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
    return min_lr + 0.5 * (max_lr - min_lr) * (1.0 + math.cos(math.pi * progress))


def wsd_at(
    step: int, max_lr: float, min_lr: float, warmup_steps: int, total_steps: int, decay_steps: int
) -> float:
    """Warmup-stable-decay: linear warmup to max_lr, flat at max_lr, then linear down over the last
    `decay_steps` updates, the last one at exactly min_lr (a finished model)."""
    lr, warmup_steps = _warmup(step, max_lr, warmup_steps, total_steps)
    if lr is not None:
        return lr
    decay_steps = max(1, min(decay_steps, total_steps - warmup_steps))
    left = total_steps - 1 - step  # updates after this one
    if left >= decay_steps:
        return max_lr
    return min_lr + (max_lr - min_lr) * max(left, 0) / decay_steps


def decay_steps(args, total_steps: int) -> int:
    """wsd's decay length: --decay_steps, else --decay_fraction of the run (at least one step)."""
    return args.decay_steps or max(1, round(args.decay_fraction * total_steps))


SCHEDULES = {  # --lr_schedule -> LR of 0-based update `step` (LambdaLR's count)
    "cosine": lambda step, args, total: lr_at(
        step, args.learning_rate, args.min_lr, args.warmup_steps, total
    ),
    "wsd": lambda step, args, total: wsd_at(
        step, args.learning_rate, args.min_lr, args.warmup_steps, total, decay_steps(args, total)
    ),
}


def build_scheduler(optimizer, max_lr: float, min_lr: float, warmup_steps: int, total_steps: int) -> LambdaLR:
    """Scales every param group's base LR (which must be `max_lr`) by `lr_at(...) / max_lr`."""
    return LambdaLR(optimizer, lambda step: lr_at(step, max_lr, min_lr, warmup_steps, total_steps) / max_lr)


def build_lr_scheduler(optimizer, args, total_steps: int) -> LambdaLR:
    """The flags' schedule (--lr_schedule): warmup to --learning_rate over --warmup_steps, then cosine
    to --min_lr at the run's last step, or flat and a linear decay (wsd). Every group's base LR is
    scaled by the same factor: every optimizer's groups follow the same shape."""
    schedule, max_lr = SCHEDULES[args.lr_schedule], args.learning_rate
    return LambdaLR(optimizer, lambda step: schedule(step, args, total_steps) / max_lr)
