"""Sample quality vs steps for the score-SDE samplers: a VE-SDE model and a DDPM model trained on the digits.

    python -m benchmarks.sde_quality --data data/digits --out benchmarks/results/h100/sde-quality
    python -m benchmarks.sde_quality --data data/digits --out /tmp/sq --steps 200 data.batch_size=64 train.device=cpu

Budget: the whole command, both trainings included, is planned for about 7 minutes on one H100/H200: the digits
judge (ffcv_ddpm.quality, ~20 s unless --judge names a saved one), two class-conditional models of the small
configuration MODEL below (1.6M parameters, 0.84 GFLOP forward per image) trained 4,000 steps at batch 128 in bf16
(eager: compiling two models would cost more than it saves at this size), then the sampler rows
(each sampler's cheapest setting first, see plan_rows) until --budget-s (default 400 s from the start) would be
passed; a row that would not finish in time is listed as not run. After every row the JSON, Markdown and the
quality-vs-NFE plot are rewritten, so a run cut short keeps what it measured.

Rows (each: --n samples with labels 0..9 in turn, one seed, sampling in true fp32 so the adaptive ODE solver's
error control sees the solution and not bf16 rounding):
- DDPM model: ddim at --ddim-steps, ancestral ddpm (all T steps), and em / pc / ode on its VP-SDE;
- VE model: em at --em-steps, pc at --pc-steps, ode at --ode-tols.
Per row: NFE per image, images/s (CUDA events around the sampler call), FD-digits to the test set and conditional
accuracy from the judge. The reference rows: the judge's test accuracy and the FD floor (--n train images vs test).

Writes sde_quality.json, .md, .png and samples-<process>.png (a grid of the best row by FD) into --out.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.sde_quality_report import render
from ffcv_ddpm.checkpoint import list_checkpoints
from ffcv_ddpm.checks import Parser
from ffcv_ddpm.config import RunConfig, load_config
from ffcv_ddpm.data import dataset_info, read_beton
from ffcv_ddpm.diffusion import save_grid
from ffcv_ddpm.env import environment
from ffcv_ddpm.sde import load_for_sampling
from ffcv_ddpm.sde_sampling import SamplerOptions, sample
from ffcv_ddpm.timing import timed_call
from ffcv_ddpm.step import AMP_DTYPES, TrainingError, resolve_device, set_precision
from ffcv_ddpm.train import train

# The small conditional model both processes train (on top of the ddpm-cifar10 preset); overrides after it win.
MODEL = ("model.base_channels=32", "model.channel_mult=(1, 2, 2)", "model.num_res_blocks=2", "model.norm_groups=8",
         "model.dropout=0.0", "model.num_classes=10")
TRAIN = ("data.batch_size=128", "data.loader=gpu", "data.flip=none",  # a mirrored digit is not a digit
         "train.lr=5e-4", "train.warmup_steps=200", "train.ema_decay=0.999", "train.compile=False",
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
    while every sampler of both processes keeps at least one row."""
    groups = []
    for proc in ("ddpm", "ve"):
        groups.append([dict(process=proc, sampler="em", steps=s, tol=None, guess=s) for s in args.em_steps])
        groups.append([dict(process=proc, sampler="pc", steps=s, tol=None, guess=2 * s) for s in args.pc_steps])
        groups.append([dict(process=proc, sampler="ode", steps=0, tol=t, guess=ODE_NFE_GUESS.get(t, 100))
                       for t in args.ode_tols])
    groups.append([dict(process="ddpm", sampler="ddim", steps=s, tol=None, guess=s) for s in args.ddim_steps])
    if args.ancestral:
        groups.append([dict(process="ddpm", sampler="ddpm", steps=timesteps, tol=None, guess=timesteps)])
    ranked = [(rank, row) for group in groups for rank, row in enumerate(sorted(group, key=lambda r: r["guess"]))]
    return [row for _, row in sorted(ranked, key=lambda rr: (rr[0], rr[1]["guess"]))]


def base_config(args) -> RunConfig:
    return load_config(args.preset, [*MODEL, *TRAIN, f"train.steps={args.steps}", f"train.ckpt_every={args.steps}",
                                     *args.overrides])


