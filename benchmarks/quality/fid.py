"""`make fid`: FID of a trained run's samples (or of an image set) against a dataset, with pytorch-fid's Inception.

    python -m benchmarks.quality.fid --data data/cifar10_train_raw.beton --run runs/00000-ddpm-cifar10 --n 50000
    python -m benchmarks.quality.fid --data data/cifar10_train_raw.beton --run RUN --sampler ddpm --raw  # no EMA
    python -m benchmarks.quality.fid --data data/cifar10_train_raw.beton --run VE_RUN --sampler ode  # VE: em/pc/ode
    python -m benchmarks.quality.fid --data data/cifar10_train_raw.beton --run RUN train.precision=fp32  # in fp32
    python -m benchmarks.quality.fid --data data/cifar10_train_raw.beton --images data/cifar10_test_raw.beton
    make fid RUN=runs/00000-ddpm-cifar10 ARGS="--n 10000"

Weights: pt_inception-2015-12-05-6726825d.pth in the torch hub cache ($TORCH_HOME/hub/checkpoints/, where
pytorch-fid would download it) or --weights PATH; without it, one line says where to put it, and nothing is
downloaded. The reference statistics are cached beside the reference data (keyed by its pixels' hash), so only the
first run pays for them. Samples are generated and scored in batches on the GPU, with the run's own process (DDPM or
VE) and by default its sampler; every option is checked against the run before any statistics are computed.
SIGTERM/SIGINT stop it with one line (exit 128 + signal); the report is written only when the score exists.

Writes fid-<name>.json and .md under benchmarks/results/<card>/ (or --out). On synthetic reference data (the
manifest's flag) and with --random-inception (a randomly initialised network, for testing the path without the
weights file) the report says that the number measures nothing about image quality.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

from benchmarks.common import DEVICE_HELP, commit_text, results_out, write_json, write_text
from ffcv_ddpm import fid
from ffcv_ddpm.env import environment
from ffcv_ddpm.checks import Parser, at_least, one_of, option
from ffcv_ddpm.evaluate import check_sampler, class_labels, generate, load_run


def parse_args(argv: list[str]) -> argparse.Namespace:
    """Every option checked (and a bad KEY=VALUE refused) before anything is loaded."""
    from ffcv_ddpm.config import RULES, load_config
    from ffcv_ddpm.sde_sampling import DDPM_SAMPLERS, SDE_SAMPLERS

    count = option(int, at_least(1))
    p = Parser(prog="python -m benchmarks.quality.fid", doc=__doc__, overrides=True,
               epilog="The overrides change the run's config for sampling (e.g. train.precision=fp32, "
                      "model.attn_impl=math); fields that change the network's shape or process are refused.")
    p.add_argument("--data", type=Path, required=True,
                   help="the reference: one .beton file or a PNG folder (e.g. the train split)")
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--run", type=Path, help="run folder: sample from its newest checkpoint")
    what.add_argument("--images", type=Path, help="a .beton or PNG folder to score instead of samples")
    p.add_argument("--n", type=option(int, at_least(2)), default=10_000,
                   help="samples to generate (the published CIFAR-10 FIDs use 50,000)")
    p.add_argument("--sampler", type=option(str, one_of(DDPM_SAMPLERS + SDE_SAMPLERS)),
                   help="default: the run's process's (ddim for DDPM, pc for VE); ddpm = all T ancestral steps")
    p.add_argument("--sample-steps", type=count, default=100, help="sampler steps (as train.sample_steps)")
    p.add_argument("--guidance", type=option(float, at_least(0)), default=0.0,
                   help="classifier-free guidance weight w (conditional runs; 0: none)")
    p.add_argument("--raw", action="store_true", help="the raw weights instead of the EMA")
    p.add_argument("--sample-batch", type=count, default=500, help="images per sampling / Inception batch")
    p.add_argument("--max-ref", type=option(int, at_least(2)), help="use the first N reference images only")
    p.add_argument("--weights", type=Path, help=f"the Inception weights file (default: {fid.default_weights_path()})")
    p.add_argument("--random-inception", type=option(int, at_least(0)), metavar="SEED",
                   help="a randomly initialised Inception instead of the weights: tests the path, is NOT FID")
    p.add_argument("--device", default="auto", type=option(str, RULES["train.device"]), help=DEVICE_HELP)
    p.add_argument("--seed", type=option(int, at_least(0)), default=0, help="sampling seed")
    p.add_argument("--out", type=Path, help="results folder (default benchmarks/results/<card>)")
    args, args.overrides = p.parse_with_overrides(argv)
    if args.overrides and args.run is None:
        p.error("KEY=VALUE overrides change a run's config for sampling: they need --run")
    try:
        load_config("ddpm-cifar10", args.overrides)  # a bad KEY=VALUE is one line before anything is loaded
    except ValueError as e:
        p.error(str(e))
    p.check_paths(inputs=[("--data", args.data, "file or folder"), ("--run", args.run, "folder"),
                          ("--images", args.images, "file or folder"), ("--weights", args.weights, "file")],
                  outputs=[("--out", args.out)])
    return args


def sampling_plan(args: argparse.Namespace, device: torch.device):
    """(config, model, process, step, sampler, steps) of --run, every choice checked against the run (its process,
    its schedule) before the reference statistics are computed."""
    cfg, model, diffusion, step = load_run(args.run, device, ema=not args.raw, overrides=args.overrides)
    sampler = check_sampler(diffusion, args.sampler)
    if sampler == "ddpm":
        steps = diffusion.num_timesteps
    elif sampler == "ddim" and args.sample_steps > diffusion.num_timesteps:
        raise ValueError(f"--sample-steps {args.sample_steps}: at most the run's diffusion.timesteps="
                         f"{diffusion.num_timesteps}")
    else:
        steps = args.sample_steps
    if sampler in ("em", "pc") and steps < 2:
        raise ValueError(f"--sample-steps {steps}: {sampler} needs at least 2")
    if args.guidance and not cfg.model.num_classes:
        raise ValueError(f"--guidance {args.guidance:g}: {args.run} is unconditional (model.num_classes=0)")
    return cfg, model, diffusion, step, sampler, steps


def score(args: argparse.Namespace, device: torch.device, stop) -> dict:
    from ffcv_ddpm.data import dataset_info

    t0 = time.perf_counter()
    plan = sampling_plan(args, device) if args.run is not None else None
    stop.doing("the reference statistics")
    inception = fid.load_inception(args.weights, device, random_init_seed=args.random_inception)
    tag = fid.network_tag(args.weights, args.random_inception)
    ref = fid.reference_stats(args.data, inception, tag, args.sample_batch, args.max_ref)
    t_ref = time.perf_counter()
    if plan is not None:
        from ffcv_ddpm.step import AMP_DTYPES

        cfg, model, diffusion, step, sampler, steps = plan
        stop.doing("sampling")
        labels = class_labels(args.n, cfg.model.num_classes, device)
        images = generate(model, diffusion, args.n, labels=labels, sampler=sampler, steps=steps,
                          guidance=args.guidance, batch=args.sample_batch, seed=args.seed,
                          amp_dtype=AMP_DTYPES[cfg.train.precision] if device.type == "cuda" else None,
                          shape=(cfg.model.in_channels, cfg.model.image_size, cfg.model.image_size),
                          memory_format=torch.channels_last)
        samples = {"run": str(args.run), "step": step, "weights": "raw" if args.raw else "EMA", "sampler": sampler,
                   "process": cfg.diffusion.process, "steps": "adaptive" if sampler == "ode" else steps,
                   "guidance": args.guidance if cfg.model.num_classes else None, "n": args.n, "seed": args.seed}
        name = f"{args.run.name}-{sampler}"
    else:
        images = torch.from_numpy(fid.read_images(args.images)).permute(0, 3, 1, 2)
        samples = {"images": str(args.images), "n": len(images)}
        name = args.images.stem if args.images.is_file() else args.images.name
    t_gen = time.perf_counter()
    stop.doing("the Inception features of the samples")
    value = fid.fid_of_images(inception, images, ref, args.sample_batch)
    ref_ds = dataset_info(args.data) if args.data.is_file() else {"path": str(args.data), "synthetic": None}
    notes = []
    if args.random_inception is not None:
        notes.append("randomly initialised Inception (--random-inception): this is NOT FID, it tests the code path")
    if ref_ds.get("synthetic"):
        notes.append("SYNTHETIC reference data: the number measures nothing about image quality")
    if samples["n"] < 10_000:
        notes.append(f"{samples['n']} samples: FID is biased upwards at small N (published CIFAR-10 FIDs use 50,000)")
    return {
        "name": name, "fid": value, "network": tag, "samples": samples,
        "reference": {"path": str(args.data), "n": ref["n"], "content_sha256": ref["content_sha256"],
                      "stats_cache": ref["cache"], "stats_were_cached": ref["cached"],
                      "synthetic": ref_ds.get("synthetic"), "source": ref_ds.get("source")},
        "seconds": {"reference": t_ref - t0, "samples": t_gen - t_ref, "fid": time.perf_counter() - t_gen},
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU",
        "notes": notes, "environment": environment(),
    }


def render(result: dict) -> str:
    s, r, env = result["samples"], result["reference"], result["environment"]
    what = (f"{s['n']} samples of {s['run']} (step {s['step']}, {s['weights']} weights, {s['sampler']} "
            f"{s['steps']} steps" + (f", guidance w={s['guidance']}" if s.get("guidance") is not None else "") + ")"
            if "run" in s else f"{s['n']} images of {s['images']}")
    lines = [f"# FID: {result['name']}", "",
             f"**FID {result['fid']:.3f}**: {what} against {r['n']} images of {r['path']}", "",
             f"- network: {result['network']}; device {result['device']}; commit {commit_text(env, 40)}, "
             f"torch {env.get('torch')}, {env.get('date_utc')}",
             f"- command: `{result['command']}`",
             f"- seconds: reference statistics {result['seconds']['reference']:.1f} "
             f"({'cached' if r['stats_were_cached'] else 'computed'}: {r['stats_cache']}), samples "
             f"{result['seconds']['samples']:.1f}, features + distance {result['seconds']['fid']:.1f}"]
    lines += [f"- **{n}**" for n in result["notes"]]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    from benchmarks.quality.study import run_study
    from ffcv_ddpm.step import resolve_device

    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)

    def body(stop) -> None:
        device = resolve_device(args.device)
        out = results_out(args.out, torch.cuda.get_device_name(device) if device.type == "cuda" else None)
        result = score(args, device, stop)
        stop.done()  # scored: the files are written whatever comes
        result["command"] = "python -m benchmarks.quality.fid " + " ".join(argv)
        out.mkdir(parents=True, exist_ok=True)
        json_path = out / f"fid-{result['name']}.json"
        write_json(json_path, result, indent=2)
        write_text(json_path.with_suffix(".md"), render(result))
        print(f"fid: {result['fid']:.3f} ({result['network']}); wrote {json_path} and "
              f"{json_path.with_suffix('.md').name}" + "".join(f"\nfid: NOTE: {n}" for n in result["notes"]))

    return run_study("fid", body)


if __name__ == "__main__":
    sys.exit(main())
