"""Guards around the optimizer step: stopping cleanly (a signal, the launcher's stop request, a
launcher gone), non-finite gradients, and loss or gradient-norm spikes (SpikeGuard, the one guard
that syncs the host each step, when it is on).

The first two never read a device value in the step that produced it: each step's verdict (signal seen by any
rank, non-finite gradient norm) is copied to the host behind an event and read one step later,
when the device is busy with the next step's work already queued. So the CPU keeps running ahead
of the GPU, and the decisions stay the same on every rank.
"""

import math
import os
import signal
import time

import psutil
import torch
import torch.distributed as dist

from llama_train import gpu
from llama_train.distributed.dist import all_reduce_mean, is_dist
from llama_train.errors import NonFiniteError
from llama_train.ops.stopfile import STALE_S, stop_path


class DeviceFlag:
    """A small device tensor read on the host later without stalling the device: `put` copies it to
    pinned host memory behind a CUDA event; `take` waits for that event only, not for the work
    queued after it. On CPU both are plain reads."""

    def __init__(self):
        self._host, self._event, self._pending = None, None, False

    def put(self, t: torch.Tensor):
        assert not self._pending, "take() the previous value first"
        if t.device.type == "cuda":
            if self._host is None or self._host.shape != t.shape:
                self._host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
                self._event = torch.cuda.Event()
            self._host.copy_(t, non_blocking=True)
            self._event.record()
        else:
            self._host, self._event = t, None
        self._pending = True

    def take(self) -> list[float] | None:
        """The value `put` last, or None if nothing is pending."""
        if not self._pending:
            return None
        self._pending = False
        if self._event is not None:
            self._event.synchronize()
        return self._host.tolist()


LAUNCHER_SCRIPTS = ("deepspeed", "torchrun")
# the modules of `python -m MODULE` launchers: deepspeed's per-node one, torchrun and deepspeed
# (gpu.LAUNCHER_MODULES, as the bench and the scripts start them), and the launch front
LAUNCHER_MODULES = ("deepspeed.launcher.launch", *gpu.LAUNCHER_MODULES.values(), "llama_train.launch")


def launcher_name(cmdline: list[str]) -> str | None:
    """'deepspeed', 'torchrun', or the module of `python -m MODULE`, when a command line is one of
    the launchers a rank runs under; else None."""
    words = cmdline[1:] if cmdline and "python" in os.path.basename(cmdline[0]) else cmdline
    words = [w for w in words[:4] if not (w.startswith("-") and w != "-m")]
    if words and os.path.basename(words[0]) in LAUNCHER_SCRIPTS:
        return os.path.basename(words[0])
    if len(words) >= 2 and words[0] == "-m" and words[1] in LAUNCHER_MODULES:
        return words[1]
    return None


class LauncherWatch:
    """The launchers this process runs under (parent, grandparent, ... while they are launchers:
    launcher.launch and `deepspeed`, torchrun, llama_train.launch). `gone()` names one that has
    died, so ranks stop cleanly rather than train on as orphans (a plain `deepspeed` killed by
    SIGTERM). Checked at most once a second."""

    def __init__(self):
        self.launchers = []
        try:
            for p in psutil.Process().parents():
                name = launcher_name(p.cmdline())
                if name is None:
                    break
                self.launchers.append((p, name))
        except psutil.Error:  # an ancestor we may not inspect: watch what we found
            pass
        self._next = 0.0

    def gone(self) -> str | None:
        if not self.launchers or time.monotonic() < self._next:
            return None
        self._next = time.monotonic() + 1.0
        for p, name in self.launchers:
            try:
                alive = p.is_running() and p.status() != psutil.STATUS_ZOMBIE
            except psutil.NoSuchProcess:
                alive = False
            if not alive:
                return f"{name} (pid {p.pid})"
        return None


