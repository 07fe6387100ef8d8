"""Which sequences each optimizer step sees: the step plan and the data order.

Steps count from 1, as torchtitan's do: step s is the s-th optimizer update, and a run that
finished s steps continues at step s + 1.

The data position is a count of consumed samples (sequences), as Megatron's `consumed_samples`,
never a per-rank offset. Epoch e's order is one permutation of the train blocks drawn from
(seed, e) alone, whatever the world size (utils.data.data_utils.EpochSampler). An optimizer step
takes the next G = batch_size x accumulation x world sequences of it; rank r trains on every
world-th of those (the slice's elements r::world, which is what torch's DistributedSampler gives
a rank), batch_size at a time as micro-batches. The loss and gradient of a step are means over
all G sequences, so 1 process and N ranks with the same G train on the same numbers, and a run
resumed on another world size continues exactly where the straight run would be. A resume with
another G continues at the same sample count; the LR schedule stays in optimizer steps. The tail
of an epoch that is shorter than one global batch is not trained on.
"""

import os
import time
from dataclasses import asdict, dataclass, field

import numpy as np
from torch.utils.data import DataLoader, Sampler
from transformers import default_data_collator

MEMORY_STEP = 2  # model state is measured in step 2: optimizer state exists, grads not yet freed


@dataclass(frozen=True)
class DataPosition:
    """Where the next optimizer step reads: epoch and sequences of its order already consumed."""

    epoch: int = 0
    consumed: int = 0  # sequences of this epoch's permutation trained on, all ranks together

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class StepPlan:
    """How optimizer steps map onto epochs, counted in samples: `done` steps were taken before
    this process started, and step `done` + 1 reads at `start`."""

    num_samples: int  # train sequences per epoch
    batch_size: int  # micro batch per rank
    accumulation: int  # micro-batches per rank per optimizer step
    world: int
    total_steps: int  # the run's last optimizer step (the LR schedule spans it)
    done: int = 0
    start: DataPosition = field(default_factory=DataPosition)

    @property
    def global_batch(self) -> int:
        return self.batch_size * self.accumulation * self.world

    @property
    def steps_per_epoch(self) -> int:
        return self.num_samples // self.global_batch

    @classmethod
    def make(
        cls,
        num_samples: int,
        batch_size: int,
        accumulation: int,
        world: int,
        epochs: int,
        max_steps: int,
        done: int = 0,
        start: DataPosition | None = None,
    ) -> "StepPlan":
        """`max_steps` -1: as many steps as `epochs` passes give from `start` on."""
        plan = cls(num_samples, batch_size, accumulation, world, 0, done, start or DataPosition())
        if plan.steps_per_epoch == 0:
            raise ValueError(
                f"the train split has {num_samples} sequences, fewer than one global batch of "
                f"{plan.global_batch} (--batch_size {batch_size} x --accumulation_steps {accumulation} x "
                f"{world} ranks): use more data, a smaller --batch_size, fewer accumulation steps or fewer ranks"
            )
        if max_steps > 0:
            plan.total_steps = max_steps
        else:
            first = plan.start.epoch
            left = plan.steps_left_in(first) if first < epochs else 0
            plan.total_steps = done + left + max(0, epochs - first - 1) * plan.steps_per_epoch
        return plan

    def steps_left_in(self, epoch: int) -> int:
        """Optimizer steps that epoch `epoch` still holds when this run reaches it."""
        first = self.start.consumed if epoch == self.start.epoch else 0
        return max(0, self.num_samples - first) // self.global_batch

    def epochs(self):
        """(epoch, first sample, steps) for the epochs this run reads, from `start`, up to total_steps
        (past the last of --epochs when --max_steps asks for more, each a new shuffle)."""
        step, epoch = self.done, self.start.epoch
        while step < self.total_steps:
            steps = min(self.steps_left_in(epoch), self.total_steps - step)
            first = self.start.consumed if epoch == self.start.epoch else 0
            if steps:
                yield epoch, first, steps
            step, epoch = step + steps, epoch + 1

    def position_after(self, step: int) -> DataPosition:
        """The data position once optimizer step `step` (done < step <= total) has trained."""
        if step == self.done:
            return self.start
        taken = self.done
        for epoch, first, steps in self.epochs():
            if step <= taken + steps:
                return DataPosition(epoch, first + (step - taken) * self.global_batch)
            taken += steps
        raise ValueError(f"step {step} is outside this run's steps {self.done + 1}..{self.total_steps}")

    def state_at(self, step: int) -> dict:
        """What a checkpoint after `step` records of the data, so any world size and global batch
        can continue from it."""
        return {
            "position": self.position_after(step).to_dict(),
            "num_samples": self.num_samples,
            "global_batch": self.global_batch,
        }


