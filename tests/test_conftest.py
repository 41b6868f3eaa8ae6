"""The suite's own machinery in tests/conftest.py: make test-quick's selection and the recorded costs it reads."""

import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

from conftest import QUICK_LIMIT, quick_selection, recorded_costs

TESTS = Path(__file__).resolve().parent


def test_quick_leaves_out_the_tests_recorded_at_the_limit_or_more_in_order():
    items = [SimpleNamespace(nodeid=f"tests/test_a.py::{name}") for name in ("slow", "cheap", "edge", "unlisted")]
    costs = {"test_a.py::slow": 40.0, "test_a.py::cheap": 4.9, "test_a.py::edge": QUICK_LIMIT}
    kept, left_out = quick_selection(items, costs)
    assert [i.nodeid.rsplit(":", 1)[1] for i in kept] == ["cheap", "unlisted"]
    assert [i.nodeid.rsplit(":", 1)[1] for i in left_out] == ["slow", "edge"]


def test_every_recorded_test_exists():
    """A renamed or removed test left in durations.txt would neither be ordered nor left out by --quick."""
    costs = recorded_costs()
    assert len(costs) > 50 and all(seconds >= 1 for seconds in costs.values())
    for nodeid in costs:
        path, name = nodeid.split("::", 1)
        source = (TESTS / path).read_text()
        assert re.search(rf"^def {re.escape(name.split('[', 1)[0])}\(", source, re.M), nodeid


def test_the_quick_option_deselects_through_pytest():
    """--quick as make test-quick passes it: pytest's own summary counts the tests left out."""
    slow = [n for n, s in recorded_costs().items() if n.startswith("test_sampling.py::") and s >= QUICK_LIMIT]
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--collect-only", "--quick",
                          "tests/test_sampling.py"], cwd=TESTS.parent, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert slow and f"{len(slow)} deselected" in out.stdout, out.stdout[-2000:]
    assert not any(n.split("::", 1)[1] in out.stdout for n in slow)
