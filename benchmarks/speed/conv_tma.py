"""Does Hopper's TMA lift a plain Triton 3x3 convolution to cuDNN's rate? (issue 47, NOTES items 28-29)

    python -m benchmarks.speed.conv_tma --out DIR                  # CUDA: every stride-1 3x3 site of ddpm-cifar10
    python -m benchmarks.speed.conv_tma --out DIR --sites 4 data.batch_size=512

NOTES 28: a convolution that owns its GroupNorm wins only if its GEMM runs at >= ~60% of cuDNN's rate with the
prologue and epilogue inside; item 28's Triton implicit GEMM (pointer loads of shifted rows) reached 57% with nothing
inside, Inductor's templates 0.66-0.90x (item 29). Both load the input with pointers. This kernel loads it with the
tensor memory accelerator instead: a 4-D descriptor over the NHWC input, one box of [1, BH, BW, BK] a tap (the tap's
shift is the box's start, -1 included: TMA fills the padding with zeros), read as the GEMM's [BH * BW, BK] operand,
and the weights as [Cout, 9 * Cin] boxes. That is what CUTLASS's sm90 convolutions do in tiled mode (without their
warp specialisation); if plain Triton gets near cuDNN this way, the convolution half of item 2 is open in Triton.

Nothing else in the kernel: no bias, no prologue, no statistics. Per site (stride 1, 8x8 or larger, channels a
multiple of 64: 16 of the 22 distinct sites, 94% of the step's 3x3 FLOPs), the best of a few tile shapes against F.conv2d
with cuDNN's search, both as CUDA-graph replays (norm_bench.graph_ms), checked against fp32 torch. conv_tma.json and
.md are rewritten after every site. On CPU tensors the kernel runs under Triton's interpreter (tests/test_conv_tma.py).
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

from benchmarks.common import commit_text, md_table, write_json, write_text
from ffcv_ddpm.checks import Parser, at_least, fail, option


class Tiles(NamedTuple):
    """Output pixels a program (BH rows x BW columns of one sample), output channels, input channels a step, warps,
    pipelined loads; rows: how a tap is read (False: a 4-D box of the image, its padding TMA's zeros; True: BH x BW
    consecutive pixels of the flattened (N*H*W, C) input, a 2-D box, the pixels whose tap falls outside the image
    zeroed in registers, so that BH may span samples: 8x8 and 4x4 images at 128 pixels a program)."""
    bh: int
    bw: int
    bn: int = 128
    bk: int = 64
    warps: int = 8
    stages: int = 4
    rows: bool = False

    def fits(self, h: int, w: int, cin: int, cout: int) -> bool:
        rows_ok = self.bw == w and (self.bh % h == 0 or h % self.bh == 0) if self.rows else h % self.bh == 0
        return rows_ok and w % self.bw == 0 and cin % self.bk == 0 and cout % self.bn == 0


def configs_for(h: int, w: int) -> list[Tiles]:
    """A few shapes a site. Boxes: 128 output pixels a program (a wgmma M of 128, two warpgroups), 64 at 8x8; 128 or
    256 output channels. Rows: 128 pixels a program at every size (whole image rows, across samples below 16x16)."""
    bw = min(w, 32)
    m = 128 if h * w >= 128 else 64
    boxes = [Tiles(m // bw, bw, 128, 64, 8, 4), Tiles(m // bw, bw, 128, 64, 4, 4), Tiles(m // bw, bw, 256, 64, 8, 3),
             Tiles(2 * m // bw, bw, 128, 64, 8, 3)]
    rows = [Tiles(128 // w, w, 128, 64, 4, 4, True), Tiles(128 // w, w, 128, 64, 8, 3, True),
            Tiles(128 // w, w, 256, 64, 8, 3, True)]
    return boxes + rows


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


@triton.jit
def _conv3x3_tma_rows_kernel(x_desc, w_desc, o_desc, N_BLOCKS, C: tl.constexpr, H: tl.constexpr, W: tl.constexpr,
                             BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, STAGES: tl.constexpr,
                             FP32_DOT: tl.constexpr):
    # A program: BM consecutive pixels of the flattened input (whole image rows), BN output channels.
    pid = tl.program_id(0)
    co = (pid % N_BLOCKS) * BN
    p0 = (pid // N_BLOCKS) * BM
    p = p0 + tl.arange(0, BM)
    hh = (p // W) % H
    ww = p % W
    kc: tl.constexpr = C // BK
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for i in tl.range(0, 9 * kc, num_stages=STAGES):
        tap = i // kc
        k = (i - tap * kc) * BK
        dh = tap // 3 - 1
        dw = tap % 3 - 1
        # the tap's pixels are the box shifted by dh rows and dw columns; where that leaves the image (a neighbouring
        # row or sample, or before the tensor: TMA's zeros) the input is padding
        a = x_desc.load([p0 + dh * W + dw, k])
        inside = (hh + dh >= 0) & (hh + dh < H) & (ww + dw >= 0) & (ww + dw < W)
        a = tl.where(inside[:, None], a, tl.zeros_like(a))
        b = w_desc.load([co, tap * C + k])
        if FP32_DOT:
            acc = tl.dot(a.to(tl.float32), b.to(tl.float32).T, acc)
        else:
            acc = tl.dot(a, b.T, acc)
    o_desc.store([p0, co], acc.to(o_desc.dtype))


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
    if tiles.rows:
        bm = tiles.bh * tiles.bw
        x_desc = TensorDescriptor.from_tensor(xh.reshape(n * h * wd, c), [bm, tiles.bk])
        w_desc = TensorDescriptor.from_tensor(wk, [tiles.bn, tiles.bk])
        o_desc = TensorDescriptor.from_tensor(out.permute(0, 2, 3, 1).reshape(n * h * wd, cout), [bm, tiles.bn])
        nb = cout // tiles.bn
        _conv3x3_tma_rows_kernel[(triton.cdiv(n * h * wd, bm) * nb,)](
            x_desc, w_desc, o_desc, nb, C=c, H=h, W=wd, BM=bm, BN=tiles.bn, BK=tiles.bk, STAGES=tiles.stages,
            FP32_DOT=triton.knobs.runtime.interpret, num_warps=tiles.warps)
        return out
    x_desc = TensorDescriptor.from_tensor(xh, [1, tiles.bh, tiles.bw, tiles.bk])
    w_desc = TensorDescriptor.from_tensor(wk, [tiles.bn, tiles.bk])
    o_desc = TensorDescriptor.from_tensor(out.permute(0, 2, 3, 1), [1, tiles.bh, tiles.bw, tiles.bn])
    th, tw, nb = h // tiles.bh, wd // tiles.bw, cout // tiles.bn
    _conv3x3_tma_kernel[(n * th * tw * nb,)](x_desc, w_desc, o_desc, th, tw, nb, C=c, BH=tiles.bh, BW=tiles.bw,
                                             BN=tiles.bn, BK=tiles.bk, STAGES=tiles.stages,
                                             FP32_DOT=triton.knobs.runtime.interpret, num_warps=tiles.warps)
    return out


def rel_error(out: Tensor, ref: Tensor) -> float:
    return float((out.float() - ref).abs().max() / ref.abs().max().clamp_min(1e-12))


def render(result: dict) -> str:
    lines = [f"# A TMA-fed Triton 3x3 convolution against cuDNN ({result.get('device_name')})", "",
             f"`{result['command']}`", "",
             f"commit {commit_text(result['environment'])}, torch {result['environment'].get('torch')}, Triton "
             f"{result.get('triton')}; batch {result['batch']}, bf16, channels_last, stride 1, fp32 accumulation; ms a "
             "call, CUDA-graph replays; the kernel's best tile shape a site.", ""]
    rows, tot = [], {"cudnn": 0.0, "tma": 0.0}
    for s in result["sites"]:
        best = s.get("best")
        if best is None:
            rows.append([s["name"], str(s["count"]), f"{s['cudnn_ms']:.3f}", "-", "-", "-", s.get("note", "")])
            continue
        tot["cudnn"] += s["count"] * s["cudnn_ms"]
        tot["tma"] += s["count"] * best["ms"]
        rows.append([s["name"], str(s["count"]), f"{s['cudnn_ms']:.3f} ({s['flop'] / s['cudnn_ms'] / 1e9:.0f})",
                     f"{best['ms']:.3f} ({s['flop'] / best['ms'] / 1e9:.0f})", f"{s['cudnn_ms'] / best['ms']:.2f}",
                     str(tuple(best["tiles"])), f"err {best['rel_err']:.1e}"])
    lines += md_table(["site", "a step", "cuDNN ms (TFLOP/s)", "TMA kernel ms (TFLOP/s)", "rate vs cuDNN",
                       "tiles (BH, BW, BN, BK, warps, stages, rows)", "check"], rows)
    if tot["tma"]:
        lines += ["", f"Over the sites measured, a step: cuDNN {tot['cudnn']:.2f} ms, the TMA kernel {tot['tma']:.2f} ms "
                      f"({tot['cudnn'] / tot['tma']:.2f}x cuDNN's rate)."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = Parser(prog="python -m benchmarks.speed.conv_tma", doc=__doc__, overrides=True,
               epilog="Overrides: data.batch_size (default 1024) and model.* configure the network the sites are "
                      "recorded from.")
    p.add_argument("--out", type=Path, required=True, help="folder for conv_tma.json and .md")
    p.add_argument("--preset", default="ddpm-cifar10")
    p.add_argument("--sites", type=option(int, at_least(1)), help="only the first N sites (by FLOPs a step)")
    p.add_argument("--iters", type=option(int, at_least(1)), default=10, help="calls per captured graph")
    args, overrides = p.parse_with_overrides(argv)
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
              "triton": triton.__version__, "sites": []}
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
            if not tiles.fits(spec.h, spec.h, spec.cin, spec.cout):
                continue
            try:
                # the worst of three calls: a kernel that races gives a different answer from call to call
                row["rel_err"] = max(rel_error(conv3x3(x, w, tiles), ref) for _ in range(3))
                row["ms"] = graph_ms(lambda: conv3x3(x, w, tiles), args.iters, warmup=2)
            except Exception as e:  # noqa: BLE001 - a shape Triton cannot build is a row with its error
                row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
            entry["rows"].append(row)
        good = [r for r in entry["rows"] if "ms" in r and r["rel_err"] <= 2e-2]
        if good:
            entry["best"] = min(good, key=lambda r: r["ms"])
        else:
            entry["note"] = "; ".join(r.get("error", f"wrong ({r.get('rel_err')})") for r in entry["rows"])[:200] or \
                "no tile shape fits"
        write_json(args.out / "conv_tma.json", result)
        write_text(args.out / "conv_tma.md", render(result))
        best = entry.get("best")
        print(f"conv_tma: [{time.time() - t0:.0f} s] {entry['name']}: cuDNN {entry['cudnn_ms']:.3f} ms, TMA "
              + (f"{best['ms']:.3f} ms {tuple(best['tiles'])}" if best else entry["note"]), flush=True)
        del x, w, ref
        torch.cuda.empty_cache()
    print(render(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
