"""The sentencepiece tokenizer: LLaMA conventions, transformers parity, loading, caching, CLI."""

import importlib.util
import shutil
from pathlib import Path
from pydoc_data.topics import topics

import pytest
import sentencepiece as spm
from transformers import AutoTokenizer, LlamaTokenizer

from llama_train.errors import DataSourceError
from utils.data import tokenizer as T

ROOT = Path(__file__).resolve().parents[1]
VOCAB = 512  # small: trains in well under a second


def write_corpus(path: Path, n_topics: int = 40) -> Path:
    """Real English from pydoc's topics (present in every Python), one document per topic."""
    path.write_text("\n\n".join(topics[k] for k in sorted(topics)[:n_topics]), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("tok")
    return T.train_tokenizer(str(write_corpus(tmp / "corpus.txt")), VOCAB, tmp / "tokenizer")


@pytest.fixture(scope="module")
def tok(tok_dir):
    return T.load_tokenizer(tok_dir)


SAMPLES = [
    "The quick brown fox jumps over the lazy dog.",
    "Indented:\n    def f(x):\n        return x  # two  spaces",
    "Numbers 1234567890 and 3.14159, tabs\tand\r\nCRLF.",
    "Emoji 😀👍🏽, CJK 漢字かな, accents é ü ß, and a literal <s> and </s> in text.",
    "trailing spaces   ",
]


def test_llama_conventions(tok_dir, tok):
    assert isinstance(tok, LlamaTokenizer)
    assert len(tok) == VOCAB
    assert tok.convert_ids_to_tokens([0, 1, 2]) == ["<unk>", "<s>", "</s>"]
    assert (tok.unk_token_id, tok.bos_token_id, tok.eos_token_id) == (0, 1, 2)
    sp = spm.SentencePieceProcessor(model_file=str(tok_dir / "tokenizer.model"))
    assert [sp.id_to_piece(i) for i in range(3)] == ["<unk>", "<s>", "</s>"]
    assert sp.id_to_piece(3) == "<0x00>"  # byte fallback pieces follow the specials, as in LLaMA
    assert tok.tokenize("2024")[-4:] == ["2", "0", "2", "4"]  # digits split
    assert tok("hi")["input_ids"][0] != tok.bos_token_id  # no BOS: the pretraining stream has none


def test_autotokenizer_matches_sentencepiece(tok_dir, tok):
    auto = AutoTokenizer.from_pretrained(tok_dir)
    assert type(auto).__name__ == "LlamaTokenizer"
    sp = spm.SentencePieceProcessor(model_file=str(tok_dir / "tokenizer.model"))
    encode = T.make_encoder(T.encoder_spec(tok))
    texts = SAMPLES + [topics[k].strip() for k in sorted(topics)[40:60]]  # topics unseen in training
    hf_ids = auto(texts, add_special_tokens=False, split_special_tokens=True)["input_ids"]
    assert hf_ids == sp.encode(texts) == encode(texts)
    assert T.encoder_spec(tok)[0] == "sentencepiece"


def test_byte_fallback_round_trip(tok):
    for text in SAMPLES:
        ids = tok(text, add_special_tokens=False, split_special_tokens=True)["input_ids"]
        assert tok.unk_token_id not in ids
        assert tok.decode(ids) == text
    pieces = tok.tokenize("😀")
    assert pieces[-4:] == ["<0xF0>", "<0x9F>", "<0x98>", "<0x80>"]  # unseen: UTF-8 bytes


def test_load_raw_model_file(tok_dir, tok):
    raw = T.load_tokenizer(tok_dir / "tokenizer.model")
    assert isinstance(raw, LlamaTokenizer) and len(raw) == VOCAB
    assert T.sentencepiece_model_path(raw) == tok_dir / "tokenizer.model"
    for text in SAMPLES:
        assert raw(text)["input_ids"] == tok(text)["input_ids"]
    assert T.tokenizer_fingerprint(raw) == T.tokenizer_fingerprint(tok)


def test_load_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such tokenizer"):
        T.load_tokenizer(tmp_path / "missing")
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(ValueError, match="not a tokenizer"):
        T.load_tokenizer(tmp_path / "notes.txt")


def test_tokenizers_backend_without_sentencepiece_model(tok_dir, tok, tmp_path):
    """A tokenizer dir without tokenizer.model (e.g. save_pretrained output) still gives the same ids."""
    shutil.copytree(tok_dir, tmp_path / "tok")
    (tmp_path / "tok" / "tokenizer.model").unlink()
    bare = T.load_tokenizer(tmp_path / "tok")
    spec = T.encoder_spec(bare)
    assert spec[0] == "tokenizers"
    assert T.make_encoder(spec)(SAMPLES) == T.make_encoder(T.encoder_spec(tok))(SAMPLES)


def test_save_tokenizer_keeps_sentencepiece_model(tok, tmp_path):
    out = T.save_tokenizer(tok, tmp_path / "export")
    assert (out / "tokenizer.model").is_file() and (out / "tokenizer.json").is_file()
    assert T.encoder_spec(T.load_tokenizer(out))[0] == "sentencepiece"


def test_fingerprint_identifies_the_model(tok_dir, tok, tmp_path):
    again = T.load_tokenizer(tok_dir)
    assert T.tokenizer_fingerprint(again) == T.tokenizer_fingerprint(tok)
    other = T.train_tokenizer(str(write_corpus(tmp_path / "c.txt")), VOCAB + 64, tmp_path / "other")
    assert T.tokenizer_fingerprint(T.load_tokenizer(other)) != T.tokenizer_fingerprint(tok)


def test_check_vocab(tok):
    T.check_vocab(tok, VOCAB)
    T.check_vocab(tok, VOCAB + 100)  # spare embedding rows are fine
    with pytest.raises(T.VocabSizeError, match=f"--vocab_size {VOCAB}"):
        T.check_vocab(tok, VOCAB - 1)


def test_vocab_size_errors(tmp_path):
    corpus = tmp_path / "tiny.txt"
    corpus.write_text("a few words only\n\nand a second document\n")
    with pytest.raises(T.VocabSizeError, match="at least 260"):
        T.train_sentencepiece(str(corpus), 100)
    with pytest.raises(T.VocabSizeError, match="Lower --vocab_size"):
        T.train_sentencepiece(str(corpus), 5000)


def test_prepare_tokenizer_loads_trains_and_reuses(tok_dir, tmp_path, monkeypatch):
    assert len(T.prepare_tokenizer(str(tok_dir), "ignored", None, tmp_path, local_rank=0)) == VOCAB
    corpus = str(write_corpus(tmp_path / "corpus.txt", n_topics=20))
    cache = tmp_path / "cache"

    monkeypatch.setenv("LLAMA_TRAIN_DATA_WAIT_TIMEOUT", "0.3")
    with pytest.raises(TimeoutError, match="local rank 0"):  # nothing built yet: rank 1 waits, then says why
        T.prepare_tokenizer(None, corpus, VOCAB, cache, local_rank=1)

    first = T.prepare_tokenizer(None, corpus, VOCAB, cache, local_rank=0)
    (built,) = cache.glob("tokenizer-*")
    assert (built / "manifest.json").is_file() and (built / "tokenizer.model").is_file()

    def no_training(*args, **kwargs):
        raise AssertionError("a cached tokenizer was trained again")

    monkeypatch.setattr(T, "_train_on_sources", no_training)
    for rank in (-1, 0, 1):
        assert T.tokenizer_fingerprint(T.prepare_tokenizer(None, corpus, VOCAB, cache, rank)) == (
            T.tokenizer_fingerprint(first)
        )
    assert not list(cache.glob(".*tmp*"))


def _load_cli():
    spec = importlib.util.spec_from_file_location(
        "train_tokenizer_cli", ROOT / "scripts" / "train_tokenizer.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_cli(tmp_path, capsys):
    cli = _load_cli()
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    help_text = capsys.readouterr().out
    for flag in ("--data_path", "--vocab_size", "--output_dir", "--max_chars"):
        assert flag in help_text
    corpus = write_corpus(tmp_path / "corpus.txt", n_topics=20)
    assert (
        cli.main(
            ["--data_path", str(corpus), "--vocab_size", str(VOCAB), "--output_dir", str(tmp_path / "t")]
        )
        == 0
    )
    assert len(AutoTokenizer.from_pretrained(tmp_path / "t")) == VOCAB
    assert cli.main(["--data_path", str(tmp_path / "missing.txt"), "--output_dir", str(tmp_path / "u")]) == 2
    assert "missing.txt" in capsys.readouterr().err


def test_bad_input_surfaces_through_training(tmp_path):
    """sentencepiece wraps errors raised by its input; the user still sees file and line."""
    bad = tmp_path / "data.jsonl"
    bad.write_text('{"text": "hello world"}\n{"text": oops}\n')
    with pytest.raises(DataSourceError, match=r"data.jsonl:2: invalid JSON"):
        T.train_sentencepiece(str(bad), VOCAB)


def test_a_vocab_smaller_than_the_texts_characters_says_to_raise_it(tmp_path):
    """sentencepiece needs a piece per character it keeps: the error said "Lower --vocab_size"."""
    corpus = tmp_path / "chars.txt"
    chars = "".join(chr(c) for c in range(0x4E00, 0x4E00 + 400))  # 400 distinct CJK characters
    corpus.write_text("\n\n".join(chars[i : i + 40] * 3 for i in range(0, 400, 40)))
    with pytest.raises(T.VocabSizeError) as e:
        T.train_sentencepiece(str(corpus), 300)
    message = str(e.value)
    assert "--vocab_size 300 is too small for this text" in message and "raise --vocab_size" in message
    assert "Lower --vocab_size" not in message


def test_the_same_text_gives_the_same_tokenizer_on_every_machine(tmp_path, monkeypatch):
    """sentencepiece's BPE result depends on its thread count, so a tokenizer trained with the machine's
    core count differed between a 1-, 2- and 4-core machine, and with it every loss after it. Trained
    with a fixed count, the model's bytes are the same whatever os.cpu_count() says."""
    corpus = str(write_corpus(tmp_path / "corpus.txt", n_topics=120))
    models = set()
    for cores in (1, 2, 8):
        monkeypatch.setattr(T.os, "cpu_count", lambda n=cores: n)
        models.add(T.train_sentencepiece(corpus, 2048))
    assert len(models) == 1
