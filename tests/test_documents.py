"""Documents in packed rows (--document_mask, --bos_aligned_rows) and bits per byte.

Unit tests first (the boundaries, the model's mask and its GPU block mask, BOS-aligned rows, bytes per
token, bits per byte by hand and across tokenizers), then runs of both trainers on a corpus of short
documents, launched once per module: DDP and ZeRO-0..3 and tensor parallel give the same curves under
the flag, each trainer's first loss is that of every document run alone, and the HF export scores a
document (and a packed row) as our model does."""

import json
import math
import subprocess
import sys
from dataclasses import replace
from pydoc_data.topics import topics

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import create_block_mask, create_mask, flex_attention
from torch.utils.data import DataLoader
from transformers import AutoModelForCausalLM, default_data_collator

from llama_train.config import build_parser, model_args, parse_args
from llama_train.distributed.parallel import plan_layout
from llama_train.errors import ConfigError, TokenizerError
from llama_train.hf import from_hf_config, from_hf_state_dict
from llama_train.model import PRESETS, ModelArgs, Transformer, apply_rotary_emb, document_ids, document_mask
from llama_train.train.engines.torch_engine import DDPEngine
from llama_train.train.evaluation import evaluate
from tests.trainer_utils import ROOT, assert_close_curves, env, launch, losses, read_metrics
from utils.data import (
    TextBytes,
    create_pretrain_dataset,
    document_datasets,
    document_positions,
    epoch_order,
    load_tokenizer,
    prepare_tokenizer,
    token_byte_lengths,
)
from utils.data.data_utils import PackedBlockDataset
from utils.data.documents import BosRowDataset, bos_row_starts

DEBUG = replace(PRESETS["debug"], max_seq_len=64)  # 4 query heads, 2 kv heads: the GQA path
EOS = 2


def units(positions: torch.Tensor) -> list[tuple[int, int]]:
    """[start, end) of each document of a row, from its position_ids."""
    starts = torch.nonzero(positions == 0).flatten().tolist() + [len(positions)]
    return list(zip(starts, starts[1:]))


# --- the boundaries and the model's mask ---


def test_positions_restart_at_the_row_start_and_after_each_eos():
    row = torch.tensor([7, 8, EOS, 5, 6, 9, EOS, EOS, 4])
    assert document_positions(row, EOS).tolist() == [0, 1, 0, 1, 2, 3, 0, 0, 1]
    batch = torch.stack([row, torch.tensor([EOS, 1, 1, 1, 1, 1, 1, 1, EOS])])
    assert document_positions(batch, EOS)[1].tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 0]
    assert document_ids(document_positions(batch, EOS))[0].tolist() == [1, 1, 2, 2, 2, 2, 3, 4, 4]


@pytest.mark.parametrize("flash", [True, False])
def test_a_packed_row_scores_each_document_as_if_alone(flash):
    """fp32: logits and per-document losses of a row of 5 documents (one of 1 token) equal each document
    run alone (1e-5); the training loss (chunked head) is their token mean; the rotary table of a
    document is the one it has alone."""
    torch.manual_seed(0)
    model = Transformer(replace(DEBUG, use_flash_attn=flash)).eval()
    docs = [torch.randint(3, 512, (n,)) for n in (9, 14, 1, 23, 17)]
    ids = torch.cat(docs)[None]
    positions = torch.cat([torch.arange(len(d)) for d in docs])[None]
    labels = torch.randint(3, 512, ids.shape)
    with torch.no_grad():
        packed = model(ids, position_ids=positions)
        alone = [model(d[None])[0] for d in docs]
    torch.testing.assert_close(packed[0], torch.cat(alone), rtol=0, atol=1e-5)
    for (a, b), logits in zip(units(positions[0]), alone):
        mine = F.cross_entropy(packed[0, a:b], labels[0, a:b])
        assert mine.item() == pytest.approx(F.cross_entropy(logits, labels[0, a:b]).item(), abs=1e-5)
    model.train()
    _, loss = model(ids, labels, position_ids=positions)
    want = F.cross_entropy(torch.cat(alone), labels[0])
    assert loss.item() == pytest.approx(want.item(), abs=1e-5)
    xq = torch.randn(1, ids.shape[1], 4, DEBUG.head_dim)
    rotated, _ = apply_rotary_emb(xq, xq, model.pos_cis[positions])
    a, b = units(positions[0])[3]
    assert torch.equal(rotated[:, a:b], apply_rotary_emb(xq[:, a:b], xq[:, a:b], model.pos_cis[: b - a])[0])


