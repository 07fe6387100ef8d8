"""Portable runs, the pure parts: the data order by consumed samples, what --init_from accepts,
how ranks recognise their launchers. (The trainers themselves: tests/test_resume.py.)"""

import pytest
import torch
from safetensors.torch import save_file

from llama_train.checkpoint.resuming import Resume
from llama_train.checkpoint.weights import read_weights
from llama_train.errors import CheckpointError
from llama_train.hf import export_hf, to_hf_state_dict
from llama_train.model import Transformer, preset
from llama_train.steps import DataPosition, StepPlan, rank_indices
from llama_train.train.guards import launcher_name

N = 207  # train sequences of an epoch


def trained(plan: StepPlan, order: list[int], world: int) -> list[list[int]]:
    """The sequences of each optimizer step of `plan` as the trainers take them: rank r's share is
    the global batch's elements r::world, put back in their places here."""
    steps = []
    for _epoch, first, count in plan.epochs():
        per_rank = [rank_indices(order, first, count, plan.global_batch, r, world) for r in range(world)]
        share = plan.global_batch // world
        for k in range(count):
            batch = [None] * plan.global_batch
            for r, mine in enumerate(per_rank):
                batch[r::world] = mine[k * share : (k + 1) * share]
            steps.append(batch)
    return steps


def test_a_changed_global_batch_continues_at_the_consumed_sample_count():
    """3 steps of 16 sequences (2 ranks x 4 x 2), then 24 a step (2 ranks x 4 x 3) from the saved
    position: every sequence of the epoch is trained on once, in the epoch's order, up to the tail
    shorter than a global batch; none twice, none skipped."""
    order = torch.randperm(N, generator=torch.Generator().manual_seed(3)).tolist()
    before = StepPlan.make(N, batch_size=4, accumulation=2, world=2, epochs=1, max_steps=3)
    saved = before.state_at(3)
    assert saved == {"position": {"epoch": 0, "consumed": 48}, "num_samples": N, "global_batch": 16}
    after = StepPlan.make(N, 4, 3, 2, epochs=1, max_steps=-1, done=3, start=DataPosition(**saved["position"]))
    assert after.total_steps == 3 + (N - 48) // 24  # the LR schedule counts optimizer steps
    seen = [i for step in trained(before, order, 2) + trained(after, order, 2) for i in step]
    assert len(seen) == len(set(seen)) == 48 + 6 * 24
    assert seen == order[: len(seen)]  # in order, nothing skipped: only the 15-sequence tail is left
    assert after.position_after(after.total_steps) == DataPosition(0, 192)


