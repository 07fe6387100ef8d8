"""What a link does without the model: the gloo all-reduce's throughput on the wire and a small
collective's latency, between the hosts of a simulation. make bench-cluster runs it once per host count
on unshaped links (the planner's bandwidth for "unshaped": there the hosts' shared cores and TCP stack are
the link), launched as a trainer is:

    scripts/multinode_sim.sh torchrun -m llama_train.bench.linkprobe OUT.json
"""

import json
import statistics
import sys
import time

import torch
import torch.distributed as dist

from llama_train.plan.comm import wire_factor

BIG = 4 * 2**20  # elements of the timed all-reduce: 16 MiB of fp32, a DDP bucket's order
REPEATS = 5


def timed(fn, repeats: int) -> float:
    """The median seconds of `fn` over `repeats` calls, every rank starting together."""
    times = []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main(out: str):
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    big, small = torch.ones(BIG), torch.ones(1)
    timed(lambda: dist.all_reduce(big), 1)  # connections up, buffers allocated
    seconds = timed(lambda: dist.all_reduce(big), REPEATS)
    latency = timed(lambda: dist.all_reduce(small), 4 * REPEATS)
    sent = 4 * BIG * wire_factor("gloo", "all_reduce", world)
    if dist.get_rank() == 0:
        result = {"world_size": world, "wire_bytes_s": sent / seconds, "latency_s": latency}
        with open(out, "w") as f:
            json.dump(result, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
