"""Samplers for the score SDEs of ffcv_ddpm.sde: Euler–Maruyama, predictor–corrector, probability-flow ODE.

    images, nfe = sample(process, model, n, sampler="pc", steps=100, seed=0)     # process: GaussianDiffusion or VE

`solve` is the numerical core: it takes any score function score(x, t) -> ∇ log p_t(x) (the tests give it the exact
score of Gaussian data) and returns the float samples and the number of score evaluations (NFE). `sample` builds
that score from an ε-network, draws the prior noise from its own seeded generator and returns uint8 images; it
also runs the DDPM and DDIM samplers of a DDPM process, so one call covers every sampler of both processes.

All three run from t = 1 down to t = 0 and finish with the Tweedie denoising step x0 = (x + s(0)² score) / a(0)
(Song et al.'s noise removal). Every sampler, ddpm and ddim included, clips its x0 prediction by default
(SamplerOptions.clip, ffcv_ddpm.diffusion.clip_x0): the score is replaced by the score of the clipped prediction,
(a clip(x0) - x) / s² with x0 = (x + s² score) / a, at every evaluation, so the final denoising step's output is
clipped too. clip="off" integrates the score as given. em and pc visit `steps` evenly spaced times, so `steps` network evaluations per sample
for "em" (steps - 1 SDE steps, then the denoise) and steps · (1 + corrector_steps) for "pc".
- em: Euler–Maruyama on the reverse SDE dx = [f x - g² score] dt + g dW̄.
- pc: per time, `corrector_steps` Langevin steps x += ε score + sqrt(2ε) z with ε = 2α (snr ||z|| / ||score||)²,
  the norms averaged over the batch (Song et al.'s code; so ε, one number per step, depends on the batch), then the
  reverse-diffusion predictor x <- (2 - r) x + G² score + G z between neighbouring times, where the forward step is
  x_t = r x_t' + G z (VE: r = 1, G² = σ² - σ'²: SMLD's; VP: r = 1/sqrt(1 - β): DDPM's).
- ode: the probability-flow ODE dx/dt = f x - ½ g² score, solved by torchdiffeq's adaptive solver at the given
  rtol/atol; deterministic given the starting noise. The NFE includes the solver's rejected steps and its initial
  step-size probe. The solver's step control reads its error estimate on the host (one sync per step).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from ffcv_ddpm.diffusion import CLIPS, GaussianDiffusion, clip_x0, eps_predictor, timesteps_for_sampling, to_uint8
from ffcv_ddpm.sde import VEDiffusion, sde_of

DDPM_SAMPLERS = ("ddpm", "ddim")
SDE_SAMPLERS = ("em", "pc", "ode")
ADAPTIVE_METHODS = ("dopri5", "dopri8", "bosh3", "fehlberg2", "adaptive_heun")  # torchdiffeq's adaptive solvers

Score = Callable[[torch.Tensor, float], torch.Tensor]


@dataclass
class SamplerOptions:
    snr: float = 0.16  # pc: Langevin signal-to-noise ratio (Song et al. 2021: 0.16 for VE on CIFAR-10)
    corrector_steps: int = 1  # pc: Langevin steps per time
    rtol: float = 1e-5  # ode: relative tolerance of the adaptive solver (Song et al.: 1e-5 with RK45)
    atol: float = 1e-5  # ode: absolute tolerance
    method: str = "dopri5"  # ode: torchdiffeq adaptive method, one of ADAPTIVE_METHODS
    clip: str = "static"  # every sampler: the x0 prediction clamped to [-1, 1] (the data's range), "dynamic" or "off"

    def validate(self) -> None:
        if self.clip not in CLIPS:
            raise ValueError(f"clip={self.clip!r}: use one of {', '.join(CLIPS)}")
        if self.snr <= 0 or self.corrector_steps < 0:
            raise ValueError(f"snr={self.snr} must be > 0 and corrector_steps={self.corrector_steps} >= 0")
        if self.rtol <= 0 or self.atol <= 0:
            raise ValueError(f"rtol={self.rtol} and atol={self.atol} must be > 0")
        if self.method not in ADAPTIVE_METHODS:
            raise ValueError(f"method={self.method!r}: use an adaptive torchdiffeq method, {', '.join(ADAPTIVE_METHODS)}")


def solve(sde, score: Score, x: torch.Tensor, *, sampler: str, steps: int = 100,
          options: SamplerOptions | None = None, randn: Callable[[], torch.Tensor] | None = None,
          ) -> tuple[torch.Tensor, int]:
    """(samples at t = 0, NFE) starting from x, a draw of the prior N(0, sde.prior_std² I) at t = 1.

    randn() draws standard normal noise of x's shape (the SDE samplers' source of randomness)."""
    options = options or SamplerOptions()
    options.validate()
    if sampler not in SDE_SAMPLERS:
        raise ValueError(f"sampler={sampler!r}: use one of {', '.join(SDE_SAMPLERS)}")
    if sampler != "ode" and steps < 2:
        raise ValueError(f"steps={steps}: {sampler} needs at least 2 evaluation times (t = 1 and t = 0)")
    nfe = 0
    score = clipped(sde, score, options.clip)

    def counted(x: torch.Tensor, t: float) -> torch.Tensor:
        nonlocal nfe
        nfe += 1
        return score(x, t)

    x = x.float()
    if sampler == "ode":
        x = _probability_flow(sde, counted, x, options)
    else:
        times = [1 - i / (steps - 1) for i in range(steps)]  # 1 -> 0, evenly spaced in t
        for t, t_next in zip(times[:-1], times[1:]):
            if sampler == "em":
                g2, dt = sde.diffusion2(t), t - t_next  # dt > 0: the step goes backwards in time
                x = x + (g2 * counted(x, t) - sde.drift(t) * x) * dt + math.sqrt(g2 * dt) * randn()
            else:
                x = langevin(sde, counted, x, t, options, randn)
                x = _reverse_diffusion(sde, counted, x, t, t_next, randn)
        if sampler == "pc":
            x = langevin(sde, counted, x, 0.0, options, randn)
    s0 = sde.std(0.0)
    return (x + s0**2 * counted(x, 0.0)) / sde.scale(0.0), nfe


def clipped(sde, score: Score, mode: str) -> Score:
    """The score of the clipped x0 prediction (ffcv_ddpm.diffusion.clip_x0), or `score` itself for mode "off"."""
    if mode == "off":
        return score

    def clipped_score(x: torch.Tensor, t: float) -> torch.Tensor:
        a, s2 = sde.scale(t), sde.std(t) ** 2
        return (a * clip_x0((x + s2 * score(x, t)) / a, mode) - x) / s2

    return clipped_score


def langevin(sde, score: Score, x, t: float, options: SamplerOptions, randn):
    alpha = sde.langevin_alpha(t)
    for _ in range(options.corrector_steps):
        grad, z = score(x, t), randn()
        # Batch means as in Song et al.'s code: a per-sample ratio ||z||/||grad|| is heavy-tailed in few dimensions
        # (a sample near the mode has a small grad and gets a huge step), which inflated a 16-d Gaussian's variance
        # by up to 80%. A 0-d tensor on the device: no host sync.
        ratio = z.flatten(1).norm(dim=1).mean() / grad.flatten(1).norm(dim=1).mean().clamp_min(1e-12)
        step = 2 * alpha * (options.snr * ratio) ** 2
        x = x + step * grad + (2 * step).sqrt() * z
    return x


def _reverse_diffusion(sde, score: Score, x, t: float, t_next: float, randn):
    r = sde.scale(t) / sde.scale(t_next)  # the forward step t_next -> t is x_t = r x_t_next + G z
    g2 = max(sde.std(t) ** 2 - (r * sde.std(t_next)) ** 2, 0.0)
    return (2 - r) * x + g2 * score(x, t) + math.sqrt(g2) * randn()


def _probability_flow(sde, score: Score, x, options: SamplerOptions):
    from torchdiffeq import odeint

    def velocity(t: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        tf = float(t)  # the solver already syncs per step for its error control
        return sde.drift(tf) * x - 0.5 * sde.diffusion2(tf) * score(x, tf)

    span = torch.tensor([1.0, 0.0], device=x.device)
    # step_t: the last step ends at t = 0 exactly; by default the solver steps past the end time and interpolates,
    # which would evaluate the score (and the VP schedule) at t < 0.
    return odeint(velocity, x, span, rtol=options.rtol, atol=options.atol, method=options.method,
                  options={"step_t": span[1:]})[-1]


def network_score(sde, model: nn.Module, n: int, device, y=None, guidance_scale: float = 1.0,
                  null_label: int | None = None) -> Score:
    """score(x, t) = -ε̂ / s(t) of an ε-network fed the inputs the process trained it on (sde.net_inputs)."""
    eps = eps_predictor(model, n, device, y, guidance_scale, null_label)

    def score(x: torch.Tensor, t: float) -> torch.Tensor:
        c_in, c_noise = sde.net_inputs(t)
        return eps(x * c_in if c_in != 1.0 else x, c_noise) / -sde.std(t)

    return score


@torch.no_grad()
def sample(
    process: GaussianDiffusion | VEDiffusion,
    model: nn.Module,
    n: int,
    *,
    sampler: str,
    steps: int = 100,
    options: SamplerOptions | None = None,
    eta: float = 0.0,
    seed: int = 0,
    y: torch.Tensor | None = None,
    guidance_scale: float = 1.0,
    null_label: int | None = None,
    shape: tuple[int, int, int] = (3, 32, 32),
    device: torch.device | str | None = None,
    memory_format: torch.memory_format = torch.contiguous_format,
) -> tuple[torch.Tensor, int]:
    """(n uint8 images (n, C, H, W), NFE per image) from any sampler of either process.

    ddpm/ddim (DDPM process only) go to GaussianDiffusion.sample (eta is DDIM's; of `options` only clip applies);
    em/pc/ode integrate the process's SDE with `options`. The same seed on the same device gives the same images. A guided call
    (labels and guidance_scale != 1) is one forward of a 2n batch per evaluation, counted as one NFE."""
    if sampler in DDPM_SAMPLERS:
        if not isinstance(process, GaussianDiffusion):
            raise ValueError(f"sampler={sampler!r} needs a DDPM model (diffusion.process='ddpm'); this is a "
                             f"diffusion.process='ve' model: use sampler {', '.join(SDE_SAMPLERS)}")
        options = options or SamplerOptions()
        options.validate()
        images = process.sample(model, n, sampler=sampler, steps=steps, eta=eta, seed=seed, y=y,
                                guidance_scale=guidance_scale, null_label=null_label, shape=shape, device=device,
                                clip=options.clip, memory_format=memory_format)
        nfe = process.num_timesteps if sampler == "ddpm" else len(timesteps_for_sampling(process.num_timesteps, steps))
        return images, nfe
    if sampler not in SDE_SAMPLERS:
        raise ValueError(f"sampler={sampler!r}: use one of {', '.join(DDPM_SAMPLERS + SDE_SAMPLERS)}")
    if n < 1:
        raise ValueError(f"n={n} must be >= 1")
    device = torch.device(device) if device is not None else next(model.parameters()).device
    sde = sde_of(process)
    score = network_score(sde, model, n, device, y, guidance_scale, null_label)
    gen = torch.Generator(device=device).manual_seed(seed)
    randn = lambda: torch.randn((n, *shape), generator=gen, device=device).contiguous(  # noqa: E731
        memory_format=memory_format
    )
    was_training = model.training
    model.eval()
    try:
        x, nfe = solve(sde, score, sde.prior_std * randn(), sampler=sampler, steps=steps, options=options,
                       randn=randn)
    finally:
        model.train(was_training)
    return to_uint8(x), nfe
