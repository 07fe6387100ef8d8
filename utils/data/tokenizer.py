"""Train, save and load a LLaMA-style sentencepiece tokenizer that transformers loads too.

The model is BPE with byte fallback (no <unk> in practice: unseen characters become UTF-8 byte
tokens), digits split one per token, no text normalization, ids 0/1/2 = <unk>/<s>/</s>, as
LLaMA's. A tokenizer directory holds `tokenizer.model` (sentencepiece, what our data workers
use) beside `tokenizer.json` + `tokenizer_config.json` (what `AutoTokenizer` reads; class
LlamaTokenizer).

    python scripts/train_tokenizer.py --data_path builtin --vocab_size 8192 --output_dir tok/

Data workers encode with sentencepiece itself (fast, and picklable as model bytes) but must give
the ids the transformers tokenizer gives; `encoder_spec` checks that on a probe text. Like
`split_special_tokens=True` in transformers, literal "<s>"/"</s>" in text stay text.
"""

import hashlib
import io
import logging
import os
import re
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import sentencepiece as spm
from tqdm.auto import tqdm

from llama_train.errors import TokenizerError, TokenizerNotFoundError, VocabSizeError
from utils.data.cache import build_once, sha256_json
from utils.data.sources import Source, iter_documents, resolve_sources

logger = logging.getLogger(__name__)

TOKENIZER_FORMAT_VERSION = 1  # bump when training options change what a cached tokenizer holds
DEFAULT_VOCAB_SIZE = 8192
# Text fed to the trainer. BPE training time and memory grow with it; 20M characters train an
# 8192 vocab in seconds and cover the statistics of English well enough for experiments.
DEFAULT_MAX_TRAIN_CHARS = 20_000_000
MAX_PIECE_CHARS = 4096  # longer lines are cut: sentencepiece skips sentences above max_sentence_length

SPECIAL_TOKENS = {"<unk>": 0, "<s>": 1, "</s>": 2}

# LLaMA's trainer spec, minus what only matters at 32k-vocab, billion-sentence scale.
# Fixed, not the machine's core count: sentencepiece's BPE result depends on its thread count, so the
# same text must be trained with the same count for every machine to get the same tokenizer (and the
# same losses after it). 8 costs a 2-core machine nothing measurable (~20 s for the builtin corpus).
TRAIN_THREADS = 8

SPM_OPTIONS = dict(
    model_type="bpe",
    byte_fallback=True,  # every string is encodable; no <unk> for emoji, CJK, stray bytes
    split_digits=True,  # "2024" -> 2 0 2 4: numbers get consistent pieces
    normalization_rule_name="identity",  # keep text as is (transformers' LLaMA tokenizer has no normalizer)
    remove_extra_whitespaces=False,  # runs of spaces are content (code, tables)
    add_dummy_prefix=True,  # "▁word" at the start of a text as inside it
    allow_whitespace_only_pieces=True,
    character_coverage=0.99995,  # rarer characters go to byte fallback
    max_sentence_length=4 * MAX_PIECE_CHARS,  # bytes; 4 per character at most in UTF-8
    unk_id=SPECIAL_TOKENS["<unk>"],
    bos_id=SPECIAL_TOKENS["<s>"],
    eos_id=SPECIAL_TOKENS["</s>"],
    pad_id=-1,
    minloglevel=2,  # errors only: our progress bar says what is happening
)


# ---------------------------------------------------------------------------------------------
# training


def _training_lines(sources: list[Source], max_chars: int) -> Iterator[str]:
    """Non-empty lines of the documents, cut to MAX_PIECE_CHARS, until `max_chars` characters.

    Lines, not documents: sentencepiece learns pieces within a sentence, and newlines are left
    to byte fallback (<0x0A>), as in LLaMA's vocab."""
    budget = max_chars
    # disable=None: no bar in a log file; the total is a cap, so the bar ends at what was read
    bar = tqdm(
        total=max_chars, unit="char", unit_scale=True, desc="tokenizer text", mininterval=1.0, disable=None
    )
    with bar:
        yield from _lines_until(iter_documents(sources), budget, bar)
        bar.total = bar.n  # a corpus smaller than --max_chars: 100%, not 11%
        bar.refresh()


