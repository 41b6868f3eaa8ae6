"""A 3x3 convolution that owns its GroupNorm (issue 47, step 1: the forward): a Triton implicit-GEMM convolution that
normalises its input as it loads it and writes the statistics of its output for the next GroupNorm.

    out  = conv3x3(act(x), w) + bias (+ res)           channels_last, bf16 operands, fp32 accumulation
    act(x) = keep * silu(x * scale[n, c] + shift[n, c]) / (1 - p)     (each part optional; zero padding is act's)
    part[n, k, 0:2, co] = (mean, M2) of out[n, co] over the rows of tile k of sample n

- The prologue's (scale, shift) per (sample, channel) is the `coef` that gn_kernels._finalize_kernel writes: the
  group statistics, the GroupNorm affine and a FiLM or time-embedding term in one multiply-add. `finalize` runs that
  kernel on this convolution's `part`, so a chain conv -> finalize -> conv never reads an activation for statistics.
- Dropout's mask is a bit per element (`keep_bits`: the hash of gn_kernels._keep, so norm.keep_mask is the same
  mask), made once, read by the prologue and replayable by a backward; the 1 / (1 - p) is applied to the
  accumulator (the convolution is linear), so the prologue only selects.
- The epilogue adds a bias per channel or per (sample, channel) (the time embedding), an optional residual, writes
  the output and, per tile, each sample's per-channel mean and M2 (centred on the tile's mean: no cancellation when
  |mean| >> std), Chan-combined by the finalize kernel. Per channel rather than per group, so that a consumer that
  groups differently (the up path's concatenation (h, skip)) can still combine them.
- Two parts: the input may be the parts of a channel concatenation, read where they lie (model.fused_parts).

On CPU tensors the kernels run only under Triton's interpreter (TRITON_INTERPRET=1 before triton is imported), as
tests/test_conv_gn.py does; `reference` is the same function in plain torch.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import Tensor

from ffcv_ddpm import gn_kernels
from ffcv_ddpm.gn_kernels import _silu_half  # SiLU through tanh.approx: one MUFU op a value
from ffcv_ddpm.norm import _dropout_args, unpack_bits  # noqa: F401  (unpack_bits: keep_bits' reader)


class TileConfig(NamedTuple):
    """How the kernel tiles the implicit GEMM: output rows (pixels) x output channels x input channels a step, and
    Triton's warps and software-pipelining depth."""
    block_m: int = 128
    block_n: int = 128
    block_k: int = 64
    warps: int = 8
    stages: int = 3


DEFAULT_CONFIG = TileConfig()


# ---------------------------------------------------------------------------------------------------- kernels


@triton.jit
def _per_sample(ptr, n0, s_n, cols, col_ok, N, SPT: tl.constexpr):
    """[SPT, cols] of a per-(sample, column) fp32 array for the SPT samples from n0 (0 past N)."""
    ns = n0 + tl.arange(0, SPT)
    return tl.load(ptr + ns[:, None] * s_n + cols[None, :], mask=(ns < N)[:, None] & col_ok[None, :], other=0.0)


