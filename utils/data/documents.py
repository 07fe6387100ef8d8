"""Documents inside packed rows: their boundaries (--document_mask), rows that start at a document
(--bos_aligned_rows), and the UTF-8 bytes each token stands for (bits per byte: TextBytes).

The token stream is `doc1 </s> doc2 </s> ...`. Under --document_mask a row is read as documents,
each starting at the EOS before it: that EOS plays a BOS's part (it predicts the document's first
token) and the document's last token predicts its own EOS, so every prediction of the stream stays
inside one document and is still made exactly once. The row's first token starts a document too
(the rest of one cut at the row's start, unless the rows are BOS-aligned). Boundaries ride in each
item as `position_ids`: every token's position within its document, 0 where one begins, which the
model turns into its attention mask and rotary positions (llama_train/model.py, document_mask).

BOS-aligned rows (`--bos_aligned_rows`): row r is BOS followed by the stream from the first token of
a document on, max_seq_len + 1 tokens in all. The next row starts at the first document that begins
at or after the point where this row ended; the rest of the document cut at a row's end (its
leftover tokens) is not trained on. The row index is cached beside the token cache
(`rows-<key16>/`), built by one process per node like the token cache itself.
"""

import json
import re
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from llama_train.errors import CacheError, EmptySplitError, TokenizerError
from utils.data.cache import build_once, read_manifest, sha256_json
from utils.data.mixture import MixtureDataset, build_mixture

ROWS_FORMAT_VERSION = 1
SCAN_CHUNK = 1 << 24  # tokens read at a time when finding documents: memory bounded whatever the corpus
BYTE_TOKEN = re.compile(r"<0x[0-9A-Fa-f]{2}>")  # sentencepiece's byte-fallback pieces


def document_positions(input_ids: torch.Tensor, eos_id: int) -> torch.Tensor:
    """Each token's position within its document for a row (T,) or rows (B, T) of the stream: 0 at
    the row's first token and at every EOS (where the next document starts), counting up between."""
    T = input_ids.shape[-1]
    index = torch.arange(T).expand_as(input_ids)
    starts = input_ids == eos_id
    starts[..., 0] = True
    return index - torch.where(starts, index, 0).cummax(-1).values


class DocumentDataset(Dataset):
    """A dataset of rows whose items gain `position_ids` (document_positions): the boundaries the
    model's document mask is built from. Length, indices and the other fields are the wrapped one's."""

    def __init__(self, dataset, eos_id: int):
        self.dataset, self.eos_id = dataset, eos_id
        self.max_seq_len = dataset.max_seq_len

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        item = self.dataset[i]
        return {**item, "position_ids": document_positions(item["input_ids"], self.eos_id)}


class BosRowDataset(Dataset):
    """Rows of BOS + max_seq_len stream tokens from given starts (each a document's first token)."""

    def __init__(self, blocks, starts_path: Path, bos_id: int):
        self.blocks, self.path, self.bos_id = blocks, Path(starts_path), bos_id
        self.max_seq_len = blocks.max_seq_len
        self.starts = np.load(self.path, mmap_mode="r")

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        if not -len(self) <= i < len(self):
            raise IndexError(f"row {i} out of range for {len(self)} rows")
        start, L = int(self.starts[i]), self.max_seq_len
        row = np.empty(L + 1, dtype=np.int64)
        row[0], row[1:] = self.bos_id, self.blocks.tokens[start : start + L]
        row = torch.from_numpy(row)
        return {"input_ids": row[:-1], "labels": row[1:]}


def document_starts(tokens: np.ndarray, eos_id: int) -> np.ndarray:
    """Where each document of a stream begins: 0 and every position after an EOS (read in chunks)."""
    found = [np.zeros(1, dtype=np.int64)]
    for s in range(0, len(tokens), SCAN_CHUNK):
        found.append(np.flatnonzero(tokens[s : s + SCAN_CHUNK] == eos_id).astype(np.int64) + s + 1)
    starts = np.concatenate(found)
    return starts[starts < len(tokens)]


