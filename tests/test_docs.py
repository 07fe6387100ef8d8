"""The documentation cannot rot silently: every shell command in README.md and docs/*.md names
programs, flags, scripts and make targets that exist; every relative link, anchor and image
resolves; every table renders; every page is reachable from the README; a figure quoted beside a link
to a dated result file under docs/benchmarks/ is in that file, with the file's date and machine; no
figure says "here" or "this machine" for its machine; the pages hold no development history (issue
numbers, goals, what it was before, commit ids, paths outside the repository: CHANGELOG.md and the git
log hold that); the code's pointers into the docs resolve."""

import argparse
import bisect
import csv
import os
import re
import runpy
import shlex
import subprocess
import sys
from decimal import Decimal
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


def parser_of(program: str) -> argparse.ArgumentParser:
    """A program's argparse parser, caught at its first parse (nothing runs)."""
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
            _PARSERS[program] = p.parser
        finally:
            argparse.ArgumentParser.parse_known_args, sys.argv = saved
    return _PARSERS[program]


def options_of(program: str) -> set[str]:
    """The option strings of a program's parser."""
    return set(parser_of(program)._option_string_actions)


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


# --- one source for each figure: quoted beside its result file, with that file's machine and date ---

RESULTS = ROOT / "docs" / "benchmarks"
RESULT_SUFFIXES = {".md", ".txt", ".csv", ".json"}
# words of a result folder's name that say what was run, not on which machine
NOT_A_MACHINE = {"cpu", "gpu", "check", "optim", "dtype", "amx", "demo"}
PAGE_NUMBER = re.compile(r"(?<![\w.])(\d+(?:,\d{3})*(?:\.\d+)?(?:e[+-]?\d+)?)(k\b)?", re.I)
ANY_NUMBER = re.compile(r"\d+(?:,\d{3})*(?:\.\d+)?(?:e[+-]?\d+)?", re.I)
DATE = re.compile(r"\b\d{4}-\d{2}-\d{2}\b")


def without_code_spans(text: str) -> str:
    return re.sub(r"(`+).+?\1", " ", text, flags=re.S)


def cells(row: str) -> list[str]:
    return [c.strip() for c in row.strip().strip("|").split("|")]


def blocks(text: str):
    """(text, caption, header) of every paragraph, list item, heading and table row of a page's prose;
    a table row's caption is the paragraph right above its table (where a table's source is named),
    its header the table's first row ("" for the rest)."""
    out, current, caption, header, prev_kind, prev_line = [], [], "", "", None, ""
    for line in prose(text).split("\n") + [""]:
        kind = "row" if line.startswith("|") else ("blank" if not line.strip() else "text")
        starts_item = re.match(r"^\s*([-*]|\d+\.)\s|^#", line)
        if current and (kind != "text" or starts_item):
            out.append(("\n".join(current), "", ""))
            caption, current = "\n".join(current), []
        if kind == "row":
            header = header if prev_line.startswith("|") else line
            if line != header and not re.match(r"^\|[\s:|-]+$", line):
                out.append((line, caption, header))
        elif kind == "text":
            if prev_kind == "row":
                caption = ""
            current.append(line)
        prev_kind, prev_line = (kind if kind != "blank" else prev_kind), line
    return out


def result_files(page: Path, text: str) -> list[Path]:
    """The files under docs/benchmarks/ that a block links (a folder: its text files)."""
    files = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        dest = (page.parent / target.partition("#")[0]).resolve()
        if RESULTS not in dest.parents or not dest.exists():
            continue
        found = [dest] if dest.is_file() else sorted(dest.rglob("*"))
        files += [f for f in found if f.suffix in RESULT_SUFFIXES]
    return files


def source_numbers(files: list[Path]) -> tuple[list[float], str]:
    """Every number in the files and their paths (sorted), and their text."""
    text = "\n".join(f"{f.relative_to(RESULTS)}\n{f.read_text(errors='replace')}" for f in files)
    numbers = sorted(float(n.replace(",", "")) for n in ANY_NUMBER.findall(text))
    return numbers, text


def quoted(number: str, thousands: str) -> tuple[float, float]:
    """A quoted figure's value and half the step of its last digit: 48 matches 48.41, 2.1e-7 matches
    2.1e-07, 35k matches 35,396."""
    d = Decimal(number.replace(",", ""))
    step = Decimal(1).scaleb(d.as_tuple().exponent)
    scale = 1000 if thousands else 1
    return float(d) * scale, float(step) * scale / 2


def in_source(value: float, half_step: float, numbers: list[float]) -> bool:
    i = bisect.bisect_left(numbers, value - half_step * (1 + 1e-9))
    return i < len(numbers) and numbers[i] <= value + half_step * (1 + 1e-9)


