"""The DDP trainer's one handle, in the role DeepSpeed's engine plays in train_deepspeed.py: DDPEngine,
and FSDPEngine for `--fsdp` (FSDP2: llama_train/distributed/fsdp.py), the same loop over a sharded model."""

import contextlib
import functools
import math

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from llama_train.checkpoint import portable
from llama_train.distributed import fsdp, strategies
from llama_train.distributed.dist import DTYPE_OF
from llama_train.errors import NonFiniteError
from llama_train.optim.spec import ADAMW_STATE
from llama_train.train.guards import SCALER, SKIPPED, NonFiniteGuard, SpikeGuard

# DeepSpeed's min_loss_scale (its default, and ds_configs/*.json's): an fp16 overflow there stops the run
MIN_LOSS_SCALE = 1.0


def wrap_ddp(model: torch.nn.Module, device: torch.device, find_unused_parameters: bool) -> torch.nn.Module:
    """The model on `device`, in DistributedDataParallel when a process group is up (a plain
    `python train_ddp.py` trains the bare model)."""
    model = model.to(device)
    if not torch.distributed.is_initialized():
        return model
    # complex64 rotary table: NCCL cannot broadcast complex tensors and it is not trained anyway
    model._ddp_params_and_buffers_to_ignore = {"pos_cis"}
    # gradient_as_bucket_view: the gradients live in DDP's buckets, not beside them (one copy of the
    # gradients less, and no copy into the buckets and back each step). Buckets stay DDP's 25 MB,
    # reduced in C++ as backward produces them; static_graph stays off: with find_unused_parameters off
    # and non-reentrant checkpointing it has nothing to save and forbids a graph that changes.
    return DDP(
        model,
        device_ids=[device.index] if device.type == "cuda" else None,
        find_unused_parameters=find_unused_parameters,
        gradient_as_bucket_view=True,
    )


def wrap_model(model: torch.nn.Module, device: torch.device, dtype: str, args) -> torch.nn.Module:
    """FSDP2 with --fsdp (fsdp.wrap_fsdp), else DDP (wrap_ddp)."""
    if args.fsdp:
        return fsdp.wrap_fsdp(model, device, dtype, args.fsdp_offload)
    return wrap_ddp(model, device, args.find_unused_parameters)


def engine_for(args):
    """The handle for the run: FSDPEngine with --fsdp (offloaded with --fsdp_offload), else DDPEngine."""
    return functools.partial(FSDPEngine, offload=args.fsdp_offload) if args.fsdp else DDPEngine


def strategy(args) -> str:
    """The run's `strategy` in metrics.jsonl and its checkpoints (its engine's run name)."""
    return (strategies.FSDP2 if args.fsdp else strategies.DDP).run_name()


