"""Quality per network evaluation: every sampler of ffcv_ddpm.sde_sampling on four small digits models, clipped and not.

    python -m benchmarks.quality.sde --data data/digits --out OUT1 --part 1                     # eps models, <9 min
    python -m benchmarks.quality.sde --data data/digits --out OUT2 --part 2 --continue-from OUT1/sde_quality.json
    python -m benchmarks.quality.sde --data data/digits --out /tmp/sq --steps 200 data.batch_size=64 train.device=cpu

The question (issue 48): at how few network evaluations (NFE) does each sampler reach the digits' quality targets, on
which model, and does the answer depend on the process (VE or DDPM) or on the sampler and the network's
parametrisation? Models (MODELS), all the small conditional UNet MODEL below (1.6M parameters) trained by the trainer
(ffcv_ddpm.train) for --steps steps of 512 images, bf16, torch.compile on a GPU, the dataset resident on the device:
- part 1: "ve" (diffusion.process=ve) and "ddpm", both ε-networks (diffusion.param=eps);
- part 2: "ve-edm" and "ddpm-edm", the same processes with EDM's preconditioning (diffusion.param=edm).
--part all trains the four in one call (~15 minutes on an H100); the two parts fit one GPU call each, the second
continuing the first's report (--continue-from: its rows, models and reference kept, and its judge, judge.pt beside
it, loaded, so both parts are scored by one judge against one floor).

In this order (the JSON and Markdown are rewritten after every phase and row, the plot after every phase, so a run
cut short keeps what it measured; `python -m benchmarks.quality.sde_report` redraws the plot from its JSON):
1. the digits judge (ffcv_ddpm.quality; or --judge, or the continued report's), trained on the train split less --n
   class-balanced images it holds out; the floor: FD-digits of those held-out images to the test set; saved as
   judge.pt into --out;
2. the part's two models, trained;
3. the sampler rows (plan_rows), in rounds: each (model, sampler, clip) group's cheapest setting, then every group's
   second, ...; ancestral DDPM (1,000 NFE) after every round. A row whose time, estimated from the rows before it,
   would pass --budget-s seconds of sampling is listed as not run (the trainings are not counted); a row that fails
   (the adaptive ODE solver's step size underflowing) is recorded with its error and the study goes on.

Samplers (every model; each once per --clips mode, default static and off: the x0 prediction clamped to [-1, 1] at
every step, and not): heun (EDM's Algorithm 1, NFE 2N - 1) at --heun-steps, heun with --churn (Algorithm 2) at the
same N from 5 (fewer levels have none in its noise window), dpm2m (DPM-Solver++(2M), NFE N) at --dpm-steps, em at
--em-steps, pc (NFE 2N) at --pc-steps, ode (probability flow, adaptive) at --ode-tols; and on the DDPM models ddim
(eta 0) and ddim eta 1 at --ddim-steps and ancestral ddpm (all T steps). Each row: --n samples with labels 0..9 in
turn, guidance weight --guidance, one seed (the same prior noise for every row of a model); in --sample-precision
(TF32 by default), but the adaptive ODE rows in true fp32, so that its error control sees the solution and not TF32's
rounding (both recorded per row). Per row: NFE per image, images/s (CUDA events around the sampler call), FD-digits
to the test set, conditional accuracy.

Targets (sde_report.TARGETS), checked per model and printed with the cheapest row that meets each: >= 97%
conditional accuracy at <= 10 NFE; a deterministic sampler (heun without churn, dpm2m, ddim eta 0, ode) >= 95% at
<= 20 NFE; FD-digits within 2x the floor at <= 50 NFE.

Time of one part on one H100, estimated from the last run of this study at 1caf6a3 (two models of the same size and
training, benchmarks/results/h100/sde-quality: 510 s in all, 113 s of it sampling): start-up and judge 24 s (a
loaded judge less), the two trainings 190 s and 183 s with compilation, then --budget-s 100 s of sampling (the rows
cost ~29 ms an NFE of 500 images in fp32 there; TF32 is expected faster): ~505 s, under 9 minutes. The default grids
hold 4,592 NFE of fixed-step rows per part (both clips), plus 8 adaptive ODE rows in fp32 and 2,000 of ancestral
DDPM: the budget cuts the most expensive settings first, and the report lists them as not run.

SIGTERM/SIGINT stop the whole command (benchmarks.quality.study): the report keeps what was measured, exit 128 + signal.
Writes sde_quality.json, .md, .png (quality against NFE per model), judge.pt and samples-<model>.png (a grid of the
model's best row by FD) into --out.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.quality.sde_report import deterministic, render, target_lines
from ffcv_ddpm.checks import Parser, above, at_least, float_list, int_list, one_of, option, str_list
from ffcv_ddpm.config import RunConfig, load_config

# The small conditional model every model trains (on top of the ddpm-cifar10 preset); overrides after it win.
MODEL = ("model.base_channels=32", "model.channel_mult=(1, 2, 2)", "model.num_res_blocks=2", "model.norm_groups=8",
         "model.dropout=0.0", "model.num_classes=10")
# Compiled (the trainer compiles on CUDA), GPU-resident data, a batch of 512: the eager batch-128 version was
# launch-bound at ~2,200 img/s on an H100. lr 1e-3 at batch 512 as EDM trains CIFAR-10; EMA 0.995: 0.995^3000 leaves
# 3e-7 of the random initialisation in the averaged weights.
TRAIN = ("data.batch_size=512", "data.loader=gpu", "data.flip=none",  # a mirrored digit is not a digit
         "train.lr=1e-3", "train.warmup_steps=100", "train.ema_decay=0.995", "train.compile=True",
         "train.log_every=100", "train.sample_every=0", "train.progress=False", "train.telemetry=False")
MODELS = {  # name: (diffusion.process, diffusion.param)
    "ve": ("ve", "eps"), "ddpm": ("ddpm", "eps"), "ve-edm": ("ve", "edm"), "ddpm-edm": ("ddpm", "edm")}
PARTS = {"1": ("ve", "ddpm"), "2": ("ve-edm", "ddpm-edm"), "all": tuple(MODELS)}
ODE_NFE_GUESS = {1e-1: 20, 1e-2: 40, 1e-3: 70, 1e-4: 130, 1e-5: 250}  # orders the rows; the real NFE is measured
# What the rows of a continued report must share with this call to be compared with its rows.
SHARED_SETTINGS = ("n", "guidance", "seed", "steps", "clips", "snr", "churn", "ode_method", "sample_precision")


def find_betons(data: Path) -> tuple[Path, Path]:
    found = {split: sorted(data.glob(f"*_{split}_raw.beton")) for split in ("train", "test")}
    if any(len(v) != 1 for v in found.values()):
        raise ValueError(f"{data} needs exactly one *_train_raw.beton and one *_test_raw.beton, found "
                         f"{ {k: [p.name for p in v] for k, v in found.items()} }; build the digits with "
                         "`make dataset SOURCE=digits`")
    return found["train"][0], found["test"][0]


def as_tensor(images, device) -> torch.Tensor:
    return torch.from_numpy(images).permute(0, 3, 1, 2).contiguous().to(device)  # (N, H, W, 3) -> (N, 3, H, W)


def plan_rows(args, models: tuple[str, ...], timesteps: int) -> list[dict]:
    """Every (model, sampler, setting, clip) row, in rounds: each group's cheapest setting first, then the second
    cheapest of each, ...; by expected NFE within a round; ancestral DDPM (T NFE, one point) after every round. A
    budget cut then drops the most expensive settings while every sampler of every model keeps its first rows."""
    groups = []
    for clip in args.clips:
        for model in models:
            row = lambda **kw: {"model": model, "tol": None, "eta": None, "churn": 0.0,  # noqa: E731
                                "clip": clip, **kw}
            groups.append([row(sampler="heun", steps=s, guess=2 * s - 1) for s in args.heun_steps])
            if args.churn > 0:  # below 5 levels none of either process's lies in [S_tmin, S_tmax] = [0.05, 1]:
                # such a row would be heun's again
                groups.append([row(sampler="heun", steps=s, churn=args.churn, guess=2 * s - 1)
                               for s in args.heun_steps if s >= 5])
            groups.append([row(sampler="dpm2m", steps=s, guess=s) for s in args.dpm_steps])
            groups.append([row(sampler="em", steps=s, guess=s) for s in args.em_steps])
            groups.append([row(sampler="pc", steps=s, guess=2 * s) for s in args.pc_steps])
            groups.append([row(sampler="ode", steps=0, tol=t, guess=ODE_NFE_GUESS.get(t, 100)) for t in args.ode_tols])
            if MODELS[model][0] == "ddpm":
                for eta in (0.0, 1.0):
                    groups.append([row(sampler="ddim", steps=s, eta=eta, guess=s) for s in args.ddim_steps])
    ranked = [(rank, row) for group in groups for rank, row in enumerate(sorted(group, key=lambda r: r["guess"]))]
    rows = [row for _, row in sorted(ranked, key=lambda rr: (rr[0], rr[1]["guess"]))]
    if args.ancestral:
        rows += [{"model": m, "sampler": "ddpm", "steps": timesteps, "tol": None, "eta": None, "churn": 0.0,
                  "clip": clip, "guess": timesteps} for clip in args.clips for m in models if MODELS[m][0] == "ddpm"]
    for row in rows:
        row["precision"] = "fp32" if row["sampler"] == "ode" else args.sample_precision
    return rows


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
    variant = f" eta {row['eta']:g}" if row.get("eta") else f" churn {row['churn']:g}" if row.get("churn") else ""
    return f"{row['model']}/{row['sampler']}{variant}/{setting}/clip {row['clip']}"


def base_config(args) -> RunConfig:
    return load_config(args.preset, [*MODEL, *TRAIN, f"train.steps={args.steps}", f"train.ckpt_every={args.steps}",
                                     *args.overrides])


def train_model(base: RunConfig, name: str, runs: Path, stop) -> tuple[Path, dict]:
    from benchmarks.quality.study import train_run
    from ffcv_ddpm.checkpoint import list_checkpoints
    from ffcv_ddpm.train import read_stats

    cfg = RunConfig.from_dict(base.to_dict())  # a copy per model
    cfg.diffusion.process, cfg.diffusion.param = MODELS[name]
    cfg.train.out_dir, cfg.train.desc = str(runs), f"sde-quality-{name}"
    t0 = time.perf_counter()
    run_dir = train_run(cfg, stop)
    wall = time.perf_counter() - t0
    stats = read_stats(run_dir)
    last = stats[-1]
    compiled = cfg.train.compile and cfg.train.device != "cpu" and torch.cuda.is_available()
    summary = (f"diffusion.process={cfg.diffusion.process}, param={cfg.diffusion.param}; {cfg.train.steps} steps at "
               f"batch {cfg.data.batch_size}, {cfg.train.precision}, {'compiled' if compiled else 'eager'}, lr "
               f"{cfg.train.lr:g}, EMA {cfg.train.ema_decay}; final loss {last['loss']:.4f}; {wall:.0f} s including "
               f"set-up and compilation ({last['img_per_s']:,.0f} img/s in the last interval)")
    return list_checkpoints(run_dir)[-1], {"process": cfg.diffusion.process, "param": cfg.diffusion.param,
                                           "summary": summary, "config": cfg.to_dict(), "train_wall_s": wall,
                                           "stats": stats}


def continued_report(args) -> dict | None:
    """The report --continue-from names, checked to be one whose rows this call's can stand beside: the same
    settings, none of this part's models, and its judge beside it."""
    if args.continue_from is None:
        return None
    path = args.continue_from
    try:
        prev = json.loads(path.read_text())
        settings, models = prev["settings"], prev["models"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"--continue-from {path}: not an sde report ({type(e).__name__}: {e})") from None
    mine = settings_of(args)
    diffs = [f"{k} {settings.get(k)!r} there, {mine[k]!r} here" for k in SHARED_SETTINGS if settings.get(k) != mine[k]]
    if diffs:
        raise ValueError(f"--continue-from {path} was made with other settings ({'; '.join(diffs)}): use the same")
    again = sorted(set(models) & set(PARTS[args.part]))
    if again:
        raise ValueError(f"--continue-from {path} already has the model(s) {', '.join(again)}: continue it with "
                         "another --part")
    if not (path.parent / "judge.pt").is_file():
        raise ValueError(f"--continue-from {path}: no judge.pt beside it (the judge that scored its rows)")
    return prev