class RankOrder(Sampler):
    """This rank's sequences for `steps` optimizer steps from sample `first` of `order` (the epoch's
    permutation, an array): per step the global batch's elements rank::world, in micro-batch order.
    Sliced from `order` one step at a time, as Python ints: nothing per sequence is held beyond one
    step (a list of the rank's epoch share costs ~36 bytes a sequence)."""

    def __init__(self, order, first: int, steps: int, global_batch: int, rank: int, world: int):
        self.order, self.first, self.steps = order, first, steps
        self.global_batch, self.rank, self.world = global_batch, rank, world

    def __len__(self) -> int:
        return self.steps * (self.global_batch // self.world)

    def __iter__(self):
        for k in range(self.steps):
            start = self.first + k * self.global_batch
            yield from self.order[start : start + self.global_batch][self.rank :: self.world].tolist()


def rank_indices(order, first: int, steps: int, global_batch: int, rank: int, world: int) -> list[int]:
    """RankOrder as a list: this rank's sequences of `steps` optimizer steps (tests and tools)."""
    return list(RankOrder(np.asarray(order), first, steps, global_batch, rank, world))


def train_steps(data, batch_size: int):
    """Yield (step, [micro-batches]) for steps plan.done + 1 .. plan.total_steps of `data` (a
    build.Data), continuing into further epochs with a new shuffle each. The data's sample ledger (when
    it has one) learns each step's samples as it is handed out."""
    plan, sampler, step = data.plan, data.train_sampler, data.plan.done
    ledger = getattr(data, "ledger", None)
    for epoch, first, steps in plan.epochs():
        sampler.set_epoch(epoch)
        order = sampler.permutation()
        if ledger is not None:
            ledger.epoch(epoch, order)
        mine = RankOrder(order, first, steps, plan.global_batch, sampler.rank, plan.world)
        loader = DataLoader(
            data.train_dataset,
            batch_size=batch_size,
            sampler=mine,
            collate_fn=default_data_collator,
            drop_last=True,
            pin_memory=data.pin_memory,
        )
        micro, read = [], first  # positions of the epoch's order handed out so far
        for batch in loader:
            micro.append(batch)
            if len(micro) == plan.accumulation:
                step, read = step + 1, read + plan.global_batch
                if ledger is not None:  # written once the step has trained (Ledger.trained)
                    ledger.handed(step, epoch, read - plan.global_batch, read)
                injected_slowness(sampler.rank)  # tests only: LLAMA_TRAIN_TEST_SLOW
                yield step, micro
                micro = []


def injected_slowness(rank: int):
    """Tests only: LLAMA_TRAIN_TEST_SLOW=RANK:SECONDS makes RANK wait that long for each step's data,
    a straggler (a slow disk, a throttled GPU)."""
    spec = os.environ.get("LLAMA_TRAIN_TEST_SLOW")
    if spec and int(spec.split(":")[0]) == rank:
        time.sleep(float(spec.split(":")[1]))


def due(step: int, interval: int, total: int) -> bool:
    """True every `interval` steps (0: never) and at the last step."""
    return step == total or (interval > 0 and step % interval == 0)
