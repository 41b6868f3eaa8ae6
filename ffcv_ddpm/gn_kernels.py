"""Triton kernels for GroupNorm -> per-(sample, channel) affine -> SiLU -> dropout, forward and backward.

    y   = ((x + e) - mean_g) * rstd_g * a + b      a, b, e: (N, C) fp32; e optional; mean_g, rstd_g per (n, group)
    out = dropout(silu(y))                          silu and dropout optional; the dropout mask is a hash of
                                                    (seed, element index), regenerated in the backward, never stored

`ffcv_ddpm.norm` wraps these as one autograd-aware custom op. The layout is read from the strides: an (N, C, H, W)
tensor is addressed as (n, hw, c) with H and W merged, so channels_last (c unit-stride) and NCHW both work without
a copy.

Each kernel runs in one of three modes, chosen by the constexprs PASS0 and PASS1:
- (0, 2) one program per sample: statistics, then the pass that uses them. The second read of the sample comes
  from L2 while it is still there. Used when the batch alone fills the GPU.
- (0, 1) then (1, 2): the sample's positions split into K chunks, one program each; the first launch writes
  per-chunk, per-channel partial sums, the second reads them all and does the dependent pass over its chunk.
  Used for small batches (sampling, tests), where one program per sample would leave SMs idle.

On CPU tensors the kernels run only under Triton's interpreter (TRITON_INTERPRET=1 before triton is imported; the
tests set it), which is how they are tested on machines without a GPU.

Statistics: per channel, sums of d = x - x[first row] and d^2 (a shifted sum, stable when |mean| >> std), combined
across chunks with Chan's formula, across the channels of a group by the law of total variance, all in fp32.
"""

import triton
import triton.language as tl


@triton.jit
def _act_grad(x, u, v, a, b, dout, offs, seed, p_drop, SILU: tl.constexpr, DROPOUT: tl.constexpr):
    """(xhat, dL/dy) for a tile: xhat recomputed from x, y = xhat * a + b, the output's gradient taken back through
    dropout (the forward's mask, regenerated) and SiLU."""
    xhat = x * u + v
    dy = dout
    if DROPOUT:
        dy = tl.where(tl.rand(seed, offs) >= p_drop, dy / (1.0 - p_drop), 0.0)
    if SILU:
        y = xhat * a + b
        sig = tl.sigmoid(y)
        dy = dy * sig * (1.0 + y * (1.0 - sig))
    return xhat, dy


# Channels are indexed as [group, channel within group] (c = g * CPG + j), so that per-group sums are reductions
# over one axis of a tile. Tiles are [BLOCK_HW, BLOCK_G, BLOCK_CPG]: in channels_last each tile row is one
# contiguous run of C channels.