def train_model(base: RunConfig, process: str, runs: Path) -> tuple[Path, dict]:
    cfg = RunConfig.from_dict(base.to_dict())  # a copy per model
    cfg.diffusion.process, cfg.train.out_dir, cfg.train.desc = process, str(runs), f"sde-quality-{process}"
    t0 = time.perf_counter()
    run_dir = train(cfg)
    wall = time.perf_counter() - t0
    stats = [json.loads(line) for line in (run_dir / "stats.jsonl").read_text().splitlines()]
    last = stats[-1]
    summary = (f"{cfg.train.steps} steps at batch {cfg.data.batch_size}, {cfg.train.precision}, "
               f"EMA {cfg.train.ema_decay}; final loss {last['loss']:.4f}; {wall:.0f} s including set-up "
               f"({last['img_per_s']:.0f} img/s in the last interval)")
    return list_checkpoints(run_dir)[-1], {"summary": summary, "config": cfg.to_dict(), "train_wall_s": wall,
                                           "stats": stats}


def run(args, argv: list[str]) -> Path:
    start = time.perf_counter()
    quality = importlib.import_module("ffcv_ddpm.quality")  # issue 14's judge; imported here, where it is needed
    base = base_config(args)  # a bad override stops here, before the data is looked for
    train_beton, test_beton = find_betons(args.data)
    base.data.path = str(train_beton)
    device = resolve_device(base.train.device)
    train_x, train_y = read_beton(train_beton)
    test_x, test_y = read_beton(test_beton)
    train_u8, test_u8 = as_tensor(train_x, device), as_tensor(test_x, device)
    test_labels = torch.from_numpy(test_y).to(device)

    if args.judge:
        judge, judge_desc = quality.load_judge(args.judge, device), f"loaded from {args.judge}"
    else:
        kwargs = {"steps": args.judge_steps} if args.judge_steps else {}
        judge = quality.train_judge(train_beton, device, seed=0, **kwargs)
        judge_desc = "trained by this run" + (f" ({args.judge_steps} steps)" if args.judge_steps else "")
    floor_n = min(args.n, len(train_u8))
    floor = quality.evaluate_samples(judge, train_u8[:floor_n], torch.from_numpy(train_y[:floor_n]).to(device),
                                     test_u8)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    out = args.out / "sde_quality.json"
    args.out.mkdir(parents=True, exist_ok=True)
    result = {
        "command": "python -m benchmarks.sde_quality " + " ".join(argv), "device": name,
        "environment": environment(), "dataset": {k: v for k, v in dataset_info(train_beton).items() if k != "manifest"},
        "settings": {"n": args.n, "guidance": args.guidance, "sample_precision": args.sample_precision,
                     "snr": args.snr, "ode_method": args.ode_method, "budget_s": args.budget_s, "steps": args.steps},
        "reference": {"judge": judge_desc, "test_images": len(test_u8), "floor_n": floor_n,
                      "fd_floor": floor["fd_digits"],
                      "judge_test_acc": quality.evaluate_samples(judge, test_u8, test_labels, train_u8)["cond_acc"]},
        "models": {}, "rows": [], "skipped": [], "complete": False,
    }

    with tempfile.TemporaryDirectory() as tmp:  # checkpoints are read back once, not kept (--runs keeps them)
        runs = args.runs or Path(tmp)
        ckpts = {}
        for proc in ("ve", "ddpm"):
            ckpts[proc], result["models"][proc] = train_model(base, proc, runs)
            render(result, out)
        models = {proc: load_for_sampling(ckpts[proc], device, process=proc)[:2] for proc in ckpts}

    set_precision("fp32" if args.sample_precision == "fp32" else "tf32", device)
    amp = AMP_DTYPES[args.sample_precision]
    labels = torch.arange(args.n, device=device) % 10
    options = SamplerOptions(snr=args.snr, method=args.ode_method)
    sec_per_nfe: dict[str, float] = {}
    best: dict[str, float] = {}

    def draw(proc: str, row: dict) -> tuple[torch.Tensor, int, float]:
        process, model = models[proc]
        opts = dataclasses.replace(options, rtol=row["tol"], atol=row["tol"]) if row["tol"] else options
        def run():
            with torch.autocast(device.type, dtype=amp or torch.float32, enabled=amp is not None):
                return sample(process, model, args.n, sampler=row["sampler"], steps=row["steps"], options=opts,
                              seed=args.seed, y=labels, guidance_scale=args.guidance, device=device,
                              shape=(3, 32, 32))

        (images, nfe), ms = timed_call(run, device)
        return images, nfe, ms / 1e3

    for proc in models:  # cuDNN and allocator warm-up at the rows' batch size, untimed
        draw(proc, dict(sampler="em", steps=2, tol=None))
    for row in plan_rows(args, base.diffusion.timesteps):
        label = f"{row['process']}/{row['sampler']}/" + (f"tol {row['tol']:g}" if row["tol"] else f"{row['steps']}")
        estimate = row["guess"] * sec_per_nfe.get(row["process"], 0.0)
        if time.perf_counter() - start + estimate > args.budget_s:
            result["skipped"].append(label)
            continue
        images, nfe, seconds = draw(row["process"], row)
        sec_per_nfe[row["process"]] = seconds / nfe
        metrics = quality.evaluate_samples(judge, images, labels, test_u8)
        result["rows"].append({**{k: row[k] for k in ("process", "sampler", "steps", "tol")}, "nfe": nfe,
                               "seconds": seconds, "img_per_s": args.n / seconds,
                               "fd_digits": float(metrics["fd_digits"]), "cond_acc": metrics["cond_acc"]})
        if metrics["fd_digits"] < best.get(row["process"], float("inf")):
            best[row["process"]] = metrics["fd_digits"]
            save_grid(images[:100], args.out / f"samples-{row['process']}.png", nrow=10)
        render(result, out)
        print(f"sde_quality: {label}: NFE {nfe}, {args.n / seconds:.0f} img/s, FD-digits {metrics['fd_digits']:.2f}, "
              f"cond acc {metrics['cond_acc']}", flush=True)
    result["complete"] = True
    result["total_s"] = time.perf_counter() - start
    render(result, out)
    return out


