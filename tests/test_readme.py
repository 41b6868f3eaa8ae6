"""Every command the README quotes runs as written: its options and KEY=VALUE overrides are accepted by the real
parsers (a `make` command through `make -n`, which prints the command the target runs), and nothing is run. A
renamed option, a dropped Makefile variable or a renumbered benchmark row fails here instead of on a user's machine.
"""
from __future__ import annotations

import importlib
import re
import shlex
import subprocess
from pathlib import Path

import pytest

from benchmarks.speed.rows import TABLES, resolve_rows
from ffcv_ddpm import checks
from ffcv_ddpm.config import load_config
from ffcv_ddpm.unet import PRESETS
from test_entry_points import ENTRY_POINTS

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
PLACEHOLDER_MODULES = {"X", "…"}  # the grammar's `python -m X --help`, the venv's `python -m …`
COMMAND = re.compile(r"^(?:\S*/)?(?:python3?\s+-m|make|torchrun)\s+\S")  # not the word `make` in prose


def readme_commands(text: str = README) -> list[str]:
    """The shell commands of the ```bash blocks (continuations joined, comments dropped, `a && b` split) and the
    inline `python -m ...`, `make ...` and `torchrun ...` spans of the prose."""
    commands = []
    fenced = re.compile(r"^```(\w*)\n(.*?)^```", re.M | re.S)
    for lang, body in fenced.findall(text):
        if lang != "bash":
            continue
        for line in re.sub(r"\\\n\s*", " ", body).splitlines():
            words = shlex.split(line, comments=True)
            commands += [" ".join(map(shlex.quote, part)) for part in _split_and(words) if part]
    prose = fenced.sub("", text)
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
        assert found or targets[:1] in (["test"], ["clean"]), f"{command}: make -n ran none of our commands"
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


COMMANDS = readme_commands()


def test_the_readme_quotes_commands():
    """The extraction finds what it must (a parser change that finds nothing would pass every case below)."""
    assert len(COMMANDS) > 30
    for expected in ("make dataset", "python -m ffcv_ddpm.train --resume runs/00000-ddpm-cifar10",
                     "make bench NO_SETUP=1 PY=python3", "python -m benchmarks.speed.profile --from-trace "):
        assert any(c.startswith(expected) for c in COMMANDS), expected
    assert any("\n" not in c and "--warmup 5" in c and "--rows" in c for c in COMMANDS)  # a span over two lines


@pytest.mark.parametrize("command", COMMANDS)
def test_every_readme_command_parses(command, parse_only, capsys):
    runs = module_commands(command)
    assert runs or command.startswith("make"), f"{command}: no command found"
    for module, argv in runs:
        if module in PLACEHOLDER_MODULES:
            continue
        assert module in ENTRY_POINTS, f"{command}: python -m {module} is no command of this project"
        parsed = parse_only(module, argv)
        if parsed.overrides:  # every KEY=VALUE names a config field and holds an allowed value
            preset = getattr(parsed.options, "preset", None)
            load_config(preset if preset in PRESETS else "ddpm-cifar10", parsed.overrides)
    assert "error" not in capsys.readouterr().err


def test_the_ddpm_table_command_selects_the_rows_it_shows(parse_only):
    """The DDPM table's rows, in the README's order, are the rows its reproduce command selects today."""
    section = README.split("### The DDPM paper's UNet", 1)[1].split("\n### ", 1)[0]
    command = next(c for c in readme_commands(section) if "--rows" in c)
    (module, argv), = module_commands(command)
    args = parse_only(module, argv).options
    rows = resolve_rows(TABLES[args.table](("data.loader=torch-memory",)), args.rows)
    shown = [line.split("|")[1].strip() for line in section.splitlines()
             if line.startswith("| ") and not line.startswith(("| row", "|---"))]
    assert len(rows) == len(shown) == 7
    for row, label in zip(rows, shown):
        # A row's name without its leading "+ " and its parenthesis is in the README's label for it.
        words = re.sub(r"\s*\(.*\)$", "", row.name).removeprefix("+ ")
        assert words.lower() in label.lower(), (row.name, label)


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
