"""What a maintainer says about one optimizer, in one record: `OptimizerSpec` (one file each beside
this one: adamw.py and the others registry.py lists). Every other module asks these facts instead of
testing for an optimizer's name: the flags and their checks (config.py), the DeepSpeed config entry
(ds_config.py, ds_compat.py), the DDP trainer's torch optimizer (optimizers.build_optimizer), the
state a checkpoint holds per parameter and how it maps into the neutral form (checkpoint/formats.py,
portable.py), what the planner and the memory record assume (plan/, telemetry/metrics.py), and its
refusals.

An optimizer steps the parameters it `takes` by its own rule and the rest with AdamW (e.g. only the
blocks' matrices; AdamW itself takes none beyond AdamW's own), over the AdamW groups both trainers
build (adamw.param_groups).
"""

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class State:
    """An optimizer's state per parameter, keyed as torch's state dicts key it; the neutral checkpoint
    form (checkpoint/formats.py) keeps the same keys, full tensors shaped like the parameter."""

    keys: tuple[str, ...]
    bytes: int  # fp32 bytes per parameter element, all keys together
    step: bool = False  # a step count beside them (AdamW's bias correction)
    # DeepSpeed 0.19.8's ZeRO-1/2 keep this state for whole matrices, on every rank whose partition
    # touches one, instead of partitioning it like the fp32 weights
    whole_under_zero: bool = False


ADAMW_STATE = State(("exp_avg", "exp_avg_sq"), bytes=8, step=True)  # AdamW's two fp32 moments


def _nothing(*_args, **_kwargs) -> None:
    return None


def _none(*_args) -> list:
    return []


@dataclass(frozen=True)
class OptimizerSpec:
    """One optimizer's facts. Defaults describe an optimizer that is AdamW for every parameter."""

    name: str  # --optimizer NAME, and the `optimizer` its checkpoints and metrics record
    title: str  # how log lines and refusals name it
    help: str  # what --optimizer NAME does, in --help
    ds_type: str  # DeepSpeed's "optimizer.type" for it
    build: Callable  # build(model, args): the DDP trainer's torch optimizer, over our AdamW groups
    state: State = ADAMW_STATE  # what each parameter it takes holds
    carries: str = "AdamW moments"  # what a converted resume carries, for its log line
    grad_clip: float = 1.0  # --grad_clip's default with it
    grad_clip_why: str = ""  # why, when it is not AdamW's
    takes: Callable = lambda name, shape: False  # (name, full shape) -> stepped by its own rule, not AdamW's
    numel: Callable = lambda margs: 0  # how many parameters it takes, from the ModelArgs (the planner)
    claims: Callable = lambda group: False  # a live optimizer's param group is its own, not AdamW's half
    # (an optimizer that takes every parameter claims every group)
    tag: Callable = _nothing  # tag(model): mark the parameters it takes, as DeepSpeed reads them
    # prepare(device type): what it decides about its arithmetic on that device, in both trainers
    # (e.g. the precision of an iteration it runs), before the first step
    prepare: Callable = _nothing
    add_flags: Callable = _nothing  # add_flags(argument group): its own flags
    problems: Callable = _none  # problems(args) -> [str]: flag combinations it refuses, before any work
    ds_params: Callable = lambda args: {}  # its "optimizer.params" beyond AdamW's, from the flags
    # fill_ds_config(config, zero stage, source): what it needs or refuses in a ds_config (in place)
    fill_ds_config: Callable = _nothing
    # comm_extras(zero stage, world, bytes per gradient element, ModelArgs, reduce bucket elements) ->
    # [(why, bytes)]: what DeepSpeed moves for it per step beyond the ZeRO paper's figure (FSDP2, DDP: never called)
    comm_extras: Callable = _none
    offload_moves: str = ""  # why its checkpoints cannot move into or out of CPU offload ("": they can)

    def group_state(self, group: dict) -> State:
        """The state a live optimizer's param group holds: its own, or AdamW's (the other half)."""
        return self.state if self.claims(group) else ADAMW_STATE

    @property
    def state_keys(self) -> tuple[str, ...]:
        """Every per-parameter state key its runs keep (its AdamW half's too): what a checkpoint carries."""
        return tuple(dict.fromkeys((*ADAMW_STATE.keys, *self.state.keys)))

    @property
    def whole_keys(self) -> tuple[str, ...]:
        """The state keys DeepSpeed's ZeRO-1/2 keep for whole matrices (State.whole_under_zero)."""
        return self.state.keys if self.state.whole_under_zero else ()

    def state_difference(self, numel: int) -> int:
        """Bytes of optimizer state beyond AdamW's two moments over `numel` parameters it takes
        (negative: less)."""
        return numel * (self.state.bytes - ADAMW_STATE.bytes)
