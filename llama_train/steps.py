"""Which sequences each optimizer step sees: the step plan and the data order.

Steps count from 1, as torchtitan's do: step s is the s-th optimizer update, and a run that
finished s steps continues at step s + 1. The data of a step is a pure function of its number,
which is what makes resume exact.
"""

from dataclasses import dataclass

from torch.utils.data import DataLoader
from transformers import default_data_collator

MEMORY_STEP = 2  # model state is measured in step 2: optimizer state exists, grads not yet freed


@dataclass
class StepPlan:
    """How optimizer steps map onto epochs. Leftover micro-batches at an epoch's end are dropped
    so every optimizer step sees exactly `accumulation` micro-batches."""

    batches_per_epoch: int  # micro-batches per rank per epoch
    accumulation: int
    total_steps: int

    @property
    def steps_per_epoch(self) -> int:
        return self.batches_per_epoch // self.accumulation

    @classmethod
    def make(cls, batches_per_epoch: int, accumulation: int, epochs: int, max_steps: int) -> "StepPlan":
        per_epoch = batches_per_epoch // accumulation
        if per_epoch == 0:
            raise ValueError(
                f"the train split gives {batches_per_epoch} micro-batches per rank, fewer than "
                f"--accumulation_steps={accumulation}: use more data, a smaller --batch_size or fewer ranks"
            )
        total = per_epoch * epochs if max_steps < 0 else max_steps
        return cls(batches_per_epoch, accumulation, total)


def train_steps(data, batch_size: int, done: int = 0):
    """Yield (step, [micro-batches]) for steps done + 1 .. plan.total_steps of `data` (a
    build.Data), continuing into further epochs with a new `set_epoch` shuffle each."""
    dataset, sampler, plan = data.train_dataset, data.train_sampler, data.plan
    step = done
    while step < plan.total_steps:
        epoch, offset = divmod(step, plan.steps_per_epoch)
        if hasattr(sampler, "set_epoch"):
            sampler.set_epoch(epoch)
        indices = list(sampler)[: plan.steps_per_epoch * plan.accumulation * batch_size]
        loader = DataLoader(
            dataset,
            batch_size=batch_size,
            sampler=indices[offset * plan.accumulation * batch_size :],
            collate_fn=default_data_collator,
            drop_last=True,
            pin_memory=data.pin_memory,
        )
        micro = []
        for batch in loader:
            micro.append(batch)
            if len(micro) == plan.accumulation:
                step += 1
                yield step, micro
                micro = []
                if step >= plan.total_steps or step % plan.steps_per_epoch == 0:
                    break


def due(step: int, interval: int, total: int) -> bool:
    """True every `interval` steps (0: never) and at the last step."""
    return step == total or (interval > 0 and step % interval == 0)
