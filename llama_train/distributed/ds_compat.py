"""DeepSpeed workarounds, in one place, so the trainer uses only DeepSpeed's public API.

Each names the DeepSpeed behaviour it targets (seen in DeepSpeed 0.19.8 with torch 2.13, CPU
accelerator over gloo) and how we notice when it is no longer needed:
tests/test_ds_compat.py runs tests/helpers/ds_probe.py against the installed DeepSpeed and fails,
naming the workaround to drop, once the behaviour is gone.
"""

import contextlib
import glob
import io
import math
import os
import re
import sys
import time

import torch
from deepspeed.runtime.utils import clip_grad_norm_

from llama_train.distributed.ds_cpu import overlap_reductions
from llama_train.distributed.pipeline import is_pipeline
from llama_train.errors import ConfigError
from llama_train.optim.spec import ADAMW_STATE

# DeepSpeed's CPU shared-memory allreduce (op deepspeed_shm_comm, used when all ranks share a host)
SHM_BUFFER = "/dev/shm/deepspeed_allreduce_buffer_{uid}_{addr}_{port}_{rank}"


def shm_buffer_path(rank: int) -> str:
    return SHM_BUFFER.format(
        uid=os.getuid(),
        addr=os.environ.get("MASTER_ADDR", ""),
        port=os.environ.get("MASTER_PORT", ""),
        rank=rank,
    )


def release_deepspeed_shm(rank: int, world: int):
    """DeepSpeed creates one ~69 MB shared-memory file per rank (world > 1, one host) and never
    unlinks it: every CPU run left ranks x 69 MB of RAM in /dev/shm, and a later run on the same
    port mapped stale buffers. Every rank maps all buffers inside deepspeed.init_distributed();
    after a barrier each unlinks its own, so the memory lives exactly as long as the processes."""
    if world > 1:
        torch.distributed.barrier()
    try:
        os.unlink(shm_buffer_path(rank))
    except FileNotFoundError:  # multi-host jobs (no shm), or a build of DeepSpeed without the op
        pass


def warn_stale_build_locks(older_than_s: float = 600.0) -> list[str]:
    """A JIT build of a DeepSpeed op (cpu_adam, deepspeed_shm_comm) killed midway leaves a `lock`
    file behind (torch's FileBaton), and every later launch waits on it forever without a word.
    Name such locks before DeepSpeed loads its ops; returns the paths found."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or os.path.expanduser("~/.cache/torch_extensions")
    stale = []
    for lock in sorted(glob.glob(f"{root}/*/lock") + glob.glob(f"{root}/*/*/lock")):
        try:
            age = time.time() - os.path.getmtime(lock)
        except FileNotFoundError:  # a build that was running finished between the glob and here
            continue
        if age > older_than_s:
            stale.append(lock)
            print(
                f"warning: {lock} is {age / 60:.0f} min old: an interrupted build of a DeepSpeed op left it, "
                f"and loading that op waits for it forever. If no build is running, remove it: rm {lock}",
                file=sys.stderr,
                flush=True,
            )
    return stale


def allow_cpu_fp16_for_tests():
    """Tests only: LLAMA_TRAIN_TEST_CPU_FP16=1 lets DeepSpeed's real fp16 optimizers and dynamic loss
    scaler run on a CPU accelerator whose is_fp16_supported() is False (torch's oneDNN lacks fp16 on an
    AMD EPYC; a Xeon with AVX512-FP16 has it: DeepSpeed 0.19.8 accelerator/cpu_accelerator.py), a check
    that alone refuses fp16 (engine._do_sanity_check). fp16 arithmetic on CPU works, only slowly; tests/test_fp16_state.py uses it
    to test the loss scaler's state (spike skips, moves between strategies)."""
    if os.environ.get("LLAMA_TRAIN_TEST_CPU_FP16") != "1":
        return
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    if accelerator.device_name() == "cpu":
        accelerator.is_fp16_supported = lambda: True


