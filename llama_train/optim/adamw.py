"""AdamW's record (spec.py): the parameter groups every optimizer here builds on (decay / no decay)
and torch's fused AdamW with the flags' settings. Its state facts are spec.ADAMW_STATE, the state
every other optimizer's AdamW half keeps too."""

import torch

from llama_train.optim.spec import OptimizerSpec


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


ADAMW = OptimizerSpec(
    name="adamw",
    title="AdamW",
    help="",
    ds_type="AdamW",
    build=build_adamw,
)
