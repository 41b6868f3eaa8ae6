"""Time to a good model (issue 48 item 4): how many seconds from launch until the EMA model's unconditional samples
reach each FD-digits threshold of THRESHOLDS, for this trainer and for lucidrains' denoising-diffusion-pytorch?

    python -m benchmarks.quality.race --data data/digits --out OUT --seconds 240             # 2 GPUs: < 9 minutes
    python -m benchmarks.quality.race --data data/digits --out OUT --seconds 60 --max-wall-s 150   # the small version
    python -m benchmarks.quality.race --data /tmp/d --out /tmp/r --seconds 20 --sides ours --n 20 train.device=cpu ...

The two sides, each in a process of its own, launched at once on a machine with >= 2 GPUs (one GPU each,
CUDA_VISIBLE_DEVICES), one after the other on one GPU or a CPU ("sequential" in the report: a side then shares
nothing but its clock's start with the other):
- ours: this trainer (ffcv_ddpm.train) at the SDE study's digits settings (benchmarks.quality.sde MODEL and TRAIN:
  the 1.6M-parameter conditional UNet with label dropout 0.1, batch 512, bf16, torch.compile, the dataset resident on
  the GPU), the DDPM process; the KEY=VALUE overrides after them;
- peer: denoising-diffusion-pytorch's Trainer on the same train split written as a PNG folder
  (benchmarks.quality.peer_ddpm: its Unet sized to about our parameter count, mixed precision on). It is not a
  dependency of the project: its wheels are installed beside it for this command only.

The clock of a side starts when its process is launched: imports, data loading and compilation count, as a user
waits for them. Every --ours-eval-every / --peer-eval-every steps the side draws --n unconditional samples from its
EMA model (ours: the null label, DDIM train.sample_steps; peer: its own sampler at its GaussianDiffusion's defaults,
named in the report), scores them with one judge against the test set (FD-digits, ffcv_ddpm.quality), and the
evaluation's seconds are taken off its clock (Clock). Ours also draws --n conditional samples (labels 0..9 in turn)
for its conditional accuracy at the same moment, inside the same off-clock evaluation. A side stops at its first
evaluation at or past --seconds on its clock, or at the last evaluation before --max-wall-s after its launch: when
the next interval, as long in wall time as the last one, would end past it (so that a GPU call holds; a side is only
stopped at an evaluation, and an interval the call's own limit cuts is lost: at 8793aab the peer's was).

A threshold is reached at the first evaluation whose FD-digits is at or below it: its clock time, not a time
interpolated between evaluations (the race reports what was measured). The headline is the ratio peer seconds / ours
seconds at each threshold both sides reach, with the range the evaluation intervals leave it: each side crossed
between its previous evaluation and that one, so the ratio lies between peer's previous / ours' reaching and peer's
reaching / ours' previous (an end is open where a side reached it at its first evaluation). The floor (FD-digits
of --n real images the judge never saw, to the test set) is what a generator that matched the data would score.

Writes into --out after the judge and whenever a side reports an evaluation (a run cut short keeps what it measured):
race.json (both curves: step, clock s, eval s, FD-digits, ours' conditional accuracy), race.md (the table), race.png
(FD-digits against clock seconds, log y, the floor and the thresholds drawn), judge.pt, and each side's log
(<side>.log) and curve (<side>.jsonl). SIGTERM/SIGINT stop both sides and the command (ffcv_ddpm.stopping): the
report keeps what was measured, exit 128 + signal.

Time on two H100s (one call): start-up and the judge ~25 s, then both sides at once: --seconds of training plus
their evaluations (ours ~1-2 s each, DDIM 100 twice; the peer's ancestral 1,000-step sampler ~10 s each, estimated,
to be measured by the small version) and their start-up: --seconds 240 with ~12 evaluations a side ~400 s in all.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

THRESHOLDS = (8.0, 4.0, 2.0, 1.0)  # FD-digits, fixed before the race; today's unconditional rows reach ~1.7
SIDES = ("ours", "peer")
NAMES = {"ours": "ffcv-ddpm (this trainer)", "peer": "denoising-diffusion-pytorch Trainer"}


# ---- the clock and the result (no torch: the tests read these alone) ------------------------------------------------

class Clock:
    """A side's training clock: seconds since its process was launched, less the seconds of its evaluations.

    launched: time.time() when the race launched the process (the wall clock, not perf_counter: it is read in two
    processes). Each evaluation appends one JSON line to `curve` as soon as it is measured."""

    def __init__(self, launched: float, seconds: float, max_wall_s: float, curve: Path):
        self.launched, self.seconds, self.max_wall_s, self.curve = launched, seconds, max_wall_s, Path(curve)
        self.eval_s = 0.0  # the evaluations so far, off the clock
        self.wall_s = 0.0  # wall seconds from launch to the end of the last evaluation

    def evaluate(self, step: int, measure: Callable[[], dict]) -> bool:
        """Runs measure() (the evaluation: its result's keys go into the curve point) off the clock; True when the
        side's time is up: its clock at or past `seconds`, or the next interval, as long as this one (training and
        evaluation, in wall time), would end past `max_wall_s` since launch."""
        t0 = time.time()
        clock_s = t0 - self.launched - self.eval_s
        metrics = measure()
        eval_s = time.time() - t0
        self.eval_s += eval_s
        wall_s = time.time() - self.launched
        point = {"step": step, "clock_s": clock_s, "eval_s": eval_s, "wall_s": wall_s, **metrics}
        with open(self.curve, "a") as f:
            f.write(json.dumps(point) + "\n")
        interval, self.wall_s = wall_s - self.wall_s, wall_s
        return clock_s >= self.seconds or wall_s + interval > self.max_wall_s


def read_curve(path: Path) -> list[dict]:
    """A side's curve so far (a line being written is left for the next read)."""
    if not path.is_file():
        return []
    points = []
    for line in path.read_text().splitlines():
        try:
            points.append(json.loads(line))
        except ValueError:
            break
    return points


