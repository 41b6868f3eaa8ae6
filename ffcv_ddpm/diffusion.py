"""The Gaussian diffusion process: β schedules, q_sample, the ε-MSE training loss, DDPM and DDIM samplers.

The model is any ``model(x_t, t, y=None) -> ε estimate``; only this module knows the schedule. Images live in
[-1, 1], and every sampler of the project clips its x0 prediction to that range by default (``clip_x0``; CLIPS).
``loss`` draws timesteps, noise and label dropout with torch's RNG on the data's device: no host sync, no
data-dependent Python branching, so it can sit inside a compiled training step. The samplers are plain loops over
Python-float coefficients (read from the schedule once per call) and are seeded by their own generator. With
DiffusionConfig.param="edm" the network is EDM's preconditioned denoiser instead of an ε-predictor (edm_scalings).
"""

from __future__ import annotations

import math
import os
import tempfile
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ffcv_ddpm.env import umask


@dataclass
class DiffusionConfig:
    process: str = "ddpm"  # "ddpm" (this module: discrete VP, ε-loss) or "ve" (ffcv_ddpm.sde: variance-exploding SDE)
    schedule: str = "linear"  # β schedule: "linear" (Ho et al., beta_start -> beta_end) or "cosine" (Nichol & Dhariwal)
    timesteps: int = 1000  # T, the number of diffusion steps
    beta_start: float = 1e-4  # β_1 of the linear schedule
    beta_end: float = 0.02  # β_T of the linear schedule
    p_uncond: float = 0.1  # probability a training label is replaced by the null label (classifier-free guidance)
    sigma_min: float = 0.01  # ve: smallest noise level σ(0) (Song et al. 2021's 0.01)
    sigma_max: float = 80.0  # ve: largest noise level σ(1), about the largest distance between images in [-1, 1]
    # What the network predicts: "eps" (the noise ε, DDPM's and NCSN's) or "edm" (EDM's preconditioned denoiser
    # D = c_skip x̂ + c_out F(c_in x̂, c_noise) with loss weight 1/c_out², Karras et al. 2022; edm_scalings)
    param: str = "eps"
    sigma_data: float = 0.5  # edm: the data's standard deviation the scalings assume (EDM's 0.5 for images in [-1, 1])


def make_betas(cfg: DiffusionConfig) -> torch.Tensor:
    """β_t for t = 0..T-1 in float64."""
    T = cfg.timesteps
    if T < 1:
        raise ValueError(f"timesteps={T} must be >= 1")
    if cfg.schedule == "linear":
        if not 0.0 < cfg.beta_start <= cfg.beta_end < 1.0:
            raise ValueError(f"need 0 < beta_start <= beta_end < 1, got {cfg.beta_start}, {cfg.beta_end}")
        return torch.linspace(cfg.beta_start, cfg.beta_end, T, dtype=torch.float64)
    if cfg.schedule == "cosine":
        # ᾱ(t) = cos²((t/T + s)/(1 + s) · π/2), s = 0.008; β clipped at 0.999 so the last step is not singular.
        s = 0.008
        f = torch.cos((torch.arange(T + 1, dtype=torch.float64) / T + s) / (1 + s) * math.pi / 2) ** 2
        return (1 - f[1:] / f[:-1]).clamp(max=0.999)
    raise ValueError(f"schedule={cfg.schedule!r}: use 'linear' or 'cosine'")


def timesteps_for_sampling(timesteps: int, steps: int) -> list[int]:
    """`steps` distinct timesteps from T-1 down to 0, evenly spaced (all T of them when steps == T)."""
    if not 1 <= steps <= timesteps:
        raise ValueError(f"steps={steps} must be between 1 and timesteps={timesteps}")
    return [int(t) for t in np.linspace(timesteps - 1, 0, steps).round()]


