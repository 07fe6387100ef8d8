"""The step probe does not change what it measures: one step in --probe_interval is probed, the others
carry none of its hooks, and the step logger's step time, tok/s and MFU leave the probed steps out.
One process, the debug model, no launcher (the probe on 2 ranks of both trainers: test_benchmark.py)."""

import json

import pytest
import torch

from llama_train.model import Transformer, preset
from llama_train.telemetry import metrics, timing
from llama_train.telemetry.metrics import StepLogger
from llama_train.train.engines.torch_engine import DDPEngine
from llama_train.train.guards import NonFiniteGuard

RECORD = {
    "world_size": 1, "args": {}, "peak_flops": 1e12, "peak_source": "test", "tokens_per_step": 64,
    "flops_per_token": 1e6, "strategy": "ddp", "num_params": 164_160, "dtype": "float32",
}  # fmt: skip


def hooks_on(module: torch.nn.Module) -> int:
    """Hooks the probe may have put on `module`: forward (pre-)hooks and per-parameter gradient hooks."""
    grads = sum(len(p._post_accumulate_grad_hooks or {}) for p in module.parameters())
    return len(module._forward_pre_hooks) + len(module._forward_hooks) + grads


@pytest.fixture(scope="module")
def probed_run(tmp_path_factory):
    """Six steps of the debug model through DDPEngine (no process group), one in three probed; what
    the model and engine carried during each step, and the records written."""
    torch.manual_seed(0)
    out = tmp_path_factory.mktemp("probe")
    model = Transformer(preset("debug", max_seq_len=16))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)  # as the trainer's
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    engine = DDPEngine(model, optimizer, scheduler, torch.device("cpu"), "float32", 1.0)
    log = StepLogger(str(out), 0, RECORD, 6, 0, log_interval=1)
    probe = timing.StepProbe(engine, log, torch.device("cpu"), interval=3)
    ids = torch.randint(0, 512, (4, 16))
    seen, guard = {}, NonFiniteGuard(0, 0)
    with log:
        for step, (batch,) in probe.steps((s, [ids]) for s in range(1, 7)):
            _, loss = engine(input_ids=batch, labels=batch)
            engine.backward(loss)
            seen[step] = (hooks_on(model), sorted(engine.__dict__.keys() & {"backward", "step"}))
            grad_norm, lr = engine.step(guard, step)
            log.step(step, loss.detach(), lr, grad_norm, torch.device("cpu"))
    guard.settle()
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return model, seen, records


def test_only_probed_steps_carry_hooks_and_wrappers(probed_run):
    model, seen, _ = probed_run
    params = sum(1 for p in model.parameters() if p.requires_grad)
    for step, (hooks, wrapped) in seen.items():
        if step in (3, 6):
            assert hooks == 2 + params and wrapped == ["backward", "step"], step
        else:
            assert hooks == 0 and wrapped == [], step
    assert hooks_on(model) == 0  # nothing left behind after the last probed step


def test_probed_steps_are_recorded_and_left_out_of_the_figures(probed_run):
    _, _, records = probed_run
    train = {r["step"]: r for r in records if r["event"] == "train"}
    timing_records = [r for r in records if r["event"] == "timing"]
    assert [r["step"] for r in timing_records] == [3, 6]
    assert [r["step"] for r in records if r["event"] == "comm"] == [3, 6]
    assert [train[s]["probed_steps"] for s in range(1, 7)] == [[], [], [3], [], [], [6]]
    assert [train[s]["timed_steps"] for s in range(1, 7)] == [1, 1, 0, 1, 1, 0]
    assert train[3]["step_time_s"] == train[2]["step_time_s"]  # a probed step repeats the last unprobed
    assert train[6]["tokens_per_s"] == train[5]["tokens_per_s"] and train[6]["mfu"] == train[5]["mfu"]
    for r in timing_records:  # the phases tile the probed step
        total = sum(r[f"{p}_s"][0] for p in timing.PHASES)
        assert total == pytest.approx(r["wall_s"], rel=1e-6) and r["step_time_s"] == [total]
        assert min(r["forward_s"][0], r["backward_s"][0], r["optimizer_s"][0]) > 0


def test_the_logger_leaves_probed_seconds_out_of_its_window(tmp_path, monkeypatch):
    """--log_interval 3 with step 2 probed: the window's time less the probed step's, over the 2 others."""
    clock = iter([0.0, 1.0, 7.0, 9.0, 9.0, 9.0])  # start; the steps end at 1, 7 (probed: 5 s), 9; reset
    monkeypatch.setattr(metrics.time, "perf_counter", lambda: next(clock))

    class Probe:
        measuring = 2

        def finish(self, step, writer):
            return 5.0, "a note"

    log = StepLogger(str(tmp_path), 0, RECORD, 3, 0, log_interval=3)
    log.probe = Probe()
    for step in (1, 2, 3):
        rec = log.step(step, torch.tensor(1.0), 1e-3, torch.tensor(1.0), torch.device("cpu"))
    log.close()
    assert rec["step_time_s"] == (9.0 - 5.0) / 2 and rec["timed_steps"] == 2 and rec["probed_steps"] == [2]
    assert rec["tokens_per_s"] == 64 / 2.0
