"""Score-SDE processes beside DDPM: a variance-exploding SDE (NCSN-style) and DDPM read as a variance-preserving SDE.

Both are written as x_t = a(t) x0 + s(t) ε on t ∈ [0, 1] (t = 1 is the prior end), the marginals of the forward
SDE dx = f(t) x dt + g(t) dW (Song et al. 2021). The network is an ε-predictor in both by default, so its score is
∇ log p_t(x) = -ε̂ / s(t); only ``net_inputs`` differs, which says what the UNet is fed. With diffusion.param=edm it
is EDM's preconditioned denoiser instead, in both (diffusion.edm_scalings; the network's time input unchanged), and
``network_score`` turns either into a score.

- VE: a = 1, s = σ(t) = σ_min (σ_max/σ_min)^t (geometric), f = 0, g² = dσ²/dt = 2 σ² ln(σ_max/σ_min). The
  network sees x / sqrt(1 + σ²) (unit scale at every σ, EDM's input scaling for data of second moment <= 1) and the noise
  level as NET_TIME · t = NET_TIME · ln(σ/σ_min) / ln(σ_max/σ_min), a linear function of log σ fed through the
  UNet's own sinusoidal time embedding over the same [0, 999] range DDPM's timesteps use. Training draws
  t ~ U[0, 1] (log σ uniform) and minimises the σ²-weighted denoising score-matching loss
  σ² ||s_θ(x0 + σε, σ) + ε/σ||², which with s_θ = -ε_θ/σ is exactly ||ε_θ - ε||² (VEDiffusion.loss).
- VP (a DDPM checkpoint, unchanged): τ = t (T - 1) is the DDPM timestep, ln ᾱ(τ) is the schedule's ln ᾱ_k
  interpolated linearly between integers, so β(τ) = -d ln ᾱ/dτ is piecewise constant and the marginals equal DDPM's
  at every integer τ, for the linear and the cosine schedule alike. The network sees x_t and τ, as in training.

Both also map t to EDM's noise level σ(t) = s(t) / a(t) (the noise-to-signal ratio: x / a = x0 + σ ε) and back
(`sigma`, `time_of_sigma`), which is how the σ-space samplers (Heun, DPM-Solver++) run on either process: VE's σ is
its std, DDPM's is sqrt((1 - ᾱ) / ᾱ), from 0.01 at τ = 0 to ~157 at τ = 999 for the linear schedule.

Coefficients are Python floats for one t (what the samplers in ffcv_ddpm.sde_sampling use: no device tensors, no
host sync); VESDE's also work on a tensor of per-sample t (the training loss).
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ffcv_ddpm.diffusion import (DiffusionConfig, GaussianDiffusion, check_param, drop_labels, edm_loss, edm_scalings,
                                 eps_predictor, make_betas)

PROCESSES = ("ddpm", "ve")
NET_TIME = 999.0  # the network's time input spans [0, NET_TIME], DDPM's timestep range at T = 1000


class VESDE:
    kind = "ve"

    def __init__(self, sigma_min: float, sigma_max: float):
        if not 0 < sigma_min < sigma_max:
            raise ValueError(f"diffusion.sigma_min={sigma_min}, sigma_max={sigma_max}: need 0 < sigma_min < sigma_max")
        self.sigma_min, self.sigma_max = float(sigma_min), float(sigma_max)
        self._log_ratio = math.log(self.sigma_max / self.sigma_min)
        self.prior_std = self.sigma_max  # the prior N(0, σ_max² I): the data's spread is negligible next to σ_max

    def scale(self, t):
        return 1.0

    def std(self, t):
        return self.sigma_min * (self.sigma_max / self.sigma_min) ** t

    def drift(self, t):
        return 0.0

    def diffusion2(self, t):
        return 2 * self.std(t) ** 2 * self._log_ratio

    def sigma(self, t: float) -> float:
        return self.std(t)

    def time_of_sigma(self, sigma: float) -> float:
        return math.log(sigma / self.sigma_min) / self._log_ratio

    def net_inputs(self, t):
        """(c_in, c_noise): the network gets x · c_in and c_noise as its time input."""
        return (1 + self.std(t) ** 2) ** -0.5, NET_TIME * t

    def langevin_alpha(self, t) -> float:
        return 1.0  # Song et al.'s α_i for SMLD


class VPSDE:
    kind = "vp"

    def __init__(self, betas: torch.Tensor):
        if len(betas) < 2:
            raise ValueError(f"a VP-SDE needs at least 2 timesteps, got {len(betas)}")
        self.log_abar = np.cumsum(np.log1p(-betas.double().cpu().numpy()))  # ln ᾱ_k, k = 0..T-1
        self.T = len(betas)
        self.prior_std = 1.0  # N(0, I): ᾱ_{T-1} is ~4e-5 for the linear schedule

    @classmethod
    def from_config(cls, cfg: DiffusionConfig) -> "VPSDE":
        return cls(make_betas(cfg))

    def _tau(self, t: float) -> float:
        return t * (self.T - 1)

    def _log_abar(self, t: float) -> float:
        return float(np.interp(self._tau(t), np.arange(self.T), self.log_abar))

    def _beta_per_tau(self, t: float) -> float:
        k = min(int(self._tau(t)), self.T - 2)  # the segment [k, k+1] holding τ; τ = T-1 uses the last one
        return float(self.log_abar[k] - self.log_abar[k + 1])

    def scale(self, t: float) -> float:
        return math.exp(0.5 * self._log_abar(t))

    def std(self, t: float) -> float:
        return math.sqrt(-math.expm1(self._log_abar(t)))

    def sigma(self, t: float) -> float:
        return math.sqrt(math.expm1(-self._log_abar(t)))  # sqrt((1 - ᾱ) / ᾱ)

    def time_of_sigma(self, sigma: float) -> float:
        """The t with sigma(t) = sigma: ln ᾱ = -ln(1 + σ²) located on the piecewise-linear ln ᾱ(τ) (decreasing, so
        the arrays are reversed for np.interp); σ outside [sigma(0), sigma(1)] maps to the nearest end."""
        tau = np.interp(-math.log1p(sigma * sigma), self.log_abar[::-1], np.arange(self.T - 1, -1, -1.0))
        return float(tau) / (self.T - 1)

    def drift(self, t: float) -> float:
        return -0.5 * self.diffusion2(t)

    def diffusion2(self, t: float) -> float:
        return (self.T - 1) * self._beta_per_tau(t)  # β per unit t

    def net_inputs(self, t: float):
        return 1.0, self._tau(t)

    def langevin_alpha(self, t: float) -> float:
        return math.exp(-self._beta_per_tau(t))  # 1 - β_k of the DDPM step at τ, Song et al.'s α_i


class VEDiffusion(nn.Module):
    """The VE process for the trainer: ``loss`` (the same call as GaussianDiffusion.loss) and ``sample``."""

    def __init__(self, cfg: DiffusionConfig):
        super().__init__()
        self.cfg = cfg
        if not 0.0 <= cfg.p_uncond <= 1.0:
            raise ValueError(f"p_uncond={cfg.p_uncond} must be in [0, 1]")
        check_param(cfg)
        self.sde = VESDE(cfg.sigma_min, cfg.sigma_max)

    def loss(
        self, model: nn.Module, x0: torch.Tensor, y: torch.Tensor | None = None, null_label: int | None = None
    ) -> torch.Tensor:
        """σ²-weighted denoising score matching = E ||ε - ε_θ(x0 + σε, σ)||², log σ ~ U[ln σ_min, ln σ_max]; with
        param="edm", EDM's loss (diffusion.edm_loss) at the same noise levels, the same c_noise."""
        t = torch.rand(x0.shape[0], device=x0.device)
        c_in, c_noise = self.sde.net_inputs(t)
        if y is not None and self.cfg.p_uncond > 0:
            y = drop_labels(y, self.cfg.p_uncond, null_label)
        if self.cfg.param == "edm":
            return edm_loss(model, x0, self.sde.std(t), c_noise, y, self.cfg.sigma_data)
        sigma = self.sde.std(t).view(-1, 1, 1, 1)  # (B,) -> (B, 1, 1, 1)
        noise = torch.randn_like(x0)  # keeps x0's memory format
        eps = model(((x0 + sigma * noise) * c_in.view(-1, 1, 1, 1)).to(x0.dtype), c_noise, y)
        return F.mse_loss(eps.float(), noise.float())