def test_without_boundaries_the_forward_is_the_plain_causal_one_bit_for_bit():
    """No position_ids (the flag off): the same operations as a causal forward written out here, so the
    numbers of runs without --document_mask are unchanged."""
    torch.manual_seed(0)
    model = Transformer(DEBUG).eval()
    ids = torch.randint(0, 512, (2, 40))
    with torch.no_grad():
        h, pos = model.tok_embeddings(ids), model.pos_cis[:40]
        for layer in model.layers:
            att, x = layer.attention, layer.attention_norm(h)
            q, k, v = (w(x).view(2, 40, -1, DEBUG.head_dim) for w in (att.wq, att.wk, att.wv))
            q, k = apply_rotary_emb(q, k, pos)
            q, k, v = (t.transpose(1, 2) for t in (q, k, v))
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            h = h + att.wo(o.transpose(1, 2).reshape(2, 40, -1))
            h = h + layer.feed_forward(layer.ffn_norm(h))
        want = model.output(model.norm(h)).float()
        assert torch.equal(model(ids), want)


def test_the_gpu_block_mask_allows_exactly_what_the_cpu_mask_allows():
    """The BlockMask the CUDA path builds (document_mask(fused=True)), read back densely on CPU, is the
    boolean mask SDPA gets on CPU; flex_attention over it (unfused on CPU) gives SDPA's output."""
    positions = torch.tensor([[0, 1, 2, 0, 1, 0, 0, 1, 2, 3, 4, 0, 1, 2, 3, 4], list(range(16))])
    dense = document_mask(positions, fused=False)
    block = document_mask(positions, fused=True)
    assert torch.equal(create_mask(block.mask_mod, 2, 1, 16, 16, device="cpu"), dense)
    assert dense[0, 0, 4].tolist() == [False] * 3 + [True, True] + [False] * 11  # its document, causally
    q, k, v = torch.randn(2, 4, 16, 8), torch.randn(2, 2, 16, 8), torch.randn(2, 2, 16, 8)
    with pytest.warns(UserWarning, match="without torch.compile"):
        flex = flex_attention(q, k, v, block_mask=block, enable_gqa=True)
    torch.testing.assert_close(
        flex, F.scaled_dot_product_attention(q, k, v, attn_mask=dense, enable_gqa=True)
    )


def rows_of(*docs_per_row: list[int]) -> torch.Tensor:
    """Position ids (B, T) of rows packed with documents of the given lengths."""
    return torch.stack([torch.cat([torch.arange(n) for n in docs]) for docs in docs_per_row])


def full_blocks(mask) -> torch.Tensor:
    """The (B, H, Q blocks, KV blocks) blocks a BlockMask holds as full (attended whole, no mask_mod)."""
    idx, n = mask.full_kv_indices.long(), mask.full_kv_num_blocks
    valid = (torch.arange(idx.shape[-1]) < n[..., None]).int()
    return torch.zeros(idx.shape, dtype=torch.int).scatter_add_(-1, idx, valid) > 0


MASK_MEMORY = """
import resource, torch
from llama_train.model import document_mask
B, T = 4, 4096
pos = torch.arange(T).repeat(B, 1)
pos[:, T // 2 :] -= T // 2  # two documents a row
document_mask(pos[:, :256], fused=True)  # the code path's own first-call allocations
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
document_mask(pos, fused=True)
print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) // 1024)
"""


