"""GroupNorm and what follows it in the UNets' blocks, in three implementations chosen by `model.norm_impl`.

    GroupNormAct(groups, channels, silu=True, dropout=0.1)(x, add=temb)  # dropout(silu(GroupNorm(x + temb)))

- "torch": nn.GroupNorm, then F.silu and F.dropout: the reference, what the DDPM code wrote.
- "scale-shift": GroupNorm as x * scale + shift (scale_shift_group_norm), which keeps channels_last through
  torch.compile (inductor's own GroupNorm lowering returns NCHW on GPUs).
- "fused": one Triton kernel forward and one backward (ffcv_ddpm.gn_kernels) for GroupNorm + the optional add
  before it + the optional FiLM after it + SiLU + dropout, as the custom op ffcv_ddpm::group_norm_act that
  torch.compile keeps as one call. Statistics in fp32, output in the input's dtype, the dropout mask regenerated
  in the backward from a seed instead of stored. On CPU tensors the op runs `reference_forward`, plain torch.

All three have nn.GroupNorm's parameters and state_dict keys, so a checkpoint loads into any of them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

NORM_IMPLS = ("torch", "scale-shift", "fused")


def scale_shift_group_norm(x: Tensor, groups: int, weight: Tensor | None, bias: Tensor | None, eps: float) -> Tensor:
    """GroupNorm computed as x * scale + shift with a scale and shift per (sample, channel): the output and the
    gradient it returns keep the input's memory layout.

    Why: inductor lowers nn.GroupNorm through torch._refs.native_group_norm, which on GPUs normalises a
    reshape(N, G, C/G, H*W) of the input and views it back, so a channels_last input comes out NCHW-contiguous and
    cuDNN's convolution backward must convert it back (benchmarks/NOTES.md, attempt 4).
    Statistics: a Welford mean and variance per channel over H, W (a reduction with no layout to impose), combined
    per group by the law of total variance (channels of a group count equally).
    """
    n, c = x.shape[:2]
    g, k = groups, c // groups
    xf = x.to(torch.promote_types(x.dtype, torch.float32))  # statistics in fp32 at least, as group_norm's
    var_c, mean_c = torch.var_mean(xf, dim=tuple(range(2, x.dim())), unbiased=False)  # (N, C) each
    mean_c, var_c = mean_c.view(n, g, k), var_c.view(n, g, k)
    mean = mean_c.mean(2, keepdim=True)  # (N, G, 1)
    var = var_c.mean(2, keepdim=True) + (mean_c - mean).square().mean(2, keepdim=True)  # within + between
    scale = torch.rsqrt(var + eps).expand(n, g, k)
    if weight is not None:
        scale = scale * weight.to(xf.dtype).view(1, g, k)
    shift = -mean * scale
    if bias is not None:
        shift = shift + bias.to(xf.dtype).view(1, g, k)
    per_channel = (n, c) + (1,) * (x.dim() - 2)
    out = xf * scale.reshape(per_channel) + shift.reshape(per_channel)
    # What nn.GroupNorm returns: fp32 under CUDA autocast (group_norm is on its fp32 list), else the input's dtype
    # (CPU autocast runs group_norm in the lower precision).
    keep_fp32 = x.device.type == "cuda" and torch.is_autocast_enabled("cuda")
    return out if keep_fp32 else out.to(x.dtype)


class GroupNormAct(nn.GroupNorm):
    """dropout(act(GroupNorm(x + add) * (1 + scale) + shift)): everything the UNets do between two convolutions.

    `add` (N, C) is added to x before normalisation (the DDPM block's time embedding); `film` = (scale, shift), each
    (N, C), modulates the normalised output (the annotated block's FiLM); act is SiLU or nothing; dropout is active
    in training mode only. Parameters and state_dict keys are nn.GroupNorm's.
    """

    def __init__(self, num_groups: int, num_channels: int, impl: str = "torch", silu: bool = True,
                 dropout: float = 0.0, eps: float = 1e-5):
        super().__init__(num_groups, num_channels, eps=eps)
        if impl not in NORM_IMPLS:
            raise ValueError(f"norm_impl={impl!r}: use one of {', '.join(map(repr, NORM_IMPLS))}")
        self.impl = impl  # "torch" | "scale-shift" | "fused"
        self.silu = silu  # SiLU after the normalisation (False: the attention block's plain GroupNorm)
        self.p = dropout  # dropout probability after the activation

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, impl={self.impl}, silu={self.silu}, dropout={self.p}"

    def forward(self, x: Tensor, add: Tensor | None = None, film: tuple[Tensor, Tensor] | None = None) -> Tensor:
        if self.impl == "fused":
            return self._fused(x, add, film)
        if add is not None:
            x = x + add[:, :, None, None]  # (N, C) -> (N, C, 1, 1)
        norm = F.group_norm if self.impl == "torch" else scale_shift_group_norm
        y = norm(x, self.num_groups, self.weight, self.bias, self.eps)
        if film is not None:
            y = y * (film[0][:, :, None, None] + 1) + film[1][:, :, None, None]
        if self.silu:
            y = F.silu(y)
        return F.dropout(y, self.p, self.training) if self.p else y

    def _fused(self, x: Tensor, add: Tensor | None, film: tuple[Tensor, Tensor] | None) -> Tensor:
        n = x.shape[0]
        dt = torch.promote_types(x.dtype, torch.float32)  # fp32 (fp64 for fp64 inputs)
        # The affine after normalisation, per (sample, channel): y = xhat * a + b.
        a, b = self.weight.to(dt).expand(n, -1), self.bias.to(dt).expand(n, -1)
        if film is not None:
            scale, shift = film[0].to(dt), film[1].to(dt)
            a, b = a * (scale + 1), b * (scale + 1) + shift
        p = self.p if self.training else 0.0
        # A fresh mask per call, drawn on the device (no host sync); the backward regenerates it from this seed.
        seed = (torch.randint(0, 2**31 - 1, (1,), device=x.device) if p > 0
                else torch.zeros(1, dtype=torch.int64, device=x.device))
        out, _, _ = torch.ops.ffcv_ddpm.group_norm_act(x, a.contiguous(), b.contiguous(),
                                                       None if add is None else add.to(dt).contiguous(),
                                                       seed, self.num_groups, self.eps, self.silu, p)
        return out


# ---------------------------------------------------------------------------------------------------- the op


@torch.library.custom_op("ffcv_ddpm::group_norm_act", mutates_args=())
def group_norm_act(x: Tensor, a: Tensor, b: Tensor, e: Tensor | None, seed: Tensor, groups: int, eps: float,
                   silu: bool, p: float) -> tuple[Tensor, Tensor, Tensor]:
    """(out, mean, rstd): out as GroupNormAct describes, mean and rstd (N, groups) fp32 for the backward."""
    if x.device.type == "cuda":
        return triton_forward(x, a, b, e, seed, groups, eps, silu, p)
    return reference_forward(x, a, b, e, seed, groups, eps, silu, p)


@group_norm_act.register_fake
def _(x, a, b, e, seed, groups, eps, silu, p):
    stats = x.new_empty((x.shape[0], groups), dtype=torch.float32)
    return torch.empty_like(x), stats, stats.clone()


@torch.library.custom_op("ffcv_ddpm::group_norm_act_backward", mutates_args=())
def group_norm_act_backward(dout: Tensor, x: Tensor, a: Tensor, b: Tensor, e: Tensor | None, seed: Tensor,
                            mean: Tensor, rstd: Tensor, groups: int, eps: float, silu: bool, p: float
                            ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(dx, da, db, de): de is empty when there was no add."""
    if x.device.type == "cuda":
        return triton_backward(dout, x, a, b, e, seed, mean, rstd, groups, silu, p)
    return reference_backward(dout, x, a, b, e, seed, groups, eps, silu, p)


@group_norm_act_backward.register_fake
def _(dout, x, a, b, e, seed, mean, rstd, groups, eps, silu, p):
    return torch.empty_like(x), torch.empty_like(a), torch.empty_like(b), a.new_empty(a.shape if e is not None else 0)


def _setup_context(ctx, inputs, output):
    x, a, b, e, seed, groups, eps, silu, p = inputs
    ctx.save_for_backward(x, a, b, e, seed, output[1], output[2])
    ctx.args = (groups, eps, silu, p)


def _backward(ctx, dout, _dmean, _drstd):
    x, a, b, e, seed, mean, rstd = ctx.saved_tensors
    dx, da, db, de = group_norm_act_backward(dout, x, a, b, e, seed, mean, rstd, *ctx.args)
    return dx, da, db, (de if e is not None else None), None, None, None, None, None


group_norm_act.register_autograd(_backward, setup_context=_setup_context)


# ---------------------------------------------------------------------------------------------------- Triton


# Elements per [BLOCK_HW, C] tile and warps per program (None: by tile size); module-level so that
# benchmarks.norm_bench can sweep them.
TILE_ELEMENTS = 4096
NUM_WARPS = None


def _plan(x: Tensor, groups: int) -> dict:
    """Tile sizes and the split of each sample's positions into K chunks (see ffcv_ddpm.gn_kernels)."""
    import triton

    if x.device.type != "cuda" and not triton.knobs.runtime.interpret:
        raise RuntimeError("the fused GroupNorm's Triton kernels run on CUDA tensors, or on CPU tensors under "
                           "Triton's interpreter (TRITON_INTERPRET=1 set before triton is imported)")

    n, c = x.shape[:2]
    hw = x[0, 0].numel()
    cpg = c // groups
    block_g, block_cpg = triton.next_power_of_2(groups), triton.next_power_of_2(cpg)
    if block_g * block_cpg > 8192:
        raise ValueError(f"the fused GroupNorm handles up to 8192 channels per tile, got {c}; use model.norm_impl=torch")
    block_hw = max(1, min(triton.next_power_of_2(hw), TILE_ELEMENTS // (block_g * block_cpg)))
    sms = 4 if x.device.type != "cuda" else torch.cuda.get_device_properties(x.device).multi_processor_count
    if n >= 2 * sms:  # one program per sample already fills the GPU: both passes in one launch
        k, chunk = 1, hw
    else:
        k = min(triton.cdiv(hw, block_hw), triton.cdiv(2 * sms, n))
        chunk = triton.cdiv(triton.cdiv(hw, k), block_hw) * block_hw
        k = triton.cdiv(hw, chunk)
    return dict(C=c, HW=hw, G=groups, CPG=cpg, K=k, CHUNK=chunk, BLOCK_HW=block_hw, BLOCK_G=block_g,
                BLOCK_CPG=block_cpg, BLOCK_K=triton.next_power_of_2(k),
                num_warps=NUM_WARPS or (4 if block_hw * block_g * block_cpg <= 2048 else 8))


def _nchw_strides(t: Tensor) -> tuple[int, int, int]:
    """(n, c, hw) strides of an (N, C, H, W) tensor whose H and W merge into one axis (NCHW and channels_last do)."""
    if t.dim() == 4 and t.shape[3] > 1 and t.shape[2] > 1 and t.stride(2) != t.shape[3] * t.stride(3):
        raise ValueError(f"fused GroupNorm: H and W of a tensor with strides {t.stride()} cannot be merged")
    return t.stride(0), t.stride(1), t.stride(-1)


def _run_passes(kernel, x: Tensor, plan: dict, args: tuple, **flags) -> None:
    """Both passes in one launch (K == 1), or the partial-sums launch then the dependent one."""
    n, k = x.shape[0], plan["K"]
    meta = {name: plan[name] for name in ("CHUNK", "BLOCK_HW", "BLOCK_G", "BLOCK_CPG", "BLOCK_K", "num_warps")}
    for passes in ((0, 2),) if k == 1 else ((0, 1), (1, 2)):
        kernel[(n, k)](*args, **meta, PASS0=passes[0], PASS1=passes[1], **flags)


def triton_forward(x, a, b, e, seed, groups, eps, silu, p):
    """The op's forward through the Triton kernel."""
    from ffcv_ddpm import gn_kernels

    plan = _plan(x, groups)
    n, c = x.shape[:2]
    out = torch.empty_like(x)
    if out.stride() != x.stride():
        raise ValueError(f"fused GroupNorm: input strides {x.stride()} are not those of a dense tensor")
    mean = x.new_empty((n, groups), dtype=torch.float32)
    rstd = torch.empty_like(mean)
    part = x.new_empty((n, plan["K"], 2, c) if plan["K"] > 1 else 1, dtype=torch.float32)
    e_ = a if e is None else e  # any tensor: not read when HAS_ADD is off
    args = (x, out, a, b, e_, seed, part, mean, rstd, c, plan["HW"], groups, plan["CPG"], plan["K"],
            *_nchw_strides(x), a.stride(0), a.stride(1), e_.stride(0), e_.stride(1), eps, p)
    _run_passes(gn_kernels._gn_fwd_kernel, x, plan, args,
                HAS_ADD=e is not None, SILU=silu, DROPOUT=p > 0)
    return out, mean, rstd


def triton_backward(dout, x, a, b, e, seed, mean, rstd, groups, silu, p):
    from ffcv_ddpm import gn_kernels

    plan = _plan(x, groups)
    n, c, k = x.shape[0], x.shape[1], plan["K"]
    dx = torch.empty_like(x)
    part = x.new_empty((n, k, 2, c) if k > 1 else 1, dtype=torch.float32)
    da, db = (x.new_empty((n, c), dtype=torch.float32) for _ in range(2))
    de = x.new_empty((n, k, c) if e is not None else 1, dtype=torch.float32)
    e_ = a if e is None else e
    args = (dout, x, dx, a, b, e_, seed, mean, rstd, part, da, db, de, c, plan["HW"], groups, plan["CPG"], k,
            *_nchw_strides(x), *_nchw_strides(dout), a.stride(0), a.stride(1),
            e_.stride(0), e_.stride(1), p)
    _run_passes(gn_kernels._gn_bwd_kernel, x, plan, args,
                HAS_ADD=e is not None, SILU=silu, DROPOUT=p > 0)
    de = de.sum(1) if e is not None else x.new_empty(0, dtype=torch.float32)
    return dx, da, db, de


# ---------------------------------------------------------------------------------------------------- reference


def keep_mask(seed: Tensor, shape: tuple[int, ...], p: float) -> Tensor:
    """The CPU op's dropout mask (True = kept) for an (N, C, H, W) output: a hash of the seed and each element's
    logical index, so the backward draws the same mask. (The Triton kernels use Philox: the two differ.)"""
    n, c, h, w = shape
    idx = torch.arange(n * h * w * c, dtype=torch.int64).view(n, h, w, c).permute(0, 3, 1, 2)  # (n, hw, c) order
    z = (idx + seed.cpu().to(torch.int64) * 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFF
    for mult, shift in ((0xBF58476D1CE4E5B9, 31), (0x94D049BB133111EB, 29)):  # splitmix64-style mixing, 48 bits
        z = ((z ^ (z >> shift)) * mult) & 0xFFFFFFFFFFFF
    return (z >> 24).to(torch.float64) / float(1 << 24) >= p


def _reference_math(x, a, b, e, seed, groups, eps, silu, p):
    """(out, mean, rstd, xhat, y): the forward in x's precision (fp32 at least), keeping what the backward needs."""
    n, c = x.shape[:2]
    xf = x.to(torch.promote_types(x.dtype, torch.float32))
    if e is not None:
        xf = xf + e.to(xf.dtype)[:, :, None, None]
    var, mean = torch.var_mean(xf.reshape(n, groups, -1), dim=2, unbiased=False)  # (N, G)
    rstd = torch.rsqrt(var + eps)
    xhat = ((xf.reshape(n, groups, -1) - mean[:, :, None]) * rstd[:, :, None]).view_as(xf)
    y = xhat * a.to(xf.dtype)[:, :, None, None] + b.to(xf.dtype)[:, :, None, None]
    out = F.silu(y) if silu else y
    if p > 0:
        out = torch.where(keep_mask(seed, tuple(x.shape), p).to(out.device), out / (1 - p), 0.0)
    return out, mean, rstd, xhat, y


def reference_forward(x, a, b, e, seed, groups, eps, silu, p):
    """The op in plain torch (its CPU kernel)."""
    out, mean, rstd, _, _ = _reference_math(x, a, b, e, seed, groups, eps, silu, p)
    return out.to(x.dtype).contiguous(memory_format=_format(x)), mean.float(), rstd.float()


def reference_backward(dout, x, a, b, e, seed, groups, eps, silu, p):
    """The op's backward in plain torch (its CPU kernel): the same formulas as the Triton kernel. (Not autograd: a
    custom op's kernel runs below the autograd dispatch key.)"""
    n, c = x.shape[:2]
    _, _, rstd, xhat, y = _reference_math(x, a, b, e, seed, groups, eps, silu, 0.0)
    dy = dout.to(xhat.dtype)
    if p > 0:
        dy = torch.where(keep_mask(seed, tuple(x.shape), p).to(dy.device), dy / (1 - p), 0.0)
    if silu:
        sig = torch.sigmoid(y)
        dy = dy * sig * (1 + y * (1 - sig))
    da, db = (dy * xhat).sum((2, 3)), dy.sum((2, 3))  # (N, C)
    dxhat = (dy * a.to(dy.dtype)[:, :, None, None]).reshape(n, groups, -1)
    xg = xhat.reshape(n, groups, -1)
    dx = (dxhat - dxhat.mean(2, keepdim=True) - xg * (dxhat * xg).mean(2, keepdim=True)) * rstd.to(dy.dtype)[:, :, None]
    dx = dx.view_as(xhat)
    de = dx.sum((2, 3)).to(e.dtype) if e is not None else x.new_empty(0, dtype=torch.float32)
    return dx.to(x.dtype).contiguous(memory_format=_format(x)), da.to(a.dtype), db.to(b.dtype), de


def _format(x: Tensor) -> torch.memory_format:
    return torch.channels_last if x.dim() == 4 and x.is_contiguous(memory_format=torch.channels_last) \
        and not x.is_contiguous() else torch.contiguous_format