def first_reach(curve: list[dict], threshold: float) -> dict | None:
    """The first evaluation (by step) whose FD-digits is at or below `threshold`; None if none is."""
    return next((p for p in sorted(curve, key=lambda p: p["step"]) if p["fd_digits"] <= threshold), None)


def previous_clock(curve: list[dict], point: dict) -> float | None:
    """The clock of the evaluation before `point` (the side crossed the threshold after it); None for the first."""
    before = [p["clock_s"] for p in curve if p["step"] < point["step"]]
    return max(before) if before else None


def race_table(curves: dict[str, list[dict]], thresholds=THRESHOLDS) -> list[dict]:
    """Per threshold: each side's first evaluation that reaches it (None: not reached), and where both reach it the
    ratio peer seconds / ours seconds (> 1: ours is there sooner) and its range [low, high] from each side's
    previous evaluation (None: that end is open)."""
    rows = []
    for threshold in thresholds:
        hit = {side: first_reach(curves.get(side, []), threshold) for side in SIDES}
        row = {"threshold": threshold, **hit, "ratio": None, "ratio_range": None}
        if all(hit.values()):
            ours, peer = hit["ours"]["clock_s"], hit["peer"]["clock_s"]
            ours_before, peer_before = (previous_clock(curves[side], hit[side]) for side in ("ours", "peer"))
            row["ratio"] = peer / ours
            row["ratio_range"] = [None if peer_before is None else peer_before / ours,
                                  None if ours_before is None else peer / ours_before]
        rows.append(row)
    return rows


def _ratio(row: dict) -> str:
    """'1.87 (1.40-1.96)': the ratio and the range its evaluation intervals leave it ('?' for an open end)."""
    if row["ratio"] is None:
        return "-"
    low, high = (("?" if x is None else f"{x:.2f}") for x in row.get("ratio_range") or (None, None))
    return f"{row['ratio']:.2f} ({low}-{high})"


def write_report(result: dict, out: Path, draw: bool = True) -> None:
    """race.json and race.md; race.png too unless draw is False."""
    from ffcv_ddpm.train import write_json

    out.mkdir(parents=True, exist_ok=True)
    curves = {side: result["sides"].get(side, {}).get("curve", []) for side in SIDES}
    result["table"] = race_table(curves, result["thresholds"])
    write_json(out / "race.json", result)
    (out / "race.md").write_text(markdown(result))
    if draw:
        plot(result, out / "race.png")


