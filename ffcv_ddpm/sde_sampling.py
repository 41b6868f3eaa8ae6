"""Samplers for the score SDEs of ffcv_ddpm.sde: Euler–Maruyama, predictor–corrector, probability-flow ODE, and
EDM's Heun sampler and DPM-Solver++(2M) in σ-space.

    images, nfe = sample(process, model, n, sampler="pc", steps=100, seed=0)     # process: GaussianDiffusion or VE

`solve` is the numerical core: it takes any score function score(x, t) -> ∇ log p_t(x) (the tests give it the exact
score of Gaussian data) and returns the float samples and the number of score evaluations (NFE). `sample` builds
that score from the process's network (ffcv_ddpm.sde.network_score: an ε-network or EDM's preconditioned one,
diffusion.param), draws the prior noise from its own seeded generator and returns uint8 images; it also runs the
DDPM and DDIM samplers of a DDPM process, so one call covers every sampler of both processes.

All of them run from t = 1 down to t = 0, from the same prior draw, and end on an x0 prediction (the Tweedie
denoising step). Every sampler, ddpm and ddim included, clips that prediction by default (SamplerOptions.clip,
ffcv_ddpm.diffusion.clip_x0): em, pc and ode integrate the score of the clipped prediction, (a clip(x0) - x) / s²
with x0 = (x + s² score) / a, at every evaluation; heun and dpm2m clip their denoiser D. clip="off" integrates the
score as given.

em and pc visit `steps` evenly spaced times in t:
- em: Euler–Maruyama on the reverse SDE dx = [f x - g² score] dt + g dW̄; `steps` NFE (steps - 1 SDE steps, then the
  denoising step x0 = (x + s(0)² score) / a(0), Song et al.'s noise removal).
- pc: per time, `corrector_steps` Langevin steps x += ε score + sqrt(2ε) z with ε = 2α (snr ||z|| / ||score||)²,
  the norms averaged over the batch (Song et al.'s code; so ε, one number per step, depends on the batch), then the
  reverse-diffusion predictor x <- (2 - r) x + G² score + G z between neighbouring times, where the forward step is
  x_t = r x_t' + G z (VE: r = 1, G² = σ² - σ'²: SMLD's; VP: r = 1/sqrt(1 - β): DDPM's); steps · (1 +
  corrector_steps) NFE.
- ode: the probability-flow ODE dx/dt = f x - ½ g² score, solved by torchdiffeq's adaptive solver at the given
  rtol/atol; deterministic given the starting noise. The NFE includes the solver's rejected steps and its initial
  step-size probe. The solver's step control reads its error estimate on the host (one sync per step).
heun and dpm2m run in EDM's frame (Karras et al. 2022): x̂ = x / a(t) = x0 + σ ε, σ = s(t) / a(t) (ffcv_ddpm.sde:
VE's σ, DDPM's sqrt((1 - ᾱ) / ᾱ)), the denoiser D(x̂, σ) = the x0 prediction at the t of σ, the probability-flow
ODE dx̂/dσ = (x̂ - D) / σ, and `steps` = N noise levels σ_0 = σ(1) > ... > σ_{N-1} = σ(0) spaced as EDM's
(σ_max^(1/ρ) + i/(N-1) (σ_min^(1/ρ) - σ_max^(1/ρ)))^ρ, then σ_N = 0, whose step returns D(x̂, σ(0)).
- heun: EDM's Algorithm 1, second order: an Euler step, corrected by the slope at its end (not on the step to 0):
  2N - 1 NFE. With churn > 0 Algorithm 2: before each step with S_tmin <= σ_i <= S_tmax, noise lifts σ_i to
  σ̂ = σ_i (1 + γ), γ = min(churn / N, √2 - 1), by adding sqrt(σ̂² - σ_i²) S_noise z; σ̂ is kept at most σ(1), the
  largest noise level the network was trained at.
- dpm2m: DPM-Solver++(2M) (Lu et al. 2022), second order multistep on the data prediction, in λ = -ln σ:
  x̂' = (σ'/σ) x̂ - expm1(-h) D̃, h = ln(σ/σ'), D̃ = (1 + 1/2r) D_i - (1/2r) D_{i-1}, r = h_{i-1}/h_i (the first
  step D̃ = D_0, first order; DDIM's step in σ-space); one NFE per noise level: N.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from ffcv_ddpm.diffusion import CLIPS, GaussianDiffusion, clip_x0, timesteps_for_sampling, to_uint8
from ffcv_ddpm.sde import VEDiffusion, network_score, sde_of

DDPM_SAMPLERS = ("ddpm", "ddim")
SDE_SAMPLERS = ("em", "pc", "ode", "heun", "dpm2m")
EDM_SAMPLERS = ("heun", "dpm2m")  # the σ-space samplers
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
    rho: float = 7.0  # heun, dpm2m: EDM's noise-level spacing exponent (7: finer steps at low σ)
    # heun: EDM's stochastic Algorithm 2 (0: the deterministic Algorithm 1); its S_tmin, S_tmax, S_noise default to
    # EDM's CIFAR-10 settings (Karras et al. 2022, Table 5)
    churn: float = 0.0
    s_tmin: float = 0.05
    s_tmax: float = 1.0
    s_noise: float = 1.007

    def validate(self) -> None:
        if self.rho <= 0 or self.churn < 0 or self.s_noise <= 0 or not 0 <= self.s_tmin <= self.s_tmax:
            raise ValueError(f"rho={self.rho} must be > 0, churn={self.churn} >= 0, s_noise={self.s_noise} > 0 and "
                             f"0 <= s_tmin={self.s_tmin} <= s_tmax={self.s_tmax}")
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
    if randn is None and (sampler in ("em", "pc") or (sampler == "heun" and options.churn > 0)):
        raise ValueError(f"sampler={sampler!r} draws noise: pass randn")
    nfe = 0

    def counted(x: torch.Tensor, t: float) -> torch.Tensor:
        nonlocal nfe
        nfe += 1
        return score(x, t)

    x = x if x.dtype == torch.float64 else x.float()  # float64: the convergence tests' exact arithmetic
    if sampler in EDM_SAMPLERS:
        denoise = denoiser(sde, counted, options.clip)
        run = _heun if sampler == "heun" else _dpm_solver_2m
        x = run(sde, denoise, x / sde.scale(1.0), steps, options, randn)
        return x, nfe
    counted = clipped(sde, counted, options.clip)
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


def denoiser(sde, score: Score, mode: str) -> Callable[[torch.Tensor, float], torch.Tensor]:
    """D(x̂, σ): the (clipped) x0 prediction at noise level σ, from the score at the t of σ, for x̂ = x / a(t)."""

    def denoise(xh: torch.Tensor, sigma: float) -> torch.Tensor:
        t = sde.time_of_sigma(sigma)
        a, s2 = sde.scale(t), sde.std(t) ** 2
        return clip_x0((a * xh + s2 * score(a * xh, t)) / a, mode)

    return denoise


def edm_sigmas(steps: int, sigma_min: float, sigma_max: float, rho: float) -> list[float]:
    """EDM's N = `steps` noise levels from sigma_max down to sigma_min, evenly spaced in σ^(1/ρ), then 0."""
    hi, lo = sigma_max ** (1 / rho), sigma_min ** (1 / rho)
    return [(hi + i / (steps - 1) * (lo - hi)) ** rho for i in range(steps)] + [0.0]


