"""The documentation cannot rot silently: every shell command in README.md and docs/*.md names
programs, flags, scripts and make targets that exist; every relative link, anchor and image
resolves; every table renders; every page is reachable from the README; figures the README quotes
come from the result files the benchmark wrote."""

import argparse
import csv
import os
import re
import runpy
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SHELL_FENCES = {"", "bash", "sh", "shell", "console"}
COMMAND_WORDS = {"python", "python3", "deepspeed", "torchrun", "make", "bash", "sbatch", "source", "env"}


def fenced_blocks(text: str):
    """(language, lines) of every fenced code block."""
    lang, lines = None, []
    for line in text.split("\n"):
        if line.startswith("```"):
            if lang is None:
                lang, lines = line[3:].strip(), []
            else:
                yield lang, lines
                lang = None
        elif lang is not None:
            lines.append(line)


def prose(text: str) -> str:
    """The text outside fenced code blocks."""
    return re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)


def commands(page: Path):
    """Every command line of the page's shell blocks, continuations joined, split at ; && | and
    with its comment dropped, as a list of words."""
    for lang, lines in fenced_blocks(page.read_text()):
        if lang not in SHELL_FENCES:
            continue
        joined = "\n".join(lines).replace("\\\n", " ")
        for line in joined.split("\n"):
            line = re.sub(r"(^|\s)#.*$", "", line)
            for part in re.split(r"&&|\|\||;|\|", line):
                try:
                    words = shlex.split(part)
                except ValueError:
                    words = part.split()
                while words and re.match(r"^[A-Z_][A-Z0-9_]*=", words[0]):  # VAR=value prefixes
                    words = words[1:]
                if words and (words[0] in COMMAND_WORDS or words[0].startswith(("scripts/", ".venv/bin/"))):
                    yield words


class Parsed(Exception):
    def __init__(self, parser):
        self.parser = parser


_PARSERS: dict = {}


def options_of(program: str) -> set[str]:
    """The option strings of a program's argparse parser, caught at its first parse (nothing runs)."""
    if program not in _PARSERS:

        def catch(self, *a, **k):
            raise Parsed(self)

        saved = argparse.ArgumentParser.parse_known_args, sys.argv
        argparse.ArgumentParser.parse_known_args = catch
        sys.argv = [program]
        try:
            runpy.run_path(str(ROOT / program), run_name="__main__")
            raise AssertionError(f"{program} never parsed its arguments")
        except Parsed as p:
            _PARSERS[program] = set(p.parser._option_string_actions)
        finally:
            argparse.ArgumentParser.parse_known_args, sys.argv = saved
    return _PARSERS[program]


def checked_programs(words):
    """(program, its flags) for each train_*.py or scripts/*.py in a command line."""
    for i, word in enumerate(words):
        if re.fullmatch(r"(train_(deepspeed|ddp)|scripts/\w+)\.py", word):
            flags = [w.split("=", 1)[0] for w in words[i + 1 :] if re.match(r"^--[a-z]", w)]
            yield word, flags


def all_commands():
    return [(page, words) for page in PAGES for words in commands(page)]


def test_every_flag_in_the_docs_exists_in_its_programs_parser():
    problems, seen = [], 0
    for page, words in all_commands():
        for program, flags in checked_programs(words):
            if not (ROOT / program).exists():
                problems.append(f"{page.name}: {program} does not exist")
                continue
            options = options_of(program)
            seen += 1
            problems += [
                f"{page.name}: {program} has no {f} ({' '.join(words)})" for f in flags if f not in options
            ]
    assert seen > 30, f"only {seen} trainer/script commands found: is the extraction broken?"
    assert not problems, "\n".join(problems)


def make_targets() -> set[str]:
    return set(re.findall(r"^([a-z][\w-]*):", (ROOT / "Makefile").read_text(), flags=re.M))


def test_every_script_and_make_target_in_the_docs_exists():
    problems, targets = [], make_targets()
    for page, words in all_commands():
        for word in words:
            if re.fullmatch(r"scripts/[\w./-]+", word) and not (ROOT / word).exists():
                problems.append(f"{page.name}: {word} does not exist")
        if words[0] == "make":
            problems += [
                f"{page.name}: no make target {w}" for w in words[1:] if "=" not in w and w not in targets
            ]
    assert not problems, "\n".join(problems)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    return {slug(h) for h in re.findall(r"^#{1,6} (.+)$", prose(page.read_text()), flags=re.M)}