@triton.jit
def _gn_fwd_kernel(
    x_ptr, out_ptr, a_ptr, b_ptr, e_ptr, seed_ptr, part_ptr, mean_ptr, rstd_ptr,
    C, HW, G, CPG, K,
    s_xn, s_xc, s_xhw, s_an, s_ac, s_en, s_ec,
    eps, p_drop,
    CHUNK: tl.constexpr, BLOCK_HW: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_CPG: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PASS0: tl.constexpr, PASS1: tl.constexpr,
    HAS_ADD: tl.constexpr, SILU: tl.constexpr, DROPOUT: tl.constexpr,
):
    n = tl.program_id(0)
    k = tl.program_id(1)
    hw0 = k * CHUNK
    hw1 = tl.minimum(hw0 + CHUNK, HW)
    gs = tl.arange(0, BLOCK_G)
    ch = gs[:, None] * CPG + tl.arange(0, BLOCK_CPG)[None, :]  # [G, CPG] channel index
    cmask = (gs < G)[:, None] & (tl.arange(0, BLOCK_CPG) < CPG)[None, :]
    rows = tl.arange(0, BLOCK_HW)
    x_base = x_ptr + n * s_xn
    # part_ptr: fp32 [N, K, 2, C], per chunk and channel the (mean, M2) over the chunk's positions
    part_n = part_ptr + n * K * 2 * C

    if PASS0 == 0:
        shift = tl.load(x_base + hw0 * s_xhw + ch * s_xc, mask=cmask, other=0.0).to(tl.float32)
        acc1 = tl.zeros([BLOCK_HW, BLOCK_G, BLOCK_CPG], dtype=tl.float32)
        acc2 = tl.zeros([BLOCK_HW, BLOCK_G, BLOCK_CPG], dtype=tl.float32)
        for i in range(0, CHUNK, BLOCK_HW):
            r = (hw0 + i + rows)[:, None, None]
            m = (r < hw1) & cmask[None, :, :]
            x = tl.load(x_base + r * s_xhw + ch[None, :, :] * s_xc, mask=m, other=0.0).to(tl.float32)
            d = tl.where(m, x - shift[None, :, :], 0.0)
            acc1 += d
            acc2 += d * d
        cnt = (hw1 - hw0).to(tl.float32)
        s1 = tl.sum(acc1, axis=0)
        mean_c = shift + s1 / cnt
        m2_c = tl.sum(acc2, axis=0) - s1 * s1 / cnt
        if PASS1 == 1:
            tl.store(part_n + k * 2 * C + ch, mean_c, mask=cmask)
            tl.store(part_n + k * 2 * C + C + ch, m2_c, mask=cmask)

    if PASS1 == 2:
        if PASS0 == 1:
            # Chan's parallel combination of the K chunks' (count, mean, M2), per channel.
            ks = tl.arange(0, BLOCK_K)[:, None, None]
            km = (ks < K) & cmask[None, :, :]
            cnt_k = tl.where(ks < K, tl.minimum(CHUNK, HW - ks * CHUNK), 0).to(tl.float32)  # last may be short
            mean_k = tl.load(part_n + ks * 2 * C + ch[None, :, :], mask=km, other=0.0)
            m2_k = tl.load(part_n + ks * 2 * C + C + ch[None, :, :], mask=km, other=0.0)
            mean_c = tl.sum(mean_k * cnt_k, axis=0) / HW
            dev = tl.where(km, mean_k - mean_c[None, :, :], 0.0)
            m2_c = tl.sum(m2_k + dev * dev * cnt_k, axis=0)
        if HAS_ADD:
            e = tl.load(e_ptr + n * s_en + ch * s_ec, mask=cmask, other=0.0).to(tl.float32)
            mean_c = mean_c + e
        # Per group: the mean of its channels' means (equal counts); M2 = within-channel + between-channel parts.
        mean_g = tl.sum(tl.where(cmask, mean_c, 0.0), axis=1) / CPG
        dev_c = tl.where(cmask, mean_c - mean_g[:, None], 0.0)
        m2_g = tl.sum(tl.where(cmask, m2_c, 0.0) + HW * dev_c * dev_c, axis=1)
        rstd_g = 1.0 / tl.sqrt(m2_g / (CPG * HW) + eps)
        if k == 0:
            tl.store(mean_ptr + n * G + gs, mean_g, mask=gs < G)
            tl.store(rstd_ptr + n * G + gs, rstd_g, mask=gs < G)
        # y = x * scale + bias per channel: the normalisation, the add and the affine in one FMA.
        a = tl.load(a_ptr + n * s_an + ch * s_ac, mask=cmask, other=0.0)
        b = tl.load(b_ptr + n * s_an + ch * s_ac, mask=cmask, other=0.0)
        scale = a * rstd_g[:, None]
        bias = b - mean_g[:, None] * scale
        if HAS_ADD:
            bias += e * scale
        seed = tl.load(seed_ptr)
        for i in range(0, CHUNK, BLOCK_HW):
            r = (hw0 + i + rows)[:, None, None]
            m = (r < hw1) & cmask[None, :, :]
            offs_x = r * s_xhw + ch[None, :, :] * s_xc
            x = tl.load(x_base + offs_x, mask=m, other=0.0).to(tl.float32)
            y = x * scale[None, :, :] + bias[None, :, :]
            if SILU:
                y = y * tl.sigmoid(y)
            if DROPOUT:
                # The element's logical index (n, hw, c), whatever the layout: the backward draws the same mask.
                offs = (n * HW + r) * C + ch[None, :, :]
                y = tl.where(tl.rand(seed, offs) >= p_drop, y / (1.0 - p_drop), 0.0)
            tl.store(out_ptr + n * s_xn + offs_x, y.to(out_ptr.dtype.element_ty), mask=m)


