"""`make compress`: how small and how fast can the model get before its samples degrade? Pruning, grouped and
depthwise-separable convolutions and int8 side by side: size, speed and quality in one table.

    python -m benchmarks.compress --out benchmarks/results/h100/compress      # trains the dense digits model first
    python -m benchmarks.compress runs/00007-digits-quality --out DIR         # or studies a trained run folder
    python -m benchmarks.compress --data /tmp/d --out /tmp/c --preset tiny --steps 4 ...   # CPU toy (tests)

In this order (the report is rewritten after every row; a row whose estimated time would end past --budget-s is
recorded as skipped, with the estimate; a row that fails is recorded with its error and the study goes on):
1. the dense model: RUN_DIR's newest checkpoint (EMA weights), or the `digits` preset trained here for --steps steps
   (`make dataset SOURCE=digits` first if --data has none); the judge (ffcv_ddpm.quality): --judge, RUN_DIR's
   train.eval_judge, or trained here when the data is the digits; without one, speed and size only;
2. references: the baseline (fp32 weights, bf16 autocast: how every other row samples), fp32 (TF32 off), bf16 and
   fp16 weights;
3. int8 (torchao, ffcv_ddpm.compress): weight-only, dynamic (weights and activations), dynamic on Linear layers only;
4. unstructured pruning as pruned: L1 and random x global and local x --ratios;
5. structured pruning as pruned: --ratios of every residual block's inner channels (whole GroupNorm groups);
6. res-block 3x3 convs grouped (conv_groups = 2, 4) and depthwise-separable, trained from scratch for the dense run's
   steps (--scratch-steps) with its settings;
7. --speed-preset (ddpm-cifar10): the same conversions of that preset with random weights, speed and size only;
8. every structured and unstructured row again after --ft-steps fine-tuning steps (masks kept; EMA of the steps).

Per row: parameters, non-zero parameters, weight sparsity (of the compressed layers), forward GFLOP per image,
checkpoint MB (what torch.save writes for the state_dict; unstructured rows also as CSR), sampling latency: one
DDIM --ddim-steps call at --sample-batch images timed with CUDA events, the median of --reps - 1 calls after a first
(warm-up) call, and images/s from it; the training step time (ms, median) where it trains; FD-digits to the test
set and conditional accuracy of all --reps x --sample-batch samples (the guidance weight --guidance).

What the numbers mean: a zero in a dense tensor is still multiplied, so unstructured sparsity leaves latency
where it was (the rows show it) and the checkpoint size too unless stored sparse; structured pruning and grouped
convolutions cut FLOPs, which becomes latency only where kernels are not bound by launches or memory; int8 here
saves storage but cannot save GPU time: PyTorch has no int8 convolution for CUDA, so each layer dequantizes its
weights and runs the float convolution (the rows show what that costs). Everything is eager PyTorch (no torch.compile: a compilation per variant would cost more than the study),
channels_last, cuDNN benchmark mode; training steps are the trainer's (ffcv_ddpm.step.make_step).

Time on one H100/H200, estimated from FLOP counts and eager overheads, not yet measured: about 6.5 minutes, within
the default --budget-s 420 for starting rows (the GPU machine's 10-minute call leaves room for the last row): start-up
and data ~20 s, dense 1,500 steps ~35 s, judge ~15 s, 7 reference/int8 rows ~20 s, 20 pruned rows ~1.5 s each (3 x
DDIM 50 at batch 256, 3.2 GFLOP per image forward), three models from scratch ~40 s each, 18 ddpm-cifar10 rows ~80 s
(its fp32 row alone ~12 s), 20 fine-tunings of 100 steps ~3.5 s each. The int8 rows need torchao
(requirements.txt: 0.18.0, `pip install --no-deps`); without it they are recorded as failed, saying so.
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

from benchmarks.compress_report import write_report
from ffcv_ddpm.checks import Parser, above, at_least, fail, in_range, matches, one_of, option
from ffcv_ddpm.timing import timed_call

REPO = Path(__file__).resolve().parent.parent
WARMUP_STEPS = 10  # training steps left out of a step-time median (cuDNN's algorithm search, the allocator)


def parse_args(argv: list[str]) -> argparse.Namespace:
    from benchmarks.quality import TRAIN_DEFAULTS
    from ffcv_ddpm.config import load_config
    from ffcv_ddpm.unet import PRESETS

    count = option(int, at_least(1))
    p = Parser(prog="python -m benchmarks.compress", doc=__doc__, overrides=True,
               epilog="Without RUN_DIR the overrides go to the dense model's training after the digits quality "
                      f"run's settings ({' '.join(TRAIN_DEFAULTS)}); with RUN_DIR they change the run's config for "
                      "the study (e.g. train.device=cpu).")
    p.add_argument("run_dir", nargs="?", type=Path, metavar="RUN_DIR",
                   help="a run folder to study (default: train the digits model here)")
    p.add_argument("--data", type=Path, default=Path("data/digits"), help="digits data folder (without RUN_DIR)")
    p.add_argument("--out", type=Path, help="report folder (default benchmarks/results/<card>/compress)")
    p.add_argument("--work", type=Path, default=Path("runs"), help="where trained runs and the judge go")
    p.add_argument("--judge", type=Path, help="a saved digits judge (default: the run's, or trained here)")
    p.add_argument("--preset", default="digits", type=option(str, one_of(lambda: tuple(PRESETS))),
                   help="model preset trained without RUN_DIR")
    p.add_argument("--steps", type=count, default=1500, help="dense training steps, train.steps (without RUN_DIR)")
    p.add_argument("--judge-steps", type=count, default=2000, help="judge training steps (when trained here)")
    p.add_argument("--scratch-steps", type=count, help="steps of the grouped/separable models (default: the dense run's)")
    p.add_argument("--ratios", type=_ratios, default=[0.3, 0.5, 0.7, 0.9],
                   help="pruning ratios (the share removed), comma-separated (default 0.3,0.5,0.7,0.9)")
    p.add_argument("--ft-steps", type=option(int, at_least(0)), default=100,
                   help="fine-tuning steps after pruning (0: no fine-tuned rows)")
    p.add_argument("--ft-lr", type=option(float, above(0)), default=1e-4, help="fine-tuning learning rate (constant)")
    p.add_argument("--ft-ema", type=option(float, in_range(0, 1, high_open=True)), default=0.99,
                   help="EMA decay over the fine-tuning steps")
    p.add_argument("--time-steps", type=count, default=30,
                   help="steps that time the training step of the dense and from-scratch models")
    p.add_argument("--ddim-steps", type=count, default=50, help="DDIM steps of every sampling call")
    p.add_argument("--sample-batch", type=count, default=256, help="images per sampling call")
    p.add_argument("--reps", type=count, default=3, help="sampling calls per row (the first is not timed)")
    p.add_argument("--guidance", type=option(float, at_least(0)), default=0.0,
                   help="guidance weight w (0: one forward per step)")
    p.add_argument("--speed-preset", default="ddpm-cifar10", type=option(str, matches(
                   f"a preset ({', '.join(PRESETS)}) or '' (none)", lambda v: v in ("", *PRESETS))),
                   help="preset for speed/size-only rows ('' = none)")
    p.add_argument("--budget-s", type=option(float, at_least(0)), default=420,
                   help="no row starts that would end after this (s)")
    p.add_argument("--seed", type=option(int, at_least(0)), default=0)
    args, args.overrides = p.parse_with_overrides(argv)
    if args.run_dir is not None and "=" in str(args.run_dir):  # an override where RUN_DIR would be
        args.overrides.insert(0, str(args.run_dir))
        args.run_dir = None
    try:  # a bad override is one line before anything is read, trained or written
        load_config(args.preset, [*TRAIN_DEFAULTS, "train.sample_every=0", f"train.sample_steps={args.ddim_steps}",
                                  *args.overrides])
    except ValueError as e:
        p.error(str(e))
    return args


def _ratios(text: str) -> list[float]:
    try:
        ratios = [float(t) for t in text.split(",")]
    except ValueError:
        ratios = []
    if not ratios or not all(0 < r < 1 for r in ratios):
        raise argparse.ArgumentTypeError(f"invalid value {text!r}: expected comma-separated numbers in (0, 1)")
    return ratios


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
    train_step_s: float = 0.0  # the dense model's training step (the unit of the time estimates)
    gflops: dict = field(default_factory=dict)  # parameter shapes -> forward GFLOP/img (counting costs ~1 s)


def sample_calls(study: Study, model: nn.Module, precision: str, shape) -> tuple:
    """--reps DDIM calls of --sample-batch images (seeds seed, seed+1, ...): (uint8 samples, labels, ms per call)."""
    from ffcv_ddpm.evaluate import class_labels, generate
    from ffcv_ddpm.step import set_precision

    a = study.args
    set_precision("fp32" if precision == "fp32" else "bf16", study.device)  # TF32 off only for the fp32 row
    amp = {"baseline": study.amp_dtype, "fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    labels = class_labels(a.sample_batch, shape.num_classes, study.device)
    samples, ms = [], []
    try:
        for i in range(a.reps):
            out, t = timed_call(lambda: generate(model, study.diffusion, a.sample_batch, labels=labels, steps=a.ddim_steps,
                                            guidance=a.guidance if labels is not None else 0.0, batch=a.sample_batch,
                                            seed=a.seed + i, amp_dtype=amp,
                                            shape=(shape.in_channels, shape.image_size, shape.image_size),
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
    scratch = v.extra.get("scratch_steps")
    steps = (study.args.ft_steps if v.fine_tune else 0) + (scratch + study.args.time_steps if scratch else 0)
    return max(sampling + steps * study.train_step_s, study.row_s.get((v.model, v.family, v.fine_tune), 0.0))


# ---------------------------------------------------------------------------------------------------- the study

ARCHITECTURES = [("grouped convs (2 groups)", {"conv_groups": 2}), ("grouped convs (4 groups)", {"conv_groups": 4}),
                 ("depthwise-separable convs", {"depthwise_separable": True})]


def variants(study: Study) -> list[Variant]:
    """Every row in priority order (see the module docstring)."""
    from ffcv_ddpm import compress
    from ffcv_ddpm.unet import PRESETS

    a, dense, studied = study.args, study.dense, study.cfg.preset
    pct = lambda r: f"{r:.0%}"  # noqa: E731

    def conversions(name: str, model: nn.Module, shape, quality: bool) -> list[Variant]:
        """The references and the int8 rows of one network."""
        def to(dtype):
            return lambda: copy.deepcopy(model).to(dtype)

        def int8(mode):
            return lambda: compress.quantize_int8(copy.deepcopy(model), mode)

        same = dict(shape=shape, quality=quality)
        return [Variant(name, "reference", "dense (baseline)", lambda: model, **same),
                Variant(name, "reference", "fp32 (TF32 off)", lambda: model, precision="fp32", **same),
                Variant(name, "reference", "bf16 weights", to(torch.bfloat16), precision="bf16", **same),
                Variant(name, "reference", "fp16 weights", to(torch.float16), precision="fp16", **same),
                *[Variant(name, "int8", f"int8 {mode}", int8(mode), source=model, extra={"mode": mode}, **same)
                  for mode in compress.QUANT_MODES]]

    def unstructured(name, model, method, scope, ratio, shape, quality=True, fine_tune=False) -> Variant:
        label = f"{'L1' if method == 'l1' else method} {scope} {pct(ratio)}"
        return Variant(name, "unstructured", label, lambda: compress.prune_unstructured(
            copy.deepcopy(model), ratio, method=method, scope=scope, seed=a.seed), shape=shape, quality=quality,
            fine_tune=fine_tune, extra={"method": method, "scope": scope, "ratio": ratio})

    def structured(name, model, ratio, shape, quality=True, fine_tune=False) -> Variant:
        return Variant(name, "structured", f"channels {pct(ratio)}", lambda: compress.prune_structured(model, ratio),
                       shape=shape, quality=quality, fine_tune=fine_tune, extra={"ratio": ratio})

    shape, ratios = study.cfg.model, a.ratios
    prunings = [(m, s, r) for m in compress.PRUNE_METHODS for s in compress.PRUNE_SCOPES for r in ratios]
    rows = conversions(studied, dense, shape, True)
    rows += [unstructured(studied, dense, m, s, r, shape) for m, s, r in prunings]
    rows += [structured(studied, dense, r, shape) for r in ratios]
    steps = a.scratch_steps or study.cfg.train.steps
    rows += [Variant(studied, "architecture", name, lambda o=o: train_scratch(study, o, steps),
                     shape=dataclasses.replace(shape, **o), extra={"override": o, "scratch_steps": steps})
             for name, o in ARCHITECTURES]
    if a.speed_preset:
        speed = f"{a.speed_preset} (random weights)"
        scfg = PRESETS[a.speed_preset]
        net = random_model(study, scfg)
        rows += conversions(speed, net, scfg, False)
        # One unstructured method per ratio: which weights are zero changes neither shapes nor kernels.
        rows += [unstructured(speed, net, "l1", "global", r, scfg, quality=False) for r in ratios]
        rows += [structured(speed, net, r, scfg, quality=False) for r in ratios]
        rows += [Variant(speed, "architecture", name, lambda o=o: random_model(study, dataclasses.replace(scfg, **o)),
                         shape=dataclasses.replace(scfg, **o), quality=False, extra={"override": o})
                 for name, o in ARCHITECTURES]
    if a.ft_steps:  # fine-tuned last: the most rows, each the cheapest to lose
        rows += [structured(studied, dense, r, shape, fine_tune=True) for r in ratios]
        rows += [unstructured(studied, dense, m, s, r, shape, fine_tune=True) for m, s, r in prunings]
    return rows


def random_model(study: Study, cfg) -> nn.Module:
    from ffcv_ddpm.unet import build_model

    torch.manual_seed(study.args.seed)
    return build_model(cfg).to(study.device, memory_format=torch.channels_last).eval()


def train_scratch(study: Study, override: dict, steps: int) -> nn.Module:
    """The dense run's training (config, data, seed) with other res-block convs, from scratch, for `steps` steps."""
    from ffcv_ddpm.evaluate import load_run
    from ffcv_ddpm.train import train

    cfg = copy.deepcopy(study.cfg)
    cfg.model = dataclasses.replace(cfg.model, **override)
    cfg.train.steps, cfg.train.ckpt_every, cfg.train.log_every = steps, steps, min(100, steps)
    cfg.train.resume, cfg.train.eval_every, cfg.train.sample_every = "", 0, 0
    cfg.train.compile, cfg.train.cudnn_benchmark, cfg.train.progress = False, True, False
    cfg.train.out_dir = str(study.args.work)
    cfg.train.desc = "compress-" + "-".join(f"{k}{v}" for k, v in override.items())
    run_dir = train(cfg)
    return load_run(run_dir, study.device, ema=True)[1]


