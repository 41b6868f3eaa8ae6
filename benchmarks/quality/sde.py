"""Sample quality vs steps for the score-SDE samplers: a VE-SDE model and a DDPM model trained on the digits.

    python -m benchmarks.quality.sde --data data/digits --out benchmarks/results/h100/sde-quality
    python -m benchmarks.quality.sde --data data/digits --out /tmp/sq --steps 200 data.batch_size=64 train.device=cpu

In this order (the JSON, Markdown and quality-vs-NFE plot are rewritten after every phase and row, so a run cut short
keeps what it measured):
1. the digits judge (ffcv_ddpm.quality; or --judge), trained on the train split less --n class-balanced images it
   holds out; the floor: FD-digits of those held-out images to the test set;
2. two class-conditional models of the small configuration MODEL below (1.6M parameters, 0.84 GFLOP forward per
   image), VE and DDPM, each trained by the trainer (ffcv_ddpm.train) for --steps steps of 512 images: bf16,
   torch.compile on a GPU, the dataset resident on the device;
3. the sampler rows, in rounds (plan_rows: each sampler's cheapest setting, then every sampler's second, ...) until
   --budget-s seconds of sampling would be passed: the training's time is not taken out of it. A row that would not
   finish in time is listed as not run; a row that fails (e.g. the adaptive ODE solver's step size underflowing at a
   tight tolerance) is recorded with its error and the study goes on.

Rows (each: --n samples with labels 0..9 in turn, guidance weight --guidance, one seed, sampling in true fp32 so the
adaptive ODE solver's error control sees the solution and not bf16 rounding):
- DDPM model: ddim (deterministic, eta 0) and ddim eta 1 (stochastic, DDPM's posterior variance) at --ddim-steps,
  ancestral ddpm (all T steps: one NFE point by definition), and em / pc / ode on its VP-SDE;
- VE model: em at --em-steps, pc at --pc-steps, ode at --ode-tols.
Per row: NFE per image, images/s (CUDA events around the sampler call), FD-digits to the test set and conditional
accuracy from the judge. The reference rows: the judge's test accuracy and the floor.

Time on one H100, estimated (the eager version of this command was measured there at commit 44a0e9b: two trainings
of 2,000 steps at batch 128, 140 s and 120 s, launch-bound at ~2,200 img/s): start-up and judge ~25 s; the first
compilation ~60 s, the second (same network, warm kernel cache) ~20 s; 3,000 steps of 512 per model at 12-25k img/s
~60-130 s each; the rows ~3,900 network evaluations of 500 images in fp32 (~0.4 TFLOP each, ~15 ms) ~60-90 s.
About 5-7.5 minutes in all; the default --budget-s 120 bounds the sampling part (the ODE rows' NFE is the unknown).

SIGTERM/SIGINT stop the whole command (benchmarks.quality.study): the report keeps what was measured, exit 128 + signal.
Writes sde_quality.json, .md, .png and samples-<process>.png (a grid of the best row by FD) into --out.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.quality.sde_report import TARGET_ACC, best_rows, render
from ffcv_ddpm.checks import Parser, above, at_least, float_list, int_list, one_of, option
from ffcv_ddpm.config import RunConfig, load_config

# The small conditional model both processes train (on top of the ddpm-cifar10 preset); overrides after it win.
MODEL = ("model.base_channels=32", "model.channel_mult=(1, 2, 2)", "model.num_res_blocks=2", "model.norm_groups=8",
         "model.dropout=0.0", "model.num_classes=10")
# Compiled (the trainer compiles on CUDA), GPU-resident data, a batch of 512: the eager batch-128 version was
# launch-bound at ~2,200 img/s on an H100. lr 1e-3 at batch 512 as EDM trains CIFAR-10; EMA 0.995: 0.995^3000 leaves
# 3e-7 of the random initialisation in the averaged weights.
TRAIN = ("data.batch_size=512", "data.loader=gpu", "data.flip=none",  # a mirrored digit is not a digit
         "train.lr=1e-3", "train.warmup_steps=100", "train.ema_decay=0.995", "train.compile=True",
         "train.log_every=100", "train.sample_every=0", "train.progress=False", "train.telemetry=False")
ODE_NFE_GUESS = {1e-1: 20, 1e-2: 40, 1e-3: 70, 1e-4: 130, 1e-5: 250}  # orders the rows; the real NFE is measured


def find_betons(data: Path) -> tuple[Path, Path]:
    found = {split: sorted(data.glob(f"*_{split}_raw.beton")) for split in ("train", "test")}
    if any(len(v) != 1 for v in found.values()):
        raise ValueError(f"{data} needs exactly one *_train_raw.beton and one *_test_raw.beton, found "
                         f"{ {k: [p.name for p in v] for k, v in found.items()} }; build the digits with "
                         "`make dataset SOURCE=digits`")
    return found["train"][0], found["test"][0]


def as_tensor(images, device) -> torch.Tensor:
    return torch.from_numpy(images).permute(0, 3, 1, 2).contiguous().to(device)  # (N, H, W, 3) -> (N, 3, H, W)


def plan_rows(args, timesteps: int) -> list[dict]:
    """Every (process, sampler, setting) row, in rounds: each sampler's cheapest setting first, then the second
    cheapest of each, ...; by expected NFE within a round. A budget cut then drops the most expensive settings
    while every sampler of both processes keeps its first rows."""
    groups = []
    for proc in ("ddpm", "ve"):
        groups.append([dict(process=proc, sampler="em", steps=s, tol=None, guess=s) for s in args.em_steps])
        groups.append([dict(process=proc, sampler="pc", steps=s, tol=None, guess=2 * s) for s in args.pc_steps])
        groups.append([dict(process=proc, sampler="ode", steps=0, tol=t, guess=ODE_NFE_GUESS.get(t, 100))
                       for t in args.ode_tols])
    for eta in (0.0, 1.0):
        groups.append([dict(process="ddpm", sampler="ddim", steps=s, tol=None, eta=eta, guess=s)
                       for s in args.ddim_steps])
    if args.ancestral:
        groups.append([dict(process="ddpm", sampler="ddpm", steps=timesteps, tol=None, guess=timesteps)])
    ranked = [(rank, row) for group in groups for rank, row in enumerate(sorted(group, key=lambda r: r["guess"]))]
    return [row for _, row in sorted(ranked, key=lambda rr: (rr[0], rr[1]["guess"]))]


class OverBudget(Exception):
    """A row's sampler asked for more network evaluations than the sampling budget had left."""


