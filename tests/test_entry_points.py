"""One grammar for every command: `python -m X --help` starts with an example of X, and every command that runs a
config takes KEY=VALUE overrides (the batch spelled data.batch_size) and refuses a bad one in one line, before it
reads or writes anything."""

import importlib
import runpy
import signal
import sys

import pytest

# Every `python -m` entry point, and whether it takes KEY=VALUE config overrides.
ENTRY_POINTS = {
    "ffcv_ddpm.train": True, "ffcv_ddpm.telemetry": False, "ffcv_ddpm.env": False, "tools.make_dataset": False,
    "benchmarks.ledger": False,  # shared: the index of both rooms' results
    # how fast
    "benchmarks.speed.bench": True, "benchmarks.speed.sweeps": True, "benchmarks.speed.profile": True,
    "benchmarks.speed.ddp": True, "benchmarks.speed.numerics": True, "benchmarks.speed.loaders": True,
    "benchmarks.speed.norm_bench": True, "benchmarks.speed.flops": True, "benchmarks.speed.trainer_vs_bench": True,
    "benchmarks.speed.reducer_ops": True, "benchmarks.speed.floors": True, "benchmarks.speed.merge": False, "benchmarks.speed.report": False,
    "benchmarks.speed.kernel_regs": False, "benchmarks.speed.conv_gn_bench": True,
    "benchmarks.speed.conv_autotune": True,
    "benchmarks.speed.levers": True, "benchmarks.speed.cudnn_fusion": True, "benchmarks.speed.numerics_draws": False,
    "benchmarks.speed.conv_tma": True, "benchmarks.speed.conv_dgrad": True, "ffcv_ddpm.conv_cutlass": False, "benchmarks.speed.copy_rate": False, "benchmarks.speed.conv_sites": False,
    # how good
    "benchmarks.quality.digits": True, "benchmarks.quality.sde": True, "benchmarks.quality.fid": True,
    "benchmarks.quality.compress": True, "benchmarks.quality.compress_report": False,
    "benchmarks.quality.digits_report": False, "benchmarks.quality.sde_report": False,
    "benchmarks.quality.race": True, "benchmarks.quality.peer_ddpm": False,
}


