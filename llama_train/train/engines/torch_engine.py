"""The DDP trainer's engine, in the role DeepSpeed's engine plays in train_deepspeed.py: DDPEngine over a
DistributedDataParallel model, and FSDPEngine for `--fsdp` (FSDP2: llama_train/distributed/fsdp.py), the
same loop over a sharded model. train_ddp.py wraps the model itself and hands it here; each class
implements the Engine protocol (engines/engine.py), its own files, its own load and the neutral form's."""

import contextlib
import functools
import math

import torch
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel as DDP

from llama_train.checkpoint import portable
from llama_train.checkpoint.formats import Reader, neutral_loss_scale
from llama_train.checkpoint.resuming import load_ddp_objects
from llama_train.checkpoint.store import ddp_files
from llama_train.checkpoint.weights import check_shapes
from llama_train.distributed import fsdp
from llama_train.distributed.dist import DTYPE_OF
from llama_train.distributed.strategies import FSDP2, Strategy, run_strategy
from llama_train.errors import NonFiniteError
from llama_train.optim.spec import ADAMW_STATE
from llama_train.plan.comm import CommCounter, count_ddp
from llama_train.train.guards import SCALER, SKIPPED, NonFiniteGuard, SpikeGuard

# DeepSpeed's min_loss_scale (its default, and ds_configs/*.json's): an fp16 overflow there stops the run
MIN_LOSS_SCALE = 1.0


def engine_for(strategy: Strategy) -> type["DDPEngine"]:
    """The engine class of a DDP-trainer strategy: FSDPEngine for FSDP2's, else DDPEngine."""
    return FSDPEngine if strategy.engine is FSDP2 else DDPEngine