def floats(text: str) -> list[float]:
    return [float(v) for v in text.split(",") if v]


def ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v]


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = Parser(prog="python -m benchmarks.sde_quality", doc=__doc__, overrides=True,
               epilog="The overrides go to both models' trainers, after MODEL and TRAIN (sde_quality.py).")
    p.add_argument("--data", type=Path, required=True, help="folder with *_train_raw.beton and *_test_raw.beton")
    p.add_argument("--out", type=Path, required=True, help="folder for the JSON, Markdown and PNGs")
    p.add_argument("--steps", type=int, default=4000, help="training steps per model (train.steps)")
    p.add_argument("--n", type=int, default=1000, help="samples per row")
    p.add_argument("--ddim-steps", type=ints, default=[10, 20, 50, 100])
    p.add_argument("--em-steps", type=ints, default=[20, 50, 100, 250])
    p.add_argument("--pc-steps", type=ints, default=[10, 25, 50, 100])
    p.add_argument("--ode-tols", type=floats, default=[1e-2, 1e-3, 1e-4, 1e-5], help="rtol = atol per ODE row")
    p.add_argument("--no-ancestral", dest="ancestral", action="store_false", help="skip the 1000-step DDPM row")
    p.add_argument("--snr", type=float, default=SamplerOptions.snr, help="pc: Langevin signal-to-noise ratio")
    p.add_argument("--ode-method", default=SamplerOptions.method, help="torchdiffeq adaptive method")
    p.add_argument("--guidance", type=float, default=1.0, help="classifier-free guidance weight (1 = none)")
    p.add_argument("--sample-precision", choices=("fp32", "tf32", "bf16"), default="fp32")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (the same noise for every row of a model)")
    p.add_argument("--judge", type=Path, help="a judge saved by ffcv_ddpm.quality.save_judge (default: train one)")
    p.add_argument("--judge-steps", type=int, help="training steps of the judge (default: train_judge's)")
    p.add_argument("--budget-s", type=float, default=400.0, help="rows that would end later than this are not run")
    p.add_argument("--preset", default="ddpm-cifar10", help="preset the MODEL overrides start from")
    p.add_argument("--runs", type=Path, help="keep the two training runs here (default: a temporary folder)")
    args, args.overrides = p.parse_with_overrides(argv)
    if args.n < 10:
        p.error(f"--n {args.n}: need at least 10 samples (one per class)")
    return args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    try:
        out = run(args, argv)
    except (TrainingError, ValueError, FileNotFoundError) as e:
        print(f"sde_quality: error: {e}", file=sys.stderr)
        return 2
    print(f"sde_quality: wrote {out}, {out.with_suffix('.md').name}, {out.with_suffix('.png').name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
