"""Guards around the optimizer step: stopping cleanly on a signal, and non-finite gradients."""

import signal

import torch

from llama_train.dist import all_reduce_mean


class Stopper:
    """Ends a run early but cleanly: on SIGTERM/SIGINT (preemption, Ctrl-C) or after
    `--stop_after_steps`, the current step finishes, a checkpoint is saved and the run exits 0.
    A second signal exits at once (the default handler is restored after the first)."""

    def __init__(self, stop_after_steps: int, rank: int):
        self.stop_after, self.rank, self.signalled = stop_after_steps, rank, False
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
        """Collective: every rank stops after the same step if any rank was signalled."""
        (any_signal,) = all_reduce_mean([float(self.signalled)], device)
        return any_signal > 0 or step == self.stop_after


class NonFiniteGuard:
    """Counts optimizer steps whose global gradient norm was inf/NaN (skipped by the caller) and
    stops the run after `limit` in a row: the last checkpoint stays the last good state."""

    def __init__(self, limit: int):
        self.limit, self.in_a_row, self.total = limit, 0, 0

    def check(self, grad_norm: torch.Tensor, step: int) -> bool:
        """True if this step's update must be skipped (the norm is the same on every rank)."""
        if torch.isfinite(grad_norm):
            self.in_a_row = 0
            return False
        self.in_a_row, self.total = self.in_a_row + 1, self.total + 1
        if self.in_a_row >= self.limit:
            raise FloatingPointError(
                f"{self.in_a_row} optimizer steps in a row had non-finite gradients (the last at step {step}); "
                "stopping. The last checkpoint is intact: lower --learning_rate or --grad_clip and resume from it"
            )
        return True