def to_uint8(x: torch.Tensor) -> torch.Tensor:
    """[-1, 1] floats -> uint8 [0, 255], rounding to nearest."""
    return ((x.float().clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8)


PARAMS = ("eps", "edm")  # DiffusionConfig.param
CLIPS = ("static", "dynamic", "off")  # what a sampler does to its x0 prediction at every step (clip_x0)
DYNAMIC_PERCENTILE = 0.995  # dynamic thresholding's quantile of |x0| per sample (Saharia et al. 2022, Imagen)


def clip_x0(x0: torch.Tensor, mode: str) -> torch.Tensor:
    """A sampler's x0 prediction kept to the data's range [-1, 1]: "static" clamps it; "dynamic" divides each sample
    by s = max(1, the DYNAMIC_PERCENTILE quantile of its |x0|) after clamping to [-s, s] (a sample inside the range is
    left as it is); "off" returns it unchanged.

    Why every sampler does it by default: an ε-network's error e becomes an x0 error (s/a) e, up to ~80x at the high
    noise levels where a digit's class is decided; a clipped x0 bounds it by the data's range."""
    if mode == "static":
        return x0.clamp(-1, 1)
    if mode == "dynamic":
        s = torch.quantile(x0.flatten(1).abs(), DYNAMIC_PERCENTILE, dim=1).clamp_min(1.0)  # (B,), no host sync
        s = s.view(-1, *([1] * (x0.dim() - 1)))  # (B,) -> (B, 1, 1, 1)
        return torch.minimum(torch.maximum(x0, -s), s) / s
    if mode == "off":
        return x0
    raise ValueError(f"clip={mode!r}: use one of {', '.join(CLIPS)}")


def edm_scalings(sigma, sigma_data: float):
    """(c_skip, c_out, c_in) of EDM's preconditioning at noise level σ (a float or a tensor; Karras et al. 2022,
    Table 1): D(x̂, σ) = c_skip x̂ + c_out F(c_in x̂, ...) for x̂ = x0 + σ ε. c_in gives the network unit-variance
    input, c_skip and c_out a unit-variance target for data of standard deviation sigma_data; D -> x̂ as σ -> 0 and
    -> sigma_data · F as σ -> ∞, so the network's error is never multiplied by σ as an ε-network's is."""
    total = sigma * sigma + sigma_data * sigma_data
    return sigma_data * sigma_data / total, sigma * sigma_data / total**0.5, total**-0.5


def edm_loss(model: nn.Module, x0: torch.Tensor, sigma: torch.Tensor, c_noise: torch.Tensor,
             y: torch.Tensor | None, sigma_data: float) -> torch.Tensor:
    """EDM's loss λ(σ) ||D(x0 + σ n, σ) - x0||² with λ = 1/c_out², at per-sample noise levels σ (B,): written, as
    EDM trains, as the network's output against its effective target (x0 - c_skip x̂) / c_out, unit-weighted.
    Against the ε-loss (weight 1/σ² on the same ||D - x0||²) this adds 1/sigma_data²: the high noise levels, where
    a class is decided, are learned as x0 predictions, not as ε."""
    sigma = sigma.view(-1, 1, 1, 1)  # (B,) -> (B, 1, 1, 1)
    c_skip, c_out, c_in = edm_scalings(sigma, sigma_data)
    xh = x0 + sigma * torch.randn_like(x0)  # keeps x0's memory format
    out = model((xh * c_in).to(x0.dtype), c_noise, y)
    return F.mse_loss(out.float(), ((x0 - c_skip * xh) / c_out).float())


def check_param(cfg: DiffusionConfig) -> None:
    if cfg.param not in PARAMS:
        raise ValueError(f"diffusion.param={cfg.param!r}: use one of {', '.join(PARAMS)}")
    if cfg.sigma_data <= 0:
        raise ValueError(f"diffusion.sigma_data={cfg.sigma_data} must be > 0")


def drop_labels(y: torch.Tensor, p_uncond: float, null_label: int | None) -> torch.Tensor:
    """Replaces a p_uncond fraction of the labels by ``null_label`` (on the device, no host sync), so the same
    network also learns the unconditional ε for classifier-free guidance."""
    if null_label is None:
        raise ValueError("labels were given with p_uncond > 0: pass null_label=model's num_classes")
    drop = torch.rand(y.shape[0], device=y.device) < p_uncond
    return torch.where(drop, torch.full_like(y, null_label), y)


def eps_predictor(
    model: nn.Module, n: int, device: torch.device, y: torch.Tensor | None, guidance_scale: float,
    null_label: int | None,
) -> Callable[[torch.Tensor, float], torch.Tensor]:
    """eps(x, t) -> the network's float output (the ε estimate; EDM's F with param="edm") for a batch of n at one
    network time t (an int timestep or a real number), with classifier-free guidance when labels are given and
    guidance_scale != 1 (a linear blend of outputs, so it is the same blend of the x0 predictions). Checks the labels
    once."""
    guided = y is not None and guidance_scale != 1.0
    if y is not None:
        if y.shape != (n,):
            raise ValueError(f"y has shape {tuple(y.shape)}; need one label per image, shape ({n},)")
        y = y.to(device=device, dtype=torch.long)
    if guided:
        null_label = null_label if null_label is not None else getattr(model, "num_classes", 0)
        if not null_label:
            raise ValueError("guidance needs a conditional model: pass null_label (the model's num_classes)")

    def eps(x: torch.Tensor, t: float) -> torch.Tensor:
        tt = torch.full((n,), t, device=device)  # int64 for an int timestep, float32 for a real time
        return guided_eps(model, x, tt, y, guidance_scale, null_label) if guided else model(x, tt, y).float()

    return eps


def guided_eps(
    model: nn.Module, x: torch.Tensor, t: torch.Tensor, y: torch.Tensor, guidance_scale: float, null_label: int
) -> torch.Tensor:
    """Classifier-free guidance: ε_uncond + s (ε_cond - ε_uncond), both halves in one batched forward."""
    y_in = torch.cat([y, torch.full_like(y, null_label)])  # (2B,): conditional half, then unconditional
    cond, uncond = model(torch.cat([x, x]), torch.cat([t, t]), y_in).float().chunk(2)
    return uncond + guidance_scale * (cond - uncond)


class GaussianDiffusion(nn.Module):
    """Holds the schedule as buffers (moves with ``.to(device)``); see the module docstring."""

    def __init__(self, cfg: DiffusionConfig | None = None):
        super().__init__()
        self.cfg = cfg or DiffusionConfig()
        if not 0.0 <= self.cfg.p_uncond <= 1.0:
            raise ValueError(f"p_uncond={self.cfg.p_uncond} must be in [0, 1]")
        check_param(self.cfg)
        betas = make_betas(self.cfg)
        abar = torch.cumprod(1 - betas, dim=0)
        self.num_timesteps = self.cfg.timesteps
        # float32 on the device for the training path; samplers re-read these in float64 on the host.
        for name, value in [
            ("betas", betas),
            ("alphas_cumprod", abar),
            ("sqrt_alphas_cumprod", abar.sqrt()),
            ("sqrt_one_minus_alphas_cumprod", (1 - abar).sqrt()),
            ("sigmas", ((1 - abar) / abar).sqrt()),  # EDM's noise level of each timestep: x_t / sqrt(ᾱ) = x0 + σ ε
        ]:
            self.register_buffer(name, value.float(), persistent=False)
        self._betas64 = betas  # exact values for the samplers' Python-float coefficients
        self._abar64 = abar

    def q_sample(self, x0: torch.Tensor, t: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
        """x_t = sqrt(ᾱ_t) x0 + sqrt(1 - ᾱ_t) ε, per-sample t of shape (B,)."""
        a = self.sqrt_alphas_cumprod[t].view(-1, 1, 1, 1)  # (B,) -> (B, 1, 1, 1)
        s = self.sqrt_one_minus_alphas_cumprod[t].view(-1, 1, 1, 1)
        return (a * x0 + s * noise).to(x0.dtype)

    def loss(
        self, model: nn.Module, x0: torch.Tensor, y: torch.Tensor | None = None, null_label: int | None = None
    ) -> torch.Tensor:
        """The paper's simple loss: E ||ε - ε_θ(x_t, t)||², t ~ U{0..T-1}, averaged over every element; with
        param="edm", EDM's loss (edm_loss) at the same timesteps' noise levels, the network fed t as its time.

        With labels y, a p_uncond fraction is replaced by ``null_label`` (the model's num_classes) so the same
        network also learns the unconditional ε for classifier-free guidance."""
        B = x0.shape[0]
        t = torch.randint(0, self.num_timesteps, (B,), device=x0.device)
        if y is not None and self.cfg.p_uncond > 0:
            y = drop_labels(y, self.cfg.p_uncond, null_label)
        if self.cfg.param == "edm":
            return edm_loss(model, x0, self.sigmas[t], t, y, self.cfg.sigma_data)
        noise = torch.randn_like(x0)  # keeps x0's memory format (channels_last stays channels_last)
        eps = model(self.q_sample(x0, t, noise), t, y)
        return F.mse_loss(eps.float(), noise.float())

    @torch.no_grad()
    def sample(
        self,
        model: nn.Module,
        n: int,
        *,
        sampler: str = "ddpm",
        steps: int = 50,
        eta: float = 0.0,
        seed: int = 0,
        y: torch.Tensor | None = None,
        guidance_scale: float = 1.0,
        null_label: int | None = None,
        shape: tuple[int, int, int] = (3, 32, 32),
        device: torch.device | str | None = None,
        clip: str = "static",
        memory_format: torch.memory_format = torch.contiguous_format,
    ) -> torch.Tensor:
        """n images as a uint8 (n, C, H, W) tensor on `device` (default: the schedule's device).

        sampler="ddpm": ancestral sampling over all T steps with σ_t² = β_t (the paper's CIFAR-10 setting).
        sampler="ddim": `steps` evenly spaced steps, σ_t = eta · sqrt((1-ᾱ_prev)/(1-ᾱ_t)) · sqrt(1-ᾱ_t/ᾱ_prev);
        eta=0 is deterministic given the starting noise, eta=1 matches DDPM's posterior variance.
        With labels y and guidance_scale != 1, ε = ε_uncond + s (ε_cond - ε_uncond), conditional and unconditional
        halves batched in one forward; null_label defaults to the model's ``num_classes``. clip: what is done to the
        predicted x0 at each step (clip_x0: "static" clamps it to [-1, 1], "dynamic", "off"). The same seed on the
        same device gives the same images. The model is put in eval mode for the call (dropout off) and restored
        after."""
        device = torch.device(device) if device is not None else self.betas.device
        if sampler not in ("ddpm", "ddim"):
            raise ValueError(f"sampler={sampler!r}: use 'ddpm' or 'ddim'")
        if clip not in CLIPS:
            raise ValueError(f"clip={clip!r}: use one of {', '.join(CLIPS)}")
        if n < 1:
            raise ValueError(f"n={n} must be >= 1")
        eps_fn = eps_predictor(model, n, device, y, guidance_scale, null_label)
        gen = torch.Generator(device=device).manual_seed(seed)
        randn = lambda: torch.randn((n, *shape), generator=gen, device=device).contiguous(  # noqa: E731
            memory_format=memory_format
        )
        ts = timesteps_for_sampling(self.num_timesteps, self.num_timesteps if sampler == "ddpm" else steps)
        abar = self._abar64.tolist()
        betas = self._betas64.tolist()

        was_training = model.training
        model.eval()
        try:
            x = randn()
            for i, t in enumerate(ts):
                t_prev = ts[i + 1] if i + 1 < len(ts) else -1
                a_t, a_prev = abar[t], (abar[t_prev] if t_prev >= 0 else 1.0)
                x0 = clip_x0(self.predict_x0(eps_fn, x, a_t, t), clip)
                if sampler == "ddpm":
                    # Posterior mean of q(x_{t-1} | x_t, x0) (Ho et al. eq. 7), σ_t² = β_t.
                    b_t = betas[t]
                    mean = (b_t * math.sqrt(a_prev) * x0 + (1 - a_prev) * math.sqrt(1 - b_t) * x) / (1 - a_t)
                    sigma = math.sqrt(b_t)
                else:
                    eps = (x - math.sqrt(a_t) * x0) / math.sqrt(1 - a_t)  # ε consistent with the (clipped) x0
                    sigma = eta * math.sqrt((1 - a_prev) / (1 - a_t) * (1 - a_t / a_prev))
                    mean = math.sqrt(a_prev) * x0 + math.sqrt(max(1 - a_prev - sigma**2, 0.0)) * eps
                x = mean + sigma * randn() if (t_prev >= 0 and sigma > 0) else mean
        finally:
            model.train(was_training)
        return to_uint8(x)

    def predict_x0(self, net: Callable[[torch.Tensor, float], torch.Tensor], x: torch.Tensor, abar: float,
                   t: int | float) -> torch.Tensor:
        """The x0 prediction at x_t = sqrt(ᾱ) x0 + sqrt(1 - ᾱ) ε from net(input, t) (eps_predictor: the network
        with guidance), read as the config's param says."""
        if self.cfg.param == "eps":
            return (x - math.sqrt(1 - abar) * net(x, t)) / math.sqrt(abar)
        c_skip, c_out, c_in = edm_scalings(math.sqrt((1 - abar) / abar), self.cfg.sigma_data)
        xh = x / math.sqrt(abar)
        return c_skip * xh + c_out * net(xh * c_in, t)


def save_grid(images: torch.Tensor, path: str | os.PathLike, nrow: int | None = None, padding: int = 2) -> None:
    """Writes uint8 images (N, C, H, W), C in {1, 3}, as one PNG grid (nrow per row, default ~sqrt(N)), atomically."""
    from PIL import Image

    if images.dtype != torch.uint8 or images.dim() != 4 or images.shape[1] not in (1, 3):
        raise ValueError(f"save_grid needs uint8 (N, 1|3, H, W) images, got {images.dtype} {tuple(images.shape)}")
    N, C, H, W = images.shape
    nrow = nrow or math.ceil(math.sqrt(N))
    rows = math.ceil(N / nrow)
    grid = torch.zeros(C, rows * (H + padding) + padding, nrow * (W + padding) + padding, dtype=torch.uint8)
    for i, img in enumerate(images.cpu()):
        r, c = divmod(i, nrow)
        top, left = padding + r * (H + padding), padding + c * (W + padding)
        grid[:, top : top + H, left : left + W] = img
    arr = grid.permute(1, 2, 0).numpy()  # (C, H, W) -> (H, W, C)
    pil = Image.fromarray(arr[:, :, 0] if C == 1 else arr)

    path = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".grid-", suffix=".png")
    os.fchmod(fd, 0o666 & ~umask())  # mkstemp makes 0600; the grid is as readable as the run's other files
    try:
        with os.fdopen(fd, "wb") as f:
            pil.save(f, format="PNG")
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