def network_score(sde, model: nn.Module, n: int, device, y=None, guidance_scale: float = 1.0,
                  null_label: int | None = None, param: str = "eps", sigma_data: float = 0.5):
    """score(x, t) -> ∇ log p_t(x) of the process's network at SDE time t, fed the inputs it trained on:
    param="eps": -ε̂ / s(t), the network given x · c_in (sde.net_inputs); param="edm": (a D - x) / s² with EDM's
    D = c_skip x̂ + c_out F(c_in x̂, c_noise), x̂ = x / a, σ = s / a (diffusion.edm_scalings), c_noise the process's."""
    net = eps_predictor(model, n, device, y, guidance_scale, null_label)  # guidance is linear in F as in ε

    def eps_score(x: torch.Tensor, t: float) -> torch.Tensor:
        c_in, c_noise = sde.net_inputs(t)
        return net(x * c_in if c_in != 1.0 else x, c_noise) / -sde.std(t)

    def edm_score(x: torch.Tensor, t: float) -> torch.Tensor:
        a, s = sde.scale(t), sde.std(t)
        c_skip, c_out, c_in = edm_scalings(s / a, sigma_data)
        xh = x / a
        d = c_skip * xh + c_out * net(xh * c_in, sde.net_inputs(t)[1])
        return (a * d - x) / (s * s)

    return eps_score if param == "eps" else edm_score


