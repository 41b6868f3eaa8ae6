"""Triton kernels for GroupNorm -> per-(sample, channel) affine -> SiLU -> dropout, forward and backward.

    y   = ((x + e) - mean_g) * rstd_g * a + b      a, b, e: (N, C) fp32; e optional; mean_g, rstd_g per (n, group)
    out = dropout(silu(y))                          silu and dropout optional; the dropout mask is a hash of
                                                    (seed, element index), recomputed in the backward, or kept by
                                                    the forward as a bit per element (model.norm_mask_bits);
                                                    model.norm_pair_hash: one hash for two channels

`ffcv_ddpm.norm` wraps these as one autograd-aware custom op. An (N, C, H, W) tensor is addressed as rows of
channels, (n * HW + hw, c), through its strides: channels_last (c unit-stride, rows contiguous) is the fast path,
NCHW works. Each direction is three launches, so that the two passes over the data run on grids that fill the GPU
(one program per sample left 1 CTA per SM and ran at ~500 GB/s, benchmarks/NOTES.md):
- forward: `_stats` (per chunk of rows, per channel: mean and M2), `_finalize` (per sample: group statistics ->
  per-channel scale and bias), `_apply` (out = dropout(silu(x * scale + bias)), one tile of rows per program).
- backward: `_bwd_reduce` (per chunk, per channel: sums of dy, dy * xhat, xhat), `_bwd_finalize` (per sample: dL/da,
  dL/db, dL/de and the per-channel coefficients of dx), `_bwd_dx` (dx = alpha * dy + beta * xhat + gamma). The sum
  of xhat (dL/de alone needs it) can instead come from the per-channel means the forward's finalize saves
  (model.norm_saved_means): it is HW * (channel mean - group mean) * rstd, so the reduction carries two sums.
  With model.norm_x_sums the reduction sums dy * x and x and turns them into xhat's per chunk, and dx is formed from
  x: xhat is never formed (NOTES item 38).
- two parts (model.fused_parts): x read from two tensors, the up path's (h, skip), split at channel C1; with
  model.conv_parts the output written and its gradient read as two tensors split there too.
- a residual sum folded in (model.norm_residual): x's first part given as the addends of s = h + res (+ res2) (+ a
  bias per channel); `_stats` writes s while it reads them, the other kernels read s, and `_bwd_dx` adds the
  gradient s gets from its other readers to dx, so that s and its gradient are each written once.
SiLU (SILU=1) as y * sigmoid(y), or (SILU=2, model.norm_fast_silu) as h + h * tanh(h) with h = y / 2 and its
derivative from the same tanh: one MUFU.TANH (tanh.approx.f32, ~2^-11 relative, under bf16's rounding) where sigmoid
takes an exponential and a division, in the forward and again in both backward kernels (NOTES item 37).
Statistics in fp32: shifted sums within a chunk (stable when |mean| >> std), Chan's formula across chunks, the law
of total variance across the channels of a group.

On CPU tensors the kernels run only under Triton's interpreter (TRITON_INTERPRET=1 before triton is imported; the
tests set it), which is how they are tested on machines without a GPU.
"""

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

# train.pdl (ffcv_ddpm.step.build sets it for the process): every kernel here launched with programmatic dependent
# launch. A grid's launch then overlaps the kernel before it instead of following its end: the GPU may place its
# programs while the one before drains, and each waits (griddepcontrol.wait) before it reads anything; each lets the
# kernel after it launch the same way as soon as its own programs are all placed. ~300 of the step's ~1,700 kernels
# are these, most of them short (the finalizes: one program a sample), so the gaps between kernels are a share of
# their time (NOTES item 53).
PDL = False


def pdl_args() -> dict:
    """The launch arguments that train.pdl adds to every kernel's launch here (none under Triton's interpreter)."""
    return dict(PDL=True, launch_pdl=True) if PDL and not triton.knobs.runtime.interpret else {}