def settings_of(args) -> dict:
    return {"n": args.n, "guidance": args.guidance, "seed": args.seed, "steps": args.steps, "clips": args.clips,
            "snr": args.snr, "churn": args.churn, "ode_method": args.ode_method,
            "sample_precision": args.sample_precision, "budget_s": args.budget_s}


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
    prev = continued_report(args)
    train_beton, test_beton = find_betons(args.data)
    base.data.path = str(train_beton)
    device = resolve_device(base.train.device)
    train_x, train_y = read_beton(train_beton)
    test_x, test_y = read_beton(test_beton)
    train_u8, test_u8 = as_tensor(train_x, device), as_tensor(test_x, device)
    train_labels, test_labels = torch.from_numpy(train_y).to(device), torch.from_numpy(test_y).to(device)

    stop.doing("training the judge")
    judge_path = args.judge or (args.continue_from.parent / "judge.pt" if prev else None)
    if judge_path:
        judge, judge_desc = quality.load_judge(judge_path, device), f"loaded from {judge_path}"
    else:
        judge = quality.train_judge(train_beton, device, steps=args.judge_steps, seed=0, hold_out=args.n)
        judge_desc = f"trained by this run ({args.judge_steps} steps, {args.n} class-balanced images held out)"
    args.out.mkdir(parents=True, exist_ok=True)
    quality.save_judge(judge, args.out / "judge.pt")  # what a continuing call scores its rows with
    floor = quality.fd_floor(judge, train_u8, train_labels, test_u8, args.n)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    out = args.out / "sde_quality.json"
    command = "python -m benchmarks.quality.sde " + " ".join(argv)
    part = {"part": args.part, "models": list(PARTS[args.part]), "command": command, "device": name,
            "budget_s": args.budget_s, "complete": False}
    if prev is not None:
        result = prev
        result["reference"]["judge"] += f"; part {args.part} loaded it from {judge_path}"
        result["complete"] = False
        result.pop("stopped", None)
    else:
        result = {
            "command": command, "device": name, "environment": environment(),
            "dataset": {k: v for k, v in dataset_info(train_beton).items() if k != "manifest"},
            "settings": settings_of(args),
            "reference": {"judge": judge_desc, "test_images": len(test_u8),
                          "floor_n": floor and floor["n"], "fd_floor": floor and floor["fd_digits"],
                          "judge_test_acc": quality.accuracy(judge, test_u8, test_labels)},
            "models": {}, "rows": [], "skipped": [], "parts": [], "complete": False,
        }
    result["parts"].append(part)

    plotted = [-1]  # the rows the plot on disk shows: a phase that measured none draws the same plot again

    def save(with_plot: bool = True) -> None:
        # The plot takes ~0.3-2 s to draw (4 panels of ~30 lines; 4 s on a 2-core CPU): after every phase, not every
        # row, so that it does not eat the sampling budget (sde_report re-renders it from the JSON of a run cut
        # short), and only when rows were measured since it was drawn (part 2's trainings measure none).
        with_plot = with_plot and len(result["rows"]) != plotted[0]
        render(result, out, with_plot)
        if with_plot:
            plotted[0] = len(result["rows"])
        stop.kept["report"] = (f"the report {out} ({sum(r['status'] == 'ok' for r in result['rows'])} rows "
                               "measured)")

    with saved_when_stopped(stop, result, save), tempfile.TemporaryDirectory() as tmp:
        save()
        # Checkpoints are read back once, not kept (--runs keeps them).
        runs = args.runs or Path(tmp)
        ckpts = {}
        for model_name in PARTS[args.part]:
            ckpts[model_name], result["models"][model_name] = train_model(base, model_name, runs, stop)
            save()
        # Sampled in the layout they trained in (train.channels_last): cuDNN's NHWC kernels, and on a CPU ~3x faster.
        layout = torch.channels_last if base.train.channels_last else torch.contiguous_format
        models = {}
        for model_name, ckpt in ckpts.items():
            process, model, _ = load_for_sampling(ckpt, device, process=MODELS[model_name][0])
            models[model_name] = process, model.to(memory_format=layout)

        stop.doing("sampling")
        torch.backends.cudnn.benchmark = True  # one batch shape for every row: cuDNN's fastest kernels, chosen once
        labels = torch.arange(args.n, device=device) % 10
        options = SamplerOptions(snr=args.snr, method=args.ode_method)
        sec_per_nfe: dict[tuple[str, str], float] = {}
        best: dict[str, float] = {}

        def draw(row: dict, limit: int | None = None) -> tuple[torch.Tensor, int, float]:
            process, model = models[row["model"]]
            opts = dataclasses.replace(options, clip=row["clip"], churn=row["churn"])
            opts = dataclasses.replace(opts, rtol=row["tol"], atol=row["tol"]) if row["tol"] else opts
            net = model if limit is None else Capped(model, limit)
            set_precision("fp32" if row["precision"] == "fp32" else "tf32", device)
            amp = AMP_DTYPES[row["precision"]]

            def call():
                with torch.autocast(device.type, dtype=amp or torch.float32, enabled=amp is not None):
                    return sample(process, net, args.n, sampler=row["sampler"], steps=row["steps"], options=opts,
                                  eta=row["eta"] or 0.0, seed=args.seed, y=labels,
                                  guidance_scale=1.0 + args.guidance, device=device, shape=(3, 32, 32),
                                  memory_format=layout)

            (images, nfe), ms = timed_call(call, device)
            return images, nfe, ms / 1e3

        for model_name in models:  # cuDNN's algorithm choice and the allocator at the rows' batch size, untimed
            draw({"model": model_name, "sampler": "em", "steps": 2, "tol": None, "eta": None, "churn": 0.0,
                  "clip": "static", "precision": args.sample_precision})
        sampling_start = time.perf_counter()  # the budget is the sampling's: the trainings' time is not in it
        for row in plan_rows(args, PARTS[args.part], base.diffusion.timesteps):
            stop.check()  # a signal stops the study between two rows
            label = row_label(row)
            key = (row["model"], row["precision"])
            estimate = row["guess"] * sec_per_nfe.get(key, 0.0)
            if time.perf_counter() - sampling_start + estimate > args.budget_s:
                result["skipped"].append(label)
                continue
            process_name, param = MODELS[row["model"]]
            entry = {"process": process_name, "param": param, "deterministic": deterministic(row),
                     **{k: row[k] for k in ("model", "sampler", "steps", "tol", "eta", "churn", "clip", "precision")}}
            per_nfe = sec_per_nfe.get(key)
            left = args.budget_s - (time.perf_counter() - sampling_start)
            t0 = time.perf_counter()
            try:
                images, nfe, seconds = draw(row, None if per_nfe is None else max(row["guess"], int(left / per_nfe)))
            except (OverBudget, AssertionError, RuntimeError, ValueError) as e:  # torchdiffeq's "underflow in dt"
                # is an AssertionError
                text = str(e).strip().splitlines()[0] if str(e).strip() else ""
                result["rows"].append({**entry, "status": f"failed: {type(e).__name__}: {text}",
                                       "seconds": time.perf_counter() - t0})
                save(with_plot=False)
                print(f"sde: {label}: FAILED ({type(e).__name__}: {text})", flush=True)
                continue
            sec_per_nfe[key] = seconds / nfe
            metrics = quality.evaluate_samples(judge, images, labels, test_u8)
            result["rows"].append({**entry, "status": "ok", "nfe": nfe, "seconds": seconds,
                                   "img_per_s": args.n / seconds, "fd_digits": float(metrics["fd_digits"]),
                                   "cond_acc": metrics["cond_acc"]})
            if metrics["fd_digits"] < best.get(row["model"], float("inf")):
                best[row["model"]] = metrics["fd_digits"]
                save_grid(images[:100], args.out / f"samples-{row['model']}.png", nrow=10)
            save(with_plot=False)
            print(f"sde: {label}: NFE {nfe}, {args.n / seconds:.0f} img/s, FD-digits "
                  f"{metrics['fd_digits']:.2f}, cond acc {metrics['cond_acc']:.1%}", flush=True)
        stop.done()  # measured: the last save completes
        part.update(complete=True, sampling_s=time.perf_counter() - sampling_start,
                    total_s=time.perf_counter() - start)
        result["complete"] = all(p["complete"] for p in result["parts"])
        save()
    for line in target_lines(result):
        print(f"sde: {line}")
    return out