def keep_fp32_grad_norm(engine):
    """fp32 without ZeRO: DeepSpeed 0.19.8 computes the gradient norm only when clipping
    (`clip_fp32_gradients`, skipped under --grad_clip 0) and drops it, and it applies an update whose
    gradients are inf/NaN (only ZeRO-1/2/3 and fp16 check). So the optimizer's step here clips to
    --grad_clip (0: max_norm inf, the norm only), keeps the norm for the log line (a pipeline's over
    all of its stages: `StageNorms`) and takes the engine's own overflow path for a non-finite norm or
    a spike (`opt.skip_when`, skip_updates_when): weights and AdamW untouched, LR held, skipped_steps
    counted, as ZeRO-1/2 do. tests/test_faults.py checks nothing non-finite is saved."""
    mpu = StageNorms(engine.mpu) if is_pipeline(engine) else engine.mpu
    opt, step_of = engine.optimizer, engine.optimizer.step

    def clip_and_step(*args, **kwargs):
        max_norm = engine.gradient_clipping() or math.inf
        norm = float(clip_grad_norm_(engine.module.parameters(), max_norm, mpu=mpu))
        engine._global_grad_norm = norm
        opt.overflow = bool(opt.skip_when(norm)) or not math.isfinite(norm)
        return None if opt.overflow else step_of(*args, **kwargs)

    engine.clip_fp32_gradients = lambda: None  # clipped in clip_and_step, with or without --grad_clip
    opt.skip_when, opt.step = (lambda norm: False), clip_and_step


class StageNorms:
    """A pipeline's grid as `clip_grad_norm_` should read it. DeepSpeed 0.19.8's clip_grad_norm_
    (runtime/utils.py) counts a parameter only on model-parallel rank 0 unless it is marked tensor
    parallel, and the pipeline grid's model-parallel rank is the stage: every stage but the first
    adds nothing, so fp32 ZeRO-0 pipelines clip with the first stage's norm (each stage by another
    factor) and their losses drift from every other strategy's. The other norms in that file filter
    on the tensor-parallel rank (bwc_tensor_model_parallel_rank); so does this view."""

    def __init__(self, grid):
        self.grid = grid

    def get_model_parallel_rank(self):
        return self.grid.get_slice_parallel_rank()  # the tensor-parallel rank within a stage

    def get_model_parallel_group(self):
        return self.grid.get_model_parallel_group()  # all stages (x tensor ranks) of one replica


def skip_identity_allreduce(engine):
    """One process without ZeRO: the gradient all-reduce is an identity that still flattens and
    copies back every gradient; ZeRO optimizers and bf16 need the call for their own work."""
    engine.enable_backward_allreduce = False


def zero0_fp32_master(engine) -> dict[int, torch.Tensor]:
    """ZeRO-0 with bf16/fp16: the fp32 master weights live in DeepSpeed's FP16_UnfusedOptimizer
    (`fp32_groups`, one tensor per parameter, for torch's AdamW) or FP16_Optimizer (`fp32_groups_flat`,
    for DeepSpeed's FusedAdam), where deepspeed.utils.safe_get_full_fp32_param does not look: it
    returns None for these parameters. {id(module parameter): its fp32 master}; {} elsewhere."""
    opt = engine.optimizer
    low = getattr(opt, "fp16_groups", None)
    if engine.zero_optimization_stage() != 0 or low is None:
        return {}
    if hasattr(opt, "fp32_groups"):
        high = opt.fp32_groups
    else:
        from torch._utils import _unflatten_dense_tensors

        high = [_unflatten_dense_tensors(flat, group) for flat, group in zip(opt.fp32_groups_flat, low)]
    return {id(p): master for group, masters in zip(low, high) for p, master in zip(group, masters)}


def batch_world(layout) -> int:
    """The world size DeepSpeed's batch arithmetic wants (`train_batch_size` = micro x accumulation
    x it). DeepSpeedConfig divides the ranks into data-parallel ones by the `mpu` it is given, and
    AutoTP brings none at that point (it builds its groups later, in the engine), so 0.19.8 counts
    every tensor-parallel rank as data parallel (runtime/config.py, DeepSpeedConfig.__init__) and
    asserts train_batch_size == micro x accumulation x world. A step still sees micro x accumulation
    x dp sequences; DeepSpeed's own sample counter (unused here) runs tp times too fast."""
    return layout.world if layout.tp > 1 else layout.dp


def keep_our_split():
    """DeepSpeed 0.19.8's deepspeed.initialize tags parameters for the optimizer its config names, by
    name (set_optimizer_flags in deepspeed/__init__.py), over any tags the caller set, so an optimizer
    record's own split (OptimizerSpec.tag; the one that needs it says why) would be lost, unlike in the
    DDP twin. Wrap it so that the record's split is what the engine sees, and what the record decides
    about its arithmetic on this device (OptimizerSpec.prepare: e.g. an iteration's precision) what it
    computes. Idempotent; a no-op for optimizers that tag nothing. tests/test_optimizers.py notices when DeepSpeed's tags match ours."""
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    from llama_train.optim.registry import OPTIMIZERS

    original = deepspeed.set_optimizer_flags
    if getattr(original, "keeps_our_split", False):
        return

    def set_optimizer_flags(config_class, model):
        original(config_class, model)
        for spec in OPTIMIZERS.values():
            if spec.ds_type.lower() == config_class.optimizer_name:
                spec.tag(model)
                spec.prepare(get_accelerator().device_name())

    set_optimizer_flags.keeps_our_split, set_optimizer_flags.original = True, original
    deepspeed.set_optimizer_flags = set_optimizer_flags