class Capped(torch.nn.Module):
    """The network, refusing evaluations past `limit`: an adaptive ODE solve (whose NFE is not known beforehand)
    cannot run past the sampling budget. The samplers see the wrapped network's parameters and num_classes."""

    def __init__(self, model: torch.nn.Module, limit: int):
        super().__init__()
        self.model, self.limit, self.calls = model, limit, 0
        self.num_classes = getattr(model, "num_classes", 0)

    def forward(self, *args, **kwargs):
        self.calls += 1
        if self.calls > self.limit:
            raise OverBudget(f"stopped after {self.limit} network evaluations: more would pass the sampling budget")
        return self.model(*args, **kwargs)


def row_label(row: dict) -> str:
    setting = f"tol {row['tol']:g}" if row["tol"] else f"{row['steps']}"
    eta = f" eta {row['eta']:g}" if row.get("eta") else ""
    return f"{row['process']}/{row['sampler']}{eta}/{setting}"


def base_config(args) -> RunConfig:
    return load_config(args.preset, [*MODEL, *TRAIN, f"train.steps={args.steps}", f"train.ckpt_every={args.steps}",
                                     *args.overrides])


def train_model(base: RunConfig, process: str, runs: Path, stop) -> tuple[Path, dict]:
    from benchmarks.quality.study import train_run
    from ffcv_ddpm.train import read_stats
    from ffcv_ddpm.checkpoint import list_checkpoints

    cfg = RunConfig.from_dict(base.to_dict())  # a copy per model
    cfg.diffusion.process, cfg.train.out_dir, cfg.train.desc = process, str(runs), f"sde-quality-{process}"
    t0 = time.perf_counter()
    run_dir = train_run(cfg, stop)
    wall = time.perf_counter() - t0
    stats = read_stats(run_dir)
    last = stats[-1]
    compiled = cfg.train.compile and cfg.train.device != "cpu" and torch.cuda.is_available()
    summary = (f"{cfg.train.steps} steps at batch {cfg.data.batch_size}, {cfg.train.precision}, "
               f"{'compiled' if compiled else 'eager'}, lr {cfg.train.lr:g}, EMA {cfg.train.ema_decay}; final loss "
               f"{last['loss']:.4f}; {wall:.0f} s including set-up and compilation "
               f"({last['img_per_s']:,.0f} img/s in the last interval)")
    return list_checkpoints(run_dir)[-1], {"summary": summary, "config": cfg.to_dict(), "train_wall_s": wall,
                                           "stats": stats}


