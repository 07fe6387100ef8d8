"""What the links of a simulation do without the model, run once per host count by make bench-cluster on
unshaped links, launched as a trainer is:

    scripts/multinode_sim.sh torchrun -m llama_train.bench.linkprobe OUT.json

- the gloo all-reduce's throughput on the wire and a one-element all-reduce's latency: the planner's
  unshaped link (there the hosts' shared cores and TCP stack are the link);
- for each collective the trainers' engines run, the bytes of its tensor it gets through a second (gloo's
  reduce-scatter, an all-reduce with copies around it, is slower than its bytes say: the planner's
  per-collective rates), and the bytes each rank's interface sent per byte of the tensor, as the kernel
  counts them (/sys/class/net/IF/statistics/tx_bytes), beside comm.wire_factor's.

With `--gather`, on links as they are (shaped or not: `multinode_sim.sh shape RATE` first), only the
seconds of each call of two ways to gather a tensor's parts: a ring all-gather, and one broadcast from
each rank in turn as ds_cpu gathers ZeRO-1/2's parameters (steptime.Link.broadcasts models the second).
"""

import argparse
import json
import statistics
import time

import torch
import torch.distributed as dist

from llama_train.plan.comm import wire_factor
from llama_train.telemetry.timing import link_interface, link_tx_bytes

BIG = 4 * 2**20  # elements of the timed tensors: 16 MiB of fp32, a DDP bucket's order
REPEATS = 12


def call_seconds(fn, repeats: int) -> list[float]:
    """Seconds of each of `repeats` calls of `fn`, every rank starting together (rank 0's figure is the
    slowest rank's: a collective ends together)."""
    times = []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


def timed(fn, repeats: int) -> float:
    """The fastest of `repeats` calls of `fn` (call_seconds), in seconds: the links' own rate (a call
    that another process on the shared cores slowed down is not)."""
    return min(call_seconds(fn, repeats))


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


def gather_result(world: int) -> dict:
    """Seconds of each of REPEATS calls of a ring all-gather and of ds_cpu's broadcasts, each gathering
    BIG elements of fp32 from `world` parts, and their medians."""
    out, part = torch.empty(BIG), torch.ones(BIG // world)
    ops = {
        "all_gather": lambda: dist.all_gather_into_tensor(out, part),
        "broadcasts": lambda: broadcasts(list(out.chunk(world))),
    }
    seconds = {}
    for op, fn in ops.items():
        fn()  # its buffers allocated
        seconds[op] = call_seconds(fn, REPEATS)
    medians = {op: statistics.median(s) for op, s in seconds.items()}
    return {"world_size": world, "bytes": 4 * BIG, "seconds": seconds, "median_s": medians}


def link_result(world: int) -> dict:
    """The unshaped links' all-reduce rate on the wire, a message's latency, each collective's counts."""
    big, small = torch.ones(BIG), torch.ones(1)
    timed(lambda: dist.all_reduce(big), 1)  # connections up, buffers allocated
    seconds = timed(lambda: dist.all_reduce(big), REPEATS)
    latency = timed(lambda: dist.all_reduce(small), 4 * REPEATS)
    counts = kernel_counts(world, link_interface("gloo"))
    sent = 4 * BIG * wire_factor("gloo", "all_reduce", world)
    return {"world_size": world, "wire_bytes_s": sent / seconds, "latency_s": latency, "sent": counts}


def main(out: str, gather: bool = False):
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    result = gather_result(world) if gather else link_result(world)
    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump(result, f, indent=2)
    dist.destroy_process_group()


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", help="the JSON file rank 0 writes")
    p.add_argument("--gather", action="store_true", help="time the two gathers only, on the links as shaped")
    cli = p.parse_args()
    main(cli.out, cli.gather)
