"""Does Hopper's TMA lift a Triton 3x3 convolution to cuDNN's rate? (issue 47, NOTES items 28-29, 34)

    python -m benchmarks.speed.conv_tma --out DIR                  # CUDA: every stride-1 3x3 site of ddpm-cifar10
    python -m benchmarks.speed.conv_tma --out DIR --sites 4 --kinds gluon data.batch_size=512

NOTES 28: a convolution that owns its GroupNorm wins only if its GEMM runs at >= ~60% of cuDNN's rate with the
prologue and epilogue inside; item 28's Triton implicit GEMM (pointer loads of shifted rows) reached 57% with nothing
inside, Inductor's templates 0.66-0.90x (item 29). Both load the input with pointers. These kernels load it with the
tensor memory accelerator: a 4-D descriptor over the NHWC input, one box of [samples, rows, W, BK] a tap (the tap's
shift is the box's start, -1 included: TMA fills the padding with zeros), read as the GEMM's [pixels, BK] operand,
and the weights as [Cout, 9 * Cin] boxes. That is what CUTLASS's sm90 convolutions do in tiled mode.

Two kernels: "box", plain Triton, whose compiler pipelines the loads (item 34: 0.8x cuDNN where correct, its faster
schedules wrong: the reshaped box goes through registers); "gluon", the same boxes in Gluon, Triton's lower-level
language, with the ring of buffers, its barriers and the wgmma waits written out, both operands read from shared
memory. Nothing else in either: no bias, no prologue, no statistics. Per site (stride 1, channels a multiple of 64:
17 of the 22 distinct sites, 98% of the step's 3x3 FLOPs), the best correct tile shape of each kernel against
F.conv2d with cuDNN's search, as CUDA-graph replays (norm_bench.graph_ms), each config checked against fp32 torch
over three calls. conv_tma.json and .md are rewritten after every site. On CPU tensors the box kernel runs under
Triton's interpreter (tests/test_conv_tma.py); the Gluon kernel is built there for sm_90 (no interpreter runs Gluon).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import NamedTuple

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import Tensor
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                             warpgroup_mma_wait)

from benchmarks.common import commit_text, md_table, write_json, write_text
from ffcv_ddpm.checks import Parser, at_least, fail, option


class Tiles(NamedTuple):
    """Output pixels a program (BH rows x BW columns of one sample, or BH // H whole samples where BH > H), output
    channels, input channels a step, warps, pipelined loads, and the kernel: "box" (plain Triton, its compiler
    pipelining the loads) or "gluon" (the same boxes in a ring of STAGES buffers whose every wait is written out:
    both operands read by wgmma from shared memory, one wgmma in flight while the next boxes load)."""
    bh: int
    bw: int
    bn: int = 128
    bk: int = 64
    warps: int = 8
    stages: int = 4
    kind: str = "box"

    def fits(self, h: int, w: int, cin: int, cout: int) -> bool:
        rows = (self.bh % h == 0 or h % self.bh == 0) and self.bw == w if self.kind == "gluon" else h % self.bh == 0
        return rows and w % self.bw == 0 and cin % self.bk == 0 and cout % self.bn == 0


def configs_for(h: int, w: int) -> list[Tiles]:
    """A few shapes a site. Boxes: 128 output pixels a program (a wgmma M of 128, two warpgroups), 64 at 8x8; 128 or
    256 output channels. Gluon: 128 pixels a program at every size (whole images below 16x16), 128 or 256 channels."""
    bw = min(w, 32)
    m = 128 if h * w >= 128 else 64
    boxes = [Tiles(m // bw, bw, 128, 64, 8, 4), Tiles(m // bw, bw, 128, 64, 4, 4), Tiles(m // bw, bw, 256, 64, 8, 3),
             Tiles(2 * m // bw, bw, 128, 64, 8, 3)]
    gluon_ = [Tiles(128 // w, w, 128, 64, 4, 4, "gluon"), Tiles(128 // w, w, 128, 64, 8, 4, "gluon"),
              Tiles(128 // w, w, 256, 64, 8, 3, "gluon"), Tiles(256 // w, w, 128, 64, 8, 3, "gluon")]
    return boxes + gluon_


@triton.jit
def _conv3x3_tma_kernel(x_desc, w_desc, o_desc, TILES_H, TILES_W, N_BLOCKS, C: tl.constexpr,
                        BH: tl.constexpr, BW: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                        STAGES: tl.constexpr, FP32_DOT: tl.constexpr):
    # Output-channel blocks of one pixel tile are neighbours in launch order: they read the same input boxes from L2.
    pid = tl.program_id(0)
    co = (pid % N_BLOCKS) * BN
    sp = pid // N_BLOCKS
    n = sp // (TILES_H * TILES_W)
    t = sp % (TILES_H * TILES_W)
    h0 = (t // TILES_W) * BH
    w0 = (t % TILES_W) * BW
    kc: tl.constexpr = C // BK  # C a constant: the loop's bound and the tap's split known to the compiler
    acc = tl.zeros((BH * BW, BN), dtype=tl.float32)
    for i in tl.range(0, 9 * kc, num_stages=STAGES):
        tap = i // kc
        k = (i - tap * kc) * BK
        # the tap (r, s) reads x[n, h0 + r - 1 : ..., w0 + s - 1 : ..., k : k + BK]; outside the image TMA gives 0
        a = x_desc.load([n, h0 + tap // 3 - 1, w0 + tap % 3 - 1, k]).reshape(BH * BW, BK)
        b = w_desc.load([co, tap * C + k])  # [BN, BK] of the weights as [Cout, 3 * 3 * Cin]
        if FP32_DOT:  # Triton 3.6's interpreter multiplies descriptor-loaded bf16 as raw bits: exact fp32 copies
            acc = tl.dot(a.to(tl.float32), b.to(tl.float32).T, acc)
        else:
            acc = tl.dot(a, b.T, acc)
    o_desc.store([n, h0, w0, co], acc.to(o_desc.dtype).reshape(1, BH, BW, BN))


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
def _conv3x3_gluon_kernel(x_desc, w_desc, o_desc, TILES, N_BLOCKS, C: gl.constexpr, STAGES: gl.constexpr,
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
    co = (pid % N_BLOCKS) * BN  # a pixel tile's channel blocks are neighbours: its boxes come from L2
    t = pid // N_BLOCKS
    n0 = (t // TILES) * NB
    h0 = (t % TILES) * BH

    a_smem = gl.allocate_shared_memory(dtype, [STAGES] + x_desc.block_type.shape, x_desc.layout)
    b_smem = gl.allocate_shared_memory(dtype, [STAGES] + w_desc.block_type.shape, w_desc.layout)
    bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(bars.index(s), count=1)
    for s in gl.static_range(STAGES - 1):
        _issue(x_desc, w_desc, a_smem, b_smem, bars, s, n0, h0, co, C, KC, STAGES)

    acc = gl.zeros((BM, BN), dtype=gl.float32, layout=_mma_layout(BM, BN, num_warps))
    for i in range(STEPS):
        slot = i % STAGES
        mbarrier.wait(bars.index(slot), (i // STAGES) & 1)
        # [NB, BH, W, BK] rows of 128 bytes are the GEMM's [BM, BK] operand as they lie: a view, not a copy
        acc = warpgroup_mma(a_smem.index(slot).reshape([BM, BK]), b_smem.index(slot).permute((1, 0)), acc,
                            is_async=True)
        # step i-1's wgmma is done once at most one is in flight: its slot takes step i + STAGES - 1's boxes
        acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc, ))
        if i + STAGES - 1 < STEPS:
            _issue(x_desc, w_desc, a_smem, b_smem, bars, i + STAGES - 1, n0, h0, co, C, KC, STAGES)
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
    for s in gl.static_range(STAGES):
        mbarrier.invalidate(bars.index(s))

    c_smem = gl.allocate_shared_memory(dtype, o_desc.block_type.shape, o_desc.layout)
    c_smem.store(acc.to(dtype))
    fence_async_shared()
    tma.async_copy_shared_to_global(o_desc, [(n0 * x_desc.shape[1] + h0) * W, co], c_smem)
    tma.store_wait(pendings=0)


def conv3x3(x: Tensor, w: Tensor, tiles: Tiles) -> Tensor:
    """F.conv2d(x, w, padding=1) for channels_last x (N, C, H, W) and w (Cout, C, 3, 3), stride 1, no bias."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    n, c, h, wd = x.shape
    cout = w.shape[0]
    if not tiles.fits(h, wd, c, cout):
        raise ValueError(f"conv_tma: {tiles} does not tile a {h}x{wd} image of {c} -> {cout} channels")
    xh = x.permute(0, 2, 3, 1)  # the NHWC tensor channels_last memory is (a view: TMA needs it dense)
    wk = w.permute(0, 2, 3, 1).reshape(cout, 9 * c)  # (Cout, r, s, Cin): a view when w is channels_last
    if not (xh.is_contiguous() and wk.is_contiguous()):
        raise ValueError("conv_tma: x and w must be channels_last (x.to(memory_format=torch.channels_last))")
    out = torch.empty((n, cout, h, wd), device=x.device, dtype=x.dtype, memory_format=torch.channels_last)
    if tiles.kind == "gluon":
        return _gluon_conv3x3(xh, wk, out, tiles)
    x_desc = TensorDescriptor.from_tensor(xh, [1, tiles.bh, tiles.bw, tiles.bk])
    w_desc = TensorDescriptor.from_tensor(wk, [tiles.bn, tiles.bk])
    o_desc = TensorDescriptor.from_tensor(out.permute(0, 2, 3, 1), [1, tiles.bh, tiles.bw, tiles.bn])
    th, tw, nb = h // tiles.bh, wd // tiles.bw, cout // tiles.bn
    _conv3x3_tma_kernel[(n * th * tw * nb,)](x_desc, w_desc, o_desc, th, tw, nb, C=c, BH=tiles.bh, BW=tiles.bw,
                                             BN=tiles.bn, BK=tiles.bk, STAGES=tiles.stages,
                                             FP32_DOT=triton.knobs.runtime.interpret, num_warps=tiles.warps)
    return out


def _gluon_conv3x3(xh: Tensor, wk: Tensor, out: Tensor, tiles: Tiles) -> Tensor:
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonDescriptor

    n, h, wd, c = xh.shape
    cout = wk.shape[0]
    nb, bh = (tiles.bh // h, h) if tiles.bh > h else (1, tiles.bh)

    def desc(t, block):
        return GluonDescriptor.from_tensor(t, block, gl.NVMMASharedLayout.get_default_for(block, gl.bfloat16))

    x_desc = desc(xh, [nb, bh, wd, tiles.bk])
    w_desc = desc(wk, [tiles.bn, tiles.bk])
    o_desc = desc(out.permute(0, 2, 3, 1).reshape(n * h * wd, cout), [nb * bh * wd, tiles.bn])
    tiles_h, nblocks = h // bh, cout // tiles.bn
    grid = (triton.cdiv(n, nb) * tiles_h * nblocks,)
    _conv3x3_gluon_kernel[grid](x_desc, w_desc, o_desc, tiles_h, nblocks, C=c, STAGES=tiles.stages,
                                num_warps=tiles.warps)
    return out


def build_gluon(tiles: Tiles, h: int, cin: int, cout: int, arch: int = 90) -> str:
    """The Gluon kernel compiled for sm_<arch> without a GPU (Triton's own ptxas), for tiles at an h x h site: its
    PTX. What it checks: the kernel builds for Hopper, and how its operands reach wgmma (tests/test_conv_tma.py).
    Not under TRITON_INTERPRET=1 (that makes the kernel an interpreted function)."""
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import CUDABackend
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonDescriptor
    from triton.runtime.jit import native_specialize_impl

    nb, bh = (tiles.bh // h, h) if tiles.bh > h else (1, tiles.bh)

    def desc(shape, block):  # its type as the launcher would specialise it (a CPU tensor's pointer will do)
        d = GluonDescriptor.from_tensor(torch.empty(shape, dtype=torch.bfloat16), block,
                                        gl.NVMMASharedLayout.get_default_for(block, gl.bfloat16))
        return native_specialize_impl(CUDABackend, d, False, True, True)[0]

    signature = {"x_desc": desc((2 * nb, h, h, cin), [nb, bh, h, tiles.bk]), "w_desc": desc((cout, 9 * cin),
                 [tiles.bn, tiles.bk]), "o_desc": desc((2 * nb * h * h, cout), [nb * bh * h, tiles.bn]),
                 "TILES": "i32", "N_BLOCKS": "i32", "C": "constexpr", "STAGES": "constexpr", "num_warps": "constexpr"}
    names = list(signature)
    constants = {"C": cin, "STAGES": tiles.stages, "num_warps": tiles.warps}
    source = GluonASTSource(fn=_conv3x3_gluon_kernel, signature=signature,
                            constexprs={(names.index(k),): v for k, v in constants.items()})
    return triton.compile(source, target=GPUTarget("cuda", arch, 32), options={"num_warps": tiles.warps}).asm["ptx"]


def rel_error(out: Tensor, ref: Tensor) -> float:
    return float((out.float() - ref).abs().max() / ref.abs().max().clamp_min(1e-12))


KINDS = ("box", "gluon")


def render(result: dict) -> str:
    kinds = result.get("kinds", ["box"])
    lines = [f"# TMA-fed 3x3 convolutions (Triton, Gluon) against cuDNN ({result.get('device_name')})", "",
             f"`{result['command']}`", "",
             f"commit {commit_text(result['environment'])}, torch {result['environment'].get('torch')}, Triton "
             f"{result.get('triton')}; batch {result['batch']}, bf16, channels_last, stride 1, fp32 accumulation; ms a "
             "call (TFLOP/s), CUDA-graph replays; each kernel's fastest tile shape a site among those whose worst "
             "error over three calls is <= 2e-2 (the json has every config, wrong ones included).", ""]
    rows, tot = [], {k: [0.0, 0.0] for k in kinds}  # kind: [cuDNN ms, kernel ms] over the sites it ran
    for s in result["sites"]:
        cells = [s["name"], str(s["count"]), f"{s['cudnn_ms']:.3f} ({s['flop'] / s['cudnn_ms'] / 1e9:.0f})"]
        for k in kinds:
            best = s.get("best", {}).get(k)
            if best is None:
                cells.append("-")
                continue
            tot[k][0] += s["count"] * s["cudnn_ms"]
            tot[k][1] += s["count"] * best["ms"]
            cells.append(f"{best['ms']:.3f} ({s['flop'] / best['ms'] / 1e9:.0f}), {s['cudnn_ms'] / best['ms']:.2f}x, "
                         f"{tuple(best['tiles'][:6])}")
        rows.append(cells)
    lines += md_table(["site", "a step", "cuDNN ms (TFLOP/s)",
                       *(f"{k} ms (TFLOP/s), rate vs cuDNN, tiles (BH, BW, BN, BK, warps, stages)" for k in kinds)],
                      rows)
    lines.append("")
    for k, (c, t) in tot.items():
        if t:
            lines.append(f"- {k}: over the sites it ran, a step: cuDNN {c:.2f} ms, {k} {t:.2f} ms ({c / t:.2f}x "
                         "cuDNN's rate).")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = Parser(prog="python -m benchmarks.speed.conv_tma", doc=__doc__, overrides=True,
               epilog="Overrides: data.batch_size (default 1024) and model.* configure the network the sites are "
                      "recorded from.")
    p.add_argument("--out", type=Path, required=True, help="folder for conv_tma.json and .md")
    p.add_argument("--preset", default="ddpm-cifar10")
    p.add_argument("--sites", type=option(int, at_least(1)), help="only the first N sites (by FLOPs a step)")
    p.add_argument("--iters", type=option(int, at_least(1)), default=10, help="calls per captured graph")
    p.add_argument("--kinds", default=",".join(KINDS), help=f"comma-separated, of {', '.join(KINDS)}")
    args, overrides = p.parse_with_overrides(argv)
    kinds = [k for k in args.kinds.split(",") if k]
    if bad := [k for k in kinds if k not in KINDS]:
        return fail("conv_tma", f"--kinds {','.join(bad)}: expected some of {', '.join(KINDS)}")
    from ffcv_ddpm.config import load_config

    try:
        cfg = load_config(args.preset, ["data.batch_size=1024", *overrides])
    except ValueError as e:
        return fail("conv_tma", str(e))
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9:
        return fail("conv_tma", "needs a CUDA GPU with TMA (sm_90 or newer: H100, H200)")
    from benchmarks.speed.conv_gn_bench import sites_by_cost
    from benchmarks.speed.norm_bench import graph_ms
    from ffcv_ddpm.env import environment

    torch.backends.cudnn.benchmark = True  # F.conv2d as the step runs it
    batch = cfg.data.batch_size
    sites = [(s, c) for s, c in sites_by_cost(cfg.model, batch) if s.stride == 1][:args.sites]
    result = {"command": "python -m benchmarks.speed.conv_tma " + " ".join(sys.argv[1:] if argv is None else argv),
              "environment": environment(), "device_name": torch.cuda.get_device_name(), "batch": batch,
              "triton": triton.__version__, "kinds": kinds, "sites": []}
    args.out.mkdir(parents=True, exist_ok=True)
    g = torch.Generator(device="cuda").manual_seed(0)
    t0 = time.time()
    for spec, count in sites:
        cl = torch.channels_last
        x = torch.randn(batch, spec.cin, spec.h, spec.h, device="cuda", generator=g).to(torch.bfloat16).to(
            memory_format=cl)
        w = (torch.randn(spec.cout, spec.cin, 3, 3, device="cuda", generator=g) * (9 * spec.cin) ** -0.5).to(
            torch.bfloat16).to(memory_format=cl)
        entry = {"name": spec.name(), "count": count, "flop": 2 * batch * spec.h * spec.h * spec.cout * spec.cin * 9,
                 "cudnn_ms": graph_ms(lambda: F.conv2d(x, w, padding=1), args.iters, warmup=2), "rows": []}
        result["sites"].append(entry)
        ref = F.conv2d(x.float(), w.float(), padding=1)
        for tiles in configs_for(spec.h, spec.h):
            row = {"tiles": list(tiles)}
            if tiles.kind not in kinds or not tiles.fits(spec.h, spec.h, spec.cin, spec.cout):
                continue
            try:
                # the worst of three calls: a kernel that races gives a different answer from call to call
                row["rel_err"] = max(rel_error(conv3x3(x, w, tiles), ref) for _ in range(3))
                row["ms"] = graph_ms(lambda: conv3x3(x, w, tiles), args.iters, warmup=2)
            except Exception as e:  # noqa: BLE001 - a shape Triton cannot build is a row with its error
                row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
            entry["rows"].append(row)
        entry["best"] = {}
        for k in kinds:
            good = [r for r in entry["rows"] if r["tiles"][6] == k and "ms" in r and r["rel_err"] <= 2e-2]
            if good:
                entry["best"][k] = min(good, key=lambda r: r["ms"])
        write_json(args.out / "conv_tma.json", result)
        write_text(args.out / "conv_tma.md", render(result))
        found = ", ".join(f"{k} {b['ms']:.3f} ms {tuple(b['tiles'][:6])}" for k, b in entry["best"].items())
        print(f"conv_tma: [{time.time() - t0:.0f} s] {entry['name']}: cuDNN {entry['cudnn_ms']:.3f} ms; "
              f"{found or 'no correct config'}", flush=True)
        del x, w, ref
        torch.cuda.empty_cache()
    print(render(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
