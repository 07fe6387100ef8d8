"""Moves into the engines the trainer tests do not launch: ZeRO-2/3 with the optimizer offloaded to
the CPU, and bf16 ZeRO-0/2. One process: each engine is built, the checkpoint given is loaded into
it through the neutral form (DeepSpeedEngine.load_neutral), read back through DeepSpeed's own accessors,
stepped once, then saved by DeepSpeed and read again by our reader. Prints one JSON line.

    python tests/helpers/move_probe.py CHECKPOINT_DIR
"""

import json
import os
import sys
import tempfile
from dataclasses import replace

import deepspeed
import torch

from llama_train.checkpoint.formats import open_checkpoint
from llama_train.checkpoint.store import verify_checkpoint
from llama_train.distributed.dist import ensure_launcher_env
from llama_train.distributed.parallel import Layout
from llama_train.distributed.strategies import run_strategy
from llama_train.model import PRESETS, Transformer
from llama_train.optim.adamw import param_groups
from llama_train.optim.optimizers import build_scheduler
from llama_train.train.engines.ds_engine import DeepSpeedEngine

ADAMW = {"lr": 3e-3, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1}
ENGINES = {
    "zero2_offload": {"stage": 2, "offload_optimizer": {"device": "cpu"}},
    "zero3_offload": {"stage": 3, "offload_optimizer": {"device": "cpu"}},
    "zero0_bf16": {"stage": 0},
    "zero2_bf16": {"stage": 2},
}


def config(name: str) -> dict:
    offload = "offload" in name
    return {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "bf16": {"enabled": name.endswith("bf16")},
        "optimizer": {
            "type": "AdamW",
            "params": ADAMW if offload else {**ADAMW, "torch_adam": True, "fused": True},
        },
        "zero_optimization": ENGINES[name],
    }


def max_diff(got: dict, source) -> dict:
    return {
        key: max((got[n][key] - source.tensors(n)[key]).abs().max().item() for n in got)
        for key in ("fp32", "exp_avg", "exp_avg_sq")
    }


def probe(name: str, source, margs, state: dict) -> dict:
    torch.manual_seed(0)
    model = Transformer(margs)
    ds, *_ = deepspeed.initialize(
        model=model,
        model_parameters=param_groups(model, 0.1),
        config=config(name),
        lr_scheduler=lambda opt: build_scheduler(opt, 3e-3, 3e-4, 5, 10),
    )
    engine = DeepSpeedEngine(ds, run_strategy(config(name)), Layout(1), config(name))
    engine.load_neutral(source, state["step"])
    loaded = max_diff(engine.gathered_state(), source)
    tokens = torch.randint(0, margs.vocab_size, (4, margs.max_seq_len + 1))
    _, loss = engine(input_ids=tokens[:, :-1], labels=tokens[:, 1:])
    engine.backward(loss)
    engine.step()
    after_step = engine.gathered_state()
    with tempfile.TemporaryDirectory() as root:
        ds.save_checkpoint(root, tag="t", save_latest=False)
        saved = {"model": margs.to_dict(), "optimizer_groups": engine.optimizer_groups()}
        again = open_checkpoint(os.path.join(root, "t"), saved)
        reread = {
            k: max((after_step[n][k] - again.tensors(n)[k]).abs().max().item() for n in after_step)
            for k in ("fp32", "exp_avg", "exp_avg_sq")
        }
    return {"loaded": loaded, "loss": float(loss), "step": again.step, "reread": reread}


def main():
    ckpt_dir = sys.argv[1]
    ensure_launcher_env()
    deepspeed.init_distributed()
    state = verify_checkpoint(ckpt_dir)
    source = open_checkpoint(ckpt_dir, state)
    margs = replace(PRESETS["debug"], **{k: state["model"][k] for k in ("max_seq_len",)})
    facts = {name: probe(name, source, margs, state) for name in ENGINES}
    print("PROBE " + json.dumps(facts), flush=True)


if __name__ == "__main__":
    main()