def test_the_gpu_document_mask_is_built_per_block_not_on_the_token_grid():
    """The BlockMask of the CUDA path (document_mask(fused=True)) is built from each 128-token block's
    documents, not by evaluating the mask on every (row, query, key) element as uncompiled
    create_block_mask does at every forward (+713 MiB at B=4, T=4096; ~5.5 GiB at B=8, T=8192): the
    same partial and full blocks as create_block_mask's (documents within and across blocks, a row
    shorter than a block, one that ends inside a block), and at B=4, T=4096 its peak memory grows by
    less than 64 MiB."""
    layouts = [
        rows_of([100, 200, 84], [384]),
        rows_of([300]),
        rows_of([20, 12]),
        rows_of([7] * 73 + [1], [128, 128, 129, 127]),
    ]
    for positions in layouts:
        B, T = positions.shape
        doc = document_ids(positions)
        ours = document_mask(positions, fused=True)
        want = create_block_mask(
            lambda b, h, q, kv, doc=doc: (doc[b, q] == doc[b, kv]) & (kv <= q), B, None, T, T, "cpu"
        )
        assert torch.equal(ours.to_dense(), want.to_dense()), (B, T)
        assert torch.equal(full_blocks(ours), full_blocks(want)), (B, T)
        assert torch.equal(
            create_mask(ours.mask_mod, B, 1, T, T, device="cpu"), document_mask(positions, False)
        )
    grown = subprocess.run(
        [sys.executable, "-c", MASK_MEMORY], cwd=ROOT, env=env(), capture_output=True, text=True
    )
    assert grown.returncode == 0 and int(grown.stdout) < 64, grown.stdout + grown.stderr[-2000:]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_document_mask_runs_the_fused_flex_kernel_and_matches_the_dense_mask():
    model = Transformer(replace(DEBUG)).cuda().to(torch.bfloat16)  # its own args: changed below
    ids = torch.randint(3, 512, (2, 64), device="cuda")
    positions = document_positions(torch.where(ids % 7 == 0, EOS, ids), EOS)
    mask = document_mask(positions, fused=True)
    assert type(mask).__name__ == "BlockMask"
    with torch.no_grad():
        fused = model(ids, position_ids=positions)
        model.args.use_flash_attn = False  # the explicit-math path with the dense mask
        for layer in model.layers:
            layer.attention.core.use_flash_attn = False
        dense = model(ids, position_ids=positions)
    torch.testing.assert_close(fused, dense, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("kind", ["sequence", "pipeline"])
def test_sequence_and_pipeline_parallel_refuse_the_mask_before_any_work(kind):
    args = parse_args(build_parser("t", deepspeed=True), ["--document_mask", f"--{kind}_parallel_size", "2"])
    with pytest.raises(ConfigError, match=f"--document_mask with {kind} parallel is not supported"):
        plan_layout(args, model_args(args), 2, {"zero_optimization": {"stage": 1}})
    with pytest.raises(ConfigError, match="--bos_aligned_rows needs --document_mask"):
        parse_args(build_parser("t"), ["--bos_aligned_rows"])


# --- BOS-aligned rows ---


def stream(tmp_path, tokens: list[int], max_seq_len: int) -> PackedBlockDataset:
    path = tmp_path / "train.bin"
    np.asarray(tokens, dtype=np.uint16).tofile(path)
    return PackedBlockDataset(path, len(tokens), "uint16", max_seq_len)


def test_bos_aligned_rows_start_at_documents_and_leave_out_the_cut_rest(tmp_path):
    """Documents a(3) b(1) c(6) d(2) e(4), each followed by EOS; rows of BOS + 4 stream tokens. Row 1 is
    a + EOS; row 2 starts at b and cuts c; c's rest is left out and row 3 starts at d; e has too few
    tokens after it for a row."""
    a, b, c, d, e = [10, 11, 12], [20], [30, 31, 32, 33, 34, 35], [40, 41], [50, 51, 52, 53]
    tokens = [t for doc in (a, b, c, d, e) for t in (*doc, EOS)]
    blocks = stream(tmp_path, tokens, 4)
    starts = bos_row_starts(blocks.tokens, EOS, 4)
    assert starts.tolist() == [0, 4, 13]
    np.save(tmp_path / "rows.npy", starts)
    rows = BosRowDataset(blocks, tmp_path / "rows.npy", bos_id=1)
    got = [torch.cat([r["input_ids"], r["labels"][-1:]]).tolist() for r in rows]
    assert got == [[1, *a, EOS], [1, *b, EOS, 30, 31], [1, *d, EOS, 50]]
    assert document_positions(rows[1]["input_ids"], EOS).tolist() == [0, 1, 0, 1]


def test_bos_aligned_rows_need_a_tokenizer_with_bos(tmp_path, tokenizer):
    tok = tokenizer(512)
    tok.bos_token = None
    blocks = stream(tmp_path, [5, 6, EOS] * 20, 4)
    with pytest.raises(TokenizerError, match="has no BOS token to start each row with"):
        document_datasets((blocks, blocks), tok, True, tmp_path, -1, 0)


# --- bits per byte ---


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("cache")


@pytest.fixture(scope="module")
def topics_txt(tmp_path_factory):
    """pydoc's topic texts (0.7 MB of English) as one .txt source."""
    path = tmp_path_factory.mktemp("text") / "topics.txt"
    path.write_text("\n\n".join(topics[k] for k in sorted(topics)), encoding="utf-8")
    return str(path)


@pytest.fixture
def tokenizer(cache, topics_txt):
    """vocab -> a fresh tokenizer object of that many tokens trained on topics_txt (trained once, cached)."""
    return lambda vocab: prepare_tokenizer(None, [topics_txt], vocab, cache, -1)


class Eval:
    """What evaluate() reads of a build.Data."""

    def __init__(self, items, tokenizer):
        self.eval_loader = DataLoader(items, 16, collate_fn=default_data_collator)
        self.text_bytes = TextBytes(tokenizer)


def test_bits_per_byte_does_not_count_sentencepieces_dummy_prefix_as_a_byte(tokenizer):
    """A model whose logits are all 0 puts ln V nats on every token; the bytes are the text's UTF-8
    bytes counted by hand: EOS is none, and the "▁" SentencePiece puts before each document's first
    piece (its dummy prefix: the decoder drops it) is no character of the text. Two documents in a row:
    bpb = tokens x log2 V / (23 + 11) bytes, not / (24 + 12)."""
    tok = tokenizer(512)
    texts = ["héllo wörld 😀 1234", "Hello world"]  # é and ö take 2 bytes, 😀 4: 23 bytes; 11 bytes
    docs = [tok(t, add_special_tokens=False)["input_ids"] + [tok.eos_token_id] for t in texts]
    assert [tok.decode(d, skip_special_tokens=True) for d in docs] == texts
    assert token_byte_lengths(tok)[docs[0]].sum() == 24  # the first piece's "▁" counted as a space
    ids = docs[0] + docs[1]
    model = Transformer(replace(DEBUG, vocab_size=512))
    torch.nn.init.zeros_(model.output.weight)
    item = {"input_ids": torch.tensor([tok.eos_token_id, *ids[:-1]]), "labels": torch.tensor(ids)}
    engine = DDPEngine(model, None, None, torch.device("cpu"), "float32", 0.0)  # the bare model
    loss, ppl, bpb = evaluate(engine, Eval([item], tok), torch.device("cpu"), -1)
    assert loss == pytest.approx(math.log(512)) and ppl == pytest.approx(512)
    assert bpb == pytest.approx(len(ids) * math.log2(512) / (23 + 11), rel=1e-6)


def train_tiny(tok, source: str, cache, text_bytes: int = 200_000) -> tuple[float, float, float]:
    """A debug-size model trained on `text_bytes` bytes of `source` (batches of 16 x 64 tokens, however
    many that takes with this tokenizer); its (loss, ppl, bpb) on the whole eval split: the same
    documents whatever the tokenizer."""
    train, held_out = create_pretrain_dataset(-1, [source], "95,5", cache, 1234, tok, 64)
    token_bytes = token_byte_lengths(tok)
    torch.manual_seed(0)
    model = Transformer(replace(DEBUG, vocab_size=len(tok)))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    order, seen = iter(epoch_order(len(train), 0, 0).tolist()), 0
    while seen < text_bytes:
        batch = default_data_collator([train[next(order)] for _ in range(16)])
        seen += int(token_bytes[batch["labels"]].sum())
        model(**batch)[1].backward()
        opt.step()
        opt.zero_grad()
    engine = DDPEngine(model, None, None, torch.device("cpu"), "float32", 0.0)
    return evaluate(engine, Eval(held_out, tok), torch.device("cpu"), -1)


def test_two_vocab_sizes_give_comparable_bits_per_byte_where_perplexities_are_not(
    tokenizer, topics_txt, cache
):
    """The same text, tokenizers of 512 and 2048 tokens, each model trained on the same 200 kB: a
    2048-vocab token carries more bytes, so its perplexity is several times the 512-vocab model's
    (4.8x: 32 vs 229 when measured), while their bits per byte are within 30% (2.74 vs 2.31)."""
    small, large = (train_tiny(tokenizer(v), topics_txt, cache) for v in (512, 2048))
    assert large[1] / small[1] > 4
    assert max(large[2], small[2]) / min(large[2], small[2]) < 1.3


# --- both trainers under --document_mask, on short documents (runs shared by the tests below) ---

STEPS = 4
RUNS = {  # name -> (launcher, ranks, flags): global batch 8 everywhere but `bos` (4, one process)
    "ddp": ("ddp", 2, []),
    **{f"zero{i}": ("deepspeed", 2, [f"--deepspeed_config=ds_configs/zero{i}.json"]) for i in range(4)},
    "tp2": ("deepspeed", 2, ["--deepspeed_config=ds_configs/tp2_zero1.json", "--accumulation_steps", "2"]),
    "bos": ("train_deepspeed.py", 1, ["--deepspeed_config=ds_configs/zero0.json", "--bos_aligned_rows"]),
}


@pytest.fixture(scope="module")
def short_docs(tmp_path_factory):
    """400 documents of 20-80 characters (pydoc paragraphs cut short): a row of 32 tokens holds 2-5 of
    them, so most attention a row would allow crosses a document boundary."""
    paragraphs = [p.strip() for k in sorted(topics) for p in topics[k].split("\n\n") if len(p.strip()) > 80]
    docs = [p[: 20 + (i * 37) % 61].strip() for i, p in enumerate(paragraphs[:400])]
    path = tmp_path_factory.mktemp("short") / "short.jsonl"
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    return path


@pytest.fixture(scope="module")
def runs(tmp_path_factory, short_docs, deepspeed_ops):
    """name -> output_dir of a --document_mask run of RUNS, launched on first use."""
    data, done = tmp_path_factory.mktemp("data"), {}

    def get(name: str):
        if name not in done:
            kind, nproc, extra = RUNS[name]
            flags = ["--data_path", str(short_docs), "--data_split", "90,10", "--max_steps", str(STEPS)]
            out = tmp_path_factory.mktemp(name)
            launch(kind, [*flags, "--document_mask", "--eval_batches", "2", *extra], out, data, nproc=nproc)
            done[name] = (out, data)
        return done[name]

    return get


def run_datasets(out, data, corpus, bos: bool = False):
    """(train, eval) as the run read them, and its tokenizer."""
    tok = load_tokenizer(out / "tokenizer")
    pair = create_pretrain_dataset(-1, [str(corpus)], "90,10", data, 1234, tok, 32)
    return document_datasets(pair, tok, bos, data, -1, 1234), tok


def alone_loss(model, rows: list[dict]) -> float:
    """The token-mean loss of every document of `rows` run on its own (no mask, no positions)."""
    total, count = 0.0, 0
    with torch.no_grad():
        for row in rows:
            for a, b in units(row["position_ids"]):
                logits = model(row["input_ids"][None, a:b])[0]
                total += F.cross_entropy(logits, row["labels"][a:b], reduction="sum").item()
                count += b - a
    return total / count


@pytest.mark.parametrize("name", ["ddp", "zero2", "bos"])
def test_each_trainers_first_loss_is_every_document_alone(runs, short_docs, name):
    """The first logged loss (the initial weights: seed 1234) is the token mean of every document of
    the step's rows scored alone, to 1e-5: in DDP, in ZeRO-2 and with BOS-aligned rows (DeepSpeed)."""
    out, data = runs(name)
    (train, _), tok = run_datasets(out, data, short_docs, bos=name == "bos")
    config = read_metrics(out)[0]
    torch.manual_seed(1234)
    model = Transformer(ModelArgs(**config["model"]))
    batch = config["tokens_per_step"] // 32
    rows = [train[int(i)] for i in epoch_order(len(train), 1234, 0)[:batch]]
    assert sum(len(units(r["position_ids"])) for r in rows) > batch  # documents begin inside the rows
    if name == "bos":
        assert all(r["input_ids"][0] == tok.bos_token_id for r in rows)
    first = [r for r in read_metrics(out) if r["event"] == "train"][0]["loss"]
    assert first == pytest.approx(alone_loss(model, rows), rel=1e-5)


@pytest.mark.parametrize("name", ["zero0", "zero1", "zero2", "zero3", "tp2"])
def test_zero_stages_and_tensor_parallel_give_ddps_curve_under_the_mask(runs, name):
    """The same per-step losses; the ZeRO runs also the same eval loss and bits per byte (tp2 is one
    data-parallel replica: its evaluation reads other blocks)."""
    assert_close_curves(losses(runs(name)[0]), losses(runs("ddp")[0]))
    if name != "tp2":
        evals = [[r for r in read_metrics(runs(n)[0]) if r["event"] == "eval"][-1] for n in (name, "ddp")]
        for key in ("eval_loss", "eval_bpb"):
            assert evals[0][key] == pytest.approx(evals[1][key], rel=1e-4)


def test_the_hf_export_scores_a_document_and_a_packed_row_as_our_model(runs, short_docs):
    """The export of a --document_mask run, in transformers: our logits on one document (from its
    EOS on), and on a packed eval row given its position_ids (transformers then masks documents too)."""
    out, data = runs("ddp")
    (_, held_out), _ = run_datasets(out, data, short_docs)
    hf = AutoModelForCausalLM.from_pretrained(out / "hf").eval()
    args = from_hf_config(hf.config)
    ours = Transformer(args).eval()
    ours.load_state_dict(from_hf_state_dict(hf.state_dict(), args))
    row = held_out[0]
    a, b = units(row["position_ids"])[1]
    doc, pos = row["input_ids"][None], row["position_ids"][None]
    with torch.no_grad():
        torch.testing.assert_close(hf(doc[:, a:b]).logits, ours(doc[:, a:b]), rtol=0, atol=1e-4)
        packed = hf(doc, position_ids=pos, use_cache=False).logits  # a cache turns transformers' packing off
        torch.testing.assert_close(packed, ours(doc, position_ids=pos), rtol=0, atol=1e-4)
        assert (hf(doc).logits - ours(doc, position_ids=pos)).abs().max() > 1e-2  # the mask matters


def test_eval_ppl_reproduces_the_masked_eval_loss_and_bpb(runs):
    out, _ = runs("ddp")
    proc = subprocess.run(
        [sys.executable, "scripts/eval_ppl.py", "--model", str(out / "hf"), "--device", "cpu"],
        cwd=ROOT, env=env(), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    ev = [r for r in read_metrics(out) if r["event"] == "eval"][-1]
    fields = dict(part.strip().rsplit(" ", 1) for part in proc.stdout.strip().splitlines()[-1].split("|")[:3])
    assert float(fields["eval loss"]) == pytest.approx(ev["eval_loss"], abs=1e-4)
    assert float(fields["bits per byte"]) == pytest.approx(ev["eval_bpb"], abs=1e-4)


def test_bos_aligned_rows_with_a_tokenizer_without_bos_is_one_error_line(runs, tmp_path):
    out, data = runs("ddp")
    tok = load_tokenizer(out / "tokenizer")
    tok.bos_token = None
    tok.save_pretrained(tmp_path / "no_bos")
    flags = f"--tokenizer {tmp_path / 'no_bos'} --document_mask --bos_aligned_rows --max_steps 1".split()
    proc = launch("train_ddp.py", flags, tmp_path / "run", data, nproc=1, check=False)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert len(errors) == 1 and "has no BOS token to start each row with" in errors[0], errors
