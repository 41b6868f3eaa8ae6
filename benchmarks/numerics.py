"""`make numerics`: does mixed precision change training? bf16's loss curve against an fp32 reference.

    python -m benchmarks.numerics --data data                   # ddpm-cifar10, batch 128, 2000 steps, bf16 vs fp32
    python -m benchmarks.numerics --data data --precision fp16  # fp16 + GradScaler instead
    python -m benchmarks.numerics --data data --preset tiny --steps 40 --log-every 5 --batch 16 train.device=cpu

Two runs of the trainer (ffcv_ddpm.train.train, everything else as configured) on the same data with the same seed:
the reference in true fp32 (TF32 off) and the candidate precision. The same seed gives both runs the same batches,
timesteps and noise step for step, so the curves are paired: the per-interval ratio of their mean losses is numerics
(and the slow drift of two models that no longer share weights), not sampling noise. The check: after the first
--skip share of the steps, the moving average over --smooth intervals of (candidate / reference - 1) stays within
+-tol. Exit status 1 when it does not.

Writes numerics-<precision>.json (both curves from the runs' stats.jsonl, the check, environment, config), .md and
.png under benchmarks/results/<card>/ (or --out).
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import numpy as np

from benchmarks.bench import BETON, BenchError, ensure_dataset
from benchmarks.peaks import card_slug
from ffcv_ddpm.checks import Parser, at_least, in_range, option
from ffcv_ddpm.config import RunConfig, load_config
from ffcv_ddpm.data import dataset_info
from ffcv_ddpm.env import environment
from ffcv_ddpm.train import TrainingError, resolve_device, train

REPO = Path(__file__).resolve().parent.parent


def run_curve(cfg, precision: str, tmp: Path) -> list[dict]:
    """One training run at `precision`; its stats.jsonl lines."""
    cfg = RunConfig.from_dict(cfg.to_dict())  # a copy per run
    cfg.train.precision = precision
    cfg.train.out_dir = str(tmp / precision)
    cfg.train.desc = precision
    run_dir = train(cfg)
    return [json.loads(line) for line in (run_dir / "stats.jsonl").read_text().splitlines()]


def check(reference: list[dict], candidate: list[dict], tol: float, skip: float, smooth: int) -> dict:
    """Paired comparison of two loss curves logged at the same steps."""
    steps = [s["step"] for s in reference]
    if steps != [s["step"] for s in candidate]:
        raise ValueError("the two runs logged different steps; give both the same train.log_every and steps")
    ratio = np.array([c["loss"] / r["loss"] - 1 for r, c in zip(reference, candidate)])
    w = max(1, min(smooth, len(ratio)))
    smoothed = np.convolve(ratio, np.ones(w) / w, mode="valid")  # smoothed[i] averages intervals i .. i+w-1
    first = next((i for i, s in enumerate(steps) if s > skip * steps[-1]), len(steps) - 1)
    start = min(first, len(smoothed) - 1)  # the first moving average that starts at or after `first`
    checked = smoothed[start:]
    worst = int(np.argmax(np.abs(checked)))
    tail = max(1, len(ratio) // 10)
    return {
        "tol": tol, "skip": skip, "smooth_intervals": w, "checked_from_step": steps[first],
        "ratio_minus_1": ratio.tolist(), "smoothed": smoothed.tolist(),
        "max_abs_smoothed": float(np.abs(checked).max()),
        "at_step": steps[start + worst + w - 1],
        "mean_ratio_minus_1": float(ratio[first:].mean()) if first < len(ratio) else float(ratio[-1]),
        "last_10pct_loss": {"reference": float(np.mean([r["loss"] for r in reference[-tail:]])),
                            "candidate": float(np.mean([c["loss"] for c in candidate[-tail:]]))},
        "ok": bool(np.abs(checked).max() <= tol),
    }


def render(result: dict, out: Path) -> None:
    c, ref, cand = result["check"], result["reference"], result["candidate"]
    env = result["environment"]
    verdict = "within" if c["ok"] else "OUTSIDE"
    lines = [f"# Numerics: {result['preset']}, {cand['precision']} vs {ref['precision']} "
             f"on {result['device']}", "",
             f"- commit {env.get('commit')}, torch {env.get('torch')}, {env.get('date_utc')}; "
             f"command: `{result['command']}`",
             f"- data: {result['dataset']}; batch {result['batch_size']}, {result['steps']} steps, "
             f"loss logged every {result['log_every']} steps (mean over the interval), seed {result['seed']}",
             f"- reference: {ref['precision']} (TF32 off); candidate: {cand['precision']}", "",
             f"**{verdict} tolerance**: the moving average over {c['smooth_intervals']} intervals of "
             f"(candidate / reference - 1) reaches at most {c['max_abs_smoothed']:.2%} in magnitude (at step "
             f"{c['at_step']}) from step {c['checked_from_step']} on; tolerance +-{c['tol']:.1%}. Mean ratio - 1 "
             f"over those steps: {c['mean_ratio_minus_1']:+.2%}. Mean loss over the last 10% of intervals: "
             f"{c['last_10pct_loss']['reference']:.5f} ({ref['precision']}), "
             f"{c['last_10pct_loss']['candidate']:.5f} ({cand['precision']}).", ""]
    out.with_suffix(".md").write_text("\n".join(lines))

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    steps = [s["step"] for s in ref["stats"]]
    fig, (ax, bx) = plt.subplots(2, 1, figsize=(7, 6), sharex=True, gridspec_kw={"height_ratios": [2, 1]})
    for run in (ref, cand):
        ax.plot(steps, [s["loss"] for s in run["stats"]], label=run["precision"], lw=1)
    ax.set_yscale("log")
    ax.set_ylabel("training loss (interval mean)")
    ax.legend()
    ax.set_title(f"{result['preset']}: {cand['precision']} vs {ref['precision']}, batch {result['batch_size']}")
    bx.plot(steps, 100 * np.array(c["ratio_minus_1"]), lw=0.6, color="0.6", label="per interval")
    w = c["smooth_intervals"]
    bx.plot(steps[w - 1:], 100 * np.array(c["smoothed"]), lw=1.2, label=f"moving average ({w})")
    for sign in (1, -1):
        bx.axhline(sign * 100 * c["tol"], color="r", ls=":", lw=1)
    bx.axvline(c["checked_from_step"], color="k", ls=":", lw=0.8)
    bx.set_ylabel(f"{cand['precision']} / {ref['precision']} - 1 (%)")
    bx.set_xlabel("step")
    bx.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out.with_suffix(".png"), dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = Parser(prog="python -m benchmarks.numerics", description=__doc__.split("\n\n")[0])
    p.add_argument("--data", type=Path, default=Path("data"), help="dataset folder (`make dataset`)")
    p.add_argument("--preset", default="ddpm-cifar10")
    p.add_argument("--precision", choices=("bf16", "fp16"), default="bf16", help="the candidate precision")
    p.add_argument("--batch", type=option(int, at_least(1)), default=128, help="images per step (both runs)")
    p.add_argument("--steps", type=option(int, at_least(1)), default=2000, help="training steps per run")
    p.add_argument("--log-every", type=option(int, at_least(1)), default=20,
                   help="steps per logged loss (its mean over the interval)")
    p.add_argument("--tol", type=option(float, at_least(0)), default=0.05,
                   help="allowed |smoothed candidate / reference - 1|")
    p.add_argument("--skip", type=option(float, in_range(0, 1, high_open=True)), default=0.05,
                   help="share of the steps before the check starts")
    p.add_argument("--smooth", type=option(int, at_least(1)), default=5, help="intervals in the moving average")
    p.add_argument("--out", type=Path, help="results folder (default benchmarks/results/<card>)")
    p.add_argument("overrides", nargs="*", help="trainer overrides for both runs, e.g. model.norm_impl=scale-shift")
    args = p.parse_args(argv)
    try:
        if args.steps < 2 * args.log_every:
            raise ValueError(f"--steps {args.steps} gives fewer than two logged intervals of {args.log_every}")
        cfg = load_config(args.preset, [f"data.batch_size={args.batch}", f"train.steps={args.steps}",
                                        f"train.log_every={args.log_every}", f"train.ckpt_every={args.steps}",
                                        "train.sample_every=0", "train.progress=False", *args.overrides])
        beton = args.data / BETON  # built only once the config is known to be good
        built = ensure_dataset(args.data, beton, num_synthetic=50_000)
        cfg.data.path = str(beton)
        device = resolve_device(cfg.train.device)
        import torch

        name = torch.cuda.get_device_name(device) if device.type == "cuda" else None
        with tempfile.TemporaryDirectory() as tmp:  # the runs' checkpoints are not kept, their curves are
            curves = {prec: run_curve(cfg, prec, Path(tmp)) for prec in ("fp32", args.precision)}
        synthetic = built or bool(dataset_info(beton)["synthetic"])
        result = {
            "preset": args.preset, "device": name or "CPU", "batch_size": args.batch, "steps": args.steps,
            "log_every": args.log_every, "seed": cfg.train.seed, "command": "python -m benchmarks.numerics "
            + " ".join(argv), "environment": environment(), "config": cfg.to_dict(),
            "dataset": f"{beton}" + (" (SYNTHETIC)" if synthetic else ""),
            "reference": {"precision": "fp32", "stats": curves["fp32"]},
            "candidate": {"precision": args.precision, "stats": curves[args.precision]},
            "check": check(curves["fp32"], curves[args.precision], args.tol, args.skip, args.smooth),
        }
    except (BenchError, TrainingError, ValueError, FileNotFoundError) as e:
        print(f"numerics: error: {e}", file=sys.stderr)
        return 2
    out = (args.out or REPO / "benchmarks" / "results" / card_slug(name)) / f"numerics-{args.precision}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1, default=str) + "\n")
    render(result, out)
    c = result["check"]
    print(f"numerics: {args.precision} vs fp32: max |smoothed ratio - 1| {c['max_abs_smoothed']:.2%} "
          f"(tolerance {args.tol:.1%}) -> {'ok' if c['ok'] else 'OUTSIDE TOLERANCE'}; wrote {out}, "
          f"{out.with_suffix('.md').name}, {out.with_suffix('.png').name}")
    return 0 if c["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
