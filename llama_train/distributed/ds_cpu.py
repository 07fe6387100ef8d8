"""What DeepSpeed's ZeRO-1/2 do on a CPU (gloo), made faster without changing a bit of what they compute.

**Reductions beside backward** (`overlap_reductions`). DeepSpeed 0.19.8 fills a reduce bucket from its
gradient hooks and, when the bucket is full, all-reduces it and copies this rank's share into the
gradient partition (`reduce_ipg_grads` -> `average_tensor`). On a GPU `overlap_comm` runs that on a side
stream while backward goes on, into the second of two bucket buffers. DeepSpeed's CPU accelerator has no
streams: every bucket's all-reduce blocks the hook. The patch keeps DeepSpeed's double buffer and order
and only moves the waits: a full bucket is divided by the data-parallel size and all-reduced in place
with `async_op=True`; DeepSpeed's bookkeeping for it (this rank's gradients copied into its partition,
the others' dropped, bucket after bucket) runs once that all-reduce is done, which is waited for when the
hooks need its buffer again (at the next full bucket) or at the end of backward (in DeepSpeed's
epilogue, before it reads the partition). The arithmetic is DeepSpeed's, element for element: the same
division before an all-reduce of the same values. What it does not cover goes to DeepSpeed's own path,
unchanged: a gradient larger than the bucket, MoE, offload, a communication dtype other than the
gradients' (bf16 with fp32 communication), fp32 accumulation of bf16 gradients (compact partition
buffers), sequence parallelism, reduce-to-owner (`use_multi_rank_bucket_allreduce: false`), and every
device with streams.

**The updated parameters gathered by broadcasts** (`gather_by_broadcasts`). After the optimizer step
each rank holds its updated partition, a view into the flat parameter buffer, and DeepSpeed all-gathers
the partitions (`all_gather_dp_groups` -> `all_gather_into_tensor`). Gloo's all-gather into a tensor
goes through a temporary of the whole output and a copy back; one broadcast from each partition's owner
straight into its view moves the same bytes (each rank sends its partition and receives the others')
with neither. The comm record counts them as broadcasts.

Both apply together, where the first does (`overlap_reductions`); a config with `"overlap_comm": false`
keeps DeepSpeed's own collectives.

docs/performance.md gives the measurements; tests/test_ds_compat.py checks that the weights after
accumulated steps equal DeepSpeed's own path's bit for bit, for ZeRO-1 and ZeRO-2."""

import collections
import weakref

import deepspeed.comm as dist
import torch
from deepspeed.accelerator import get_accelerator
from deepspeed.runtime.zero import stage_1_and_2


def applies(opt) -> bool:
    """Whether `opt` (a DeepSpeedZeroOptimizer) reduces in its gradient hooks through contiguous double
    buffers by all-reducing whole buckets, on a device without streams."""
    return (
        get_accelerator().is_synchronized_device()
        and opt.overlap_comm
        and opt.contiguous_gradients
        and opt.reduce_scatter
        and opt.use_multi_rank_bucket_allreduce
        and not opt.cpu_offload
        and not getattr(opt, "zenflow", False)
        and opt.sequence_parallel_size == 1
        and not any(opt._use_compact_grad_partition_buffer(g) for g in range(len(opt.bit16_groups)))
    )