class DDPEngine:
    """The (DDP-wrapped) model, its optimizer, LR schedule, fp16 GradScaler, autocast and clipping norm.
    Calling it runs the model under autocast, so evaluation is the same code for both trainers."""

    def __init__(
        self,
        model,
        optimizer,
        lr_scheduler,
        device: torch.device,
        dtype: str,
        grad_clip: float,
        spike: SpikeGuard | None = None,
        strategy: Strategy | None = None,
    ):
        self.model, self.optimizer, self.lr_scheduler = model, optimizer, lr_scheduler
        self.grad_clip, self.strategy = grad_clip, strategy or run_strategy(None)
        self.module = model.module if isinstance(model, DDP) else model  # the Transformer itself
        self.scaler = torch.amp.GradScaler(device.type, enabled=dtype == "float16")
        self.autocast = torch.autocast(device.type, dtype=DTYPE_OF[dtype], enabled=dtype != "float32")
        self.skipped_steps = (
            0  # updates left out: non-finite gradient norm (fp16: GradScaler's inf steps), spikes
        )
        self.spike = spike or SpikeGuard(
            0, 0, 2
        )  # --skip_loss_zscore / --skip_grad_zscore (off: never skips)
        self._loss = None  # fp16: the sum of this step's micro-batch losses (NonFiniteGuard.watch)

    # --- training ---

    def no_sync_unless(self, last: bool):
        """All-reduce gradients only on a step's last micro-batch; earlier ones accumulate locally."""
        return contextlib.nullcontext() if last or not isinstance(self.model, DDP) else self.model.no_sync()

    def backward(self, loss: torch.Tensor):
        self.scaler.scale(loss).backward()  # fp16: scaled so small gradients survive
        if self.scaler.is_enabled():  # the step's loss: non-finite, it is not the scaler's to skip
            self._loss = loss.detach() if self._loss is None else self._loss + loss.detach()

    def step(self, guard: NonFiniteGuard, step: int) -> tuple[torch.Tensor, float]:
        """Clip the unscaled gradient and step the optimizer and the LR schedule. A non-finite gradient
        norm (the same on every rank: it is of all-reduced gradients) skips the update on the device, via
        fused AdamW's `found_inf` as GradScaler does, and the schedule holds, as in DeepSpeed. The host
        learns it one step later (guards.NonFiniteGuard), before the next update reads its LR, so no
        step waits for the device. Returns (grad norm tensor, the LR of this update)."""
        guard.settle()  # the previous step's verdict: its LR schedule step, or a skip
        lr = self.lr_scheduler.get_last_lr()[0]
        self.scaler.unscale_(self.optimizer)  # clip the true gradient, not the fp16-scaled one
        grad_norm = self.clip_grad_norm()
        spiked = self.spike.should_skip(grad_norm)  # reads the norm on the host, only when the guard is on
        meaning = SCALER if self.scaler.is_enabled() else SKIPPED
        settled = functools.partial(self._settled, spiked=spiked, step=step)
        found_inf = guard.watch(grad_norm, step, meaning, then=settled, loss=self._loss)
        self._loss = None
        if spiked:  # skipped on the device as a non-finite step is; counted as a spike, not towards the limit
            found_inf = torch.ones_like(found_inf)
        self.optimizer.grad_scale, self.optimizer.found_inf = None, found_inf  # fused AdamW reads these
        self.optimizer.step()
        del self.optimizer.grad_scale, self.optimizer.found_inf
        self.scaler.update()  # fp16: lower the scale after an inf step (the scaler's own check)
        self.optimizer.zero_grad(set_to_none=True)
        return grad_norm, lr

    def clip_grad_norm(self) -> torch.Tensor:
        """Clip to --grad_clip (0: only measure); the norm of the whole gradient, before clipping."""
        return torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.grad_clip or math.inf)

    def _settled(self, nonfinite: bool, spiked: bool = False, step: int = 0) -> bool:
        """The step's verdict, settled (NonFiniteGuard.settle): count a left-out update or step the LR
        schedule. Returns whether the update was left out."""
        if nonfinite or spiked:
            self.skipped_steps += 1
        else:
            self.lr_scheduler.step()
        if nonfinite and self.scaler.is_enabled() and self.scaler.get_scale() < MIN_LOSS_SCALE:
            raise NonFiniteError(
                f"step {step}: fp16 gradients overflowed at the minimum loss scale {MIN_LOSS_SCALE:g}; "
                "stopping, as DeepSpeed's fp16 does at its min_loss_scale. The last checkpoint is intact: "
                "lower --learning_rate or --grad_clip (or train in bfloat16) and resume from it"
            )
        return nonfinite or spiked

    def __call__(self, **batch):
        with self.autocast:
            return self.model(**batch)

    def eval_loss(self, batch: dict) -> torch.Tensor:
        return self(**batch)[1]

    def train(self):
        self.model.train()

    def eval(self):
        self.model.eval()

    # --- its checkpoints: model/optimizer/scheduler/scaler.pt, written by rank 0 ---

    def objects(self) -> dict:
        """What a checkpoint holds, by file name (store.ddp_files)."""
        return {
            "model": self.module.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.lr_scheduler.state_dict(),
            "scaler": self.scaler.state_dict(),
        }

    def load_objects(self, objects: dict):
        self.module.load_state_dict(objects["model"])
        self.optimizer.load_state_dict(objects["optimizer"])
        self.lr_scheduler.load_state_dict(objects["scheduler"])
        self.scaler.load_state_dict(objects["scaler"])

    def files(self, rank: int):
        return ddp_files(self.objects(), rank)  # FSDP2: gathered by every rank, written by rank 0

    def load(self, path: str):
        self.load_objects(load_ddp_objects(path))

    # --- the neutral form ---

    def load_neutral(self, reader: Reader, step: int):
        """Weights, optimizer state and step count, LR schedule and fp16 loss scale of `reader`. Collective."""
        check_shapes(reader.shapes(), self.param_shapes(), what=f"checkpoint ({reader.kind})")
        self._load_tensors(reader)
        portable.restore_schedule(self.lr_scheduler, reader.lr_scheduler)
        self._restore_loss_scale(reader.loss_scale)

    def _load_tensors(self, reader: Reader):
        """Every rank holds the full tensors: the weights and the optimizer's state, copied in."""
        portable.into_torch(self.optimizer, [(n, p, p) for n, p in self.module.named_parameters()], reader)

    def loss_scale(self) -> dict | None:
        return neutral_loss_scale(self.scaler.state_dict()) if self.scaler.is_enabled() else None

    def _restore_loss_scale(self, saved: dict | None):
        """A checkpoint's fp16 loss scale (neutral form, either trainer's) into GradScaler: the scale and
        the good steps since the last overflow (when the scale grows next)."""
        if saved is None or not self.scaler.is_enabled():
            return
        state = self.scaler.state_dict()
        state.update(scale=saved["scale"], _growth_tracker=saved["good_steps"] % state["growth_interval"])
        self.scaler.load_state_dict(state)

    def optimizer_groups(self) -> list[list[str]]:
        return portable.group_names({id(p): n for n, p in self.module.named_parameters()}, self.optimizer)

    def gathered_state(self) -> dict:
        """{name: {"fp32", "exp_avg", "exp_avg_sq"}}, fp32 copies on the CPU. Collective (FSDP2)."""
        out = {}
        for name, p in self.module.named_parameters():
            tensors = portable.torch_state(p, self.optimizer)
            out[name] = portable.cpu_copies({k: self._full(v) for k, v in tensors.items()})
        return out

    def _full(self, t: torch.Tensor | None) -> torch.Tensor | None:
        return t

    def full_state_dict(self, rank: int) -> dict | None:
        """The full fp32 weights (autocast keeps them so) on rank 0, on the CPU: every rank holds them."""
        if rank == 0:
            return {k: v.detach().float().cpu() for k, v in self.module.state_dict().items()}
        return None

    # --- what the services read ---

    def param_shapes(self) -> dict[str, torch.Size]:
        return {n: p.shape for n, p in self.module.named_parameters()}

    def held_tensors(self) -> list[torch.Tensor]:
        return list(self.module.parameters())

    def gradient_group(self):
        return None  # DDP's: the default group

    def count_comm(self, counter: CommCounter):
        if isinstance(self.model, DDP):  # a plain `python train_ddp.py` trains the bare model
            count_ddp(self.model, counter)


