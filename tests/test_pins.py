"""The pinned environments (llama_train/pins.py): what `make setup` installed is what constraints/
pins, every dependency pyproject.toml declares is pinned, and a pin not met is named."""

import pytest
import tomllib
import torch
from packaging.requirements import Requirement

from llama_train import pins
from tests.trainer_utils import ROOT

SET = ROOT / "constraints" / ("gpu.txt" if torch.cuda.is_available() else "cpu.txt")


def test_the_installed_versions_are_the_pinned_ones():
    result = pins.compare(pins.read_pins(SET))
    assert result["differs"] == result["missing"] == [], f"{SET.name}: {result}"


def test_every_declared_dependency_is_pinned_within_its_range():
    """pyproject.toml's dependencies and the dev extras (what `make test` installs) each have a pin in
    constraints/cpu.txt that their range admits: the CPU set is complete and consistent."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    cpu = pins.read_pins(ROOT / "constraints" / "cpu.txt")
    for spec in [*project["dependencies"], *project["optional-dependencies"]["dev"]]:
        req = Requirement(spec)
        name = pins.canonical(req.name)
        assert name in cpu, f"{req.name} is not pinned in constraints/cpu.txt"
        assert req.specifier.contains(cpu[name], prereleases=True), (spec, cpu[name])
    gpu = pins.read_pins(ROOT / "constraints" / "gpu.txt")
    assert {"torch", "deepspeed", "transformers"} <= set(gpu) and gpu["deepspeed"] == cpu["deepspeed"]


def test_a_pin_not_met_is_named(tmp_path, capsys):
    path = tmp_path / "pins.txt"
    path.write_text(
        f"# a comment\ntorch=={torch.__version__.split('+')[0]}\ntqdm==0.0.1\nno-such-package==1.0\n"
    )
    result = pins.compare(pins.read_pins(path))
    assert result["ok"] == ["torch"] and result["differs"][0].startswith("tqdm ")
    assert result["missing"] == ["no-such-package (pinned 1.0)"]
    assert pins.check(str(path)) == 1
    out = capsys.readouterr().out
    assert "setup: 1 of 3 versions as" in out and "not as pinned: tqdm" in out and "no-such-package" in out
    path.write_text("torch>=2.0\n")
    with pytest.raises(ValueError, match=r"pins.txt:1: not a `name==version` pin"):
        pins.read_pins(path)


def test_under_system_torch_what_the_system_provides_is_not_pinned(tmp_path):
    """make setup SYSTEM_TORCH=1 holds pip only to the pins of what the image lacks: pinned, its own torch
    and transformers would be replaced (offline: the setup fails)."""
    path = tmp_path / "pins.txt"
    path.write_text("# a comment\ntorch==2.11.0\ntransformers==5.17.0\nno-such-package==1.0\n")
    assert pins.unprovided(str(path)) == path.read_text()  # this venv holds them itself: all kept
    out = pins.unprovided(str(path), prefix=str(tmp_path))  # as if they came from outside the venv
    assert out.splitlines() == [
        f"# {path}, less what the system provides: torch, transformers", "# a comment", "no-such-package==1.0"
    ]  # fmt: skip
    assert pins.compare({"torch": "2.11.0"}, prefix=str(tmp_path))["kept"][0].endswith("(pinned 2.11.0)")


def test_the_wheel_folder_holds_what_a_gpu_image_lacks():
    """make wheels: DeepSpeed's and the project's dependencies, recursively, less torch, transformers and
    what only they need, at constraints/gpu.txt's versions, and the build backend for the editable install."""
    wanted = pins.wheel_set(str(ROOT / "constraints" / "gpu.txt"), "3.12", "torch transformers")
    names = {w.split("==")[0].split(">")[0] for w in wanted}
    assert {
        "hjson",
        "pydantic",
        "pydantic-core",
        "annotated-types",
        "py-cpuinfo",
        "sentencepiece",
        "psutil",
    } <= names
    assert not names & {"torch", "transformers", "tokenizers", "huggingface-hub", "deepspeed", "llama-train"}
    assert "pydantic==2.14.4" in wanted and "sentencepiece==0.2.2" in wanted and "setuptools>=77" in wanted
