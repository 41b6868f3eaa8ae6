"""`make compress`: how small and how fast can the model get before its samples degrade? Pruning, grouped and
depthwise-separable convolutions and int8 side by side: size, speed and quality in one table.

    python -m benchmarks.quality.compress --out benchmarks/results/h100/compress  # trains the dense digits model first
    python -m benchmarks.quality.compress runs/00007-digits-quality --out DIR     # or studies a trained run folder
    python -m benchmarks.quality.compress RUN --judge J --continue-from c1/compress.json --out c2   # a report cut by
                                                   # its budget, finished by a second call: its rows kept, the rest run
    python -m benchmarks.quality.compress --data /tmp/d --out /tmp/c --preset tiny --steps 4 ...   # CPU toy (tests)

In this order (the report is rewritten after every row; a row whose estimated time would end past --budget-s is
recorded as skipped, with the estimate; a row that fails is recorded with its error and the study goes on):
1. the dense model: RUN_DIR's newest checkpoint (EMA weights; KEY=VALUE overrides applied before its network is
   built, and one that changes its shape refused), or trained here exactly as `make quality` trains it (the `digits`
   preset, benchmarks.quality.digits's settings, --steps 4000, bf16, torch.compile on a GPU), so that it has learned:
   the report says whether it passed the quality bar (>= 90% conditional accuracy) and says so plainly when it did not;
   the judge (ffcv_ddpm.quality): --judge, RUN_DIR's train.eval_judge, or trained here on the digits with the rows'
   sample count held out for the floor; without one, speed and size only;
2. the rows, in rounds so that every family runs before any family's second row (rank in variants()):
   - references: the baseline (fp32 weights, bf16 autocast: how every other row samples), fp32 (TF32 off), bf16 and
     fp16 weights;
   - int8 (torchao, ffcv_ddpm.compress): weight-only, dynamic (weights and activations; a conv's activations get one
     scale per (n, c, h) pixel row), dynamic on Linear layers only;
   - unstructured pruning as pruned: L1 and random x global and local x --ratios;
   - structured pruning as pruned: --ratios of every residual block's inner channels (whole GroupNorm groups);
   - architectures from scratch: res-block 3x3 convs grouped (conv_groups = 2, 4) and depthwise-separable, and the
     dense network beside them as their reference, each trained --scratch-steps with the dense run's settings
     (eagerly) and sampled with its raw weights (an EMA of 0.998 over a few hundred steps is still mostly the
     random initialisation);
   - --speed-preset (ddpm-cifar10): the same conversions of that preset with random weights, speed and size only;
   - fine-tuned: the L1 and structured pruning rows again after --ft-steps steps (masks kept; EMA of the steps).

Per row: parameters, non-zero parameters, weight sparsity (of the compressed layers), forward GFLOP per image,
checkpoint MB (what torch.save writes for the state_dict; unstructured rows also as CSR), sampling latency: one
sampling call (the process's default sampler, DDIM for DDPM, --ddim-steps steps) at --sample-batch images timed
with CUDA events, the median of --reps - 1 calls after a first (warm-up) call, and images/s from it; the training
step time (ms, median) where it trains; FD-digits to the test set and conditional accuracy of all --reps x
--sample-batch samples (the guidance weight --guidance). The findings printed above each table are computed from
these numbers (compress_report.findings). Variants run eagerly (a compilation per variant would cost more than the
study), channels_last, cuDNN benchmark mode; training steps are the trainer's (ffcv_ddpm.step.make_step).

Time on one H100 of its own at commit 80f184a: 13.5 minutes in all (dense training 270 s with compilation, judge
~30 s, rows ~510 s), over two GPU calls joined by --continue-from. The estimates the budget works with: the dense
training as `make quality`'s, measured there at commit 44a0e9b, ~225 s with compilation (without its evaluations);
judge ~10 s; the rows, estimated from that run (eager
DDIM sampling of this model at >= ~14,000 image-evaluations per second) and FLOP counts: ~1-2 s per sampled digits
row, ~20 s per model trained from scratch (400 eager steps), ~3 s per fine-tuning, ~50 s for the speed preset's 18
rows: ~240 s, so the default --budget-s 485 may leave the last fine-tuned rows out (the report lists them as
skipped). The sizes chosen to fit that call: --reps 2 (512 samples per row), --scratch-steps 400 (the dense model:
4000), --ft-steps 50, random-pruning rows not fine-tuned. The int8 rows need torchao (requirements.txt: 0.18.0,
`pip install --no-deps`); without it they are recorded as failed, saying so.

SIGTERM/SIGINT stop the whole command (benchmarks.quality.study): the report keeps what was measured, a training run
that was cut short is removed, exit 128 + signal.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import statistics
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Callable

import torch
from torch import nn

from benchmarks.quality.compress_report import BASELINE, FAMILIES, SCRATCH_REFERENCE, by_model, findings, write_report
from ffcv_ddpm.checks import (Parser, Rule, above, at_least, check_input, float_list, in_range, matches, one_of, option,
                              str_list)
from ffcv_ddpm.timing import timed_call

WARMUP_STEPS = 10  # training steps left out of a step-time median (cuDNN's algorithm search, the allocator)


def parse_args(argv: list[str]) -> argparse.Namespace:
    """Every option checked, and the config the study will use built from the overrides, before anything runs."""
    from benchmarks.quality.digits import DIGITS_DATA, TRAIN_DEFAULTS, check_digits
    from ffcv_ddpm.unet import PRESETS

    count = option(int, at_least(1))
    p = Parser(prog="python -m benchmarks.quality.compress", doc=__doc__, overrides=True,
               epilog="Without RUN_DIR the overrides go to the dense model's training after the digits quality "
                      f"run's settings ({' '.join(TRAIN_DEFAULTS)}); with RUN_DIR they change the run's config "
                      "before its network is built (e.g. train.device=cpu, model.attn_impl=math; one that changes "
                      "the network's shape is refused).")
    p.add_argument("run_dir", nargs="?", type=Path, metavar="RUN_DIR",
                   help="a run folder to study (default: train the digits model here)")
    p.add_argument("--data", type=Path, default=DIGITS_DATA,
                   help=f"digits data folder (without RUN_DIR; {DIGITS_DATA} is built if missing)")
    p.add_argument("--out", type=Path, help="report folder (default benchmarks/results/<card>/compress)")
    p.add_argument("--work", type=Path, default=Path("runs"), help="where trained runs and the judge go")
    p.add_argument("--judge", type=Path, help="a saved digits judge (default: the run's, or trained here)")
    p.add_argument("--preset", default="digits", type=option(str, one_of(lambda: tuple(PRESETS))),
                   help="model preset trained without RUN_DIR")
    p.add_argument("--steps", type=count, default=4000,
                   help="dense training steps, train.steps (without RUN_DIR; make quality's)")
    p.add_argument("--judge-steps", type=count, default=2000, help="judge training steps (when trained here)")
    p.add_argument("--scratch-steps", type=count, default=400,
                   help="training steps of the from-scratch models (grouped, separable and their dense reference)")
    p.add_argument("--ratios", type=float_list(Rule("in (0, 1)", lambda v: 0 < v < 1)), default=[0.3, 0.5, 0.7, 0.9],
                   help="pruning ratios (the share removed), comma-separated (default 0.3,0.5,0.7,0.9)")
    p.add_argument("--ft-steps", type=option(int, at_least(0)), default=50,
                   help="fine-tuning steps after pruning (0: no fine-tuned rows)")
    p.add_argument("--ft-lr", type=option(float, above(0)), default=1e-4, help="fine-tuning learning rate (constant)")
    p.add_argument("--ft-ema", type=option(float, in_range(0, 1, high_open=True)), default=0.95,
                   help="EMA decay over the fine-tuning steps")
    p.add_argument("--time-steps", type=option(int, at_least(2)), default=20,
                   help="steps that time the dense model's training step")
    p.add_argument("--ddim-steps", type=count, default=50, help="sampler steps of every sampling call")
    p.add_argument("--sample-batch", type=count, default=256, help="images per sampling call")
    p.add_argument("--reps", type=option(int, at_least(2)), default=2,
                   help="sampling calls per row (the first is not timed)")
    p.add_argument("--guidance", type=option(float, at_least(0)), default=0.0,
                   help="guidance weight w (0: one forward per step)")
    p.add_argument("--speed-preset", default="ddpm-cifar10", type=option(str, matches(
                   f"a preset ({', '.join(PRESETS)}) or '' (none)", lambda v: v in ("", *PRESETS))),
                   help="preset for speed/size-only rows ('' = none)")
    p.add_argument("--families", type=str_list(one_of(FAMILIES)), default=list(FAMILIES),
                   help=f"the families of rows to run, comma-separated (default: all: {','.join(FAMILIES)})")
    p.add_argument("--budget-s", type=option(float, at_least(0)), default=485,
                   help="no row starts that would end after this many seconds from the start")
    p.add_argument("--seed", type=option(int, at_least(0)), default=0)
    p.add_argument("--continue-from", type=Path, metavar="REPORT.json",
                   help="a report of RUN_DIR cut by its budget: keep its measured rows, run the others (same settings)")
    args, args.overrides = p.parse_with_overrides(argv)
    if args.run_dir is not None and "=" in str(args.run_dir):  # an override where RUN_DIR would be
        args.overrides.insert(0, str(args.run_dir))
        args.run_dir = None
    if args.judge is not None and not args.judge.is_file():
        p.error(f"--judge {args.judge}: no such file (leave it out to use the run's judge or train one)")
    try:  # a bad override is one line before anything is built, trained or written
        check_input(args.run_dir, "RUN_DIR", "folder", "give a run folder written by ffcv_ddpm.train")
        args.cfg = study_config(args)
        if args.run_dir is None:
            check_digits(args.data)
    except (ValueError, FileNotFoundError) as e:
        p.error(str(e))
    p.check_paths(outputs=[("--out", args.out), ("--work", args.work)])
    if args.ft_steps and args.ft_steps < 2:
        p.error(f"--ft-steps {args.ft_steps}: 0 (no fine-tuning) or at least 2")
    if args.continue_from is not None:
        try:
            args.previous = previous_report(args)
        except ValueError as e:
            p.error(str(e))
    return args


# The options a row's figures depend on: a report continued by another call must have been made with the same.
ROW_SETTINGS = ("ddim_steps", "sample_batch", "reps", "guidance", "seed", "ft_steps", "ft_lr", "ft_ema",
                "scratch_steps", "ratios", "speed_preset")


def previous_report(args) -> dict:
    """The report --continue-from names, checked to be one this command can continue: of RUN_DIR (the same dense
    model, so that its rows and the new ones describe one network) with the same row settings. ValueError if not."""
    path = args.continue_from
    try:
        prev = json.loads(path.read_text())
        rows, dense, settings = prev["rows"], prev["dense"], prev["settings"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"--continue-from {path}: not a compress report ({type(e).__name__}: {e}); give the "
                         "compress.json of an earlier run") from None
    if args.run_dir is None or Path(dense["run_dir"]).resolve() != args.run_dir.resolve():
        raise ValueError(f"--continue-from {path} studied the run {dense['run_dir']}: give that run folder as "
                         f"RUN_DIR (its rows and the new ones must describe one model)")
    changed = [k for k in ROW_SETTINGS if settings.get(k) != getattr(args, k)]
    if changed:
        diffs = ", ".join(f"--{k.replace('_', '-')} {settings.get(k)} there, {getattr(args, k)} here" for k in changed)
        raise ValueError(f"--continue-from {path} was made with other row settings ({diffs}): use the same")
    return prev


def study_config(args):
    """The dense run's config the study works with: RUN_DIR's config.json with the overrides, or the config of the
    digits model trained here (benchmarks.quality.digits's, evaluating nothing while it trains: the judge is the
    study's)."""
    from benchmarks.quality.digits import train_config
    from ffcv_ddpm.config import RunConfig, apply_override, check_config

    if args.run_dir is not None:
        path = args.run_dir / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"{args.run_dir} has no config.json: give a run folder written by ffcv_ddpm.train")
        cfg = RunConfig.from_dict(json.loads(path.read_text()))
        for item in args.overrides:
            apply_override(cfg, item)
        cfg = check_config(cfg)
    else:
        ns = SimpleNamespace(preset=args.preset, seed=args.seed, steps=args.steps, n_per_class=1,
                             ddim_steps=[args.ddim_steps], work=args.work,
                             overrides=["train.eval_every=0", "train.desc=compress-dense", *args.overrides])
        cfg = train_config(ns, args.data / "digits_train_raw.beton", args.data / "digits_test_raw.beton", "")
    if args.ddim_steps > cfg.diffusion.timesteps:
        raise ValueError(f"--ddim-steps {args.ddim_steps}: at most diffusion.timesteps={cfg.diffusion.timesteps}")
    return cfg