def figure_problems(page: Path, text: str) -> list[str]:
    """Every number of a paragraph or table row that links a result file (or whose table's caption
    does) occurs in the linked files; the linking paragraph names the folder's date and machine."""
    problems = []
    for block, caption, header in blocks(text):
        files = result_files(page, block) or result_files(page, caption)
        if not files:
            continue
        numbers, source = source_numbers(files)
        where = f"{page.name}: '{block.strip()[:70]}'"
        if result_files(page, block):  # the sentence that names the source names its machine and date
            for folder in {f.relative_to(RESULTS).parts[0] for f in files}:
                date, machine = folder[:10], set(folder[11:].split("-")) - NOT_A_MACHINE
                machine = {w for w in machine if not re.fullmatch(r"\d+core", w)}
                if date not in block or not any(w in block.lower() for w in machine):
                    problems.append(f"{where}: quotes {folder} without its date {date} and machine {machine}")
        if header:  # a "planned" column holds the planner's figures: checked against the planner below
            block = " | ".join(c for c, h in zip(cells(block), cells(header)) if "planned" not in h.lower())
        plain = without_code_spans(re.sub(r"\]\([^)\s]+\)", "]", block))
        for date in DATE.findall(plain):
            if date not in source:
                problems.append(f"{where}: date {date} is not in {[f.name for f in files]}")
        for number, thousands in PAGE_NUMBER.findall(DATE.sub(" ", plain)):
            if not in_source(*quoted(number, thousands), numbers):
                problems.append(f"{where}: {number}{thousands} is not in {[f.name for f in files]}")
    return problems


def test_figures_quoted_beside_a_result_file_are_in_it():
    problems = [p for page in PAGES for p in figure_problems(page, page.read_text())]
    assert not problems, "\n".join(problems)


def test_the_figure_check_catches_a_wrong_figure():
    page = ROOT / "docs" / "gpu.md"
    text = page.read_text()
    assert "462.9 ms" in text and not figure_problems(page, text)
    assert any("426.9" in p for p in figure_problems(page, text.replace("462.9 ms", "426.9 ms")))


def test_every_dated_result_folder_is_in_the_benchmark_pages_index():
    index = (ROOT / "docs" / "benchmarks.md").read_text()
    missing = [
        d.name for d in sorted(RESULTS.iterdir()) if d.is_dir() and f"](benchmarks/{d.name}/" not in index
    ]
    assert not missing, f"docs/benchmarks.md's index of dated results lacks {missing}"


# --- no figure without its machine ---

MACHINE_WORDS = re.compile(r"\bthis (\d-core )?(cpu )?(machine|cpu|vm|box)\b|\bmeasured here\b", re.I)


def machine_ref_problems(name: str, text: str) -> list[str]:
    """'this machine', 'this CPU' and a 'here' in a sentence with a figure, in prose and in the
    comments of command blocks: each names no machine, and the page is read on another."""
    parts = [prose(text)] + [
        c for _, lines in fenced_blocks(text) for c in re.findall(r"#.*", "\n".join(lines))
    ]
    problems = []
    for part in parts:
        for sentence in re.split(r"(?<=[.;!?])\s+|\n\s*\n|\n(?=[-*|#] )|\|", without_code_spans(part)):
            flat = " ".join(sentence.split())
            if MACHINE_WORDS.search(flat) or (re.search(r"\bhere\b", flat) and re.search(r"\d", flat)):
                problems.append(f"{name}: '{flat[:110]}'")
    return problems


def test_no_figure_says_here_or_this_machine_for_its_machine():
    problems = [p for page in PAGES for p in machine_ref_problems(page.name, page.read_text())]
    assert not problems, "say which machine (and date):\n" + "\n".join(problems)


# --- user pages hold no development history ---

HISTORY = {
    r"\bissues? *#?\d+\b|(?<![\w/])#\d+\b": "an issue number",
    r"\bthe issue'?s?\b(?! its)|\bissue tracker\b|\bstop notes\b": "the issue tracker",
    r"\bgoals?\b": "a development goal",
    r"\(was\b|\bwas:|\bBefore,|\(before\)|\bbefore the fix\b|(?<!is )(?<!are )(?<!be )\bused to\b": "how it was before",
    r"\b(until|since) 20\d\d-\d\d|\bas before\b|\bold name\b|\bwas the first\b|\btoday's\b|\b(not|is) reached\b": "how it was before",
    r"\b(other|three|four|\d) engineers\b|\bthis (session|round)\b|\bthe merged tree\b|\blandings?\b": "the workplace",
    r"(?<![\w./-])(?=[0-9a-f]*\d)(?=[0-9a-f]*[a-f])[0-9a-f]{7,12}\b": "a commit id",
    r"\.\./shared|/work/|outside this repository": "a path outside the repository",
}


def history_problems(name: str, text: str) -> list[str]:
    flat = " ".join(without_code_spans(prose(text)).split())
    problems = []
    for pattern, what in HISTORY.items():
        problems += [
            f"{name}: {what}: '...{flat[max(0, m.start() - 40) : m.end() + 30]}...'"
            for m in re.finditer(pattern, flat)
        ]
    return problems


