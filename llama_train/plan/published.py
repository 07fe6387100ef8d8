"""The planner held to published GPU training throughput: rows from torchtitan, llm-foundry and a Hugging
Face blog post, each with its source, its setting (model, GPU, count, interconnect, sequence, batch,
strategy) and its tokens/s per GPU; the planner's prediction for the same setting (steptime.py, the
stated H100 / A100 with the row's links); the error of the ratios inside one publication, where the
implementation's kernel efficiency cancels, and of the absolute figures at one compute efficiency for
every row. `python scripts/plan_published.py` prints it (docs/calibration.md).

MPT (llm-foundry) is modelled as a LLaMA of the same width, depth, vocabulary and parameter count (its
GELU MLP of 4d as a SwiGLU of 8d/3: the same matrices' elements, within 0.1%); FSDP's FULL_SHARD (FSDP1)
as FSDP2, the same collectives. torchtitan's selective activation checkpointing ('op': matmul outputs
kept) is counted as no recomputation; llm-foundry's full checkpointing as the trainers'."""

import statistics
from dataclasses import dataclass, replace

from llama_train.model import ModelArgs
from llama_train.plan.planner import Workload, plan_rank, shardings
from llama_train.plan.steptime import MACHINES

TORCHTITAN = "https://github.com/pytorch/torchtitan/blob/main/benchmarks/llama3_h100_202412_torchtitan.md"
FOUNDRY = "https://github.com/mosaicml/llm-foundry/blob/main/scripts/train/benchmarking/README.md"
HF_BLOG = "https://huggingface.co/blog/deepspeed-to-fsdp-and-back"

LLAMA31_8B = ModelArgs(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, vocab_size=128256, multiple_of=1024,
                       ffn_dim_multiplier=1.3, max_seq_len=8192)  # fmt: skip
GRANITE_7B = ModelArgs(dim=4096, n_layers=32, n_heads=32, vocab_size=32000, max_seq_len=4096)  # Llama-2-7B's
MPT = {  # d_model, n_layers, n_heads; vocabulary 50368, tied; SwiGLU of 8d/3 (multiple_of 1)
    "125m": ModelArgs(dim=768, n_layers=12, n_heads=12, vocab_size=50368, tie_embeddings=True, multiple_of=1),
    "1b": ModelArgs(dim=2048, n_layers=24, n_heads=16, vocab_size=50368, tie_embeddings=True, multiple_of=1),
    "7b": ModelArgs(dim=4096, n_layers=32, n_heads=32, vocab_size=50368, tie_embeddings=True, multiple_of=1),
}


@dataclass(frozen=True)
class Row:
    """One published measurement: what ran, where, and its tokens/s per GPU."""

    name: str  # how the tables and the ratios refer to it
    source: str
    model: ModelArgs
    model_name: str
    gpu: str  # steptime.MACHINES key
    gpus: int
    interconnect: str  # as the publication states it
    inter_gbit: float  # between hosts, a host's links together (0: one host)
    seq: int
    micro_batch: int
    accumulation: int
    strategy: str  # fsdp2 / zero3, as the planner names them
    checkpointing: bool
    tokens_per_s: float  # per GPU


def _foundry(name, model, gpu, gpus, seq, mb, acc, ckpt, tps, inter=0.0, fabric="8 GPUs, one node: NVLink"):
    return Row(
        name, FOUNDRY, MPT[model], f"MPT-{model}", gpu, gpus, fabric, inter, seq, mb, acc, "fsdp2", ckpt, tps
    )


def _titan(name: str, gpus: int, fabric: str, inter: float, tps: float) -> Row:
    """torchtitan's Llama 3.1 8B, FSDP, local batch 2, sequence 8192 (its 8B config), selective checkpointing."""
    return Row(
        name,
        TORCHTITAN,
        LLAMA31_8B,
        "Llama 3.1 8B",
        "h100",
        gpus,
        fabric,
        inter,
        8192,
        2,
        1,
        "fsdp2",
        False,
        tps,
    )


def _hf(name: str, strategy: str, tps: float) -> Row:
    """The blog's Granite 7B on four A100, batch 8, its sequence 4096 (tokens/s x step time / batch)."""
    return Row(
        name,
        HF_BLOG,
        GRANITE_7B,
        "Granite 7B",
        "a100",
        4,
        "4 GPUs, one node",
        0.0,
        4096,
        8,
        1,
        strategy,
        False,
        tps,
    )