def test_the_same_global_batch_trains_every_world_size_on_the_same_sequences():
    order = torch.randperm(N, generator=torch.Generator().manual_seed(4)).tolist()
    steps = {}
    for world, accumulation in ((1, 4), (2, 2), (4, 1)):
        plan = StepPlan.make(N, batch_size=4, accumulation=accumulation, world=world, epochs=2, max_steps=-1)
        steps[world] = trained(plan, order, world)
    assert steps[1] == steps[2] == steps[4] and len(steps[1]) == 2 * (N // 16)
    # a resume 3 steps into the second epoch (12 steps an epoch) continues there, on 2 ranks
    plan = StepPlan.make(N, 4, 2, 2, epochs=2, max_steps=-1, done=15, start=DataPosition(1, 48))
    assert trained(plan, order, 2) == steps[1][15:]


def test_checkpoints_from_before_the_position_was_recorded_continue_where_their_steps_end():
    old = Resume("ckpt", {"step": 14, "batch_size": 4, "accumulation_steps": 2, "world_size": 2})
    assert old.position(N) == DataPosition(1, 32)  # 12 steps of 16 an epoch: step 14 is 2 into epoch 1


def test_step_plan_refuses_a_global_batch_larger_than_the_data():
    with pytest.raises(ValueError, match="fewer than one global batch of 64"):
        StepPlan.make(50, batch_size=8, accumulation=4, world=2, epochs=1, max_steps=-1)


def test_init_from_names_every_mismatched_parameter_with_both_shapes(tmp_path):
    small = Transformer(preset("debug", max_seq_len=32))
    path = tmp_path / "model.safetensors"
    save_file(to_hf_state_dict(small.state_dict(), small.args), str(path))
    bigger = preset("debug", dim=128, n_layers=3, max_seq_len=32)
    with pytest.raises(CheckpointError) as e:
        read_weights(str(path), bigger)
    msg = str(e.value)
    assert f"model.layers.0.self_attn.q_proj.weight: --init_from {path} (64, 64), model (128, 128)" in msg
    assert "model.layers.2.mlp.down_proj.weight: missing from the --init_from" in msg
    weights, what, _ = read_weights(str(path), small.args)  # the matching model loads, in our names
    assert what.startswith("HF state dict") and torch.equal(weights["output.weight"], small.output.weight)


def test_init_from_refuses_a_model_with_the_same_shapes_but_other_heads(tmp_path):
    """8 heads of 8 instead of 4 of 16: every tensor has the same shape, attention is another."""
    small = Transformer(preset("debug", max_seq_len=32))
    export_hf(small.state_dict(), small.args, str(tmp_path / "hf"))
    other = preset("debug", n_heads=8, n_kv_heads=4, max_seq_len=32)
    with pytest.raises(CheckpointError, match=r"n_heads: --init_from 4, flags 8"):
        read_weights(str(tmp_path / "hf"), other)
    weights, what, tokenizer = read_weights(str(tmp_path / "hf"), small.args)
    assert what.startswith("HF directory") and set(weights) == set(small.state_dict())
    assert all(torch.equal(weights[k], v) for k, v in small.state_dict().items())


@pytest.mark.parametrize(
    ("cmdline", "name"),
    [
        (["/v/bin/python3.11", "/v/bin/deepspeed", "--num_gpus", "2", "train_deepspeed.py"], "deepspeed"),
        (
            ["/v/bin/python", "-u", "-m", "deepspeed.launcher.launch", "--world_info=e30="],
            "deepspeed.launcher.launch",
        ),
        (["/v/bin/python", "/v/bin/torchrun", "--nproc_per_node", "2", "train_ddp.py"], "torchrun"),
        (["python", "-m", "llama_train.launch", "torchrun", "train_ddp.py"], "llama_train.launch"),
        (
            ["/s/bin/python3", "-m", "deepspeed.launcher.runner", "--num_gpus", "1", "t.py"],
            "deepspeed.launcher.runner",
        ),
        (["/s/bin/python3", "-m", "torch.distributed.run", "--nproc_per_node", "1"], "torch.distributed.run"),
        (["/v/bin/python", "-m", "pytest", "tests/test_resume.py"], None),
        (["bash", "-c", "deepspeed train_deepspeed.py"], None),
    ],
)
def test_ranks_recognise_their_launchers(cmdline, name):
    assert launcher_name(cmdline) == name


def test_a_resume_that_would_change_the_model_or_the_data_order_is_refused():
    """World size, batch, strategy and the runtime-only model fields may change on resume; the
    model's shape and what decides the data order may not, and the error names each difference."""
    from llama_train.checkpoint.resuming import check_resumable

    model = preset("debug").to_dict()
    state = {"model": model, "seed": 1234, "data_split": "98,2,0"}
    form = {"strategy": "ddp", "world_size": 2}
    runtime = {**model, "gradient_checkpointing": True, "loss_chunk_tokens": 0, "use_flash_attn": False}
    same = {"model": runtime, "seed": 1234, "data_split": "98,2,0", "model_parallel": None, "layout": form}
    check_resumable("ckpt", state, same)  # nothing that matters changed
    other = {**same, "seed": 7, "model": {**model, "n_layers": model["n_layers"] + 1}}
    with pytest.raises(CheckpointError) as e:
        check_resumable("ckpt", state, other)
    text = str(e.value)
    assert f"model n_layers: checkpoint {model['n_layers']}, now {model['n_layers'] + 1}" in text
    assert "seed: checkpoint 1234, now 7" in text and "--init_from" in text and "data_split" not in text