def test_user_pages_hold_no_development_history():
    problems = [p for page in PAGES for p in history_problems(page.name, page.read_text())]
    assert not problems, "move it to CHANGELOG.md (or drop it):\n" + "\n".join(problems)


def test_the_history_check_catches_an_issue_number():
    text = (ROOT / "README.md").read_text()
    assert not history_problems("README.md", text)
    assert history_problems("README.md", text + "\nFixed in issue 24.\n")


# --- the code's pointers into the docs ---

CODE = [
    *ROOT.glob("train_*.py"),
    *ROOT.glob("scripts/*.py"),
    *ROOT.glob("llama_train/**/*.py"),
    *ROOT.glob("tests/*.py"),
]


def test_the_codes_pointers_into_the_docs_resolve():
    """--help texts, error messages and docstrings that send a reader to a page or a section: the page
    exists and has the section (a section moved out of the README is looked for where it went)."""
    problems = []
    for path in CODE:
        text = " ".join(re.sub(r"\n\s*# ?", " ", path.read_text()).split())  # comments joined across lines
        for page, section in re.findall(
            r"\b(docs/[\w-]+\.md|README(?:\.md)?)(?:[:,]? *['\"]([A-Z][^'\"]{2,60})['\"])?", text
        ):
            dest = ROOT / (page if page.endswith(".md") else "README.md")
            if not dest.exists():
                problems.append(f"{path.relative_to(ROOT)}: {page} does not exist")
            elif section and slug(section) not in anchors(dest):
                problems.append(f"{path.relative_to(ROOT)}: {page} has no section '{section}'")
    assert not problems, "\n".join(problems)


# --- the planner's figures on the pages are what the planner says today ---


def planned_problems(page: Path, text: str) -> list[str]:
    """In a table row holding `--preset ...` under a header naming scripts/plan_memory.py (the row's
    flags for it), each column named after a
    strategy, or headed "planned" beside a "strategy" column, holds that strategy's planned peak per
    rank (GiB, or MiB where the header says so); a "parameters" column the preset's parameter count."""
    from llama_train.model import PRESETS, preset
    from llama_train.plan.memory import param_numels
    from llama_train.plan.planner import Workload, plan

    problems = []
    for row, _, header in blocks(text):
        spans = re.findall(r"`(--preset [^`]*)`", row)
        if "plan_memory.py" not in header or not spans:
            continue
        args = parser_of("scripts/plan_memory.py").parse_args(shlex.split(spans[0]))
        model = preset(
            args.preset,
            gradient_checkpointing=args.gradient_checkpointing,
            max_seq_len=PRESETS[args.preset].max_seq_len,
        )
        work = Workload(model, args.world_size, args.batch_size, args.max_seq_len, args.dtype, 1, args.device)
        reserve = args.reserve_gib * 2**30 * (args.device == "gpu")
        planned = {
            r["strategy"]: r["total_bytes"] for r in plan(work, args.device_mem_gib * 2**30, None, reserve)
        }
        named = dict(zip(map(str.lower, cells(header)), cells(row)))
        for head, cell in named.items():
            strategy = head.strip("` ") if head.strip("` ") in planned else None
            if "planned" in head:
                strategy = named.get("strategy", "").strip("` ")
            expected = planned.get(strategy, 0) / (2**20 if "mib" in head else 2**30) if strategy else None
            if "parameters" in head:
                expected = sum(param_numels(model))
            if expected is None:
                continue
            found = PAGE_NUMBER.search(cell)
            if not found or not in_source(*quoted(*found.groups("")), [expected]):
                problems.append(
                    f"{page.name}: `{spans[0]}`, {head}: the page says {cell!r}, the planner {expected:,.2f}"
                )
    return problems


def test_the_planners_figures_on_the_pages_are_the_planners():
    problems = [p for page in PAGES for p in planned_problems(page, page.read_text())]
    assert not problems, "\n".join(problems)


def test_the_machine_and_planner_checks_catch_a_wrong_page():
    page = ROOT / "docs" / "tested.md"
    text = page.read_text()
    assert not machine_ref_problems("x.md", text) and not planned_problems(page, text)
    assert machine_ref_problems("x.md", text + "\nA step took 5 s here.\n")
    assert machine_ref_problems("x.md", text + "\nOn this machine it is fast.\n")
    wrong = text.replace("| 39.4 | 36.1 |", "| 39.4 | 33.7 |")  # the 1b row's zero2 column
    assert wrong != text, "the 1b row's planned figures moved: update this test's row"
    assert any("zero2" in p and "33.7" in p for p in planned_problems(page, wrong))


def test_the_launch_fronts_help_names_the_stop_file():
    from llama_train import launch
    from llama_train.ops.stopfile import STOP_NAME

    assert f"<output_dir>/{STOP_NAME}" in launch.__doc__