def bos_row_starts(tokens: np.ndarray, eos_id: int, max_seq_len: int) -> np.ndarray:
    """The stream offset each BOS-aligned row starts at: a document's first token; the next row at the
    first document that starts where this row ended or later (the cut document's rest is left out)."""
    starts = document_starts(tokens, eos_id)
    starts = starts[starts + max_seq_len <= len(tokens)]  # a row needs max_seq_len stream tokens
    rows, i = [], 0
    while i < len(starts):
        rows.append(starts[i])
        i = int(np.searchsorted(starts, starts[i] + max_seq_len))
    return np.asarray(rows, dtype=np.int64)


def bos_rows(pair: tuple, bos_id: int, eos_id: int, data_output_path, local_rank: int) -> tuple:
    """(train, eval) BosRowDataset over a cached (train, eval) pair of PackedBlockDatasets; the row
    index is built once (per node) under data_output_path and says what share of tokens is left out."""
    L = pair[0].max_seq_len
    inputs = {"format": ROWS_FORMAT_VERSION, "cache": pair[0].path.parent.name, "bos": bos_id, "eos": eos_id}
    key = sha256_json({**inputs, "max_seq_len": L})

    def build(tmp: Path) -> dict:
        stats = {}
        for name, blocks in zip(("train", "eval"), pair):
            starts = bos_row_starts(blocks.tokens, eos_id, L)
            if len(starts) == 0:
                raise EmptySplitError(
                    f"the {name} split has no document with {L} tokens after it for one BOS-aligned row; "
                    "use a lower --max_seq_len or more text"
                )
            np.save(tmp / f"{name}_rows.npy", starts)
            kept, tokens = len(starts) * L, blocks.num_tokens  # every stream token a row holds is a label
            stats[name] = {"rows": len(starts), "kept": kept, "tokens": tokens}
            stats[name]["left_out"] = 1 - kept / tokens
        return {"format": ROWS_FORMAT_VERSION, "key": key, "inputs": inputs, "splits": stats}

    rows_dir = Path(data_output_path) / f"rows-{key[:16]}"
    manifest = build_once(rows_dir, build, local_rank, what="BOS-aligned row index")
    if manifest.get("key") != key:
        raise CacheError(f"{rows_dir} holds a row index for other inputs; delete it")
    return tuple(
        BosRowDataset(b, rows_dir / f"{n}_rows.npy", bos_id) for n, b in zip(("train", "eval"), pair)
    )


def check_bos(tokenizer):
    """BOS-aligned rows start with the tokenizer's BOS token: a TokenizerError if it has none."""
    if tokenizer.bos_token_id is None:
        raise TokenizerError(
            f"--bos_aligned_rows: the tokenizer {tokenizer.name_or_path} has no BOS token to start each row "
            "with; use a tokenizer with one (scripts/train_tokenizer.py makes <s>) or drop --bos_aligned_rows"
        )


def document_datasets(
    datasets: tuple, tokenizer, bos_aligned: bool, data_output_path, local_rank: int, seed: int
) -> tuple:
    """create_pretrain_dataset's (train, eval) for --document_mask: items gain `position_ids`; with
    `bos_aligned`, the rows are first realigned to start at documents (a mixture: each component's,
    then blended again by `seed`). Raises TokenizerError when BOS-aligned rows are asked of a
    tokenizer without a BOS token."""
    eos, bos = tokenizer.eos_token_id, tokenizer.bos_token_id
    if bos_aligned:
        check_bos(tokenizer)
    if bos_aligned and isinstance(datasets[0], MixtureDataset):
        train, held_out = datasets
        parts = [
            bos_rows(p, bos, eos, data_output_path, local_rank)
            for p in zip(train.datasets, held_out.datasets)
        ]
        datasets = build_mixture(
            list(zip(train.names, train.shares, parts)), seed, data_output_path, local_rank
        )
    elif bos_aligned:
        datasets = bos_rows(datasets, bos, eos, data_output_path, local_rank)
    return tuple(DocumentDataset(d, eos) for d in datasets)


