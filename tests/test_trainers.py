"""The real trainers, launched as users launch them: `deepspeed` and `torchrun`, 2 gloo ranks.

Each run is expensive (process start-up), so runs are module fixtures shared by the tests
that read them. Every comparison is of per-step losses logged by the trainers themselves.
"""

import gzip

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.trainer_utils import BF16_TWIN_RTOL, ROOT, assert_close_curves, launch, losses, read_metrics

pytestmark = pytest.mark.usefixtures("deepspeed_ops")  # tests/conftest.py

STEPS = 24
CONTRACT_TRAIN = {"step", "loss", "lr", "grad_norm", "tokens_per_s", "mfu", "step_time_s"}


@pytest.fixture(scope="module")
def runs(tmp_path_factory, shared_data):
    """Lazily launched runs, keyed by name, so each is paid for once per module. Some runs also serve a
    feature's test (SHARED): their other tests' assertions hold with it on."""
    cache = {}

    def get(name: str, kind: str, flags: list[str], nproc: int = 2):
        if name not in cache:
            out = tmp_path_factory.mktemp(name)
            launch(kind, [*flags, *SHARED.get(name, [])], out, shared_data, nproc=nproc)
            cache[name] = out
        return cache[name]

    return get


SELECTIVE = ["--gradient_checkpointing", "--checkpoint_every", "2"]  # block 0 recomputed, block 1 not
PROFILE = ["--profile", "--profile_interval", "2"]
# run name -> flags added to it: selective checkpointing recomputes in fp32 (ZeRO-0's losses within 1e-5),
# the profiler only watches; each spares a launch of its own
SHARED = {"zero2": SELECTIVE, "ddp_acc1": SELECTIVE, "zero2_acc4": PROFILE}


def ds(stage: str, steps: int = STEPS, acc: int = 1) -> list[str]:
    return [f"--deepspeed_config=ds_configs/{stage}.json", *ddp(steps, acc)]


def ddp(steps: int = STEPS, acc: int = 1) -> list[str]:
    return f"--max_steps {steps} --accumulation_steps {acc}".split()


@pytest.mark.parametrize("stage", ["zero0", "zero1", "zero2", "zero3", "zero2_offload"])
def test_deepspeed_stage_trains_and_logs_contract(runs, stage):
    out = runs(stage, "deepspeed", ds(stage))
    records = read_metrics(out)
    config = records[0]
    assert config["event"] == "config" and config["world_size"] == 2
    assert config["strategy"] == f"deepspeed-zero{stage[4]}"
    train = [r for r in records if r["event"] == "train"]
    assert [r["step"] for r in train] == list(range(1, STEPS + 1))
    for r in train:
        assert CONTRACT_TRAIN <= r.keys() and r["grad_norm"] is not None and r["tokens_per_s"] > 0
    first, last = sum(r["loss"] for r in train[:4]) / 4, sum(r["loss"] for r in train[-4:]) / 4
    assert last < first - 0.1, f"loss did not fall: {first:.3f} -> {last:.3f}"
    (ev,) = [r for r in records if r["event"] == "eval"]
    assert ev["step"] == STEPS and ev["eval_ppl"] == pytest.approx(2.718281828 ** ev["eval_loss"], rel=1e-6)
    assert (out / "checkpoints" / "latest").read_text().strip() == f"step_{STEPS:08d}"


@pytest.mark.parametrize("kind", ["ddp", "deepspeed"])
def test_selective_checkpointing_computes_the_same_losses(runs, kind):
    """--gradient_checkpointing --checkpoint_every 2 (the debug model's block 0 recomputed, block 1 not) in
    both trainers (DDP; ZeRO-2: SHARED): the losses of ZeRO-0 without checkpointing, within 1e-5 (fp32)."""
    out = runs("ddp_acc1", "ddp", ddp()) if kind == "ddp" else runs("zero2", "deepspeed", ds("zero2"))
    model = read_metrics(out)[0]["model"]
    assert model["gradient_checkpointing"] and model["checkpoint_every"] == 2
    assert_close_curves(losses(out), losses(runs("zero0", "deepspeed", ds("zero0"))), rtol=1e-5)


@pytest.mark.parametrize("stage", ["zero1", "zero2", "zero3", "zero2_offload"])
def test_zero_stages_give_zero0_losses(runs, stage):
    assert_close_curves(
        losses(runs(stage, "deepspeed", ds(stage))), losses(runs("zero0", "deepspeed", ds("zero0")))
    )


@pytest.mark.parametrize("acc", [1, 4])
@pytest.mark.parametrize("stage", ["zero0", "zero2"])
def test_ddp_matches_deepspeed(runs, stage, acc):
    steps = STEPS if acc == 1 else 12
    name = stage if acc == 1 else f"{stage}_acc{acc}"
    ds_losses = losses(runs(name, "deepspeed", ds(stage, steps, acc)))
    ddp_losses = losses(runs(f"ddp_acc{acc}", "ddp", ddp(steps, acc)))
    assert_close_curves(ddp_losses, ds_losses)