def links(page: Path):
    for target in re.findall(r"\]\(([^)\s]+)\)", prose(page.read_text())):
        if not re.match(r"^[a-z]+:", target):
            yield target


def test_every_relative_link_anchor_and_image_resolves():
    problems = []
    for page in PAGES:
        for target in links(page):
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if not dest.exists():
                problems.append(f"{page.name}: {target} does not exist")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                problems.append(f"{page.name}: {target}: no heading with anchor #{anchor} in {dest.name}")
    assert not problems, "\n".join(problems)


def test_every_docs_page_is_reachable_from_the_readme_and_the_readme_is_short():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 250
    seen, todo = set(), [ROOT / "README.md"]
    while todo:
        page = todo.pop()
        if page in seen:
            continue
        seen.add(page)
        for target in links(page):
            dest = (page.parent / target.partition("#")[0]).resolve()
            if dest.suffix == ".md" and dest.exists():
                todo.append(dest)
    unreachable = sorted(p.name for p in PAGES if p not in seen)
    assert not unreachable, f"not linked from README.md (directly or through a page): {unreachable}"


def test_every_table_has_its_header_delimiter_row():
    problems = []
    for page in PAGES:
        lines = prose(page.read_text()).split("\n")
        for i, line in enumerate(lines):
            starts = line.startswith("|") and not (i and lines[i - 1].startswith("|"))
            if starts and not re.match(
                r"^\|(\s*:?-{3,}:?\s*\|)+\s*$", lines[i + 1] if i + 1 < len(lines) else ""
            ):
                problems.append(f"{page.name}: table '{line[:60]}' has no |---| row under its header")
    assert not problems, "\n".join(problems)


def newest_results() -> Path:
    return sorted((ROOT / "docs" / "benchmarks").glob("*/results.csv"))[-1]


def test_the_readmes_divergence_figure_is_the_newest_benchmarks():
    rows = list(csv.DictReader(newest_results().open()))
    worst = max(float(r["loss_diff_vs_ddp"]) for r in rows if r["loss_diff_vs_ddp"])
    mantissa, exponent = f"{worst:.1e}".split("e")
    quoted = f"within {mantissa}e{int(exponent)}"
    assert quoted in (ROOT / "README.md").read_text().replace("\n", " "), (quoted, newest_results())


@pytest.mark.parametrize("script", ["run_deepspeed.sh", "run_ddp.sh"])
def test_the_reference_scripts_say_they_need_a_corpus(script):
    env = {k: v for k, v in os.environ.items() if k != "DATA_PATH"}
    proc = subprocess.run(["bash", f"scripts/{script}"], cwd=ROOT, env=env, capture_output=True, text=True)
    assert proc.returncode == 2
    assert proc.stderr.startswith("error: the reference launch needs a corpus: set DATA_PATH"), proc.stderr


@pytest.mark.parametrize("trainer", ["train_deepspeed.py", "train_ddp.py"])
def test_every_trainer_flag_is_in_the_configuration_page(trainer):
    page = (ROOT / "docs" / "configuration.md").read_text()
    named = set(re.findall(r"--[a-z][a-z0-9_]*", page))
    flags = {f.replace("--no-", "--") for f in options_of(trainer)} - {"-h", "--help"}  # --no-X: X's off form
    missing = sorted(flags - named)
    assert not missing, f"docs/configuration.md's flag table lacks {missing}"


def test_the_benchmark_pages_tables_are_the_newest_result_files():
    """docs/benchmarks.md shows the newest dated results.md's rows as the benchmark wrote them."""
    newest = newest_results().with_name("results.md").read_text()
    page = (ROOT / "docs" / "benchmarks.md").read_text()
    rows = [
        line for line in page.split("\n") if re.match(r"^\| [a-z0-9]", line) and "](benchmarks/" not in line
    ]
    rows = [row for row in rows if not row.startswith("| date |")]  # the index of dated runs
    assert len(rows) > 20
    copied = [row for row in rows if row not in newest]
    assert not copied, f"rows not in {newest_results().parent.name}/results.md: {copied}"