def _seconds(point: dict | None) -> str:
    return "not reached" if point is None else f"{point['clock_s']:.0f} s (step {point['step']:,})"


def markdown(result: dict) -> str:
    floor = result.get("floor") or {}
    lines = [f"# Time to a good model: {NAMES['ours']} vs {NAMES['peer']}", "",
             f"`{result['command']}`", "",
             f"Device: {result['device']}; sides "
             f"{'one after the other' if result['sequential'] else 'at once, one GPU each'}"
             f"; budget {result['settings']['seconds']:g} s of training clock a side (evaluations off the clock), "
             f"{result['settings']['n']} unconditional EMA samples per evaluation.",
             f"Floor: FD-digits {floor['fd_digits']:.3f} ({floor['n']} held-out real images)." if floor else "Floor: -",
             "", "| FD-digits <= | ours | ours cond. acc. there | peer | peer s / ours s (range) |",
             "|---:|---:|---:|---:|---:|"]
    for row in result.get("table", []):
        acc = row["ours"]["cond_acc"] if row["ours"] else None
        lines.append(f"| {row['threshold']:g} | {_seconds(row['ours'])} | {'-' if acc is None else f'{acc:.1%}'} | "
                     f"{_seconds(row['peer'])} | {_ratio(row)} |")
    for side in SIDES:
        info = result["sides"].get(side)
        if not info:
            continue
        lines += ["", f"## {side}: {NAMES[side]}", "", info.get("summary", ""), f"Status: {info.get('status', '-')}",
                  "", "| step | clock s | eval s | FD-digits | cond. acc. |", "|---:|---:|---:|---:|---:|"]
        for p in info.get("curve", []):
            acc = p.get("cond_acc")
            lines.append(f"| {p['step']:,} | {p['clock_s']:.1f} | {p['eval_s']:.1f} | {p['fd_digits']:.3f} | "
                         f"{'-' if acc is None else f'{acc:.1%}'} |")
    if result.get("stopped"):
        lines += ["", f"Stopped: {result['stopped']}"]
    return "\n".join(lines) + "\n"