def first_update_runs(runs, kind: str) -> list:
    """One process, no launcher, one step: batch 8 x accumulation 1, then batch 2 x accumulation 4."""
    extra = ["--deepspeed_config=ds_configs/zero0.json"] if "deepspeed" in kind else []
    flags = "--max_steps 1 --batch_size {} --accumulation_steps {} --adam_eps 1e-4"
    return [
        runs(f"{kind}_b{b}", kind, [*extra, *flags.format(b, a).split()], nproc=1)
        for b, a in ((8, 1), (2, 4))
    ]


@pytest.mark.parametrize("kind", ["train_ddp.py", "train_deepspeed.py"])
def test_accumulation_equivalence_first_update(runs, kind):
    """batch 8 x acc 1 and batch 2 x acc 4 see the same 8 sequences, so the first update and the
    exported weights after it must agree (one process, no launcher). Adam's first step is
    lr * g / (|g| + eps), a sign function for |g| << eps that turns fp32 rounding of tiny
    gradients into full-size differences; a larger eps keeps the comparison about the gradients."""
    outs = first_update_runs(runs, kind)
    (r1,), (r2,) = ([r for r in read_metrics(o) if r["event"] == "train"] for o in outs)
    assert r1["loss"] == pytest.approx(r2["loss"], rel=1e-6)
    assert r1["grad_norm"] == pytest.approx(r2["grad_norm"], rel=1e-5)  # the accumulated mean gradient
    m1, m2 = (AutoModelForCausalLM.from_pretrained(o / "hf") for o in outs)
    diffs = [(p1 - p2).abs().max().item() for p1, p2 in zip(m1.parameters(), m2.parameters())]
    assert max(diffs) < 1e-6
    # and the update is real: the weights moved away from the seeded initialisation
    from llama_train.hf import from_hf_config, to_hf_state_dict
    from llama_train.model import Transformer

    args = from_hf_config(m1.config)
    torch.manual_seed(1234)  # the trainers' default --seed
    init = to_hf_state_dict(Transformer(args).state_dict(), args)
    moved = max((m1.state_dict()[k] - v).abs().max().item() for k, v in init.items())
    assert moved > 1e-4


def test_one_process_trainers_agree(runs):
    """Without a launcher both trainers run one process (DeepSpeed then skips its identity
    all-reduce): the same first update, to the weights."""
    ddp_out, ds_out = (first_update_runs(runs, kind)[0] for kind in ("train_ddp.py", "train_deepspeed.py"))
    (r1,), (r2,) = ([r for r in read_metrics(o) if r["event"] == "train"] for o in (ddp_out, ds_out))
    assert r1["loss"] == pytest.approx(r2["loss"], rel=1e-6)
    assert r1["grad_norm"] == pytest.approx(r2["grad_norm"], rel=1e-5)
    m1, m2 = (AutoModelForCausalLM.from_pretrained(o / "hf") for o in (ddp_out, ds_out))
    assert max((p1 - p2).abs().max().item() for p1, p2 in zip(m1.parameters(), m2.parameters())) < 1e-6


def test_zero3_export_matches_deepspeed_consolidation(runs):
    """HF export of a ZeRO-3 run == DeepSpeed's own zero_to_fp32 consolidation of its checkpoint."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    from llama_train.hf import from_hf_config
    from llama_train.model import Transformer

    out = runs("zero3", "deepspeed", ds("zero3"))
    sd = get_fp32_state_dict_from_zero_checkpoint(str(out / "checkpoints"), tag=f"step_{STEPS:08d}")
    hf = AutoModelForCausalLM.from_pretrained(out / "hf").eval()
    ours = Transformer(from_hf_config(hf.config)).eval()
    ours.load_state_dict(sd)
    tokens = torch.randint(0, hf.config.vocab_size, (2, 16))
    with torch.no_grad():
        diff = (ours(tokens) - hf(tokens).logits).abs().max().item()
    assert diff <= 1e-4


def test_bf16_deepspeed_exports_its_fp32_master_and_tracks_ddp(runs):
    """bf16, 2 ranks, accumulation 2. ZeRO-2 accumulates and reduces gradients in fp32, as DDP's
    autocast does (llama_train.distributed.ds_config.precision_defaults); its in-run export holds the fp32 master
    weights, equal to zero_to_fp32 of its checkpoint (not their bf16 rounding); and DDP follows the
    same loss curve within bf16's precision (the twins differ in what they keep in bf16: DeepSpeed
    the weights and activations, autocast only the matmul inputs)."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    from llama_train.checkpoint.formats import safe_load
    from llama_train.hf import from_hf_config, from_hf_state_dict

    steps, bf16 = 12, ["--dtype", "bfloat16"]
    ds_out = runs("zero2_bf16", "deepspeed", [*ds("zero2", steps, 2), *bf16])
    ddp_out = runs("ddp_bf16", "ddp", [*ddp(steps, 2), *bf16])
    tag = ds_out / "checkpoints" / f"step_{steps:08d}"
    engine_config = safe_load(str(tag / "mp_rank_00_model_states.pt"))["ds_config"]
    assert (
        engine_config["communication_data_type"] == engine_config["data_types"]["grad_accum_dtype"] == "fp32"
    )
    master = get_fp32_state_dict_from_zero_checkpoint(str(ds_out / "checkpoints"), tag=tag.name)
    hf = AutoModelForCausalLM.from_pretrained(ds_out / "hf")
    exported = from_hf_state_dict(hf.state_dict(), from_hf_config(hf.config))
    assert all(torch.equal(exported[k], master[k]) for k in master)
    assert any(not torch.equal(v, v.bfloat16().float()) for v in master.values())
    assert_close_curves(losses(ddp_out), losses(ds_out), rtol=BF16_TWIN_RTOL)