def dense_run(args) -> tuple:
    """(run config, EMA model, diffusion, run info) of RUN_DIR, or of the digits model trained here."""
    from benchmarks.quality import ensure_digits, train_config
    from ffcv_ddpm.config import apply_override
    from ffcv_ddpm.evaluate import load_run
    from ffcv_ddpm.step import resolve_device
    from ffcv_ddpm.train import train

    if args.run_dir is not None:
        cfg, model, diffusion, step = load_run(args.run_dir, "cpu")
        for item in args.overrides:  # e.g. train.device=cpu, and the settings of the from-scratch runs
            apply_override(cfg, item)
        device = resolve_device(cfg.train.device)
        return cfg, model.to(device), diffusion.to(device), {"run_dir": str(args.run_dir), "step": step,
                                                             "trained_here": False}
    built = ensure_digits(args.data)
    # The digits quality run's settings, eager, evaluating nothing while it trains (the judge is the study's).
    eager = ["train.eval_every=0", "train.compile=False", "train.cudnn_benchmark=True", "train.desc=compress-dense"]
    ns = SimpleNamespace(preset=args.preset, seed=args.seed, steps=args.steps, n_per_class=1,
                         ddim_steps=[args.ddim_steps], work=args.work, overrides=[*eager, *args.overrides])
    args.work.mkdir(parents=True, exist_ok=True)
    cfg = train_config(ns, args.data / "digits_train_raw.beton", args.data / "digits_test_raw.beton", "")
    t0 = time.perf_counter()
    run_dir = train(cfg)
    seconds = time.perf_counter() - t0
    device = resolve_device(cfg.train.device)
    _, model, diffusion, step = load_run(run_dir, device)
    stats = [json.loads(line) for line in (run_dir / "stats.jsonl").read_text().splitlines()]
    return cfg, model, diffusion, {"run_dir": str(run_dir), "step": step, "trained_here": True,
                                   "dataset_built_now": built, "seconds": seconds, "stats": stats}