def run(args, argv: list[str], stop) -> Path:
    from benchmarks.quality.study import saved_when_stopped
    from ffcv_ddpm import quality
    from ffcv_ddpm.data import dataset_info, read_beton
    from ffcv_ddpm.diffusion import save_grid
    from ffcv_ddpm.env import environment
    from ffcv_ddpm.sde import load_for_sampling
    from ffcv_ddpm.sde_sampling import SamplerOptions, sample
    from ffcv_ddpm.step import AMP_DTYPES, resolve_device, set_precision
    from ffcv_ddpm.timing import timed_call

    start = time.perf_counter()
    base = args.base
    train_beton, test_beton = find_betons(args.data)
    base.data.path = str(train_beton)
    device = resolve_device(base.train.device)
    train_x, train_y = read_beton(train_beton)
    test_x, test_y = read_beton(test_beton)
    train_u8, test_u8 = as_tensor(train_x, device), as_tensor(test_x, device)
    train_labels, test_labels = torch.from_numpy(train_y).to(device), torch.from_numpy(test_y).to(device)

    stop.doing("training the judge")
    if args.judge:
        judge, judge_desc = quality.load_judge(args.judge, device), f"loaded from {args.judge}"
    else:
        judge = quality.train_judge(train_beton, device, steps=args.judge_steps, seed=0, hold_out=args.n)
        judge_desc = f"trained by this run ({args.judge_steps} steps, {args.n} class-balanced images held out)"
    floor = quality.fd_floor(judge, train_u8, train_labels, test_u8, args.n)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    out = args.out / "sde_quality.json"
    args.out.mkdir(parents=True, exist_ok=True)
    result = {
        "command": "python -m benchmarks.quality.sde " + " ".join(argv), "device": name,
        "environment": environment(), "dataset": {k: v for k, v in dataset_info(train_beton).items() if k != "manifest"},
        "settings": {"n": args.n, "guidance": args.guidance, "sample_precision": args.sample_precision,
                     "snr": args.snr, "ode_method": args.ode_method, "budget_s": args.budget_s, "steps": args.steps},
        "reference": {"judge": judge_desc, "test_images": len(test_u8),
                      "floor_n": floor and floor["n"], "fd_floor": floor and floor["fd_digits"],
                      "judge_test_acc": quality.accuracy(judge, test_u8, test_labels)},
        "models": {}, "rows": [], "skipped": [], "complete": False,
    }

    def save() -> None:
        render(result, out)
        stop.kept["report"] = (f"the report {out} ({sum(r['status'] == 'ok' for r in result['rows'])} rows "
                               "measured)")

    with saved_when_stopped(stop, result, save), tempfile.TemporaryDirectory() as tmp:
        save()
        # Checkpoints are read back once, not kept (--runs keeps them).
        runs = args.runs or Path(tmp)
        ckpts = {}
        for proc in ("ve", "ddpm"):
            ckpts[proc], result["models"][proc] = train_model(base, proc, runs, stop)
            save()
        # Sampled in the layout they trained in (train.channels_last): cuDNN's NHWC kernels, and on a CPU ~3x faster.
        layout = torch.channels_last if base.train.channels_last else torch.contiguous_format
        models = {}
        for proc in ckpts:
            process, model, _ = load_for_sampling(ckpts[proc], device, process=proc)
            models[proc] = process, model.to(memory_format=layout)

        stop.doing("sampling")
        set_precision("fp32" if args.sample_precision == "fp32" else "tf32", device)
        torch.backends.cudnn.benchmark = True  # one batch shape for every row: cuDNN's fastest kernels, chosen once
        amp = AMP_DTYPES[args.sample_precision]
        labels = torch.arange(args.n, device=device) % 10
        options = SamplerOptions(snr=args.snr, method=args.ode_method)
        sec_per_nfe: dict[str, float] = {}
        best: dict[str, float] = {}

        def draw(proc: str, row: dict, limit: int | None = None) -> tuple[torch.Tensor, int, float]:
            process, model = models[proc]
            opts = dataclasses.replace(options, rtol=row["tol"], atol=row["tol"]) if row["tol"] else options
            net = model if limit is None else Capped(model, limit)

            def call():
                with torch.autocast(device.type, dtype=amp or torch.float32, enabled=amp is not None):
                    return sample(process, net, args.n, sampler=row["sampler"], steps=row["steps"], options=opts,
                                  eta=row.get("eta", 0.0), seed=args.seed, y=labels,
                                  guidance_scale=1.0 + args.guidance, device=device, shape=(3, 32, 32),
                                  memory_format=layout)

            (images, nfe), ms = timed_call(call, device)
            return images, nfe, ms / 1e3

        for proc in models:  # cuDNN's algorithm choice and the allocator at the rows' batch size, untimed
            draw(proc, dict(sampler="em", steps=2, tol=None))
        sampling_start = time.perf_counter()  # the budget is the sampling's: the trainings' time is not in it
        for row in plan_rows(args, base.diffusion.timesteps):
            stop.check()  # a signal stops the study between two rows
            label = row_label(row)
            estimate = row["guess"] * sec_per_nfe.get(row["process"], 0.0)
            if time.perf_counter() - sampling_start + estimate > args.budget_s:
                result["skipped"].append(label)
                continue
            entry = {**{k: row[k] for k in ("process", "sampler", "steps", "tol")}, "eta": row.get("eta")}
            per_nfe = sec_per_nfe.get(row["process"])
            left = args.budget_s - (time.perf_counter() - sampling_start)
            t0 = time.perf_counter()
            try:
                images, nfe, seconds = draw(row["process"], row, None if per_nfe is None else
                                            max(row["guess"], int(left / per_nfe)))
            except (OverBudget, AssertionError, RuntimeError, ValueError) as e:  # torchdiffeq's "underflow in dt"
                # is an AssertionError
                text = str(e).strip().splitlines()[0] if str(e).strip() else ""
                result["rows"].append({**entry, "status": f"failed: {type(e).__name__}: {text}",
                                       "seconds": time.perf_counter() - t0})
                save()
                print(f"sde: {label}: FAILED ({type(e).__name__}: {text})", flush=True)
                continue
            sec_per_nfe[row["process"]] = seconds / nfe
            metrics = quality.evaluate_samples(judge, images, labels, test_u8)
            result["rows"].append({**entry, "status": "ok", "nfe": nfe, "seconds": seconds,
                                   "img_per_s": args.n / seconds, "fd_digits": float(metrics["fd_digits"]),
                                   "cond_acc": metrics["cond_acc"]})
            if metrics["fd_digits"] < best.get(row["process"], float("inf")):
                best[row["process"]] = metrics["fd_digits"]
                save_grid(images[:100], args.out / f"samples-{row['process']}.png", nrow=10)
            save()
            print(f"sde: {label}: NFE {nfe}, {args.n / seconds:.0f} img/s, FD-digits "
                  f"{metrics['fd_digits']:.2f}, cond acc {metrics['cond_acc']:.1%}", flush=True)
        stop.done()  # measured: the last save completes
        result["complete"] = True
        result["sampling_s"] = time.perf_counter() - sampling_start
        result["total_s"] = time.perf_counter() - start
        save()
    for proc, row in best_rows(result["rows"]).items():
        verdict = "meets" if row["cond_acc"] >= TARGET_ACC else "does NOT meet"
        print(f"sde: {proc}: best conditional accuracy {row['cond_acc']:.1%} ({row_label(row)}): {verdict} "
              f"the {TARGET_ACC:.0%} target")
    return out


