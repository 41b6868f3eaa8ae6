"""`make quality`: does the trainer learn? A class-conditional DDPM trained on the digits, scored by a digits judge.

    python -m benchmarks.quality.digits --data data/digits --out benchmarks/results/h100/quality-digits
    python -m benchmarks.quality.digits --data /tmp/d --out /tmp/q --preset tiny --steps 4 model.num_classes=10 \
        data.batch_size=16 train.device=cpu train.compile=False      # CPU toy (tests/test_bench_quality.py)

One command, in this order (each phase's result is written before the next starts, so a run cut off keeps what
it measured):
1. the digits .beton files (`make dataset SOURCE=digits`), if --data has none;
2. the judge (ffcv_ddpm.quality): a small CNN trained --judge-steps on the train split less a held-out, class-balanced
   set of --n-per-class x 10 images; its test accuracy;
3. the floor: FD-digits between those held-out images (which the judge never saw) and the test set;
4. training: the `digits` preset (6.5M parameters, 10 classes + the null label, label dropout
   diffusion.p_uncond = 0.1) for --steps steps of data.batch_size images (256 here), bf16 + torch.compile on a GPU,
   the whole dataset resident on the device, no flips (a mirrored digit is another symbol or none); the trainer logs
   FD-digits and conditional accuracy every steps/4 steps (train.eval_every) into its stats.jsonl;
5. sampling rows, in priority order: EMA weights with DDIM 100 at guidance w = 0, 1, 2, 4 and unconditional;
   DDIM 50; raw weights with DDIM 100; ancestral DDPM (all 1000 steps) at the first w, then at the w whose DDIM 100
   row had the best conditional accuracy, then at the others. Each row: --n-per-class samples per class from the
   same seed, FD-digits to the test set and conditional accuracy; the report is rewritten after every row. A row
   whose time (estimated from the rows before it) would end past --budget-s is recorded as skipped.

Writes quality.json, quality.md, quality.png (FD-digits and conditional accuracy per guidance weight and sampler, and
the training curve) and samples.png (per-class grids: rows = classes) into --out; the run folder (checkpoint,
stats.jsonl) and the judge go to --work. SIGTERM/SIGINT stop the whole command (benchmarks.quality.study): the report
keeps what was measured, an unfinished training run is removed, exit 128 + signal.

Time on one H100, measured at commit 44a0e9b: start-up and judge ~25 s; training 4,000 steps of 256 with its four
evaluations 237 s including compilation. The rows, estimated from that run (its first four rows fitted in the
seconds its budget left, so eager sampling evaluates the network on >= ~14,000 images per second): DDIM 100 ~4 s
unguided, ~7 s guided (a guided step is one forward of a doubled batch), DDIM 50 half that, DDPM 1000 ten times that:
~175 s for every row up to the DDPM row at the best w, ~450 s in all, inside the default --budget-s 470 and the 8.5
minutes one GPU call has for this report (the DDPM rows at the other weights, ~140 s more, run only if time is left).
Sampling runs eagerly: compiling the network for its two batch shapes (n and 2n) would cost (~2 x 30-60 s) about
what it saves on these rows.

Guidance weight w (Ho & Salimans): ε = (1 + w) ε(x, y) - w ε(x, ∅); w = 0 is the plain conditional model.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch

from benchmarks.quality.digits_report import best_row, write_report
from ffcv_ddpm.checks import (BadValue, Parser, at_least, check_input, check_out_dir, float_list, int_list, one_of,
                              option)

# The trainer's settings for this report, before the command's own KEY=VALUE overrides (which win).
TRAIN_DEFAULTS = ("data.batch_size=256", "train.lr=5e-4", "train.ema_decay=0.998")  # 0.998^4000: 0.03% of the init

TRAIN, TEST = "digits_train_raw.beton", "digits_test_raw.beton"
DIGITS_DATA = Path("data/digits")  # the one folder where missing digits files are built rather than refused
BEST = "best"  # the guidance of a DDPM row decided when it runs: the w whose main DDIM row did best


def parse_args(argv: list[str]) -> argparse.Namespace:
    """The options, each checked here (and the run config built from them), before anything is read or written."""
    from ffcv_ddpm.unet import PRESETS

    count = option(int, at_least(1))
    p = Parser(prog="python -m benchmarks.quality.digits", doc=__doc__, overrides=True,
               epilog=f"The overrides go to the trainer after this report's own settings: {' '.join(TRAIN_DEFAULTS)} "
                      "(peak learning rate after 200 warm-up steps).")
    p.add_argument("--data", type=Path, default=DIGITS_DATA,
                   help=f"digits data folder (`make dataset SOURCE=digits`; {DIGITS_DATA} is built if missing)")
    p.add_argument("--out", type=Path, help="report folder (default benchmarks/results/<card>/quality-digits)")
    p.add_argument("--work", type=Path, default=Path("runs"), help="where the training run and the judge go")
    p.add_argument("--preset", default="digits", type=option(str, one_of(lambda: tuple(PRESETS))),
                   help="model preset (a conditional one, or num_classes=10 below)")
    p.add_argument("--steps", type=count, default=4000, help="training steps (train.steps)")
    p.add_argument("--judge-steps", type=count, default=2000, help="judge training steps")
    p.add_argument("--n-per-class", type=count, default=50,
                   help="samples per class in each row (and the judge's held-out images per class)")
    p.add_argument("--guidance", type=float_list(at_least(0)), default=[0.0, 1.0, 2.0, 4.0],
                   help="guidance weights w, comma-separated (0: no guidance) (default: 0,1,2,4)")
    p.add_argument("--ddim-steps", type=int_list(at_least(1)), default=[100, 50],
                   help="DDIM step counts: the first is the main one (default: 100,50)")
    p.add_argument("--sample-batch", type=count, default=1000, help="images per sampling batch")
    p.add_argument("--budget-s", type=option(float, at_least(0)), default=470,
                   help="no row starts that would end after this many seconds from the start")
    p.add_argument("--seed", type=option(int, at_least(0)), default=0)
    args, args.overrides = p.parse_with_overrides(argv)
    try:
        args.cfg = train_config(args, args.data / TRAIN, args.data / TEST, args.work / "quality-judge.pt")
        check_digits(args.data)
    except ValueError as e:
        p.error(str(e))
    p.check_paths(outputs=[("--out", args.out), ("--work", args.work)])
    return args


def check_digits(data: Path) -> None:
    """--data holds the digits .beton files, or ensure_digits may build them there: a writable folder with no other
    dataset in it, which exists unless it is data/digits; BadValue otherwise (a typo or a CIFAR-10 folder is refused,
    not filled with digits). Looks only."""
    if (data / TRAIN).is_file() and (data / TEST).is_file():
        return
    make = f"make it with `make dataset SOURCE=digits OUT={data}`"
    if data.resolve() != DIGITS_DATA.resolve():
        check_input(data, "--data", "folder", f"{make}, or leave --data out for {DIGITS_DATA}")
    if other := sorted(p.name for p in data.glob("*_train_raw.beton") if p.name != TRAIN):
        raise BadValue(f"--data {data}: holds another dataset ({', '.join(other)}), not the digits ({TRAIN}); give "
                       f"a digits folder ({make})")
    check_out_dir(data, "--data")  # the digits are built there


def ensure_digits(data: Path) -> bool:
    """Builds the digits .beton files (tools.make_dataset) when missing; True if it did."""
    if (data / TRAIN).is_file() and (data / TEST).is_file():
        return False
    from tools.cifar10 import DatasetError
    from tools.make_dataset import check_one_dataset, main as make_dataset

    try:  # a CIFAR-10 folder, say: the digits files and manifest written into it would make it hold two
        check_one_dataset(data, "digits", "this report's build (make dataset SOURCE=digits)")
    except DatasetError as e:
        raise ValueError(str(e)) from None

    print(f"digits: no {TRAIN} in {data}/: building the digits dataset there (make dataset SOURCE=digits)", flush=True)
    if make_dataset(["--source", "digits", "--out", str(data)]) != 0:
        raise ValueError(f"building the digits dataset in {data} failed (see the error above)")
    return True


def rows_in_priority_order(args) -> list[dict]:
    """The sampling rows; earlier rows matter more (the budget skips from the end)."""
    main_ddim, *other_ddim = args.ddim_steps

    def ema(sampler: str, steps, w) -> dict:
        return dict(weights="EMA", sampler=sampler, steps=steps, guidance=w)

    rows = [ema("ddim", main_ddim, w) for w in args.guidance]
    rows.append(ema("ddim", main_ddim, None))  # null label: unconditional
    rows += [ema("ddim", s, w) for s in other_ddim for w in args.guidance]
    rows += [dict(weights="raw", sampler="ddim", steps=main_ddim, guidance=w) for w in args.guidance]
    # Ancestral DDPM costs T / main_ddim DDIM rows: the first w, the best one, then the others while time is left.
    rows += [ema("ddpm", None, args.guidance[0]), ema("ddpm", None, BEST)]
    rows += [ema("ddpm", None, w) for w in args.guidance[1:]]
    return rows


def best_guidance(rows: list[dict], main_ddim: int, taken: set) -> float | None:
    """The w of the measured EMA DDIM-main row with the best conditional accuracy (lower FD-digits breaks ties),
    among the weights not in `taken`; None if there is none."""
    scored = [r for r in rows if r["status"] == "ok" and r["weights"] == "EMA" and r["sampler"] == "ddim"
              and r["steps"] == main_ddim and r["guidance"] is not None and r["guidance"] not in taken]
    best = max(scored, key=lambda r: (r["cond_acc"], -r["fd_digits"]), default=None)
    return None if best is None else best["guidance"]


def train_config(args, train_beton: Path, test_beton: Path, judge_path: Path):
    """The training run's config: this report's settings, then the command's overrides; ValueError if the report
    cannot use it (an unconditional model, a VE process, DDIM steps beyond the schedule)."""
    from ffcv_ddpm.config import load_config

    eval_every = max(1, args.steps // 4)
    cfg = load_config(args.preset, [
        f"data.path={train_beton}", "data.loader=gpu", "data.flip=none", *TRAIN_DEFAULTS,
        f"data.seed={args.seed}", f"train.steps={args.steps}",
        f"train.warmup_steps={min(200, max(1, args.steps // 10))}",
        f"train.log_every={min(100, eval_every)}", f"train.ckpt_every={args.steps}", "train.sample_every=0",
        f"train.eval_every={eval_every}", f"train.eval_n={10 * args.n_per_class}",
        f"train.sample_steps={args.ddim_steps[0]}", f"train.eval_judge={judge_path}",
        f"train.eval_ref={test_beton}", "train.progress=False", "train.desc=quality", f"train.seed={args.seed}",
        f"train.out_dir={args.work}", *args.overrides])
    if cfg.model.num_classes < 2:
        raise ValueError(f"preset {args.preset!r} is unconditional: add model.num_classes=10")
    if cfg.diffusion.process != "ddpm":
        raise ValueError(f"diffusion.process={cfg.diffusion.process}: this report's rows are DDPM's samplers (DDIM, "
                         "ancestral); benchmarks.quality.sde studies the VE process")
    if max(args.ddim_steps) > cfg.diffusion.timesteps:
        raise ValueError(f"--ddim-steps {max(args.ddim_steps)}: at most diffusion.timesteps="
                         f"{cfg.diffusion.timesteps}")
    return cfg


def run(args, argv: list[str], t_start: float, stop) -> dict:
    from benchmarks.common import results_out
    from benchmarks.quality.study import saved_when_stopped, train_run
    from ffcv_ddpm.train import read_stats
    from ffcv_ddpm import quality
    from ffcv_ddpm.data import dataset_info
    from ffcv_ddpm.env import environment
    from ffcv_ddpm.evaluate import class_labels, generate, load_run
    from ffcv_ddpm.step import AMP_DTYPES, resolve_device
    from ffcv_ddpm.unet import build_model, count_params

    cfg = args.cfg
    train_beton, test_beton = args.data / TRAIN, args.data / TEST
    judge_path = Path(cfg.train.eval_judge)
    device = resolve_device(cfg.train.device)
    card = torch.cuda.get_device_name(device) if device.type == "cuda" else None
    out = results_out(args.out, card, "quality-digits")
    stop.doing("building the digits dataset")
    built = ensure_digits(args.data)
    info = dataset_info(train_beton)
    manifest = info.pop("manifest") or {}
    result = {
        "command": "python -m benchmarks.quality.digits " + " ".join(argv), "device": card or "CPU",
        "environment": environment(), "budget_s": args.budget_s, "complete": False,
        "dataset": {**info, "built_now": built, "counts": manifest.get("counts"),
                    "split": manifest.get("settings", {}).get("split"),
                    "preprocess": manifest.get("settings", {}).get("preprocess")},
        "config": cfg.to_dict(), "rows": [],
    }
    images = {}  # the samples of the main rows, for the grids

    def save(phase: str | None = None, draw: bool = True) -> None:
        """JSON + Markdown always; the two PNGs only when asked (matplotlib costs ~1 s per rewrite)."""
        result["elapsed_s"] = time.perf_counter() - t_start
        result["best"] = best_row(result["rows"])
        write_report(result, out, images if draw else None)
        stop.kept["report"] = f"the report {out} ({sum(r['status'] == 'ok' for r in result['rows'])} rows measured)"
        if phase:
            print(f"digits: [{result['elapsed_s']:.0f} s] {phase}", flush=True)

    with saved_when_stopped(stop, result, lambda: save(draw=False)):
        # ---- judge and floor ------------------------------------------------------------------------------------
        stop.doing("training the judge")
        n = args.n_per_class * cfg.model.num_classes
        print(f"digits: [{time.perf_counter() - t_start:.0f} s] training the judge ({args.judge_steps} steps)",
              flush=True)  # the first phase that takes long: without a line the command looks stuck
        t0 = time.perf_counter()
        judge = quality.train_judge(train_beton, device, steps=args.judge_steps, seed=args.seed, hold_out=n)
        args.work.mkdir(parents=True, exist_ok=True)
        quality.save_judge(judge, judge_path)
        stop.kept["judge"] = f"the judge {judge_path}"
        test_x, test_y = quality.beton_tensors(test_beton, device)
        train_x, train_y = quality.beton_tensors(train_beton, device)
        held = judge.info["held_out"]
        result["judge"] = {"test_accuracy": quality.accuracy(judge, test_x, test_y), "test_images": len(test_y),
                           "seconds": time.perf_counter() - t0, "path": str(judge_path),
                           **{k: v for k, v in judge.info.items() if k != "held_out"}, "held_out": len(held),
                           **judge.config}
        # As many images the judge trained on, to show how far they would have biased the floor.
        labels_np = train_y.cpu().numpy()
        seen = np.setdiff1d(np.arange(len(labels_np)), held)
        seen = torch.from_numpy(seen[quality.class_balanced_subset(labels_np[seen], n, args.seed)]).to(device)
        result["floor"] = {**quality.fd_floor(judge, train_x, train_y, test_x, n), "n_train_images": len(train_y),
                           "fd_digits_seen_by_judge": quality.evaluate_samples(judge, train_x[seen], None,
                                                                               test_x)["fd_digits"]}
        images["test set (real)"] = (test_x, test_y)
        save(f"judge: test accuracy {result['judge']['test_accuracy']:.2%}; floor FD-digits "
             f"{result['floor']['fd_digits']:.3f}")

        # ---- training ------------------------------------------------------------------------------------------
        t0 = time.perf_counter()
        run_dir = train_run(cfg, stop)
        stop.kept["run"] = f"the trained run {run_dir}"
        stats = read_stats(run_dir)
        with torch.device("meta"):
            params = count_params(build_model(cfg.model))
        result["training"] = {"run_dir": str(run_dir), "preset": args.preset, "params": params, "steps": args.steps,
                              "batch": cfg.data.batch_size, "seconds": time.perf_counter() - t0, "stats": stats}
        save(f"trained {args.steps} steps in {result['training']['seconds']:.0f} s")

        # ---- sampling rows -------------------------------------------------------------------------------------
        stop.doing("sampling")
        models = {"EMA": load_run(run_dir, device, ema=True), "raw": load_run(run_dir, device, ema=False)}
        amp_dtype = AMP_DTYPES[cfg.train.precision] if device.type == "cuda" else None
        labels = class_labels(n, cfg.model.num_classes, device)
        per_forward_s = None  # seconds per image per network evaluation, measured on the rows so far
        ddpm_weights = set()  # guidance weights of the DDPM rows so far (run or skipped)
        for row in rows_in_priority_order(args):
            stop.check()  # a signal stops the study between two rows
            _, model, diffusion, _ = models[row["weights"]]
            if row["sampler"] == "ddpm":
                if row["guidance"] == BEST:
                    row["guidance"] = best_guidance(result["rows"], args.ddim_steps[0], ddpm_weights)
                if row["guidance"] is None or row["guidance"] in ddpm_weights:
                    continue  # no best w measured, or this w has its DDPM row already
                ddpm_weights.add(row["guidance"])
            steps = diffusion.num_timesteps if row["sampler"] == "ddpm" else row["steps"]
            guided = row["guidance"] not in (None, 0.0)
            forwards = n * steps * (2 if guided else 1)
            row.update(steps=steps, n=n)
            elapsed = time.perf_counter() - t_start
            if per_forward_s is not None and elapsed + per_forward_s * forwards > args.budget_s:
                row.update(status=f"skipped: estimated {per_forward_s * forwards:.0f} s would end past the "
                                  f"{args.budget_s:.0f} s budget")
                result["rows"].append(row)
                continue
            uncond = row["guidance"] is None
            y = torch.full_like(labels, cfg.model.num_classes) if uncond else labels  # the null label
            t0 = time.perf_counter()
            samples = generate(model, diffusion, n, labels=y, sampler=row["sampler"], steps=steps,
                               guidance=row["guidance"] or 0.0, batch=args.sample_batch, seed=args.seed,
                               amp_dtype=amp_dtype, memory_format=torch.channels_last)
            scores = quality.evaluate_samples(judge, samples, None if uncond else labels, test_x)
            seconds = time.perf_counter() - t0
            per_forward_s = seconds / forwards
            predicted = judge.predict(samples)
            hist = torch.bincount(predicted, minlength=cfg.model.num_classes)
            row.update(status="ok", fd_digits=scores["fd_digits"], cond_acc=scores["cond_acc"], seconds=seconds,
                       predicted_class_counts=hist.tolist())
            result["rows"].append(row)
            main_row = row["weights"] == "EMA" and row["sampler"] == "ddim" and row["steps"] == args.ddim_steps[0]
            if main_row:
                # Unconditional samples asked for no class: their grid rows are the class the judge sees.
                images["unconditional (judge's class)" if uncond else f"w = {row['guidance']:g}"] = \
                    (samples, predicted if uncond else labels)
            acc = "-" if uncond else f"{scores['cond_acc']:.1%}"
            save(f"{row['weights']} {row['sampler']} {steps} w={row['guidance']}: FD-digits "
                 f"{scores['fd_digits']:.3f}, cond acc {acc} ({seconds:.1f} s)", draw=main_row)
        stop.done()  # measured: the last save completes
        result["complete"] = True
        save("done")
    return result


def main(argv: list[str] | None = None) -> int:
    from benchmarks.quality.study import run_study

    t_start = time.perf_counter()
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)

    def body(stop) -> None:
        best = run(args, argv, t_start, stop).get("best")
        if best:
            print(f"digits: best conditional accuracy {best['cond_acc']:.1%} ({best['label']})")

    return run_study("digits", body)


if __name__ == "__main__":
    sys.exit(main())