def parse_args(argv: list[str]) -> argparse.Namespace:
    """The options, each checked here (and the training config built), before anything is read or written."""
    from ffcv_ddpm.diffusion import CLIPS
    from ffcv_ddpm.sde_sampling import ADAPTIVE_METHODS, SamplerOptions
    from ffcv_ddpm.unet import PRESETS

    count = option(int, at_least(1))
    steps = lambda default: dict(type=int_list(at_least(2)), default=default,  # noqa: E731
                                 help=f"(default: {','.join(map(str, default))})")
    p = Parser(prog="python -m benchmarks.quality.sde", doc=__doc__, overrides=True,
               epilog="The overrides go to every model's trainer, after MODEL and TRAIN (benchmarks/quality/sde.py).")
    p.add_argument("--data", type=Path, required=True, help="folder with *_train_raw.beton and *_test_raw.beton")
    p.add_argument("--out", type=Path, required=True, help="folder for the JSON, Markdown, PNGs and judge.pt")
    p.add_argument("--part", choices=tuple(PARTS), default="all",
                   help="which models: 1 = ve and ddpm (ε-networks), 2 = ve-edm and ddpm-edm, all = the four")
    p.add_argument("--continue-from", type=Path, metavar="REPORT.json",
                   help="add this part's models and rows to that report (and score them with its judge.pt)")
    p.add_argument("--steps", type=count, default=3000, help="training steps per model (train.steps)")
    p.add_argument("--n", type=option(int, at_least(10)), default=500,
                   help="samples per row (and the judge's held-out images for the floor)")
    p.add_argument("--heun-steps", **steps([2, 3, 5, 10, 25]))
    p.add_argument("--dpm-steps", **steps([3, 5, 10, 20, 50]))
    p.add_argument("--ddim-steps", type=int_list(at_least(1)), default=[3, 5, 10, 20, 50],
                   help="ddim eta 0 and eta 1, DDPM models (default: 3,5,10,20,50)")
    p.add_argument("--em-steps", **steps([10, 20, 50, 100, 250]))
    p.add_argument("--pc-steps", **steps([5, 10, 25, 50, 100]))
    p.add_argument("--ode-tols", type=float_list(above(0)), default=[1e-2, 1e-3],
                   help="rtol = atol per ODE row (default: 0.01,0.001)")
    p.add_argument("--churn", type=option(float, at_least(0)), default=30.0,
                   help="heun's S_churn for its stochastic rows (EDM's CIFAR-10 VP setting; 0: no such rows)")
    p.add_argument("--clips", type=str_list(one_of(CLIPS)), default=["static", "off"],
                   help="x0 clipping of every sampler, a row group per mode (default: static,off)")
    p.add_argument("--no-ancestral", dest="ancestral", action="store_false", help="skip the T-step DDPM rows")
    p.add_argument("--snr", type=option(float, above(0)), default=SamplerOptions.snr,
                   help="pc: Langevin signal-to-noise ratio")
    p.add_argument("--ode-method", type=option(str, one_of(ADAPTIVE_METHODS)), default=SamplerOptions.method,
                   help="torchdiffeq adaptive method")
    p.add_argument("--guidance", type=option(float, at_least(0)), default=0.0,
                   help="classifier-free guidance weight w (0: no guidance)")
    p.add_argument("--sample-precision", choices=("fp32", "tf32", "bf16"), default="tf32",
                   help="of the fixed-step rows (the adaptive ODE rows run in fp32)")
    p.add_argument("--seed", type=option(int, at_least(0)), default=0,
                   help="sampling seed (the same noise for every row of a model)")
    p.add_argument("--judge", type=Path, help="a judge saved by ffcv_ddpm.quality.save_judge (default: train one)")
    p.add_argument("--judge-steps", type=count, default=2000, help="training steps of the judge")
    p.add_argument("--budget-s", type=option(float, at_least(0)), default=100.0,
                   help="seconds of sampling: rows that would end later are not run (the trainings are not counted)")
    p.add_argument("--preset", default="ddpm-cifar10", type=option(str, one_of(lambda: tuple(PRESETS))),
                   help="preset the MODEL overrides start from")
    p.add_argument("--runs", type=Path, help="keep the training runs here (default: a temporary folder)")
    args, args.overrides = p.parse_with_overrides(argv)
    if args.judge is not None and not args.judge.is_file():
        p.error(f"--judge {args.judge}: no such file (save one with ffcv_ddpm.quality.save_judge, or leave it out)")
    if args.judge is not None and args.continue_from is not None:
        p.error("--judge with --continue-from: a continued report is scored by its own judge (judge.pt beside it)")
    if args.continue_from is not None and not args.continue_from.is_file():
        p.error(f"--continue-from {args.continue_from}: no such file")
    if args.continue_from is not None and args.part == "all":
        p.error("--continue-from with --part all: there is no model left to add; name the part this call adds")
    try:
        args.base = base_config(args)
    except ValueError as e:
        p.error(str(e))
    if args.base.model.num_classes < 2:
        p.error("model.num_classes must be >= 2: the rows are scored by conditional accuracy")
    if max(args.ddim_steps) > args.base.diffusion.timesteps:
        p.error(f"--ddim-steps {max(args.ddim_steps)}: at most diffusion.timesteps={args.base.diffusion.timesteps}")
    p.check_paths(inputs=[("--data", args.data, "folder", "build the digits with `make dataset SOURCE=digits`")],
                  outputs=[("--out", args.out), ("--runs", args.runs)])
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
