"""The Makefile's variables come from its defaults or the command line, never from the environment: the GPU machine,
CI systems and many shells export OUT, DATA or PY, and `make bench` must not write or read somewhere else for it."""

import os
import shlex
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def dry_run(target: str, env: dict, *args: str) -> str:
    # Without the outer make's MAKEFLAGS: `make test NO_SETUP=1 PY=python3` (as on the GPU machine) passes its
    # command-line variables to every make below it, which is make's design, not the environment leaking in.
    outer = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL", "MAKEOVERRIDES")}
    return subprocess.run(["make", "-s", "-n", target, "NO_SETUP=1", *args], cwd=REPO, capture_output=True,
                          text=True, check=True, env={**outer, **env}).stdout


ENVIRONMENT = {"OUT": "/env/out", "DATA": "/env/data", "PY": "/env/python", "ARGS": "--env-args", "VENV": "/env/venv",
               "PRESET": "env-preset", "SOURCE": "synthetic", "RUN": "/env/run", "NO_SETUP": ""}


def test_environment_variables_do_not_reach_the_commands():
    for target in ("bench", "train", "dataset", "profile"):
        out = dry_run(target, ENVIRONMENT)
        assert "/env/" not in out and "env-preset" not in out and "--env-args" not in out, (target, out)
        assert ".venv/bin/python -m " in out, (target, out)
    assert shlex.split(dry_run("bench", ENVIRONMENT))[-2:] == ["--data", "data"]
    assert shlex.split(dry_run("dataset", ENVIRONMENT))[3:7] == ["--source", "download", "--out", "data"]


def test_the_command_line_still_sets_them():
    out = dry_run("bench", ENVIRONMENT, "OUT=/cli/out", "DATA=/cli/data", "PY=/cli/python")
    assert shlex.split(out) == ["/cli/python", "-m", "benchmarks.speed.bench", "--data", "/cli/data", "--out", "/cli/out"]
