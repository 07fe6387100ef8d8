"""The Engine protocol (llama_train/train/engines/engine.py) from outside: a third kind of engine,
sketched here, implements it and nothing else, and the shared code (evaluation, the probe's counter, the
memory walk, saving, resuming natively and through the neutral form into the DDP trainer's engine)
runs over it unchanged. One process, the debug model, no launch."""

import types

import pytest
import torch
from torch.utils.data import DataLoader

from llama_train.checkpoint import portable
from llama_train.checkpoint.async_save import Saver
from llama_train.checkpoint.resuming import load_ddp_objects, resume_point
from llama_train.checkpoint.store import ddp_files, run_meta
from llama_train.checkpoint.weights import check_shapes
from llama_train.config import build_parser, model_args, parse_args
from llama_train.distributed.parallel import Layout
from llama_train.distributed.strategies import EngineKind, Strategy, run_strategy
from llama_train.model import Transformer
from llama_train.optim.optimizers import build_lr_scheduler, build_optimizer
from llama_train.plan.comm import install_counter
from llama_train.plan.memory import model_state_bytes
from llama_train.train.build import gradient_group_timeout_s
from llama_train.train.checkpointing import checkpoint_settings, resume, save
from llama_train.train.engines.engine import Engine
from llama_train.train.engines.torch_engine import DDPEngine
from llama_train.train.evaluation import evaluate

# the third kind's record: what every strategy of it shares (distributed/strategies.py's EngineKind)
LOCAL = EngineKind(
    "local", "train_local.py", full_state=True, configured=False, fp32_comm=True, cpu_runtime=(0,)
)


class LocalEngine:
    """A third kind of engine: one process, the bare model and its torch optimizer, in fp32 (nanoGPT's
    single-device path). It writes the DDP trainer's files, so the neutral reader knows them."""

    def __init__(self, model, optimizer, lr_scheduler):
        self.module, self.optimizer, self.lr_scheduler = model, optimizer, lr_scheduler
        self.strategy, self.skipped_steps = Strategy("local", LOCAL), 0

    def __call__(self, **batch):
        return self.module(**batch)

    def backward(self, loss):
        loss.backward()

    def step(self):
        grad_norm = torch.nn.utils.clip_grad_norm_(self.module.parameters(), 1.0)
        self.optimizer.step()
        self.lr_scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return grad_norm

    def eval_loss(self, batch):
        return self(**batch)[1]

    def train(self):
        self.module.train()

    def eval(self):
        self.module.eval()

    def files(self, rank):
        objects = {"model": self.module.state_dict(), "optimizer": self.optimizer.state_dict()}
        return ddp_files({**objects, "scheduler": self.lr_scheduler.state_dict()}, rank)

    def load(self, path):
        objects = load_ddp_objects(path, names=("model", "optimizer", "scheduler"))
        self.module.load_state_dict(objects["model"])
        self.optimizer.load_state_dict(objects["optimizer"])
        self.lr_scheduler.load_state_dict(objects["scheduler"])

    def load_neutral(self, reader, step):
        check_shapes(reader.shapes(), self.param_shapes(), what="checkpoint")
        portable.into_torch(self.optimizer, [(n, p, p) for n, p in self.module.named_parameters()], reader)
        portable.restore_schedule(self.lr_scheduler, reader.lr_scheduler)

    def optimizer_groups(self):
        return portable.group_names({id(p): n for n, p in self.module.named_parameters()}, self.optimizer)

    def full_state_dict(self, rank):
        return (
            {k: v.detach().float().cpu() for k, v in self.module.state_dict().items()} if rank == 0 else None
        )

    def gathered_state(self):
        named = self.module.named_parameters()
        return {n: portable.cpu_copies(portable.torch_state(p, self.optimizer)) for n, p in named}

    def loss_scale(self):
        return None  # fp32: no loss scaler

    def param_shapes(self):
        return {n: p.shape for n, p in self.module.named_parameters()}

    def held_tensors(self):
        return list(self.module.parameters())

    def gradient_group(self):
        return None

    def count_comm(self, counter):
        pass  # one process: no collectives