def patch_engine(engine, world: int, config: dict | None = None):
    """Apply the workarounds that this engine's configuration (`config`: the dict it was built from)
    needs."""
    mixed_or_zero = engine.fp16_enabled() or engine.bfloat16_enabled() or engine.zero_optimization()
    if not mixed_or_zero:
        keep_fp32_grad_norm(engine)
    if world == 1 and not engine.zero_optimization() and not engine.bfloat16_enabled():
        skip_identity_allreduce(engine)
    if engine.bfloat16_enabled() and "check_grad_overflow" not in (config or {}).get("bf16", {}):
        skip_bf16_overflow_scan(engine)  # a config that sets bf16.check_grad_overflow gets DeepSpeed's own
    if world > 1:  # ZeRO-1/2 on a CPU (ds_cpu.py): reductions beside backward, gathers by broadcasts
        overlap_reductions(engine)
    skip_nonfinite_on_device(engine)  # bf16 ZeRO-1/2: no host sync in the step


def skip_bf16_overflow_scan(engine):
    """bf16 ZeRO-1/2 (DeepSpeedZeroOptimizer): DeepSpeed 0.19.8's `check_grad_overflow` (on by default)
    scans every gradient for inf/NaN, all-reduces the flag and reads it on the host (`.item()`), every
    step, before computing the gradient norm; the same `check_grad_overflow` also makes a non-finite
    norm skip the step (`step()`: `(self.dtype != torch.bfloat16 or self.check_grad_overflow) and
    is_invalid_grad_norm(...)`), and switched off a bf16 step would apply inf/NaN. So the scan alone
    goes: an inf/NaN gradient makes the norm inf/NaN, which skips the step through the engine's
    overflow path, as fp32 ZeRO steps are skipped and as DDP skips (guards.NonFiniteGuard counts it).
    Noticed when gone: tests/test_ds_compat.py checks that a patched bf16 ZeRO-2 engine skips a NaN
    step without the scan's collective, and that DeepSpeed's step still reads `check_grad_overflow`."""
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    opt = engine.optimizer
    if isinstance(opt, DeepSpeedZeroOptimizer) and opt.check_grad_overflow:

        def check_overflow(partition_gradients=True):
            opt.overflow = False  # the norm decides (above)

        opt.check_overflow = check_overflow


_STEPPING = []  # the inner optimizer of a step deciding on the device (skip_nonfinite_on_device), while it runs


def _invalid_on_device(original):
    """DeepSpeed's is_invalid_grad_norm (`bool(tensor)`: a host sync) inside a device-deciding step: the
    verdict goes to the inner optimizer's `found_inf` (fused AdamW skips its update on the device, as
    under torch's GradScaler) and the step goes on as if the norm were valid. Elsewhere the original."""

    def is_invalid_grad_norm(norm):
        if not _STEPPING or not torch.is_tensor(norm):
            return original(norm)
        inner, bad = (
            _STEPPING[-1],
            (~torch.isfinite(norm) | (norm < 0)).any().float(),
        )  # -1: DeepSpeed's inf/NaN
        known = getattr(inner, "found_inf", None)
        inner.found_inf = bad if known is None else torch.maximum(known, bad)
        return False

    is_invalid_grad_norm.original = original
    return is_invalid_grad_norm


def _clip_on_device(original):
    """DeepSpeed's clip_tensors_by_global_norm (`if clip_coef < 1`: a host sync) inside a device-deciding
    step: every gradient times min(1, clip_coef), the same numbers (x 1.0 is exact). Elsewhere the original."""

    def clip_tensors_by_global_norm(
        input_tensors, max_norm=1.0, global_norm=None, mpu=None, eps=1e-6, **kwargs
    ):
        if not _STEPPING or not torch.is_tensor(global_norm):
            return original(input_tensors, max_norm, global_norm, mpu, eps, **kwargs)
        coef = torch.clamp(max_norm / (global_norm + eps), max=1.0)
        for tensor in input_tensors:
            tensor.detach().mul_(coef)
        return global_norm

    clip_tensors_by_global_norm.original = original
    return clip_tensors_by_global_norm