def test_two_nodes_without_ssh(tmp_path, shared_data):
    """Two `deepspeed --no_ssh --node_rank K` launchers, one rank each: one world of size 2."""
    import subprocess

    from llama_train import gpu
    from tests.trainer_utils import BASE_FLAGS, env, free_port

    hostfile = tmp_path / "hostfile"
    hostfile.write_text("node0 slots=1\nnode1 slots=1\n")
    port, out = free_port(), tmp_path / "run"
    flags = [*BASE_FLAGS, *ds("zero2", 6), "--data_output_path", str(shared_data), "--output_dir", str(out)]

    def launcher(k: int) -> list[str]:
        node = f"--no_ssh --node_rank {k} --master_addr 127.0.0.1 --master_port {port} train_deepspeed.py"
        return [*gpu.launcher("deepspeed"), "--hostfile", str(hostfile), *node.split(), *flags]

    procs = [
        subprocess.Popen(launcher(k), cwd=ROOT, env=env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        for k in (0, 1)
    ]
    logs = [p.communicate(timeout=600)[0].decode() for p in procs]
    assert [p.returncode for p in procs] == [0, 0], "\n\n".join(log[-3000:] for log in logs)
    records = read_metrics(out)
    assert records[0]["world_size"] == 2
    assert len([r for r in records if r["event"] == "train"]) == 6


EXPORT_CASES = [
    ("zero0", "deepspeed", ds("zero0")),  # DeepSpeed without ZeRO: the module file
    ("zero2", "deepspeed", ds("zero2")),  # ZeRO shards merged by zero_to_fp32
    ("ddp_acc1", "ddp", ddp()),  # our own model.pt
]


@pytest.mark.parametrize(("name", "kind", "flags"), EXPORT_CASES)
def test_export_script_from_checkpoint_matches_final_export(runs, tmp_path, name, kind, flags):
    """scripts/export_hf.py on the last checkpoint == the trainer's own export of the live model, and
    (ZeRO-2's) scripts/eval_ppl.py / generate.py run on it. Those two read each checkpoint format
    through the same consolidated_state_dict as export_hf.py, so one format is enough for them (eval_ppl's
    loss on an export: tests/test_reporting.py; generate.py on TP/PP checkpoints: tests/test_parallel.py)."""
    import subprocess
    import sys

    out = runs(name, kind, flags)
    exp = tmp_path / "exported"
    export = [sys.executable, "scripts/export_hf.py", "--checkpoint", str(out), "--output_dir", str(exp)]
    subprocess.run(export, cwd=ROOT, check=True, capture_output=True)
    a, b = (AutoModelForCausalLM.from_pretrained(p).eval() for p in (out / "hf", exp))
    tokens = torch.randint(0, a.config.vocab_size, (2, 16))
    with torch.no_grad():
        assert (a(tokens).logits - b(tokens).logits).abs().max().item() <= 1e-5
    if name != "zero2":
        return
    few_blocks = "--max_seq_len 32 --batch_size 4 --max_batches 3".split()
    eval_ppl = [sys.executable, "scripts/eval_ppl.py", "--model", str(exp), *few_blocks]
    ppl = subprocess.run(eval_ppl, cwd=ROOT, capture_output=True, text=True)
    assert "perplexity" in ppl.stdout, ppl.stderr[-2000:]
    generate = [sys.executable, "scripts/generate.py", "--model", str(out), "--prompt", "The value"]
    gen = subprocess.run([*generate, "--max_new_tokens", "5"], cwd=ROOT, capture_output=True, text=True)
    assert "\n> The value" in "\n" + gen.stdout, gen.stderr[-2000:]


def test_profile_writes_flops_profile_and_trace(runs):
    # the trace window (step 2) ends well before the run: Kineto's profiler thread can abort a
    # process that exits while it still processes a trace (pytorch/kineto#1051)
    out = runs("zero2_acc4", "deepspeed", ds("zero2", 12, 4))  # SHARED: --profile --profile_interval 2
    profile = (out / "flops_profile.txt").read_text()
    assert "DeepSpeed Flops Profiler" in profile and "fwd flops per GPU" in profile
    traces = list((out / "profile").glob("*.pt.trace.json.gz"))
    assert len(traces) == 2  # one per rank, for TensorBoard / Perfetto, gzipped
    assert '"traceEvents"' in gzip.decompress(traces[0].read_bytes()).decode()[:10000]