# ---------------------------------------------------------------------------------------------------- measuring


def fine_tune(model: nn.Module, cfg, diffusion, data, steps: int, lr: float, ema_decay: float, seed: int):
    """Trains `model` in place for `steps` steps on random batches of `data` ((uint8 images, labels) on the device)
    at a constant learning rate with the trainer's step (autocast, clipping, fused AdamW, EMA); pruning masks stay.
    Returns the EMA model (eval mode) and each step's milliseconds (CUDA events, one sync at the end)."""
    from ffcv_ddpm.ema import EMA
    from ffcv_ddpm.step import make_step
    from ffcv_ddpm.timing import timed_steps

    images, labels = data
    device = images.device
    model.train()
    fused = cfg.train.fused_adam
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=cfg.train.betas,
                                  weight_decay=cfg.train.weight_decay, fused=fused or None, foreach=not fused)
    scaler = torch.amp.GradScaler(device.type, enabled=cfg.train.precision == "fp16")
    ema = EMA(model, decay=ema_decay)
    step = make_step(model, model, diffusion, optimizer, scaler, ema, cfg)
    gen = torch.Generator(device=device).manual_seed(seed)

    def fetch():
        idx = torch.randint(0, len(labels), (cfg.data.batch_size,), generator=gen, device=device)
        return images[idx], labels[idx]

    timed = timed_steps(lambda batch, _i: step(*batch, lr), fetch, steps, device)
    model.eval()
    return ema.module.eval(), timed.iter_ms