def parse_args(argv: list[str]) -> argparse.Namespace:
    """The options, each checked here (and the training config built), before anything is read or written."""
    from ffcv_ddpm.sde_sampling import ADAPTIVE_METHODS, SamplerOptions
    from ffcv_ddpm.unet import PRESETS

    count = option(int, at_least(1))
    p = Parser(prog="python -m benchmarks.quality.sde", doc=__doc__, overrides=True,
               epilog="The overrides go to both models' trainers, after MODEL and TRAIN (benchmarks/quality/sde.py).")
    p.add_argument("--data", type=Path, required=True, help="folder with *_train_raw.beton and *_test_raw.beton")
    p.add_argument("--out", type=Path, required=True, help="folder for the JSON, Markdown and PNGs")
    p.add_argument("--steps", type=count, default=3000, help="training steps per model (train.steps)")
    p.add_argument("--n", type=option(int, at_least(10)), default=500,
                   help="samples per row (and the judge's held-out images for the floor)")
    p.add_argument("--ddim-steps", type=int_list(at_least(1)), default=[10, 20, 50, 100],
                   help="(default: 10,20,50,100)")
    p.add_argument("--em-steps", type=int_list(at_least(2)), default=[20, 50, 100, 250], help="(default: 20,50,100,250)")
    p.add_argument("--pc-steps", type=int_list(at_least(2)), default=[10, 25, 50, 100], help="(default: 10,25,50,100)")
    p.add_argument("--ode-tols", type=float_list(above(0)), default=[1e-2, 1e-3, 1e-4, 1e-5],
                   help="rtol = atol per ODE row (default: 1e-2,1e-3,1e-4,1e-5)")
    p.add_argument("--no-ancestral", dest="ancestral", action="store_false", help="skip the T-step DDPM row")
    p.add_argument("--snr", type=option(float, above(0)), default=SamplerOptions.snr,
                   help="pc: Langevin signal-to-noise ratio")
    p.add_argument("--ode-method", type=option(str, one_of(ADAPTIVE_METHODS)), default=SamplerOptions.method,
                   help="torchdiffeq adaptive method")
    p.add_argument("--guidance", type=option(float, at_least(0)), default=0.0,
                   help="classifier-free guidance weight w (0: no guidance)")
    p.add_argument("--sample-precision", choices=("fp32", "tf32", "bf16"), default="fp32")
    p.add_argument("--seed", type=option(int, at_least(0)), default=0,
                   help="sampling seed (the same noise for every row of a model)")
    p.add_argument("--judge", type=Path, help="a judge saved by ffcv_ddpm.quality.save_judge (default: train one)")
    p.add_argument("--judge-steps", type=count, default=2000, help="training steps of the judge")
    p.add_argument("--budget-s", type=option(float, at_least(0)), default=120.0,
                   help="seconds of sampling: rows that would end later are not run (the trainings are not counted)")
    p.add_argument("--preset", default="ddpm-cifar10", type=option(str, one_of(lambda: tuple(PRESETS))),
                   help="preset the MODEL overrides start from")
    p.add_argument("--runs", type=Path, help="keep the two training runs here (default: a temporary folder)")
    args, args.overrides = p.parse_with_overrides(argv)
    if args.judge is not None and not args.judge.is_file():
        p.error(f"--judge {args.judge}: no such file (save one with ffcv_ddpm.quality.save_judge, or leave it out)")
    try:
        args.base = base_config(args)
    except ValueError as e:
        p.error(str(e))
    if args.base.model.num_classes < 2:
        p.error("model.num_classes must be >= 2: the rows are scored by conditional accuracy")
    if max(args.ddim_steps) > args.base.diffusion.timesteps:
        p.error(f"--ddim-steps {max(args.ddim_steps)}: at most diffusion.timesteps={args.base.diffusion.timesteps}")
    return args


def main(argv: list[str] | None = None) -> int:
    from benchmarks.quality.study import run_study

    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)

    def body(stop) -> None:
        out = run(args, argv, stop)
        print(f"sde: wrote {out}, {out.with_suffix('.md').name}, {out.with_suffix('.png').name}")

    return run_study("sde", body)


if __name__ == "__main__":
    sys.exit(main())
