"""Every command line ends bad input with one line naming what was wrong, and a non-zero exit: no traceback, no
usage block, nothing built first."""

import pytest

import benchmarks.speed.bench
import benchmarks.speed.ddp
import benchmarks.speed.loaders
import benchmarks.speed.numerics
import benchmarks.speed.profile
import benchmarks.speed.sweeps
import ffcv_ddpm.train
import tools.make_dataset

CASES = [
    (ffcv_ddpm.train, ["train.steps=abc"], "train.steps=abc: expected an integer in [1, 99999999]"),
    (ffcv_ddpm.train, ["--preset", "nope"], "unknown preset 'nope'"),
    (benchmarks.speed.bench, ["--iters", "abc"], "--iters: invalid value 'abc': expected an integer >= 1"),
    (benchmarks.speed.bench, ["--max-batch", "0", "--list"],
     "--max-batch: invalid value '0': expected an integer >= 1"),
    (benchmarks.speed.bench, ["--mem-fraction", "5", "--list"],
     "--mem-fraction: invalid value '5': expected a number in (0, 1]"),
    (benchmarks.speed.profile, ["train.lr=abc"], "train.lr=abc: expected a number > 0"),
    (benchmarks.speed.profile, ["--top", "x"], "--top: invalid value 'x': expected an integer >= 1"),
    (benchmarks.speed.loaders, ["--workers", "x"],
     "--workers: invalid value 'x': expected comma-separated integers >= 0"),
    (benchmarks.speed.loaders, ["data.batch_size=0"], "data.batch_size=0: expected an integer >= 1"),
    (benchmarks.speed.ddp, ["--gpus", "1,x", "--device", "cpu"], "--gpus: invalid value '1,x'"),
    (benchmarks.speed.ddp, ["--device", "cpu", "train.steps=abc"],
     "train.steps=abc: expected an integer in [1, 99999999]"),
    (benchmarks.speed.ddp, ["--device", "cpu", "--mode", "global", "data.batch_size=2", "--gpus", "1,4"],
     "data.batch_size=2 is the global"),
    (benchmarks.speed.numerics, ["--steps", "abc"], "--steps: invalid value 'abc': expected an integer >= 1"),
    (benchmarks.speed.numerics, ["--skip", "1"], "--skip: invalid value '1': expected a number in [0, 1)"),
    (benchmarks.speed.numerics, ["train.lr=abc"], "train.lr=abc: expected a number > 0"),
    (benchmarks.speed.sweeps, ["--sweep", "nope"], "unknown sweep nope"),
    (benchmarks.speed.sweeps, ["--preset", "nope", "--list"], "--preset: invalid choice: 'nope'"),
    (tools.make_dataset, ["--source", "synthetic", "--seed", "-1"],
     "--seed: invalid value '-1': expected an integer >= 0"),
    (tools.make_dataset, ["--num-synthetic", "abc"], "--num-synthetic: invalid value 'abc': expected an integer >= 1"),
    (tools.make_dataset, ["--jpeg-quality", "0"], "--jpeg-quality: invalid value '0': expected an integer in [1, 100]"),
    (tools.make_dataset, ["--source", "png", "--png-holdout", "1.5"], "--png-holdout: invalid value '1.5'"),
]


@pytest.mark.parametrize("module,argv,words", CASES, ids=[f"{m.__name__}:{' '.join(a)}" for m, a, _ in CASES])
def test_bad_input_is_one_line(module, argv, words, tmp_path, capsys):
    # --data / --out in an empty folder: a command that built a dataset before checking its input would show it.
    flag = "--out" if module is tools.make_dataset else "--data"
    if module not in (benchmarks.speed.sweeps, benchmarks.speed.bench):
        argv = [*argv, flag, str(tmp_path)]
    try:
        rc = module.main(argv)
    except SystemExit as e:
        rc = e.code
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert rc == 2 and len(err) == 1, err
    assert words in err[0] and "Traceback" not in err[0], err[0]
    assert list(tmp_path.iterdir()) == []
