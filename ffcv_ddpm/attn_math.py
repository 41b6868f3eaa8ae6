"""The explicit matmul-softmax attention of one head, with a backward that writes q, k and v's gradients as one tensor
(model.attn_impl=math-qkv, NOTES item 55).

With attn_linear the attention's q, k and v are the three thirds of one (B, N, 3C) GEMM output, and the qkv GEMM's
backward wants their gradients as one (B, N, 3C) tensor again. Written by three separate batched GEMMs, autograd
then stacks them with a copy (inductor's `clone_permute_stack` kernels: ~1.0 ms a step of 1024 on an H200, plus the
bias gradient's reduction that reads the three; NOTES item 54's profile). Here the three GEMMs write their thirds of
one tensor in place (cuBLAS with a leading dimension of 3C), an op of its own (`qkv_grads`) so that the compiled
step cannot put a copy back. Everything else stays in the traced graph, where inductor fuses the softmax and its
backward as it does for model.attn_impl=math; the arithmetic is that path's under autocast, rounding for rounding:
the scores in the activations' dtype and scaled there, the softmax in fp32, its output rounded for `@ v`, and in
the backward the softmax's gradient in fp32, rounded, then scaled.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.utils.flop_counter import register_flop_formula


class MathAttention(torch.autograd.Function):
    """softmax(q k^T * scale) v for one head, q, k, v = qkv's thirds along its last dim: (B, N, 3C) -> (B, N, C)."""

    @staticmethod
    def forward(ctx, qkv: Tensor, scale: float) -> Tensor:
        c = qkv.shape[-1] // 3
        q, k, v = qkv[..., :c], qkv[..., c:2 * c], qkv[..., 2 * c:]
        s = torch.bmm(q, k.transpose(1, 2)) * scale  # (B, N, N) in qkv's dtype, as autocast's matmul and the multiply
        p = torch.softmax(_wide(s), -1).to(qkv.dtype)  # autocast runs softmax in fp32; @ v casts its output back
        ctx.save_for_backward(qkv, s, p)
        ctx.scale = scale
        return torch.bmm(p, v)

    @staticmethod
    def backward(ctx, do: Tensor):
        qkv, s, p = ctx.saved_tensors
        c = qkv.shape[-1] // 3
        dp = _wide(torch.bmm(do.to(qkv.dtype), qkv[..., 2 * c:].transpose(1, 2)))
        p32 = torch.softmax(_wide(s), -1)  # the forward's fp32 softmax again: inductor fuses it into the backward's
        ds = (p32 * (dp - (p32 * dp).sum(-1, keepdim=True))).to(qkv.dtype) * ctx.scale
        return qkv_grads(ds, p, do.to(qkv.dtype), qkv), None


def _wide(t: Tensor) -> Tensor:
    """t in the dtype autocast runs softmax in: fp32 for bf16 and fp16, else its own (fp32, and fp64 in the tests)."""
    return t.to(torch.promote_types(t.dtype, torch.float32))


def math_attention(qkv: Tensor) -> Tensor:
    """One head's attention over qkv (B, N, 3C) -> (B, N, C), scaled by C^-1/2 (unet.attention's math path)."""
    if qkv.dim() != 3 or qkv.shape[-1] % 3:
        raise ValueError(f"math_attention: qkv must be (B, N, 3C), got {tuple(qkv.shape)}")
    return MathAttention.apply(qkv, (qkv.shape[-1] // 3) ** -0.5)


@torch.library.custom_op("ffcv_ddpm::qkv_grads", mutates_args=())
def qkv_grads(ds: Tensor, p: Tensor, do: Tensor, qkv: Tensor) -> Tensor:
    """(dq, dk, dv) as one (B, N, 3C) tensor: dq = ds k, dk = ds^T q, dv = p^T do, each GEMM writing its third in
    place (bmm's out, a strided view: cuBLAS takes the leading dimension 3C, no copy)."""
    c = qkv.shape[-1] // 3
    out = torch.empty(qkv.shape, dtype=ds.dtype, device=ds.device)
    torch.bmm(ds, qkv[..., c:2 * c], out=out[..., :c])
    torch.bmm(ds.transpose(1, 2), qkv[..., :c], out=out[..., c:2 * c])
    torch.bmm(p.transpose(1, 2), do, out=out[..., 2 * c:])
    return out


@qkv_grads.register_fake
def _(ds, p, do, qkv):
    return torch.empty(qkv.shape, dtype=ds.dtype, device=ds.device)


@register_flop_formula(torch.ops.ffcv_ddpm.qkv_grads)
def _qkv_grads_flops(ds_shape, p_shape, do_shape, qkv_shape, *args, out_shape=None, **kwargs) -> int:
    """Three batched GEMMs of (N x N) by (N x C), as aten.bmm's formula counts each: 2 B N N C."""
    b, n, c3 = qkv_shape
    return 3 * 2 * b * n * n * (c3 // 3)
