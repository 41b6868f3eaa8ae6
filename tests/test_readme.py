"""The user's pages say what runs and what was measured: README.md, docs/*.md and benchmarks/README.md.

- Every command they quote runs as written: its options and KEY=VALUE overrides, and the overrides inside each
  `--variant NAME:KEY=VALUE ...`, are accepted by the real parsers and config (a `make` command through `make -n`,
  which prints the command the target runs), and nothing is run. A renamed option, a dropped Makefile variable, a
  renumbered benchmark row or a setting the config now refuses fails here instead of on a user's machine.
- Every figure that links a result JSON is a value of that file, as rounded on the page. The convention: in a table
  row that links exactly one `.json`, every cell but the first that starts with a number; in prose, a number
  followed within six words by a parenthesised link to a `.json` (`41.1% MFU on one H200 ([JSON](...))`). A share
  written with % matches a fraction (0.411) or a percentage in the file.
- Every relative link of these pages, NOTES and the cards' indexes reaches a file, and its #anchor a heading there.
"""
from __future__ import annotations

import importlib
import json
import re
import shlex
import subprocess
from pathlib import Path

import pytest

from benchmarks.common import parse_variant
from benchmarks.speed.report import add_metrics
from benchmarks.speed.rows import TABLES, resolve_rows
from ffcv_ddpm import checks
from ffcv_ddpm.config import load_config
from ffcv_ddpm.unet import PRESETS
from test_entry_points import ENTRY_POINTS

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "benchmarks" / "README.md"]
LINKED_PAGES = [*PAGES, ROOT / "benchmarks" / "NOTES.md", *sorted((ROOT / "benchmarks" / "results").glob("*/README.md"))]
README = (ROOT / "README.md").read_text()
PLACEHOLDER_MODULES = {"X", "…"}  # the grammar's `python -m X --help`, the venv's `python -m …`
COMMAND = re.compile(r"^(?:\S*/)?(?:python3?\s+-m|make|torchrun)\s+\S")  # not the word `make` in prose
FENCED = re.compile(r"^```(\w*)\n(.*?)^```", re.M | re.S)


def page_commands(text: str) -> list[str]:
    """The shell commands of the ```bash blocks (continuations joined, comments dropped, `a && b` split) and the
    inline `python -m ...`, `make ...` and `torchrun ...` spans of the prose."""
    commands = []
    for lang, body in FENCED.findall(text):
        if lang != "bash":
            continue
        for line in re.sub(r"\\\n\s*", " ", body).splitlines():
            words = shlex.split(line, comments=True)
            commands += [" ".join(map(shlex.quote, part)) for part in _split_and(words) if part]
    prose = FENCED.sub("", text)
    for span in re.findall(r"`([^`]+)`", prose):
        span = " ".join(span.split())  # a span may wrap onto the next line
        if COMMAND.match(span):
            commands.append(span)
    return commands


def _split_and(words: list[str]) -> list[list[str]]:
    parts = [[]]
    for w in words:
        if w == "&&":
            parts.append([])
        else:
            parts[-1].append(w)
    return parts


def module_commands(command: str) -> list[tuple[str, list[str]]]:
    """(module, argv) of each of our `python -m` commands that `command` runs; for `make`, what `make -n` prints."""
    words = shlex.split(command)
    if words[0] == "make":
        assigns = [w for w in words[1:] if "=" in w and w.split("=")[0] not in ("NO_SETUP", "PY")]
        targets = [w for w in words[1:] if "=" not in w]
        done = subprocess.run(["make", "-n", "--no-print-directory", *targets, *assigns, "NO_SETUP=1", "PY=python"],
                              cwd=ROOT, capture_output=True, text=True)
        assert done.returncode == 0, f"{command}: {done.stderr}"
        found = []
        for line in re.sub(r"\\\n\s*", " ", done.stdout).splitlines():
            found += [(m, a) for m, a in module_commands(line) if m in ENTRY_POINTS]  # not `-m pytest`
        assert found or targets[:1] in (["test"], ["test-quick"], ["clean"]), \
            f"{command}: make -n ran none of our commands"
        return found
    found = []
    for i, w in enumerate(words[:-1]):
        if w == "-m" and (i == 0 or words[i - 1] == "torchrun" or words[i - 1].endswith(("python", "python3"))
                          or words[0] == "torchrun"):
            rest = [w for w in words[i + 2:] if w != "…"]  # "-m ffcv_ddpm.train …": the rest as given above
            end = rest.index("&&") if "&&" in rest else len(rest)
            found.append((words[i + 1], rest[:end]))
            break
    return found


