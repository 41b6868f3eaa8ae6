"""The peer side of benchmarks.quality.race: lucidrains' denoising-diffusion-pytorch Trainer on the digits.

    python -m benchmarks.quality.peer_ddpm --images DIR --test-beton data/digits/digits_test_raw.beton \
        --judge judge.pt --curve peer.jsonl --launched $(date +%s.%N) --seconds 240     # as the race runs it

denoising-diffusion-pytorch (and ema-pytorch) are not dependencies of this project: the race's GPU call installs
their wheels from the git-ignored .peer-wheels/ with --no-deps (its other requirements, accelerate, einops, scipy,
torchvision..., are on that machine); it is imported inside functions only, so this module imports without it.

What it runs, all the package's own code at its defaults but for what is listed:
- Unet(dim=--dim, dim_mults=--dim-mults): 24 and (1, 2, 4) give 1,520,275 parameters against our side's 1,625,731
  (both counts are printed and recorded); its default attention, dropout 0;
- GaussianDiffusion(image_size=32) at its defaults: 1,000 steps, the sigmoid schedule, v-prediction, and
  sampling_timesteps = timesteps, so its sample() is the ancestral sampler over all 1,000 steps (--sampling-steps N
  < 1000 makes it DDIM eta 0 over N, its other sampler);
- Trainer(train_batch_size=--batch, amp=True with mixed_precision_type=--precision (its default type fp16),
  augment_horizontal_flip=False (its default True: a mirrored digit is not a digit; our side does not flip either),
  calculate_fid=False): its lr 1e-4, Adam betas (0.9, 0.99), gradient clipping at 1, EMA 0.995 updated every 10
  steps, its DataLoader (PIL images, shuffled, num_workers = the CPU count).
- --loader persistent (the default) rebuilds that DataLoader with persistent_workers=True, nothing else changed: its
  Trainer cycles a DataLoader whose workers (one per core) are started again every epoch, and the digits' 1,438
  images are 6 batches of 256, so on the digits it spends most of its time starting workers (4 steps/s on an H200
  at 922d6ff, benchmarks/results/h200/race-922d6ff). On CIFAR-10 (196 batches an epoch) that cost is amortized;
  --loader its keeps the Trainer's own.
- --train-seed (the race passes its --seed, as it gives ours train.seed) seeds torch, numpy and random before the
  Unet is built; its Trainer seeds nothing, and unseeded its time to FD-digits 8 on an H200 was 145-194 s in one race
  and 289-383 s in another (benchmarks/results/h200/race-peer-8793aab).
The batch: --batch 256 by default (512 was slower to every threshold: benchmarks/results/h200/race-8793aab).

Its Trainer.train() has no hook between steps: train() below reproduces its loop's step as written in
denoising-diffusion-pytorch 2.3.4 (the forward under accelerator.autocast, loss.item() every step, backward, clip,
Adam step, EMA update), calling its objects, and leaves out what the loop does every save_and_sample_every steps (a
grid of samples, FID, a checkpoint), which the race replaces by its own evaluation, off the clock.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path



def import_peer():
    """The denoising_diffusion_pytorch module; ModuleNotFoundError (the race's one line) when it is not installed."""
    from ffcv_ddpm.fid import pytorch_fid_inception

    pytorch_fid_inception()  # imports torchvision, also beside a CPU-only torch (its stub there); the peer needs it
    try:
        import denoising_diffusion_pytorch
    except ModuleNotFoundError as e:
        raise ModuleNotFoundError(f"the peer needs denoising-diffusion-pytorch and ema-pytorch ({e}): install the "
                                  "wheels of .peer-wheels/ with --no-deps (benchmarks.quality.race)") from None
    return denoising_diffusion_pytorch


def build(args):
    """(trainer, unet parameter count) as the module docstring lists them."""
    peer = import_peer()
    unet = peer.Unet(dim=args.dim, dim_mults=tuple(args.dim_mults))
    params = sum(p.numel() for p in unet.parameters())
    diffusion = peer.GaussianDiffusion(unet, image_size=32,
                                       **({"sampling_timesteps": args.sampling_steps} if args.sampling_steps else {}))
    args.work.mkdir(parents=True, exist_ok=True)
    trainer = peer.Trainer(diffusion, str(args.images), train_batch_size=args.batch, amp=args.precision != "no",
                           mixed_precision_type=args.precision if args.precision != "no" else "fp16",
                           augment_horizontal_flip=False, calculate_fid=False, results_folder=str(args.work),
                           train_num_steps=10**9)
    if args.loader == "persistent":
        from multiprocessing import cpu_count

        from torch.utils.data import DataLoader

        dl = DataLoader(trainer.ds, batch_size=args.batch, shuffle=True, pin_memory=True, num_workers=cpu_count(),
                        persistent_workers=True)  # 2.3.4's Trainer.__init__ builds this, without the last argument
        trainer.dl = peer.denoising_diffusion_pytorch.cycle(trainer.accelerator.prepare(dl))
    return trainer, params, diffusion


def sample_u8(trainer, n: int, batch: int, seed: int):
    """n uint8 images (n, 3, 32, 32) from the EMA model's sample(), as its Trainer samples (inference mode, no
    autocast), seeded without touching the training's random state."""
    import torch

    model = trainer.ema.ema_model
    model.eval()
    device = trainer.device
    chunks = []
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), torch.inference_mode():
        torch.manual_seed(seed)
        for start in range(0, n, batch):
            x = model.sample(batch_size=min(batch, n - start))  # [0, 1] (its unnormalize)
            chunks.append(x.mul(255).add_(0.5).clamp_(0, 255).to(torch.uint8))  # as its utils.save_image rounds
    return torch.cat(chunks)


