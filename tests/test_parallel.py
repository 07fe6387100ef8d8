"""Model parallelism on the DeepSpeed engine (llama_train/distributed/parallel.py, pipeline.py): tensor (AutoTP),
sequence (Ulysses) and pipeline parallel at 2 gloo ranks give ZeRO-0's per-step losses on the same
global batches, hold their share of the weights, resume exactly and export the whole model.

The reference is ZeRO-0 on 1 rank: a model-parallel run at world 2 has one data-parallel replica,
so it reads the same sequences in the same order. Every run is the tiny preset with grouped-query
attention (2 kv heads for 4 query heads, so the splits must keep each query head with its kv head)
and accumulation 2. One straight run per kind saves at step 6 and exports at the end.
"""

import hashlib
import json
import shutil
import subprocess
import sys
from dataclasses import replace

import pytest
import torch
from transformers import AutoModelForCausalLM

from llama_train.checkpoint.resuming import check_resumable, continues_natively
from llama_train.checkpoint.store import form_of, verify_checkpoint
from llama_train.checkpoint.weights import consolidated_state_dict
from llama_train.config import build_parser, parse_args
from llama_train.distributed.parallel import Layout, feature_problems, layout_problems
from llama_train.errors import CheckpointError
from llama_train.hf import from_hf_config, from_hf_state_dict
from llama_train.model import PRESETS, ModelArgs, Transformer
from llama_train.train.evaluation import score_blocks
from tests.trainer_utils import ROOT, assert_close_curves, env, launch, losses, read_metrics
from utils.data import load_tokenizer, stream_blocks

pytestmark = pytest.mark.usefixtures("deepspeed_ops")  # tests/conftest.py

STEPS, SAVED = 12, 6
COMMON = f"--preset tiny --n_kv_heads 2 --accumulation_steps 2 --max_steps {STEPS}".split()
RUNS = {  # name -> (ranks, ds_config, the kind's own flags)
    "zero0": (1, "zero0", []),
    "tp2": (2, "tp2_zero1", ["--save_interval", str(SAVED)]),
    "sp2": (2, "zero1", ["--sequence_parallel_size", "2"]),
    "pp2": (2, "zero0", ["--pipeline_parallel_size", "2", "--save_interval", str(SAVED)]),
}
STRATEGY = {"tp2": "deepspeed-tp2-zero1", "sp2": "deepspeed-sp2-zero1", "pp2": "deepspeed-pp2-zero0"}


@pytest.fixture(scope="module")
def run(tmp_path_factory, shared_data):
    """Lazily launched runs by name ("tp2", or "tp2_resumed": from the straight run's step 6)."""
    cache = {}

    def get(name: str):
        if name not in cache:
            kind = name.removesuffix("_resumed")
            ranks, config, extra = RUNS[kind]
            flags = [*COMMON, f"--deepspeed_config=ds_configs/{config}.json", *extra]
            if name != kind:
                flags += ["--resume", str(get(kind) / "checkpoints" / f"step_{SAVED:08d}")]
            out = tmp_path_factory.mktemp(name)
            launch("deepspeed", flags, out, shared_data, nproc=ranks)
            cache[name] = out
        return cache[name]

    return get


def train(out) -> list[dict]:
    return [r for r in read_metrics(out) if r["event"] == "train"]


@pytest.mark.parametrize("kind", ["tp2", "sp2", "pp2"])
def test_model_parallel_gives_zero0_losses(run, kind):
    """Loss, grad norm (clipping at 1.0 acts on it) and eval loss of every step agree with ZeRO-0's.
    Step 9's grad norm amplifies rounding: ZeRO-1 on the same single rank is 2.2e-4 off ZeRO-0 there
    (every other step, and every loss, within 2e-5), hence 1e-3 for the norms."""
    got, want = run(kind), run("zero0")
    assert_close_curves(losses(got), losses(want))
    norms = ([r["grad_norm"] for r in train(o)] for o in (got, want))
    assert_close_curves(*norms, rtol=1e-3)
    (ev,), (ev_ref,) = ([r for r in read_metrics(o) if r["event"] == "eval"] for o in (got, want))
    assert ev["eval_loss"] == pytest.approx(ev_ref["eval_loss"], rel=1e-4)
    config = read_metrics(got)[0]
    assert config["strategy"] == STRATEGY[kind] and config["world_size"] == 2
    assert (config["model"]["n_heads"], config["model"]["n_kv_heads"]) == (4, 2)  # GQA
    assert config["layout"] == {"tp": 1, "sp": 1, "pp": 1, "dp": 1} | {kind[:2]: 2}
    assert config["tokens_per_step"] == read_metrics(want)[0]["tokens_per_step"]  # one replica's batch