@triton.jit
def _pdl_start(PDL: tl.constexpr):
    """A kernel's first statement: with PDL, wait for the kernel before it to finish (its writes visible), then let
    the one after it launch. Safe by the chain: each kernel waits for the one before before it ends."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


@triton.jit
def _hash(offs, seed):
    """A 32-bit integer hash (murmur3's finaliser) of an index and the seed."""
    h = offs.to(tl.uint32) * 0x9E3779B1 + seed
    h ^= h >> 16
    h *= 0x85EBCA6B
    h ^= h >> 13
    h *= 0xC2B2AE35
    h ^= h >> 16
    return h


@triton.jit
def _keep(offs, seed, thr24):
    """Dropout's keep mask: _hash of the element's logical index, kept where its top 24 bits are >= p * 2^24.
    Cheaper than Philox (tl.rand), and recomputed twice in the backward; ffcv_ddpm.norm.keep_mask is the same
    function in torch."""
    return (_hash(offs, seed) >> 8).to(tl.int32) >= thr24


@triton.jit
def _keep_tile(n, r, C, HW, seed, thr, BLOCK_C: tl.constexpr, PAIR: tl.constexpr):
    """The keep mask of rows r of sample n, [rows, BLOCK_C]: _keep of each element's logical index (n, hw, c), or
    with PAIR (model.norm_pair_hash; C even) one _hash for channels 2j and 2j + 1, its low and high 16 bits each
    kept where >= p * 2^16: half the integer work a element, which the kernels are short of (NOTES item 37)."""
    if PAIR:
        h = _hash((n * HW + r[:, None]) * (C // 2) + tl.arange(0, BLOCK_C // 2)[None, :], seed)
        return tl.interleave((h & 0xFFFF).to(tl.int32) >= thr, (h >> 16).to(tl.int32) >= thr)
    else:
        return _keep((n * HW + r[:, None]) * C + tl.arange(0, BLOCK_C)[None, :], seed, thr)


@triton.jit
def _tanh(h, FAST_TANH: tl.constexpr):
    """tanh(h): tanh.approx.f32 on a GPU; 2 sigmoid(2h) - 1 without FAST_TANH (the interpreter has no inline PTX)."""
    if FAST_TANH:
        return tl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=f,f", [h], dtype=tl.float32, is_pure=True,
                                         pack=1)
    else:
        return 2.0 * tl.sigmoid(2.0 * h) - 1.0


@triton.jit
def _silu_half(h, FAST_TANH: tl.constexpr):
    """SiLU(y) of h = y / 2, as h + h * tanh(h) (sigmoid(y) = (1 + tanh(y / 2)) / 2): one MUFU.TANH a value."""
    return h + h * _tanh(h, FAST_TANH)


@triton.jit
def _silu(y, SILU: tl.constexpr, FAST_TANH: tl.constexpr):
    """SiLU(y): as y * sigmoid(y) (SILU=1) or through tanh (SILU=2)."""
    if SILU == 2:
        return _silu_half(0.5 * y, FAST_TANH)
    else:
        return y * tl.sigmoid(y)


@triton.jit
def _silu_grad(y, SILU: tl.constexpr, FAST_TANH: tl.constexpr):
    """d SiLU(y) / dy = s (1 + y (1 - s)), s = sigmoid(y); with SILU=2 from t = tanh(y / 2), s = (1 + t) / 2:
    (1 + t + h (1 - t^2)) / 2, h = y / 2."""
    if SILU == 2:
        h = 0.5 * y
        t = _tanh(h, FAST_TANH)
        return 0.5 + 0.5 * t + 0.5 * h * (1.0 - t * t)
    else:
        sig = tl.sigmoid(y)
        return sig * (1.0 + y * (1.0 - sig))


@triton.jit
def _mix_seed(seed_ptr):
    s = tl.load(seed_ptr).to(tl.uint32)
    s ^= s >> 16
    s *= 0x7FEB352D
    s ^= s >> 15
    return s


@triton.jit
def _bits_at(bits_ptr, n, rows, HW, CW, BLOCK_C: tl.constexpr, WORD: tl.constexpr):
    """The [rows, words] pointers and mask of sample n's rows in the keep bits: int32 words of WORD channels (32, or
    BLOCK_C when fewer), CW = ceil(C / 32) words a row n * HW + hw, bit b of word j the keep of channel WORD * j + b:
    ffcv_ddpm.conv_gn.keep_bits' layout."""
    words = tl.arange(0, BLOCK_C // WORD)
    at = bits_ptr + (n * HW + rows[:, None]) * CW + words[None, :]
    return at, (rows < HW)[:, None] & (words < CW)[None, :]


@triton.jit
def _pack_keep(keep, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, WORD: tl.constexpr):
    """A [BLOCK_R, BLOCK_C] keep mask as [BLOCK_R, BLOCK_C // WORD] int32 words (_bits_at's layout)."""
    k = tl.reshape(keep.to(tl.int32), (BLOCK_R, BLOCK_C // WORD, WORD))
    return tl.sum(k << tl.arange(0, WORD)[None, None, :], axis=2)  # distinct bits: the sum is their OR


@triton.jit
def _unpack_keep(words, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, WORD: tl.constexpr):
    """_pack_keep undone: each channel's bit of its row's word, as a [BLOCK_R, BLOCK_C] keep mask."""
    w = tl.reshape(tl.broadcast_to(words[:, :, None], (BLOCK_R, BLOCK_C // WORD, WORD)), (BLOCK_R, BLOCK_C))
    return ((w >> (tl.arange(0, BLOCK_C) % WORD)[None, :]) & 1) != 0


@triton.jit
def _act_grad(x, u, v, a, b, dout, keep, inv_keep, SILU: tl.constexpr, DROPOUT: tl.constexpr,
              FAST_TANH: tl.constexpr, XSUMS: tl.constexpr):
    """(xhat, dL/dy) for a tile: xhat recomputed from x, y = xhat * a + b, the output's gradient taken back through
    dropout (the forward's mask `keep`, recomputed or read back) and SiLU. XSUMS (model.norm_x_sums): (x, dL/dy),
    with (u, v) y's own coefficients (u * a, v * a + b, _y_coefs): y in one step, and the callers sum over x."""
    if XSUMS:
        xhat = x
        y = x * u + v
    else:
        xhat = x * u + v
        y = xhat * a + b
    dy = dout
    if DROPOUT:
        dy = tl.where(keep, dy * inv_keep, 0.0)
    if SILU:
        dy = dy * _silu_grad(y, SILU, FAST_TANH)
    return xhat, dy


@triton.jit
def _y_coefs(u, v, a, b, XSUMS: tl.constexpr):
    """The per-channel (u, v) _act_grad takes: xhat's, or with XSUMS y's (y = xhat * a + b = x * u a + (v a + b))."""
    if XSUMS:
        return u * a, v * a + b
    return u, v


@triton.jit
def _load_x(x_ptr, x2_ptr, n, rows, cols, m, s_xn, s_xc, s_xhw, C1, s_2n, s_2c, s_2hw, TWO: tl.constexpr):
    """x[n, cols, rows] as an fp32 [rows, cols] tile. With TWO, x is two tensors, the parts of a channel
    concatenation (the up path's (h, skip): model.fused_parts): channels from C1 on are read from the second."""
    if TWO:
        lo = (cols < C1)[None, :]
        x = tl.load(x_ptr + n * s_xn + rows[:, None] * s_xhw + cols[None, :] * s_xc, mask=m & lo, other=0.0)
        x2 = tl.load(x2_ptr + n * s_2n + rows[:, None] * s_2hw + (cols - C1)[None, :] * s_2c,
                     mask=m & (cols >= C1)[None, :], other=0.0)
        return x.to(tl.float32) + x2.to(tl.float32)
    return tl.load(x_ptr + n * s_xn + rows[:, None] * s_xhw + cols[None, :] * s_xc, mask=m, other=0.0).to(tl.float32)


@triton.jit
def _load_sum(x_ptr, x2_ptr, res_ptr, res2_ptr, rb_ptr, s_ptr, n, rows, cols, m, s_xn, s_xc, s_xhw, C1, s_2n, s_2c,
              s_2hw, TWO: tl.constexpr, RES: tl.constexpr, RBIAS: tl.constexpr, STORE: tl.constexpr):
    """_load_x with the first part (channels below C1) the residual sum s = x + res (+ res2) (+ rb per channel),
    rounded to x's dtype as a tensor of it would be and, with STORE, written to s_ptr (model.norm_residual). The
    residual tensors and s have x's strides. RES: how many residual tensors (0: _load_x)."""
    if RES == 0:  # (Triton's compiler has no early return: the sum is the else branch)
        s = _load_x(x_ptr, x2_ptr, n, rows, cols, m, s_xn, s_xc, s_xhw, C1, s_2n, s_2c, s_2hw, TWO)
    else:
        at = n * s_xn + rows[:, None] * s_xhw + cols[None, :] * s_xc
        m1 = m & (cols < C1)[None, :] if TWO else m  # (one part: C1 is C, and m's own mask keeps the loads plain)
        s = tl.load(x_ptr + at, mask=m1, other=0.0).to(tl.float32)
        s += tl.load(res_ptr + at, mask=m1, other=0.0).to(tl.float32)
        if RES == 2:
            s += tl.load(res2_ptr + at, mask=m1, other=0.0).to(tl.float32)
        if RBIAS:
            s += tl.load(rb_ptr + cols, mask=cols < C1, other=0.0)[None, :]
        s = s.to(x_ptr.dtype.element_ty)
        if STORE:
            tl.store(s_ptr + at, s, mask=m1)
        s = s.to(tl.float32)
        if TWO:
            s += tl.load(x2_ptr + n * s_2n + rows[:, None] * s_2hw + (cols - C1)[None, :] * s_2c,
                         mask=m & (cols >= C1)[None, :], other=0.0).to(tl.float32)
    return s


@triton.jit
def _store_x(x_ptr, x2_ptr, x, n, rows, cols, m, s_xn, s_xc, s_xhw, C1, s_2n, s_2c, s_2hw, TWO: tl.constexpr):
    """_load_x's inverse: a [rows, cols] tile into x[n, cols, rows]. With TWO, channels from C1 on into the second
    tensor: dx into the input's two parts, or (model.conv_parts) the output as two tensors."""
    if TWO:
        tl.store(x_ptr + n * s_xn + rows[:, None] * s_xhw + cols[None, :] * s_xc, x.to(x_ptr.dtype.element_ty),
                 mask=m & (cols < C1)[None, :])
        tl.store(x2_ptr + n * s_2n + rows[:, None] * s_2hw + (cols - C1)[None, :] * s_2c,
                 x.to(x2_ptr.dtype.element_ty), mask=m & (cols >= C1)[None, :])
    else:
        tl.store(x_ptr + n * s_xn + rows[:, None] * s_xhw + cols[None, :] * s_xc, x.to(x_ptr.dtype.element_ty), mask=m)


@triton.jit
def _grad_tile(dout_ptr, dout2_ptr, x_ptr, x2_ptr, bits_ptr, n, r, cols, m, u, v, a, b, seed, thr, inv_keep, C, HW,
               CW, s_xn, s_xc, s_xhw, C1, s_2n, s_2c, s_2hw, s_dn, s_dc, s_dhw, s_d2n, s_d2c, s_d2hw,
               SILU: tl.constexpr, DROPOUT: tl.constexpr, TWO: tl.constexpr, BITS: tl.constexpr,
               BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, WORD: tl.constexpr, FAST_TANH: tl.constexpr,
               PAIR: tl.constexpr, XSUMS: tl.constexpr, DOUT_TWO: tl.constexpr):
    """(xhat, dy) of rows r of sample n (with XSUMS (x, dy), u and v from _y_coefs): x (from either part) and dout
    read, _act_grad on them. With DOUT_TWO dout is two tensors split at C1 too (the forward's two outputs:
    model.conv_parts). The dropout mask: with BITS read from the forward's keep bits, else hashed again."""
    x = _load_x(x_ptr, x2_ptr, n, r, cols, m, s_xn, s_xc, s_xhw, C1, s_2n, s_2c, s_2hw, TWO)
    dout = _load_x(dout_ptr, dout2_ptr, n, r, cols, m, s_dn, s_dc, s_dhw, C1, s_d2n, s_d2c, s_d2hw, DOUT_TWO)
    keep = None
    if DROPOUT:
        if BITS:
            at, wm = _bits_at(bits_ptr, n, r, HW, CW, BLOCK_C, WORD)
            keep = _unpack_keep(tl.load(at, mask=wm, other=0), BLOCK_R, BLOCK_C, WORD)
        else:
            keep = _keep_tile(n, r, C, HW, seed, thr, BLOCK_C, PAIR)
    return _act_grad(x, u[None, :], v[None, :], a[None, :], b[None, :], dout, keep, inv_keep, SILU, DROPOUT,
                     FAST_TANH, XSUMS)


@triton.jit
def _stats_kernel(x_ptr, x2_ptr, part_ptr, C, HW, K, s_xn, s_xc, s_xhw, C1, s_2n, s_2c, s_2hw,
                  CHUNK: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, TWO: tl.constexpr,
                  STAGES: tl.constexpr, res_ptr=None, res2_ptr=None, rb_ptr=None, s_ptr=None,
                  RES: tl.constexpr = 0, RBIAS: tl.constexpr = False, PDL: tl.constexpr = False):
    """part[n, k, 0:2, c] = (mean, M2) of x[n, c, rows of chunk k]. STAGES: the plan's (norm.PLAN_STAGES), None for
    the loop as written. With RES, of the residual sum that _load_sum makes of x's first part, written to s_ptr as it
    goes (model.norm_residual: the sum's one pass, where a pass of its own would write it and this one read it)."""
    _pdl_start(PDL)
    n = tl.program_id(0)
    k = tl.program_id(1)
    r0 = k * CHUNK
    cols = tl.arange(0, BLOCK_C)
    cmask = cols < C
    first = r0 + tl.arange(0, 1)  # the chunk's first row
    shift = tl.sum(_load_sum(x_ptr, x2_ptr, res_ptr, res2_ptr, rb_ptr, s_ptr, n, first, cols, cmask[None, :], s_xn,
                             s_xc, s_xhw, C1, s_2n, s_2c, s_2hw, TWO, RES, RBIAS, False), axis=0)
    acc1 = tl.zeros([BLOCK_R, BLOCK_C], dtype=tl.float32)
    acc2 = tl.zeros([BLOCK_R, BLOCK_C], dtype=tl.float32)
    for i in tl.range(0, CHUNK, BLOCK_R, num_stages=STAGES):
        r = r0 + i + tl.arange(0, BLOCK_R)
        m = (r < HW)[:, None] & cmask[None, :]
        x = _load_sum(x_ptr, x2_ptr, res_ptr, res2_ptr, rb_ptr, s_ptr, n, r, cols, m, s_xn, s_xc, s_xhw, C1, s_2n,
                      s_2c, s_2hw, TWO, RES, RBIAS, RES > 0)
        d = tl.where(m, x - shift[None, :], 0.0)
        acc1 += d
        acc2 += d * d
    cnt = tl.minimum(CHUNK, HW - r0).to(tl.float32)
    s1 = tl.sum(acc1, axis=0)
    out = part_ptr + (n * K + k) * 2 * C + cols
    tl.store(out, shift + s1 / cnt, mask=cmask)
    tl.store(out + C, tl.sum(acc2, axis=0) - s1 * s1 / cnt, mask=cmask)


@triton.jit
def _finalize_kernel(part_ptr, a_ptr, b_ptr, e_ptr, coef_ptr, mean_ptr, rstd_ptr,
                     C, HW, G, CPG, K, s_an, s_ac, s_en, s_ec, eps,
                     CHUNK: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_CPG: tl.constexpr,
                     HAS_ADD: tl.constexpr, cmean_ptr=None, SAVE_MEANS: tl.constexpr = False, SUMS_ROWS=0,
                     SUMS: tl.constexpr = False, PDL: tl.constexpr = False):
    """Per sample: the K chunks' (mean, M2) -> group mean and rstd -> coef[n, 0:2, c] = (scale, bias) with
    y = x * scale + bias. With SAVE_MEANS also cmean[n, c], the per-channel mean of x + e, for the backward
    (_bwd_finalize_kernel's FROM_MEANS). With SUMS the chunks are a convolution epilogue's tiles instead
    (ffcv_ddpm.conv_cutlass, model.conv_cutlass): part is [2, SUMS_ROWS = N * K, C], each tile's sum and sum of
    squares."""
    _pdl_start(PDL)
    n = tl.program_id(0)
    gs = tl.arange(0, BLOCK_G)
    ch = gs[:, None] * CPG + tl.arange(0, BLOCK_CPG)[None, :]  # [G, CPG]: channel index, groups along axis 0
    cmask = (gs < G)[:, None] & (tl.arange(0, BLOCK_CPG) < CPG)[None, :]
    ks = tl.arange(0, BLOCK_K)[:, None, None]
    km = (ks < K) & cmask[None, :, :]
    cnt = tl.where(ks < K, tl.minimum(CHUNK, HW - ks * CHUNK), 0).to(tl.float32)  # the last chunk may be short
    if SUMS:
        part = part_ptr + (n * K + ks) * C + ch[None, :, :]
        s1 = tl.load(part, mask=km, other=0.0)
        mean_k = s1 / tl.maximum(cnt, 1.0)
        m2_k = tl.load(part + SUMS_ROWS * C, mask=km, other=0.0) - s1 * mean_k  # a 128-pixel tile's: fp32 holds it
    else:
        part = part_ptr + n * K * 2 * C + ks * 2 * C + ch[None, :, :]
        mean_k = tl.load(part, mask=km, other=0.0)
        m2_k = tl.load(part + C, mask=km, other=0.0)
    mean_c = tl.sum(mean_k * cnt, axis=0) / HW  # Chan: per channel over the whole sample
    dev = tl.where(km, mean_k - mean_c[None, :, :], 0.0)
    m2_c = tl.sum(m2_k + dev * dev * cnt, axis=0)
    if HAS_ADD:
        e = tl.load(e_ptr + n * s_en + ch * s_ec, mask=cmask, other=0.0)
        mean_c += e
    if SAVE_MEANS:
        tl.store(cmean_ptr + n * C + ch, mean_c, mask=cmask)
    # Per group: the mean of its channels' means (equal counts); M2 = within-channel + between-channel parts.
    mean_g = tl.sum(tl.where(cmask, mean_c, 0.0), axis=1) / CPG
    dev_c = tl.where(cmask, mean_c - mean_g[:, None], 0.0)
    m2_g = tl.sum(tl.where(cmask, m2_c, 0.0) + HW * dev_c * dev_c, axis=1)
    rstd_g = 1.0 / tl.sqrt(m2_g / (CPG * HW) + eps)
    tl.store(mean_ptr + n * G + gs, mean_g, mask=gs < G)
    tl.store(rstd_ptr + n * G + gs, rstd_g, mask=gs < G)
    a = tl.load(a_ptr + n * s_an + ch * s_ac, mask=cmask, other=0.0)
    b = tl.load(b_ptr + n * s_an + ch * s_ac, mask=cmask, other=0.0)
    scale = a * rstd_g[:, None]
    bias = b - mean_g[:, None] * scale
    if HAS_ADD:
        bias += e * scale
    tl.store(coef_ptr + n * 2 * C + ch, scale, mask=cmask)
    tl.store(coef_ptr + n * 2 * C + C + ch, bias, mask=cmask)


@triton.jit
def _apply_kernel(x_ptr, x2_ptr, out_ptr, coef_ptr, seed_ptr, bits_ptr, C, HW, CW, s_xn, s_xc, s_xhw, C1, s_2n,
                  s_2c, s_2hw, s_on, s_oc, s_ohw, thr, inv_keep, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
                  SILU: tl.constexpr, DROPOUT: tl.constexpr, TWO: tl.constexpr, BITS: tl.constexpr,
                  WORD: tl.constexpr, FAST_TANH: tl.constexpr = False, PAIR: tl.constexpr = False, out2_ptr=None,
                  s_o2n=0, s_o2c=0, s_o2hw=0, OUT_TWO: tl.constexpr = False, PDL: tl.constexpr = False):
    """out = dropout(silu(x * scale + bias)) over one tile of BLOCK_R rows of sample n; with BITS the dropout mask
    also written as bits (_bits_at) for the backward. OUT_TWO (model.conv_parts; with TWO): out written as two
    tensors split at C1 as x is read, the next convolution's two inputs, so that no tensor of all C channels exists."""
    _pdl_start(PDL)
    n = tl.program_id(0)
    r = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_C)
    m = (r < HW)[:, None] & (cols < C)[None, :]
    scale = tl.load(coef_ptr + n * 2 * C + cols, mask=cols < C, other=0.0)
    bias = tl.load(coef_ptr + n * 2 * C + C + cols, mask=cols < C, other=0.0)
    x = _load_x(x_ptr, x2_ptr, n, r, cols, m, s_xn, s_xc, s_xhw, C1, s_2n, s_2c, s_2hw, TWO)
    y = x * scale[None, :] + bias[None, :]
    if SILU:
        y = _silu(y, SILU, FAST_TANH)
    if DROPOUT:
        # The element's logical index (n, hw, c), whatever the layout, so that the backward draws the same mask.
        keep = _keep_tile(n, r, C, HW, _mix_seed(seed_ptr), thr, BLOCK_C, PAIR)
        y = tl.where(keep, y * inv_keep, 0.0)
        if BITS:
            at, wm = _bits_at(bits_ptr, n, r, HW, CW, BLOCK_C, WORD)
            tl.store(at, _pack_keep(keep & (cols < C)[None, :], BLOCK_R, BLOCK_C, WORD), mask=wm)
    _store_x(out_ptr, out2_ptr, y, n, r, cols, m, s_on, s_oc, s_ohw, C1, s_o2n, s_o2c, s_o2hw, OUT_TWO)


@triton.jit
def _per_channel(a_ptr, b_ptr, e_ptr, mean_ptr, rstd_ptr, n, cols, C, G, CPG, s_an, s_ac, s_en, s_ec,
                 HAS_ADD: tl.constexpr):
    """(u, v, a, b) of sample n per channel, xhat = x * u + v: u = the group's rstd, v = (e - the group's mean) * u."""
    cmask = cols < C
    g = cols // CPG
    u = tl.load(rstd_ptr + n * G + g, mask=cmask, other=0.0)
    v = -tl.load(mean_ptr + n * G + g, mask=cmask, other=0.0) * u
    if HAS_ADD:
        v += tl.load(e_ptr + n * s_en + cols * s_ec, mask=cmask, other=0.0) * u
    a = tl.load(a_ptr + n * s_an + cols * s_ac, mask=cmask, other=0.0)
    b = tl.load(b_ptr + n * s_an + cols * s_ac, mask=cmask, other=0.0)
    return u, v, a, b


@triton.jit
def _bwd_reduce_kernel(dout_ptr, x_ptr, x2_ptr, bits_ptr, a_ptr, b_ptr, e_ptr, seed_ptr, mean_ptr, rstd_ptr,
                       part_ptr, C, HW, CW, G, CPG, K, s_xn, s_xc, s_xhw, C1, s_2n, s_2c, s_2hw, s_dn, s_dc, s_dhw,
                       s_an, s_ac, s_en, s_ec, thr, inv_keep,
                       CHUNK: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
                       HAS_ADD: tl.constexpr, SILU: tl.constexpr, DROPOUT: tl.constexpr, TWO: tl.constexpr,
                       STAGES: tl.constexpr, SUM_XHAT: tl.constexpr, BITS: tl.constexpr, WORD: tl.constexpr,
                       FAST_TANH: tl.constexpr = False, PAIR: tl.constexpr = False, XSUMS: tl.constexpr = False,
                       dout2_ptr=None, s_d2n=0, s_d2c=0, s_d2hw=0, DOUT_TWO: tl.constexpr = False,
                       PDL: tl.constexpr = False):
    """part[n, k, 0:3, c] = sums over the chunk's rows of dy, dy * xhat and xhat (dy = dL/dy; the sum of xhat only
    with SUM_XHAT: dL/de alone needs it, and the forward's saved means can give it instead). STAGES as in
    _stats_kernel; BITS: the dropout mask read from the forward's bits. XSUMS: the tiles sum dy * x and x, one
    multiply-add an element fewer (xhat = x * u + v is never formed), and the chunk's sums are turned into xhat's
    at the end: sum(dy * xhat) = u sum(dy * x) + v sum(dy), sum(xhat) = u sum(x) + v rows. DOUT_TWO: dout read
    from two tensors (_grad_tile)."""
    _pdl_start(PDL)
    n = tl.program_id(0)
    k = tl.program_id(1)
    cols = tl.arange(0, BLOCK_C)
    u, v, a, b = _per_channel(a_ptr, b_ptr, e_ptr, mean_ptr, rstd_ptr, n, cols, C, G, CPG, s_an, s_ac, s_en, s_ec,
                              HAS_ADD)
    cu, cv = _y_coefs(u, v, a, b, XSUMS)
    seed = _mix_seed(seed_ptr)
    acc1 = tl.zeros([BLOCK_R, BLOCK_C], dtype=tl.float32)
    acc2 = tl.zeros([BLOCK_R, BLOCK_C], dtype=tl.float32)
    acc3 = tl.zeros([BLOCK_R, BLOCK_C], dtype=tl.float32)  # without SUM_XHAT never updated: compiled away
    for i in tl.range(0, CHUNK, BLOCK_R, num_stages=STAGES):
        r = k * CHUNK + i + tl.arange(0, BLOCK_R)
        m = (r < HW)[:, None] & (cols < C)[None, :]
        xhat, dy = _grad_tile(dout_ptr, dout2_ptr, x_ptr, x2_ptr, bits_ptr, n, r, cols, m, cu, cv, a, b, seed, thr,
                              inv_keep, C, HW, CW, s_xn, s_xc, s_xhw, C1, s_2n, s_2c, s_2hw, s_dn, s_dc, s_dhw, s_d2n,
                              s_d2c, s_d2hw, SILU, DROPOUT, TWO, BITS, BLOCK_R, BLOCK_C, WORD, FAST_TANH, PAIR, XSUMS,
                              DOUT_TWO)
        acc1 += dy
        acc2 += dy * xhat
        if SUM_XHAT:
            if XSUMS:
                acc3 += xhat  # x, read as 0 outside the rows and channels
            else:
                acc3 += tl.where(m, xhat, 0.0)
    out = part_ptr + (n * K + k) * 3 * C + cols
    s1 = tl.sum(acc1, axis=0)
    s2 = tl.sum(acc2, axis=0)
    if XSUMS:
        s2 = u * s2 + v * s1
    tl.store(out, s1, mask=cols < C)
    tl.store(out + C, s2, mask=cols < C)
    if SUM_XHAT:
        s3 = tl.sum(acc3, axis=0)
        if XSUMS:
            s3 = u * s3 + v * tl.minimum(HW - k * CHUNK, CHUNK).to(tl.float32)
        tl.store(out + 2 * C, s3, mask=cols < C)


@triton.jit
def _bwd_finalize_kernel(part_ptr, a_ptr, mean_ptr, rstd_ptr, cmean_ptr, da_ptr, db_ptr, de_ptr, coef_ptr, C, HW, G,
                         CPG, K, s_an, s_ac, BLOCK_K: tl.constexpr, BLOCK_G: tl.constexpr,
                         BLOCK_CPG: tl.constexpr, HAS_ADD: tl.constexpr, FROM_MEANS: tl.constexpr,
                         PDL: tl.constexpr = False):
    """Per sample: dL/da = sum(dy * xhat), dL/db = sum(dy), dL/de = sum(dx), and coef[n, 0:3, c] = (alpha, beta,
    gamma) with dx = alpha * dy + beta * xhat + gamma, where
    dx = u * (dy * a - the group's mean of dy * a - xhat * the group's mean of dy * a * xhat).
    dL/de needs the sum of xhat over the sample's rows: from the reduction's third sum, or with FROM_MEANS from the
    forward's per-channel means (xhat = (x + e - the group's mean) * u sums to HW * (channel mean - group mean) * u)."""
    _pdl_start(PDL)
    n = tl.program_id(0)
    gs = tl.arange(0, BLOCK_G)
    ch = gs[:, None] * CPG + tl.arange(0, BLOCK_CPG)[None, :]
    cmask = (gs < G)[:, None] & (tl.arange(0, BLOCK_CPG) < CPG)[None, :]
    ks = tl.arange(0, BLOCK_K)[:, None, None]
    km = (ks < K) & cmask[None, :, :]
    part = part_ptr + n * K * 3 * C + ks * 3 * C + ch[None, :, :]
    s1 = tl.sum(tl.load(part, mask=km, other=0.0), axis=0)  # sum dy
    s2 = tl.sum(tl.load(part + C, mask=km, other=0.0), axis=0)  # sum dy * xhat
    tl.store(da_ptr + n * C + ch, s2, mask=cmask)
    tl.store(db_ptr + n * C + ch, s1, mask=cmask)
    a = tl.load(a_ptr + n * s_an + ch * s_ac, mask=cmask, other=0.0)
    u = tl.load(rstd_ptr + n * G + gs, mask=gs < G, other=0.0)[:, None]
    inv_m = 1.0 / (CPG * HW)
    c1 = tl.sum(tl.where(cmask, a * s1, 0.0), axis=1)[:, None] * inv_m
    c2 = tl.sum(tl.where(cmask, a * s2, 0.0), axis=1)[:, None] * inv_m
    alpha = u * a
    beta = -u * c2
    gamma = -u * c1
    tl.store(coef_ptr + n * 3 * C + ch, alpha, mask=cmask)
    tl.store(coef_ptr + n * 3 * C + C + ch, beta, mask=cmask)
    tl.store(coef_ptr + n * 3 * C + 2 * C + ch, gamma, mask=cmask)
    if HAS_ADD:
        if FROM_MEANS:
            mean_g = tl.load(mean_ptr + n * G + gs, mask=gs < G, other=0.0)[:, None]
            s3 = HW * (tl.load(cmean_ptr + n * C + ch, mask=cmask, other=0.0) - mean_g) * u
        else:
            s3 = tl.sum(tl.load(part + 2 * C, mask=km, other=0.0), axis=0)  # sum xhat
        tl.store(de_ptr + n * C + ch, alpha * s1 + beta * s3 + gamma * HW, mask=cmask)


@triton.jit
def _bwd_dx_kernel(dout_ptr, x_ptr, x2_ptr, bits_ptr, dx_ptr, dx2_ptr, a_ptr, b_ptr, e_ptr, seed_ptr, mean_ptr,
                   rstd_ptr, coef_ptr, C, HW, CW, G, CPG, s_xn, s_xc, s_xhw, C1, s_2n, s_2c, s_2hw, s_dn, s_dc, s_dhw,
                   s_an, s_ac, s_en, s_ec, thr, inv_keep,
                   BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
                   HAS_ADD: tl.constexpr, SILU: tl.constexpr, DROPOUT: tl.constexpr, TWO: tl.constexpr,
                   BITS: tl.constexpr, WORD: tl.constexpr, ds_ptr=None, s_gn=0, s_gc=0, s_ghw=0,
                   HAS_DS: tl.constexpr = False, FAST_TANH: tl.constexpr = False, PAIR: tl.constexpr = False,
                   XSUMS: tl.constexpr = False, dbias_ptr=None, DBIAS: tl.constexpr = False, dout2_ptr=None, s_d2n=0,
                   s_d2c=0, s_d2hw=0, DOUT_TWO: tl.constexpr = False, PDL: tl.constexpr = False):
    """dx = alpha * dy + beta * xhat + gamma over one tile of BLOCK_R rows of sample n (XSUMS: beta u x +
    (beta v + gamma), xhat never formed). With HAS_DS plus ds, the gradient the first part (x a residual sum,
    model.norm_residual) gets from its other readers: one write of the sum's whole gradient where a pass of its own
    would read dx and ds and write their sum. DBIAS (model.norm_dbias): dbias[n, tile, c] = the tile's sum of the
    first part's dx as stored (rounded to its dtype), the residual sum's bias gradient in partial sums, where a
    reduction of its own would read dx again. DOUT_TWO: dout read from two tensors (_grad_tile)."""
    _pdl_start(PDL)
    n = tl.program_id(0)
    r = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_C)
    cmask = cols < C
    m = (r < HW)[:, None] & cmask[None, :]
    u, v, a, b = _per_channel(a_ptr, b_ptr, e_ptr, mean_ptr, rstd_ptr, n, cols, C, G, CPG, s_an, s_ac, s_en, s_ec,
                              HAS_ADD)
    alpha = tl.load(coef_ptr + n * 3 * C + cols, mask=cmask, other=0.0)
    beta = tl.load(coef_ptr + n * 3 * C + C + cols, mask=cmask, other=0.0)
    gamma = tl.load(coef_ptr + n * 3 * C + 2 * C + cols, mask=cmask, other=0.0)
    cu, cv = _y_coefs(u, v, a, b, XSUMS)
    if XSUMS:  # beta * xhat + gamma = beta u * x + (beta v + gamma)
        gamma = beta * v + gamma
        beta = beta * u
    xhat, dy = _grad_tile(dout_ptr, dout2_ptr, x_ptr, x2_ptr, bits_ptr, n, r, cols, m, cu, cv, a, b,
                          _mix_seed(seed_ptr), thr, inv_keep, C, HW, CW, s_xn, s_xc, s_xhw, C1, s_2n, s_2c, s_2hw, s_dn,
                          s_dc, s_dhw, s_d2n, s_d2c, s_d2hw, SILU, DROPOUT, TWO, BITS, BLOCK_R, BLOCK_C, WORD,
                          FAST_TANH, PAIR, XSUMS, DOUT_TWO)
    dx = alpha[None, :] * dy + beta[None, :] * xhat + gamma[None, :]
    if HAS_DS:
        dx += tl.load(ds_ptr + n * s_gn + r[:, None] * s_ghw + cols[None, :] * s_gc, mask=m & (cols < C1)[None, :],
                      other=0.0).to(tl.float32)
    _store_x(dx_ptr, dx2_ptr, dx, n, r, cols, m, s_xn, s_xc, s_xhw, C1, s_2n, s_2c, s_2hw, TWO)
    if DBIAS:
        first = m & (cols < C1)[None, :]
        part = tl.sum(tl.where(first, dx.to(dx_ptr.dtype.element_ty).to(tl.float32), 0.0), axis=0)
        tl.store(dbias_ptr + (n * tl.num_programs(1) + tl.program_id(1)) * C1 + cols, part, mask=cols < C1)
