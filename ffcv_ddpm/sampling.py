"""Sampling at compiled speed: the denoiser compiled for the one shape a sampler calls it with, CUDA graphs optional.

    net = compile_denoiser(ema_model, "reduce-overhead")     # a module with the model's call signature
    images = diffusion.sample(net, 256, sampler="ddim", steps=50, seed=0, device="cuda")   # any sampler, unchanged
    images, nfe = sample(process, net, 256, sampler="pc", steps=100)                      # ffcv_ddpm.sde_sampling

A sampler calls the network tens to thousands of times with one input shape (n images, or 2n with guidance) and
nothing else changes between calls but the values of x and t: exactly what a graph compiled once for that shape
(dynamic=False) serves. Modes (SAMPLE_COMPILE_MODES): "off" is the eager model; "default" inductor's kernels (fused
elementwise work, no per-op dispatch); "reduce-overhead" the same kernels replayed as a CUDA graph, one launch per
network call instead of hundreds, which is what a small batch needs; "max-autotune-no-cudagraphs" autotunes the
matmuls and convolutions too (minutes of compiling). The first call at a new shape compiles (kept in the compile
cache folder, ffcv_ddpm.env.compile_cache); a CUDA graph is recorded at the second call and replayed from the third.

The wrapper keeps the eager module's attributes and modes (eval(), num_classes, parameters()), so every sampler of
ffcv_ddpm.diffusion and ffcv_ddpm.sde_sampling takes it in place of the model, and the weights it reads are the
model's own: an EMA updated in place is sampled with its current weights without recompiling.
"""

from __future__ import annotations

import torch
from torch import nn

from ffcv_ddpm.unet import null_labels

SAMPLE_COMPILE_MODES = ("off", "default", "reduce-overhead", "max-autotune-no-cudagraphs")


class CompiledDenoiser(nn.Module):
    """`model` compiled for sampling (see the module docstring); call it as the model: (x, t, y=None) -> ε."""

    def __init__(self, model: nn.Module, mode: str):
        super().__init__()
        self.model = model  # the eager module: its parameters and weights are the ones this module computes with
        self.mode = mode
        self.train(model.training)  # a new Module starts in training mode; a sampler restores the mode it found
        self.cudagraphs = mode == "reduce-overhead"
        # Not a registered submodule: state_dict() and parameters() stay the model's, without _orig_mod. duplicates.
        object.__setattr__(self, "_compiled", torch.compile(model, mode=None if mode == "default" else mode,
                                                            dynamic=False))

    @property
    def num_classes(self) -> int:
        return getattr(self.model, "num_classes", 0)

    def forward(self, x: torch.Tensor, t: torch.Tensor, y: torch.Tensor | None = None) -> torch.Tensor:
        if y is None and self.num_classes:
            # The null label, as the model itself fills it in: unconditional and labelled calls at one batch are one
            # graph (y=None would be a guard of its own, and a second compilation: ~30 s of a tiny UNet on a CPU).
            y = null_labels(t, self.num_classes)
        if self.cudagraphs:
            # Each call is a new step: the graph may overwrite the previous call's output buffer, which the clone
            # below has already copied out (a sampler may still hold it, e.g. an ODE solver's stages).
            torch.compiler.cudagraph_mark_step_begin()
            return self._compiled(x, t, y).clone()
        return self._compiled(x, t, y)


def compile_denoiser(model: nn.Module, mode: str = "reduce-overhead") -> nn.Module:
    """The model for a sampler: itself for mode "off", else a CompiledDenoiser (compiled lazily, at its first call).

    CUDA graphs need a CUDA model; on a CPU "reduce-overhead" compiles as "default" would (inductor skips the graph)."""
    if mode not in SAMPLE_COMPILE_MODES:
        raise ValueError(f"sample compile mode {mode!r}: use one of {', '.join(SAMPLE_COMPILE_MODES)}")
    if mode == "off":
        return model
    from ffcv_ddpm.env import compile_cache

    compile_cache()  # the compiled sampler is kept for the next process
    return CompiledDenoiser(model, mode)