def test_tensor_parallel_rank_holds_its_heads_and_units(run):
    """Each TP rank holds the embedding and norms whole and half of every other weight (the output
    head by vocabulary rows): 60% of the tiny model, whose embedding is a fifth of it."""
    (mem,) = [r for r in read_metrics(run("tp2")) if r["event"] == "memory"]
    model = Transformer(ModelArgs(**read_metrics(run("tp2"))[0]["model"]))
    counts = {n: p.numel() for n, p in model.named_parameters()}
    whole = sum(n for name, n in counts.items() if "norm" in name or name.startswith("tok_embeddings"))
    split = model.num_params() - whole
    assert mem["params_per_rank"] == [whole + split // 2] * 2
    assert max(mem["params_per_rank"]) < 0.61 * model.num_params()
    assert mem["expected_model_state_bytes_per_rank"] == [16 * (whole + split // 2)] * 2  # ZeRO-1, dp 1


def test_pipeline_stage_holds_its_layers(run):
    """The stages split the parameters between them, about half each (the embedding and the head are
    balanced against the blocks they displace), and hold their gradients at the step."""
    (mem,) = [r for r in read_metrics(run("pp2")) if r["event"] == "memory"]
    (mem_ref,) = [r for r in read_metrics(run("zero0")) if r["event"] == "memory"]
    total = mem_ref["params_per_rank"][0]
    assert sum(mem["params_per_rank"]) == total
    assert max(mem["params_per_rank"]) < 0.51 * total
    assert [b["params_and_grads"] for b in mem["breakdown"]] == [8 * n for n in mem["params_per_rank"]]


@pytest.mark.parametrize("kind", ["tp2", "pp2"])
def test_resume_continues_the_same_curve(run, kind):
    """From the step-6 checkpoint: steps 7-12 with the straight run's losses, grad norms and LRs, bitwise."""
    straight, resumed = train(run(kind)), train(run(f"{kind}_resumed"))
    assert [r["step"] for r in resumed] == list(range(SAVED + 1, STEPS + 1))
    for key in ("loss", "grad_norm", "lr"):
        assert [r[key] for r in resumed] == [r[key] for r in straight[SAVED:]]


def hf_logits(path, tokens) -> torch.Tensor:
    with torch.no_grad():
        return AutoModelForCausalLM.from_pretrained(path).eval()(tokens).logits


@pytest.mark.parametrize("kind", ["tp2", "pp2"])
def test_export_gathers_the_whole_model(run, kind):
    """The in-run export (shards / stages gathered from the engine) predicts what ZeRO-0's does, and
    equals the checkpoint merged from its per-rank files (what scripts/export_hf.py exports)."""
    out = run(kind)
    tokens = torch.randint(0, PRESETS["tiny"].vocab_size, (2, 16))
    assert (hf_logits(out / "hf", tokens) - hf_logits(run("zero0") / "hf", tokens)).abs().max() < 1e-4
    hf = AutoModelForCausalLM.from_pretrained(out / "hf")
    exported = from_hf_state_dict(hf.state_dict(), from_hf_config(hf.config))
    merged, _ = consolidated_state_dict(str(out / "checkpoints" / f"step_{STEPS:08d}"))
    assert merged.keys() == exported.keys()
    assert all(torch.equal(merged[k], exported[k]) for k in merged)


def test_checkpoint_of_another_layout_is_refused(run):
    """A tensor-parallel checkpoint does not move to another layout (its files are per-TP-rank
    shards the neutral form does not read): the refusal names both layouts and the way out."""
    path = str(run("tp2") / "checkpoints" / f"step_{SAVED:08d}")
    state = verify_checkpoint(path)
    assert state["model_parallel"] == "tp2"
    same = {k: state[k] for k in ("model", "seed", "data_split", "model_parallel")} | {
        "layout": form_of(state)
    }
    now = {**form_of(state), "strategy": "deepspeed-zero1"}
    with pytest.raises(CheckpointError, match="model_parallel: checkpoint 'tp2', now None.*--init_from"):
        check_resumable(path, state, {**same, "model_parallel": None, "layout": now})
    check_resumable(path, state, same)  # the same layout: resumed, with its own loader
    assert continues_natively(form_of(state), same["layout"])


# --- every tool reads a model-parallel checkpoint through llama_train/checkpoint/formats.py, without unpickling code ---


def tool(script: str, *flags) -> subprocess.CompletedProcess:
    """scripts/SCRIPT run as a user would."""
    cmd = [sys.executable, f"scripts/{script}", *map(str, flags)]
    return subprocess.run(cmd, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=300)


def ok(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def test_eval_ppl_scores_the_blocks_of_a_model_parallel_runs_own_evaluation(run):
    """2 ranks holding one model replica (tp2; pp2 reads its data the same way) read one data-parallel
    share of the eval split: eval_ppl.py on the export scores those blocks (not two ranks' shares) and
    reproduces the trainer's final eval loss, saying it read 1 data-parallel rank's batches."""
    out = run("tp2")
    final = [r for r in read_metrics(out) if r["event"] == "eval"][-1]["eval_loss"]
    line = ok(tool("eval_ppl.py", "--model", out / "hf", "--device", "cpu")).strip().splitlines()[-1]
    assert abs(float(line.split("|")[0].split()[-1]) - final) <= 1e-4 * final, (final, line)
    assert "the trainer's final evaluation: 1 data-parallel rank(s) x 4 batches of 4): 512 tokens" in line, (
        line
    )


EVAL_TEXT = "The list of prime numbers begins with two, three, five and seven. " * 40


@pytest.mark.parametrize("kind", ["tp2", "pp2"])
def test_every_tool_reads_a_model_parallel_checkpoint(run, kind, shared_data, tmp_path):
    """scripts/export_hf.py, eval_ppl.py, generate.py and --init_from read the run's last checkpoint
    (per-TP-rank or per-layer files): the export is the in-run export tensor for tensor, eval and
    greedy generation give what that export gives, and a new run from it starts at its eval loss."""
    out = run(kind)
    ckpt, hf = out / "checkpoints" / f"step_{STEPS:08d}", out / "hf"
    ok(tool("export_hf.py", "--checkpoint", ckpt, "--output_dir", tmp_path / "hf"))
    ours, want = (AutoModelForCausalLM.from_pretrained(p).state_dict() for p in (tmp_path / "hf", hf))
    assert ours.keys() == want.keys() and all(torch.equal(ours[k], want[k]) for k in ours)

    model, tokenizer = AutoModelForCausalLM.from_pretrained(hf).eval(), load_tokenizer(hf)
    (tmp_path / "eval.txt").write_text(EVAL_TEXT)
    blocks = stream_blocks(tokenizer, [str(tmp_path / "eval.txt")], 16, 8)
    loss, _, _ = score_blocks(model, blocks, list(range(len(blocks))), 8, "cpu")
    flags = ("--split", "all", "--data_path", tmp_path / "eval.txt", "--max_seq_len", 16, "--max_batches", 1)
    assert ok(tool("eval_ppl.py", "--model", ckpt, *flags)).startswith(f"eval loss {loss:.4f} |")
    ids = tokenizer("The list", return_tensors="pt")
    greedy = model.generate(**ids, max_new_tokens=8, do_sample=False, pad_token_id=tokenizer.eos_token_id)
    text = ok(
        tool(
            "generate.py", "--model", ckpt, "--prompt", "The list", "--max_new_tokens", 8, "--temperature", 0
        )
    )
    assert text == f"> {tokenizer.decode(greedy[0], skip_special_tokens=True)}\n"

    flags = [*COMMON, "--max_steps", "1", "--no_export", "--init_from", str(ckpt)]
    proc = launch("train_ddp.py", flags, tmp_path / "run", shared_data, nproc=1)
    assert (
        f"initialised from checkpoint {ckpt} ({'tensor' if kind == 'tp2' else 'pipeline'} parallel)"
        in proc.stdout
    )
    first = next(r for r in read_metrics(tmp_path / "run") if r["event"] == "eval")
    last = [r for r in read_metrics(out) if r["event"] == "eval"][-1]  # one replica: the same eval blocks
    assert first["step"] == 0 and first["eval_loss"] == pytest.approx(last["eval_loss"], rel=1e-5)


class _Payload:
    """Unpickling this creates a file: what a malicious checkpoint would do with os.system."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def poisoned_copy(src, dst, victim: str, marker) -> str:
    """A copy of checkpoint `src` whose file `victim` also carries a pickled payload, its manifest
    entry rewritten to match (so only unpickling can stop it)."""
    shutil.copytree(src, dst)
    path = dst / victim
    state = torch.load(path, weights_only=True, map_location="cpu")
    torch.save({**state, "extra": _Payload(str(marker))}, path)
    trainer_state = json.loads((dst / "trainer_state.json").read_text())
    data = path.read_bytes()
    trainer_state["files"][victim] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (dst / "trainer_state.json").write_text(json.dumps(trainer_state))
    return str(dst)


@pytest.mark.parametrize(
    "kind, victim, entry",
    [
        ("tp2", "mp_rank_01_model_states.pt", "generate.py"),
        ("pp2", "layer_02-model_states.pt", "--init_from"),
    ],
)
def test_a_checkpoint_file_that_would_run_code_is_refused(run, kind, victim, entry, shared_data, tmp_path):
    """A tensor- or pipeline-parallel checkpoint file carrying a pickled call (here: creating a file)
    is refused with one `error:` line, and nothing in it runs: through the scripts' reader
    (weights.consolidated_state_dict, which export_hf.py, eval_ppl.py and generate.py call) and the
    trainers' (--init_from)."""
    marker = tmp_path / "pwned"
    ckpt = poisoned_copy(run(kind) / "checkpoints" / f"step_{SAVED:08d}", tmp_path / "ckpt", victim, marker)
    if entry == "--init_from":
        flags = [*COMMON, "--init_from", ckpt]
        proc = launch("train_ddp.py", flags, tmp_path / "run", shared_data, nproc=1, check=False)
    else:
        proc = tool(entry, "--model", ckpt)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert len(errors) == 1 and errors[0].startswith(f"error: refused to load {ckpt}/{victim}"), errors
    assert not marker.exists()


def test_features_not_combined_with_model_parallelism_are_refused():
    args = parse_args(build_parser("t", deepspeed=True), [*COMMON, "--compile", "--skip_loss_zscore", "3"])
    problems = feature_problems(Layout(2, pp=2), args)
    assert len(problems) == 2 and problems[0].startswith("--compile with pp2 is not supported")
    assert "pipeline parallel" in problems[1] and not feature_problems(Layout(2), args)


TINY_GQA = replace(PRESETS["tiny"], n_kv_heads=2)


def zero(stage: int, **extra) -> dict:
    return {"zero_optimization": {"stage": stage}, **extra}


@pytest.mark.parametrize(
    ("layout", "margs", "config", "message"),
    [
        (Layout(2, pp=2), TINY_GQA, zero(2), "pipeline parallel needs ZeRO stage 0 or 1, x.json has stage 2"),
        (Layout(4, tp=4), TINY_GQA, zero(1), "n_kv_heads=2 is not divisible by the tensor parallel size 4"),
        (Layout(2, tp=2), TINY_GQA, zero(3), "tensor parallel with ZeRO stage 3 (x.json) is not supported"),
        (Layout(3, tp=3), TINY_GQA, zero(1), "n_heads=4 is not divisible by the tensor parallel size 3"),
        (Layout(4, sp=4), TINY_GQA, zero(1), "n_kv_heads=2 is not divisible by the sequence parallel size 4"),
        (Layout(2, sp=2), replace(TINY_GQA, max_seq_len=33), zero(1), "--max_seq_len 33 is not divisible by"),
        (Layout(3, tp=2), TINY_GQA, zero(1), "world size 3 is not divisible by TP x SP x PP = 2 x 1 x 1"),
        (
            Layout(4, tp=2, pp=2),
            TINY_GQA,
            zero(1),
            "tensor parallel 2 and pipeline parallel 2 cannot be combined",
        ),
        (Layout(2, pp=2), replace(TINY_GQA, tie_embeddings=True), zero(0), "--tie_embeddings with pipeline"),
        (
            Layout(2, pp=2),
            TINY_GQA,
            zero(1, wall_clock_breakdown=True),
            '"wall_clock_breakdown": true in x.json',
        ),
    ],
)
def test_invalid_layouts_are_named(layout, margs, config, message):
    problems = layout_problems(layout, margs, config, "x.json")
    assert any(message in p for p in problems), problems


def test_valid_layouts_pass():
    for layout in (Layout(2, tp=2), Layout(4, sp=2), Layout(2, pp=2), Layout(8, tp=2)):
        assert layout_problems(layout, TINY_GQA, zero(1), "x.json") == []


def test_data_rank_follows_deepspeeds_pipeline_topology():
    """Layout.data_rank against DeepSpeed's own topology (the sampler is built before the engine)."""
    from deepspeed.runtime.pipe.topology import PipeDataParallelTopology

    for pp, dp in ((2, 1), (2, 3), (4, 2)):
        topo = PipeDataParallelTopology(num_pp=pp, num_dp=dp)
        layout = Layout(pp * dp, pp=pp)
        assert [layout.data_rank(r) for r in range(pp * dp)] == [
            topo.get_coord(r).data for r in range(pp * dp)
        ]


def test_invalid_layout_stops_before_any_work(tmp_path):
    """One process (no launcher): pipeline parallel over 1 rank under ZeRO-2 gives both reasons in one
    error and exit 2, before data, model or output directory exist."""
    out, flags = (
        tmp_path / "out",
        ["--pipeline_parallel_size", "2", "--deepspeed_config", "ds_configs/zero2.json"],
    )
    proc = launch("train_deepspeed.py", flags, out, tmp_path / "data", nproc=1, check=False)
    assert proc.returncode == 2, proc.stderr[-2000:]
    (line,) = [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]
    assert line == "error: invalid parallel layout:"
    assert "world size 1 is not divisible by TP x SP x PP = 1 x 1 x 2" in proc.stderr
    assert "ZeRO stage 0 or 1, ds_configs/zero2.json has stage 2" in proc.stderr
    assert "Traceback" not in proc.stderr and not out.exists() and not (tmp_path / "data").exists()
