"""DDP specifics, in-process on 2 gloo ranks: the complex rotary buffer is not synchronised and
a parameter without a gradient does not break training (find_unused_parameters)."""

import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from tests.trainer_utils import free_port


def _worker(rank: int, world: int, port: int, results):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    from llama_train.config import build_parser, parse_args
    from llama_train.config import model_args as to_model_args
    from llama_train.distributed.dist import DDP_IGNORED
    from llama_train.model import Transformer
    from llama_train.optim.adamw import build_adamw

    args = parse_args(build_parser("t"), ["--preset", "debug", "--max_seq_len", "16"])
    torch.manual_seed(0)
    model = Transformer(to_model_args(args))
    model.unused = nn.Linear(8, 8)  # never called in forward: no gradient, ever
    with torch.no_grad():
        model.pos_cis.mul_(1 + rank)  # differs per rank: a sync would overwrite rank 1's copy
    mine = model.pos_cis.clone()
    model._ddp_params_and_buffers_to_ignore = DDP_IGNORED  # as train_ddp.py's build_engine wraps it
    ddp = nn.parallel.DistributedDataParallel(
        model, find_unused_parameters=True, gradient_as_bucket_view=True
    )
    optimizer = build_adamw(ddp, args)
    torch.manual_seed(rank)
    for _ in range(3):
        tokens = torch.randint(0, 512, (2, 16))
        _, loss = ddp(tokens, labels=tokens)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    checksum = sum(p.detach().double().sum().item() for p in model.parameters())
    results[rank] = (torch.equal(model.pos_cis, mine), model.pos_cis.dtype, checksum)
    dist.destroy_process_group()


def test_pos_cis_not_synchronised_and_unused_params_tolerated():
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_worker, args=(2, free_port(), results), nprocs=2, join=True)
        results = dict(results)
    for rank in (0, 1):
        kept, dtype, _ = results[rank]
        assert kept, f"rank {rank}'s pos_cis was overwritten: DDP synchronised the complex buffer"
        assert dtype == torch.complex64
    # the trained parameters still agree across ranks: gradients were all-reduced
    assert results[0][2] == results[1][2]