class Parsed(BaseException):
    """Raised by the patched parser right after it accepted the command line: nothing after parsing runs. A
    BaseException, so a command's `except Exception` does not swallow it."""

    def __init__(self, options, overrides):
        self.options, self.overrides = options, overrides


@pytest.fixture
def parse_only(monkeypatch):
    real_parse_args, real_with_overrides = checks.Parser.parse_args, checks.Parser.parse_with_overrides

    def parse_args(self, args=None, namespace=None):
        raise Parsed(real_parse_args(self, args, namespace), [])

    def parse_with_overrides(self, argv):
        raise Parsed(*real_with_overrides(self, argv))

    monkeypatch.setattr(checks.Parser, "parse_args", parse_args)
    monkeypatch.setattr(checks.Parser, "parse_with_overrides", parse_with_overrides)

    def run(module: str, argv: list[str]) -> Parsed:
        try:
            rc = importlib.import_module(module).main(argv)
        except Parsed as parsed:
            return parsed
        except SystemExit as e:
            rc = e.code
        raise AssertionError(f"python -m {module} {shlex.join(argv)}: not accepted (exit {rc})")

    return run


def check_command(command: str, parse_only) -> None:
    """Parse `command` as its module would; its overrides, and each --variant's on top of them, build a config."""
    runs = module_commands(command)
    assert runs or command.startswith("make"), f"{command}: no command found"
    for module, argv in runs:
        if module in PLACEHOLDER_MODULES:
            continue
        assert module in ENTRY_POINTS, f"{command}: python -m {module} is no command of this project"
        parsed = parse_only(module, argv)
        preset = getattr(parsed.options, "preset", None)
        preset = preset if preset in PRESETS else "ddpm-cifar10"
        if parsed.overrides:  # every KEY=VALUE names a config field and holds an allowed value
            load_config(preset, parsed.overrides)
        for text in getattr(parsed.options, "variant", None) or []:  # ddp and levers: NAME:KEY=VALUE[,...]
            try:
                load_config(preset, [*parsed.overrides, *parse_variant(text, "")[1]])
            except ValueError as e:
                raise AssertionError(f"{command}: --variant {text}: {e}") from None


COMMANDS = [(page, c) for page in PAGES for c in page_commands(page.read_text())]


def test_the_pages_quote_commands():
    """The extraction finds what it must (a parser change that finds nothing would pass every case below)."""
    readme = [c for page, c in COMMANDS if page.name == "README.md" and page.parent == ROOT]
    assert len(readme) > 15 and len(COMMANDS) > 80
    texts = [c for _, c in COMMANDS]
    for expected in ("make dataset", "python -m ffcv_ddpm.train --resume runs/00000-ddpm-cifar10",
                     "make bench NO_SETUP=1 PY=python3", "python -m benchmarks.speed.profile --from-trace ",
                     "torchrun --nproc_per_node 4 -m ffcv_ddpm.train"):
        assert any(c.startswith(expected) for c in texts), expected
    assert any("\n" not in c and "--warmup 5" in c and "--rows" in c for c in texts)  # a span over two lines
    assert any("--variant" in c for c in texts)


@pytest.mark.parametrize("command", [c for _, c in COMMANDS],
                         ids=[f"{p.relative_to(ROOT)}:{c[:60]}" for p, c in COMMANDS])
def test_every_quoted_command_parses(command, parse_only, capsys):
    check_command(command, parse_only)
    assert "error" not in capsys.readouterr().err


@pytest.mark.parametrize("command,why", [
    ("python -m benchmarks.speed.ddp --data data --gpus 1,2 --variant graph-cuts:train.ddp_split=True",
     "train.ddp_reduce=ddp"),  # DDP's buckets under the flat all-reduce, the default: refused by the config
    ("python -m benchmarks.speed.ddp --data data --variant fast:data.batch_size=0", "data.batch_size"),
    ("python -m benchmarks.speed.bench --data data --rows 24 data.batch_size=0", "expected an integer"),
])
def test_a_command_the_config_refuses_fails(command, why, parse_only):
    with pytest.raises((AssertionError, ValueError), match=why):
        check_command(command, parse_only)