def plot(result: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for side, style in zip(SIDES, ("o-", "s-")):
        curve = result["sides"].get(side, {}).get("curve", [])
        if curve:
            ax.plot([p["clock_s"] for p in curve], [p["fd_digits"] for p in curve], style, ms=3, label=NAMES[side])
    for threshold in result["thresholds"]:
        ax.axhline(threshold, color="0.8", lw=0.8, ls=":")
    if result.get("floor"):
        ax.axhline(result["floor"]["fd_digits"], color="k", lw=1, ls="--",
                   label=f"floor ({result['floor']['n']} real images)")
    ax.set_yscale("log")
    ax.set_xlabel("training clock, s (from launch; evaluations taken off)")
    ax.set_ylabel("FD-digits, unconditional EMA samples")
    ax.set_title(f"Time to a good model ({result['device']})", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ---- our side (a process of its own: --side ours) ---------------------------------------------------------------

def ours_config(args):
    """The trainer's config for our side: the SDE study's digits settings, then the command's overrides. The run
    ends at the evaluation where its time is up (OursEvaluator's "stop"), so train.steps only bounds it."""
    from benchmarks.quality.sde import MODEL, TRAIN
    from ffcv_ddpm.config import load_config

    return load_config(args.preset, [
        *MODEL, *TRAIN, f"data.path={args.data / 'digits_train_raw.beton'}", "train.steps=1000000",
        "train.ckpt_every=1000000", f"train.eval_every={args.ours_eval_every}", f"train.eval_n={args.n}",
        f"train.seed={args.seed}", "train.desc=race", *args.overrides])


class OursEvaluator:
    """train(evaluator=...): --n unconditional (null label) and --n conditional samples of the EMA model at each
    evaluation, scored by the judge, off the side's clock; "stop" when its time is up."""

    def __init__(self, cfg, clock: Clock, judge_path: Path, test_beton: Path):
        from ffcv_ddpm import quality
        from ffcv_ddpm.step import AMP_DTYPES, resolve_device

        self.cfg, self.clock, self.calls = cfg, clock, 0
        self.device = resolve_device(cfg.train.device)
        self.amp = AMP_DTYPES[cfg.train.precision] if self.device.type == "cuda" else None
        self.judge = quality.load_judge(judge_path, self.device)
        self.test_u8 = quality.beton_tensors(test_beton, self.device)[0]

    def __call__(self, model, diffusion) -> dict:
        self.calls += 1  # called every train.eval_every steps (the run never reaches its train.steps)
        stop = self.clock.evaluate(self.calls * self.cfg.train.eval_every, lambda: self.measure(model, diffusion))
        return {"stop": stop}

    def measure(self, model, diffusion) -> dict:
        import torch

        from ffcv_ddpm.evaluate import class_labels, generate
        from ffcv_ddpm.quality import evaluate_samples

        cfg, n = self.cfg, self.cfg.train.eval_n
        labels = class_labels(n, cfg.model.num_classes, self.device)
        shape = (cfg.model.in_channels, cfg.model.image_size, cfg.model.image_size)
        layout = torch.channels_last if cfg.train.channels_last else torch.contiguous_format
        draw = lambda y: generate(model, diffusion, n, labels=y, steps=cfg.train.sample_steps,  # noqa: E731
                                  batch=cfg.data.batch_size, seed=cfg.train.seed, amp_dtype=self.amp, shape=shape,
                                  memory_format=layout)
        uncond = evaluate_samples(self.judge, draw(torch.full_like(labels, cfg.model.num_classes)), None,
                                  self.test_u8)
        cond = evaluate_samples(self.judge, draw(labels), labels, self.test_u8)
        return {"fd_digits": uncond["fd_digits"], "cond_acc": cond["cond_acc"], "fd_digits_cond": cond["fd_digits"]}


def run_ours(args, stop) -> None:
    from ffcv_ddpm.train import train
    from ffcv_ddpm.unet import build_model, count_params
    import torch

    cfg = ours_config(args)
    cfg.train.out_dir = str(args.work / "ours-runs")
    with torch.device("meta"):
        params = count_params(build_model(cfg.model))
    evaluator = OursEvaluator(cfg, Clock(args.launched, args.seconds, args.max_wall_s, args.curve), args.judge,
                              args.data / "digits_test_raw.beton")
    write_info(args.curve, {
        "params": params, "config": cfg.to_dict(), "sampler": f"DDIM {cfg.train.sample_steps} (eta 0)",
        "summary": f"{params:,} parameters; batch {cfg.data.batch_size}, {cfg.train.precision}, compile "
                   f"{cfg.train.compile}, lr {cfg.train.lr:g}, EMA {cfg.train.ema_decay}; samples: DDIM "
                   f"{cfg.train.sample_steps}, unconditional = the null label (label dropout "
                   f"{cfg.diffusion.p_uncond:g})"})
    train(cfg, stop=stop, evaluator=evaluator)
    stop.phase = "start-up"
    stop.check()  # a signal stopped the run with its checkpoint: the side says it was stopped


def write_info(curve: Path, info: dict) -> None:
    from ffcv_ddpm.train import write_json

    write_json(curve.with_name(curve.stem + "-info.json"), info)


# ---- the race -----------------------------------------------------------------------------------------------------

def write_png_folder(beton: Path, folder: Path) -> int:
    """Every image of a .beton as one RGB PNG in `folder`, at the .beton's own resolution; returns how many. The
    peer's Dataset (benchmarks.quality.peer_ddpm) reads a folder of images; labels are not needed: it trains
    unconditionally."""
    import numpy as np
    from PIL import Image

    from ffcv_ddpm.data import read_beton

    images, _ = read_beton(beton)  # (N, H, W, 3) uint8
    folder.mkdir(parents=True, exist_ok=True)
    for i, image in enumerate(images):
        Image.fromarray(np.ascontiguousarray(image), mode="RGB").save(folder / f"{i:05d}.png")
    return len(images)


def side_command(side: str, args, launched: float) -> list[str]:
    common = ["--judge", str(args.judge_out), "--n", str(args.n), "--seconds", str(args.seconds), "--max-wall-s",
              str(args.max_wall_s), "--launched", repr(launched), "--curve", str(args.out / f"{side}.jsonl"),
              "--seed", str(args.seed)]
    if side == "ours":
        return [sys.executable, "-m", "benchmarks.quality.race", "--side", "ours", "--data", str(args.data), "--out",
                str(args.out), "--work", str(args.work), "--ours-eval-every", str(args.ours_eval_every),
                "--preset", args.preset, *common, *args.overrides]
    return [sys.executable, "-m", "benchmarks.quality.peer_ddpm", "--images", str(args.images), "--test-beton",
            str(args.data / "digits_test_raw.beton"), "--work", str(args.work / "peer"), "--eval-every",
            str(args.peer_eval_every), "--batch", str(args.peer_batch), "--loader", args.peer_loader,
            "--dim", str(args.peer_dim), "--dim-mults",
            ",".join(map(str, args.peer_dim_mults)), "--precision", args.peer_precision, "--sampling-steps",
            str(args.peer_sampling_steps), "--train-seed", str(args.seed), *common]  # seeded as ours is


def run(args, argv: list[str], stop) -> dict:
    import torch

    from benchmarks.quality.sde import find_betons
    from benchmarks.quality.study import saved_when_stopped
    from ffcv_ddpm import quality
    from ffcv_ddpm.env import environment
    from ffcv_ddpm.stopping import finish, start

    train_beton, test_beton = find_betons(args.data)
    gpus = torch.cuda.device_count()
    parallel = gpus >= 2 and len(args.sides) == 2 and not args.sequential
    cards = [torch.cuda.get_device_name(i) for i in range(min(gpus, 2))]
    result = {"command": "python -m benchmarks.quality.race " + " ".join(argv), "environment": environment(),
              "device": (" + ".join(cards) if parallel else cards[0] if cards else "CPU"),
              "sequential": not parallel, "thresholds": list(THRESHOLDS), "complete": False,
              "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()
                           if k not in ("side", "launched", "curve", "cfg")},
              "sides": {}}
    args.out.mkdir(parents=True, exist_ok=True)
    args.judge_out = args.out / "judge.pt"

    def save(draw: bool = True) -> None:
        for side in args.sides:
            entry = result["sides"].setdefault(side, {"status": "waiting"})
            entry["curve"] = read_curve(args.out / f"{side}.jsonl")
            info = args.out / f"{side}-info.json"
            if info.is_file():
                entry.update(json.loads(info.read_text()))
        write_report(result, args.out, draw)
        stop.kept["report"] = f"the report {args.out / 'race.json'}"

    def save_stopped() -> None:
        for entry in result["sides"].values():
            if entry.get("status") == "running":
                entry["status"] = "stopped with the race"
        save(draw=False)

    with saved_when_stopped(stop, result, save_stopped), tempfile.TemporaryDirectory() as tmp:
        # ---- judge and floor (before either clock starts) ----------------------------------------------------------
        stop.doing("training the judge")
        device = torch.device("cuda:0" if gpus else "cpu")
        train_u8, train_y = quality.beton_tensors(train_beton, device)
        test_u8 = quality.beton_tensors(test_beton, device)[0]
        if args.judge:
            judge = quality.load_judge(args.judge, device)
        else:
            judge = quality.train_judge(train_beton, device, steps=args.judge_steps, seed=args.seed, hold_out=args.n)
        quality.save_judge(judge, args.judge_out)
        result["floor"] = quality.fd_floor(judge, train_u8, train_y, test_u8, args.n)
        result["judge"] = {"path": str(args.judge or args.judge_out), "steps": judge.info.get("steps")}
        del judge, train_u8, test_u8
        torch.cuda.empty_cache()
        for side in args.sides:
            (args.out / f"{side}.jsonl").unlink(missing_ok=True)
        # The peer reads a PNG folder (its Dataset's only input): written here, off its clock, as our .beton was.
        args.images = Path(tmp) / "digits-train-png"
        args.work = args.work or Path(tmp) / "work"
        if "peer" in args.sides:
            write_png_folder(train_beton, args.images)
        save()
        print(f"race: floor FD-digits {result['floor']['fd_digits']:.3f}; sides "
              f"{'at once' if parallel else 'one after the other'}: {', '.join(args.sides)}", flush=True)

        # ---- the sides ---------------------------------------------------------------------------------------------
        def launch(side: str, gpu: int | None) -> subprocess.Popen:
            env = dict(os.environ, TQDM_DISABLE="1")  # the peer's sampler draws a progress bar per call
            if gpu is not None:
                env["CUDA_VISIBLE_DEVICES"] = str(gpu)
            result["sides"].setdefault(side, {})["status"] = "running"
            log = open(args.out / f"{side}.log", "w")
            launched = time.time()
            return start(side_command(side, args, launched), stdout=log, stderr=subprocess.STDOUT, env=env)

        def watch(procs: dict[str, subprocess.Popen]) -> None:
            """Rewrites the report as evaluations come in, until every side has exited."""
            seen = {side: 0 for side in procs}
            while True:
                stop.check()
                done = {side: proc.poll() is not None for side, proc in procs.items()}
                counts = {side: len(read_curve(args.out / f"{side}.jsonl")) for side in procs}
                if counts != seen:
                    save()
                    for side in procs:
                        for p in result["sides"][side]["curve"][seen[side]:]:
                            print(f"race: {side} step {p['step']:,}: {p['clock_s']:.0f} s on the clock, FD-digits "
                                  f"{p['fd_digits']:.3f} (eval {p['eval_s']:.1f} s)", flush=True)
                    seen = counts
                if all(done.values()):
                    break
                time.sleep(1.0)
            for side, proc in procs.items():
                finish(proc)
                result["sides"][side]["status"] = status_of(proc.returncode, args.out / f"{side}.log")

        stop.doing("racing")
        if parallel:
            watch({side: launch(side, gpu) for gpu, side in enumerate(args.sides)})
        else:
            for side in args.sides:
                stop.doing(f"racing: {side}")
                watch({side: launch(side, None)})
        stop.done()
        result["complete"] = all(result["sides"][s]["status"] == "done" for s in args.sides)
        save()
    for row in result["table"]:
        ratio = "" if row["ratio"] is None else f"; peer / ours {_ratio(row)}"
        print(f"race: FD-digits <= {row['threshold']:g}: ours {_seconds(row['ours'])}, peer "
              f"{_seconds(row['peer'])}{ratio}")
    return result


def status_of(returncode: int, log: Path) -> str:
    """'done', or how the side ended: its exit status and the last line of its log (its one-line error)."""
    if returncode == 0:
        return "done"
    last = next((line for line in reversed(log.read_text().splitlines()) if line.strip()), "") if log.is_file() else ""
    return f"failed (exit {returncode}): {last}"


def parse_args(argv: list[str]) -> argparse.Namespace:
    from ffcv_ddpm.checks import Parser, above, at_least, int_list, one_of, option, str_list
    from ffcv_ddpm.unet import PRESETS

    count = option(int, at_least(1))
    p = Parser(prog="python -m benchmarks.quality.race", doc=__doc__, overrides=True,
               epilog="The overrides go to our side's trainer, after benchmarks.quality.sde's MODEL and TRAIN.")
    p.add_argument("--data", type=Path, required=True, help="the digits folder (`make dataset SOURCE=digits`)")
    p.add_argument("--out", type=Path, required=True, help="folder for race.json/.md/.png, judge.pt, the logs")
    p.add_argument("--seconds", type=option(float, above(0)), default=240.0,
                   help="training clock of each side (from launch, evaluations off): it stops at its first "
                        "evaluation past it")
    p.add_argument("--max-wall-s", type=option(float, above(0)), default=520.0,
                   help="a side also stops at its last evaluation before this long after its launch (evaluations "
                        "included; the next interval taken as long as the last)")
    p.add_argument("--n", type=option(int, at_least(10)), default=500,
                   help="unconditional samples per evaluation (and the judge's held-out images for the floor)")
    p.add_argument("--sides", type=str_list(one_of(SIDES)), default=list(SIDES), help="(default: ours,peer)")
    p.add_argument("--sequential", action="store_true", help="one side after the other even on 2 GPUs")
    p.add_argument("--ours-eval-every", type=count, default=200, help="our side's steps between evaluations")
    p.add_argument("--peer-eval-every", type=count, default=500, help="the peer's steps between evaluations")
    p.add_argument("--peer-batch", type=count, default=256, help="the peer Trainer's train_batch_size")
    p.add_argument("--peer-loader", choices=("persistent", "its"), default="persistent",
                   help="its DataLoader with persistent workers (default), or its Trainer's own "
                        "(benchmarks.quality.peer_ddpm)")
    p.add_argument("--peer-dim", type=count, default=24, help="the peer Unet's dim")
    p.add_argument("--peer-dim-mults", type=int_list(at_least(1)), default=[1, 2, 4], help="(default: 1,2,4)")
    p.add_argument("--peer-precision", choices=("fp16", "bf16", "no"), default="fp16",
                   help="the peer Trainer's mixed precision (amp; its default type fp16; no = amp off)")
    p.add_argument("--peer-sampling-steps", type=option(int, at_least(0)), default=0,
                   help="the peer GaussianDiffusion's sampling_timesteps (0: its default, ancestral over all 1000)")
    p.add_argument("--judge", type=Path, help="a saved judge (default: train one)")
    p.add_argument("--judge-steps", type=count, default=2000)
    p.add_argument("--seed", type=option(int, at_least(0)), default=0,
                   help="both sides' training seed (ours train.seed, the peer's --train-seed), the judge's and the "
                        "samples'")
    p.add_argument("--preset", default="ddpm-cifar10", type=option(str, one_of(lambda: tuple(PRESETS))),
                   help="preset our MODEL overrides start from")
    p.add_argument("--work", type=Path, help="where the sides' runs go (default: a temporary folder)")
    # A side's own process (side_command): which side, when the race launched it, where its curve goes.
    p.add_argument("--side", choices=("ours",), help=argparse.SUPPRESS)
    p.add_argument("--launched", type=float, help=argparse.SUPPRESS)
    p.add_argument("--curve", type=Path, help=argparse.SUPPRESS)
    args, args.overrides = p.parse_with_overrides(argv)
    if args.side and (args.launched is None or args.curve is None or args.judge is None):
        p.error("--side needs --launched, --curve and --judge (the race passes them)")
    try:
        args.cfg = ours_config(args)  # our side's config, checked before anything runs
    except ValueError as e:
        p.error(str(e))
    if args.cfg.train.eval_every % args.cfg.train.log_every:
        p.error(f"--ours-eval-every {args.ours_eval_every}: a multiple of train.log_every="
                f"{args.cfg.train.log_every} (the trainer evaluates at its log lines)")
    if args.cfg.model.num_classes < 2 or args.cfg.diffusion.p_uncond <= 0:
        p.error("our side samples unconditionally through the null label: it needs model.num_classes >= 2 and "
                "diffusion.p_uncond > 0")
    p.check_paths(inputs=[("--data", args.data, "folder", "build the digits with `make dataset SOURCE=digits`"),
                          ("--judge", args.judge, "file")],
                  outputs=[("--out", args.out), ("--work", args.work)])
    return args


def main(argv: list[str] | None = None) -> int:
    from benchmarks.quality.study import run_study
    from ffcv_ddpm.stopping import run_command

    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.side == "ours":
        args.work = args.work or args.out
        return run_command("race-ours", lambda stop: run_ours(args, stop), errors=_errors())

    def body(stop) -> None:
        run(args, argv, stop)
        print(f"race: wrote {args.out / 'race.json'}, race.md, race.png")

    return run_study("race", body)


def _errors() -> tuple:
    from benchmarks.common import BenchError
    from ffcv_ddpm.step import TrainingError

    return (BenchError, TrainingError, ValueError, FileNotFoundError, OSError)


if __name__ == "__main__":
    sys.exit(main())
