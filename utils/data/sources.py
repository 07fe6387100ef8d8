"""Where pretraining text comes from.

`resolve_sources(data_path)` turns what the user wrote (`--data_path builtin data/ more/*.jsonl
hf:wikitext:wikitext-2-raw-v1`) into a list of `Source`s; `parse_mixture` reads a weighted mixture
(`--data_path 0.7 builtin 0.3 code.jsonl`, which utils/data/mixture.py samples). Each source knows a `fingerprint()`
for cache keys and yields its documents as strings, streaming, so no corpus is held in memory.

Named sources and file readers are registries (dicts): add one by adding an entry.

Documents are whitespace-stripped and empty ones are skipped, in every source alike (this also
keeps our sentencepiece ids equal to transformers' ids: they differ only on leading spaces).
"""

import ast
import glob
import hashlib
import itertools
import json
import os
import sys
import sysconfig
import warnings
from collections.abc import Callable, Iterator
from functools import cache
from pathlib import Path

from llama_train.errors import DataSourceError, SourceNotFoundError, SourceUnavailableError


class Source:
    """A named stream of documents with a fingerprint that changes when its content may."""

    name: str

    def fingerprint(self) -> str:
        raise NotImplementedError

    def raw_documents(self) -> Iterator[str]:
        raise NotImplementedError

    def documents(self) -> Iterator[str]:
        """Stripped, non-empty documents; a source that yields none is an error, not a no-op."""
        count = 0
        for text in self.raw_documents():
            text = text.strip()
            if text:
                count += 1
                yield text
        if count == 0:
            raise DataSourceError(f"{self.name}: no documents (the source is empty or only whitespace)")

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"


# ---------------------------------------------------------------------------------------------
# local files


