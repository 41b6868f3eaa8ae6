"""Every output folder and every input is checked before any work (issue 46): a bad one is one line (`X: error:
...`), exit 2, and nothing is left behind -- no empty folder, no half-done work.

Outputs (ffcv_ddpm.checks.check_out_dir): an existing file, a path under a file, a folder this user cannot write.
Inputs (check_input and the commands' own dataset checks): missing, or of the wrong kind. Each command runs in a
forked child, so a check that fires late (after a dataset build or a training) would show as work on disk, and the
unwritable cases run as user nobody: this machine's tests run as root, which writes anywhere.
"""

import importlib
import os
import shutil
import sys
import tempfile
import traceback
from pathlib import Path

import pytest

NOBODY = 65534  # uid and gid of nobody; without root the tests run as they are (a read-only folder holds then too)


def call(module: str, argv: list[str], user: int | None = None) -> tuple[int, list[str]]:
    """(exit status, non-empty stderr lines) of `python -m module argv`, run as module.main(argv) in a forked child:
    fast (the imports are this process's) and isolated (no state of the command stays here). `user`: the child
    drops root to that uid/gid first."""
    importlib.import_module(module)  # here, as root: the interpreter's own library may lie where nobody cannot read
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        rc = 70
        try:
            os.close(read)
            sys.stderr = os.fdopen(write, "w")
            sys.stdout = open(os.devnull, "w")
            if user is not None and os.geteuid() == 0:
                os.setgroups([])
                os.setgid(user)
                os.setuid(user)
            try:
                rc = importlib.import_module(module).main(argv)
            except SystemExit as e:
                rc = e.code
        except BaseException:
            traceback.print_exc()
        finally:
            sys.stderr.flush()
            os._exit(rc if isinstance(rc, int) else 70)
    os.close(write)
    with os.fdopen(read) as f:
        err = f.read()
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status), [line for line in err.splitlines() if line.strip()]


@pytest.fixture
def base():
    """A folder user nobody can reach (pytest's tmp_path lies in root's private folder), with `in/`: inputs that
    pass their checks (an empty folder, placeholder .beton files: nothing gets far enough to read them)."""
    root = Path(tempfile.mkdtemp(prefix="test-paths-"))
    root.chmod(0o755)
    (root / "in").mkdir()
    for name in ("x.beton", "digits_train_raw.beton", "digits_test_raw.beton"):
        (root / "in" / name).write_bytes(b"")
    (root / "free").mkdir()
    (root / "free").chmod(0o777)  # where nobody may write: the outputs a case does not test
    yield root
    shutil.rmtree(root)


def tree(root: Path) -> set[Path]:
    return set(root.rglob("*"))


def short(module: str) -> str:
    return module.rsplit(".", 1)[-1]


# (command, its argv, the option that names the output): OUT stands for the output under test, IN for base/in,
# FREE for a folder anyone may write (the other outputs of the command).
OUTPUTS = [
    ("ffcv_ddpm.train", ["--preset", "tiny", "--data", "IN/x.beton", "train.device=cpu", "train.out_dir=OUT"],
     "train.out_dir"),
    ("tools.make_dataset", ["--source", "synthetic", "--out", "OUT"], "--out"),
    ("tools.make_dataset", ["--source", "synthetic", "--out", "FREE/d", "--export-png", "OUT"], "--export-png"),
    ("benchmarks.speed.bench", ["--table", "quick", "--out", "OUT"], "--out"),
    ("benchmarks.speed.loaders", ["--data", "IN", "--out", "OUT"], "--out"),
    ("benchmarks.speed.profile", ["--preset", "tiny", "--data", "IN", "--out", "OUT"], "--out"),
    ("benchmarks.speed.ddp", ["--device", "cpu", "--data", "IN", "--out", "OUT"], "--out"),
    ("benchmarks.speed.numerics", ["--data", "IN", "--out", "OUT"], "--out"),
    ("benchmarks.speed.floors", ["--preset", "tiny", "--out", "OUT"], "--out"),
    ("benchmarks.quality.digits", ["--data", "IN", "--work", "FREE/w", "--out", "OUT"], "--out"),
    ("benchmarks.quality.digits", ["--data", "IN", "--out", "FREE/o", "--work", "OUT"], "--work"),
    ("benchmarks.quality.sde", ["--data", "IN", "--out", "OUT"], "--out"),
    ("benchmarks.quality.sde", ["--data", "IN", "--out", "FREE/o", "--runs", "OUT"], "--runs"),
    ("benchmarks.quality.compress", ["--data", "IN", "--work", "FREE/w", "--out", "OUT"], "--out"),
    ("benchmarks.quality.compress", ["--data", "IN", "--out", "FREE/o", "--work", "OUT"], "--work"),
    ("benchmarks.quality.fid", ["--data", "IN/x.beton", "--images", "IN/x.beton", "--out", "OUT"], "--out"),
]
IDS = [f"{short(m)}:{option}" for m, _, option in OUTPUTS]


def fill(argv: list[str], base: Path, out: Path) -> list[str]:
    return [a.replace("OUT", str(out)).replace("IN", str(base / "in")).replace("FREE", str(base / "free"))
            for a in argv]