def _decide_on_device_in_deepspeed():
    """Install the two stand-ins above where DeepSpeed 0.19.8's ZeRO-1/2 steps call them (module globals
    of stage_1_and_2 and bf16_optimizer); idempotent. Outside a device-deciding step they call DeepSpeed's."""
    from deepspeed.runtime import bf16_optimizer
    from deepspeed.runtime.zero import stage_1_and_2

    for module in (stage_1_and_2, bf16_optimizer):
        if not hasattr(module.is_invalid_grad_norm, "original"):
            module.is_invalid_grad_norm = _invalid_on_device(module.is_invalid_grad_norm)
    if not hasattr(bf16_optimizer.clip_tensors_by_global_norm, "original"):
        bf16_optimizer.clip_tensors_by_global_norm = _clip_on_device(
            bf16_optimizer.clip_tensors_by_global_norm
        )


def skip_nonfinite_on_device(engine) -> bool:
    """bf16 ZeRO-1/2: decide a non-finite step on the device, as the DDP twin does (ddp.DDPEngine.step),
    instead of on the host. DeepSpeed 0.19.8 reads the gradient norm on the host 2-3 times a step:
    DeepSpeedZeroOptimizer.step's `is_invalid_grad_norm` (a skip) and unscale_and_clip_grads' (for each
    group), BF16_Optimizer.step's `is_invalid_grad_norm` and `if clip_coef < 1` (runtime/utils.py), so the
    next step's work is queued only once the device has caught up. Here the verdict becomes fused AdamW's
    `found_inf` (no update, its step count held), the clip a device multiply; the engine, told nothing,
    steps the LR schedule, and `settle_skip` (the guard's verdict a step later, before the next update)
    takes that step back and counts the skip. Only where the inner optimizer takes `found_inf` (torch's
    fused AdamW: not DeepSpeedCPUAdam under offload, nor another optimizer); fp16 keeps DeepSpeed's own path (its loss
    scaler decides on the host), as do fp32 ZeRO and pipelines. Returns whether it was installed.
    Noticed when gone: tests/test_ds_compat.py counts the host reads of a bf16 ZeRO-1/2 step."""
    from deepspeed.runtime.bf16_optimizer import BF16_Optimizer
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    opt = engine.optimizer
    inner = getattr(opt, "optimizer", None)
    if not (engine.bfloat16_enabled() and isinstance(opt, DeepSpeedZeroOptimizer | BF16_Optimizer)):
        return False
    if is_pipeline(engine) or not getattr(inner, "_step_supports_amp_scaling", False):
        return False
    _decide_on_device_in_deepspeed()
    step_of = opt.step

    def step(*args, **kwargs):
        _STEPPING.append(inner)
        try:
            return step_of(*args, **kwargs)
        finally:
            _STEPPING.pop()
            inner.found_inf = inner.grad_scale = None  # read by the next step's kernels otherwise

    opt.step, opt.skips_on_device = step, True
    return True


def skips_on_device(engine) -> bool:
    """Whether skip_nonfinite_on_device is in place: the step's verdict is then the guard's to settle."""
    return getattr(engine.optimizer, "skips_on_device", False)


def settle_skip(engine, nonfinite: bool) -> bool:
    """A device-skipped step's host side, once its verdict is read (before the next update): the skip
    counted, and the LR schedule's step that the engine took after it taken back (the schedule holds,
    as on DeepSpeed's own overflow path and in the DDP twin; LambdaLR's LR is a function of its step).
    Returns whether the update was left out."""
    if nonfinite:
        engine.skipped_steps += 1
        engine.lr_scheduler.last_epoch -= 2
        engine.lr_scheduler.step()
    return nonfinite


