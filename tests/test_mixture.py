"""Weighted data mixtures (issue 17): `--data_path 0.7 A 0.3 B` draws 70% / 30% of the blocks from
A / B, deterministically from the seed, with the weights in the cache key; a source too small for
its weight is upsampled with a warning; a zero or negative weight is an error."""

import json

import numpy as np
import pytest

from llama_train.errors import DataSourceError
from utils.data.data_utils import create_pretrain_dataset
from utils.data.mixture import blend_index, mixture_report, slot_counts
from utils.data.sources import parse_mixture
from utils.data.tokenizer import load_tokenizer, train_tokenizer

WORDS = "the quick brown fox jumps over a lazy dog while seven wizards quietly hex jolly bakers".split()


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """Two sources that share no character but the space: prose (letters) and numbers (digits), so
    a block's source is visible in its tokens."""
    d = tmp_path_factory.mktemp("mixture")
    rng = np.random.default_rng(0)
    prose = [" ".join(rng.choice(WORDS, 60)) for _ in range(400)]
    numbers = [" ".join(map(str, rng.integers(0, 10, 60))) for _ in range(100)]
    for name, docs in (("prose", prose), ("numbers", numbers)):
        (d / f"{name}.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in docs))
    train_tokenizer([str(d / "prose.jsonl"), str(d / "numbers.jsonl")], 300, d / "tok")
    return d, load_tokenizer(d / "tok")


def build(corpus, *weighted, seed=7):
    d, tok = corpus
    spec = [str(d / w) if w.endswith(".jsonl") else w for w in weighted]
    return create_pretrain_dataset(-1, spec, "90,10", d / "cache", seed, tok, 32)


def numbers_share(dataset, tok) -> float:
    """Share of blocks made of digits, read from the items themselves."""
    digit_ids = {
        i
        for i, piece in enumerate(tok.convert_ids_to_tokens(range(len(tok))))
        if any(c.isdigit() for c in piece)
    }
    is_numbers = [bool(digit_ids & set(dataset[i]["input_ids"].tolist())) for i in range(len(dataset))]
    return sum(is_numbers) / len(is_numbers)


def test_measured_shares_follow_the_weights(corpus):
    train, held_out = build(corpus, "0.7", "prose.jsonl", "0.3", "numbers.jsonl")
    tok = corpus[1]
    assert abs(numbers_share(train, tok) - 0.3) <= 0.01
    assert abs(numbers_share(held_out, tok) - 0.3) <= 0.01  # the eval split is the same mixture
    d = corpus[0]
    assert (
        mixture_report(train, len(train))[0] == f"data mix: {d}/prose.jsonl 70.0% / {d}/numbers.jsonl 30.0%"
    )


def test_same_seed_same_blocks_other_seed_other_order(corpus):
    a, _ = build(corpus, "0.7", "prose.jsonl", "0.3", "numbers.jsonl")
    b, _ = build(corpus, "0.7", "prose.jsonl", "0.3", "numbers.jsonl")
    c, _ = build(corpus, "0.7", "prose.jsonl", "0.3", "numbers.jsonl", seed=8)
    items = lambda ds: [ds[i]["input_ids"].tolist() for i in range(0, len(ds), 7)]  # noqa: E731
    assert items(a) == items(b)
    assert items(a) != items(c)


def test_weights_are_in_the_cache_key_and_components_are_reused(corpus):
    d = corpus[0]
    build(corpus, "0.7", "prose.jsonl", "0.3", "numbers.jsonl")
    before = {p.name for p in (d / "cache").iterdir() if p.is_dir()}
    build(corpus, "0.5", "prose.jsonl", "0.5", "numbers.jsonl")
    new = {p.name for p in (d / "cache").iterdir() if p.is_dir()} - before
    assert len(new) == 1 and new.pop().startswith("mixture-")  # a new index; no source tokenized again


def test_a_small_source_is_upsampled_with_a_warning(corpus):
    train, _ = build(corpus, "0.5", "prose.jsonl", "0.5", "numbers.jsonl")
    small = train.datasets[1]
    planned = 2 * len(train)
    lines = mixture_report(train, planned)
    epochs = 0.5 * planned / len(small)
    assert epochs > 1 and len(lines) == 2  # the larger source, downsampled, gets no warning
    assert "numbers.jsonl is 50.0%" in lines[1] and f"see it {epochs:.1f} times" in lines[1]
    comp, block = blend_index([len(d) for d in train.datasets], [0.5, 0.5], 7)
    assert np.bincount(block[comp == 1]).min() >= 1  # every block of the small source is used


def test_slot_counts_are_exact():
    assert slot_counts([0.7, 0.3], 10) == [7, 3]
    assert sum(slot_counts([1 / 3, 1 / 3, 1 / 3], 100)) == 100


@pytest.mark.parametrize(
    "spec, message",
    [
        (["0", "builtin", "1", "x.jsonl"], "weight 0 for builtin: mixture weights must be positive"),
        (["-0.5", "builtin", "1", "x.jsonl"], "weight -0.5 for builtin"),
        (["0.5", "builtin", "0.5"], "WEIGHT SOURCE pairs"),
        (["0.5", "builtin", "x.jsonl", "0.5"], "WEIGHT SOURCE pairs"),
        (["0.5", "builtin", "0.5", "builtin"], "appears twice"),
    ],
)
def test_bad_weights_are_refused(spec, message):
    with pytest.raises(DataSourceError, match=message):
        parse_mixture(spec)


def test_plain_paths_keep_their_meaning():
    assert parse_mixture(["builtin", "data/"]) is None
    assert parse_mixture(["3", "builtin", "1", "more"]) == [(0.75, "builtin"), (0.25, "more")]
