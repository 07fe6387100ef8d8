"""ZeRO-1/2 gradient reductions that run beside backward on a CPU, as DDP's do.

DeepSpeed 0.19.8 fills a reduce bucket from its gradient hooks and, when the bucket is full, all-reduces
it and copies this rank's share into the gradient partition (`reduce_ipg_grads` -> `average_tensor`).
On a GPU `overlap_comm` runs that on a side stream while backward goes on, into the second of two
bucket buffers. DeepSpeed's CPU accelerator has no streams: every bucket's all-reduce blocks the hook
(on 2 CPU ranks at 25m ZeRO-1/2 waited 310 ms a step where DDP, whose all-reduces run in gloo's
threads, waited 60: docs/performance.md).

`overlap_reductions` keeps DeepSpeed's double buffer and order and only moves the waits: a full bucket
is divided by the data-parallel size and all-reduced in place with `async_op=True`; DeepSpeed's
bookkeeping for it (this rank's gradients copied into its partition, the others' dropped, bucket after
bucket) runs once that all-reduce is done, which is waited for when the hooks need its buffer again
(at the next full bucket) or at the end of backward (in DeepSpeed's epilogue, before it reads the
partition). The arithmetic is DeepSpeed's, element for element: the same division before an all-reduce
of the same values. tests/test_ds_compat.py checks that the weights after accumulated steps equal
DeepSpeed's blocking path's bit for bit, for ZeRO-1 and ZeRO-2.

What it does not cover goes to DeepSpeed's own path, unchanged: a gradient larger than the bucket,
MoE, offload, a communication dtype other than the gradients' (bf16 with fp32 communication), fp32
accumulation of bf16 gradients (compact partition buffers), sequence parallelism, reduce-to-owner
(`use_multi_rank_bucket_allreduce: false`), and every device with streams."""

import collections


def applies(opt) -> bool:
    """Whether `opt` (a DeepSpeedZeroOptimizer) reduces in its gradient hooks through contiguous double
    buffers by all-reducing whole buckets, on a device without streams."""
    from deepspeed.accelerator import get_accelerator

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
            import deepspeed.comm as dist

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
    """Install the patch on `engine`'s ZeRO-1/2 optimizer where it applies (see the module's
    docstring); None where DeepSpeed's own path stays."""
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    opt = engine.optimizer
    if not isinstance(opt, DeepSpeedZeroOptimizer) or not applies(opt):
        return None
    if getattr(opt, "_llama_train_overlap", None) is None:
        opt._llama_train_overlap = OverlappedReductions(opt)
    return opt._llama_train_overlap
