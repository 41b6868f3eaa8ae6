"""A 3x3 convolution of our own at about cuDNN's rate on Hopper, in Gluon, that can own its GroupNorm (issue 47).

    out  = conv3x3(act(x), w) (+ bias[c] or bias[n, c]) (+ res)   channels_last bf16, fp32 accumulation, stride 1
    act(x) = silu(x * scale[n, c] + shift[n, c]) with a prologue, else x (zero padding is act's)
    part[n, t, 0, c], part[n, t, 1, c] = mean and M2 of out[n, c] over the pixels of tile t of sample n

The input is read with TMA: a 4-D box [samples, rows, W, 64] of the NHWC tensor a tap, starting at the tap's shift
(-1 included: TMA's zeros are the padding), whose 128-byte rows lie as a 2-D box's would, so wgmma reads it as the
GEMM's [pixels, 64] operand where it landed; the weights are [Cout, 9 * Cin] boxes. A ring of STAGES such pairs, a
barrier each; one asynchronous wgmma in flight, its predecessor's slot refilled at once (NOTES item 34: plain
Triton's own pipelining of the same loads raced; Gluon, Triton's lower-level language, lets every wait be written).

The prologue (optional) is the input's GroupNorm apply + SiLU (scale and shift per (sample, channel): the group
statistics with the affine and any time embedding folded in, as gn_kernels' finalize writes them): the box is read
from shared memory into registers, activated, its padding rows zeroed, and fed to wgmma from registers; once a tap,
so 9 times an element; dropout's keep mask, if any, read as the bits conv_gn.keep_bits makes (the same mask as the
fused GroupNorm's hash), the kept values' 1 / (1 - p) applied once to the accumulator.
The epilogue (optional) adds the bias (per channel, or per (sample, channel): the time embedding) and a residual,
writes the output once, and writes the statistics the next GroupNorm needs from the values it wrote (bf16-rounded):
per (sample, tile, channel) the mean and the sum of squared deviations (M2), which gn_kernels' finalize combines
(Chan). So the chain conv -> add -> GroupNorm statistics reads nothing again.

Needs an sm_90 GPU (TMA, wgmma). No interpreter runs Gluon: tests/test_conv_gluon.py builds it for sm_90 offline and
checks what the build did; benchmarks.speed.conv_tma checks its answers on the GPU.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
from torch import Tensor
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                             warpgroup_mma_wait)


class GluonTiles(NamedTuple):
    """Output pixels a program (`rows` image rows of one sample, or rows // H whole samples where rows > H), output
    channels, input channels a step, warps, ring slots; late: the output's buffer allocated after the main loop, in
    the ring's memory (two programs an SM where the ring is small enough), the residual then read into it."""
    rows: int
    bn: int = 128
    bk: int = 64
    warps: int = 8
    stages: int = 3
    late: bool = False

    def fits(self, h: int, w: int, cin: int, cout: int) -> bool:
        return (self.rows % h == 0 or h % self.rows == 0) and cin % self.bk == 0 and cout % self.bn == 0 and \
            self.rows * w in (64, 128, 256)

    def box(self, h: int) -> tuple[int, int]:
        """(samples, rows) of the input box."""
        return (self.rows // h, h) if self.rows > h else (1, self.rows)


@gluon.constexpr_function
def _mma_layout(BM, BN, num_warps):
    """wgmma's accumulator layout: warps along M first (16 rows a warp), the widest instruction N that divides BN."""
    warps = [4, 1]
    while warps[0] * warps[1] != num_warps:
        if BM > 16 * warps[0]:
            warps[0] *= 2
        else:
            warps[1] *= 2
    n_reps = triton.cdiv(num_warps, triton.cdiv(BM, 16))
    n = 256
    while n > max(BN // n_reps, 8) or BN % n != 0:
        n -= 8
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=warps, instr_shape=[16, n, 16])


@gluon.jit
def _issue(x_desc, w_desc, a_smem, b_smem, bars, j, n0, h0, co, C: gl.constexpr, KC: gl.constexpr,
           STAGES: gl.constexpr):
    """Start step j's two boxes into ring slot j % STAGES: the tap's input box and its weights."""
    slot = j % STAGES
    tap = j // KC
    k = (j - tap * KC) * x_desc.block_type.shape[3]
    bar = bars.index(slot)
    mbarrier.expect(bar, x_desc.block_type.nbytes + w_desc.block_type.nbytes)  # TMA counts its zeros too
    tma.async_copy_global_to_shared(x_desc, [n0, h0 + tap // 3 - 1, tap % 3 - 1, k], bar, a_smem.index(slot))
    tma.async_copy_global_to_shared(w_desc, [co, tap * C + k], bar, b_smem.index(slot))


@gluon.jit
def _out_buffer(o_desc, r_desc, row0, co, RES: gl.constexpr):
    """The output tile's shared buffer; with RES the residual tile starts landing in it (wait on the barrier
    returned, else an unused one)."""
    c_smem = gl.allocate_shared_memory(o_desc.dtype, o_desc.block_type.shape, o_desc.layout)
    r_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    if RES:
        mbarrier.init(r_bar, count=1)
        mbarrier.expect(r_bar, r_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(r_desc, [row0, co], r_bar, c_smem)
    return c_smem, r_bar


@gluon.jit
def _store(o_desc, c_smem, y, row0, co):
    c_smem.store(y)
    fence_async_shared()
    tma.async_copy_shared_to_global(o_desc, [row0, co], c_smem)


@gluon.jit
def _conv3x3_kernel(x_desc, w_desc, o_desc, r_desc, bias_ptr, part_ptr, scale_ptr, shift_ptr, bits_ptr, inv_keep,
                    TILES, N_BLOCKS, C: gl.constexpr, STAGES: gl.constexpr, PRO: gl.constexpr, DROP: gl.constexpr,
                    BIAS: gl.constexpr, RES: gl.constexpr, STATS: gl.constexpr, LATE: gl.constexpr,
                    num_warps: gl.constexpr):
    NB: gl.constexpr = x_desc.block_type.shape[0]  # whole samples a program (1 from 16x16 up)
    BH: gl.constexpr = x_desc.block_type.shape[1]
    W: gl.constexpr = x_desc.block_type.shape[2]
    BK: gl.constexpr = x_desc.block_type.shape[3]
    BN: gl.constexpr = w_desc.block_type.shape[0]
    BM: gl.constexpr = NB * BH * W
    KC: gl.constexpr = C // BK
    STEPS: gl.constexpr = 9 * KC
    dtype: gl.constexpr = x_desc.dtype

    pid = gl.program_id(0)
    co = (pid % N_BLOCKS) * BN  # a pixel tile's channel blocks are neighbours: its input boxes come from L2
    t = pid // N_BLOCKS
    n0 = (t // TILES) * NB
    h0 = (t % TILES) * BH
    row0 = (n0 * x_desc.shape[1] + h0) * W

    a_smem = gl.allocate_shared_memory(dtype, [STAGES] + x_desc.block_type.shape, x_desc.layout)
    b_smem = gl.allocate_shared_memory(dtype, [STAGES] + w_desc.block_type.shape, w_desc.layout)
    bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(bars.index(s), count=1)
    if not LATE:  # the output's buffer now, and the residual landing in it while the main loop runs
        c_smem, r_bar = _out_buffer(o_desc, r_desc, row0, co, RES)
    for s in gl.static_range(STAGES - 1):
        _issue(x_desc, w_desc, a_smem, b_smem, bars, s, n0, h0, co, C, KC, STAGES)

    layout: gl.constexpr = _mma_layout(BM, BN, num_warps)
    acc = gl.zeros((BM, BN), dtype=gl.float32, layout=layout)
    if PRO:  # each row's pixel, to zero the activation where a tap falls outside the image (TMA's zeros are x's)
        a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=layout, k_width=2)
        a_rows = gl.arange(0, BM, layout=gl.SliceLayout(1, a_layout))
        a_cols = gl.arange(0, BK, layout=gl.SliceLayout(0, a_layout))
        hh = h0 + (a_rows % (BH * W)) // W
        ww = a_rows % W
        a_n = gl.expand_dims(n0 + a_rows // (BH * W), 1)
        a_real = a_n < x_desc.shape[0]  # a last program of whole samples may run past the batch: TMA gives zeros
        H = x_desc.shape[1]
    for i in range(STEPS):
        slot = i % STAGES
        mbarrier.wait(bars.index(slot), (i // STAGES) & 1)
        # [NB, BH, W, BK] rows of 128 bytes are the GEMM's [BM, BK] operand as they lie: a view, not a copy
        a_view = a_smem.index(slot).reshape([BM, BK])
        if PRO:
            # the input's GroupNorm apply and SiLU on the box as wgmma takes it from registers: act = silu(x * scale
            # + shift) per (sample, channel), zero where the tap is padding; once a tap (9 times an element)
            tap = i // KC
            ch = gl.expand_dims((i - tap * KC) * BK + a_cols, 0)
            if NB == 1:
                sc = gl.load(scale_ptr + n0 * C + ch)
                sh = gl.load(shift_ptr + n0 * C + ch)
            else:
                sc = gl.load(scale_ptr + a_n * C + ch, mask=a_real, other=0.0)
                sh = gl.load(shift_ptr + a_n * C + ch, mask=a_real, other=0.0)
            # SiLU as h + h * tanh(h), h = y / 2: one MUFU op a value where y / (1 + exp(-y)) takes an exponential
            # and an IEEE division, nine times an element here (conv_gn._silu_half; eee22f5's prologue: 4-5x the
            # plain kernel's time)
            h = (a_view.load(a_layout).to(gl.float32) * sc + sh) * 0.5
            v = h + h * gl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=f,f", [h], dtype=gl.float32,
                                                  is_pure=True, pack=1)
            dr = tap // 3 - 1
            dc = tap % 3 - 1
            inside = gl.expand_dims((hh + dr >= 0) & (hh + dr < H) & (ww + dc >= 0) & (ww + dc < W), 1)
            if DROP:  # dropout's keep bits of the tap's pixel (conv_gn.keep_bits' words); 1 / (1 - p) on acc
                inside = inside & a_real
                pix = gl.expand_dims(((n0 + a_rows // (BH * W)) * H + hh + dr) * W + ww + dc, 1)
                word = gl.load(bits_ptr + pix * ((C + 31) // 32) + ch // 32, mask=inside, other=0)
                inside = inside & (((word >> (ch % 32)) & 1) != 0)
            acc = warpgroup_mma(gl.where(inside, v, 0.0).to(dtype), b_smem.index(slot).permute((1, 0)), acc,
                                is_async=True)
        else:
            acc = warpgroup_mma(a_view, b_smem.index(slot).permute((1, 0)), acc, is_async=True)
        # step i-1's wgmma is done once at most one is in flight: its slot takes step i + STAGES - 1's boxes
        acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc, ))
        if i + STAGES - 1 < STEPS:
            _issue(x_desc, w_desc, a_smem, b_smem, bars, i + STAGES - 1, n0, h0, co, C, KC, STAGES)
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
    for s in gl.static_range(STAGES):
        mbarrier.invalidate(bars.index(s))
    if LATE:  # allocated after the ring's last use, the output's buffer takes the ring's memory: less shared memory
        # a program, two programs an SM, one's epilogue beside the other's main loop; the residual is read now
        c_smem, r_bar = _out_buffer(o_desc, r_desc, row0, co, RES)

    HW: gl.constexpr = BH * W  # a sample's pixels in this tile (BH = H where a program holds whole samples)
    if DROP:  # the kept activations' 1 / (1 - p), once on the sum (the convolution is linear)
        acc = acc * inv_keep
    cols = co + gl.arange(0, BN, layout=gl.SliceLayout(0, layout))
    rows = gl.arange(0, BM, layout=gl.SliceLayout(1, layout))
    n_rows = n0 + rows // HW  # each row's sample
    cout = w_desc.shape[0]
    if BIAS == 1:  # per channel
        acc = acc + gl.expand_dims(gl.load(bias_ptr + cols), 0)
    if BIAS == 2 and NB == 1:  # per (sample, channel): the tile's one sample's row of the table
        acc = acc + gl.expand_dims(gl.load(bias_ptr + n0 * cout + cols), 0)
    if BIAS == 2 and NB > 1:  # ... each row's sample's, a small table in L2
        keep = gl.expand_dims(n_rows < x_desc.shape[0], 1)
        acc = acc + gl.load(bias_ptr + gl.expand_dims(n_rows, 1) * cout + gl.expand_dims(cols, 0), mask=keep,
                            other=0.0)
    if RES:
        mbarrier.wait(r_bar, 0)
        acc = acc + c_smem.load(layout).to(gl.float32)
        mbarrier.invalidate(r_bar)
        gl.thread_barrier()  # every thread has read the residual before the output overwrites it
    y = acc.to(dtype)
    if not LATE:  # the output's store runs beside the statistics
        _store(o_desc, c_smem, y, row0, co)
    if STATS and NB == 1:
        # the tile's column sums and sums of squares of the values written, in one pass (fp32 over <= 256 pixels:
        # M2 = sum y^2 - sum y * mean keeps ~1e-4 of the variance unless |mean| > ~30 std)
        yf = y.to(gl.float32)
        s1 = gl.sum(yf, axis=0)
        mean = s1 / HW
        at = part_ptr + (n0 * TILES + t % TILES) * 2 * cout + cols
        ok = (cols < cout) & (n0 < x_desc.shape[0])
        gl.store(at, mean, mask=ok)
        gl.store(at + cout, gl.sum(yf * yf, axis=0) - s1 * mean, mask=ok)
    if STATS and NB > 1:  # the same a sample: the tile's rows as (samples, pixels, channels)
        y3 = gl.reshape(y.to(gl.float32), [NB, HW, BN])
        s1 = gl.sum(y3, axis=1)
        s2 = gl.sum(y3 * y3, axis=1)
        mean = s1 / HW
        sl: gl.constexpr = s1.type.layout
        samples = gl.expand_dims(n0 + gl.arange(0, NB, layout=gl.SliceLayout(1, sl)), 1)
        chans = gl.expand_dims(co + gl.arange(0, BN, layout=gl.SliceLayout(0, sl)), 0)
        at = part_ptr + samples * TILES * 2 * cout + chans
        ok = (samples < x_desc.shape[0]) & (chans < cout)
        gl.store(at, mean, mask=ok)
        gl.store(at + cout, s2 - s1 * mean, mask=ok)
    if LATE:  # after the statistics: their reductions' scratch may share the ring's memory with the late output
        # buffer, which the TMA store reads after its op has returned (a55667d stored last for all tiles: NaN no
        # more, but 0.4 ms a step slower at the other tiles)
        _store(o_desc, c_smem, y, row0, co)
    tma.store_wait(pendings=0)


def _desc(t: Tensor, block: list[int]):
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    return TensorDescriptor.from_tensor(t, block, gl.NVMMASharedLayout.get_default_for(block, gl.bfloat16))


def nhwc_operands(who: str, x: Tensor, w: Tensor, tiles, res: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """(x as NHWC, w as (Cout, 9 * Cin), an empty channels_last output) for a TMA convolution of x (N, C, H, W) by w
    (Cout, C, 3, 3), stride 1, after `tiles.fits` and the layouts TMA needs (dense views) are checked: one-line
    errors named by `who`."""
    n, c, h, wd = x.shape
    cout = w.shape[0]
    if not tiles.fits(h, wd, c, cout):
        raise ValueError(f"{who}: {tiles} does not tile a {h}x{wd} image of {c} -> {cout} channels")
    xh = x.permute(0, 2, 3, 1)  # the NHWC tensor channels_last memory is (a view: TMA needs it dense)
    wk = w.permute(0, 2, 3, 1).reshape(cout, 9 * c)  # (Cout, r, s, Cin): a view when w is channels_last
    if not (xh.is_contiguous() and wk.is_contiguous()) or (res is not None and not res.is_contiguous(
            memory_format=torch.channels_last)):
        named = "x, w and res" if res is not None else "x and w"
        raise ValueError(f"{who}: {named} must be channels_last (t.to(memory_format=torch.channels_last))")
    return xh, wk, torch.empty((n, cout, h, wd), device=x.device, dtype=x.dtype, memory_format=torch.channels_last)


def conv3x3(x: Tensor, w: Tensor, tiles: GluonTiles, bias: Tensor | None = None, res: Tensor | None = None,
            stats: bool = False, prologue: tuple[Tensor, Tensor] | None = None,
            dropout: tuple[Tensor, float] | None = None) -> tuple[Tensor, Tensor | None]:
    """(out, part): F.conv2d(act(x), w, padding=1) + bias + res for channels_last bf16 x (N, C, H, W) and w
    (Cout, C, 3, 3), stride 1; act(x) = silu(x * scale + shift) with prologue = (scale, shift), fp32 (N, C) (a
    GroupNorm's apply with its affine folded in: gn_kernels' coef), else x; bias fp32 (Cout,) or (N, Cout); res like
    out; dropout = (bits, p): the activation dropped where conv_gn.keep_bits' bits (int32 (N * H * W, ceil(C / 32)))
    are 0 and scaled by 1 / (1 - p) (with a prologue only). part (N, tiles a sample, 2, Cout) fp32, the mean and M2
    of out over each tile's pixels, if stats; else None."""
    n, c, h, wd = x.shape
    cout = w.shape[0]
    xh, wk, out = nhwc_operands("conv_gluon", x, w, tiles, res)
    nb, bh = tiles.box(h)
    bm = nb * bh * wd
    flat = out.permute(0, 2, 3, 1).reshape(n * h * wd, cout)
    o_desc = _desc(flat, [bm, tiles.bn])
    r_desc = _desc(res.permute(0, 2, 3, 1).reshape(n * h * wd, cout), [bm, tiles.bn]) if res is not None else o_desc
    tiles_h, nblocks = h // bh, cout // tiles.bn
    part = torch.empty((n, tiles_h, 2, cout), device=x.device, dtype=torch.float32) if stats else None
    bias_kind = 0 if bias is None else 1 if bias.dim() == 1 else 2
    scale, shift = prologue if prologue is not None else (out, out)
    if dropout is not None and prologue is None:
        raise ValueError("conv_gluon: dropout is applied to the prologue's activation: give a prologue too")
    bits, p = dropout if dropout is not None else (out, 0.0)
    grid = (triton.cdiv(n, nb) * tiles_h * nblocks,)
    _conv3x3_kernel[grid](_desc(xh, [nb, bh, wd, tiles.bk]), _desc(wk, [tiles.bn, tiles.bk]), o_desc, r_desc,
                          bias if bias is not None else out, part if stats else out, scale, shift, bits,
                          1.0 / (1.0 - p), tiles_h, nblocks, C=c, STAGES=tiles.stages, PRO=prologue is not None,
                          DROP=dropout is not None, BIAS=bias_kind, RES=res is not None, STATS=stats,
                          LATE=tiles.late, num_warps=tiles.warps)
    return out, part


def reference(x: Tensor, w: Tensor, rows: int, bias: Tensor | None = None, res: Tensor | None = None,
              prologue: tuple[Tensor, Tensor] | None = None, dropout: tuple[Tensor, float] | None = None):
    """conv3x3's (out, part) in torch: fp32 arithmetic, the activation and out rounded to bf16 as the kernel has
    them."""
    a = x.float()
    if prologue is not None:
        scale, shift = prologue
        a = torch.nn.functional.silu(a * scale[:, :, None, None] + shift[:, :, None, None]).to(x.dtype).float()
    if dropout is not None:
        from ffcv_ddpm.norm import unpack_bits

        bits, p = dropout
        a = a * unpack_bits(bits, tuple(x.shape)) / (1 - p)
    out = torch.nn.functional.conv2d(a, w.float(), padding=1)
    if bias is not None:
        out = out + (bias.float()[None, :, None, None] if bias.dim() == 1 else bias.float()[:, :, None, None])
    if res is not None:
        out = out + res.float()
    out = out.to(x.dtype)
    n, c, h, wd = out.shape
    bh = min(rows, h)
    tiles = out.float().reshape(n, c, h // bh, bh * wd)
    mean = tiles.mean(-1)
    m2 = ((tiles - mean[..., None]) ** 2).sum(-1)
    return out, torch.stack([mean, m2], 2).permute(0, 3, 2, 1).contiguous()  # (n, tile, 2, c)


def build(tiles: GluonTiles, h: int, cin: int, cout: int, bias: int = 0, res: bool = False, stats: bool = False,
          prologue: bool = False, dropout: bool = False, arch: int = 90) -> tuple[str, int]:
    """The kernel compiled for sm_<arch> without a GPU (Triton's own ptxas), for tiles at an h x h site: its PTX and
    the shared memory a program takes.
    Not under TRITON_INTERPRET=1 (that makes the kernel an interpreted function): tests/test_conv_gluon.py runs it in
    a subprocess without it."""
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import CUDABackend
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import native_specialize_impl

    nb, bh = tiles.box(h)

    def desc(shape, block):  # its type as the launcher would specialise it (a CPU tensor's pointer will do)
        return native_specialize_impl(CUDABackend, _desc(torch.empty(shape, dtype=torch.bfloat16), block), False,
                                      True, True)[0]

    o = desc((2 * nb * h * h, cout), [nb * bh * h, tiles.bn])
    signature = {"x_desc": desc((2 * nb, h, h, cin), [nb, bh, h, tiles.bk]),
                 "w_desc": desc((cout, 9 * cin), [tiles.bn, tiles.bk]), "o_desc": o, "r_desc": o,
                 "bias_ptr": "*fp32" if bias else "*bf16", "part_ptr": "*fp32" if stats else "*bf16",
                 "scale_ptr": "*fp32" if prologue else "*bf16", "shift_ptr": "*fp32" if prologue else "*bf16",
                 "bits_ptr": "*i32" if dropout else "*bf16", "inv_keep": "fp32", "TILES": "i32", "N_BLOCKS": "i32",
                 "C": "constexpr", "STAGES": "constexpr", "PRO": "constexpr", "DROP": "constexpr",
                 "BIAS": "constexpr", "RES": "constexpr", "STATS": "constexpr", "LATE": "constexpr",
                 "num_warps": "constexpr"}
    names = list(signature)
    constants = {"C": cin, "STAGES": tiles.stages, "PRO": prologue, "DROP": dropout, "BIAS": bias, "RES": res,
                 "STATS": stats, "LATE": tiles.late, "num_warps": tiles.warps}
    source = GluonASTSource(fn=_conv3x3_kernel, signature=signature,
                            constexprs={(names.index(k),): v for k, v in constants.items()})
    compiled = triton.compile(source, target=GPUTarget("cuda", arch, 32), options={"num_warps": tiles.warps})
    return compiled.asm["ptx"], compiled.metadata.shared