def _heun(sde, denoise, x, steps: int, options: SamplerOptions, randn):
    sigmas = edm_sigmas(steps, sde.sigma(0.0), sde.sigma(1.0), options.rho)
    top = sigmas[0]
    gamma = min(options.churn / steps, math.sqrt(2) - 1)
    for sigma, sigma_next in zip(sigmas[:-1], sigmas[1:]):
        if gamma > 0 and options.s_tmin <= sigma <= options.s_tmax:
            sigma_hat = min(sigma * (1 + gamma), top)  # never above the trained range
            x = x + math.sqrt(sigma_hat**2 - sigma**2) * options.s_noise * randn()
            sigma = sigma_hat
        slope = (x - denoise(x, sigma)) / sigma
        x_next = x + (sigma_next - sigma) * slope
        if sigma_next > 0:
            x_next = x + (sigma_next - sigma) * 0.5 * (slope + (x_next - denoise(x_next, sigma_next)) / sigma_next)
        x = x_next
    return x


def _dpm_solver_2m(sde, denoise, x, steps: int, options: SamplerOptions, randn):
    sigmas = edm_sigmas(steps, sde.sigma(0.0), sde.sigma(1.0), options.rho)
    previous = h_previous = None
    for sigma, sigma_next in zip(sigmas[:-2], sigmas[1:-1]):
        d = denoise(x, sigma)
        h = math.log(sigma / sigma_next)
        if previous is None:
            blended = d
        else:
            r = h_previous / h
            blended = (1 + 1 / (2 * r)) * d - (1 / (2 * r)) * previous
        x = (sigma_next / sigma) * x - math.expm1(-h) * blended
        previous, h_previous = d, h
    return denoise(x, sigmas[-2])  # the step to σ = 0 (λ = ∞) returns the prediction itself


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
    em/pc/ode/heun/dpm2m integrate the process's SDE with `options`. The same seed on the same device gives the
    same images. A guided call (labels and guidance_scale != 1) is one forward of a 2n batch per evaluation, counted
    as one NFE."""
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
    score = network_score(sde, model, n, device, y, guidance_scale, null_label, process.cfg.param,
                          process.cfg.sigma_data)
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