class Stopper:
    """Ends a run early but cleanly, after the current step: every rank finishes it, a checkpoint
    is saved and the run exits 0. What asks for it: SIGTERM/SIGINT to a rank (preemption, Ctrl-C),
    the stop file of llama_train.launch (<output_dir>/llama_train.stop: the launcher was signalled), a
    launcher of this rank that died, or `--stop_after_steps`. Under a launcher, further signals are
    ignored (launchers and schedulers repeat them; the save must not be cut short: SIGKILL, or a
    second signal to llama_train.launch, exits now); a single process exits on a second signal."""

    def __init__(self, stop_after_steps: int, rank: int, output_dir: str | None = None):
        self.stop_after, self.rank, self.signalled = stop_after_steps, rank, False
        self._any, self._alone = DeviceFlag(), False  # the ranks' stop flags; one process's, a step late
        self.watch = LauncherWatch()
        self.stop_file = output_dir and stop_path(output_dir)
        self.started = psutil.Process().create_time()
        self.launched = bool(self.watch.launchers) or int(os.environ.get("WORLD_SIZE", "1")) > 1
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._handle)

    def _handle(self, signum, _frame):
        if self.signalled:
            return  # the launcher's (or scheduler's) own repeat: the stop is under way
        self.signalled = True
        if not self.launched:  # one interactive process: a second Ctrl-C exits now
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            signal.signal(signal.SIGINT, signal.SIG_DFL)
        again = "" if self.launched else " (send it again to exit now)"
        self._say(f"{signal.Signals(signum).name}: finishing this step and saving a checkpoint{again}")

    def _say(self, message: str):
        print(f"[rank {self.rank}] {message}", flush=True)

    def _asked_from_outside(self) -> bool:
        """The launcher's stop file, or a launcher gone."""
        if self._stop_file_seen():
            self._say("the launcher was signalled: finishing this step and saving a checkpoint")
            return True
        gone = self.watch.gone()
        if gone:
            self._say(f"launcher {gone} is gone: finishing this step and saving a checkpoint")
        return gone is not None

    def _stop_file_seen(self) -> bool:
        """<output_dir>/llama_train.stop (one stat a step, on a shared filesystem too), when written after
        this rank started (less STALE_S of clock skew between hosts): an older one is a dead run's."""
        if not self.stop_file:
            return False
        try:
            return os.stat(self.stop_file).st_mtime >= self.started - STALE_S
        except FileNotFoundError:
            return False

    def should_stop(self, step: int, device) -> bool:
        """Collective, once per step: every rank stops after the same step. The ranks' stop flags are
        max-reduced after each step and read after the next, so a request stops the run one step
        after the step it arrived in, without a host sync. One process keeps the same timing on the
        host alone."""
        if not self.signalled and self._asked_from_outside():
            self.signalled = True
        if not is_dist() or dist.get_world_size() == 1:  # nothing to agree on: no fill, collective or copy
            seen, self._alone = self._alone, self.signalled
            return seen or step == self.stop_after
        seen = self._any.take()
        flag = torch.full((1,), float(self.signalled), device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        self._any.put(flag)
        return (seen is not None and seen[0] > 0) or step == self.stop_after


# what a non-finite gradient norm meant for the update (NonFiniteGuard.watch)
SKIPPED = "skipped"  # the update was left out (DDP: on the device; DeepSpeed: its overflow path): counted
SCALER = "scaler"  # fp16 loss scaling skipped it and lowers the scale: expected, not counted
APPLIED = "applied"  # the engine applied it anyway (an optimizer without a check): stop the run


def deepspeed_verdict(skipped_before: int, skipped_after: int) -> str:
    """What DeepSpeed did with a step whose norm was non-finite, from `engine.skipped_steps` around its
    engine.step(): ZeRO-1/2/3 (and ZeRO-0 fp32, ds_compat.keep_fp32_grad_norm) drop such an update and
    hold the LR schedule, as the DDP twin does, so the step counts as SKIPPED; one that went through
    is APPLIED."""
    return SKIPPED if skipped_after > skipped_before else APPLIED


class NonFiniteGuard:
    """Optimizer steps whose global gradient norm was inf/NaN. `watch` returns the step's verdict as a
    device tensor (1.0 = non-finite), for an optimizer that skips on the device (fused AdamW's
    `found_inf`); `settle` reads it on the host a step later (or now, before a save or a log line),
    counts it, and stops the run after `limit` skipped steps in a row or one applied one.

    fp16 overflows are the loss scaler's (SCALER: not counted, the scale goes down), but not a
    non-finite loss: no scale makes it finite, so it counts like any other skipped step (`loss`).

    `left_out`: the settled steps whose update the engine left out, for whatever reason (a non-finite
    gradient, an fp16 overflow, a spike): those whose `then` returned True. The sample ledger records
    them (RunServices.record_left_out)."""

    def __init__(self, limit: int, rank: int = 0):
        self.limit, self.in_a_row, self.total, self.rank = limit, 0, 0, rank
        self._flag, self._pending = DeviceFlag(), None
        self.left_out: list[int] = []

    def watch(self, grad_norm, step: int, meaning: str = SKIPPED, then=None, loss=None) -> torch.Tensor:
        """Queue step `step`'s verdict; `then(nonfinite: bool)` runs when it is settled and returns whether
        the step's update was left out (then recorded in `left_out`). Settles the
        previous step first (waiting for that step's work only). `loss` (fp16: this rank's loss for the
        step, on the device): non-finite on any rank (a max all-reduce, no host sync), a SCALER step
        counts as skipped."""
        self.settle()
        # on the norm's device, where the optimizer reads it (CPU under FSDP2's offload: a CPU kernel must
        # not read a flag still being copied from the GPU); a negative norm is DeepSpeed's inf/NaN
        norm = torch.as_tensor(grad_norm, dtype=torch.float32)
        found_inf = (~torch.isfinite(norm) | (norm < 0)).float()
        flag = found_inf.reshape(1)
        if loss is not None:  # the host flag: both verdicts, on the loss's device for the all-reduce
            loss_inf = (~torch.isfinite(loss.detach().float())).float().reshape(1)
            if is_dist():
                dist.all_reduce(loss_inf, op=dist.ReduceOp.MAX)
            flag = torch.cat([flag.to(loss_inf.device), loss_inf])
        self._flag.put(flag)
        self._pending = (step, meaning, then)
        return found_inf

    def settle(self):
        """Decide the pending verdict, if any (a host sync on it)."""
        if self._pending is None:
            return
        (bad, *loss_bad), (step, meaning, then) = self._flag.take(), self._pending
        self._pending = None
        if meaning == SCALER and any(loss_bad):  # a non-finite loss: no loss scale helps
            bad, meaning = True, SKIPPED
        self._count(bool(bad), step, meaning)
        if then is not None and then(bool(bad)):
            self.left_out.append(step)

    def take_left_out(self) -> list[int]:
        """The steps left out since the last call (settled ones only)."""
        steps, self.left_out = self.left_out, []
        return steps

    def _count(self, bad: bool, step: int, meaning: str):
        if not bad or meaning == SCALER:
            self.in_a_row = 0 if not bad else self.in_a_row
            return
        if meaning == APPLIED:
            raise NonFiniteError(
                f"step {step}: non-finite gradient norm and the optimizer applied the update anyway; "
                "stopping before anything is saved. The last checkpoint is intact: lower --learning_rate "
                "or --grad_clip and resume"
            )
        self.in_a_row, self.total = self.in_a_row + 1, self.total + 1
        if self.rank == 0:
            print(
                f"step {step}: skipped the update: non-finite gradient norm "
                f"({self.in_a_row} in a row; --max_nonfinite_steps {self.limit} stops the run)",
                flush=True,
            )
        if self.in_a_row >= self.limit:
            raise NonFiniteError(
                f"{self.in_a_row} optimizer steps in a row had non-finite gradients (the last at step {step}); "
                "stopping. The last checkpoint is intact: lower --learning_rate or --grad_clip and resume from it"
            )


class SpikeGuard:
    """Skips an optimizer update whose loss or gradient norm is an outlier (llm.c's -sl / -sg): more
    than `loss_z` / `grad_z` standard deviations above the mean of the last `window` kept steps. Off
    when both are 0. Acts once the window is full; a skipped step's values stay out of the window.
    The windows (`state`) go into every checkpoint's trainer state and come back on resume
    (`restore_state`), so a resumed run decides as the uninterrupted one would.

    The inputs are the same on every rank (the loss is all-reduced in `observe`, the norm is of
    all-reduced gradients), and the verdict is max-reduced as well, so every rank decides the same
    even if a norm differed in its last bit. When on, each step waits for its loss on the host once
    (and two scalar all-reduces): the guard is off by default for that reason."""

    def __init__(self, loss_z: float, grad_z: float, window: int, rank: int = 0):
        self.loss_z, self.grad_z, self.rank = loss_z, grad_z, rank
        self.enabled, self.window = loss_z > 0 or grad_z > 0, window
        self.state = {"losses": [], "grad_norms": []}  # the last `window` kept steps' values, in place
        self.step, self.loss, self.device = 0, None, "cpu"  # the step being decided, its loss (observe)
        self.skipped = 0  # updates skipped so far in this process

    @classmethod
    def from_args(cls, args, rank: int) -> "SpikeGuard":
        return cls(args.skip_loss_zscore, args.skip_grad_zscore, args.spike_window, rank)

    def observe(self, step: int, loss: torch.Tensor, device):
        """Step `step`'s loss (mean over its micro-batches); collective when the loss guard is on: the
        mean over ranks, on the host. Call before the update is applied (DeepSpeed: before the
        boundary's engine.step())."""
        self.step, self.device = step, device
        if self.loss_z > 0:
            (self.loss,) = all_reduce_mean([float(loss)], device)

    def should_skip(self, grad_norm) -> bool:
        """Decide for the observed step from its loss and `grad_norm` (a float or tensor, before
        clipping; None when unknown): True skips the update. A kept step joins the windows."""
        if not self.enabled:
            return False
        step, loss, self.loss = self.step, self.loss, None
        norm = None if grad_norm is None else float(grad_norm)
        past_losses, past_norms = self.state["losses"], self.state["grad_norms"]
        checks = [("loss", loss, past_losses, self.loss_z), ("grad norm", norm, past_norms, self.grad_z)]
        reasons = [r for what, x, past, limit in checks if (r := outlier(what, x, past, limit, self.window))]
        (verdict,) = all_reduce_max([float(bool(reasons))], self.device)  # any rank's spike skips on all
        if verdict > 0:
            self.skipped += 1
            if self.rank == 0:
                why = "; ".join(reasons) or "another rank saw a spike"
                print(f"step {step}: skipped the update: {why}", flush=True)
            return True
        for _, x, past, limit in checks:
            if limit > 0 and x is not None and math.isfinite(x):  # non-finite ones: NonFiniteGuard's
                past.append(x)
                del past[: -self.window]
        return False

    def restore_state(self, trainer_state: dict):
        """The windows of a checkpoint's trainer state, already read (resuming.Resume.state)."""
        saved = trainer_state.get("spike_guard") or {}
        for key, values in self.state.items():
            values[:] = saved.get(key, [])[-self.window :]


def all_reduce_max(values: list[float], device) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64, device=device)
    if is_dist():
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def zscore(x: float, past: list[float], window: int) -> tuple[float, float, float] | None:
    """(z, mean, std) of `x` against the values in `past`, once it holds `window` of them; or None."""
    if len(past) < max(window, 2):
        return None
    mean = sum(past) / len(past)
    std = math.sqrt(sum((v - mean) ** 2 for v in past) / len(past))
    return ((x - mean) / std if std > 0 else math.inf if x > mean else 0.0), mean, std


def outlier(what: str, x: float | None, past: list[float], limit: float, window: int) -> str | None:
    """Why `x` is an outlier (a sentence), or None: only upward spikes count."""
    if limit <= 0 or x is None or not math.isfinite(x) or (z := zscore(x, past, window)) is None:
        return None
    score, mean, std = z
    if score <= limit:
        return None
    return (
        f"{what} {x:.4g} is {score:.1f} sd above the last {len(past)} steps' mean {mean:.4g} (sd {std:.2g})"
    )


def injected_spike(loss: torch.Tensor, step: int) -> torch.Tensor:
    """Tests only: LLAMA_TRAIN_TEST_SPIKE=STEP:RANK:FACTOR[,STEP:RANK:FACTOR...] multiplies that rank's
    micro-batch losses at optimizer step STEP by FACTOR (so its loss and its gradients spike), as a bad
    batch would."""
    for spec in filter(None, os.environ.get("LLAMA_TRAIN_TEST_SPIKE", "").split(",")):
        at, rank, factor = spec.split(":")
        if step == int(at) and os.environ.get("RANK", "0") == rank:
            return loss * float(factor)
    return loss