ROCE = "1600 Gbit/s RoCE a node, NVLink inside"
ROWS = (
    _titan("torchtitan-8", 8, "NVLink (one host)", 0.0, 5762),  # Table 1, FSDP
    _titan("torchtitan-128", 128, "NVLink; 400 Gbit/s RDMA a GPU between hosts", 3200.0, 5605),  # Table 3
    _foundry("foundry-1b-h100", "1b", "h100", 8, 2048, 14, 1, False, 45455),
    _foundry("foundry-7b-h100", "7b", "h100", 8, 2048, 6, 1, False, 10643),
    _foundry("foundry-125m-a100", "125m", "a100", 8, 2048, 32, 2, False, 141737),
    _foundry("foundry-1b-a100", "1b", "a100", 8, 2048, 14, 4, False, 20513),
    _foundry("foundry-7b-a100", "7b", "a100", 8, 2048, 6, 2, False, 4641),
    _foundry("foundry-7b-a100-16", "7b", "a100", 16, 2048, 16, 1, True, 3645, 1600.0, ROCE),  # A100 40GB
    _foundry("foundry-7b-a100-128", "7b", "a100", 128, 2048, 18, 1, True, 3623, 1600.0, ROCE),
    _hf("hf-fsdp", "fsdp2", 3158.7),
    _hf("hf-zero3", "zero3", 3094.5),
)
# (label, numerator, denominator): ratios inside one publication, where its kernels' efficiency cancels
RATIOS = (
    ("torchtitan: 128 vs 8 H100", "torchtitan-128", "torchtitan-8"),
    ("llm-foundry: MPT-7b on 128 vs 16 A100", "foundry-7b-a100-128", "foundry-7b-a100-16"),
    ("llm-foundry: MPT-1b, H100 vs A100", "foundry-1b-h100", "foundry-1b-a100"),
    ("llm-foundry: MPT-7b, H100 vs A100", "foundry-7b-h100", "foundry-7b-a100"),
    ("HF blog: FSDP vs DeepSpeed ZeRO-3", "hf-fsdp", "hf-zero3"),
)
EFFICIENCY = 0.45  # the one compute efficiency (share of the dense bf16 peak) for every row: steptime.H100's


def predict(row: Row, efficiency: float = EFFICIENCY) -> dict:
    """The planner's tokens/s per GPU for `row`, and the inputs it used."""
    machine = replace(
        MACHINES[row.gpu], mfu=efficiency, inter_bytes_s=row.inter_gbit * 1e9 / 8, ranks_per_host=8
    )
    model = replace(row.model, gradient_checkpointing=row.checkpointing)
    work = Workload(model, row.gpus, row.micro_batch, row.seq, "bfloat16", row.accumulation)
    (sharding,) = shardings([row.strategy], work)
    plan = plan_rank(sharding, work, machine=machine)
    tokens = row.micro_batch * row.seq * row.accumulation
    return {"tokens_per_s": tokens / plan["step_s"], "plan": plan, "machine": machine}


def held(efficiency: float = EFFICIENCY) -> dict:
    """Every row's prediction and error, every ratio's, and the medians and worst of both."""
    rows = {r.name: {"row": r, **predict(r, efficiency)} for r in ROWS}
    for r in rows.values():
        r["error"] = r["tokens_per_s"] / r["row"].tokens_per_s - 1
    ratios = []
    for label, a, b in RATIOS:
        measured = rows[a]["row"].tokens_per_s / rows[b]["row"].tokens_per_s
        predicted = rows[a]["tokens_per_s"] / rows[b]["tokens_per_s"]
        ratios.append(
            {"label": label, "measured": measured, "predicted": predicted, "error": predicted / measured - 1}
        )
    summary = {
        kind: {
            "median": statistics.median(abs(x["error"]) for x in xs),
            "worst": max(abs(x["error"]) for x in xs),
        }
        for kind, xs in (("absolute", list(rows.values())), ("ratios", ratios))
    }
    return {"rows": rows, "ratios": ratios, "summary": summary, "efficiency": efficiency}