class DDPEngine:
    """The (DDP-wrapped) model, AdamW, LR schedule, fp16 GradScaler, autocast and clipping norm.
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
    ):
        self.model, self.optimizer, self.lr_scheduler, self.grad_clip = (
            model,
            optimizer,
            lr_scheduler,
            grad_clip,
        )
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

    def no_sync_unless(self, last: bool):
        """All-reduce gradients only on a step's last micro-batch; earlier ones accumulate locally."""
        return contextlib.nullcontext() if last or not isinstance(self.model, DDP) else self.model.no_sync()

    def backward(self, loss: torch.Tensor):
        self.scaler.scale(loss).backward()  # fp16: scaled so small gradients survive
        if self.scaler.is_enabled():  # the step's loss: non-finite, it is not the scaler's to skip
            self._loss = loss.detach() if self._loss is None else self._loss + loss.detach()

    def step(self, guard: NonFiniteGuard, step: int) -> tuple[torch.Tensor, float]:
        """Clip the unscaled gradient and step AdamW and the LR schedule. A non-finite gradient norm
        (the same on every rank: it is of all-reduced gradients) skips the update on the device, via
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

    def state_dict(self) -> dict:
        """What a checkpoint holds, by file name (checkpoint.ddp_files)."""
        return {
            "model": self.module.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.lr_scheduler.state_dict(),
            "scaler": self.scaler.state_dict(),
        }

    def load_state_dict(self, objects: dict):
        self.module.load_state_dict(objects["model"])
        self.optimizer.load_state_dict(objects["optimizer"])
        self.lr_scheduler.load_state_dict(objects["scheduler"])
        self.scaler.load_state_dict(objects["scaler"])

    def full_state_dict(self, rank: int) -> dict | None:
        """The full fp32 weights (autocast keeps them so) on rank 0, on the CPU: every rank holds them."""
        if rank == 0:
            return {k: v.detach().float().cpu() for k, v in self.module.state_dict().items()}
        return None

    def zero_optimization_stage(self) -> int:
        return 0  # every rank holds everything, as under ZeRO-0

    def __call__(self, **batch):
        with self.autocast:
            return self.model(**batch)

    def train(self):
        self.model.train()

    def eval(self):
        self.model.eval()


class FSDPEngine(DDPEngine):
    """DDPEngine's step over a fully_shard-ed model (fsdp.wrap_fsdp). The mixed-precision policy
    casts the parameters, so there is no autocast; checkpoints hold gathered full state in DDP's
    format (fsdp.full_model_state / full_optimizer_state), so either trainer loads them natively."""

    def __init__(self, model, optimizer, lr_scheduler, device, dtype, grad_clip, spike=None, offload=False):
        super().__init__(model, optimizer, lr_scheduler, device, dtype, grad_clip, spike)
        self.autocast, self.offloaded = contextlib.nullcontext(), offload

    @contextlib.contextmanager
    def no_sync_unless(self, last: bool):
        """DDP's no_sync: earlier micro-batches keep their (unsharded) gradients and add to them; the
        last one's backward reduce-scatters the sum, so accumulation computes what DDP computes."""
        self.model.set_requires_gradient_sync(last)
        yield

    def clip_grad_norm(self) -> torch.Tensor:
        return super().clip_grad_norm().full_tensor()  # a replicated DTensor: every rank has the norm

    def state_dict(self) -> dict:
        """Collective: the DDP trainer's objects, gathered on rank 0 (elsewhere: empty model/optimizer)."""
        return {
            "model": fsdp.full_model_state(self.model),
            "optimizer": fsdp.full_optimizer_state(self.model, self.optimizer),
            "scheduler": self.lr_scheduler.state_dict(),
            "scaler": self.scaler.state_dict(),
        }

    def load_state_dict(self, objects: dict):
        """Collective: a DDP or FSDP2 checkpoint's objects (full tensors) into the shards."""
        groups = portable.optimizer_groups(self)
        fsdp.load_full_state(self.model, self.optimizer, objects["model"], objects["optimizer"], groups)
        self.lr_scheduler.load_state_dict(objects["scheduler"])
        self.scaler.load_state_dict(objects["scaler"])

    def load_source(self, source):
        """Collective: a portable.Source (the neutral form of any checkpoint) into the shards; the
        LR schedule is portable.load_into's."""
        groups = portable.optimizer_groups(self)
        tensors = {name: source.tensors(name) for g in groups for name in g}
        weights = {name: t["fp32"] for name, t in tensors.items()}
        state = None
        if source.step is not None:
            step = torch.tensor(float(source.step))
            names = [n for g in groups for n in g]
            moments = [
                {k: tensors[n].get(k, torch.zeros_like(weights[n])) for k in ADAMW_STATE.keys} for n in names
            ]
            state = {
                "state": {i: {"step": step.clone(), **m} for i, m in enumerate(moments)},
                "param_groups": self.optimizer.state_dict()["param_groups"],
            }
        fsdp.load_full_state(self.model, self.optimizer, weights, state, groups)

    def full_state_dict(self, rank: int) -> dict | None:
        """Collective: the gathered fp32 weights on rank 0."""
        state = fsdp.full_model_state(self.model)
        return {k: v.float() for k, v in state.items()} if rank == 0 else None

    def zero_optimization_stage(self) -> int:
        return 3  # parameters, gradients and optimizer state sharded, as under ZeRO-3
