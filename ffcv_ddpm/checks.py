"""User values, parsed and range-checked by one set of rules: config fields and command-line options alike.

    value = coerce("train.steps", "abc", int, at_least(1))   # BadValue: train.steps=abc: expected an integer >= 1
    p = Parser(prog="python -m benchmarks.x")                  # argparse; a bad option: 'x: error: ...', exit 2
    p.add_argument("--iters", type=option(int, at_least(1)))
    p.check_paths(inputs=[("--data", args.data, "folder")], outputs=[("--out", args.out)])   # before any work

Every failure is one line that names the field (or option), the value given and what is allowed; a path is checked
the same way (check_out_dir: a folder this user can write or create; check_input: there, of its kind). No torch
import: tools/ and the CLIs' argument parsing use this before anything heavy loads.
"""

from __future__ import annotations

import argparse
import ast
import math
import os
import sys
import types
import typing
from typing import Any, Callable


class BadValue(ValueError):
    """One line: which field or option, the value given, and what is allowed."""


class Rule:
    """What a value must satisfy: `ok(value)`, and `allowed`, the words a user reads after the type."""

    def __init__(self, allowed: str | Callable[[], str], ok: Callable[[Any], bool], *, replaces_type: bool = False):
        self._allowed, self.ok = allowed, ok
        self.replaces_type = replaces_type  # "one of a, b" says it all: no "a string" before it

    @property
    def allowed(self) -> str:
        return self._allowed() if callable(self._allowed) else self._allowed


def at_least(low) -> Rule:
    return Rule(f">= {low}", lambda v: v >= low)


def above(low) -> Rule:
    return Rule(f"> {low}", lambda v: v > low)


def in_range(low, high, *, high_open: bool = False) -> Rule:
    return Rule(f"in [{low}, {high}{')' if high_open else ']'}",
                lambda v: low <= v < high if high_open else low <= v <= high)


def one_of(choices) -> Rule:
    """`choices`: a tuple, or a function returning one (read when checking, so a module's own list stays the truth)."""
    get = choices if callable(choices) else (lambda: choices)
    return Rule(lambda: "one of " + ", ".join(map(str, get())), lambda v: v in get(), replaces_type=True)


def each(rule: Rule | None = None, *, length: int | None = None, nonempty: bool = False) -> Rule:
    """A rule for a whole tuple: its length, and `rule` for every element."""
    words = ([f"of length {length}"] if length is not None else ["non-empty"] if nonempty else [])
    words += [f"each {rule.allowed}"] if rule else []
    return Rule(", ".join(words), lambda t: (length is None or len(t) == length) and (not nonempty or len(t) > 0)
                and (rule is None or all(rule.ok(v) for v in t)))


def matches(description: str, predicate: Callable[[Any], bool]) -> Rule:
    """A rule whose description says everything, type included: 'a non-empty string', 'auto, cpu or cuda:N'."""
    return Rule(description, lambda v: bool(predicate(v)), replaces_type=True)


# ---- types -----------------------------------------------------------------------------------------------------

_KIND = {int: "an integer", float: "a number", bool: "True or False", str: "a string"}


def describe(typ, rule: Rule | None = None) -> str:
    """'an integer >= 1', 'a tuple of integers, non-empty, each >= 1', 'one of a, b', 'None or an integer >= 1'."""
    inner = _optional(typ)
    if inner is not None:
        return "None or " + describe(inner, rule)
    if rule is not None and rule.replaces_type:
        return rule.allowed
    if _is_tuple(typ):
        elem = {int: "integers", float: "numbers", bool: "booleans", str: "strings"}.get(_element_type(typ), "values")
        kind = f"a tuple of {elem}"
        return kind + (f", {rule.allowed}" if rule and rule.allowed else "")
    return _KIND.get(typ, getattr(typ, "__name__", str(typ))) + (f" {rule.allowed}" if rule else "")


def _optional(typ):
    """T for `T | None` (or Optional[T]), else None."""
    if isinstance(typ, types.UnionType) or typing.get_origin(typ) is typing.Union:
        args = [a for a in typing.get_args(typ) if a is not type(None)]
        if len(args) == 1 and len(typing.get_args(typ)) == 2:
            return args[0]
    return None


