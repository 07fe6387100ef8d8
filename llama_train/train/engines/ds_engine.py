"""The DeepSpeed trainer's engine: DeepSpeedEngine wraps the object train_deepspeed.py got from
deepspeed.initialize (`ds`, any ZeRO stage, a PipelineEngine too) and implements the Engine protocol
(engines/engine.py) over DeepSpeed's public API: its own save_checkpoint / load_checkpoint, the neutral
form through safe_get/safe_set_full_*, the guard's verdict from `skipped_steps`. What DeepSpeed 0.19
lacks is patched in distributed/ds_compat.py, applied here once."""

import os

import torch

from llama_train.checkpoint import portable
from llama_train.checkpoint.formats import Reader, neutral_loss_scale
from llama_train.checkpoint.weights import check_shapes
from llama_train.distributed import ds_compat, parallel
from llama_train.distributed.pipeline import eval_loss
from llama_train.distributed.strategies import Strategy
from llama_train.optim.spec import ADAMW_STATE
from llama_train.plan.comm import CommCounter, count_deepspeed
from llama_train.train.guards import SCALER, SKIPPED, NonFiniteGuard, SpikeGuard, deepspeed_verdict


class DeepSpeedEngine:
    """The engine deepspeed.initialize returned (`ds`), patched (ds_compat.patch_engine), its groups
    checked against the layout, the spike guard's skip installed inside its step."""

    def __init__(self, ds, strategy: Strategy, layout, config: dict, spike: SpikeGuard | None = None):
        self.ds, self.strategy, self.layout = ds, strategy, layout
        self.pipelined = layout.pp > 1  # PipelineEngine: train_batch / eval_batch run the stages
        ds_compat.patch_engine(ds, torch.distributed.get_world_size(), config)  # what 0.19 lacks
        parallel.check_groups(ds, layout, torch.distributed.get_rank())
        if spike is not None and spike.enabled:  # decided inside ds.step(), before the update
            ds_compat.skip_updates_when(ds, spike.should_skip)

    @property
    def module(self):
        return self.ds.module

    @property
    def optimizer(self):
        return self.ds.optimizer

    @property
    def lr_scheduler(self):
        return self.ds.lr_scheduler

    @property
    def skipped_steps(self) -> int:
        return self.ds.skipped_steps

    @skipped_steps.setter
    def skipped_steps(self, value: int):
        self.ds.skipped_steps = value

    # --- training: DeepSpeed's own calls ---

    def __call__(self, **batch):
        return self.ds(**batch)

    def backward(self, loss: torch.Tensor):
        self.ds.backward(loss)  # scaled by 1/accumulation; gradients reduced at the boundary

    def step(self):
        self.ds.step()  # after every micro-batch: the update (clip, AdamW, LR) at the accumulation boundary

    def verdict(self, guard: NonFiniteGuard, step: int, skipped_before: int, loss: torch.Tensor):
        """The step's grad norm, watched: fp16's loss scaler skips overflows itself (SCALER), but a
        non-finite loss counts towards --max_nonfinite_steps; a non-finite fp32/bf16 step counts as
        DeepSpeed's `skipped_steps` around its step say (guards.deepspeed_verdict); bf16 ZeRO-1/2 skip a
        non-finite step on the device (ds_compat.skip_nonfinite_on_device), settled a step later.
        Whether engine.step() left the update out (a non-finite step, an fp16 overflow, a spike) goes
        to the guard's `left_out`, settled with the step."""
        grad_norm = self.ds.get_global_grad_norm()
        left_out = self.ds.skipped_steps > skipped_before
        then = lambda _nonfinite: left_out  # noqa: E731
        if self.ds.fp16_enabled():
            guard.watch(0.0 if grad_norm is None else grad_norm, step, SCALER, then, loss=loss)
        elif ds_compat.skips_on_device(self.ds):  # counted when settled, before the next update
            guard.watch(
                grad_norm,
                step,
                SKIPPED,
                lambda nonfinite: ds_compat.settle_skip(self.ds, nonfinite) or left_out,
            )
        elif grad_norm is not None:
            guard.watch(grad_norm, step, deepspeed_verdict(skipped_before, self.ds.skipped_steps), then)
        elif left_out:
            guard.left_out.append(step)
        return grad_norm

    def eval_loss(self, batch: dict) -> torch.Tensor:
        if self.pipelined:  # the loss comes out of the last stage
            return eval_loss(self.ds, batch)
        return self.ds(**batch)[1]

    def train(self):
        self.ds.train()

    def eval(self):
        self.ds.eval()

    # --- its checkpoints: every rank's ZeRO shards, DeepSpeed's own files ---

    def files(self, rank: int):
        """Every rank's ZeRO shards as DeepSpeed's save_checkpoint makes them, kept by path instead of
        written (ds_compat.captured_saves), for async_save.Saver.save."""
        from deepspeed.checkpoint.constants import UNIVERSAL_CHECKPOINT_INFO

        def files(tmp: str) -> dict:
            info = {UNIVERSAL_CHECKPOINT_INFO: {}}  # lets DeepSpeed's ds_to_universal convert it
            with ds_compat.captured_saves(self.ds) as captured:
                self.ds.save_checkpoint(
                    os.path.dirname(tmp), tag=os.path.basename(tmp), save_latest=False, client_state=info
                )
            return captured

        return files

    def load(self, path: str):
        root, tag = os.path.split(path)
        self.ds.load_checkpoint(root, tag=tag, load_optimizer_states=True, load_lr_scheduler_states=True)

    # --- the neutral form ---

    def load_neutral(self, reader: Reader, step: int):
        """Weights, optimizer state and step count, LR schedule and fp16 loss scale of `reader`, in any
        stage: ZeRO-1/2/3 (with or without CPU offload) through DeepSpeed's public setters, ZeRO-0 into
        its torch optimizer (or its fp32 masters). Collective."""
        check_shapes(reader.shapes(), self.param_shapes(), what=f"checkpoint ({reader.kind})")
        if self._partitioned():
            self._into_partitioned(reader)
        else:
            masters = ds_compat.zero0_fp32_master(self.ds)
            optimizer = self.optimizer.optimizer if masters else self.optimizer
            named = [(n, p, masters.get(id(p), p)) for n, p in self.module.named_parameters()]
            portable.into_torch(optimizer, named, reader)
        portable.restore_schedule(self.lr_scheduler, reader.lr_scheduler)
        self._restore_loss_scale(reader.loss_scale)
        self.ds.global_steps, self.ds.global_samples = step, step * self.ds.train_batch_size()

    def _partitioned(self) -> bool:
        """ZeRO-1/2 and DeepSpeed's bf16 optimizer map each parameter to fp32 fragments (`_hp_mapping`),
        ZeRO-3 partitions it (`ds_id`); ZeRO-0 steps whole tensors."""
        return any(hasattr(p, "ds_id") or hasattr(p, "_hp_mapping") for p in self.module.parameters())

    @torch.no_grad()
    def _into_partitioned(self, reader: Reader):
        """ZeRO-1/2/3: the optimizer's state is created in its own format (zeros; ZeRO-1/2's state kept
        whole_under_zero as read), then every parameter's fp32 master and partitioned state (ZeRO-3: all
        of it) are set through DeepSpeed's public setters, each rank keeping its partition; the module's
        weights follow."""
        from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state

        names = {id(p): n for n, p in self.module.named_parameters()}

        def whole(params, key: str) -> torch.Tensor:  # ZeRO-1/2: whole matrices, one after another
            return torch.cat([portable.or_zeros(reader.tensors(names[id(p)]), key).flatten() for p in params])

        ds_compat.create_optimizer_state(self.ds, reader.step or 0, reader.optimizer.group_state, whole)
        for name, param in self.module.named_parameters():
            tensors = reader.tensors(name)
            if self.strategy.stage == 3:
                ds_compat.zero3_set_full(self.optimizer, param, tensors)
                _set_zero3_module_param(param, tensors["fp32"])
                continue
            safe_set_full_fp32_param(param, tensors["fp32"])
            # whole state came with the state; a checkpoint whose every fp16 step overflowed has none: zeros
            for key in sorted(set(tensors) - {"fp32", *reader.optimizer.whole_keys}):
                safe_set_full_optimizer_state(param, tensors[key], key)
            param.data.copy_(tensors["fp32"])
        portable.set_group_step(self.optimizer, reader.step or 0)

    def _loss_scaler(self):
        """The dynamic fp16 loss scaler: ZeRO-1/2/3's DynamicLossScaler or ZeRO-0's LossScaleConfig;
        None for fp32/bf16 or a static scale."""
        opt = self.optimizer
        scaler = getattr(opt, "loss_scaler", None) or getattr(opt, "loss_scale_config", None)
        return scaler if neutral_loss_scale(scaler) else None

    def loss_scale(self) -> dict | None:
        scaler = self._loss_scaler()
        return neutral_loss_scale(scaler) if scaler is not None else None

    def _restore_loss_scale(self, saved: dict | None):
        """A checkpoint's fp16 loss scale (neutral form, either trainer's): the scale, the good steps since
        the last overflow (when the scale grows next) and DeepSpeed's hysteresis."""
        scaler = self._loss_scaler()
        if saved is None or scaler is None:
            return
        scaler.cur_scale = saved["scale"]
        scaler.last_overflow_iter = scaler.cur_iter - 1 - saved["good_steps"]
        if hasattr(scaler, "cur_hysteresis"):
            scaler.cur_hysteresis = saved.get("hysteresis", scaler.delayed_shift)

    def optimizer_groups(self) -> list[list[str]] | None:
        """ZeRO-0's groups (of its fp32 masters under bf16/fp16); ZeRO-1/2/3 hold flat partitions: None."""
        if self.strategy.stage != 0:
            return None
        masters = ds_compat.zero0_fp32_master(self.ds)
        optimizer = self.optimizer.optimizer if masters else self.optimizer
        named = self.module.named_parameters()
        return portable.group_names({id(masters.get(id(p), p)): n for n, p in named}, optimizer)

    def gathered_state(self) -> dict:
        """Collective: read through DeepSpeed's own accessors (safe_get_full_*) under ZeRO-1/2/3."""
        from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

        ds_compat.relink_hp_optimizer_state(self.ds)
        masters = ds_compat.zero0_fp32_master(self.ds)
        optimizer = self.optimizer.optimizer if masters else self.optimizer
        out = {}
        for name, p in self.module.named_parameters():
            if self.strategy.stage > 0:
                t = {"fp32": safe_get_full_fp32_param(p)}
                t.update({k: safe_get_full_optimizer_state(p, k) for k in ADAMW_STATE.keys})
            else:
                t = portable.torch_state(masters.get(id(p), p), optimizer)
            out[name] = portable.cpu_copies(t)
        return out

    def full_state_dict(self, rank: int) -> dict | None:
        """Collective: the full fp32 master weights on rank 0 (bf16/fp16: the optimizer's, not the module's)."""
        from deepspeed.utils import safe_get_full_fp32_param

        state, zero0_master = {}, ds_compat.zero0_fp32_master(self.ds)  # ZeRO-0 bf16/fp16
        split = self.layout.tp * self.layout.pp > 1
        for name, p in self.module.named_parameters():
            master = safe_get_full_fp32_param(p)  # ZeRO-1/2/3: None for fp32 runs
            if master is None:
                master = zero0_master.get(id(p), p.detach().float())  # an fp32 run: the module's own
            if rank == 0 or split:  # shards and stages gathered below
                state[name] = master.cpu().clone()
        return parallel.gather_full_state(state, self.layout, rank)

    # --- what the services read ---

    def param_shapes(self) -> dict[str, torch.Size]:
        return {n: getattr(p, "ds_shape", p.shape) for n, p in self.module.named_parameters()}  # ZeRO-3: full

    def held_tensors(self) -> list[torch.Tensor]:
        """The module's parameters and, under ZeRO-3, the partitions that hold their storage."""
        params = list(self.module.parameters())
        return params + [p.ds_tensor for p in params if getattr(p, "ds_tensor", None) is not None]

    def gradient_group(self):
        return getattr(self.ds, "seq_data_parallel_group", None)  # ZeRO's data-parallel group

    def count_comm(self, counter: CommCounter):
        count_deepspeed(counter)


def _set_zero3_module_param(param, value: torch.Tensor):
    """The module's own (partitioned) copy of a ZeRO-3 parameter, through DeepSpeed's public gather:
    every rank holds the full value, rank 0's is re-partitioned on exit."""
    import deepspeed

    with deepspeed.zero.GatheredParameters([param], modifier_rank=0):
        param.data.copy_(value)
