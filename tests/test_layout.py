"""The code's shape, checked: modules import without a circle and never up the declared layers,
errors are leaves, utils/data is entered through its one door, functions stay short, and the two
trainers differ only where the strategy does (issues: code shape; one way in).

    python -m tests.test_layout [ROOT]    # the module graph's figures (of another checkout too)
"""

import ast
import difflib
import os
import subprocess
import sys
from pathlib import Path

from tests.trainer_utils import ROOT, env

PACKAGES = ("llama_train", "utils")
MAX_FUNCTION_LINES = 60
MAX_TWIN_DIFF = 120
# The declared layering, lowest first: a module imports only from its own layer or one below.
# Matched by the longest prefix of the module's name; each folder of llama_train/ is one floor.
FOUNDATION = ("errors", "console", "fileio", "steps", "gpu", "cpu", "pins")  # leaves, and the machine's facts
LAYERS = (
    tuple(f"llama_train.{m}" for m in FOUNDATION),
    ("utils",),  # the data package: text, tokenizer, token cache
    ("llama_train.model", "llama_train.hf"),  # the model and its transformers adapter
    ("llama_train.optim",),  # optimizers and LR schedules
    ("llama_train.distributed",),  # process groups, ds_config, FSDP2, TP/SP/PP, compile
    ("llama_train.plan",),  # memory, communication and the planner
    ("llama_train.telemetry",),  # metrics, timing, report writers, goodput
    ("llama_train.checkpoint",),  # store, weights readers, moves, async saves
    ("llama_train.ops",),  # hostfiles, the watchdog
    ("llama_train.launch",),  # the launch front (python -m llama_train.launch)
    ("llama_train.train",),  # the run both trainers share
    ("llama_train.cli", "llama_train.config"),  # flags and their validation
    ("llama_train",),  # the package's own __init__
    ("llama_train.bench",),  # the benchmark's logic, over the library
    ("train_ddp", "train_deepspeed", "scripts"),  # entry points: nothing imports them
)


def python_files(root: Path = ROOT, scripts: bool = False) -> list[Path]:
    files = [p for pkg in PACKAGES for p in sorted((root / pkg).rglob("*.py"))] + sorted(
        root.glob("train_*.py")
    )
    return files + (sorted((root / "scripts").glob("*.py")) if scripts else [])


def module_name(path: Path, root: Path = ROOT) -> str:
    return ".".join(path.relative_to(root).with_suffix("").parts).removesuffix(".__init__")


