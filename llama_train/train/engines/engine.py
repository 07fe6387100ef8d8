"""The Engine protocol: everything the shared code (services, evaluation, the probe, the memory record,
saving and resuming) asks of a trainer's engine. Each trainer builds its engine itself, visibly
(train_deepspeed.py: deepspeed.initialize; train_ddp.py: DistributedDataParallel or fully_shard), and
hands it to the library as an Engine: ds_engine.DeepSpeedEngine wraps what deepspeed.initialize
returns, torch_engine.DDPEngine / FSDPEngine hold the torch pieces. Nothing outside those files asks
which kind it holds (tests/test_layout.py: no engine-kind probe in shared code)."""

from collections.abc import Callable
from typing import Any, Protocol

import torch

from llama_train.checkpoint.formats import Reader
from llama_train.distributed.strategies import Strategy
from llama_train.plan.comm import CommCounter


class Engine(Protocol):
    """One training run's model, optimizer, LR schedule and precision, as the shared code sees them."""

    strategy: Strategy  # the run's strategy, resolved once at start-up (strategies.run_strategy)
    module: torch.nn.Module  # the Transformer (DeepSpeed's: its module, partitioned under ZeRO-3)
    optimizer: Any  # what the memory record walks for held state (a torch or ZeRO optimizer)
    lr_scheduler: torch.optim.lr_scheduler.LRScheduler
    skipped_steps: int  # updates left out (non-finite, spikes); goes on after a resume

    # --- training: forward and backward over the micro-batches, the optimizer's step ---

    def __call__(self, **batch) -> tuple[torch.Tensor | None, torch.Tensor]:
        """(logits, loss) of a micro-batch, under the engine's precision."""

    def backward(self, loss: torch.Tensor) -> None:
        """Backward of one micro-batch's loss (the probe times it as `backward`)."""

    step: Callable[
        ..., Any
    ]  # the optimizer's part (the probe times it as `optimizer`; its arguments are the trainer's)

    def eval_loss(self, batch: dict) -> torch.Tensor:
        """The mean loss of one held-out batch (a pipeline's from its last stage)."""

    def train(self) -> None: ...

    def eval(self) -> None: ...

    # --- saving and loading: its own files, and the neutral form ---

    def files(self, rank: int) -> Callable[[str], dict]:
        """Collective: what this rank saves, for async_save.Saver.save (temp dir -> {path: object})."""

    def load(self, path: str) -> None:
        """Collective: a checkpoint in this engine's own format (resuming.Resume.native)."""

    def load_neutral(self, reader: Reader, step: int) -> None:
        """Collective: weights, optimizer state and step, LR schedule and fp16 loss scale from any
        checkpoint in the neutral form (checkpoint/portable.py); `step`: the trainer step reached."""

    def optimizer_groups(self) -> list[list[str]] | None:
        """Parameter names per optimizer group where the optimizer holds whole parameters, else None."""

    def full_state_dict(self, rank: int) -> dict | None:
        """Collective: the full fp32 weights on rank 0 (None elsewhere), for the export."""

    def gathered_state(self) -> dict:
        """Collective: {name: {"fp32", "exp_avg", "exp_avg_sq"}}, full tensors on the CPU."""

    def loss_scale(self) -> dict | None:
        """fp16's dynamic loss scaler in the neutral form (formats.neutral_loss_scale), or None."""

    # --- what the services read ---

    def param_shapes(self) -> dict[str, torch.Size]:
        """Full shape of every parameter this rank's module holds, by name (ZeRO-3's unpartitioned)."""

    def held_tensors(self) -> list[torch.Tensor]:
        """The parameter tensors this rank holds storage for, for the memory record (ZeRO-3: partitions)."""

    def gradient_group(self) -> Any:
        """The process group its gradient collectives run on (None: the default group)."""

    def count_comm(self, counter: CommCounter) -> None:
        """Make `counter` see this engine's collectives (plan/comm.py), while `counter.active`."""