@triton.jit
def _gn_bwd_kernel(
    dout_ptr, x_ptr, dx_ptr, a_ptr, b_ptr, e_ptr, seed_ptr, mean_ptr, rstd_ptr, part_ptr, da_ptr, db_ptr, de_ptr,
    C, HW, G, CPG, K,
    s_xn, s_xc, s_xhw, s_dn, s_dc, s_dhw, s_an, s_ac, s_en, s_ec,
    p_drop,
    CHUNK: tl.constexpr, BLOCK_HW: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_CPG: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PASS0: tl.constexpr, PASS1: tl.constexpr,
    HAS_ADD: tl.constexpr, SILU: tl.constexpr, DROPOUT: tl.constexpr,
):
    n = tl.program_id(0)
    k = tl.program_id(1)
    hw0 = k * CHUNK
    hw1 = tl.minimum(hw0 + CHUNK, HW)
    gs = tl.arange(0, BLOCK_G)
    ch = gs[:, None] * CPG + tl.arange(0, BLOCK_CPG)[None, :]
    cmask = (gs < G)[:, None] & (tl.arange(0, BLOCK_CPG) < CPG)[None, :]
    rows = tl.arange(0, BLOCK_HW)
    x_base = x_ptr + n * s_xn
    d_base = dout_ptr + n * s_dn
    # part_ptr: fp32 [N, K, 2, C], per chunk and channel sum(dL/dy) and sum(dL/dy * xhat)
    part_n = part_ptr + n * K * 2 * C

    # xhat = x * u + v per channel: u = the group's rstd, v = (e - the group's mean) * u.
    mean_g = tl.load(mean_ptr + n * G + gs, mask=gs < G, other=0.0)
    u = tl.broadcast_to(tl.load(rstd_ptr + n * G + gs, mask=gs < G, other=0.0)[:, None], (BLOCK_G, BLOCK_CPG))
    v = -mean_g[:, None] * u
    if HAS_ADD:
        v += tl.load(e_ptr + n * s_en + ch * s_ec, mask=cmask, other=0.0).to(tl.float32) * u
    a = tl.load(a_ptr + n * s_an + ch * s_ac, mask=cmask, other=0.0)
    b = tl.load(b_ptr + n * s_an + ch * s_ac, mask=cmask, other=0.0)
    seed = tl.load(seed_ptr)

    if PASS0 == 0:
        acc1 = tl.zeros([BLOCK_HW, BLOCK_G, BLOCK_CPG], dtype=tl.float32)
        acc2 = tl.zeros([BLOCK_HW, BLOCK_G, BLOCK_CPG], dtype=tl.float32)
        for i in range(0, CHUNK, BLOCK_HW):
            r = (hw0 + i + rows)[:, None, None]
            m = (r < hw1) & cmask[None, :, :]
            x = tl.load(x_base + r * s_xhw + ch[None, :, :] * s_xc, mask=m, other=0.0).to(tl.float32)
            dout = tl.load(d_base + r * s_dhw + ch[None, :, :] * s_dc, mask=m, other=0.0).to(tl.float32)
            xhat, dy = _act_grad(x, u[None, :, :], v[None, :, :], a[None, :, :], b[None, :, :], dout,
                                 (n * HW + r) * C + ch[None, :, :], seed, p_drop, SILU, DROPOUT)
            acc1 += dy
            acc2 += dy * xhat
        s1 = tl.sum(acc1, axis=0)
        s2 = tl.sum(acc2, axis=0)
        if PASS1 == 1:
            tl.store(part_n + k * 2 * C + ch, s1, mask=cmask)
            tl.store(part_n + k * 2 * C + C + ch, s2, mask=cmask)

    if PASS1 == 2:
        if PASS0 == 1:
            ks = tl.arange(0, BLOCK_K)[:, None, None]
            km = (ks < K) & cmask[None, :, :]
            s1 = tl.sum(tl.load(part_n + ks * 2 * C + ch[None, :, :], mask=km, other=0.0), axis=0)
            s2 = tl.sum(tl.load(part_n + ks * 2 * C + C + ch[None, :, :], mask=km, other=0.0), axis=0)
        if k == 0:
            # dL/da = sum(dy * xhat), dL/db = sum(dy) per (n, c): fp32 [N, C] each
            tl.store(da_ptr + n * C + ch, s2, mask=cmask)
            tl.store(db_ptr + n * C + ch, s1, mask=cmask)
        # dx = u * (dy * a - the group's mean of dy * a - xhat * the group's mean of dy * a * xhat)
        inv_m = 1.0 / (CPG * HW)
        c1 = tl.sum(tl.where(cmask, a * s1, 0.0), axis=1)[:, None] * inv_m
        c2 = tl.sum(tl.where(cmask, a * s2, 0.0), axis=1)[:, None] * inv_m
        acc3 = tl.zeros([BLOCK_HW, BLOCK_G, BLOCK_CPG], dtype=tl.float32)
        for i in range(0, CHUNK, BLOCK_HW):
            r = (hw0 + i + rows)[:, None, None]
            m = (r < hw1) & cmask[None, :, :]
            offs_x = r * s_xhw + ch[None, :, :] * s_xc
            x = tl.load(x_base + offs_x, mask=m, other=0.0).to(tl.float32)
            dout = tl.load(d_base + r * s_dhw + ch[None, :, :] * s_dc, mask=m, other=0.0).to(tl.float32)
            xhat, dy = _act_grad(x, u[None, :, :], v[None, :, :], a[None, :, :], b[None, :, :], dout,
                                 (n * HW + r) * C + ch[None, :, :], seed, p_drop, SILU, DROPOUT)
            dx = u[None, :, :] * (dy * a[None, :, :] - c1[None, :, :] - xhat * c2[None, :, :])
            tl.store(dx_ptr + n * s_xn + offs_x, dx.to(dx_ptr.dtype.element_ty), mask=m)
            if HAS_ADD:
                acc3 += tl.where(m, dx, 0.0)
        if HAS_ADD:
            # dL/de of this chunk per (n, c); the caller sums the K chunks: fp32 [N, K, C]
            tl.store(de_ptr + (n * K + k) * C + ch, tl.sum(acc3, axis=0), mask=cmask)