def test_the_ddpm_table_command_selects_the_rows_it_shows(parse_only):
    """The H200's first DDPM table: its rows, in the page's order, are the rows its command selects today."""
    page = (ROOT / "docs" / "results-h200.md").read_text()
    section = page.split("### The DDPM paper's UNet", 1)[1].split("\n### ", 1)[0]
    command = next(c for c in page_commands(section) if "--rows" in c)
    (module, argv), = module_commands(command)
    args = parse_only(module, argv).options
    rows = resolve_rows(TABLES[args.table](("data.loader=torch-memory",)), args.rows)
    shown = [line.split("|")[1].strip() for line in section.splitlines()
             if line.startswith("| ") and not line.startswith(("| row", "|---"))]
    assert len(rows) == len(shown) == 7
    for row, label in zip(rows, shown):
        # A row's name without its leading "+ " and its parenthesis is in the page's label for it.
        words = re.sub(r"\s*\(.*\)$", "", row.name).removeprefix("+ ")
        assert words.lower() in label.lower(), (row.name, label)


# ---- figures read from the files they link ---------------------------------------------------------------------

NUMBER = r"\d[\d,]*(?:\.\d+)?"
CELL_FIGURE = re.compile(rf"^[*`]*(?P<num>{NUMBER})(?P<pct>%)?")
PROSE_FIGURE = re.compile(rf"(?<![\w.,/])(?P<num>{NUMBER})(?P<pct>%)?"
                          r"(?:\s+[A-Za-z`*][^\s(\[]*){0,6}\s*\(\[[^\]]*\]\((?P<path>[^)\s#]+\.json)\)\)")
JSON_LINK = re.compile(r"\]\(([^)\s#]+\.json)\)")
COMMIT = re.compile(r"[0-9a-f]{7,40}")


def linked_figures(text: str) -> list[tuple[str, bool, str]]:
    """(figure, written with %, linked path) for every figure of `text` that the convention ties to a JSON."""
    found = []
    prose = FENCED.sub("", text)
    for line in prose.splitlines():
        links = set(JSON_LINK.findall(line))
        if line.startswith("|") and len(links) == 1:
            (path,) = links
            for cell in [c.strip() for c in line.strip().strip("|").split("|")][1:]:
                m = CELL_FIGURE.match(cell)
                if m and "](" not in cell and not (COMMIT.fullmatch(cell.strip("`")) and re.search("[a-f]", cell)):
                    found.append((m["num"], bool(m["pct"]), path))
    tables = "\n".join(line for line in prose.splitlines() if not line.startswith("|"))
    found += [(m["num"], bool(m["pct"]), m["path"]) for m in PROSE_FIGURE.finditer(tables)]
    return found


def json_values(node, out: list[float] | None = None) -> list[float]:
    """Every number of a result file but those of long lists (per-iteration times would match any figure)."""
    out = [] if out is None else out
    if isinstance(node, dict):
        for v in node.values():
            json_values(v, out)
    elif isinstance(node, list):
        if len(node) <= 8 or not all(isinstance(v, (int, float)) for v in node):
            for v in node:
                json_values(v, out)
    elif isinstance(node, (int, float)) and not isinstance(node, bool):
        out.append(float(node))
    return out


def with_metrics(result):
    """A bench table of the first schema kept only raw times: its metrics as the report computes them."""
    rows = result.get("rows") if isinstance(result, dict) else None
    if isinstance(rows, list) and all("preset" in r for r in rows) and any(
            r.get("status") == "ok" and "metrics" not in r for r in rows):
        add_metrics(result)
    return result


def is_value(figure: str, percent: bool, values: list[float]) -> bool:
    """`figure` is one of `values` rounded to its decimals; with % also a fraction times 100."""
    x = float(figure.replace(",", ""))
    tol = 0.5 * 10 ** -(len(figure.split(".")[1]) if "." in figure else 0) + 1e-9
    return any(abs(v - x) <= tol or (percent and abs(100 * v - x) <= tol) for v in values)


def wrong_figures(page: Path) -> tuple[int, list[str]]:
    """How many linked figures `page` has, and those its files do not hold."""
    figures, wrong, cache = linked_figures(page.read_text()), [], {}
    for figure, percent, path in figures:
        file = (page.parent / path).resolve()
        if file not in cache:
            cache[file] = json_values(with_metrics(json.loads(file.read_text())))
        if not is_value(figure, percent, cache[file]):
            wrong.append(f"{figure}{'%' if percent else ''} is not in {path}")
    return len(figures), wrong


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_every_linked_figure_is_read_from_its_file(page):
    count, wrong = wrong_figures(page)
    assert not wrong, f"{page.relative_to(ROOT)}: " + "; ".join(wrong)
    if page.name == "README.md" and page.parent == ROOT:
        assert count >= 30  # the glance tables' cells and the headline: the extraction found them