def import_nodes(path: Path):
    """(module, names) of every import in `path`, functions included: names is None for `import m`."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            yield from ((a.name, None) for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            yield node.module, [a.name for a in node.names]


def imports_of(path: Path, modules: set[str]) -> set[str]:
    """The project modules `path` imports anywhere in it (functions too): `from a.b import c` is
    a.b.c when that is a module, else a.b."""
    return set().union(*(imports_of_one(m, names, modules) for m, names in import_nodes(path))) & modules


def imports_of_one(module: str, names: list[str] | None, modules: set[str]) -> set[str]:
    sub = {f"{module}.{n}" for n in names or ()} & modules
    return sub if sub and len(sub) == len(names) else {module} | sub


def import_graph(root: Path = ROOT, scripts: bool = False) -> dict[str, set[str]]:
    files = {module_name(p, root): p for p in python_files(root, scripts)}
    return {m: imports_of(p, set(files)) - {m} for m, p in files.items()}


def layer_of(module: str) -> int:
    matches = [
        (len(prefix), i)
        for i, prefixes in enumerate(LAYERS)
        for prefix in prefixes
        if module == prefix or module.startswith(prefix + ".")
    ]
    assert matches, f"{module} is in no declared layer (tests/test_layout.py LAYERS)"
    return max(matches)[1]


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    return sorted(f"{a} -> {b}" for a, bs in graph.items() for b in bs if layer_of(a) < layer_of(b))


def longest_chain(graph: dict[str, set[str]]) -> list[str]:
    """The longest import chain (module -> what it imports -> ...) of a graph without circles."""
    memo: dict[str, list[str]] = {}

    def chain(m: str) -> list[str]:
        if m not in memo:
            memo[m] = [m] + max((chain(n) for n in sorted(graph[m])), key=len, default=[])
        return memo[m]

    return max((chain(m) for m in sorted(graph)), key=len)


def test_no_import_circle():
    graph = import_graph(scripts=True)
    state: dict[str, str] = {}

    def visit(m: str, trail: list[str]):
        state[m] = "open"
        for n in sorted(graph[m]):
            assert state.get(n) != "open", "import circle: " + " -> ".join(trail[trail.index(n) :] + [n])
            if n not in state:
                visit(n, trail + [n])
        state[m] = "done"

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])


def test_no_import_runs_up_the_declared_layers():
    """The floors of LAYERS, lowest first (errors, utils/data, model, optim, distributed, plan,
    telemetry, checkpoint, ops, train, config, bench, entry points): an import the other way (the
    planner reading the benchmark's strategy list, the data package importing the training library)
    would tie a lower floor to a higher one."""
    assert upward_imports(import_graph(scripts=True)) == []


ERRORS = ROOT / "llama_train" / "errors.py"


def error_classes() -> set[str]:
    return {n.name for n in ast.parse(ERRORS.read_text()).body if isinstance(n, ast.ClassDef)}


def test_errors_are_leaves_defined_and_imported_in_one_place():
    """Every error class lives in llama_train/errors.py, which imports nothing, and is imported from
    there: no module imports config.py or checkpoint.py just to raise."""
    assert not list(import_nodes(ERRORS)), "llama_train/errors.py imports something"
    errors, elsewhere, detours = error_classes(), [], []
    for path in python_files(scripts=True):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            bases = {getattr(b, "id", getattr(b, "attr", None)) for b in getattr(node, "bases", [])}
            if isinstance(node, ast.ClassDef) and path != ERRORS and bases & (errors | {"Exception"}):
                elsewhere.append(f"{path.relative_to(ROOT)}: class {node.name}")
        detours += [
            f"{path.relative_to(ROOT)}: from {module} import {', '.join(set(names) & errors)}"
            for module, names in import_nodes(path)
            if names and set(names) & errors and module != "llama_train.errors"
        ]
    assert not elsewhere and not detours, elsewhere + detours


def data_door() -> set[str]:
    """utils/data/__init__.py's __all__."""
    for node in ast.parse((ROOT / "utils" / "data" / "__init__.py").read_text()).body:
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == "__all__":
            return set(ast.literal_eval(node.value))
    raise AssertionError("utils/data/__init__.py has no __all__")


def test_utils_data_is_entered_through_its_door():
    """The trainers, llama_train and scripts/ import utils.data's public names only: `from utils.data
    import NAME` with NAME in its __all__, never a module behind it."""
    public, stray = data_door(), []
    users = [p for p in python_files(scripts=True) if not module_name(p).startswith("utils")]
    for path in users:
        for module, names in import_nodes(path):
            if module.startswith("utils") and (module != "utils.data" or not set(names or ["*"]) <= public):
                stray.append(f"{path.relative_to(ROOT)}: {module} {names or ''}")
    assert not stray, stray


def test_utils_cannot_be_shadowed(tmp_path):
    """A PyPI package named `utils` (there is one) installed in site-packages comes before an editable
    install's finder, so a script under scripts/ imports it instead of ours; where it has a `data` of
    its own, importing llama_train names the cause instead of a script failing on it later."""
    fake = tmp_path / "site" / "utils"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("")
    (fake / "data.py").write_text("")  # e.g. a utils.data module of its own
    e = env() | {"PYTHONPATH": os.pathsep.join([str(fake.parent), str(ROOT)])}  # searched as site-packages is
    cmd = [sys.executable, "scripts/export_hf.py", "--help"]
    proc = subprocess.run(cmd, cwd=ROOT, env=e, capture_output=True, text=True, timeout=120)
    last = proc.stderr.strip().splitlines()[-1]
    assert proc.returncode == 1 and last.startswith("ImportError: utils.data is ")
    assert (
        f"{fake / 'data.py'}, not this project's {ROOT / 'utils' / 'data'}" in last
        and "pip uninstall utils" in last
    )


def declares_flags(fn: ast.FunctionDef) -> bool:
    """A function that is mostly argparse declarations, one add_argument after another."""
    calls = [n for n in ast.walk(fn) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)]
    return sum(c.func.attr == "add_argument" for c in calls) >= 8