@pytest.mark.parametrize("under", [False, True], ids=["is a file", "under a file"])
@pytest.mark.parametrize("module,argv,option", OUTPUTS, ids=IDS)
def test_an_output_that_is_or_lies_under_a_file(module, argv, option, under, base):
    blocker = base / "blocker"
    blocker.write_text("a file where a folder should be")
    out = blocker / "sub" if under else blocker
    before = tree(base)
    rc, err = call(module, fill(argv, base, out))
    assert rc == 2 and len(err) == 1 and err[0].startswith(f"{short(module)}: error: "), err
    words = f"is under {blocker}, which is a file" if under else "is a file, not a folder"
    assert f"{option} {out}: {words}" in err[0], err[0]
    assert tree(base) == before  # nothing written, nothing made (the synthetic dataset of make_dataset included)


@pytest.mark.parametrize("under", [False, True], ids=["the folder", "a folder to make in it"])
@pytest.mark.parametrize("module,argv,option", OUTPUTS, ids=IDS)
def test_an_output_folder_this_user_cannot_write(module, argv, option, under, base):
    locked = base / "locked"
    locked.mkdir(mode=0o555)
    locked.chmod(0o555)  # mkdir's mode passes through the umask
    out = locked / "sub" if under else locked
    before = tree(base)
    rc, err = call(module, fill(argv, base, out), user=NOBODY)
    assert rc == 2 and len(err) == 1 and err[0].startswith(f"{short(module)}: error: "), err
    assert f"{option} {out}: this user cannot write there" in err[0], err[0]
    assert tree(base) == before


# ---- inputs ------------------------------------------------------------------------------------------------------

CIFAR = "IN/cifar"  # a folder holding CIFAR-10's train .beton (a placeholder), made by the test that uses it

INPUTS = [
    # an explicit --data that does not exist: refused, not filled with a synthetic dataset
    ("benchmarks.speed.bench", ["--table", "quick", "--rows", "1", "--data", "IN/typo", "--out", "FREE/o"],
     "--data IN/typo: no such folder"),
    ("benchmarks.speed.bench", ["--table", "quick", "--rows", "1", "--data", "IN/typo.beton"],
     "--data IN/typo.beton: no such file"),
    ("benchmarks.speed.profile", ["--preset", "tiny", "--data", "IN/typo", "--out", "FREE/o"],
     "--data IN/typo: no such folder"),
    ("benchmarks.speed.ddp", ["--device", "cpu", "--data", "IN/typo", "--out", "FREE/o"],
     "--data IN/typo: no such folder"),
    ("benchmarks.speed.numerics", ["--preset", "tiny", "--data", "IN/typo", "--out", "FREE/o"],
     "--data IN/typo: no such folder"),
    # the digits studies: a missing folder or another dataset's is refused, not trained on or filled with digits
    ("benchmarks.quality.digits", ["--data", "IN/typo", "--out", "FREE/o", "--work", "FREE/w"],
     "--data IN/typo: no such folder"),
    ("benchmarks.quality.digits", ["--data", CIFAR, "--out", "FREE/o", "--work", "FREE/w"],
     f"--data {CIFAR}: holds another dataset (cifar10_train_raw.beton)"),
    ("benchmarks.quality.compress", ["--data", "IN/typo", "--out", "FREE/o", "--work", "FREE/w"],
     "--data IN/typo: no such folder"),
    ("benchmarks.quality.compress", ["--data", CIFAR, "--out", "FREE/o", "--work", "FREE/w"],
     f"--data {CIFAR}: holds another dataset"),
    ("benchmarks.quality.compress", ["IN/no-run", "--out", "FREE/o"], "RUN_DIR IN/no-run: no such folder"),
    ("benchmarks.quality.sde", ["--data", "IN/typo", "--out", "FREE/o"], "--data IN/typo: no such folder"),
    # fid: the samples' source before the reference statistics are computed
    ("benchmarks.quality.fid", ["--data", "IN/x.beton", "--images", "IN/typo", "--out", "FREE/o"],
     "--images IN/typo: no such file or folder"),
    ("benchmarks.quality.fid", ["--data", "IN/x.beton", "--run", "IN/typo", "--out", "FREE/o"],
     "--run IN/typo: no such folder"),
    ("benchmarks.quality.fid", ["--data", "IN/typo.beton", "--images", "IN/x.beton", "--out", "FREE/o"],
     "--data IN/typo.beton: no such file or folder"),
    ("benchmarks.quality.fid", ["--data", "IN/x.beton", "--images", "IN/x.beton", "--weights", "IN", "--out",
                                "FREE/o"], "--weights IN: is a folder, not a file"),
    # loaders: a variant that does not exist, a PNG folder that does not
    ("benchmarks.speed.loaders", ["--data", "IN", "--loaders", "ffcv-raw,nope", "--out", "FREE/o"],
     "--loaders: nope matches no variant"),
    ("benchmarks.speed.loaders", ["--data", "IN", "--png-dir", "IN/typo", "--out", "FREE/o"],
     "--png-dir IN/typo: no such folder"),
    ("benchmarks.speed.loaders", ["--data", "IN/x.beton", "--out", "FREE/o"], "--data IN/x.beton: is a file"),
    ("benchmarks.speed.numerics", ["--from-runs", "IN/r1", "IN/r2", "--out", "FREE/o"],
     "--from-runs: IN/r1 is not a finished run folder"),
    ("benchmarks.speed.floors", ["--profile", "IN/typo", "--out", "FREE/o"], "--profile IN/typo: no such folder"),
    # make_dataset: the input checked before the --out folder is made
    ("tools.make_dataset", ["--source", "png", "--png-dir", "IN/typo", "--out", "FREE/d"],
     "--png-dir IN/typo: no such folder"),
    ("tools.make_dataset", ["--source", "tarball", "--tarball", "IN/typo.tar.gz", "--out", "FREE/d"],
     "--tarball IN/typo.tar.gz: no such file"),
    ("tools.make_dataset", ["--source", "mnist", "--mnist-dir", "IN/x.beton", "--out", "FREE/d"],
     "--mnist-dir IN/x.beton: is a file, not a folder"),
]


