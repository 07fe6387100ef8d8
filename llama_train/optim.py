"""AdamW parameter groups and the warmup + cosine LR schedule, shared by both trainers (DeepSpeed
steps the same LambdaLR)."""

import math

import torch
from torch.optim.lr_scheduler import LambdaLR


def param_groups(model: torch.nn.Module, weight_decay: float, decay_all: bool = False) -> list[dict]:
    """AdamW groups: decay matrices; not norms, biases or embeddings (unless `decay_all`)."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        skip = p.ndim < 2 or "tok_embeddings" in name or name.endswith("norm.weight")
        (no_decay if skip and not decay_all else decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def build_adamw(model: torch.nn.Module, args) -> torch.optim.AdamW:
    """torch's fused AdamW (one kernel for all parameters, CPU and CUDA) with the flags' settings:
    what ds_configs/*.json ask DeepSpeed for ("torch_adam": true, "fused": true)."""
    return torch.optim.AdamW(
        param_groups(model, args.weight_decay, args.decay_all_params),
        lr=args.learning_rate,
        betas=(args.beta1, args.beta2),
        eps=args.adam_eps,
        fused=True,
    )


def lr_at(step: int, max_lr: float, min_lr: float, warmup_steps: int, total_steps: int) -> float:
    """LR for the optimizer update with 0-based index `step` (LambdaLR's count): linear warmup to
    max_lr, cosine down to min_lr."""
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


def build_lr_scheduler(optimizer, args, total_steps: int) -> LambdaLR:
    """The flags' schedule: warmup to --learning_rate over --warmup_steps, cosine to --min_lr at
    the run's last step."""
    return build_scheduler(optimizer, args.learning_rate, args.min_lr, args.warmup_steps, total_steps)
