"""Guards around the optimizer step: stopping cleanly (a signal, the launcher's stop request, a
launcher gone), and non-finite gradients.

Neither reads a device value in the step that produced it: each step's verdict (signal seen by any
rank, non-finite gradient norm) is copied to the host behind an event and read one step later,
when the device is busy with the next step's work already queued. So the CPU keeps running ahead
of the GPU, and the decisions stay the same on every rank.
"""

import os
import signal
import time

import psutil
import torch
import torch.distributed as dist

from llama_train.dist import is_dist
from llama_train.launch import STOP_FILE_ENV


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
LAUNCHER_MODULES = ("deepspeed.launcher.launch", "torch.distributed.run", "llama_train.launch")


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
    the stop file of llama_train.launch ($LLAMA_TRAIN_STOP_FILE: the launcher was signalled), a
    launcher of this rank that died, or `--stop_after_steps`. Under a launcher, further signals are
    ignored (launchers and schedulers repeat them; the save must not be cut short: SIGKILL, or a
    second signal to llama_train.launch, exits now); a single process exits on a second signal."""

    def __init__(self, stop_after_steps: int, rank: int):
        self.stop_after, self.rank, self.signalled = stop_after_steps, rank, False
        self._any = DeviceFlag()
        self.watch = LauncherWatch()
        self.stop_file = os.environ.get(STOP_FILE_ENV)
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
        if self.stop_file and os.path.exists(self.stop_file):
            if self.rank == 0:
                self._say("the launcher was signalled: finishing this step and saving a checkpoint")
            return True
        gone = self.watch.gone()
        if gone:
            self._say(f"launcher {gone} is gone: finishing this step and saving a checkpoint")
        return gone is not None

    def should_stop(self, step: int, device) -> bool:
        """Collective, once per step: every rank stops after the same step. The ranks' stop flags are
        max-reduced after each step and read after the next, so a request stops the run one step
        after the step it arrived in, without a host sync."""
        if not self.signalled and self._asked_from_outside():
            self.signalled = True
        seen = self._any.take()
        flag = torch.full((1,), float(self.signalled), device=device)
        if is_dist():
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        self._any.put(flag)
        return (seen is not None and seen[0] > 0) or step == self.stop_after


# what a non-finite gradient norm meant for the update (NonFiniteGuard.watch)
SKIPPED = "skipped"  # the update was left out (on the device): counts towards --max_nonfinite_steps
SCALER = "scaler"  # fp16 loss scaling skipped it and lowers the scale: expected, not counted
APPLIED = "applied"  # the engine applied it anyway (DeepSpeed outside fp16): stop the run


class NonFiniteGuard:
    """Optimizer steps whose global gradient norm was inf/NaN. `watch` returns the step's verdict as a
    device tensor (1.0 = non-finite), for an optimizer that skips on the device (fused AdamW's
    `found_inf`); `settle` reads it on the host a step later (or now, before a save or a log line),
    counts it, and stops the run after `limit` skipped steps in a row or one applied one."""

    def __init__(self, limit: int):
        self.limit, self.in_a_row, self.total = limit, 0, 0
        self._flag, self._pending = DeviceFlag(), None

    def watch(self, grad_norm, step: int, meaning: str = SKIPPED, then=None) -> torch.Tensor:
        """Queue step `step`'s verdict; `then(nonfinite: bool)` runs when it is settled. Settles the
        previous step first (waiting for that step's work only)."""
        self.settle()
        found_inf = (~torch.isfinite(torch.as_tensor(grad_norm, dtype=torch.float32))).float()
        self._flag.put(found_inf.reshape(1))
        self._pending = (step, meaning, then)
        return found_inf

    def settle(self):
        """Decide the pending verdict, if any (a host sync on it)."""
        if self._pending is None:
            return
        (bad,), (step, meaning, then) = self._flag.take(), self._pending
        self._pending = None
        self._count(bool(bad), step, meaning)
        if then is not None:
            then(bool(bad))

    def _count(self, bad: bool, step: int, meaning: str):
        if not bad or meaning == SCALER:
            self.in_a_row = 0 if not bad else self.in_a_row
            return
        if meaning == APPLIED:
            raise FloatingPointError(
                f"step {step}: non-finite gradient norm; DeepSpeed cannot skip an update outside fp16's "
                "loss scaler. The last checkpoint is intact: lower --learning_rate or --grad_clip and resume"
            )
        self.in_a_row, self.total = self.in_a_row + 1, self.total + 1
        if self.in_a_row >= self.limit:
            raise FloatingPointError(
                f"{self.in_a_row} optimizer steps in a row had non-finite gradients (the last at step {step}); "
                "stopping. The last checkpoint is intact: lower --learning_rate or --grad_clip and resume from it"
            )