def make_diffusion(cfg: DiffusionConfig) -> GaussianDiffusion | VEDiffusion:
    """The process `diffusion.process` names: what the trainer trains and samples with."""
    if cfg.process == "ddpm":
        return GaussianDiffusion(cfg)
    if cfg.process == "ve":
        return VEDiffusion(cfg)
    raise ValueError(f"diffusion.process={cfg.process!r}: use one of {', '.join(PROCESSES)}")


def sde_of(process: GaussianDiffusion | VEDiffusion) -> VESDE | VPSDE:
    """The SDE the new samplers integrate: VE's own, or DDPM's schedule read as a VP-SDE."""
    return process.sde if isinstance(process, VEDiffusion) else VPSDE.from_config(process.cfg)


def load_for_sampling(path, device, *, process: str | None = None, ema: bool = True):
    """(process, model in eval mode, RunConfig) from a trainer checkpoint; the EMA weights when present and `ema`.

    The process comes from the checkpoint's config (checkpoints written before the field existed are DDPM). With
    `process` given, a checkpoint of another process is a ValueError rather than a model sampled with the wrong
    noise levels."""
    from ffcv_ddpm.config import RunConfig
    from ffcv_ddpm.unet import build_model

    state = torch.load(Path(path), map_location=device, weights_only=False)
    cfg = RunConfig.from_dict(state["config"])
    if process is not None and cfg.diffusion.process != process:
        raise ValueError(f"{path} holds a diffusion.process={cfg.diffusion.process!r} model, not {process!r}; "
                         f"sample it with its own process (make_diffusion of the checkpoint's config)")
    model = build_model(cfg.model).to(device)
    weights = state["ema"]["module"] if ema and state.get("ema") is not None else state["model"]
    model.load_state_dict(weights)
    return make_diffusion(cfg.diffusion).to(device), model.eval(), cfg