def _lines_until(documents, budget: int, bar) -> Iterator[str]:
    for doc in documents:
        for line in doc.split("\n"):
            for start in range(0, len(line), MAX_PIECE_CHARS):
                piece = line[start : start + MAX_PIECE_CHARS]
                if not piece.strip():
                    continue
                yield piece
                budget -= len(piece)
                bar.update(len(piece))
                if budget <= 0:
                    return


def train_sentencepiece(
    data_path: str | list[str], vocab_size: int, max_chars: int = DEFAULT_MAX_TRAIN_CHARS
) -> bytes:
    """Train a BPE sentencepiece model on the first `max_chars` characters of `data_path`.

    Returns the serialized model. Training reads sources in order, so with several sources and
    a small budget the first ones dominate."""
    return _train_on_sources(resolve_sources(data_path), vocab_size, max_chars)


def _vocab_error(e: RuntimeError, vocab_size: int, sources: list[Source]) -> VocabSizeError:
    """sentencepiece's two failures, told apart: a vocabulary smaller than the characters the text
    needs (raise --vocab_size), or too little text for the vocabulary (lower it, or more text)."""
    needed = re.search(r"smaller than required_chars\. \d+ vs (\d+)", str(e))
    if needed:
        return VocabSizeError(
            f"--vocab_size {vocab_size} is too small for this text: sentencepiece needs at least "
            f"{needed.group(1)} (a piece for every character it keeps, and the special tokens); raise --vocab_size"
        )
    return VocabSizeError(
        f"sentencepiece could not train a {vocab_size}-token vocabulary on {', '.join(s.name for s in sources)}: "
        f"{e}. Lower --vocab_size or give more text."
    )


def _train_on_sources(sources: list[Source], vocab_size: int, max_chars: int) -> bytes:
    min_vocab = len(SPECIAL_TOKENS) + 256 + 1  # specials, 256 byte tokens, at least one piece
    if vocab_size < min_vocab:
        raise VocabSizeError(
            f"--vocab_size must be at least {min_vocab} (3 special + 256 byte tokens), got {vocab_size}"
        )
    model = io.BytesIO()
    source_errors: list[Exception] = []

    def lines() -> Iterator[str]:
        # sentencepiece turns an exception raised in its input into a generic RuntimeError;
        # keep the original (e.g. "data.jsonl:3: invalid JSON") to re-raise it as is
        try:
            yield from _training_lines(sources, max_chars)
        except Exception as e:
            source_errors.append(e)
            raise

    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=lines(),
            model_writer=model,
            vocab_size=vocab_size,
            num_threads=TRAIN_THREADS,
            **SPM_OPTIONS,
        )
    except RuntimeError as e:
        if source_errors:
            raise source_errors[0] from None
        raise _vocab_error(e, vocab_size, sources) from e
    return model.getvalue()


def save_sentencepiece(model: bytes, output_dir: str | os.PathLike) -> Path:
    """Write `model` as a tokenizer directory: tokenizer.model + transformers' files."""
    from transformers import LlamaTokenizer  # transformers is slow to import; only here and in load

    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "tokenizer.model").write_bytes(model)
    # transformers converts the sentencepiece model to its BPE tokenizer.json (same ids; tested).
    # No BOS is added: our pretraining stream has none (documents are separated by EOS only).
    tok = LlamaTokenizer.from_pretrained(out, vocab_file=str(out / "tokenizer.model"), add_bos_token=False)
    tok.save_pretrained(out)
    return out


def train_tokenizer(
    data_path: str | list[str],
    vocab_size: int,
    output_dir: str | os.PathLike,
    max_chars: int = DEFAULT_MAX_TRAIN_CHARS,
) -> Path:
    """Train on `data_path` and save a tokenizer directory at `output_dir`; returns its path."""
    return save_sentencepiece(train_sentencepiece(data_path, vocab_size, max_chars), output_dir)


