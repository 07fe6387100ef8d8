"""Muon (Newton-Schulz-orthogonalised momentum) for the hidden matrices, AdamW for the rest, the same
arithmetic in both trainers.

The split: every 2-D weight inside a transformer block (attention wq/wk/wv/wo, feed-forward w1/w2/w3)
gets Muon; the token embedding, the norms and the output head get AdamW (Muon is defined for hidden
linear maps, not for lookup tables or the logits layer). `train_deepspeed.py` runs DeepSpeed's own Muon
(`"optimizer": {"type": "Muon"}`, parameters tagged `use_muon`); `train_ddp.py` runs DeepSpeed's
`MuonWithAuxAdam` itself over the full parameters, the class DeepSpeed's ZeRO-0 engine uses, so both
call the same `muon_update` (momentum, Nesterov blend, Newton-Schulz) and the same torch AdamW. The
parameter groups are DeepSpeed's (engine._muon_param_groups): each of our AdamW groups (decay / no
decay) split into its Muon half and its AdamW half, in that order.
"""

import re

import torch

OPTIMIZERS = ("adamw", "muon")


HIDDEN = re.compile(r"(^|\.)layers\.\d+\.")  # inside a block, also under a wrapper's `module.` prefix


def uses_muon(name: str, p: torch.Tensor) -> bool:
    """A hidden matrix: 2-D and inside a transformer block (`layers.N.attention.*` / `feed_forward.*`)."""
    shape = getattr(p, "ds_shape", p.shape)  # a ZeRO-3 partition reports 1-D
    return len(shape) == 2 and HIDDEN.search(name) is not None


def tag(model: torch.nn.Module):
    """Set `use_muon` on every parameter, the attribute DeepSpeed's Muon and ZeRO optimizers read."""
    for name, p in model.named_parameters():
        p.use_muon = uses_muon(name, p)


def split_groups(groups: list[dict], muon: dict, adam: dict) -> list[dict]:
    """Each AdamW group (llama_train.optim.adamw.param_groups) as its Muon half then its AdamW half, with
    `muon` / `adam` settings and the group's own weight decay: what DeepSpeed builds from the same
    groups (engine._muon_param_groups, one name per half), so the twins hold the same groups."""
    out = []
    for index, group in enumerate(groups):
        for use_muon, label, settings in ((True, "muon", muon), (False, "adam", adam)):
            half = [p for p in group["params"] if p.requires_grad and bool(p.use_muon) is use_muon]
            if half:
                name = f"group{index}-{label}-params" if len(groups) > 1 else f"{label}-params"
                wd = {"weight_decay": group["weight_decay"]}
                out.append(dict(params=half, use_muon=use_muon, name=name, **settings, **wd))
    return out


def muon_settings(args) -> dict:
    """The Muon half's hyper-parameters from the flags (DeepSpeed: optimizer.params muon_lr, momentum)."""
    return {"lr": args.muon_lr, "momentum": args.muon_momentum}


def adam_settings(args) -> dict:
    """The AdamW half's (DeepSpeed: optimizer.params adam_lr, betas, eps)."""
    return {"lr": args.learning_rate, "betas": (args.beta1, args.beta2), "eps": args.adam_eps}


def build_muon(model: torch.nn.Module, groups: list[dict], args) -> torch.optim.Optimizer:
    """The DDP trainer's Muon: DeepSpeed's MuonWithAuxAdam over `groups` (our AdamW groups), its AdamW
    half torch's non-fused AdamW, as DeepSpeed builds it for `"torch_adam": true`."""
    from deepspeed.runtime.zero.muon.muon_optimizer import MuonWithAuxAdam

    class SkippingMuon(MuonWithAuxAdam):
        """Skips the whole update when `found_inf` (set by ddp.DDPEngine.step, as for fused AdamW) is
        non-zero. Unlike fused AdamW it decides on the host: one sync per step."""

        found_inf = None

        @torch.no_grad()
        def step(self, closure=None):
            if self.found_inf is not None and bool(self.found_inf):
                return None
            return super().step(closure)

    tag(model)
    halves = split_groups(groups, muon_settings(args), adam_settings(args))
    return SkippingMuon(halves, adam_optimizer=torch.optim.AdamW, adam_optimizer_kwargs={"foreach": None})
