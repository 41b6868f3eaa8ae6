"""Sample quality during and after training: batched generation, and the metric the trainer logs every
train.eval_every steps.

    images = generate(model, diffusion, 1000, labels=labels, sampler="ddim", steps=100, guidance=2.0)
    evaluator = Evaluator(cfg, device, amp_dtype)          # loads the judge or Inception, reference data once
    stats.update(evaluator(ema_model, diffusion))          # {"fd_digits", "cond_acc"} or {"fid"}, + eval_n, eval_s

Guidance is the classifier-free guidance weight w of Ho & Salimans: ε = (1 + w) ε(x, y) - w ε(x, ∅), so w = 0 is
the plain conditional model (GaussianDiffusion.sample's guidance_scale is 1 + w).

A run is sampled with its own process (diffusion.process: DDPM, or the VE-SDE of ffcv_ddpm.sde): load_run builds it
from the run's config, and the default sampler follows it (default_sampler).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch
from torch import nn

from ffcv_ddpm.diffusion import GaussianDiffusion


def default_sampler(diffusion) -> str:
    """DDIM for a DDPM process; predictor-corrector for VE (Song et al.'s choice for VE-SDE models)."""
    return "ddim" if isinstance(diffusion, GaussianDiffusion) else "pc"


def check_sampler(diffusion, sampler: str | None) -> str:
    """The sampler to use (`sampler`, or the process's default); ValueError for one the process does not have."""
    from ffcv_ddpm.sde_sampling import DDPM_SAMPLERS, SDE_SAMPLERS

    sampler = sampler or default_sampler(diffusion)
    allowed = (DDPM_SAMPLERS + SDE_SAMPLERS) if isinstance(diffusion, GaussianDiffusion) else SDE_SAMPLERS
    if sampler not in allowed:
        process = "ddpm" if isinstance(diffusion, GaussianDiffusion) else "ve"
        raise ValueError(f"sampler {sampler!r} does not sample a diffusion.process={process} run; use one of "
                         f"{', '.join(allowed)}")
    return sampler


@torch.no_grad()
def generate(model: nn.Module, diffusion, n: int, *, labels: torch.Tensor | None = None,
             sampler: str | None = None, steps: int = 100, guidance: float = 0.0, batch: int = 500, seed: int = 0,
             amp_dtype: torch.dtype | None = None, shape: tuple[int, int, int] = (3, 32, 32),
             memory_format: torch.memory_format = torch.contiguous_format) -> torch.Tensor:
    """n uint8 images (n, C, H, W) on the model's device, sampled `batch` at a time (chunk i seeded seed + i), from
    a DDPM or VE process (`diffusion`); sampler None = default_sampler(diffusion)."""
    from ffcv_ddpm.sde_sampling import sample

    device = next(model.parameters()).device
    sampler = check_sampler(diffusion, sampler)
    chunks = []
    for i, start in enumerate(range(0, n, batch)):
        m = min(batch, n - start)
        y = None if labels is None else labels[start:start + m]
        with torch.autocast(device.type, dtype=amp_dtype or torch.float32, enabled=amp_dtype is not None):
            chunks.append(sample(diffusion, model, m, sampler=sampler, steps=steps, seed=seed + i, y=y,
                                 guidance_scale=1.0 + guidance, shape=shape, device=device,
                                 memory_format=memory_format)[0])
    return torch.cat(chunks)


def load_run(run_dir: str | Path, device: torch.device | str, ema: bool = True, overrides=()):
    """(config, model in eval mode, process, step) from a run folder's config.json and newest checkpoint; the EMA
    weights unless ema=False (or the run kept none). The process is the run's own (diffusion.process: a DDPM
    GaussianDiffusion or a VEDiffusion). `overrides` (KEY=VALUE) change the config before the network is built; one
    that changes the network's shape is a ValueError, and so is one that changes the process."""
    from ffcv_ddpm.checkpoint import load_latest
    from ffcv_ddpm.config import RunConfig, apply_override, check_config
    from ffcv_ddpm.sde import make_diffusion
    from ffcv_ddpm.unet import build_model

    run_dir = Path(run_dir)
    if not (run_dir / "config.json").is_file():
        raise FileNotFoundError(f"{run_dir} has no config.json: give a run folder written by ffcv_ddpm.train")
    cfg = RunConfig.from_dict(json.loads((run_dir / "config.json").read_text()))
    process = cfg.diffusion.process
    for item in overrides:
        apply_override(cfg, item)
    check_config(cfg)
    if cfg.diffusion.process != process:
        raise ValueError(f"{run_dir} was trained as diffusion.process={process}; it is sampled as that process, "
                         f"not as {cfg.diffusion.process}: drop the override")
    state, path = load_latest(run_dir, map_location="cpu")
    if state is None:
        raise FileNotFoundError(f"{run_dir} has no complete checkpoint (ckpt-*.pt)")
    model = build_model(cfg.model)
    try:
        model.load_state_dict(state["ema"]["module"] if ema and state.get("ema") else state["model"])
    except RuntimeError as e:
        raise ValueError(f"{path} does not fit the model built from {run_dir}/config.json with the overrides "
                         f"{' '.join(overrides) or '(none)'}: {str(e).splitlines()[0]}") from None
    memory_format = torch.channels_last if cfg.train.channels_last else torch.contiguous_format
    model = model.to(device, memory_format=memory_format).eval()
    return cfg, model, make_diffusion(cfg.diffusion).to(device), state["step"]


def class_labels(n: int, num_classes: int, device: torch.device | str = "cpu") -> torch.Tensor | None:
    """0, 1, ..., C-1, 0, 1, ... (n labels), or None for an unconditional model."""
    return torch.arange(n, device=device) % num_classes if num_classes > 0 else None


class Evaluator:
    """The quality metric of a run config: with train.eval_judge, FD-digits and conditional accuracy from that judge;
    otherwise FID (Inception weights from the torch hub cache). Reference: train.eval_ref, default data.path.

    Everything that can fail (a missing judge or weights file, unreadable reference data) fails here, at set-up."""

    def __init__(self, cfg, device: torch.device, amp_dtype: torch.dtype | None):
        self.cfg, self.device, self.amp_dtype = cfg, device, amp_dtype
        ref = cfg.train.eval_ref or cfg.data.path
        self.judge = None
        if cfg.train.eval_judge:
            from ffcv_ddpm.fid import read_images
            from ffcv_ddpm.quality import load_judge

            self.judge = load_judge(cfg.train.eval_judge, device)
            self.ref_images = torch.from_numpy(read_images(ref)).permute(0, 3, 1, 2).to(device)
        else:
            from ffcv_ddpm import fid

            self.inception = fid.load_inception(None, device)
            self.ref = fid.reference_stats(ref, self.inception, fid.network_tag())

    def __call__(self, model: nn.Module, diffusion: GaussianDiffusion) -> dict:
        t0 = time.perf_counter()
        cfg = self.cfg
        labels = class_labels(cfg.train.eval_n, cfg.model.num_classes, self.device)
        images = generate(model, diffusion, cfg.train.eval_n, labels=labels, steps=cfg.train.sample_steps,
                          batch=cfg.data.batch_size, seed=cfg.train.seed, amp_dtype=self.amp_dtype,
                          shape=(cfg.model.in_channels, cfg.model.image_size, cfg.model.image_size),
                          memory_format=torch.channels_last if cfg.train.channels_last else torch.contiguous_format)
        if self.judge is not None:
            from ffcv_ddpm.quality import evaluate_samples

            result = evaluate_samples(self.judge, images, labels, self.ref_images)
            out = {"fd_digits": result["fd_digits"], "cond_acc": result["cond_acc"]}
        else:
            from ffcv_ddpm.fid import fid_of_images

            out = {"fid": fid_of_images(self.inception, images, self.ref)}
        return {**out, "eval_n": cfg.train.eval_n, "eval_s": time.perf_counter() - t0}
