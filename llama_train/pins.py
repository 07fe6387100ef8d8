"""The pinned environments (constraints/cpu.txt, constraints/gpu.txt) against what is installed.

    python -m llama_train.pins check constraints/cpu.txt   # what `make setup` ends with: kept, differing
    python -m llama_train.pins lock constraints/cpu.txt    # `make lock`: the installed set becomes the pins

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
    """Each pin as `ok` (installed in this environment at the pinned version), `kept` (at the pinned
    version, from the system's site-packages: a GPU image's own CUDA torch), `differs` or `missing`."""
    out = {"ok": [], "kept": [], "differs": [], "missing": []}
    for name, want in sorted(pins.items()):
        version, where = installed(name)
        if version is None:
            out["missing"].append(f"{name} (pinned {want})")
        elif public(version) != public(want):
            out["differs"].append(f"{name} {version} (pinned {want})")
        elif where and not Path(where).resolve().is_relative_to(Path(prefix).resolve()):
            out["kept"].append(f"{name} {version}")
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


if __name__ == "__main__":
    verbs = {"check": check, "lock": lock}
    if len(sys.argv) != 3 or sys.argv[1] not in verbs:
        print(__doc__, file=sys.stderr)
        sys.exit(2)
    sys.exit(verbs[sys.argv[1]](sys.argv[2]))
