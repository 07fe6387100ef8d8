"""Three cluster shapes the README answers "which strategy" for, as `scripts/plan_memory.py` flags, and the
planner's ranking on each as one line of text (the README's table is these lines; tests/test_explain.py
holds it to the planner)."""

from llama_train.distributed.strategies import DEFAULT_STRATEGIES, STRATEGIES
from llama_train.model import preset
from llama_train.plan.planner import Workload, plan

# name -> (world size, ranks per host, Gbit/s between hosts a host: 0 = one host)
SHAPES = {
    "one node, 8 H100 on NVLink": (8, 8, 0.0),
    "4 nodes x 8 H100, 400 Gbit/s InfiniBand a node": (32, 8, 400.0),
    "4 nodes x 8 H100, 25 Gbit/s Ethernet a node": (32, 8, 25.0),
}
MODELS = {"1b": (4, 2048), "7b": (1, 4096)}  # preset -> (micro batch, sequence)
# the default set without offload (which the planner ranks last whatever its time)
ON_DEVICE = [name for name in DEFAULT_STRATEGIES if not STRATEGIES[name].offload]


def flags(shape: str, model: str) -> str:
    """The plan_memory.py flags of one cell."""
    world, per_host, gbit = SHAPES[shape]
    batch, seq = MODELS[model]
    link = f" --ranks_per_host {per_host} --link_gbit {gbit:g}" if gbit else ""
    return f"--preset {model} --world_size {world} --batch_size {batch} --max_seq_len {seq}{link}"


def ranking(shape: str, model: str) -> str:
    """'fsdp2 138 ms, ddp 146, ...': what fits in 80 GiB, fastest expected step first."""
    from dataclasses import replace

    from llama_train.plan.steptime import H100

    world, per_host, gbit = SHAPES[shape]
    batch, seq = MODELS[model]
    machine = replace(H100, ranks_per_host=per_host, inter_bytes_s=gbit * 1e9 / 8)
    work = Workload(preset(model, max_seq_len=seq), world, batch, seq)
    rows = sorted((r for r in plan(work, 80 * 2**30, ON_DEVICE, 2**30, machine) if r["fits"]),
                  key=lambda r: r["step_s"])  # fmt: skip
    unit, scale = ("s", 1) if rows[0]["step_s"] >= 2 else ("ms", 1000)
    times = [f"{r['step_s'] * scale:,.1f}" if unit == "s" else f"{r['step_s'] * scale:,.0f}" for r in rows]
    cells = [f"{r['strategy']} {t}" for r, t in zip(rows, times)]
    cells[0] += f" {unit}"
    return ", ".join(cells)
