"""DeepSpeed's inference engine over a transformers model (scripts/generate.py and scripts/eval_tasks.py
with --ds_inference): `deepspeed.init_inference` with AutoTP, the model's own linear layers split over
the launch's ranks (tensor parallel, one all-reduce after each attention and MLP block, the logits
gathered), no kernel injection: a CPU has no DeepSpeed inference kernels, and on a GPU the injected
fused kernels would not give the plain model's numbers, which these scripts compare against.

    deepspeed --num_gpus 2 scripts/generate.py --model outputs/demo/hf --ds_inference --compare
"""

import datetime
import os

import torch

from llama_train.distributed.dist import ensure_launcher_env


def setup_inference(device_name: str, timeout_minutes: float = 30.0) -> tuple[int, int]:
    """The process group the engine's tensor-parallel ranks use: deepspeed.init_distributed under the
    launcher (gloo on CPU, nccl on GPU), one process without it. Returns (rank, world)."""
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    ensure_launcher_env()
    if device_name != "cpu":
        get_accelerator().set_device(int(os.environ["LOCAL_RANK"]))
    deepspeed.init_distributed(timeout=datetime.timedelta(minutes=timeout_minutes))
    return torch.distributed.get_rank(), torch.distributed.get_world_size()


def ds_inference(model, world: int, dtype: torch.dtype):
    """`model` (a transformers causal LM) in DeepSpeed's InferenceEngine, tensor parallel over the `world`
    ranks of the launch (AutoTP: heads and MLP units split, every rank gets the whole logits). Call it
    as the model (`engine(input_ids=...)`), or `engine.module.generate(...)`."""
    import deepspeed

    return deepspeed.init_inference(
        model,
        tensor_parallel={"tp_size": world},
        dtype=dtype,
        replace_with_kernel_inject=False,
    )


class Logits:
    """A transformers model (or its inference engine) as the task scorer calls an engine:
    `scorer(input_ids=...)` -> logits; eval()/train() leave an inference model as it is."""

    def __init__(self, model):
        self.model = model

    @torch.no_grad()
    def __call__(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids, use_cache=False).logits

    def eval(self):
        pass

    def train(self):
        pass