def test_functions_are_short():
    long = []
    for path in python_files(scripts=True):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef) and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES:
                if not declares_flags(node):
                    long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}")
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines: {long}"


def test_twin_trainers_differ_only_where_the_strategy_does():
    ddp, ds = ((ROOT / name).read_text().splitlines() for name in ("train_ddp.py", "train_deepspeed.py"))
    changed = [line for line in difflib.unified_diff(ddp, ds, lineterm="", n=0) if line[:1] in "+-"]
    changed = [line for line in changed if not line.startswith(("+++", "---"))]
    assert len(changed) < MAX_TWIN_DIFF, "\n".join(changed)
    main = {name: src[src.index("def main():") :] for name, src in (("ddp", ddp), ("ds", ds))}
    differ = [line for line in difflib.ndiff(main["ddp"], main["ds"]) if line[:1] in "+-"]
    assert len(differ) <= 10, "main() differs beyond the strategy's own lines:\n" + "\n".join(differ)


def mentions(word: str) -> set[str]:
    """The package's files (relative paths) whose text names `word`, in any case: what `git grep -il`
    lists."""
    files = sorted((ROOT / "llama_train").rglob("*.py"))
    return {str(p.relative_to(ROOT)) for p in files if word.lower() in p.read_text().lower()}


def test_optimizers_are_named_only_in_their_records():
    """Each optimizer but AdamW (every optimizer's other half) is named only in its own record's file,
    llama_train/optim/NAME.py, the list of records (optim/registry.py) and the benchmark's labels
    (bench/): every other module asks its record (llama_train/optim/spec.py)."""
    from llama_train.optim.registry import OPTIMIZERS

    for name in set(OPTIMIZERS) - {"adamw"}:
        outside = {f for f in mentions(name) if not f.startswith("llama_train/bench/")}
        own = {f"llama_train/optim/{name}.py", "llama_train/optim/registry.py"}
        assert outside == own, f"{name!r} named outside its record: {outside - own}"


def name_matches(path: Path, names: set[str]) -> list[str]:
    """Where `path` matches a string against one of `names`: compares it (==, !=, in) or lists it in a
    set, tuple or list (what `in` tests against), as 'file:line name'."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
        elif isinstance(node, ast.Set | ast.Tuple | ast.List):
            operands = node.elts
        else:
            continue
        out += [
            f"{path.relative_to(ROOT)}:{o.lineno} {o.value!r}"
            for o in operands
            if isinstance(o, ast.Constant) and o.value in names
        ]
    return out


def test_strategies_are_matched_only_in_their_table():
    """No module matches a strategy's name (the benchmark's and planner's, or a run's recorded one)
    outside the strategy table, llama_train/distributed/strategies.py, and the benchmark's labels
    (bench/): checkpoint, memory, planner and comm ask the records."""
    from llama_train.distributed.strategies import DDP, FSDP2, STRATEGIES

    names = {*STRATEGIES, DDP.name, FSDP2.name}
    table = ROOT / "llama_train" / "distributed" / "strategies.py"
    files = [p for p in (ROOT / "llama_train").rglob("*.py") if p != table and "bench" not in p.parts]
    found = [hit for p in sorted(files) for hit in name_matches(p, names)]
    assert not found, f"strategy names matched outside the table: {found}"


# Where an engine's kind may be asked: the engines themselves, and the DeepSpeed and FSDP2 code they call
ENGINE_IMPLEMENTATIONS = {
    "llama_train/train/engines/ds_engine.py",
    "llama_train/train/engines/torch_engine.py",
    "llama_train/distributed/ds_compat.py",  # DeepSpeed 0.19's patches, each with its probe
    "llama_train/distributed/ds_cpu.py",
    "llama_train/distributed/pipeline.py",  # DeepSpeed's PipelineEngine
    "llama_train/distributed/fsdp.py",  # FSDP2's wrapping, full state and collectives
}
KIND_PREDICATES = {"is_deepspeed", "is_pipeline", "is_fsdp"}
# attributes only one kind of engine (or its parameters) has: asking for one asks which kind is in hand
KIND_MARKERS = {
    "_hp_mapping",
    "zero_optimization_stage",
    "load_source",
    "global_steps",
    "seq_data_parallel_group",
    "loss_scaler",
    "loss_scale_config",
    "scaler",
    "to_local",
    "full_tensor",
}


def dotted(node: ast.AST) -> str:
    """`engine`, `self.engine`, `engine.optimizer` for a name or attribute chain; '' otherwise."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{dotted(node.value)}.{node.attr}"
    return ""


