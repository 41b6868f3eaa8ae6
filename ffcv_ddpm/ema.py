"""Exponential moving average of model weights, updated with foreach kernels and no host sync.

Build it from the uncompiled module (after moving it to its device), call ``update(model)`` after each optimizer
step, sample and evaluate with ``ema.module``. Checkpoint ``ema.state_dict()``.
"""

from __future__ import annotations

import copy

import torch
from torch import nn


class EMA:
    """θ_ema <- d θ_ema + (1 - d) θ on every update; buffers are copied.

    d is the plain float ``decay`` (0.9999 as in the DDPM paper). With ``warmup=True`` (off by default) the step's
    decay is min(decay, (1 + n) / (10 + n)) for the n-th update, computed on the device from a step counter tensor,
    so early averages are not dominated by the random initialisation."""

    def __init__(self, model: nn.Module, decay: float = 0.9999, warmup: bool = False):
        if not 0.0 <= decay <= 1.0:
            raise ValueError(f"EMA decay={decay} must be in [0, 1] (0.9999 is the DDPM paper's)")
        self.decay = decay  # weight kept from the running average each update
        self.warmup = warmup  # ramp the decay up from 0.1 over the first updates
        self.module = copy.deepcopy(model).eval().requires_grad_(False)
        self._params = list(self.module.parameters())
        self._buffers = list(self.module.buffers())
        device = self._params[0].device if self._params else torch.device("cpu")
        self.step = torch.zeros((), dtype=torch.int64, device=device)  # updates so far; a tensor, never read on host

    @torch.no_grad()
    def update(self, model: nn.Module) -> None:
        params = list(model.parameters())
        buffers = list(model.buffers())
        if len(params) != len(self._params) or len(buffers) != len(self._buffers):
            raise ValueError(
                f"EMA was built from a model with {len(self._params)} parameters and {len(self._buffers)} buffers; "
                f"update() got {len(params)} and {len(buffers)}: pass the same (uncompiled) module"
            )
        if self.warmup:
            d = torch.clamp((1 + self.step) / (10 + self.step), max=self.decay)  # 0-d float tensor on the device
            delta = torch._foreach_sub(params, self._params)  # θ - θ_ema
            torch._foreach_mul_(delta, 1 - d)
            torch._foreach_add_(self._params, delta)
        else:
            torch._foreach_lerp_(self._params, params, 1.0 - self.decay)  # θ_ema + (1-d)(θ - θ_ema)
        for mine, theirs in zip(self._buffers, buffers):
            mine.copy_(theirs)
        self.step += 1

    def state_dict(self) -> dict:
        return {"module": self.module.state_dict(), "step": self.step, "decay": self.decay, "warmup": self.warmup}

    def load_state_dict(self, state: dict) -> None:
        """Restores the averaged weights and the step count; decay and warmup stay as constructed."""
        self.module.load_state_dict(state["module"])
        self.step.copy_(state["step"])