def _is_tuple(typ) -> bool:
    return typ is tuple or typing.get_origin(typ) is tuple


def _element_type(typ, default=None):
    args = typing.get_args(typ)
    if args:
        return args[0]
    # A bare `tuple` annotation: the element type of its default, e.g. betas (0.9, 0.999) -> float.
    return type(default[0]) if default else float


def _parse_scalar(value, typ):
    """The value as `typ`, or raise TypeError. Strings (command-line text) are parsed; other values are checked."""
    if typ is str:
        if isinstance(value, str):
            return value
        raise TypeError
    if isinstance(value, str):
        text = value.strip()
        if typ is bool:
            lowered = text.lower()
            if lowered in ("true", "1", "yes"):
                return True
            if lowered in ("false", "0", "no"):
                return False
            raise TypeError
        try:
            value = ast.literal_eval(text)
        except (ValueError, SyntaxError):
            try:
                value = float(text)  # 'nan', 'inf': rejected below with a clear message
            except ValueError:
                raise TypeError from None
    if typ is bool:
        if isinstance(value, bool):
            return value
        raise TypeError
    if isinstance(value, bool):  # True is an int to Python, never to a user
        raise TypeError
    if typ is int:
        if isinstance(value, int):
            return value
        # 1e5 steps, but not 1e30: above 2**53 a float no longer holds the integer the user wrote.
        if isinstance(value, float) and value.is_integer() and abs(value) <= 2**53:
            return int(value)
        raise TypeError
    if typ is float:
        if isinstance(value, (int, float)) and math.isfinite(value):
            return float(value)
        raise TypeError
    if isinstance(value, typ):
        return value
    raise TypeError


def parse(value, typ, default=None):
    """`value` (command-line text, JSON or Python) as the annotated type `typ`; TypeError if it is not one."""
    inner = _optional(typ)
    if inner is not None:
        if value is None or (isinstance(value, str) and value.strip() in ("None", "none", "null")):
            return None
        return parse(value, inner, default)
    if _is_tuple(typ):
        if isinstance(value, str):
            try:
                value = ast.literal_eval(value.strip())
            except (ValueError, SyntaxError):
                raise TypeError from None
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            value = (value,)  # model.attn_resolutions=16
        if not isinstance(value, (list, tuple)):
            raise TypeError
        elem = _element_type(typ, default)
        return tuple(_parse_scalar(v, elem) for v in value)
    return _parse_scalar(value, typ)


def coerce(name: str, value, typ, rule: Rule | None = None, default=None):
    """`value` parsed as `typ` and checked against `rule`; BadValue('name=value: expected ...') otherwise."""
    try:
        parsed = parse(value, typ, default)
        if parsed is not None and rule is not None and not rule.ok(parsed):
            raise TypeError
    except TypeError:
        shown = value if isinstance(value, str) else repr(value)
        raise BadValue(f"{name}={shown}: expected {describe(typ, rule)}") from None
    return parsed


# ---- paths -------------------------------------------------------------------------------------------------------

_EFFECTIVE_IDS = os.access in os.supports_effective_ids  # the rights this process writes with (setuid: not the real)


def check_out_dir(path, what: str):
    """`path` if this process can write its outputs there: a writable folder, or one it can create (the nearest
    existing ancestor is a writable folder, with no file on the way); BadValue otherwise. None passes (an option
    left out: its default is checked where it is decided).

    Creates nothing, so a command that stops on a later check leaves no empty folder behind. The rights are those of
    os.access: root passes everywhere but a read-only filesystem, as its writes would."""
    if path is None:
        return None
    given, path = path, os.fspath(path)
    existing = path
    while not os.path.lexists(existing):  # lexists: a dangling link is there (mkdir would fail on it)
        parent = os.path.dirname(existing.rstrip(os.sep)) or os.curdir
        if parent == existing:
            break
        existing = parent
    if not os.path.isdir(existing):
        kind = "a broken link" if os.path.islink(existing) and not os.path.exists(existing) else "a file"
        where = "is" if existing == path else f"is under {existing}, which is"
        raise BadValue(f"{what} {path}: {where} {kind}, not a folder; choose another folder")
    if not os.access(existing, os.W_OK | os.X_OK, effective_ids=_EFFECTIVE_IDS):
        where = "" if existing == path else f" (it would be made in {existing})"
        raise BadValue(f"{what} {path}: this user cannot write there{where}; choose another folder")
    return given