def train(args, stop) -> None:
    import torch

    from benchmarks.quality.race import Clock, write_info
    from ffcv_ddpm import quality

    if args.train_seed is not None:  # its Trainer seeds nothing: its Unet's initialisation and its data order
        import random

        import numpy as np

        random.seed(args.train_seed)
        np.random.seed(args.train_seed)
        torch.manual_seed(args.train_seed)  # and the DataLoader's shuffle and workers' seeds, drawn from it
    trainer, params, diffusion = build(args)
    device = trainer.device
    judge = quality.load_judge(args.judge, device)
    test_u8 = quality.beton_tensors(args.test_beton, device)[0]
    sampler = (f"DDIM eta {diffusion.ddim_sampling_eta:g}, {diffusion.sampling_timesteps} steps"
               if diffusion.is_ddim_sampling else f"ancestral, all {diffusion.num_timesteps} steps")
    print(f"peer: Unet dim {args.dim}, dim_mults {tuple(args.dim_mults)}: {params:,} parameters; sampler {sampler}",
          flush=True)
    write_info(args.curve, {
        "params": params, "sampler": sampler, "package": peer_versions(), "train_seed": args.train_seed,
        "summary": f"{params:,} parameters (Unet dim {args.dim}, dim_mults {tuple(args.dim_mults)}); batch "
                   f"{args.batch} ({args.loader} loader workers), amp {args.precision}, "
                   f"lr {trainer.opt.param_groups[0]['lr']:g}, EMA "
                   f"{trainer.ema.beta} every {trainer.ema.update_every} steps; objective {diffusion.objective}; "
                   f"training seed {'none' if args.train_seed is None else args.train_seed}; "
                   f"samples: {sampler}, {len(trainer.ds)} training images"})
    clock = Clock(args.launched, args.seconds, args.max_wall_s, args.curve)

    def measure() -> dict:
        images = sample_u8(trainer, args.n, args.n, args.seed)
        return {"fd_digits": quality.evaluate_samples(judge, images, None, test_u8)["fd_digits"]}

    accelerator = trainer.accelerator
    stop.phase = "start-up"  # a signal stops the side between two steps (stop.check)
    while True:
        # ---- Trainer.train()'s step (gradient_accumulate_every = 1), its objects and order ------------------------
        trainer.model.train()
        data = next(trainer.dl).to(device)
        with accelerator.autocast():
            loss = trainer.model(data)
            loss.item()  # its per-step host sync (the progress bar's loss), kept: it is part of its speed
        accelerator.backward(loss)
        accelerator.wait_for_everyone()
        accelerator.clip_grad_norm_(trainer.model.parameters(), trainer.max_grad_norm)
        trainer.opt.step()
        trainer.opt.zero_grad()
        accelerator.wait_for_everyone()
        trainer.step += 1
        trainer.ema.update()
        # ---- the race's evaluation in place of its save_and_sample_every block ------------------------------------
        if trainer.step % args.eval_every == 0:
            if device.type == "cuda":
                torch.cuda.synchronize(device)  # the steps so far are on the clock, not in the evaluation
            if clock.evaluate(trainer.step, measure):
                return
        stop.check()


