"""Pretraining data: text sources, the tokenizer, the build-once token cache and its datasets.

This is the package's one door: the trainers, llama_train and scripts/ import only the names in
`__all__` (tests/test_layout.py keeps it so); the modules behind it may change. Its errors live in
llama_train/errors.py, the one module of llama_train this package imports.

    sources.py     where text comes from (builtin, files, hf:), weighted mixtures
    tokenizer.py   train / load a LLaMA-style sentencepiece tokenizer that transformers loads
    cache.py       the build-once cache: lock, temp dir, rename, wait
    data_utils.py  tokenized blocks: create_pretrain_dataset, the samplers, stream_blocks
    documents.py   document boundaries in rows (--document_mask), BOS-aligned rows, bytes per token
    mixture.py     a weighted mixture of datasets, sampled by seed
    tasks.py       downstream task files (--eval_tasks) and the built-in task
"""

from utils.data.cache import read_manifest
from utils.data.data_utils import (
    create_pretrain_dataset,
    epoch_order,
    make_sampler,
    open_pretrain_datasets,
    pretrain_cache_dir,
    stream_blocks,
)
from utils.data.documents import (
    TextBytes,
    check_bos,
    document_datasets,
    document_positions,
    left_out_share,
    source_datasets,
    token_byte_lengths,
)
from utils.data.mixture import MixtureDataset, mixture_report
from utils.data.sources import iter_documents, parse_mixture, resolve_sources
from utils.data.tasks import BUILTIN as BUILTIN_TASK
from utils.data.tasks import (
    CLOZE,
    MULTIPLE_CHOICE,
    Task,
    TaskItem,
    builtin_task,
    read_task,
    task_entries,
    task_name,
    task_problems,
)
from utils.data.tokenizer import (
    DEFAULT_MAX_TRAIN_CHARS,
    DEFAULT_VOCAB_SIZE,
    check_vocab,
    load_tokenizer,
    prepare_tokenizer,
    save_tokenizer,
    tokenizer_fingerprint,
    train_tokenizer,
)

__all__ = [
    # datasets (data_utils.py, mixture.py, cache.py)
    "create_pretrain_dataset",
    "epoch_order",
    "make_sampler",
    "open_pretrain_datasets",
    "pretrain_cache_dir",
    "stream_blocks",
    "read_manifest",
    "MixtureDataset",
    "mixture_report",
    # documents in rows, bytes per token (documents.py)
    "check_bos",
    "document_datasets",
    "document_positions",
    "left_out_share",
    "source_datasets",
    "token_byte_lengths",
    "TextBytes",
    # sources (sources.py)
    "parse_mixture",
    "resolve_sources",
    "iter_documents",
    # downstream tasks (tasks.py)
    "BUILTIN_TASK",
    "CLOZE",
    "MULTIPLE_CHOICE",
    "Task",
    "TaskItem",
    "builtin_task",
    "read_task",
    "task_entries",
    "task_name",
    "task_problems",
    # the tokenizer (tokenizer.py)
    "DEFAULT_MAX_TRAIN_CHARS",
    "DEFAULT_VOCAB_SIZE",
    "check_vocab",
    "load_tokenizer",
    "prepare_tokenizer",
    "save_tokenizer",
    "tokenizer_fingerprint",
    "train_tokenizer",
]