# ---------------------------------------------------------------------------------------------
# loading and identity


def load_tokenizer(path: str | os.PathLike):
    """A transformers tokenizer from a tokenizer directory or a sentencepiece `.model` file.

    Local paths only: nothing is downloaded."""
    from transformers import AutoTokenizer, LlamaTokenizer

    path = Path(path).expanduser()
    if path.is_dir():
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    if path.is_file() and path.suffix == ".model":
        # transformers wants a directory; the model file itself is passed as vocab_file, which
        # also tells `sentencepiece_model_path` where to find it later.
        with tempfile.TemporaryDirectory() as empty:
            tok = LlamaTokenizer.from_pretrained(empty, vocab_file=str(path), add_bos_token=False)
        tok.name_or_path = str(path)
        return tok
    if path.is_file():
        raise TokenizerError(
            f"{path}: not a tokenizer: give a tokenizer directory or a sentencepiece .model file"
        )
    raise TokenizerNotFoundError(
        f"{path}: no such tokenizer directory or .model file "
        "(train one with scripts/train_tokenizer.py; hub names are not downloaded)"
    )


def save_tokenizer(tokenizer, output_dir: str | os.PathLike) -> Path:
    """`tokenizer.save_pretrained(output_dir)` plus its sentencepiece model, when it has one, so
    `load_tokenizer(output_dir)` keeps the sentencepiece fast path."""
    out = Path(output_dir)
    tokenizer.save_pretrained(out)
    model = sentencepiece_model_path(tokenizer)
    if model is not None and model.resolve() != (out / "tokenizer.model").resolve():
        (out / "tokenizer.model").write_bytes(model.read_bytes())
    return out


def sentencepiece_model_path(tokenizer) -> Path | None:
    """The sentencepiece model file a transformers tokenizer was loaded from, if any."""
    vocab_file = tokenizer.init_kwargs.get("vocab_file") or getattr(tokenizer, "vocab_file", None)
    if vocab_file and str(vocab_file).endswith(".model") and Path(vocab_file).is_file():
        return Path(vocab_file)
    return None


def check_vocab(tokenizer, model_vocab_size: int) -> None:
    """Raise VocabSizeError if the tokenizer has ids the model's embedding cannot hold."""
    n = len(tokenizer)
    if n > model_vocab_size:
        raise VocabSizeError(
            f"the tokenizer has {n} tokens but the model's embedding has {model_vocab_size} rows: "
            f"pass --vocab_size {n} (or more), or a tokenizer with at most {model_vocab_size} tokens"
        )


# ---------------------------------------------------------------------------------------------
# the encoder data workers use, and the tokenizer's identity for cache keys

# Covers what differs between tokenizer implementations: runs of spaces, tabs, newlines, digits,
# byte fallback (emoji, CJK) and special-token text. Documents are stripped, so no leading space.
PROBE_TEXT = "Probe:  two  spaces\tand a tab\n\nnew lines 1234567 ÿ 😀 漢字 <s> x</s> end."

EncoderSpec = tuple[str, bytes]  # (kind in ENCODERS, serialized tokenizer): small and picklable


def _sentencepiece_encoder(model: bytes) -> Callable[[list[str]], list[list[int]]]:
    sp = spm.SentencePieceProcessor(model_proto=model)
    return lambda texts: sp.encode(texts, num_threads=1)  # one thread: parallelism is our pool's


def _tokenizers_encoder(serialized: bytes) -> Callable[[list[str]], list[list[int]]]:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_str(serialized.decode("utf-8"))
    tok.encode_special_tokens = True  # literal "</s>" in a document is text, not EOS
    # encode() per text rather than encode_batch(): the batch version starts Rust threads
    return lambda texts: [tok.encode(t, add_special_tokens=False).ids for t in texts]