def engine_kind_probes(path: Path) -> list[str]:
    """Where `path` asks which kind of engine it holds, as 'file:line what': a kind predicate
    (is_deepspeed(engine)), hasattr/getattr/isinstance/type on an engine, hasattr/getattr of an attribute
    only one kind has (DeepSpeed's `ds_*` parameter marks, `_hp_mapping`, FSDP2's `to_local`, ...),
    or DeepSpeed's own zero_optimization_stage() asked of an engine."""
    out = []
    calls = [n for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.Call)]
    for node in sorted(calls, key=lambda n: (n.lineno, n.col_offset)):
        func = node.func.id if isinstance(node.func, ast.Name) else getattr(node.func, "attr", "")
        subject = dotted(node.args[0]) if node.args else ""
        attr = node.args[1] if len(node.args) > 1 else None
        marker = isinstance(attr, ast.Constant) and isinstance(attr.value, str)
        marker = marker and (attr.value.startswith("ds_") or attr.value in KIND_MARKERS)
        if (
            func in KIND_PREDICATES
            or func == "zero_optimization_stage"
            or func in ("hasattr", "getattr", "isinstance", "type")
            and "engine" in subject.split(".")
            or func in ("hasattr", "getattr")
            and marker
        ):
            out.append(
                f"{path.relative_to(ROOT) if path.is_relative_to(ROOT) else path.name}:{node.lineno} {ast.unparse(node)}"
            )
    return out


def test_shared_code_never_asks_which_engine_it_holds():
    """Only the engines (llama_train/train/engines/) and the DeepSpeed and FSDP2 code they call know
    which kind of engine is in hand; everything else asks the Engine protocol (engines/engine.py) or
    the run's strategy. A new kind of engine is then one implementation, not a branch in each module."""
    files = [p for p in python_files(scripts=True) if str(p.relative_to(ROOT)) not in ENGINE_IMPLEMENTATIONS]
    files = [p for p in files if not p.name.startswith("train_")]  # each trainer knows its own engine
    probes = [hit for p in files for hit in engine_kind_probes(p)]
    assert not probes, f"engine-kind probes in shared code: {probes}"


def test_the_probe_finder_finds_the_probes_of_round_4(tmp_path):
    """The checks the round-4 code made in checkpoint/portable.py and telemetry/metrics.py are found."""
    code = tmp_path / "portable.py"
    code.write_text(
        "def load_into(engine, reader):\n"
        "    if hasattr(engine, 'load_source'):\n"
        "        engine.load_source(reader)\n"
        "    elif not is_deepspeed(engine):\n"
        "        pass\n"
        "    elif any(hasattr(p, 'ds_id') for p in engine.module.parameters()):\n"
        "        stage = engine.zero_optimization_stage()\n"
        "    local = sum(getattr(p, 'ds_numel', p.numel()) for p in engine.module.parameters())\n"
        "    scaler = getattr(engine, 'scaler', None)\n"
    )
    assert [hit.split()[0] for hit in engine_kind_probes(code)] == [
        f"portable.py:{n}" for n in (2, 4, 6, 7, 8, 9)
    ]