def test_every_entry_point_is_listed():
    """A new `if __name__ == "__main__"` module joins ENTRY_POINTS (benchmarks.speed.jobs is the runner's child
    only)."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    found = {".".join(p.relative_to(root).with_suffix("").parts)
             for d in ("ffcv_ddpm", "benchmarks", "tools") for p in (root / d).rglob("*.py")
             if '__name__ == "__main__"' in p.read_text()}
    assert found - {"benchmarks.speed.jobs"} == set(ENTRY_POINTS)


@pytest.mark.filterwarnings("ignore:.*found in sys.modules:RuntimeWarning")  # runpy, for an imported module
@pytest.mark.parametrize("name", ENTRY_POINTS)
def test_help_shows_an_example(name, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", [name, "--help"])
    # Run as __main__, a command installs its early signal handlers (stopping.catch_early), which would stay in this
    # worker's process for the tests after it (tests/test_bench_quality.py checks the handlers a command leaves).
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        with pytest.raises(SystemExit) as e:
            runpy.run_module(name, run_name="__main__", alter_sys=True)
    finally:
        for s, handler in handlers.items():
            signal.signal(s, handler)
    out = capsys.readouterr().out
    assert e.value.code == 0, out
    examples = [line for line in out.splitlines() if line.startswith("    ") and f"-m {name}" in line]
    assert examples, out  # an indented command line, as the module docstring shows it
    if ENTRY_POINTS[name]:
        assert "KEY=VALUE" in out and "data.batch_size" in out
    else:
        assert "no KEY=VALUE overrides" in out.replace("\n", " ")


# What each config-running command needs besides the override to get as far as reading its config.
NEEDS = {"benchmarks.quality.fid": ["--run", "RUN"], "benchmarks.speed.norm_bench": ["--out", "OUT"],
         "benchmarks.speed.reducer_ops": ["--out", "OUT"], "benchmarks.speed.floors": ["--out", "OUT"],
         "benchmarks.quality.sde": ["--out", "OUT"], "benchmarks.speed.flops": ["--preset", "tiny"],
         "benchmarks.speed.ddp": ["--device", "cpu"], "benchmarks.quality.digits": ["--out", "OUT", "--work", "WORK"],
         "benchmarks.quality.compress": ["--out", "OUT", "--work", "WORK"],
         "benchmarks.speed.conv_gn_bench": ["--out", "OUT"], "benchmarks.speed.conv_autotune": ["--out", "OUT"],
         "benchmarks.speed.levers": ["--out", "OUT"], "benchmarks.quality.race": ["--out", "OUT"],
         "benchmarks.speed.cudnn_fusion": ["--out", "OUT"], "benchmarks.speed.conv_tma": ["--out", "OUT"],
         "benchmarks.speed.conv_dgrad": ["--out", "OUT"]}


@pytest.mark.parametrize("name", [n for n, takes in ENTRY_POINTS.items() if takes])
def test_a_bad_override_is_one_line_before_anything_happens(name, tmp_path, capsys):
    module = importlib.import_module(name)
    argv = [a.replace("RUN", str(tmp_path / "run")).replace("OUT", str(tmp_path / "out"))
            .replace("WORK", str(tmp_path / "work")) for a in NEEDS.get(name, [])]
    # No data to read (their --help says so):
    if name not in ("benchmarks.speed.flops", "benchmarks.speed.norm_bench", "benchmarks.speed.reducer_ops",
                    "benchmarks.speed.floors", "benchmarks.speed.conv_gn_bench",
                    "benchmarks.speed.conv_autotune", "benchmarks.speed.cudnn_fusion", "benchmarks.speed.conv_tma",
                    "benchmarks.speed.conv_dgrad"):
        argv += ["--data", str(tmp_path)]
    try:
        rc = module.main([*argv, "data.batch_size=0"])
    except SystemExit as e:
        rc = e.code
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert rc == 2 and len(err) == 1, err
    assert err[0].startswith(f"{short_name(name)}: error: "), err[0]  # found after parsing, same prefix
    assert "data.batch_size=0: expected an integer >= 1" in err[0], err[0]
    assert list(tmp_path.iterdir()) == []  # no dataset built, no run folder, no result


def short_name(module: str) -> str:
    return module.rsplit(".", 1)[-1]


@pytest.mark.filterwarnings("ignore:.*found in sys.modules:RuntimeWarning")
@pytest.mark.parametrize("name", ENTRY_POINTS)
def test_every_error_starts_with_the_command_name(name, monkeypatch, capsys):
    """One prefix for every command and every error, 'bench: error: ...', whether argparse or the command found it
    (ffcv_ddpm.checks.Parser and fail; the override test above covers the errors found after parsing)."""
    monkeypatch.setattr(sys, "argv", [name, "-Z"])  # no command has it, and no --KEY VALUE override looks like it
    with pytest.raises(SystemExit) as e:
        runpy.run_module(name, run_name="__main__", alter_sys=True)
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert e.value.code == 2 and len(err) == 1 and err[0].startswith(f"{short_name(name)}: error: "), err


@pytest.mark.parametrize("argv,steps,device", [
    (["--steps", "7", "--device", "cpu"], 7, "cpu"),  # as the README writes them
    (["--steps=7", "--device=cpu"], 7, "cpu"),
    (["steps=7", "train.device=cpu"], 7, "cpu"),
])
def test_overrides_as_options_with_a_space(argv, steps, device):
    from ffcv_ddpm.train import parse_args

    cfg = parse_args(["--preset", "tiny", *argv])
    assert (cfg.train.steps, cfg.train.device) == (steps, device)


def test_a_space_joins_only_unknown_options(capsys):
    from ffcv_ddpm.checks import Parser

    p = Parser(prog="python -m pkg.cmd", overrides=True)
    p.add_argument("--data")
    p.add_argument("--verbose", action="store_true")
    args, overrides = p.parse_with_overrides(["--data", "d", "--steps", "5", "--verbose", "x.y=1", "--lr", "1e-4"])
    assert args.data == "d" and args.verbose and overrides == ["steps=5", "x.y=1", "lr=1e-4"]
    # An abbreviation of a known option stays argparse's; an unknown flag before a KEY=VALUE is no override.
    assert p.parse_with_overrides(["--dat", "e"])[0].data == "e"
    with pytest.raises(SystemExit):
        p.parse_with_overrides(["--oops", "x.y=1"])
    assert capsys.readouterr().err == "cmd: error: unrecognized arguments: --oops (config overrides are KEY=VALUE) " \
                                      "(see --help)\n"


def test_good_overrides_reach_the_config(capsys):
    from benchmarks.speed import bench, flops, sweeps

    assert bench.main(["--list", "--table", "quick", "--rows", "1", "data.num_workers=1"]) == 0
    assert capsys.readouterr().out.rstrip().endswith("data.num_workers=2 data.num_workers=1")  # the row's, then ours
    assert sweeps.main(["--list", "--sweep", "batch", "--preset", "tiny", "--rows", "1", "train.lr=0.001"]) == 0
    assert "train.lr=0.001" in capsys.readouterr().out
    assert flops.main(["--preset", "tiny", "model.base_channels=16"]) == 0
    small = capsys.readouterr().out
    assert flops.main(["--preset", "tiny"]) == 0
    assert small.split()[2] != capsys.readouterr().out.split()[2]  # the parameter count follows the override
