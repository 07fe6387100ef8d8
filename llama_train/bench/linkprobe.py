"""What the links of a simulation do without the model, run once per host count by make bench-cluster on
unshaped links, launched as a trainer is:

    scripts/multinode_sim.sh torchrun -m llama_train.bench.linkprobe OUT.json

- the gloo all-reduce's throughput on the wire and a one-element all-reduce's latency: the planner's
  unshaped link (there the hosts' shared cores and TCP stack are the link);
- for each collective the trainers' engines run, the bytes of its tensor it gets through a second (gloo's
  reduce-scatter, an all-reduce with copies around it, is slower than its bytes say: the planner's
  per-collective rates), and the bytes each rank's interface sent per byte of the tensor, as the kernel
  counts them (/sys/class/net/IF/statistics/tx_bytes), beside comm.wire_factor's.
"""

import json
import sys
import time

import torch
import torch.distributed as dist

from llama_train.plan.comm import wire_factor
from llama_train.telemetry.timing import link_interface, link_tx_bytes

BIG = 4 * 2**20  # elements of the timed tensors: 16 MiB of fp32, a DDP bucket's order
REPEATS = 12


def timed(fn, repeats: int) -> float:
    """The fastest of `repeats` calls of `fn`, every rank starting together, in seconds: the links' own
    rate (a call that another process on the shared cores slowed down is not); rank 0's figure is the
    slowest rank's (a collective ends together)."""
    times = []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def broadcasts(parts: list[torch.Tensor]):
    """One broadcast from each rank in turn, of its part (as ds_cpu gathers ZeRO-1/2's parameters)."""
    for work in [dist.broadcast(p, src, async_op=True) for src, p in enumerate(parts)]:
        work.wait()


def sent_per_byte(fn, size: int, interface: str) -> tuple[float | None, float]:
    """(bytes this rank's interface sent for `fn` per byte of its tensor, bytes of the tensor a second),
    over REPEATS calls, each timed from a barrier."""
    fn()  # its buffers allocated
    dist.barrier()
    time.sleep(0.2)  # the barrier's own bytes on the wire before the count starts
    before = link_tx_bytes(interface)
    seconds = timed(fn, REPEATS)
    time.sleep(0.2)
    after = link_tx_bytes(interface)
    sent = None if before is None or after is None else (after - before) / REPEATS / size
    return sent, size / seconds


def kernel_counts(world: int, interface: str) -> dict[str, dict]:
    """Each collective's bytes sent per rank per byte of its tensor (the kernel's count on every rank,
    the comm record's), and the bytes of its tensor it gets through a second on rank 0."""
    x, out, part = torch.ones(BIG), torch.empty(BIG), torch.ones(BIG // world)
    ops = {
        "all_reduce": lambda: dist.all_reduce(x),
        "all_gather": lambda: dist.all_gather_into_tensor(out, part),
        "reduce_scatter": lambda: dist.reduce_scatter_tensor(part, x),
        "broadcast": lambda: broadcasts(list(out.chunk(world))),
    }
    counted = {op: sent_per_byte(fn, 4 * BIG, interface) for op, fn in ops.items()}
    every = [None] * world
    dist.all_gather_object(every, {op: sent for op, (sent, _) in counted.items()})
    return {
        op: {"kernel": [c[op] for c in every], "model": wire_factor("gloo", op, world), "bytes_s": rate}
        for op, (_, rate) in counted.items()
    }


def main(out: str):
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    big, small = torch.ones(BIG), torch.ones(1)
    timed(lambda: dist.all_reduce(big), 1)  # connections up, buffers allocated
    seconds = timed(lambda: dist.all_reduce(big), REPEATS)
    latency = timed(lambda: dist.all_reduce(small), 4 * REPEATS)
    counts = kernel_counts(world, link_interface("gloo"))
    if dist.get_rank() == 0:
        sent = 4 * BIG * wire_factor("gloo", "all_reduce", world)
        result = {"world_size": world, "wire_bytes_s": sent / seconds, "latency_s": latency, "sent": counts}
        with open(out, "w") as f:
            json.dump(result, f, indent=2)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