def skip_updates_when(engine, decide):
    """The spike guard's hook (guards.SpikeGuard) inside DeepSpeed's step: `decide(grad_norm)` runs in
    engine.step() at the accumulation boundary, once the global gradient norm (before clipping) is
    known and before the optimizer applies the update; True sends the step down the engine's own
    overflow path, as an fp16 overflow would: gradients dropped, weights and optimizer state
    untouched, the LR schedule held, `engine.skipped_steps` counting it. An fp32/bf16 update cannot
    be taken back after engine.step(), so there is no other place to decide.

    DeepSpeed 0.19.8: ZeRO-1/2's DeepSpeedZeroOptimizer computes the norm in `scaled_global_norm()`
    and checks `self.overflow` right after it; ZeRO-0 fp32 steps torch's optimizer through
    keep_fp32_grad_norm's step, which asks `opt.skip_when` once it has the norm. Other optimizers (ZeRO-3, ZeRO-0 in
    bf16/fp16, ZeRO-1 in bf16 with fp32 accumulation) are refused. tests/test_reporting.py checks
    that a skipped ZeRO-2 step leaves weights and optimizer state bit-identical; fp16's loss scaler
    is told of the real overflow only, so a spike neither halves the scale nor spends its hysteresis
    (tests/test_fp16_state.py)."""
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    opt, state = engine.optimizer, {"skipped": False, "norm": None, "overflow": False}
    if isinstance(opt, DeepSpeedZeroOptimizer):
        norm_of, step_of, update_scale = opt.scaled_global_norm, opt.step, opt._update_scale

        def scaled_global_norm(*args, **kwargs):
            norm = norm_of(*args, **kwargs)
            state["norm"] = float(norm) / opt.loss_scale
            state["overflow"] = opt.overflow or not math.isfinite(state["norm"])
            state["skipped"] = decide(state["norm"])
            opt.overflow = opt.overflow or state["skipped"]
            return norm

        def _update_scale(has_overflow=False):  # fp16: a spike is no overflow; the scale stays
            return update_scale(state["overflow"] if state["skipped"] else has_overflow)

        def step(*args, **kwargs):
            state["skipped"] = False
            out = step_of(*args, **kwargs)
            if state["skipped"]:  # the overflow path reports an inf norm: keep the real one
                opt._global_grad_norm = state["norm"]
            return out

        opt.scaled_global_norm, opt.step, opt._update_scale = scaled_global_norm, step, _update_scale
    elif engine.zero_optimization_stage() == 0 and not (engine.fp16_enabled() or engine.bfloat16_enabled()):
        opt.skip_when = decide  # keep_fp32_grad_norm's step asks it once the norm is known
    else:
        raise ConfigError(
            f"--skip_loss_zscore / --skip_grad_zscore: DeepSpeed's {type(opt).__name__} (ZeRO-{engine.zero_optimization_stage()}"
            f"{', bf16' if engine.bfloat16_enabled() else ''}) has no hook to skip an update before it is applied; the "
            "guard works with ZeRO-0 in fp32 and ZeRO-1/2 (ds_configs/zero2.json), and in train_ddp.py"
        )


def announce_op_builds(ops=("deepspeed_shm_comm",)) -> list[str]:
    """DeepSpeed JIT-compiles its CPU ops (here the shared-memory allreduce) the first time they load:
    ~90 s without a word. Say so before, naming where the build is cached; returns the ops to build."""
    from torch.utils.cpp_extension import _get_build_directory

    dirs = {op: _get_build_directory(op, verbose=False) for op in ops}
    missing = [op for op, d in dirs.items() if not os.path.isfile(os.path.join(d, f"{op}.so"))]
    if missing:
        root = os.path.dirname(dirs[missing[0]])
        print(
            f"building DeepSpeed's CPU ops once ({', '.join(missing)}: ~90 s, cached in {root})",
            file=sys.stderr,
            flush=True,
        )
    return missing


@contextlib.contextmanager
def hide_op_load_banner(verbose: bool = False):
    """DeepSpeed 0.19.8's deepspeed.init_distributed() prints "DeepSpeed deepspeed.ops.comm.
    deepspeed_shm_comm_op built successfully" on every rank of every CPU run, built or only loaded
    (comm/torch.py: build_shm_op); other lines it prints pass through."""
    if verbose:
        yield
        return
    buf = io.StringIO()
    try:
        with contextlib.redirect_stdout(buf):
            yield
    finally:
        for line in buf.getvalue().splitlines():
            if not re.fullmatch(r"DeepSpeed \S+ built successfully", line):
                print(line, flush=True)