ENCODERS: dict[str, Callable[[bytes], Callable[[list[str]], list[list[int]]]]] = {
    "sentencepiece": _sentencepiece_encoder,  # tokenizers from train_tokenizer / with a tokenizer.model
    "tokenizers": _tokenizers_encoder,  # any other transformers tokenizer with a tokenizer.json backend
}


def make_encoder(spec: EncoderSpec) -> Callable[[list[str]], list[list[int]]]:
    """A function from texts to id lists (no BOS/EOS added), built from an `encoder_spec`."""
    kind, payload = spec
    return ENCODERS[kind](payload)


def encoder_spec(tokenizer) -> EncoderSpec:
    """How data workers reproduce `tokenizer`'s ids without pickling it.

    The sentencepiece model when the tokenizer has one and both give the same ids on PROBE_TEXT;
    else the tokenizer's `tokenizers` backend (with a warning when a sentencepiece model existed
    but disagreed). Raises ValueError when neither reproduces the tokenizer."""
    expected = tokenizer(PROBE_TEXT, add_special_tokens=False, split_special_tokens=True)["input_ids"]
    model = sentencepiece_model_path(tokenizer)
    if model is not None:
        spec = ("sentencepiece", model.read_bytes())
        if make_encoder(spec)([PROBE_TEXT])[0] == expected:
            return spec
        logger.warning(
            "%s gives other ids than the transformers tokenizer; using the latter's backend", model
        )
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        spec = ("tokenizers", backend.to_str().encode("utf-8"))
        if make_encoder(spec)([PROBE_TEXT])[0] == expected:
            return spec
    raise ValueError(
        f"cannot reproduce {type(tokenizer).__name__} ({tokenizer.name_or_path}) in data workers: it has "
        "neither a matching sentencepiece model nor a tokenizers backend; save it with save_pretrained"
    )


def spec_fingerprint(spec: EncoderSpec, eos_id: int, vocab_size: int) -> str:
    """sha256 of what determines the token stream: encoder, EOS id, and vocab (the dtype)."""
    kind, payload = spec
    h = hashlib.sha256(f"{kind}\0{eos_id}\0{vocab_size}\0".encode())
    h.update(payload)
    return h.hexdigest()


def tokenizer_fingerprint(tokenizer) -> str:
    """sha256 identifying `tokenizer` for cache keys (its sentencepiece model or tokenizer.json)."""
    return spec_fingerprint(encoder_spec(tokenizer), tokenizer.eos_token_id, len(tokenizer))


# ---------------------------------------------------------------------------------------------
# what the trainers call


def prepare_tokenizer(
    tokenizer_path: str | None,
    data_path: str | list[str],
    vocab_size: int | None,
    data_output_path: str | os.PathLike,
    local_rank: int,
    max_chars: int = DEFAULT_MAX_TRAIN_CHARS,
):
    """The trainers' tokenizer: `tokenizer_path` if given, else one trained on `data_path`.

    A trained tokenizer is cached under `data_output_path/tokenizer-<key>/`, keyed by a sha256 of
    the sources' fingerprints, `vocab_size` (default 8192), `max_chars` and the format version,
    so later runs reuse it. Local rank 0 (or -1) trains; other local ranks wait for its manifest
    file (no collective). Returns a transformers tokenizer."""
    if tokenizer_path:
        return load_tokenizer(tokenizer_path)
    vocab_size = vocab_size or DEFAULT_VOCAB_SIZE
    sources = resolve_sources(data_path)
    inputs = {
        "format": TOKENIZER_FORMAT_VERSION,
        "sources": [s.fingerprint() for s in sources],
        "vocab_size": vocab_size,
        "max_chars": max_chars,
    }
    key = sha256_json(inputs)

    def build(tmp: Path) -> dict:
        save_sentencepiece(_train_on_sources(sources, vocab_size, max_chars), tmp)
        return {"key": key, "inputs": inputs}

    out = Path(data_output_path) / f"tokenizer-{key[:16]}"
    build_once(out, build, local_rank, what="tokenizer")
    return load_tokenizer(out)
