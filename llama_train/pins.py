"""The pinned environments (constraints/cpu.txt, constraints/gpu.txt) against what is installed.

    python -m llama_train.pins check constraints/cpu.txt   # what `make setup` ends with: kept, differing
    python -m llama_train.pins lock constraints/cpu.txt    # `make lock`: the installed set becomes the pins
    python llama_train/pins.py unprovided FILE             # `make setup`: FILE less what the system provides
    python -m llama_train.pins wheels FILE [PYTHON] [SKIP] # `make wheels`: what a GPU image lacks, pinned

`make setup` installs with `pip -c FILE`, so a fresh clone gets exactly the versions the suite (CPU) or
the GPU runs used; `make setup CONSTRAINTS=` takes the newest that pyproject.toml allows, on purpose,
and `make lock` records them once the suite has passed on them. A pin has no local label: `torch==2.13.0`
is met by 2.13.0+cpu and 2.13.0+cu130 alike (which build: `python -m llama_train.gpu check`).
"""

import re
import subprocess
import sys
from importlib.metadata import PackageNotFoundError, distribution
from pathlib import Path

HEADER = """# Exact versions for `make setup` (pip -c): the set {what}.
# Written by `make lock` ({how}); `make setup CONSTRAINTS=` installs the newest that pyproject.toml
# allows instead, on purpose. A pin has no local label: torch==X is met by X+cpu and X+cuNNN alike.
"""


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def read_pins(path: str | Path) -> dict[str, str]:
    """{package: version} of a constraints file's `name==version` lines (comments and blanks skipped)."""
    pins = {}
    for number, raw in enumerate(Path(path).read_text().splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        name, sep, version = line.partition("==")
        if not sep or not name.strip() or not version.strip():
            raise ValueError(f"{path}:{number}: not a `name==version` pin: {raw!r}")
        pins[canonical(name.strip())] = version.strip()
    return pins


def public(version: str) -> str:
    """The version without its local label (2.13.0+cpu -> 2.13.0)."""
    return version.split("+", 1)[0]


def installed(name: str) -> tuple[str | None, str | None]:
    """(version, where) of an installed distribution; (None, None) when it is missing."""
    try:
        dist = distribution(name)
    except PackageNotFoundError:
        return None, None
    return dist.version, str(dist.locate_file(""))


def compare(pins: dict[str, str], prefix: str = sys.prefix) -> dict[str, list[str]]:
    """Each pin as `ok` (installed in this environment at the pinned version), `kept` (from the
    system's site-packages, at whatever version it has: a GPU image's own CUDA torch, which make setup
    leaves alone under SYSTEM_TORCH=1), `differs` or `missing`."""
    out = {"ok": [], "kept": [], "differs": [], "missing": []}
    for name, want in sorted(pins.items()):
        version, where = installed(name)
        if version is None:
            out["missing"].append(f"{name} (pinned {want})")
        elif where and not Path(where).resolve().is_relative_to(Path(prefix).resolve()):
            other = f" (pinned {want})" if public(version) != public(want) else ""
            out["kept"].append(f"{name} {version}{other}")
        elif public(version) != public(want):
            out["differs"].append(f"{name} {version} (pinned {want})")
        else:
            out["ok"].append(name)
    return out


def check(path: str) -> int:
    """One report line (two where something differs); exit 1 when a pin is not met."""
    result = compare(read_pins(path))
    key = sorted(result["kept"], key=lambda k: k.split()[0] not in ("torch", "deepspeed", "transformers"))
    more = f" and {len(key) - 6} more" if len(key) > 6 else ""
    kept = f"; kept from the system: {', '.join(key[:6])}{more}" if key else ""
    print(f"setup: {len(result['ok']) + len(result['kept'])} of {sum(map(len, result.values()))} "
          f"versions as {path} pins{kept}")  # fmt: skip
    bad = result["differs"] + result["missing"]
    if bad:
        print(f"setup: not as pinned: {', '.join(bad)} (make setup CONSTRAINTS= allows them on purpose)")
    return 1 if bad else 0


def unprovided(path: str, prefix: str = sys.prefix) -> str:
    """The constraints file less the pins of packages this Python has from outside its own environment:
    under SYSTEM_TORCH=1 a GPU image's torch, transformers, ... (make setup's .pth). pip would try to
    replace those with the pinned versions (and fail without an index); unpinned, the image's stay.
    Stdlib only: `make setup` runs it by path, before torch is in the venv."""
    kept, dropped = [], []
    for raw in Path(path).read_text().splitlines():
        name = canonical(raw.split("#", 1)[0].partition("==")[0].strip())
        where = installed(name)[1] if name else None
        outside = where and not Path(where).resolve().is_relative_to(Path(prefix).resolve())
        (dropped if outside else kept).append(name if outside else raw)
    note = f"# {path}, less what the system provides: {', '.join(dropped)}\n" if dropped else ""
    return note + "\n".join(kept) + "\n"


# where `make wheels`' wheels run: a GPU image's Linux x86-64 CPython (markers of Requires-Dist)
TARGET = {"sys_platform": "linux", "platform_system": "Linux", "platform_machine": "x86_64", "os_name": "posix",
          "implementation_name": "cpython", "platform_python_implementation": "CPython", "extra": ""}  # fmt: skip


def closure(roots: list[str], skip: set[str], python: str) -> set[str]:
    """The distributions `roots` need, recursively (their Requires-Dist without extras, evaluated for
    Linux and Python `python`), less `skip` and what only those need: from this environment's metadata."""
    from importlib.metadata import requires

    from packaging.requirements import Requirement

    env = {**TARGET, "python_version": python, "python_full_version": f"{python}.0"}
    seen, todo = set(), [canonical(r) for r in roots]
    while todo:
        name = todo.pop()
        if name in seen or name in skip:
            continue
        seen.add(name)
        try:
            needs = requires(name) or []
        except PackageNotFoundError:  # not installed here: pip resolves it (its version unpinned)
            continue
        reqs = (Requirement(r) for r in needs)
        todo += [canonical(r.name) for r in reqs if r.marker is None or r.marker.evaluate(env)]
    return seen


def wheel_set(pins_path: str, python: str = "3.12", skip: str = "torch") -> list[str]:
    """`make wheels`: what a GPU image with its own CUDA torch lacks, as pip requirements: the closure
    of this project's dependencies and DeepSpeed's (less `skip`, space-separated, and what only they
    need; less this project and DeepSpeed themselves, which PyPI has only as source), at `pins_path`'s
    versions, else as installed here; and the build system's requirements (pyproject.toml), for the
    editable install pip builds in an isolated environment."""
    import tomllib

    project = Path(__file__).resolve().parent.parent / "pyproject.toml"
    roots = [tomllib.loads(project.read_text())["project"]["name"], "deepspeed"]
    pins = read_pins(pins_path)
    names = sorted(
        closure(roots, {canonical(n) for n in skip.split()}, python) - {canonical(r) for r in roots}
    )
    versions = {n: pins.get(n) or public(installed(n)[0] or "") for n in names}
    build = tomllib.loads(project.read_text())["build-system"]["requires"]
    return [f"{n}=={v}" if v else n for n, v in versions.items()] + build


def lock(path: str) -> int:
    """Write the installed set (pip freeze, this checkout left out) as the pins of `path`."""
    freeze = subprocess.run(
        [sys.executable, "-m", "pip", "freeze", "--exclude-editable", "--disable-pip-version-check"],
        capture_output=True, text=True, check=True,
    ).stdout.split()  # fmt: skip
    lines = sorted(
        {f"{n}=={public(v)}" for n, _, v in (p.partition("==") for p in freeze) if v}, key=str.lower
    )
    how = f"Python {sys.version.split()[0]}, {sys.platform}"
    what = "the CPU suite passed on" if "cpu" in Path(path).name else "the GPU runs used"
    Path(path).write_text(HEADER.format(what=what, how=how) + "\n".join(lines) + "\n")
    print(f"wrote {len(lines)} pins to {path}")
    return 0


def main(argv: list[str]) -> int:
    verbs = {"check": check, "lock": lock, "unprovided": unprovided, "wheels": wheel_set}
    if len(argv) < 2 or argv[0] not in verbs or (argv[0] in ("check", "lock") and len(argv) != 2):
        print(__doc__, file=sys.stderr)
        return 2
    out = verbs[argv[0]](*argv[1:])
    if isinstance(out, int):
        return out
    print(out if isinstance(out, str) else "\n".join(out), end="" if isinstance(out, str) else "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