def test_checkpoint_takes_no_engine():
    """checkpoint/ reads and writes files and the neutral form; it never holds an engine, so it cannot
    call up into the engines (train/) through one, a call no import test sees."""
    found = [
        f"{p.relative_to(ROOT)}:{node.lineno} {node.name}({', '.join(a.arg for a in node.args.args)})"
        for p in sorted((ROOT / "llama_train" / "checkpoint").glob("*.py"))
        for node in ast.walk(ast.parse(p.read_text()))
        if isinstance(node, ast.FunctionDef) and any("engine" in a.arg for a in node.args.args)
    ]
    assert not found, found


def test_one_torch_load():
    """Every file the package unpickles goes through checkpoint/formats.safe_load (weights only, the
    DeepSpeed data classes it allows): the package calls torch.load once, there."""
    calls = [
        f"{p.relative_to(ROOT)}:{node.lineno}"
        for p in sorted((ROOT / "llama_train").rglob("*.py"))
        for node in ast.walk(ast.parse(p.read_text()))
        if isinstance(node, ast.Attribute)
        and node.attr == "load"
        and getattr(node.value, "id", "") == "torch"
    ]
    assert len(calls) == 1 and calls[0].startswith("llama_train/checkpoint/formats.py"), calls


def face_exports(root: Path, modules: set[str]) -> dict[str, dict[str, str]]:
    """Package faces (an __init__.py that defines nothing, only hands names on): for each, which
    module every name it hands on comes from."""
    out = {}
    for m in modules:
        init = root / m.replace(".", "/") / "__init__.py"
        if init.is_file():
            body = ast.parse(init.read_text()).body
            if not any(isinstance(n, ast.FunctionDef | ast.ClassDef) for n in body):
                out[m] = {
                    a.asname or a.name: n.module
                    for n in body
                    if isinstance(n, ast.ImportFrom)
                    for a in n.names
                }
    return out


def through_faces(graph: dict[str, set[str]], root: Path) -> dict[str, set[str]]:
    """The graph with `from utils.data import x` an import of the module that defines x, as a reader
    follows it (the face itself left out)."""
    faces = face_exports(root, set(graph))
    files = {module_name(p, root): p for p in python_files(root, scripts=True)}
    out = {}
    for m, p in files.items():
        if m in faces:
            continue
        found = set()
        for module, names in import_nodes(p):
            if module in faces and names:  # a submodule, or the module the face took the name from
                found |= {
                    f"{module}.{n}" if f"{module}.{n}" in graph else faces[module].get(n) for n in names
                }
            else:
                found |= imports_of_one(module, names, set(graph))
        out[m] = (found & set(graph)) - set(faces) - {m}
    return out


def figures(root: Path) -> str:
    """The module graph of the checkout at `root`: modules, imports, its depth (the longest import
    chain, package faces passed through) and the imports that run up the declared layers."""
    graph = import_graph(root, scripts=True)
    library = {m: bs for m, bs in through_faces(graph, root).items() if m.startswith(PACKAGES)}
    chain = longest_chain(library)
    up = upward_imports(graph)
    return "\n".join(
        [
            f"modules {len(graph)} (package {len(library)}), imports {sum(map(len, graph.values()))}",
            f"depth of the package: {len(chain)} modules: {' -> '.join(chain)}",
            f"imports up the declared layers: {len(up)}" + "".join(f"\n  {u}" for u in up),
        ]
    )


if __name__ == "__main__":
    print(figures(Path(sys.argv[1]).resolve() if len(sys.argv) > 1 else ROOT))