def load_or_train_judge(args, cfg, device) -> tuple:
    """(judge, test images, info) or (None, None, reason) when this run's data has no digits judge."""
    from ffcv_ddpm import quality

    train_beton = Path(cfg.data.path)
    test_beton = Path(cfg.train.eval_ref) if cfg.train.eval_ref else train_beton.with_name("digits_test_raw.beton")
    path = args.judge or (Path(cfg.train.eval_judge) if cfg.train.eval_judge else None)
    if path is not None and path.is_file() and test_beton.is_file():
        judge = quality.load_judge(path, device)
        info = {"path": str(path), "trained_here": False}
    elif train_beton.name.startswith("digits_") and test_beton.is_file():
        t0 = time.perf_counter()
        judge = quality.train_judge(train_beton, device, steps=args.judge_steps, seed=args.seed)
        path = args.work / "compress-judge.pt"
        quality.save_judge(judge, path)
        info = {"path": str(path), "trained_here": True, "seconds": time.perf_counter() - t0, **judge.info}
    else:
        return None, None, {"none": f"no digits judge for {train_beton} (give --judge and a digits run): "
                                    "speed and size only"}
    test_x, test_y = quality.beton_tensors(test_beton, device)
    info.update(test_beton=str(test_beton), test_accuracy=quality.accuracy(judge, test_x, test_y))
    return judge, test_x, info


