"""setup/install.sh says which step is running (the real install runs in CI's fresh machine; here every command
it runs is a stub, so the test checks the script's own output and order)."""

import os
import re
import subprocess

from conftest import REPO

# Stands in for python3 and the venv's python: `-m venv DIR` makes DIR/bin/python (this stub), all else succeeds.
STUB = """#!/bin/sh
if [ "$1" = --version ]; then echo "Python 3.x"; exit 0; fi
echo "RUN $*"
if [ "$1" = -m ] && [ "$2" = venv ]; then mkdir -p "$3/bin" && cp "$0" "$3/bin/python"; fi
if [ "$1" = - ]; then cat > /dev/null; fi
exit 0
"""


def test_install_prints_each_step_before_running_it(tmp_path):
    stub = tmp_path / "python3"
    stub.write_text(STUB)
    stub.chmod(0o755)
    env = {**os.environ, "PYTHON": str(stub), "VENV": str(tmp_path / "venv"), "APT": "never"}
    proc = subprocess.run(["bash", str(REPO / "setup" / "install.sh")], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    steps = [line for line in proc.stdout.splitlines() if line.startswith("setup: [")]
    assert [s.split("]")[0] for s in steps] == [f"setup: [{i}/5" for i in range(1, 6)], proc.stdout
    assert "pinned requirements" in steps[2] and "FFCV" in steps[3]
    assert proc.stdout.splitlines()[-1].startswith("setup: done in ")
    assert (tmp_path / "venv" / ".installed").exists()
    # Each step's line comes before the commands of that step.
    lines = proc.stdout.splitlines()

    def ran(words):
        return next(i for i, line in enumerate(lines) if line.startswith("RUN") and words in line)

    assert lines.index(steps[1]) < ran("-m venv") < lines.index(steps[2]) < ran("-r requirements.txt") \
        < lines.index(steps[3]) < ran("ffcv==") < lines.index(steps[4]) < lines.index("RUN -")


def test_readme_says_how_to_use_the_venv_before_its_first_python_command():
    """The quick start's `python -m ...` lines fail outside .venv (No module named torch) unless it says how."""
    text = (REPO / "README.md").read_text()
    assert "source .venv/bin/activate" in text
    first_command = re.search(r"python -m \w", text).start()
    assert text.index("source .venv/bin/activate") < first_command