def check_input(path, what: str, kind: str = "file or folder", hint: str = ""):
    """`path` if it exists, is a `kind` ("file", "folder" or "file or folder") and can be read; BadValue otherwise,
    with `hint` (how to make it) after the reason. None passes (an option left out)."""
    if path is None:
        return None
    reason = None
    if not os.path.exists(path):
        reason = f"no such {kind}"
    elif kind == "file" and not os.path.isfile(path):
        reason = "is a folder, not a file"
    elif kind == "folder" and not os.path.isdir(path):
        reason = "is a file, not a folder"
    elif not os.access(path, os.R_OK | (os.X_OK if os.path.isdir(path) else 0), effective_ids=_EFFECTIVE_IDS):
        reason = "this user cannot read it"
    if reason:
        raise BadValue(f"{what} {os.fspath(path)}: {reason}" + (f"; {hint}" if hint else ""))
    return path


# ---- command lines -----------------------------------------------------------------------------------------------

def option(typ, rule: Rule | None = None) -> Callable[[str], Any]:
    """An argparse `type=` that parses and range-checks, e.g. option(int, at_least(1))."""

    def convert(text: str):
        try:
            return coerce("", text, typ, rule)
        except BadValue:
            raise argparse.ArgumentTypeError(f"invalid value {text!r}: expected {describe(typ, rule)}") from None

    convert.__name__ = getattr(typ, "__name__", "value")  # argparse names the type in some messages
    return convert


def int_list(rule: Rule | None = None) -> Callable[[str], list[int]]:
    """Comma-separated integers ('1,2,4'), each checked against `rule`."""
    return _value_list(int, rule)


def float_list(rule: Rule | None = None) -> Callable[[str], list[float]]:
    """Comma-separated numbers ('0,0.5,2'), each checked against `rule`."""
    return _value_list(float, rule)


def str_list(rule: Rule | None = None) -> Callable[[str], list[str]]:
    """Comma-separated words ('int8,structured'), each checked against `rule`."""
    return _value_list(str, rule)


def _value_list(typ, rule: Rule | None) -> Callable[[str], list]:
    kind = {int: "integers", float: "numbers", str: "words"}[typ]
    expected = f"comma-separated {kind}" + (f", each {rule.allowed}" if rule and rule.replaces_type else
                                           f" {rule.allowed}" if rule else "")

    def convert(text: str) -> list:
        try:
            values = [coerce("", t.strip(), typ, rule) for t in text.split(",") if t.strip()]
        except BadValue:
            values = []
        if not values:
            raise argparse.ArgumentTypeError(f"invalid value {text!r}: expected {expected}")
        return values

    return convert


def choice_list(choices) -> Callable[[str], list[str]]:
    """Comma-separated names ('ddim,ddpm'), each one of `choices` (a tuple, or a function returning one)."""
    get = choices if callable(choices) else (lambda: choices)

    def convert(text: str) -> list[str]:
        values = [t.strip() for t in text.split(",") if t.strip()]
        if not values or any(v not in get() for v in values):
            raise argparse.ArgumentTypeError(f"invalid value {text!r}: expected comma-separated names, each one of "
                                             f"{', '.join(get())}")
        return values

    return convert


OVERRIDES_HELP = ("Any other KEY=VALUE (or --KEY=VALUE) overrides a config field (ffcv_ddpm.config), e.g.\n"
                  "  data.batch_size=256 train.precision=fp32 train.compile=False")