def create_optimizer_state(engine, step: int, group_state=None, whole=None):
    """ZeRO-1/2/3 create the optimizer's state (and link it to each parameter's fragment) only in the
    first optimizer step, so DeepSpeed's public setters (safe_set_full_optimizer_state) have nothing to
    write into before it. A converted resume creates it as zeros, in the inner optimizer's own
    format (torch's load_state_dict places `step` as the fused kernel wants it; DeepSpeedCPUAdam
    counts an int), as ZeRO-3's own _rigid_load_state_dict does around its groups, then links it as
    the first step would (ZeRO-1/2: _lazy_init_hp_params_optimizer_state). Each group gets the state
    `group_state(group)` names (OptimizerSpec.group_state; default AdamW's moments and step): ZeRO-3
    partitions it like the weights (zeros here, set per parameter by zero3_set_full); a State kept
    `whole_under_zero` ZeRO-1/2 hold for the whole matrices their partition touches
    (get_flat_partition): `whole(params_in_partition, key)` builds it, DeepSpeed's setters cannot."""
    zero, inner = engine.optimizer, engine.optimizer.optimizer
    stage3 = hasattr(zero, "_set_fp32_optimizer_param_groups")
    if stage3:
        zero._set_fp32_optimizer_param_groups()  # ZeRO-3 keeps its groups empty between steps
    as_int = type(inner).__name__ == "DeepSpeedCPUAdam"
    state, index = {}, 0
    for g, group in enumerate(inner.param_groups):
        kind = group_state(group) if group_state else ADAMW_STATE
        for p in group["params"]:
            if not kind.whole_under_zero or stage3:
                counted = {"step": step if as_int else torch.tensor(float(step))} if kind.step else {}
                state[index] = {**counted, **{k: torch.zeros_like(p) for k in kind.keys}}
            elif zero.params_in_partition[g]:
                state[index] = {k: whole(zero.params_in_partition[g], k) for k in kind.keys}
            index += 1
    inner.load_state_dict({"state": state, "param_groups": inner.state_dict()["param_groups"]})
    if stage3:
        zero._clear_fp32_optimizer_param_groups()
    link = getattr(zero, "_lazy_init_hp_params_optimizer_state", None)
    if link is not None:
        link()


def zero3_set_full(optimizer, param, tensors: dict):
    """ZeRO-3's set_full_hp_param (behind safe_set_full_fp32_param / _optimizer_state) narrows
    value[rank * part : (rank + 1) * part] without padding, which runs past the end on the last rank
    when a parameter's size does not divide by the world size (DeepSpeed 0.19.8; e.g. a norm of 64
    on 3 ranks). This rank's piece of each flat value ("fp32" or a moment), zero-padded as ZeRO-3
    pads its partitions, written where DeepSpeed's own getter reads it."""
    rank = optimizer._get_param_partition_rank(param)
    for key, value in tensors.items():
        part, _ = optimizer._get_fp32_opt_state_partition(
            param, release_swap_buffers=False, optim_state_key=None if key == "fp32" else key
        )
        piece = value.flatten()[rank * part.numel() : (rank + 1) * part.numel()]
        part.data.zero_()  # .data: the fp32 partition is a leaf that requires grad
        part.data[: piece.numel()].copy_(piece)


def relink_hp_optimizer_state(engine):
    """ZeRO-1/2 (and DeepSpeed's bf16 optimizer) link AdamW's state to every parameter's fragment once,
    right after the first parameter group's first step, when the other groups have no state yet:
    their parameters stay linked to nothing, and safe_get_full_optimizer_state fails for them with
    "exp_avg not found in optimizer state fragment" (DeepSpeed 0.19.8, two param groups). Linking
    again once every group has state fixes it; training itself never reads the links."""
    zero = engine.optimizer
    if getattr(zero, "_hp_optimizer_states_linked", False):
        zero._hp_optimizer_states_linked = False
        zero._lazy_init_hp_params_optimizer_state()


@contextlib.contextmanager
def captured_saves(engine):
    """DeepSpeed 0.19.8's save_checkpoint writes each file through `engine.checkpoint_engine.save(state,
    path)` (TorchCheckpointEngine: a plain torch.save; `latest` is ours, save_latest=False). While
    inside, a stand-in keeps {path: state} instead, for llama_train.checkpoint.async_save to write now or from a
    host copy in the background: one writer for both modes, the same bytes. The collectives of
    save_checkpoint (its barriers, the tag check) still run here, on the training thread. Noticed
    when gone: tests/test_resume.py compares an async run's checkpoint files with a sync run's."""
    from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointEngine

    class Capture(CheckpointEngine):
        def __init__(self):
            super().__init__()
            self.files = {}

        def create(self, info):
            pass

        def save(self, state_dict, path: str):
            self.files[path] = state_dict

        def load(self, path: str, map_location=None):
            raise NotImplementedError("captured_saves is for saving only")

        def commit(self, info):
            return True

    real, engine.checkpoint_engine = engine.checkpoint_engine, Capture()
    try:
        yield engine.checkpoint_engine.files
    finally:
        engine.checkpoint_engine = real