class OverlappedReductions:
    """The patch on one optimizer: `pending` holds the launched buckets, oldest first."""

    def __init__(self, opt):
        self.opt, self.pending = opt, collections.deque()
        self.deepspeed_reduce = opt.reduce_ipg_grads
        self.launched = self.handed_back = 0  # buckets reduced here, and by DeepSpeed's own path
        opt.reduce_ipg_grads = self.reduce_ipg_grads

    def deferrable(self, dtype) -> bool:
        bucket = self.opt.ipg_buckets[dtype]
        return (
            dtype not in self.opt.extra_large_param_to_reduce
            and not bucket.has_moe_params
            and self.opt._gradient_reduction_buffer_dtype() == dtype
        )

    def reduce_ipg_grads(self, comm_dtype=None):
        """A hook's call (one dtype's full bucket) returns with that bucket's all-reduce under way
        and the one before it done: the hooks fill that one's buffer next. The call for every dtype
        (comm_dtype None) is the end of backward (DeepSpeed's epilogue), which reads the partition
        right after it: it returns with every bucket done."""
        dtypes = list(self.opt.ipg_buckets) if comm_dtype is None else [comm_dtype]
        if not all(self.deferrable(d) for d in dtypes):
            self.drain()
            self.handed_back += 1
            return self.deepspeed_reduce(comm_dtype)
        for dtype in dtypes:
            self.launch(self.opt.ipg_buckets[dtype])
        while len(self.pending) > (0 if comm_dtype is None else 1):
            self.finish(*self.pending.popleft())

    def launch(self, bucket):
        opt = self.opt
        if bucket.elements:
            for _, _, param_id in bucket.params:
                assert not opt.params_already_reduced[param_id], "a gradient reduced twice in one backward"
                opt.params_already_reduced[param_id] = True
            tensor = bucket.buffer[bucket.index].narrow(0, 0, bucket.elements)
            if opt.gradient_average:  # average_tensor's division, before the all-reduce
                tensor.div_(dist.get_world_size(group=opt.dp_process_group))  # sp is 1 (applies)
            work = dist.all_reduce(tensor, group=opt.dp_process_group, async_op=True)
            self.pending.append((work, list(bucket.params)))
            self.launched += 1
        bucket.clear()

    def finish(self, work, params):
        """reduce_ipg_grads' bookkeeping once the bucket's all-reduce is done."""
        opt = self.opt
        work.wait()
        for group_idx, param_idx, param_id in params:
            param = opt.bit16_groups[group_idx][param_idx]
            if opt.is_param_in_current_partition[param_id]:
                opt.copy_grads_in_partition(param, group_idx)
            elif opt.partition_gradients:  # ZeRO-2 drops the others' gradients; ZeRO-1 keeps them
                opt.clear_grad_attribute(param)

    def drain(self):
        while self.pending:
            self.finish(*self.pending.popleft())


def overlap_reductions(engine) -> OverlappedReductions | None:
    """Install both patches on `engine`'s ZeRO-1/2 optimizer where the first applies (see the module's
    docstring: overlap_comm on, a device without streams, ...); None where DeepSpeed's own path stays,
    so a config with `"overlap_comm": false` runs DeepSpeed's own collectives."""
    opt = engine.optimizer
    if not isinstance(opt, stage_1_and_2.DeepSpeedZeroOptimizer) or not applies(opt):
        return None
    if getattr(opt, "_llama_train_overlap", None) is None:
        opt._llama_train_overlap = OverlappedReductions(opt)
        gather_by_broadcasts(opt)
    return opt._llama_train_overlap


_GATHER_BY_BROADCASTS = weakref.WeakSet()  # the optimizers whose parameters are gathered by broadcasts


def gather_by_broadcasts(opt):
    """Gather `opt`'s (a DeepSpeedZeroOptimizer's) updated parameters by one asynchronous broadcast per
    partition where its group runs on gloo and the partitions are the flat buffer's consecutive views, as
    DeepSpeed 0.19.8 builds them. DeepSpeed's `all_gather_dp_groups` (as stage_1_and_2 imported it) is
    replaced once for the process and keeps DeepSpeed's gather for every other optimizer."""
    _GATHER_BY_BROADCASTS.add(opt)
    original = stage_1_and_2.all_gather_dp_groups
    if getattr(original, "by_broadcasts", False):
        return

    def all_gather_dp_groups(groups_flat, partitioned_param_groups, dp_process_group, *args, **kwargs):
        groups = list(zip(groups_flat, partitioned_param_groups, dp_process_group))
        ours = any(o.bit16_groups_flat is groups_flat for o in _GATHER_BY_BROADCASTS)
        if not ours or not all(_broadcastable(*group) for group in groups):
            return original(groups_flat, partitioned_param_groups, dp_process_group, *args, **kwargs)
        works = [
            dist.broadcast(part, dist.get_global_rank(pg, src), group=pg, async_op=True)
            for _, parts, pg in groups
            if dist.get_world_size(group=pg) > 1
            for src, part in enumerate(parts)
        ]
        for work in works:
            work.wait()

    all_gather_dp_groups.by_broadcasts, all_gather_dp_groups.original = True, original
    stage_1_and_2.all_gather_dp_groups = all_gather_dp_groups


def _broadcastable(flat, parts, group) -> bool:
    """Gloo, and `parts` tile `flat` in rank order (each a view at the previous one's end)."""
    if torch.distributed.get_backend(group) != "gloo" or len(parts) != dist.get_world_size(group=group):
        return False
    offset = flat.storage_offset()
    for part in parts:
        same_storage = part.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()
        if not same_storage or part.storage_offset() != offset or not part.is_contiguous():
            return False
        offset += part.numel()
    return offset <= flat.storage_offset() + flat.numel()