def step_ms(iter_ms: list[float]) -> float | None:
    """Median step time after the warm-up steps (cuDNN's algorithm search, the allocator), or of all if too few."""
    kept = iter_ms[WARMUP_STEPS:] or iter_ms
    return statistics.median(kept) if kept else None


# ---------------------------------------------------------------------------------------------------- variants


@dataclass
class Variant:
    model: str  # which network: the studied run's preset, or the speed preset's name
    family: str  # reference | int8 | unstructured | structured | architecture
    name: str  # what was done, e.g. "L1 global 50%"
    make: Callable[[], nn.Module]  # builds the variant (trains it from scratch for "architecture" rows)
    shape: object  # the ModelConfig it was built from (input shape, classes: for sampling and FLOP counts)
    precision: str = "baseline"  # sampling: baseline (fp32 weights, the run's autocast) | fp32 | bf16 | fp16
    fine_tune: bool = False  # fine-tuned for --ft-steps after make() (pruning masks kept)
    quality: bool = True  # score samples with the judge
    source: nn.Module | None = None  # int8 rows: the float network, whose counts and FLOPs describe it
    extra: dict = field(default_factory=dict)  # recorded in the row (ratio, method, scope, override, ...)
    rank: int = 1  # the round it runs in (0: the first row of each family; see variants)