@triton.jit
def _affine_by_sample(v, scale, shift, SPT: tl.constexpr):
    """v [rows, cols] (the rows: SPT samples' pixels in order) * scale + shift, both [SPT, cols], by each row's sample:
    through a [SPT, rows a sample, cols] view rather than a gather of rows x cols values."""
    ROWS: tl.constexpr = v.shape[0]
    COLS: tl.constexpr = v.shape[1]
    v3 = tl.reshape(v, (SPT, ROWS // SPT, COLS))
    return tl.reshape(v3 * scale[:, None, :] + shift[:, None, :], (ROWS, COLS))


@triton.jit
def _conv3x3_kernel(x_ptr, x2_ptr, w_ptr, out_ptr, coef_ptr, bits_ptr, bias_ptr, res_ptr, part_ptr,
                    N, H, W, C, C1, OH, OW, CO, K, CW, kc,
                    s_xn, s_xh, s_xw, s_xc, s_2n, s_2h, s_2w, s_2c,
                    s_wo, s_wi, s_wh, s_ww,
                    s_on, s_oh, s_ow, s_oc,
                    s_rn, s_rh, s_rw, s_rc,
                    s_bn, s_bc, inv_keep,
                    STRIDE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    NORM: tl.constexpr, SILU: tl.constexpr, DROPOUT: tl.constexpr, TWO: tl.constexpr,
                    HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, STATS: tl.constexpr, SPT: tl.constexpr,
                    FAST_TANH: tl.constexpr, KC: tl.constexpr, DOT_F32: tl.constexpr):
    """One [BLOCK_M pixels, BLOCK_N output channels] tile of out, K = 9 taps x C input channels in BLOCK_K steps.
    SPT: how a tile's rows lie in the samples (stats_layout): 1, all in one sample; > 1, SPT whole samples; 0,
    anywhere (per-row loads of the per-sample vectors; no statistics). kc: cdiv(C, BLOCK_K), the steps a tap; KC the
    same as a constant, or 0 (Triton's interpreter cannot loop to a run-time bound under NumPy 2.4: it gets KC, a GPU
    kc, so that one compiled kernel serves every C). DOT_F32: an fp32 product of fp32 operands (not TF32), for fp32
    inputs and for the interpreter (Triton 3.6's multiplies bf16 operands as their uint16 bits). FAST_TANH: for bf16
    operands on a GPU, SiLU through tanh.approx, whose error is under bf16's rounding."""
    pid = tl.program_id(0)
    num_n = (CO + BLOCK_N - 1) // BLOCK_N
    pid_m = pid // num_n  # a tile's output-channel blocks run next to each other: its input is read once from DRAM
    pid_n = pid - pid_m * num_n
    OHW = OH * OW
    m0 = pid_m * BLOCK_M
    m = m0 + tl.arange(0, BLOCK_M)
    row_ok = m < N * OHW
    n_r = m // OHW
    p = m - n_r * OHW
    oh = p // OW
    ow = p - oh * OW
    n0 = m0 // OHW  # the tile's first sample
    rk = tl.arange(0, BLOCK_K)
    bit = 1 << (rk % 32)  # channel c0 + k's bit in its keep word (dropout)
    co = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    co_ok = co < CO
    half = 0.5 if SILU else 1.0  # _silu_half takes y / 2: the scale and shift halved once, not y every time
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    # (KC if KC > 0 else kc) written out where used: the interpreter turns every assignment into a tensor, which
    # range() cannot take.
    for i in range(0, 9 * (KC if KC > 0 else kc)):
        tap = i // (KC if KC > 0 else kc)
        c0 = (i - tap * (KC if KC > 0 else kc)) * BLOCK_K
        kh = tap // 3
        kw = tap - kh * 3
        ih = oh * STRIDE + kh - 1
        iw = ow * STRIDE + kw - 1
        # one unsigned compare a bound: a pixel above or left of the image wraps to a large number (tl.cast, not
        # .to: Triton passes a size of 1 as a Python int)
        inside = row_ok & (ih.to(tl.uint32) < tl.cast(H, tl.uint32)) & (iw.to(tl.uint32) < tl.cast(W, tl.uint32))
        cin = c0 + rk
        c_ok = cin < C
        if TWO:  # channels below C1 from the first part, the rest from the second
            a = tl.load(x_ptr + (n_r * s_xn + ih * s_xh + iw * s_xw)[:, None] + cin[None, :] * s_xc,
                        mask=inside[:, None] & (cin < C1)[None, :], other=0.0)
            a += tl.load(x2_ptr + (n_r * s_2n + ih * s_2h + iw * s_2w)[:, None] + (cin - C1)[None, :] * s_2c,
                         mask=inside[:, None] & ((cin >= C1) & c_ok)[None, :], other=0.0)
        else:
            a = tl.load(x_ptr + (n_r * s_xn + ih * s_xh + iw * s_xw)[:, None] + cin[None, :] * s_xc,
                        mask=inside[:, None] & c_ok[None, :], other=0.0)
        if NORM:
            # y = x * scale + shift, zeroed where the convolution pads or dropout drops: SiLU(0) = 0, so one select
            # before the activation does both.
            xf = a.to(tl.float32)
            if SPT == 1:
                scale = tl.load(coef_ptr + n0 * 2 * C + cin, mask=c_ok, other=0.0) * half
                shift = tl.load(coef_ptr + n0 * 2 * C + C + cin, mask=c_ok, other=0.0) * half
                y = xf * scale[None, :] + shift[None, :]
            elif SPT > 1:
                scale = _per_sample(coef_ptr, n0, 2 * C, cin, c_ok, N, SPT) * half
                shift = _per_sample(coef_ptr + C, n0, 2 * C, cin, c_ok, N, SPT) * half
                y = _affine_by_sample(xf, scale, shift, SPT)
            else:
                at = n_r[:, None] * 2 * C + cin[None, :]
                scale = tl.load(coef_ptr + at, mask=row_ok[:, None] & c_ok[None, :], other=0.0) * half
                shift = tl.load(coef_ptr + at + C, mask=row_ok[:, None] & c_ok[None, :], other=0.0) * half
                y = xf * scale + shift
            if DROPOUT:
                # BLOCK_K / 32 words a row, each the keep bits of 32 channels (keep_bits), spread over the channels;
                # a padding row's words load as 0, so the keep test alone zeroes the padding too.
                words = c0 // 32 + tl.arange(0, BLOCK_K // 32)
                pix = (n_r * H + ih) * W + iw
                wt = tl.load(bits_ptr + pix[:, None] * CW + words[None, :],
                             mask=inside[:, None] & (words < CW)[None, :], other=0)
                wt = tl.reshape(tl.broadcast_to(wt[:, :, None], (BLOCK_M, BLOCK_K // 32, 32)), (BLOCK_M, BLOCK_K))
                y = tl.where((wt & bit[None, :]) != 0, y, 0.0)
            else:
                y = tl.where(inside[:, None], y, 0.0)
            if SILU:
                y = _silu_half(y, FAST_TANH)
            a = y.to(w_ptr.dtype.element_ty)
        b = tl.load(w_ptr + co[None, :] * s_wo + cin[:, None] * s_wi + kh * s_wh + kw * s_ww,
                    mask=c_ok[:, None] & co_ok[None, :], other=0.0)
        if DOT_F32:
            acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)

    if DROPOUT:
        acc = acc * inv_keep
    if HAS_BIAS:
        if SPT == 1:
            acc += tl.load(bias_ptr + n0 * s_bn + co * s_bc, mask=co_ok, other=0.0)[None, :]
        else:
            acc += tl.load(bias_ptr + n_r[:, None] * s_bn + co[None, :] * s_bc,
                           mask=row_ok[:, None] & co_ok[None, :], other=0.0)
    out_ok = row_ok[:, None] & co_ok[None, :]
    if HAS_RES:
        acc += tl.load(res_ptr + (n_r * s_rn + oh * s_rh + ow * s_rw)[:, None] + co[None, :] * s_rc, mask=out_ok,
                       other=0.0).to(tl.float32)
    y = acc.to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + (n_r * s_on + oh * s_oh + ow * s_ow)[:, None] + co[None, :] * s_oc, y, mask=out_ok)
    if STATS:
        # The statistics of what was stored (the next GroupNorm reads the rounded values), centred on the tile's
        # mean. A tile's rows are one sample's (SPT 1) or SPT whole samples': rows past N * OHW belong to samples
        # past N, never stored.
        yf = y.to(tl.float32)
        if SPT == 1:
            mean = tl.sum(yf, axis=0) / BLOCK_M
            d = yf - mean[None, :]
            m2 = tl.sum(d * d, axis=0)
            k = (m0 - n0 * OHW) // BLOCK_M
            dst = part_ptr + (n0 * K + k) * 2 * CO + co
            tl.store(dst, mean, mask=co_ok)
            tl.store(dst + CO, m2, mask=co_ok)
        else:
            y3 = tl.reshape(yf, (SPT, BLOCK_M // SPT, BLOCK_N))
            mean = tl.sum(y3, axis=1) / (BLOCK_M // SPT)  # [SPT, BLOCK_N]
            d = y3 - mean[:, None, :]
            m2 = tl.sum(d * d, axis=1)
            ns = n0 + tl.arange(0, SPT)
            dst = part_ptr + ns[:, None] * 2 * CO + co[None, :]  # K = 1
            ok = (ns < N)[:, None] & co_ok[None, :]
            tl.store(dst, mean, mask=ok)
            tl.store(dst + CO, m2, mask=ok)


@triton.jit
def _keep_bits_kernel(seed_ptr, bits_ptr, P, C, CW, thr24, BLOCK_P: tl.constexpr, BLOCK_W: tl.constexpr):
    """bits[r, j] bit b = keep of element (row r = n * HW + hw, channel 32 j + b), the hash of gn_kernels._keep on
    the logical index r * C + c (norm.keep_mask's)."""
    r = tl.program_id(0) * BLOCK_P + tl.arange(0, BLOCK_P)
    words = tl.arange(0, BLOCK_W)
    bit = tl.arange(0, 32)
    c = words[:, None] * 32 + bit[None, :]  # [BLOCK_W, 32]
    keep = gn_kernels._keep(r[:, None, None] * C + c[None, :, :], gn_kernels._mix_seed(seed_ptr), thr24)
    keep = keep & (c < C)[None, :, :]
    packed = tl.sum(keep.to(tl.int32) << bit[None, None, :], axis=2)  # distinct bits: the sum is their OR
    tl.store(bits_ptr + r[:, None] * CW + words[None, :], packed, mask=(r < P)[:, None] & (words < CW)[None, :])


# ---------------------------------------------------------------------------------------------------- launches


def _interpreting() -> bool:
    return bool(triton.knobs.runtime.interpret)


def _check_device(x: Tensor) -> None:
    if x.device.type != "cuda" and not _interpreting():
        raise RuntimeError("conv_gn's Triton kernels run on CUDA tensors, or on CPU tensors under Triton's "
                           "interpreter (TRITON_INTERPRET=1 set before triton is imported)")


def _nhwc_strides(t: Tensor) -> tuple[int, int, int, int]:
    """(n, h, w, c) strides of an (N, C, H, W) tensor."""
    return t.stride(0), t.stride(2), t.stride(3), t.stride(1)


def stats_layout(hw: int, block_m: int) -> tuple[int, int, int]:
    """(K, CHUNK, SPT) of the statistics a launch with `block_m` rows a tile writes at `hw` output pixels a sample:
    K chunks of CHUNK rows per sample, each tile holding SPT samples. ValueError unless one of hw and block_m
    divides the other (a tile never straddles a sample's boundary)."""
    if hw % block_m == 0:
        return hw // block_m, block_m, 1
    if block_m % hw == 0:
        return 1, hw, block_m // hw
    raise ValueError(f"conv_gn: the statistics need H*W ({hw}) and BLOCK_M ({block_m}) to divide one another")


def conv3x3(x: Tensor, weight: Tensor, *, x2: Tensor | None = None, coef: Tensor | None = None, silu: bool = False,
            bits: Tensor | None = None, p: float = 0.0, bias: Tensor | None = None, res: Tensor | None = None,
            stats: bool = False, stride: int = 1, config: TileConfig = DEFAULT_CONFIG, warmup: bool = False,
            out: Tensor | None = None, part: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
    """(out, part): conv3x3(act(x), weight) + bias (+ res) with padding 1, channels_last, in x's dtype, and with
    `stats` the (N, K, 2, C_out) fp32 partial statistics that `finalize` reads (else None).

    x (N, C1, H, W) and the optional second part x2 (N, C - C1, H, W): the input (or the parts of its channel
    concatenation). weight (C_out, C, 3, 3), any layout (channels_last is cuDNN's and the fast one here). coef
    (N, 2, C) fp32: act's per-(sample, channel) (scale, shift), None for no normalisation (then silu and dropout are
    off too). bits: keep_bits' mask of act's output, with its p. bias: (C_out,) or (N, C_out). res: (N, C_out, OH,
    OW), added after the bias. warmup: compile the kernel this call would launch, launch nothing (the tensors may be
    on the meta device: benchmarks.speed.conv_gn_bench compiles its variants in parallel processes so). out, part:
    where to write them (a check poisons them first, to see every element written), None: new tensors."""
    n, c1, h, w = x.shape
    c = c1 + (x2.shape[1] if x2 is not None else 0)
    co = weight.shape[0]
    if weight.shape != (co, c, 3, 3):
        raise ValueError(f"conv_gn: weight {tuple(weight.shape)} is not ({co}, {c}, 3, 3)")
    if coef is None and (silu or bits is not None or x2 is not None):
        raise ValueError("conv_gn: silu, dropout and two parts are parts of the normalisation: pass coef")
    if (bits is not None) != (p > 0):
        raise ValueError(f"conv_gn: dropout p={p} needs its keep bits, and keep bits need p > 0")
    if config.block_k % 32 and bits is not None:
        raise ValueError(f"conv_gn: dropout reads 32 channels' bits a word: BLOCK_K={config.block_k} must be a "
                         "multiple of 32")
    oh, ow = (h - 1) // stride + 1, (w - 1) // stride + 1
    if max(n * c * h * w, n * co * oh * ow) >= 2**31:
        raise ValueError(f"conv_gn indexes with 32-bit integers: {(n, c, h, w)} -> {(n, co, oh, ow)} is too large")
    if not warmup:
        _check_device(x)
    if out is None:
        out = torch.empty((n, co, oh, ow), dtype=x.dtype, device=x.device, memory_format=torch.channels_last)
    if out.shape != (n, co, oh, ow) or out.dtype != x.dtype:
        raise ValueError(f"conv_gn: out {tuple(out.shape)} {out.dtype} is not {(n, co, oh, ow)} {x.dtype}")
    bm = config.block_m
    if stats:
        k, _, spt = stats_layout(oh * ow, bm)
    elif coef is None and bias is None:  # nothing per sample: one compiled kernel for every H*W
        k, spt = 1, 1
    else:  # any H*W: the per-sample vectors loaded per row where a tile's samples are not whole (SPT 0)
        k, spt = 1, 1 if (oh * ow) % bm == 0 else bm // (oh * ow) if bm % (oh * ow) == 0 else 0
    if stats and part is None:
        part = x.new_empty((n, k, 2, co), dtype=torch.float32)
    if stats and (part.shape != (n, k, 2, co) or not part.is_contiguous()):
        raise ValueError(f"conv_gn: part {tuple(part.shape)} is not a dense {(n, k, 2, co)}")
    part = part if stats else None
    if bias is not None and bias.dim() == 1:
        bias = bias[None, :].expand(n, co)  # stride 0 over samples
    grid = (triton.cdiv(n * oh * ow, bm) * triton.cdiv(co, config.block_n),)
    none4 = (0, 0, 0, 0)
    args = (x, x2 if x2 is not None else x, weight, out, coef if coef is not None else out,
            bits if bits is not None else x, bias if bias is not None else out, res if res is not None else out,
            part if part is not None else out,  # the unused pointers: any tensor, never read
            n, h, w, c, c1, oh, ow, co, k, triton.cdiv(c, 32), triton.cdiv(c, config.block_k),
            *_nhwc_strides(x), *(_nhwc_strides(x2) if x2 is not None else none4), *weight.stride(),
            *_nhwc_strides(out), *(_nhwc_strides(res) if res is not None else none4),
            *(bias.stride() if bias is not None else (0, 0)), 1.0 / (1.0 - p))
    meta = dict(STRIDE=stride, BLOCK_M=bm, BLOCK_N=config.block_n, BLOCK_K=config.block_k, NORM=coef is not None,
                SILU=silu, DROPOUT=bits is not None, TWO=x2 is not None, HAS_BIAS=bias is not None,
                HAS_RES=res is not None, STATS=stats, SPT=spt,
                FAST_TANH=(warmup or x.device.type == "cuda") and not _interpreting() and weight.dtype != torch.float32,
                KC=triton.cdiv(c, config.block_k) if _interpreting() else 0,
                DOT_F32=_interpreting() or weight.dtype == torch.float32,
                num_warps=config.warps, num_stages=config.stages)
    if warmup:
        _conv3x3_kernel.warmup(*(a.dtype if isinstance(a, Tensor) else a for a in args), grid=grid, **meta)
    else:
        _conv3x3_kernel[grid](*args, **meta)
    return out, part


def keep_bits(seed: Tensor, shape: tuple[int, int, int, int], p: float) -> Tensor:
    """Dropout's keep mask of an (N, C, H, W) activation as bits: int32 (N * H * W, ceil(C / 32)), bit b of word j of
    row n * H * W + h * W + w the keep of channel 32 j + b; the same mask as norm.keep_mask(seed, shape, p)."""

    _check_device(seed)
    n, c, h, w = shape
    rows, cw = n * h * w, triton.cdiv(c, 32)
    bits = torch.empty((rows, cw), dtype=torch.int32, device=seed.device)
    block_w = triton.next_power_of_2(cw)
    block_p = max(1, 2048 // (32 * block_w))
    _keep_bits_kernel[(triton.cdiv(rows, block_p),)](seed, bits, rows, c, cw, _dropout_args(p)[0], BLOCK_P=block_p,
                                                     BLOCK_W=block_w, num_warps=4)
    return bits


def finalize(part: Tensor, hw: int, block_m: int, groups: int, a: Tensor, b: Tensor, e: Tensor | None = None,
             eps: float = 1e-5) -> tuple[Tensor, Tensor, Tensor]:
    """(coef (N, 2, C), mean (N, groups), rstd (N, groups)) of the GroupNorm of the output whose partial statistics
    conv3x3 wrote (at `hw` output pixels a sample, tiles of `block_m` rows), with the per-(sample, channel) affine
    a, b (fp32 (N, C)) and optional add e before normalising: gn_kernels._finalize_kernel, as norm.triton_forward
    runs it after its own statistics pass. coef is what conv3x3's prologue takes."""
    n, k, _, c = part.shape
    _, chunk, _ = stats_layout(hw, block_m)
    coef = part.new_empty((n, 2, c))
    mean = part.new_empty((n, groups))
    rstd = torch.empty_like(mean)
    e_ = a if e is None else e
    cpg = c // groups
    gn_kernels._finalize_kernel[(n,)](
        part, a, b, e_, coef, mean, rstd, c, hw, groups, cpg, k, a.stride(0), a.stride(1), e_.stride(0), e_.stride(1),
        eps, CHUNK=chunk, BLOCK_K=triton.next_power_of_2(k), BLOCK_G=triton.next_power_of_2(groups),
        BLOCK_CPG=triton.next_power_of_2(cpg), HAS_ADD=e is not None, num_warps=4)
    return coef, mean, rstd


# ---------------------------------------------------------------------------------------------------- reference


def activation(x: Tensor, coef: Tensor | None, silu: bool, keep: Tensor | None, p: float) -> Tensor:
    """act(x) in x's precision (fp32 at least): x * scale + shift per (sample, channel), SiLU, dropout with the
    boolean (N, C, H, W) `keep`."""
    xf = x.to(torch.promote_types(x.dtype, torch.float32))
    if coef is None:
        return xf
    y = xf * coef[:, 0, :, None, None].to(xf.dtype) + coef[:, 1, :, None, None].to(xf.dtype)
    if silu:
        y = F.silu(y)
    return torch.where(keep, y / (1 - p), 0.0) if keep is not None else y


def reference(x: Tensor, weight: Tensor, *, coef: Tensor | None = None, silu: bool = False,
              keep: Tensor | None = None, p: float = 0.0, bias: Tensor | None = None, res: Tensor | None = None,
              stride: int = 1) -> Tensor:
    """conv3x3's output in plain torch at x's precision (fp32 at least), x the whole input (the parts joined)."""
    y = F.conv2d(activation(x, coef, silu, keep, p), weight.to(torch.promote_types(x.dtype, torch.float32)),
                 stride=stride, padding=1)
    if bias is not None:
        y = y + (bias[:, :, None, None] if bias.dim() == 2 else bias[None, :, None, None]).to(y.dtype)
    return y + res.to(y.dtype) if res is not None else y


def coef_of(mean: Tensor, rstd: Tensor, a: Tensor, b: Tensor, e: Tensor | None = None) -> Tensor:
    """The (N, 2, C) (scale, shift) of GroupNorm(x + e) * a + b from its per-(sample, group) mean and rstd, as
    gn_kernels._finalize_kernel computes it: what conv3x3's prologue takes."""
    n, c = a.shape
    g = mean.shape[1]
    scale = a * rstd.repeat_interleave(c // g, 1)
    shift = b - mean.repeat_interleave(c // g, 1) * scale
    if e is not None:
        shift = shift + e * scale
    return torch.stack((scale, shift), 1)