def source_datasets(dataset) -> list[tuple[str, Dataset]]:
    """(source, its own part) of a mixture's split, each source's items as the mixture's (with document
    positions under --document_mask): per-source evaluation reads each whole, not as sampled into the
    blend. [] for a split of one source."""
    inner = getattr(dataset, "dataset", dataset)
    if not isinstance(inner, MixtureDataset):
        return []
    if isinstance(dataset, DocumentDataset):
        return [(n, DocumentDataset(d, dataset.eos_id)) for n, d in zip(inner.names, inner.datasets)]
    return list(zip(inner.names, inner.datasets))


def left_out_share(dataset) -> float | None:
    """The share of the train split's tokens that BOS-aligned rows leave out, from their index's
    manifest (a mixture: of its components' splits together); None for other datasets."""
    inner = getattr(dataset, "dataset", dataset)
    parts = inner.datasets if isinstance(inner, MixtureDataset) else [inner]
    if not all(isinstance(p, BosRowDataset) for p in parts):
        return None
    stats = [read_manifest(p.path.parent)["splits"]["train"] for p in parts]
    return 1 - sum(s["kept"] for s in stats) / sum(s["tokens"] for s in stats)


def token_byte_lengths(tokenizer) -> np.ndarray:
    """The UTF-8 bytes of text each token id stands for, for bits per byte: 0 for special tokens
    (BOS, EOS, <unk>), 1 for a byte-fallback token (<0xNN>), else its piece's bytes with
    sentencepiece's '▁' as a space (a byte-level BPE piece: one byte per character)."""
    n = len(tokenizer)
    pieces = tokenizer.convert_ids_to_tokens(list(range(n)))
    special = set(tokenizer.all_special_ids)
    backend = getattr(tokenizer, "backend_tokenizer", None)
    decoder = json.loads(backend.to_str()).get("decoder") if backend is not None else None
    byte_level = '"ByteLevel"' in json.dumps(decoder)  # GPT-2 style: every byte a character
    out = np.zeros(n, dtype=np.int64)
    for i, piece in enumerate(pieces):
        if i in special or piece is None:
            continue
        if BYTE_TOKEN.fullmatch(piece):
            out[i] = 1
        else:
            out[i] = len(piece) if byte_level else len(piece.replace("▁", " ").encode("utf-8"))
    return out


class TextBytes:
    """The UTF-8 bytes of text the scored tokens of a batch stand for: bits per byte's denominator.

    Each label counts its token_byte_lengths, less the dummy prefix where it begins a document (its
    input is EOS or BOS): a SentencePiece tokenizer (add_dummy_prefix, Metaspace) puts a "▁" before each
    text it encodes, which token_byte_lengths reads as a space but is no character of the text (the
    decoder drops it). Byte-level BPE adds none. `device`: where the tables live (the batches')."""

    def __init__(self, tokenizer, device=None):
        table = token_byte_lengths(tokenizer)
        pieces = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
        self.per_token = torch.from_numpy(table).to(device)
        self.prefixed = torch.tensor([bool(p and p.startswith("▁")) for p in pieces], device=device)
        self.prefix = dummy_prefix_bytes(tokenizer, table)
        starts = [t for t in (tokenizer.eos_token_id, tokenizer.bos_token_id) if t is not None]
        self.starts = torch.tensor(starts, dtype=torch.long, device=device)

    def count(self, input_ids: torch.Tensor, labels: torch.Tensor) -> int:
        """Bytes of the text that `labels` (-100: not scored) stand for, `input_ids` the tokens before them."""
        scored = labels != -100
        total = self.per_token[labels[scored]].sum()
        if self.prefix:
            first = scored & torch.isin(input_ids, self.starts)  # the label begins a document
            total = total - self.prefix * self.prefixed[labels[first]].sum()
        return int(total)


def dummy_prefix_bytes(tokenizer, table: np.ndarray) -> int:
    """Bytes a tokenizer adds before each text it encodes (SentencePiece's "▁": 1; byte-level BPE: 0),
    measured: a one-letter text's tokens against its one byte."""
    ids = tokenizer("a", add_special_tokens=False)["input_ids"]
    return max(0, int(table[ids].sum()) - 1)