def test_a_figure_the_file_does_not_hold_fails(tmp_path):
    """The check can fail: a stale figure in a table row or before a link, or a figure only in a long list."""
    (tmp_path / "r.json").write_text(json.dumps({"mfu": 0.41147, "img_per_s": 10907.46, "batch": 1024,
                                                 "iter_ms": [93.2] * 50, "commit": "5f421de"}))
    ok = ("| today's defaults | 1024 | 10,907 | 41.1% | `5f421de` | [r.json](r.json) |\n"
          "It runs at **41.1% MFU** on one H200 ([JSON](r.json)).\n")
    (tmp_path / "ok.md").write_text(ok)
    assert wrong_figures(tmp_path / "ok.md") == (4, [])
    for stale, bad in [("41.1% MFU** on", "41.2% MFU** on"), ("| 10,907 |", "| 10,500 |"), ("| 1024 |", "| 93.2 |")]:
        (tmp_path / "bad.md").write_text(ok.replace(stale, bad))
        count, wrong = wrong_figures(tmp_path / "bad.md")
        assert count == 4 and len(wrong) == 1, (bad, wrong)


# ---- links -----------------------------------------------------------------------------------------------------

def anchors(text: str) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces as hyphens, repeats numbered."""
    seen: dict[str, int] = {}
    for heading in re.findall(r"^#+\s+(.+?)\s*$", FENCED.sub("", text), re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")
        seen[slug] = seen.get(slug, -1) + 1
        if seen[slug]:
            seen[f"{slug}-{seen[slug]}"] = 0
    return set(seen)


@pytest.mark.parametrize("page", LINKED_PAGES, ids=[str(p.relative_to(ROOT)) for p in LINKED_PAGES])
def test_every_relative_link_reaches_its_target(page):
    text = re.sub(r"`[^`]*`", "", FENCED.sub("", page.read_text()))  # a link inside code is an example
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", target):
            continue  # https:, mailto:
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            broken.append(target)
        elif anchor and file.suffix == ".md" and anchor not in anchors(file.read_text()):
            broken.append(f"{target} (no such heading)")
    assert not broken, f"{page.relative_to(ROOT)}: {broken}"


# ---- make: where every target writes ---------------------------------------------------------------------------

@pytest.mark.parametrize("target,assign,expected", [
    *[(target, "OUT", ["--out", "a b"]) for target in ("dataset", "bench", "bench-loaders", "bench-ddp", "profile",
                                                        "numerics", "sweeps", "fid", "quality", "compress")],
    ("dataset-png", "OUT", ["--export-png", "a b/png"]), ("sde-quality", "OUT", ["out=a b"]),
    ("train", "OUT", ["train.out_dir=a b"]),
    # the inputs too: a folder name with a space is one word to the command
    ("bench", "DATA", ["--data", "a b"]), ("quality", "DATA", ["--data", "a b"]),
    ("train", "DATA", ["--data", "a b/cifar10_train_raw.beton"]), ("fid", "RUN", ["--run", "a b"]),
    ("compress", "RUN", ["a b", "--data"]), ("dataset", "PNG_DIR", ["--png-dir", "a b"])])
def test_out_and_every_path_reach_the_command_as_one_word(target, assign, expected):
    """`make dataset OUT=x` used to write into data/ (the target read DATA=): OUT is every target's output. Every
    path reaches the command as one word (`make dataset OUT="a b"` used to give it two)."""
    done = subprocess.run(["make", "-n", "--no-print-directory", target, f"{assign}=a b", "NO_SETUP=1", "PY=python"],
                          cwd=ROOT, capture_output=True, text=True, check=True)
    words = shlex.split(re.sub(r"\\\n\s*", " ", done.stdout))
    assert any(words[i:i + len(expected)] == expected for i in range(len(words))), done.stdout
    if target == "dataset" and assign == "OUT":
        assert "--out data" not in done.stdout


def test_make_dataset_out_writes_there(tmp_path):
    """End to end: the dataset lands in OUT, and DATA's default (data/) is not created."""
    import sys

    out = tmp_path / "x y"  # a space: the Makefile quotes it
    done = subprocess.run(["make", "--no-print-directory", "dataset", "SOURCE=synthetic", f"OUT={out}", "NO_SETUP=1",
                           f"PY={sys.executable}", "DATA=" + str(tmp_path / "not-here"),
                           "ARGS=--num-synthetic 64 --num-synthetic-test 64"],
                          cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert (out / "cifar10_train_raw.beton").is_file() and not (tmp_path / "not-here").exists()
