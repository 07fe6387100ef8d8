"""Guards around the optimizer step: stopping cleanly on a signal, and non-finite gradients.

Neither reads a device value in the step that produced it: each step's verdict (signal seen by any
rank, non-finite gradient norm) is copied to the host behind an event and read one step later,
when the device is busy with the next step's work already queued. So the CPU keeps running ahead
of the GPU, and the decisions stay the same on every rank.
"""

import signal

import torch
import torch.distributed as dist

from llama_train.dist import is_dist


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


class Stopper:
    """Ends a run early but cleanly: on SIGTERM/SIGINT (preemption, Ctrl-C) or after
    `--stop_after_steps`, the current step finishes, a checkpoint is saved and the run exits 0.
    A second signal exits at once (the default handler is restored after the first)."""

    def __init__(self, stop_after_steps: int, rank: int):
        self.stop_after, self.rank, self.signalled = stop_after_steps, rank, False
        self._any = DeviceFlag()
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._handle)

    def _handle(self, signum, _frame):
        self.signalled = True
        signal.signal(signum, signal.SIG_DFL)
        name = signal.Signals(signum).name
        print(
            f"[rank {self.rank}] {name}: finishing this step and saving a checkpoint "
            "(send it again to exit now)",
            flush=True,
        )

    def should_stop(self, step: int, device) -> bool:
        """Collective, once per step: every rank stops after the same step. The ranks' signal flags
        are max-reduced after each step and read after the next, so a signal stops the run one
        step after the step it arrived in, without a host sync."""
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