def protocol_members() -> set[str]:
    """What Engine declares: its attributes and methods (what a new kind must implement)."""
    methods = {n for n, v in vars(Engine).items() if callable(v) and not n.startswith("_")}
    return methods | set(Engine.__annotations__) | {"__call__"}


def build(engine_class, args, seed: int, **kw):
    torch.manual_seed(seed)
    model = Transformer(model_args(args))
    optimizer = build_optimizer(model, args)
    return engine_class(model, optimizer, build_lr_scheduler(optimizer, args, 10), **kw)


def batches(vocab: int, n: int, seed: int = 0) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (n, 2, 17), generator=g)
    return [{"input_ids": t[:, :-1], "labels": t[:, 1:]} for t in tokens]


def test_a_third_engine_kind_is_one_class_and_one_record(tmp_path):
    """What a new kind must implement is the protocol's members, no more (LocalEngine above, ~60 lines
    mostly of portable.py's engine-free helpers, and its EngineKind record); then the shared code runs
    over it as over the DDP and DeepSpeed engines: held-out loss, the collective counter, the memory
    walk, the collective timeout, a checkpoint saved and resumed natively, and its checkpoint moved into
    the DDP trainer's engine through the neutral form, state for state."""
    flags = ["--preset", "debug", "--max_seq_len", "16", "--output_dir", str(tmp_path), "--resume", "auto"]
    args = parse_args(build_parser("t"), flags)
    vocab = model_args(args).vocab_size
    engine = build(LocalEngine, args, seed=0)
    assert protocol_members() - set(dir(engine)) == set()
    assert {"files", "load", "load_neutral", "gathered_state", "strategy", "step"} <= protocol_members()

    for batch in batches(vocab, 2):
        _, loss = engine(**batch)
        engine.backward(loss)
        engine.step()
    data = types.SimpleNamespace(
        eval_loader=DataLoader(batches(vocab, 1, seed=1), collate_fn=lambda b: b[0]),
        text_bytes=types.SimpleNamespace(count=lambda input_ids, labels: int((labels != -100).sum())),
    )  # one byte a scored token
    loss, ppl, _ = evaluate(engine, data, torch.device("cpu"), -1)
    assert 0 < loss < 10 and ppl == pytest.approx(torch.tensor(loss).exp().item(), rel=1e-6)
    assert install_counter(engine).take() == ({}, {}, {}) and gradient_group_timeout_s(engine, "cpu") is None
    held = model_state_bytes(engine.held_tensors(), engine.optimizer)
    assert held["params_and_grads"] == 4 * sum(p.numel() for p in engine.module.parameters())

    settings, layout = checkpoint_settings(args), Layout(world=1)
    meta = {**run_meta(args, model_args(args), layout, engine.strategy, "float32"), "data": None}
    meta["optimizer_groups"] = engine.optimizer_groups()
    with Saver.of(settings, rank=0, world=1) as saver:
        save(engine, settings, 2, meta, 0, saver)
    plan = types.SimpleNamespace(
        start=types.SimpleNamespace(epoch=0, consumed=8), num_samples=64, global_batch=4
    )

    start = resume_point(settings, meta, 0, 1)  # the same form: its own loader
    again = build(LocalEngine, args, seed=1)
    assert start.native and resume(again, start, settings, meta, plan, 0) == 2
    ddp_meta = {**meta, **run_meta(args, model_args(args), layout, run_strategy(None), "float32")}
    start = resume_point(settings, ddp_meta, 0, 1)  # another kind: the neutral form
    ddp = build(DDPEngine, args, seed=1, device=torch.device("cpu"), dtype="float32", grad_clip=1.0)
    assert not start.native and resume(ddp, start, settings, ddp_meta, plan, 0) == 2
    want = engine.gathered_state()
    for other in (again, ddp):
        got = other.gathered_state()
        assert all(torch.equal(got[n][k], want[n][k]) for n in want for k in want[n]), type(other).__name__
    assert (
        again.lr_scheduler.get_last_lr()
        == ddp.lr_scheduler.get_last_lr()
        == engine.lr_scheduler.get_last_lr()
    )
