"""How often a run saves: `--save_interval N` (every N optimizer steps; 0: only at the end) or `auto`,
the default, which bounds the work a crash, an OOM, a lost node or `kill -9` can take with it.

`auto` decides in optimizer steps, agreed by all ranks (the max over ranks of what each measured, one
all-reduce per decision), at steps that do not depend on timing, so every rank saves after the same
steps:
- two steps after the process's first, from the step time measured over those steps: the first save
  comes after `--save_max_minutes` of training (nothing is known yet of what a save costs);
- the step after each save, from that save's measured stall C (seconds training stood still) and the
  step time: the interval is Young/Daly's optimum for a failure every MTBF_H hours, sqrt(2 C MTBF),
  at most --save_max_minutes, and at least 1/SHARE saves' worth (C / 2%), so saving takes at most 2%
  of the run; where a save is too slow for both, the 2% bound wins and the start-up line says so.
Each decision is printed (rank 0) with its reason and written to metrics.jsonl as a `save_plan` record
(`interval`, `save_s`, `step_s`, `reason`); summarize_run shows the last one."""

import math
import time

import torch
import torch.distributed as dist

from llama_train.distributed.dist import is_dist
from llama_train.steps import due

SHARE = 0.02  # saving takes at most this share of the run
MTBF_H = 24.0  # the failure rate Young/Daly's interval is chosen for: one failure a day
FIRST_PLAN_AFTER = 2  # steps after the process's first one whose time the first plan measures


def auto_interval(save_s: float, step_s: float, max_s: float) -> tuple[int, str]:
    """(optimizer steps between saves, why) from a save's stall and the step time."""
    young_daly = math.sqrt(2 * save_s * MTBF_H * 3600)
    seconds, why = (
        min(young_daly, max_s),
        "Young/Daly for a failure a day" if young_daly < max_s else "the bound",
    )
    if save_s / seconds > SHARE:
        seconds, why = save_s / SHARE, f"saving kept to {SHARE:.0%}, past the --save_max_minutes bound"
    steps = max(1, round(seconds / step_s))
    share = save_s / (steps * step_s + save_s)
    return (
        steps,
        f"{why}: a save stalls {save_s:.2f} s, a step takes {step_s:.3f} s, saving {share:.2%} of the run",
    )


class SaveCadence:
    """Whether a step is followed by a periodic save (`due`), and, with `auto`, the plan's updates
    (`saved` after each save). Collective under `auto`: every rank calls `due` after every step."""

    def __init__(self, interval: int | str, max_minutes: float, device, writer=None, rank: int = 0):
        self.fixed = None if interval == "auto" else int(interval)
        self.max_s, self.device, self.writer, self.rank = max_minutes * 60, device, writer, rank
        self.first = self.t_first = self.next = None
        self.saved_s = 0.0  # stalls since t_first: left out of the step time
        self.replan_at, self.last_save_s = None, None

    def due(self, step: int, last: int) -> bool:
        if self.fixed is not None:
            return due(step, self.fixed, last)
        now = time.perf_counter()
        if self.first is None:
            self.first, self.t_first = step, now
        elif step == self.first + FIRST_PLAN_AFTER and self.next is None:
            step_s, _ = self._agree((now - self.t_first - self.saved_s) / FIRST_PLAN_AFTER, 0.0)
            interval = max(1, math.floor(self.max_s / step_s))
            self._plan(
                step,
                interval,
                0.0,
                step_s,
                f"first save after {self.max_s / 60:g} min of {step_s:.3f} s steps; then from its cost",
            )
        elif step == self.replan_at:
            step_s, save_s = self._agree(
                (now - self.t_first - self.saved_s) / (step - self.first), self.last_save_s
            )
            interval, why = auto_interval(save_s, step_s, self.max_s)
            self._plan(step - 1, interval, save_s, step_s, why)
        return step == last or (self.next is not None and step >= self.next)

    def saved(self, step: int, seconds: float):
        """A save after `step` stalled training `seconds`: the next step re-plans from it."""
        self.saved_s += seconds
        if self.fixed is None and self.first is not None:
            self.replan_at, self.last_save_s = step + 1, seconds

    def _agree(self, step_s: float, save_s: float) -> tuple[float, float]:
        """The max over ranks of each rank's step time and save stall."""
        if not is_dist():
            return step_s, save_s
        t = torch.tensor([step_s, save_s], dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t[0]), float(t[1])

    def _plan(self, step: int, interval: int, save_s: float, step_s: float, why: str):
        self.next = step + interval
        if self.writer is not None:
            self.writer.write(
                "save_plan", step=step, interval=interval, save_s=save_s, step_s=step_s, reason=why
            )
        if self.rank == 0:
            print(
                f"--save_interval auto: a checkpoint every {interval} steps, next after step {self.next} ({why})",
                flush=True,
            )