SINGLE_FILE_HELP = "No --data and no KEY=VALUE overrides: the file given is the whole input."


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """The module docstring's examples as written; an option's default after its help, unless the help says it."""

    def _get_help_string(self, action):
        text = action.help or ""
        if (action.option_strings and action.default not in (None, False, argparse.SUPPRESS)
                and "default" not in text):
            text += " (default: %(default)s)"
        return text


class Parser(argparse.ArgumentParser):
    """argparse whose errors are one line ('x: error: ... (see --help)' for prog 'python -m pkg.x') and exit 2, not a
    usage block: the same prefix as fail() gives the errors found after parsing.

    `doc`: the command's module docstring; --help shows its first line and its example block (the indented lines
    after it), so every command's help starts with how it is run. `overrides`: the command takes KEY=VALUE config
    overrides (parse_with_overrides), which the help says."""

    def __init__(self, *args, doc: str | None = None, overrides: bool = False, **kwargs):
        if doc is not None:
            paragraphs = doc.strip("\n").split("\n\n")
            examples = [p for p in paragraphs[1:2] if p.startswith("    ")]
            kwargs.setdefault("description", "\n\n".join(paragraphs[:1] + examples))
            kwargs.setdefault("formatter_class", HelpFormatter)
        if overrides:
            kwargs["epilog"] = "\n".join(filter(None, [kwargs.get("epilog"), OVERRIDES_HELP]))
        super().__init__(*args, **kwargs)

    def error(self, message: str):
        self.exit(2, f"{command_name(self.prog)}: error: {message} (see --help)\n")

    def check_paths(self, inputs=(), outputs=()) -> None:
        """Each (option, path, kind[, hint]) of `inputs` there (check_input), then each (option, path) of `outputs`
        writable (check_out_dir), before the command reads or writes anything; the first that is not: self.error.
        A None path (an option left out) passes."""
        try:
            for what, path, *rest in inputs:
                check_input(path, what, *rest)
            for what, path in outputs:
                check_out_dir(path, what)
        except BadValue as e:
            self.error(str(e))

    def parse_with_overrides(self, argv) -> tuple[argparse.Namespace, list[str]]:
        """(options, KEY=VALUE overrides in the order given); anything else unknown is the usual one-line error.

        An override is written KEY=VALUE, --KEY=VALUE or --KEY VALUE (`--steps 100`, `--device cpu` as the README
        spells them): argparse alone leaves `--steps` and `100` as two unknown words."""
        argv = sys.argv[1:] if argv is None else list(argv)
        args, rest = self.parse_known_args(self._join_key_value(argv))
        bad = [r for r in rest if "=" not in r or r.startswith("-") and not r.startswith("--")]
        if bad:
            self.error(f"unrecognized arguments: {' '.join(bad)} (config overrides are KEY=VALUE)")
        return args, [r.lstrip("-") for r in rest]

    def _join_key_value(self, argv: list[str]) -> list[str]:
        """`--KEY VALUE` -> `--KEY=VALUE` where --KEY is none of this parser's options (nor a prefix of one, which
        argparse expands) and VALUE is a plain word; everything after `--` stays as it is."""
        known = [s for a in self._actions for s in a.option_strings]
        out, i = [], 0
        while i < len(argv):
            word = argv[i]
            if word == "--":
                out += argv[i:]
                break
            if (word.startswith("--") and len(word) > 2 and "=" not in word and i + 1 < len(argv)
                    and not argv[i + 1].startswith("-") and "=" not in argv[i + 1]
                    and not any(s.startswith(word) for s in known)):
                out.append(f"{word}={argv[i + 1]}")
                i += 2
                continue
            out.append(word)
            i += 1
        return out


def command_name(prog: str) -> str:
    """The name every error line of a command starts with: 'python -m benchmarks.speed.bench' -> 'bench'."""
    return prog.split()[-1].rsplit(".", 1)[-1]


def fail(prog: str, message: str, code: int = 2) -> int:
    """Print the one-line error every CLI ends bad input with ('bench: error: ...'); returns the exit code.
    `prog`: the command's Parser prog or its short name, so parse errors and later ones start alike."""
    print(f"{command_name(prog)}: error: {message}", file=sys.stderr)
    return code