def _decode(raw: bytes, path: Path, lineno: int) -> str:
    """UTF-8 text of `raw`, which starts at line `lineno` of `path`; errors name line and column."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = lineno + raw.count(b"\n", 0, e.start)
        column = e.start - (raw.rfind(b"\n", 0, e.start) + 1) + 1
        raise DataSourceError(
            f"{path}:{line}: not valid UTF-8 (byte {raw[e.start]:#04x} at column {column}); "
            "convert the file to UTF-8, e.g. with iconv"
        ) from None


def _lines(path: Path) -> Iterator[tuple[int, str]]:
    """(line number, text without the line break). Decoding line by line, rather than through a
    text-mode file, lets a decode error name its line."""
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            line = _decode(raw, path, lineno).rstrip("\r\n")
            if lineno == 1:
                line = line.removeprefix("\ufeff")  # a UTF-8 byte-order mark is not text
            yield lineno, line


def read_txt(path: Path) -> Iterator[str]:
    """One document per block of text separated by one or more blank lines."""
    block: list[str] = []
    for _, line in _lines(path):
        if line.strip():
            block.append(line)
        elif block:
            yield "\n".join(block)
            block = []
    if block:
        yield "\n".join(block)


def _text_field(record, where: str, field: str = "text") -> str:
    if not isinstance(record, dict):
        raise DataSourceError(
            f"{where}: expected a JSON object with a '{field}' field, got {type(record).__name__}"
        )
    if field not in record:
        keys = ", ".join(sorted(map(str, record))[:10]) or "none"
        raise DataSourceError(f"{where}: no '{field}' field (keys: {keys})")
    text = record[field]
    if not isinstance(text, str):
        raise DataSourceError(f"{where}: '{field}' must be a string, got {type(text).__name__}")
    try:
        text.encode("utf-8")  # JSON escapes can encode lone surrogates, which no tokenizer takes
    except UnicodeEncodeError:
        raise DataSourceError(f"{where}: 'text' has an unpaired surrogate escape (\\ud800-\\udfff)") from None
    return text


def read_jsonl(path: Path) -> Iterator[str]:
    """One JSON object per line with a string field `text`; blank lines are allowed."""
    for lineno, line in _lines(path):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataSourceError(f"{path}:{lineno}: invalid JSON ({e.msg} at column {e.colno})") from None
        yield _text_field(record, f"{path}:{lineno}")


def read_json(path: Path) -> Iterator[str]:
    """A JSON array of objects with `text` (read whole: use .jsonl for large corpora), or JSON
    Lines under a .json name, as `datasets.Dataset.to_json` writes them."""
    with open(path, "rb") as f:
        head = f.read(4096).lstrip(b"\xef\xbb\xbf \t\r\n")
    if not head.startswith(b"["):
        yield from read_jsonl(path)
        return
    text = _decode(path.read_bytes(), path, 1)
    try:
        records = json.loads(text)
    except json.JSONDecodeError as e:
        raise DataSourceError(f"{path}:{e.lineno}: invalid JSON ({e.msg} at column {e.colno})") from None
    for i, record in enumerate(records):
        yield _text_field(record, f"{path}: item {i}")


def read_parquet(path: Path, batch_rows: int = 1024) -> Iterator[str]:
    """The string column `text`, streamed in record batches."""
    import pyarrow.parquet as pq  # imported here: only parquet users pay for pyarrow

    f = pq.ParquetFile(path)
    if "text" not in f.schema_arrow.names:
        raise DataSourceError(f"{path}: no 'text' column (columns: {', '.join(f.schema_arrow.names)})")
    row = 0
    for batch in f.iter_batches(batch_size=batch_rows, columns=["text"]):
        for text in batch.column(0).to_pylist():
            if not isinstance(text, str):
                raise DataSourceError(
                    f"{path}: row {row}: 'text' must be a string, got {type(text).__name__}"
                )
            row += 1
            yield text


FILE_READERS: dict[str, Callable[[Path], Iterator[str]]] = {
    ".txt": read_txt,
    ".jsonl": read_jsonl,
    ".json": read_json,
    ".parquet": read_parquet,
}


class FileSource(Source):
    """One local file, read by the reader registered for its suffix."""

    def __init__(self, path: Path):
        self.path = path.resolve()
        self.name = str(path)
        if self.path.suffix not in FILE_READERS:
            raise DataSourceError(f"{path}: unsupported file type; supported: {', '.join(FILE_READERS)}")

    def fingerprint(self) -> str:
        st = self.path.stat()  # size + mtime: cheap, and any edit changes one of them
        return f"file:{self.path}:{st.st_size}:{st.st_mtime_ns}"

    def raw_documents(self) -> Iterator[str]:
        return FILE_READERS[self.path.suffix](self.path)


def _supported_files(paths) -> list[Path]:
    return sorted(p for p in map(Path, paths) if p.is_file() and p.suffix in FILE_READERS)


def _local_sources(entry: str) -> list[Source]:
    """A file, a directory (recursively, skipping hidden names) or a glob."""
    path = Path(entry).expanduser()
    if path.is_file():
        return [FileSource(path)]
    if path.is_dir():
        files = [
            p
            for p in _supported_files(path.rglob("*"))
            if not any(part.startswith(".") for part in p.relative_to(path).parts)
        ]
        if not files:
            raise DataSourceError(f"{entry}: directory has no {'/'.join(FILE_READERS)} files")
        return [FileSource(p) for p in files]
    if glob.has_magic(entry):
        files = _supported_files(glob.glob(os.path.expanduser(entry), recursive=True))
        if not files:
            raise SourceNotFoundError(f"{entry}: glob matches no {'/'.join(FILE_READERS)} files")
        return [FileSource(p) for p in files]
    raise SourceNotFoundError(
        f"{entry}: no such file, directory or source. A data_path entry is one of: "
        f"{', '.join(NAMED_SOURCES)} (named sources, hf takes hf:NAME[:CONFIG][@ROWS][#COLUMN]), "
        f"a {'/'.join(FILE_READERS)} file, a directory, or a glob"
    )


# ---------------------------------------------------------------------------------------------
# builtin: English prose shipped with every Python install

# Parts of the standard library that are not prose about Python, or are someone else's packages.
_BUILTIN_SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idlelib", "tkinter", "turtledemo"}
_BUILTIN_SKIP_FILES = {"__main__.py", "antigravity.py", "this.py"}


@cache
def _stdlib_files() -> tuple[Path, ...]:
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    # skipped folders are pruned, not walked: the interpreter's own site-packages can hold gigabytes
    # (0.38 s a process start with rglob on the dev VM, 0.01 s pruned; the same 632 files)
    for folder, subfolders, names in os.walk(root):
        subfolders[:] = [d for d in subfolders if d not in _BUILTIN_SKIP_DIRS]
        files += [Path(folder, n) for n in names if n.endswith(".py") and n not in _BUILTIN_SKIP_FILES]
    # sorted by relative POSIX path: the same order in every process, run and file system
    return tuple(sorted(files, key=lambda p: p.relative_to(root).as_posix()))


def _module_name(path: Path) -> str:
    rel = path.relative_to(Path(sysconfig.get_paths()["stdlib"])).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


def _module_document(path: Path) -> str:
    """A module's docstrings in source order, each under its qualified name. Parsed with `ast`,
    never imported: importing runs code (antigravity opens a browser)."""
    try:
        with warnings.catch_warnings():  # e.g. "invalid escape sequence" in old modules: not our concern
            warnings.simplefilter("ignore", SyntaxWarning)
            tree = ast.parse(path.read_bytes(), filename=str(path))
    except SyntaxError:
        return ""  # e.g. lib2to3 fixtures written in Python 2: no prose for us either way
    module = _module_name(path)
    parts = []

    def visit(node, prefix: str):
        doc = ast.get_docstring(node, clean=True)
        if doc:
            parts.append(f"{prefix}\n\n{doc}")
        for child in node.body:
            if isinstance(child, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
                visit(child, f"{prefix}.{child.name}")

    visit(tree, module)
    return "\n\n".join(parts)


@cache  # hashing 13 MB of stdlib once per process is enough
def _builtin_fingerprint() -> str:
    # Content, not mtimes: two nodes with the same Python get the same key.
    import pydoc_data.topics

    h = hashlib.sha256(sys.version.encode())
    h.update(Path(pydoc_data.topics.__file__).read_bytes())
    root = Path(sysconfig.get_paths()["stdlib"])
    for p in _stdlib_files():
        h.update(p.relative_to(root).as_posix().encode() + b"\0")
        h.update(hashlib.sha256(p.read_bytes()).digest())
    return f"builtin:{h.hexdigest()}"


class BuiltinSource(Source):
    """pydoc's topic texts (sorted by topic) then standard-library docstrings, one document per
    module (sorted by path). About 2 MB of English on CPython 3.11, offline, the same in every
    process."""

    name = "builtin"

    def fingerprint(self) -> str:
        return _builtin_fingerprint()

    def raw_documents(self) -> Iterator[str]:
        from pydoc_data.topics import topics  # a dict of strings; importing it runs nothing else

        for name in sorted(topics):
            yield topics[name]
        for path in _stdlib_files():
            yield _module_document(path)


# ---------------------------------------------------------------------------------------------
# hf:NAME[:CONFIG][@ROWS][#COLUMN]


def parse_hf_spec(spec: str) -> tuple[str, str | None, int | None, str]:
    """(dataset, config, rows, column) of `hf:`'s argument NAME[:CONFIG][@ROWS][#COLUMN]: the first ROWS
    rows of the `train` split (all by default), their COLUMN field (`text` by default)."""
    rest, _, column = spec.partition("#")
    rest, at, rows = rest.partition("@")
    dataset, _, config = rest.partition(":")
    if not dataset or (at and not rows.isdigit()) or (at and int(rows) < 1) or ("#" in spec and not column):
        raise DataSourceError(
            f"hf:{spec}: expected hf:NAME[:CONFIG][@ROWS][#COLUMN], e.g. hf:wikitext:wikitext-2-raw-v1@10000#text"
        )
    return dataset, config or None, int(rows) if at else None, column or "text"


def _hub_offline() -> bool:
    return any(
        os.environ.get(v, "").lower() in ("1", "true", "yes")
        for v in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")
    )


class HFSource(Source):
    """The `train` split of a Hugging Face Hub dataset (its first ROWS rows with `@ROWS`), one field
    of each row (`text`, or `#COLUMN`), streamed with `datasets` (online only)."""

    def __init__(self, spec: str):
        self.dataset, self.config, self.rows, self.column = parse_hf_spec(spec)
        self.name = f"hf:{spec}"
        try:
            import datasets  # noqa: F401 -- checked now so every rank fails fast, not rank 0 mid-build
        except ImportError:
            raise SourceUnavailableError(
                f"{self.name}: hub datasets need the `datasets` library and network access; "
                ".venv/bin/pip install -e '.[hf]' in the checkout, or pass local files instead"
            ) from None
        if _hub_offline():
            raise SourceUnavailableError(
                f"{self.name}: HF_HUB_OFFLINE / HF_DATASETS_OFFLINE is set, so the hub cannot be reached; "
                "export the dataset to .jsonl/.parquet on an online machine and pass those files"
            )

    def fingerprint(self) -> str:
        # Hub datasets are keyed by name only: use a new --data_output_path after the hub copy changes.
        cap = (f"@{self.rows}" if self.rows else "") + (f"#{self.column}" if self.column != "text" else "")
        return f"hf:{self.dataset}:{self.config}{cap}"

    def raw_documents(self) -> Iterator[str]:
        import datasets

        try:
            rows = datasets.load_dataset(self.dataset, self.config, split="train", streaming=True)
        except Exception as e:  # network errors come from several libraries; we add the likely cause
            raise SourceUnavailableError(
                f"{self.name}: could not load from the hub ({type(e).__name__}: {e}); is this machine online?"
            ) from e
        for i, row in enumerate(itertools.islice(rows, self.rows)):
            yield _text_field(row, f"{self.name}: row {i}", self.column)


# Sources named in data_path, by the part before the first ':' (builtin takes no argument).
NAMED_SOURCES: dict[str, Callable[[str], Source]] = {
    "builtin": lambda arg: BuiltinSource() if not arg else _no_argument("builtin", arg),
    "hf": HFSource,
}


def _no_argument(name: str, arg: str):
    raise DataSourceError(f"{name}:{arg}: the {name} source takes no argument")


def _weight(entry: str) -> float | None:
    try:
        return float(entry)
    except ValueError:
        return None


def parse_mixture(data_path) -> list[tuple[float, str]] | None:
    """`WEIGHT SRC WEIGHT SRC ...` (Megatron's syntax: `0.7 builtin 0.3 code.jsonl`) -> [(share,
    SRC), ...], the shares normalised to sum 1; None for plain entries, which are concatenated in
    order. Each SRC is any one data_path entry (a directory or glob is one mixture component)."""
    entries = [data_path] if isinstance(data_path, str | os.PathLike) else list(map(str, data_path))
    if not entries or _weight(str(entries[0])) is None:
        return None
    pairs = list(zip(entries[0::2], entries[1::2]))
    if len(entries) % 2 or any(_weight(w) is None or _weight(s) is not None for w, s in pairs):
        raise DataSourceError(
            f"a weighted data_path is WEIGHT SOURCE pairs (e.g. 0.7 builtin 0.3 code.jsonl), got {' '.join(entries)!r}"
        )
    for w, src in pairs:
        if not _weight(w) > 0 or _weight(w) == float("inf"):
            raise DataSourceError(
                f"weight {w} for {src}: mixture weights must be positive and finite (leave a source out instead)"
            )
    if len({src for _, src in pairs}) < len(pairs):
        raise DataSourceError(
            f"a source appears twice in the mixture {' '.join(entries)!r}: give it one weight"
        )
    total = sum(_weight(w) for w, _ in pairs)
    return [(_weight(w) / total, src) for w, src in pairs]


def resolve_sources(data_path: str | list[str] | tuple[str, ...]) -> list[Source]:
    """Expand data_path entries (named sources, files, directories, globs) into sources, in order.
    A weighted mixture's weights are dropped here (its sources in order, e.g. for the tokenizer).

    A name in NAMED_SOURCES wins over a local path of the same name; write ./builtin for the path.
    """
    entries = [data_path] if isinstance(data_path, str | os.PathLike) else list(data_path)
    if (mixture := parse_mixture(entries)) is not None:
        entries = [src for _, src in mixture]
    if not entries:
        raise DataSourceError("data_path is empty: give at least one source, e.g. builtin")
    sources: list[Source] = []
    for entry in map(str, entries):
        scheme, _, arg = entry.partition(":")
        if scheme in NAMED_SOURCES:
            sources.append(NAMED_SOURCES[scheme](arg))
        else:
            sources.extend(_local_sources(entry))
    return sources


def iter_documents(sources: list[Source]) -> Iterator[str]:
    """All documents of all sources, in order."""
    for source in sources:
        yield from source.documents()