@dataclass
class Study:
    """What every row needs: the device, the dense model and its run config, data, judge, settings."""
    args: argparse.Namespace
    device: torch.device
    cfg: object  # RunConfig of the dense run
    dense: nn.Module
    diffusion: nn.Module
    amp_dtype: torch.dtype | None
    judge: object | None = None
    test_x: torch.Tensor | None = None
    data: tuple | None = None  # train (uint8 images, labels) on the device, for fine-tuning
    sample_s: dict = field(default_factory=dict)  # model -> seconds of each sampling call so far
    row_s: dict = field(default_factory=dict)  # (model, family, fine_tune) -> seconds the last such row took
    train_step_s: float = 0.0  # the dense model's eager training step (the unit of the time estimates)
    sampler: str = "ddim"  # the process's default sampler (evaluate.default_sampler): every row's
    stop: object = None  # the command's benchmarks.quality.study.StudyStop (training runs inside the study)
    scratch_ms: float | None = None  # the eager step time of the last model trained from scratch
    gflops: dict = field(default_factory=dict)  # parameter shapes -> forward GFLOP/img (counting costs ~1 s)


def sample_calls(study: Study, model: nn.Module, precision: str, shape) -> tuple:
    """--reps sampling calls of --sample-batch images (seeds seed, seed+1, ...): (uint8 samples, labels, ms per call)."""
    from ffcv_ddpm.evaluate import class_labels, generate
    from ffcv_ddpm.step import set_precision

    a = study.args
    set_precision("fp32" if precision == "fp32" else "bf16", study.device)  # TF32 off only for the fp32 row
    amp = {"baseline": study.amp_dtype, "fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    labels = class_labels(a.sample_batch, shape.num_classes, study.device)
    samples, ms = [], []
    try:
        for i in range(a.reps):
            out, t = timed_call(lambda: generate(
                model, study.diffusion, a.sample_batch, labels=labels, sampler=study.sampler, steps=a.ddim_steps,
                guidance=a.guidance if labels is not None else 0.0, batch=a.sample_batch, seed=a.seed + i,
                amp_dtype=amp, shape=(shape.in_channels, shape.image_size, shape.image_size),
                memory_format=torch.channels_last), study.device)
            samples.append(out)
            ms.append(t)
    finally:
        set_precision("bf16", study.device)
    return torch.cat(samples), None if labels is None else labels.repeat(a.reps), ms


def measure(study: Study, v: Variant, model: nn.Module) -> dict:
    """Counts, size, latency and (with a judge) quality of a built variant."""
    from ffcv_ddpm import compress, quality

    counted = v.source if v.source is not None else model
    params, nonzero = compress.param_counts(counted)
    shapes = (v.model, *(tuple(p.shape) for p in counted.parameters()))
    if shapes not in study.gflops:
        study.gflops[shapes] = compress.forward_gflops(counted, v.shape.in_channels, v.shape.image_size,
                                                       v.shape.num_classes)
    row = {"params": params, "nonzero_params": nonzero, "weight_sparsity": compress.weight_sparsity(counted),
           "gflops_per_image": study.gflops[shapes], "size_mb": compress.checkpoint_mb(model)}
    if v.family == "unstructured":
        row["size_csr_mb"] = compress.sparse_checkpoint_mb(model)
    samples, labels, ms = sample_calls(study, model, v.precision, v.shape)
    study.sample_s.setdefault(v.model, []).extend(t / 1e3 for t in ms)
    latency = statistics.median(ms[1:]) if len(ms) > 1 else ms[0]
    row.update(latency_ms=latency, latency_ms_calls=ms, img_per_s=study.args.sample_batch / (latency / 1e3))
    if v.quality and study.judge is not None:
        scores = quality.evaluate_samples(study.judge, samples, labels, study.test_x)
        row.update(fd_digits=scores["fd_digits"], cond_acc=scores["cond_acc"], n_samples=scores["n"])
    return row


def estimate_s(study: Study, v: Variant) -> float:
    """Seconds the row should take: its sampling calls and training steps at the times measured so far, or what the
    last row of its kind took if that was longer (start-up, slower kernels); 0 for a new model's first row."""
    calls = study.sample_s.get(v.model)
    sampling = study.args.reps * statistics.median(calls) if calls else 0.0
    steps = (study.args.ft_steps if v.fine_tune else 0) + v.extra.get("scratch_steps", 0)
    return max(sampling + steps * study.train_step_s, study.row_s.get((v.model, v.family, v.fine_tune), 0.0))


# ---------------------------------------------------------------------------------------------------- the study

ARCHITECTURES = [("grouped convs (2 groups)", {"conv_groups": 2}), ("grouped convs (4 groups)", {"conv_groups": 4}),
                 ("depthwise-separable convs", {"depthwise_separable": True})]


def variants(study: Study) -> list[Variant]:
    """Every row, in the order they run: by rank (0: one row of every family, so that a budget cut never leaves a
    family out; 1: the studied model's other rows; 2: the speed preset's other rows; 3: the other fine-tunings),
    then as listed."""
    from ffcv_ddpm import compress
    from ffcv_ddpm.unet import PRESETS

    a, dense, studied = study.args, study.dense, study.cfg.preset
    pct = lambda r: f"{r:.0%}"  # noqa: E731
    mid = a.ratios[(len(a.ratios) - 1) // 2]  # the ratio of the first round (0.5 of the default four)

    def conversions(name: str, model: nn.Module, shape, quality: bool, rank: int) -> list[Variant]:
        """The references and the int8 rows of one network (the baseline and int8 weight-only at `rank`)."""
        def to(dtype):
            return lambda: copy.deepcopy(model).to(dtype)

        def int8(mode):
            return lambda: compress.quantize_int8(copy.deepcopy(model), mode)

        same = dict(shape=shape, quality=quality)
        return [Variant(name, "reference", BASELINE, lambda: model, rank=rank, **same),
                Variant(name, "reference", "fp32 (TF32 off)", lambda: model, precision="fp32", **same),
                Variant(name, "reference", "bf16 weights", to(torch.bfloat16), precision="bf16", **same),
                Variant(name, "reference", "fp16 weights", to(torch.float16), precision="fp16", **same),
                *[Variant(name, "int8", compress.QUANT_LABELS[mode], int8(mode), source=model, extra={"mode": mode},
                          rank=rank if mode == "weight-only" else 1, **same) for mode in compress.QUANT_MODES]]

    def unstructured(name, model, method, scope, ratio, shape, quality=True, fine_tune=False, rank=1) -> Variant:
        label = f"{'L1' if method == 'l1' else method} {scope} {pct(ratio)}"
        return Variant(name, "unstructured", label, lambda: compress.prune_unstructured(
            copy.deepcopy(model), ratio, method=method, scope=scope, seed=a.seed), shape=shape, quality=quality,
            fine_tune=fine_tune, extra={"method": method, "scope": scope, "ratio": ratio}, rank=rank)

    def structured(name, model, ratio, shape, quality=True, fine_tune=False, rank=1) -> Variant:
        return Variant(name, "structured", f"channels {pct(ratio)}", lambda: compress.prune_structured(model, ratio),
                       shape=shape, quality=quality, fine_tune=fine_tune, extra={"ratio": ratio}, rank=rank)

    def scratch(name, override, rank) -> Variant:
        return Variant(studied, "architecture", name, lambda: train_scratch(study, override, a.scratch_steps),
                       shape=dataclasses.replace(shape, **override), rank=rank,
                       extra={"override": override, "scratch_steps": a.scratch_steps})

    shape, ratios = study.cfg.model, a.ratios
    can_prune = compress.structured_refusal(dense) is None  # the refusal is in the report (run)
    rows = conversions(studied, dense, shape, True, rank=0)
    rows += [unstructured(studied, dense, m, s, r, shape, rank=0 if (m, s, r) == ("l1", "global", mid) else 1)
             for m in compress.PRUNE_METHODS for s in compress.PRUNE_SCOPES for r in ratios]
    rows += [structured(studied, dense, r, shape, rank=0 if r == mid else 1) for r in ratios if can_prune]
    rows += [scratch(SCRATCH_REFERENCE, {}, 0)]
    rows += [scratch(name, o, 0 if i == 0 else 1) for i, (name, o) in enumerate(ARCHITECTURES)]
    if a.speed_preset:
        speed = f"{a.speed_preset} (random weights)"
        scfg = PRESETS[a.speed_preset]
        net = random_model(study, scfg)
        speed_rows = conversions(speed, net, scfg, False, rank=0)
        # One unstructured method: which weights are zero changes neither shapes nor kernels.
        speed_rows += [unstructured(speed, net, "l1", "global", r, scfg, quality=False) for r in ratios]
        if compress.structured_refusal(net) is None:
            speed_rows += [structured(speed, net, r, scfg, quality=False) for r in ratios]
        speed_rows += [Variant(speed, "architecture", name,
                               lambda o=o: random_model(study, dataclasses.replace(scfg, **o)),
                               shape=dataclasses.replace(scfg, **o), quality=False, extra={"override": o})
                       for name, o in ARCHITECTURES]
        for v in speed_rows:
            v.rank = 0 if v.name == BASELINE else 2
        rows += speed_rows
    if a.ft_steps:
        # Fine-tuned: L1 and structured pruning (random pruning is the control of L1, shown as pruned only).
        rows += [structured(studied, dense, r, shape, fine_tune=True, rank=0 if r == mid else 3)
                 for r in ratios if can_prune]
        rows += [unstructured(studied, dense, "l1", s, r, shape, fine_tune=True,
                              rank=0 if (s, r) == ("global", mid) and not can_prune else 3)
                 for s in compress.PRUNE_SCOPES for r in ratios]
    rows = [v for v in rows if v.family in a.families or v.name == BASELINE]  # every ratio is to the baseline
    return sorted(rows, key=lambda v: v.rank)  # stable: within a rank, as listed


def random_model(study: Study, cfg) -> nn.Module:
    from ffcv_ddpm.unet import build_model

    torch.manual_seed(study.args.seed)
    return build_model(cfg).to(study.device, memory_format=torch.channels_last).eval()


def train_scratch(study: Study, override: dict, steps: int) -> nn.Module:
    """The dense run's training (config, data, seed) with other res-block convs (or none: the reference), from
    scratch, eagerly, for `steps` steps; the raw weights (eval mode). Its step time goes to study.scratch_ms."""
    from benchmarks.quality.study import train_run
    from ffcv_ddpm.train import read_stats
    from ffcv_ddpm.evaluate import load_run

    cfg = copy.deepcopy(study.cfg)
    cfg.model = dataclasses.replace(cfg.model, **override)
    cfg.train.steps, cfg.train.ckpt_every, cfg.train.log_every = steps, steps, min(100, steps)
    cfg.train.resume, cfg.train.eval_every, cfg.train.sample_every = "", 0, 0
    cfg.train.compile, cfg.train.cudnn_benchmark, cfg.train.progress = False, True, False
    cfg.train.telemetry = False
    cfg.train.out_dir = str(study.args.work)
    cfg.train.desc = "compress-" + ("-".join(f"{k}{v}" for k, v in override.items()) or "dense-scratch")
    run_dir = train_run(cfg, study.stop)
    stats = read_stats(run_dir)
    study.scratch_ms = stats[-1]["iter_ms_median"]  # the last interval: after cuDNN's algorithm search
    return load_run(run_dir, study.device, ema=False)[1]


def report_dir(args, device) -> Path:
    """--out, or benchmarks/results/<card>/compress; BenchError if it cannot be written."""
    from benchmarks.common import results_out

    return results_out(args.out, torch.cuda.get_device_name(device) if device.type == "cuda" else None, "compress")


def dense_run(args, stop) -> tuple:
    """(run config, EMA model, process, run info) of RUN_DIR, or of the digits model trained here."""
    from benchmarks.quality.digits import ensure_digits
    from benchmarks.quality.study import train_run
    from ffcv_ddpm.train import read_stats
    from ffcv_ddpm.evaluate import load_run
    from ffcv_ddpm.step import resolve_device

    device = resolve_device(args.cfg.train.device)
    report_dir(args, device)  # checked before the model is loaded or trained
    if args.run_dir is not None:
        stop.doing(f"loading {args.run_dir}")
        cfg, model, diffusion, step = load_run(args.run_dir, device, overrides=args.overrides)
        return cfg, model, diffusion, {"run_dir": str(args.run_dir), "step": step, "trained_here": False}
    stop.doing("building the digits dataset")
    built = ensure_digits(args.data)
    args.work.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    run_dir = train_run(args.cfg, stop)
    stop.kept["run"] = f"the dense run {run_dir}"
    seconds = time.perf_counter() - t0
    cfg, model, diffusion, step = load_run(run_dir, device)
    stats = read_stats(run_dir)
    return cfg, model, diffusion, {"run_dir": str(run_dir), "step": step, "trained_here": True,
                                   "dataset_built_now": built, "seconds": seconds, "stats": stats}


def load_or_train_judge(args, cfg, device, n: int) -> tuple:
    """(judge, test images, info) or (None, None, reason) when this run's data has no digits judge. A judge trained
    here holds n class-balanced train images out for the floor."""
    from ffcv_ddpm import quality

    train_beton = Path(cfg.data.path)
    test_beton = Path(cfg.train.eval_ref) if cfg.train.eval_ref else train_beton.with_name("digits_test_raw.beton")
    path = args.judge or (Path(cfg.train.eval_judge) if cfg.train.eval_judge else None)
    if path is not None and path.is_file() and test_beton.is_file():
        judge = quality.load_judge(path, device)
        info = {"path": str(path), "trained_here": False}
    elif train_beton.name.startswith("digits_") and test_beton.is_file():
        t0 = time.perf_counter()
        judge = quality.train_judge(train_beton, device, steps=args.judge_steps, seed=args.seed, hold_out=n)
        path = args.work / "compress-judge.pt"
        path.parent.mkdir(parents=True, exist_ok=True)
        quality.save_judge(judge, path)
        info = {"path": str(path), "trained_here": True, "seconds": time.perf_counter() - t0,
                **{k: v for k, v in judge.info.items() if k != "held_out"}}
    else:
        return None, None, {"none": f"no digits judge for {train_beton} (give --judge and a digits run): "
                                    "speed and size only"}
    test_x, test_y = quality.beton_tensors(test_beton, device)
    info.update(test_beton=str(test_beton), test_accuracy=quality.accuracy(judge, test_x, test_y),
                held_out=len(judge.info.get("held_out") or []))
    return judge, test_x, info


def run(args, argv: list[str], t_start: float, stop) -> dict:
    from benchmarks.quality.study import saved_when_stopped
    from ffcv_ddpm import compress, quality
    from ffcv_ddpm.env import environment
    from ffcv_ddpm.evaluate import default_sampler
    from ffcv_ddpm.step import AMP_DTYPES

    cfg, dense, diffusion, dense_info = dense_run(args, stop)
    device = next(dense.parameters()).device
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = True  # every row: each conv shape's fastest algorithm (warm-up call pays)
    card = torch.cuda.get_device_name(device) if device.type == "cuda" else None
    out = report_dir(args, device)
    try:
        torchao_version = compress.import_torchao().__version__
    except ImportError:
        torchao_version = None
    study = Study(args, device, cfg, dense, diffusion, AMP_DTYPES[cfg.train.precision] if device.type == "cuda"
                  else None, sampler=default_sampler(diffusion), stop=stop)
    result = {"command": "python -m benchmarks.quality.compress " + " ".join(argv), "device": card or "CPU",
              "environment": {**environment(), "torchao": torchao_version}, "budget_s": args.budget_s,
              "complete": False, "model": cfg.preset, "dense": {**dense_info, "config": cfg.to_dict()},
              "sampler": study.sampler,
              "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k not in ("cfg", "previous")},
              "notes": [], "rows": []}
    reason = compress.structured_refusal(dense)
    if reason:
        result["notes"].append(f"no structured pruning rows: {reason}")
    kept = continued_rows(args, result, dense_info)

    def save(message: str | None = None, draw: bool = False) -> None:
        result["elapsed_s"] = time.perf_counter() - t_start
        write_report(result, out, draw)
        stop.kept["report"] = f"the report {out} ({sum(r['status'] == 'ok' for r in result['rows'])} rows measured)"
        if message:
            print(f"compress: [{result['elapsed_s']:.0f} s] {message}", flush=True)

    with saved_when_stopped(stop, result, save):
        stop.doing("training the judge")
        n = args.reps * args.sample_batch
        study.judge, study.test_x, result["judge"] = load_or_train_judge(args, cfg, device, n)
        if kept and result["judge"].get("path") != args.previous["judge"].get("path"):
            raise ValueError(f"--continue-from {args.continue_from} judged its rows with "
                             f"{args.previous['judge'].get('path')}: give it as --judge")
        if study.judge is not None:
            stop.kept["judge"] = f"the judge {result['judge']['path']}"
        study.data = train_x, train_y = quality.beton_tensors(cfg.data.path, device)
        if study.judge is not None:
            result["floor"] = quality.fd_floor(study.judge, train_x, train_y, study.test_x, n)
        # The dense model's training step, eager like every fine-tuning and from-scratch run: the estimates' unit.
        stop.doing("timing the dense model's training step")
        _, iter_ms = fine_tune(copy.deepcopy(dense), cfg, diffusion, study.data, args.time_steps, args.ft_lr,
                               args.ft_ema, args.seed)
        dense_step_ms = step_ms(iter_ms)
        study.train_step_s = dense_step_ms / 1e3
        judged = f"judge test accuracy {result['judge']['test_accuracy']:.1%}" if study.judge else "no judge"
        save(f"dense model {dense_info['run_dir']} ready, {dense_step_ms:.1f} ms per eager training step; {judged}")

        for v in variants(study):
            label = f"{v.model} / {v.name}{' (fine-tuned)' if v.fine_tune else ''}"
            stop.doing(f"row {label}")
            row = {"model": v.model, "family": v.family, "variant": v.name, "precision": v.precision,
                   "fine_tune_steps": args.ft_steps if v.fine_tune else 0, "rank": v.rank, **v.extra}
            if row_key(row) in kept:  # measured by the call this one continues
                result["rows"].append(kept[row_key(row)])
                continue
            est = estimate_s(study, v)
            if time.perf_counter() - t_start + est > args.budget_s:
                row["status"] = f"skipped: estimated {est:.0f} s would end past the {args.budget_s:.0f} s budget"
                result["rows"].append(row)
                save(f"{label}: {row['status']}")
                continue
            t0 = time.perf_counter()
            try:
                model = v.make()
                if v.fine_tune:
                    ema, iter_ms = fine_tune(model, cfg, diffusion, study.data, args.ft_steps, args.ft_lr,
                                             args.ft_ema, args.seed)
                    model = compress.make_permanent(ema)
                    row["train_step_ms"] = step_ms(iter_ms)
                elif "scratch_steps" in v.extra:  # trained from scratch: the step time of its own training
                    row["train_step_ms"] = study.scratch_ms
                    row["weights"] = "raw"
                elif v.model == cfg.preset and v.name == BASELINE:
                    row["train_step_ms"] = dense_step_ms
                # Measured as deployed: pruning masks baked into the weights, no per-call mask multiply.
                row.update(measure(study, v, compress.make_permanent(model)))
                row["status"] = "ok"
            except Exception as e:  # one broken conversion must not end the study: the row says what happened
                traceback.print_exc()
                row["status"] = f"failed: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            row["seconds"] = study.row_s[v.model, v.family, v.fine_tune] = time.perf_counter() - t0
            result["rows"].append(row)
            save(f"{label}: {_summary(row)}", draw=len(result["rows"]) % 10 == 0)  # a plot costs ~1 s
        stop.done()  # measured: the last save completes
        result["complete"] = True
        save("done", draw=True)
    return result


def row_key(row: dict) -> tuple:
    return row["model"], row["family"], row["variant"], row["fine_tune_steps"]


def continued_rows(args, result: dict, dense_info: dict) -> dict:
    """The measured rows of the report this call continues, by row_key (empty without --continue-from); the
    report says where they came from."""
    prev = getattr(args, "previous", None)
    if prev is None:
        return {}
    if prev["dense"]["step"] != dense_info["step"] or prev["device"] != result["device"]:
        raise ValueError(f"--continue-from {args.continue_from}: its rows were measured at step "
                         f"{prev['dense']['step']} on {prev['device']}, this call studies step {dense_info['step']} "
                         f"on {result['device']}; start a new report instead")
    kept = {row_key(r): r for r in prev["rows"] if r["status"] == "ok"}
    # The dense model's own record (trained by the first call: its training time, stats) stays the report's.
    result["dense"] = {**prev["dense"], "config": result["dense"]["config"]}
    result["continued_from"] = {"path": str(args.continue_from), "command": prev["command"],
                                "date_utc": prev["environment"].get("date_utc"), "elapsed_s": prev.get("elapsed_s"),
                                "rows_kept": len(kept)}
    result["notes"].append(f"{len(kept)} rows measured by an earlier call on the same card "
                           f"({prev['environment'].get('date_utc')}: `{prev['command']}`), kept as measured; the "
                           "other rows by this call")
    return kept


def _summary(row: dict) -> str:
    if row["status"] != "ok":
        return row["status"]
    quality = f", FD-digits {row['fd_digits']:.2f}" if "fd_digits" in row else ""
    return f"{row['latency_ms']:.1f} ms, {row['size_mb']:.2f} MB{quality}"


def main(argv: list[str] | None = None) -> int:
    from benchmarks.quality.study import run_study

    t_start = time.perf_counter()
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)

    def body(stop) -> None:
        result = run(args, argv, t_start, stop)
        for model_rows in by_model(result["rows"]).values():
            for line in findings(model_rows):
                print(f"compress: {line}")

    return run_study("compress", body)


if __name__ == "__main__":
    sys.exit(main())