@pytest.mark.parametrize("module,argv,words", INPUTS, ids=[f"{short(m)}:{' '.join(a[:4])}" for m, a, _ in INPUTS])
def test_a_missing_or_wrong_input_is_refused_before_any_work(module, argv, words, base):
    (base / "in" / "cifar").mkdir()
    (base / "in" / "cifar" / "cifar10_train_raw.beton").write_bytes(b"")
    before = tree(base)
    rc, err = call(module, fill(argv, base, base / "unused"))
    assert rc == 2 and len(err) == 1 and err[0].startswith(f"{short(module)}: error: "), err
    assert fill([words], base, base)[0] in err[0], err[0]
    assert tree(base) == before  # no dataset built, no output folder made, nothing trained


def test_the_quick_start_folder_alone_is_made_for_a_synthetic_dataset(tmp_path, monkeypatch):
    """`make bench` (--data data) in a fresh clone builds a synthetic dataset in data/; any other folder that does
    not exist is a typo, refused. An existing folder without a dataset gets one (the NOTE line says so)."""
    from benchmarks.common import DEFAULT_DATA, BenchError, check_data

    monkeypatch.chdir(tmp_path)
    check_data(DEFAULT_DATA)  # to be made: passes
    check_data(tmp_path / "data")  # the same folder, spelled absolute
    (tmp_path / "mine").mkdir()
    check_data(Path("mine"))
    with pytest.raises(BenchError, match="--data dat: no such folder; make it with `make dataset OUT=dat`"):
        check_data(Path("dat"))
    blocker = tmp_path / "data"
    blocker.write_text("")  # the quick start's folder, blocked by a file: the build could not write there
    with pytest.raises(BenchError, match="--data data: is a file, not a folder"):
        check_data(DEFAULT_DATA)


@pytest.mark.parametrize("argv,words", [
    (["--iters", "0"], "--iters: invalid value '0': expected an integer >= 1"),
    (["--copy-mib", "-1"], "--copy-mib: invalid value '-1': expected an integer >= 0"),
])
def test_floors_options_are_checked(argv, words, base):
    rc, err = call("benchmarks.speed.floors", ["--preset", "tiny", "--out", str(base / "free" / "o"), *argv])
    assert rc == 2 and len(err) == 1 and words in err[0], err
    assert not (base / "free" / "o").exists()


def test_loaders_with_no_variant_that_can_run_says_why_before_measuring(small_dataset, base):
    out = base / "free" / "o"
    rc, err = call("benchmarks.speed.loaders", ["--data", str(small_dataset), "--loaders", "torch-files",
                                                 "--out", str(out), "--quick"])
    assert rc == 2 and len(err) == 1 and "no selected variant has its input" in err[0], err
    assert "PNG folder" in err[0] and not out.exists()


def test_the_default_results_folder_is_checked_like_an_out(tmp_path, monkeypatch):
    """Without --out a benchmark writes under benchmarks/results/<card>/: checked the same way, before the work."""
    import benchmarks.common as common

    blocker = tmp_path / "results"
    blocker.write_text("")
    monkeypatch.setattr(common, "RESULTS", blocker)
    with pytest.raises(common.BenchError, match=r"^the results folder .*: is under .*results, which is a file"):
        common.results_out(None, None, "floors")
    assert common.results_out(tmp_path / "mine", None, "floors") == tmp_path / "mine"  # --out wins, unmade
    assert not (tmp_path / "mine").exists()


def test_a_broken_link_where_a_folder_should_be(tmp_path):
    from ffcv_ddpm.checks import BadValue, check_out_dir

    (tmp_path / "link").symlink_to(tmp_path / "gone")
    with pytest.raises(BadValue, match="is a broken link, not a folder"):
        check_out_dir(tmp_path / "link" / "sub", "--out")
    assert check_out_dir(tmp_path / "a" / "b", "--out") == tmp_path / "a" / "b" and not (tmp_path / "a").exists()
