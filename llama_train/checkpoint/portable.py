"""Moving a run across strategies and world sizes: the strategy-neutral form, and the engine-free
helpers that write it into a torch optimizer and an LR schedule.

The neutral form, in memory: per parameter (by its name in the model) the fp32 weight and AdamW's
`exp_avg` / `exp_avg_sq` (or, for the parameters another optimizer takes, the state its record in
llama_train/optim/ keeps, whole tensors), plus AdamW's step count, the LR schedule and fp16's loss
scale. A `formats.Reader` reads it from any of our checkpoints (llama_train/checkpoint/formats.py, the
one safe reader). Each live engine writes it into itself (`Engine.load_neutral`,
llama_train/train/engines/): the DDP trainer's torch optimizer and DeepSpeed's ZeRO-0 through
`into_torch` here, FSDP2's shards through torch's full-state setters, ZeRO-1/2/3 through DeepSpeed's
public setters. Whether a resume goes this way or through the engine's own loader is decided before
any work, in resuming.resume_point. Nothing here asks which engine it serves.
"""

import torch

from llama_train.checkpoint.formats import Reader
from llama_train.optim.spec import ADAMW_STATE, State

# --- writing the neutral form into a torch optimizer (the DDP trainer's, DeepSpeed ZeRO-0's) ---


@torch.no_grad()
def into_torch(optimizer, params, reader: Reader):
    """A torch optimizer over full tensors: copy the weights, then load each parameter's state (what its
    group holds: the reader's optimizer record's group_state) through torch's own load_state_dict
    (which places `step` as the fused kernel wants it). `params`: (name, module parameter, the tensor
    the optimizer steps for it: the parameter itself or its fp32 master)."""
    index = {id(t): i for i, t in enumerate(t for g in optimizer.param_groups for t in g["params"])}
    kinds = {id(t): reader.optimizer.group_state(g) for g in optimizer.param_groups for t in g["params"]}
    state = {}
    for name, param, stepped in params:
        tensors = reader.tensors(name)
        stepped.copy_(tensors["fp32"])
        param.copy_(tensors["fp32"])  # the module's copy (bf16/fp16: rounded, as DeepSpeed keeps it)
        if reader.step is not None:
            state[index[id(stepped)]] = state_of(tensors, reader.step, kinds[id(stepped)])
    if reader.step is not None:
        groups = optimizer.state_dict()["param_groups"]
        optimizer.load_state_dict({"state": state, "param_groups": groups})
        set_group_step(optimizer, reader.step)


def state_of(tensors: dict, step: int, kind: State = ADAMW_STATE) -> dict:
    """One parameter's optimizer state from its neutral form, as `kind` keeps it: its keys (zeros for
    one the checkpoint lacks) and the step count where it has one (AdamW's)."""
    counted = {"step": torch.tensor(float(step))} if kind.step else {}
    return {**counted, **{k: or_zeros(tensors, k) for k in kind.keys}}


def or_zeros(tensors: dict, key: str) -> torch.Tensor:
    """One state tensor of a parameter; zeros where the checkpoint has none yet (every update so far
    skipped: a NaN, fp16 overflows), as DeepSpeed's and torch's first step create it."""
    return tensors[key] if key in tensors else torch.zeros_like(tensors["fp32"])


def set_group_step(optimizer, step: int):
    """Optimizers that count steps per group (DeepSpeed's FusedAdam) rather than per parameter."""
    for group in optimizer.param_groups:
        if "step" in group:
            group["step"] = step


# --- the LR schedule ---


def restore_schedule(scheduler, state: dict | None):
    """The LR schedule's position, and the LR its optimizer's groups use for the next step."""
    if state is None:
        return
    scheduler.load_state_dict(state)
    for group, lr in zip(scheduler.optimizer.param_groups, scheduler.get_last_lr()):
        group["lr"] = lr


def reapply_schedule(scheduler):
    """The LR of the next update from this run's schedule at the restored position, not the one the
    checkpoint stored: the same number when the flags are unchanged (LambdaLR's own arithmetic), the
    branch's when --max_steps / --lr_schedule / --decay_steps changed (docs/optimizers.md, branching)."""
    step = scheduler.last_epoch
    groups = scheduler.optimizer.param_groups
    for group, base, schedule in zip(groups, scheduler.base_lrs, scheduler.lr_lambdas):
        group["lr"] = base * schedule(step)
    scheduler._last_lr = [group["lr"] for group in groups]


# --- what a checkpoint records about its optimizer, and state read back for comparisons ---


def group_names(names: dict[int, str], optimizer) -> list[list[str]]:
    """Parameter names per optimizer group, in order (`names`: id of each tensor the optimizer steps
    -> its parameter's name): what turns optimizer.pt's indices back into names."""
    return [[names[id(p)] for p in g["params"]] for g in optimizer.param_groups]


def torch_state(stepped: torch.Tensor, optimizer) -> dict:
    """{"fp32", "exp_avg", "exp_avg_sq"} of one tensor a torch optimizer steps (None: no state yet)."""
    state = optimizer.state.get(stepped, {})
    return {"fp32": stepped, **{k: state.get(k) for k in ADAMW_STATE.keys}}


def cpu_copies(tensors: dict) -> dict:
    """Full tensors as fp32 copies on the CPU, for comparing an engine before a save with after a resume."""
    return {k: None if v is None else v.detach().float().cpu().clone() for k, v in tensors.items()}