class FSDPEngine(DDPEngine):
    """DDPEngine's step over a fully_shard-ed model (fsdp.wrap_fsdp). The mixed-precision policy
    casts the parameters, so there is no autocast; checkpoints hold gathered full state in DDP's
    format (fsdp.full_model_state / full_optimizer_state), so either trainer loads them natively."""

    def __init__(self, model, optimizer, lr_scheduler, device, dtype, grad_clip, spike=None, strategy=None):
        strategy = strategy or run_strategy(None, fsdp=True)
        super().__init__(model, optimizer, lr_scheduler, device, dtype, grad_clip, spike, strategy)
        self.autocast = contextlib.nullcontext()

    @contextlib.contextmanager
    def no_sync_unless(self, last: bool):
        """DDP's no_sync: earlier micro-batches keep their (unsharded) gradients and add to them; the
        last one's backward reduce-scatters the sum, so accumulation computes what DDP computes."""
        self.model.set_requires_gradient_sync(last)
        yield

    def clip_grad_norm(self) -> torch.Tensor:
        return super().clip_grad_norm().full_tensor()  # a replicated DTensor: every rank has the norm

    def objects(self) -> dict:
        """Collective: the DDP trainer's objects, gathered on rank 0 (elsewhere: empty model/optimizer)."""
        return {
            "model": fsdp.full_model_state(self.model),
            "optimizer": fsdp.full_optimizer_state(self.model, self.optimizer),
            "scheduler": self.lr_scheduler.state_dict(),
            "scaler": self.scaler.state_dict(),
        }

    def load_objects(self, objects: dict):
        """Collective: a DDP or FSDP2 checkpoint's objects (full tensors) into the shards."""
        groups = self.optimizer_groups()
        fsdp.load_full_state(self.model, self.optimizer, objects["model"], objects["optimizer"], groups)
        self.lr_scheduler.load_state_dict(objects["scheduler"])
        self.scaler.load_state_dict(objects["scaler"])

    def _load_tensors(self, reader: Reader):
        """Collective: full tensors in, sharded by torch's full-state setters."""
        groups = self.optimizer_groups()
        tensors = {name: reader.tensors(name) for g in groups for name in g}
        weights = {name: t["fp32"] for name, t in tensors.items()}
        state = None
        if reader.step is not None:
            step = torch.tensor(float(reader.step))
            names = [n for g in groups for n in g]
            moments = [{k: portable.or_zeros(tensors[n], k) for k in ADAMW_STATE.keys} for n in names]
            state = {
                "state": {i: {"step": step.clone(), **m} for i, m in enumerate(moments)},
                "param_groups": self.optimizer.state_dict()["param_groups"],
            }
        fsdp.load_full_state(self.model, self.optimizer, weights, state, groups)

    def _full(self, t: torch.Tensor | None) -> torch.Tensor | None:
        return t.full_tensor() if isinstance(t, DTensor) else t  # gathers this parameter's shards

    def full_state_dict(self, rank: int) -> dict | None:
        """Collective: the gathered fp32 weights on rank 0."""
        state = fsdp.full_model_state(self.model)
        return {k: v.float() for k, v in state.items()} if rank == 0 else None

    def count_comm(self, counter: CommCounter):
        fsdp.count_fsdp(self.model, counter)
