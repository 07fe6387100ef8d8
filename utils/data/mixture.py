"""Weighted mixtures of sources: `--data_path 0.7 builtin 0.3 code.jsonl` (Megatron's syntax).

Each component (one data_path entry) is tokenized and split into train/eval on its own, in its own
cache (so changing the weights re-tokenizes nothing); a mixture dataset then draws blocks from the
components by weight. Its size is the sum of the components' sizes (one "epoch" of the mixture has as
many blocks as the concatenated corpus), of which component i gets `share_i x size` slots: a seeded
permutation of its blocks, repeated when it is too small for its share (upsampled) or cut short
when it is larger (downsampled). The slots are interleaved evenly (component i's j-th block at
position (j + 0.5) / count_i), and the train sampler shuffles them as usual. The index is cached
under a key of the components' caches, the shares and the seed: the same inputs give the same
blocks on every rank, run and machine.
"""

from pathlib import Path

import numpy as np
from torch.utils.data import Dataset

from llama_train.errors import CacheError
from utils.data.cache import build_once, sha256_json

MIXTURE_FORMAT_VERSION = 1


def slot_counts(shares: list[float], total: int) -> list[int]:
    """`total` slots split by `shares` (largest remainder): the counts sum to `total` exactly."""
    raw = [s * total for s in shares]
    counts = [int(r) for r in raw]
    by_remainder = sorted(range(len(raw)), key=lambda i: (counts[i] - raw[i], i))
    for i in by_remainder[: total - sum(counts)]:
        counts[i] += 1
    return counts


def blend_index(lengths: list[int], shares: list[float], seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(component, block) of every slot of a mixture of components with `lengths` blocks."""
    counts = slot_counts(shares, sum(lengths))
    component = np.concatenate([np.full(c, i, dtype=np.int32) for i, c in enumerate(counts)])
    position = np.concatenate([(np.arange(c) + 0.5) / c for c in counts if c])
    order = np.argsort(position, kind="stable")
    component = component[order]
    block = np.empty(len(component), dtype=np.int64)
    for i, (n, c) in enumerate(zip(lengths, counts)):
        rng = np.random.default_rng([seed, i])
        cycles = [rng.permutation(n) for _ in range(-(-c // n))]  # a new order for each repeat
        block[component == i] = np.concatenate(cycles)[:c] if cycles else []
    return component, block


class MixtureDataset(Dataset):
    """Blocks drawn from component datasets by a (component, block) index; items as theirs."""

    def __init__(self, datasets: list, names: list[str], shares: list[float], index_dir: Path, split: str):
        self.datasets, self.names, self.shares = datasets, names, shares
        self.index_dir = Path(index_dir)  # the sample ledger names it: which source each sample came from
        self.component = np.load(index_dir / f"{split}_component.npy", mmap_mode="r")
        self.block = np.load(index_dir / f"{split}_block.npy", mmap_mode="r")
        self.max_seq_len = datasets[0].max_seq_len

    def __len__(self) -> int:
        return len(self.component)

    def __getitem__(self, i: int):
        if not -len(self) <= i < len(self):
            raise IndexError(f"block {i} out of range for {len(self)} blocks")
        return self.datasets[int(self.component[i])][int(self.block[i])]

    def measured_shares(self) -> list[float]:
        """Each component's share of this dataset's blocks (= of its tokens: blocks are equal)."""
        counts = np.bincount(self.component, minlength=len(self.datasets))
        return (counts / max(1, len(self))).tolist()


def build_mixture(
    components: list[tuple[str, float, tuple]], seed: int, data_output_path, local_rank: int
) -> tuple[MixtureDataset, MixtureDataset]:
    """(train, eval) mixtures of `components` = [(name, share, (train_ds, eval_ds)), ...], each a
    component's own cached datasets; the index is built once under data_output_path."""
    names = [n for n, _, _ in components]
    shares = [s for _, s, _ in components]
    splits = {"train": [d[0] for _, _, d in components], "eval": [d[1] for _, _, d in components]}
    inputs = {
        "format": MIXTURE_FORMAT_VERSION,
        "components": [[n, s, Path(d[0].path).parent.name] for n, s, d in components],
        "seed": seed,
    }
    key = sha256_json(inputs)

    def build(tmp: Path) -> dict:
        stats = {}
        for split, datasets in splits.items():
            component, block = blend_index([len(d) for d in datasets], shares, seed)
            np.save(tmp / f"{split}_component.npy", component)
            np.save(tmp / f"{split}_block.npy", block)
            stats[split] = {"blocks": len(component), "component_blocks": [len(d) for d in datasets]}
        return {"format": MIXTURE_FORMAT_VERSION, "key": key, "inputs": inputs, "splits": stats}

    index_dir = Path(data_output_path) / f"mixture-{key[:16]}"
    manifest = build_once(index_dir, build, local_rank, what="data mixture index")
    if manifest.get("key") != key:
        raise CacheError(f"{index_dir} holds a mixture index for other inputs; delete it")
    return tuple(MixtureDataset(splits[s], names, shares, index_dir, s) for s in ("train", "eval"))


def mixture_report(train: MixtureDataset, planned_samples: int) -> list[str]:
    """The `data mix:` line, measured on the built train mixture, and a warning for each component
    too small for its weight (it fills more slots than it has blocks, so its blocks repeat), saying how
    many times the run's `planned_samples` sequences see it."""
    counts = np.bincount(train.component, minlength=len(train.datasets))
    measured = counts / max(1, len(train))
    lines = ["data mix: " + " / ".join(f"{n} {m * 100:.1f}%" for n, m in zip(train.names, measured))]
    for name, share, slots, ds in zip(train.names, measured, counts, train.datasets):
        if slots > len(ds):
            epochs = share * planned_samples / len(ds)
            lines.append(
                f"warning: {name} is {share * 100:.1f}% of the mixture but has {len(ds):,} of its {len(train):,} "
                f"blocks, so it is upsampled: the run's {planned_samples:,} sequences see it {epochs:.1f} times; "
                "give it a lower weight or more text to see each block once"
            )
    return lines