def run(args, argv: list[str], t_start: float) -> dict:
    from benchmarks.peaks import card_slug
    from ffcv_ddpm import compress, quality
    from ffcv_ddpm.env import environment
    from ffcv_ddpm.step import AMP_DTYPES

    cfg, dense, diffusion, dense_info = dense_run(args)
    device = next(dense.parameters()).device
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = True  # every row: each conv shape's fastest algorithm (warm-up call pays)
    card = torch.cuda.get_device_name(device) if device.type == "cuda" else None
    out = args.out or REPO / "benchmarks" / "results" / card_slug(card) / "compress"
    try:
        torchao_version = compress.import_torchao().__version__
    except ImportError:
        torchao_version = None
    study = Study(args, device, cfg, dense, diffusion, AMP_DTYPES[cfg.train.precision] if device.type == "cuda"
                  else None)
    result = {"command": "python -m benchmarks.compress " + " ".join(argv), "device": card or "CPU",
              "environment": {**environment(), "torchao": torchao_version}, "budget_s": args.budget_s,
              "complete": False, "model": cfg.preset, "dense": {**dense_info, "config": cfg.to_dict()},
              "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
              "rows": []}

    def save(message: str, draw: bool = False) -> None:
        result["elapsed_s"] = time.perf_counter() - t_start
        write_report(result, out, draw)
        print(f"compress: [{result['elapsed_s']:.0f} s] {message}", flush=True)

    study.judge, study.test_x, result["judge"] = load_or_train_judge(args, cfg, device)
    study.data = train_x, train_y = quality.beton_tensors(cfg.data.path, device)
    if study.judge is not None:
        n = args.reps * args.sample_batch
        subset = torch.from_numpy(quality.class_balanced_subset(train_y, min(n, len(train_y)), args.seed))
        result["floor"] = {"n": len(subset), "fd_digits": quality.evaluate_samples(
            study.judge, train_x[subset.to(device)], None, study.test_x)["fd_digits"]}
    # The dense model's training step, timed like every fine-tuning (eager, this study's loop): the estimates' unit.
    _, iter_ms = fine_tune(copy.deepcopy(dense), cfg, diffusion, study.data, args.time_steps, args.ft_lr, args.ft_ema,
                           args.seed)
    dense_step_ms = step_ms(iter_ms)
    study.train_step_s = dense_step_ms / 1e3
    judged = f"judge test accuracy {result['judge']['test_accuracy']:.1%}" if study.judge else "no judge"
    save(f"dense model {dense_info['run_dir']} ready, {dense_step_ms:.1f} ms per training step; {judged}")

    for v in variants(study):
        label = f"{v.model} / {v.name}{' (fine-tuned)' if v.fine_tune else ''}"
        row = {"model": v.model, "family": v.family, "variant": v.name, "precision": v.precision,
               "fine_tune_steps": args.ft_steps if v.fine_tune else 0, **v.extra}
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
                ema, iter_ms = fine_tune(model, cfg, diffusion, study.data, args.ft_steps, args.ft_lr, args.ft_ema,
                                         args.seed)
                model = compress.make_permanent(ema)
                row["train_step_ms"] = step_ms(iter_ms)
            elif "scratch_steps" in v.extra:  # trained from scratch: its step timed like the dense model's
                row["train_step_ms"] = step_ms(fine_tune(copy.deepcopy(model), cfg, diffusion, study.data,
                                                         args.time_steps, args.ft_lr, args.ft_ema, args.seed)[1])
            elif v.model == cfg.preset and v.name == "dense (baseline)":
                row["train_step_ms"] = dense_step_ms
            # Measured as deployed: pruning masks baked into the weights, no per-call mask multiply.
            row.update(measure(study, v, compress.make_permanent(model)))
            row["status"] = "ok"
        except Exception as e:  # one broken conversion must not end the study: the row says what happened
            traceback.print_exc()
            row["status"] = f"failed: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        row["seconds"] = study.row_s[v.model, v.family, v.fine_tune] = time.perf_counter() - t0
        result["rows"].append(row)
        save(f"{label}: {_summary(row)}", draw=len(result["rows"]) % 10 == 0)  # a plot costs ~1 s: not every row
    result["complete"] = True
    save("done", draw=True)
    return result


def _summary(row: dict) -> str:
    if row["status"] != "ok":
        return row["status"]
    quality = f", FD-digits {row['fd_digits']:.2f}" if "fd_digits" in row else ""
    return f"{row['latency_ms']:.1f} ms, {row['size_mb']:.2f} MB{quality}"


def main(argv: list[str] | None = None) -> int:
    t_start = time.perf_counter()
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    from ffcv_ddpm.step import TrainingError

    try:
        run(args, argv, t_start)
    except (TrainingError, ValueError, FileNotFoundError) as e:
        return fail("compress", str(e))
    return 0


if __name__ == "__main__":
    sys.exit(main())