def peer_versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for name in ("denoising-diffusion-pytorch", "ema-pytorch", "accelerate"):
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = None
    return out


def parse_args(argv: list[str]) -> argparse.Namespace:
    from ffcv_ddpm.checks import Parser, above, at_least, int_list, option

    count = option(int, at_least(1))
    p = Parser(prog="python -m benchmarks.quality.peer_ddpm", doc=__doc__,
               epilog="No --data and no KEY=VALUE overrides: the race gives the peer its images, judge and clock.")
    p.add_argument("--images", type=Path, required=True,
                   help="the train split as a PNG folder (benchmarks.quality.race.write_png_folder)")
    p.add_argument("--test-beton", type=Path, required=True, help="the judge's reference set")
    p.add_argument("--judge", type=Path, required=True, help="a saved digits judge (ffcv_ddpm.quality)")
    p.add_argument("--curve", type=Path, required=True, help="the evaluations, one JSON line each")
    p.add_argument("--launched", type=float, default=None, help="time.time() at launch (default: now)")
    p.add_argument("--seconds", type=option(float, above(0)), default=240.0)
    p.add_argument("--max-wall-s", type=option(float, above(0)), default=520.0)
    p.add_argument("--n", type=option(int, at_least(10)), default=500, help="samples per evaluation")
    p.add_argument("--eval-every", type=count, default=500, help="steps between evaluations")
    p.add_argument("--batch", type=option(int, at_least(16)), default=256,
                   help="train_batch_size (its Trainer asks for >= 16)")
    p.add_argument("--loader", choices=("persistent", "its"), default="persistent",
                   help="its DataLoader with persistent workers, or as its Trainer builds it (see above)")
    p.add_argument("--dim", type=count, default=24)
    p.add_argument("--dim-mults", type=int_list(at_least(1)), default=[1, 2, 4])
    p.add_argument("--precision", choices=("fp16", "bf16", "no"), default="fp16")
    p.add_argument("--sampling-steps", type=option(int, at_least(0)), default=0,
                   help="sampling_timesteps (0: its default, all 1000 steps, ancestral)")
    p.add_argument("--seed", type=option(int, at_least(0)), default=0, help="sampling seed")
    p.add_argument("--train-seed", type=option(int, at_least(0)),
                   help="seeds torch, numpy and random before its Unet is built (default: none, as its Trainer)")
    p.add_argument("--work", type=Path, required=True, help="its results_folder")
    args = p.parse_args(argv)
    args.launched = time.time() if args.launched is None else args.launched
    p.check_paths(inputs=[("--images", args.images, "folder"), ("--test-beton", args.test_beton, "file"),
                          ("--judge", args.judge, "file")], outputs=[("--work", args.work)])
    return args


def main(argv: list[str] | None = None) -> int:
    from benchmarks.quality.race import _errors
    from ffcv_ddpm.stopping import run_command

    args = parse_args(sys.argv[1:] if argv is None else argv)
    return run_command("race-peer", lambda stop: train(args, stop), errors=(*_errors(), ModuleNotFoundError))


if __name__ == "__main__":
    sys.exit(main())
