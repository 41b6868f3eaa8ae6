"""Does Hopper's TMA lift a Triton 3x3 convolution to cuDNN's rate, and can it own its GroupNorm? (issue 47)

    python -m benchmarks.speed.conv_tma --out DIR                  # CUDA: every stride-1 3x3 site of ddpm-cifar10
    python -m benchmarks.speed.conv_tma --out DIR --sites 4 --kinds gluon data.batch_size=512

NOTES 28: a convolution that owns its GroupNorm wins only if its GEMM runs at >= ~60% of cuDNN's rate with the
prologue and epilogue inside; item 28's Triton implicit GEMM (pointer loads of shifted rows) reached 57% with nothing
inside, Inductor's templates 0.66-0.90x (item 29). Both load the input with pointers. These kernels load it with the
tensor memory accelerator: a 4-D descriptor over the NHWC input, one box of [samples, rows, W, BK] a tap (the tap's
shift is the box's start, -1 included: TMA fills the padding with zeros), read as the GEMM's [pixels, BK] operand,
and the weights as [Cout, 9 * Cin] boxes. That is what CUTLASS's sm90 convolutions do in tiled mode.

Three kernels: "box", plain Triton, whose compiler pipelines the loads (item 34: 0.8x cuDNN where correct, its
faster schedules wrong: the reshaped box goes through registers); "gluon" (ffcv_ddpm.conv_gluon), the same boxes in
Gluon, Triton's lower-level language, with the ring of buffers, its barriers and the wgmma waits written out, both
operands read from shared memory; "cutlass" (benchmarks.speed.conv_cutlass, NOTES 46-47), CUTLASS 3's sm90
implicit-GEMM mainloop (TMA's im2col mode: a tile of any 128 output pixels, across samples) built with nvcc, under
CUTLASS's own non-persistent kernel or, through an adapter of ours, its persistent ping-pong and cooperative GEMM
kernels. Per site (stride 1, channels a multiple of 64: 17 of the 22 distinct sites, 98% of the step's 3x3 FLOPs),
the best correct tile shape of each kernel, the convolution alone, against F.conv2d with cuDNN's search, as
CUDA-graph replays (clocks.graph_ms), each config checked against fp32 torch over three calls; then the Gluon kernel
with the site's epilogue (its bias, residual and the next GroupNorm's statistics), and where the site has one input
with the prologue too (the input's GroupNorm apply + SiLU + dropout), each at its fastest correct tiles, its time
over the plain kernel's best against the passes it removes at the copy rate; and each CUTLASS config with the
residual and the next GroupNorm's sums in its epilogue against the plain config it extends, with the chain from the
convolution to the next GroupNorm's (mean, rstd) timed three ways (chain_row).
conv_tma.json and .md are rewritten after every site. On CPU tensors the box kernel runs under Triton's interpreter
(tests/test_conv_tma.py); the Gluon kernel is built there for sm_90 (tests/test_conv_gluon.py).
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from typing import NamedTuple

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import Tensor

from benchmarks.common import commit_text, md_table, write_json, write_text
from ffcv_ddpm import conv_cutlass
from ffcv_ddpm import conv_gluon as CG
from ffcv_ddpm.checks import fail


class Tiles(NamedTuple):
    """The plain Triton kernel's tiles: output pixels a program (BH rows x BW columns of one sample), output
    channels, input channels a step, warps, pipelined loads."""
    bh: int
    bw: int
    bn: int = 128
    bk: int = 64
    warps: int = 8
    stages: int = 4

    def fits(self, h: int, w: int, cin: int, cout: int) -> bool:
        return h % self.bh == 0 and w % self.bw == 0 and cin % self.bk == 0 and cout % self.bn == 0


def configs_for(h: int, w: int) -> dict[str, list]:
    """A few tile shapes a site, each kernel. Box: 128 output pixels a program (a wgmma M of 128, two warpgroups),
    64 at 8x8; 128 or 256 output channels. Gluon: 128 pixels a program at every size (whole images below 16x16), 128
    or 256 channels, or 256 pixels; 3-4 ring slots, or the output's buffer in the ring (two programs an SM)."""
    bw = min(w, 32)
    m = 128 if h * w >= 128 else 64
    return {"box": [Tiles(m // bw, bw, 128, 64, 8, 4), Tiles(m // bw, bw, 128, 64, 4, 4),
                    Tiles(m // bw, bw, 256, 64, 8, 3), Tiles(2 * m // bw, bw, 128, 64, 8, 3)],
            "gluon": [CG.GluonTiles(128 // w, 128, 64, 4, 4), CG.GluonTiles(128 // w, 128, 64, 8, 4),
                      CG.GluonTiles(128 // w, 256, 64, 8, 3), CG.GluonTiles(256 // w, 128, 64, 8, 3),
                      # the output's buffer in the ring's memory (~96 KB): two programs an SM, one's epilogue
                      # beside the other's main loop (7ca5240's two-slot tiles with their own buffer never won)
                      CG.GluonTiles(128 // w, 128, 64, 4, 3, True), CG.GluonTiles(128 // w, 128, 64, 8, 3, True),
                      CG.GluonTiles(128 // w, 128, 64, 8, 2, True)]}


def run(kind: str, x: Tensor, w: Tensor, tiles) -> Tensor:
    if kind == "cutlass":
        return conv_cutlass.conv3x3(x, w, tiles)
    return conv3x3(x, w, tiles) if kind == "box" else CG.conv3x3(x, w, tiles)[0]


def passes_removed(site, batch: int, prologue: bool = False) -> int:
    """Bytes that today's chain moves around cuDNN's convolution and the Gluon kernel does not. Its epilogue: the
    inductor add of the residual reads the output and writes the sum (2 passes), the next GroupNorm's statistics
    read it again (1); biases cost no pass today (the conv bias and the time embedding are added inside the fused
    GroupNorm: conv_bias_in_norm, norm2's add). Its prologue: the input's GroupNorm apply reads x and writes the
    activation (2 passes of the input) that the convolution then reads, where the kernel reads x itself; less the
    dropout bits it reads where the site has dropout (today's apply hashes the mask; who writes the bits in a fused
    step is not counted)."""
    out = 2 * batch * site.out_h ** 2 * site.cout
    pixels = batch * site.h ** 2
    pro = 2 * 2 * pixels * site.cin - (4 * pixels * -(-site.cin // 32) if site.p else 0)
    return out * (2 * site.residual + site.stats) + (pro if prologue else 0)


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


def conv3x3(x: Tensor, w: Tensor, tiles: Tiles) -> Tensor:
    """F.conv2d(x, w, padding=1) for channels_last x (N, C, H, W) and w (Cout, C, 3, 3), stride 1, no bias."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    (n, c, h, wd), cout = x.shape, w.shape[0]
    xh, wk, out = CG.nhwc_operands("conv_tma", x, w, tiles)
    x_desc = TensorDescriptor.from_tensor(xh, [1, tiles.bh, tiles.bw, tiles.bk])
    w_desc = TensorDescriptor.from_tensor(wk, [tiles.bn, tiles.bk])
    o_desc = TensorDescriptor.from_tensor(out.permute(0, 2, 3, 1), [1, tiles.bh, tiles.bw, tiles.bn])
    th, tw, nb = h // tiles.bh, wd // tiles.bw, cout // tiles.bn
    _conv3x3_tma_kernel[(n * th * tw * nb,)](x_desc, w_desc, o_desc, th, tw, nb, C=c, BH=tiles.bh, BW=tiles.bw,
                                             BN=tiles.bn, BK=tiles.bk, STAGES=tiles.stages,
                                             FP32_DOT=triton.knobs.runtime.interpret, num_warps=tiles.warps)
    return out


def fused_row(spec, batch: int, x: Tensor, w: Tensor, configs: list, randn, iters: int, copy_gbs: float,
              plain_ms: float, prologue: bool = False) -> dict:
    """The Gluon kernel with the site's epilogue (its bias, residual and statistics), and with prologue the input's
    GroupNorm apply + SiLU, at each of `configs`: each checked against conv_gluon.reference; the fastest correct
    one's time over the plain kernel's best (plain_ms), against the passes it removes. The epilogue runs after the
    main loop: tiles that fit two programs an SM may hide it behind the other program's loop, so the fastest need
    not be at the plain kernel's best tiles."""
    from benchmarks.speed.clocks import graph_ms

    bias = {"channel": randn(spec.cout, dt=torch.float32), "sample": randn(batch, spec.cout, dt=torch.float32),
            "": None}[spec.bias]
    res = randn(batch, spec.cout, spec.h, spec.h).to(memory_format=torch.channels_last) if spec.residual else None
    pro = (1 + 0.5 * randn(batch, spec.cin, dt=torch.float32), 0.5 * randn(batch, spec.cin, dt=torch.float32)) \
        if prologue else None
    drop = None
    if prologue and spec.p:  # the same mask as the fused GroupNorm's, as bits
        from ffcv_ddpm.conv_gn import keep_bits

        seed = torch.tensor([1234], device=x.device, dtype=torch.int64)
        drop = (keep_bits(seed, tuple(x.shape), spec.p), spec.p)
    entry = {"bias": spec.bias, "res": spec.residual, "stats": spec.stats, "prologue": prologue, "configs": []}
    for tiles in configs:
        row = {"tiles": list(tiles)}
        try:
            out, part = CG.conv3x3(x, w, tiles, bias, res, spec.stats, pro, drop)
            want, want_part = CG.reference(x, w, tiles.rows, bias, res, pro, drop)
            row["rel_err"] = rel_error(out, want.float())
            if spec.stats:
                row["stats_err"] = max(rel_error(part[:, :, i], want_part[:, :, i]) for i in (0, 1))
            row["ms"] = graph_ms(lambda: CG.conv3x3(x, w, tiles, bias, res, spec.stats, pro, drop), iters, warmup=2)
        except Exception as e:  # noqa: BLE001 - an epilogue that cannot build is a row with its error
            row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        entry["configs"].append(row)
    good = [r for r in entry["configs"] if "ms" in r and r["rel_err"] <= 2e-2 and r.get("stats_err", 0) <= 2e-2]
    if not good:
        return {**entry, "error": "no correct config: " + "; ".join(
            r.get("error", f"wrong ({r.get('rel_err')}, {r.get('stats_err')})") for r in entry["configs"])[:300]}
    best = min(good, key=lambda r: r["ms"])
    return {**entry, **best, "extra_ms": best["ms"] - plain_ms,
            "passes_ms": passes_removed(spec, batch, prologue) / copy_gbs / 1e6}


def cutlass_epilogue_row(spec, batch: int, x: Tensor, w: Tensor, config, randn, iters: int, copy_gbs: float,
                        plain: dict) -> dict:
    """A CUTLASS config with the epilogue the next GroupNorm needs (the residual where the site has one,
    per-128-pixel channel sums and sums of squares of the output), checked against torch, its time over the plain
    config it extends at this site (`plain`, that config's row), against the passes it removes. No bias: today's
    fused GroupNorm adds it, and the sums of x + b follow from x's exactly."""
    from benchmarks.speed.clocks import graph_ms

    res = randn(batch, spec.cout, spec.h, spec.h).to(memory_format=torch.channels_last) if spec.residual else None
    row = {"tiles": list(config), "res": spec.residual, "stats": True}
    try:
        out, sums = conv_cutlass.conv3x3_sums(x, w, config, res)
        want_out = F.conv2d(x.float(), w.float(), padding=1) + (res.float() if res is not None else 0)
        row["rel_err"] = rel_error(out, want_out)
        row["stats_err"] = max(rel_error(sums[i], conv_cutlass.tile_sums(out)[i]) for i in (0, 1))
        row["ms"] = graph_ms(lambda: conv_cutlass.conv3x3_sums(x, w, config, res), iters, warmup=2)
    except Exception as e:  # noqa: BLE001 - an epilogue that cannot build is a row with its error
        return {**row, "error": f"{type(e).__name__}: {str(e)[:300]}"}
    if row["rel_err"] > 2e-2 or row["stats_err"] > 2e-2:
        return {**row, "error": f"wrong ({row['rel_err']}, {row['stats_err']})"}
    row.update(plain_ms=plain["ms"], extra_ms=row["ms"] - plain["ms"],
               passes_ms=passes_removed(spec, batch) / copy_gbs / 1e6)
    if spec.out_h ** 2 % conv_cutlass.TILE_M == 0:  # tiles within a sample: the next GroupNorm's statistics
        try:
            row["chain"] = chain_row(spec, batch, config, iters)
        except Exception as e:  # noqa: BLE001 - the plain figures stand without it
            row["chain"] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
    return row


def chain_row(spec, batch: int, config, iters: int) -> dict:
    """The site's chain from the convolution to the next GroupNorm's (mean, rstd), three ways, each one CUDA graph:
    - preset: as today's step runs it: cuDNN's convolution, then the fused GroupNorm's statistics kernel, which at a
      residual site reads the convolution's output, the residual and the bias and writes their sum as it goes
      (model.norm_residual), and its finalize (conv_gn_bench's pieces);
    - added: the same with the bias and residual first added by one compiled kernel, the chain before norm_residual
      (what the rows of 2c50675-f4a48ff called today's);
    - fused: the CUTLASS kernel with the residual and the sums, and (mean, rstd) from the sums
      (conv_cutlass.group_stats; the conv bias is the GroupNorm's add there, as a per-sample one is everywhere).
    (mean, rstd) of each compared with the preset's."""
    from benchmarks.speed.clocks import graph_ms
    from benchmarks.speed.conv_gn_bench import Bench, gn_coef

    b = Bench(spec, batch, "cuda", torch.bfloat16)
    x, groups, hw = b.whole, spec.groups, spec.out_h ** 2
    chan = b.bias if spec.bias == "channel" else None
    sample = b.bias if spec.bias == "sample" else None

    def preset():
        y = F.conv2d(x, b.w, None, 1, 1)
        if b.res is None and chan is not None:  # a conv bias with no residual to carry it: added as today's step
            y = b.pointwise(y, chan, None)      # (only the input convolution, which these rows leave out)
        return gn_coef(y, groups, b.a2, b.b2, sample, res=b.res, rbias=chan if b.res is not None else None)[1:]

    def added():
        y = F.conv2d(x, b.w, None, 1, 1)
        if b.pointwise is not None:
            y = b.pointwise(y, chan, b.res)
        return gn_coef(y, groups, b.a2, b.b2, sample)[1:]

    def fused():
        _, sums = conv_cutlass.conv3x3_sums(x, b.w, config, b.res)
        return conv_cutlass.group_stats(sums, batch, hw, groups, b.bias if spec.bias else None)

    (m0, r0), (m1, r1), (m2, r2) = preset(), added(), fused()
    out = {"mean_err": max(rel_error(m1, m0), rel_error(m2, m0)), "rstd_err": max(rel_error(r1, r0), rel_error(r2, r0)),
           "today_ms": graph_ms(preset, iters, warmup=2), "added_ms": graph_ms(added, iters, warmup=2),
           "fused_ms": graph_ms(fused, iters, warmup=2)}
    return {**out, "saved_ms": out["today_ms"] - out["fused_ms"]}


def rel_error(out: Tensor, ref: Tensor) -> float:
    return float((out.float() - ref).abs().max() / ref.abs().max().clamp_min(1e-12))


KINDS = ("box", "gluon", "cutlass")


def render(result: dict) -> str:
    kinds = result.get("kinds", ["box"])
    lines = [f"# TMA-fed 3x3 convolutions (Triton, Gluon, CUTLASS) against cuDNN ({result.get('device_name')})", "",
             f"`{result['command']}`", "",
             f"commit {commit_text(result['environment'])}, torch {result['environment'].get('torch')}, Triton "
             f"{result.get('triton')}; batch {result['batch']}, bf16, channels_last, stride 1, fp32 accumulation; ms a "
             "call (TFLOP/s), CUDA-graph replays; each kernel's fastest tile shape a site among those whose worst "
             "error over three calls is <= 2e-2 (the json has every config, wrong ones included).", ""]
    rows, tot = [], {k: [0.0, 0.0] for k in kinds}  # kind: [cuDNN ms, kernel ms] over the sites it ran
    # a step: ms over the plain kernel (Gluon's, or CUTLASS's ping-pong with the same tile), passes removed
    sums = {"epilogue": [0.0, 0.0], "fused": [0.0, 0.0], "cutlass_epilogue": [0.0, 0.0]}
    chains = [0.0, 0.0, 0.0]  # a step: today's chain ms, the fused chain's, the worst (mean, rstd) error

    def fused_cell(s: dict, key: str) -> str:
        row = s.get(key)
        if row is None:
            return "-"
        if "error" in row:
            return "error: " + row["error"][:100].replace("|", "/")
        sums[key][0] += s["count"] * row["extra_ms"]
        sums[key][1] += s["count"] * row["passes_ms"]
        tiles = f" {row['tiles'][1]!r}" if key == "cutlass_epilogue" else f" {tuple(row['tiles'])}"
        chain = row.get("chain") or {}
        if "saved_ms" in chain:
            chains[0] += s["count"] * chain["today_ms"]
            chains[1] += s["count"] * chain["fused_ms"]
            chains[2] = max(chains[2], chain["mean_err"], chain["rstd_err"])
        chain_text = (f"; chain {chain['today_ms']:.3f} -> {chain['fused_ms']:.3f}" if "saved_ms" in chain else
                      f"; chain error: {chain['error'][:60]}" if "error" in chain else "")
        return f"{row['ms']:.3f}{tiles}: {row['extra_ms']:+.3f} for {row['passes_ms']:.3f}{chain_text}"

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
                         f"{tuple(best['tiles'])}")
        rows.append(cells + [fused_cell(s, "epilogue"), fused_cell(s, "fused"), fused_cell(s, "cutlass_epilogue")])
    lines += md_table(["site", "a step", "cuDNN ms (TFLOP/s)",
                       *(f"{k} ms (TFLOP/s), rate vs cuDNN, tiles" for k in kinds),
                       "gluon + epilogue ms, tiles: extra for passes ms", "+ prologue too",
                       "CUTLASS + residual + sums ms, best config: extra over its plain config for passes ms"], rows)
    lines.append("")
    for k, (c, t) in tot.items():
        if t:
            lines.append(f"- {k}: over the sites it ran, a step: cuDNN {c:.2f} ms, {k} {t:.2f} ms ({c / t:.2f}x "
                         "cuDNN's rate).")
    what = {"epilogue": "the epilogue (bias, residual, statistics) in the Gluon kernel, every site with one",
            "fused": "the prologue (the input's GroupNorm apply + SiLU, dropout from bits) and the epilogue, every "
                     "site with one input",
            "cutlass_epilogue": "CUTLASS's persistent kernel with the residual and the per-128-pixel channel sums and "
                                "sums of squares (no bias; the best config a site), every site whose output a "
                                "GroupNorm's statistics read"}
    site_rates = [s["copy_gbs"] for s in result["sites"] if "copy_gbs" in s]  # files before a55667d: one, 128 MB
    rates = (f"the copy rate of each site's output size ({min(site_rates):.0f}-{max(site_rates):.0f} GB/s)"
             if site_rates else f"the copy rate ({result.get('copy_gbs', 0):.0f} GB/s)")
    for key, (extra, passes) in sums.items():
        if passes:
            lines.append(f"- {what[key]}: {extra:+.2f} ms a step over the plain kernel, for {passes:.2f} ms of "
                         f"passes removed at {rates}.")
    if chains[0]:
        lines.append(f"- the chain from the convolution to the next GroupNorm's (mean, rstd), at the sites whose "
                     f"tiles lie in one sample (32x32, 16x16), a step: today's (cuDNN, then the fused GroupNorm's "
                     f"statistics kernel, which reads the residual and writes the sum where there is one, and its "
                     f"finalize) {chains[0]:.2f} ms, CUTLASS's with the residual and sums and the statistics from "
                     f"them {chains[1]:.2f} ms ({chains[1] - chains[0]:+.2f}); (mean, rstd) within {chains[2]:.1e} "
                     f"of today's.")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    from benchmarks.speed.conv_gn_bench import site_parser

    p = site_parser("conv_tma", __doc__)
    p.add_argument("--kinds", default=",".join(KINDS), help=f"comma-separated, of {', '.join(KINDS)}")
    p.add_argument("--prologue", action=argparse.BooleanOptionalAction, default=True,
                   help="time the prologue rows too (default); --no-prologue: the epilogue's only")
    p.add_argument("--cutlass-match", default="", metavar="REGEX",
                   help="only the CUTLASS configs whose name matches (re.search; default: every config)")
    p.add_argument("--epilogue", action=argparse.BooleanOptionalAction, default=True,
                   help="time the fused rows (default): Gluon's epilogue and prologue, CUTLASS's residual and sums "
                        "and the chain to the next GroupNorm; --no-epilogue: the plain convolutions only")
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
    from benchmarks.speed.copy_rate import copy_gb_per_s
    from benchmarks.speed.clocks import graph_ms
    from ffcv_ddpm.env import environment

    torch.backends.cudnn.benchmark = True  # F.conv2d as the step runs it
    batch = cfg.data.batch_size
    sites = [(s, c) for s, c in sites_by_cost(cfg.model, batch) if s.stride == 1][:args.sites]
    result = {"command": "python -m benchmarks.speed.conv_tma " + " ".join(sys.argv[1:] if argv is None else argv),
              "environment": environment(), "device_name": torch.cuda.get_device_name(), "batch": batch,
              "triton": triton.__version__, "kinds": kinds, "sites": []}
    cutlass_configs = ([c for c in conv_cutlass.configs() if re.search(args.cutlass_match, c.name)]
                       if "cutlass" in kinds else [])
    if cutlass_configs:
        result["cutlass"] = {"version": conv_cutlass.CUTLASS_VERSION, "library": conv_cutlass.library_path().name}
    args.out.mkdir(parents=True, exist_ok=True)
    g = torch.Generator(device="cuda").manual_seed(0)
    t0 = time.time()
    for spec, count in sites:
        cl = torch.channels_last

        def randn(*shape, scale=1.0, dt=torch.bfloat16):
            return (torch.randn(*shape, device="cuda", generator=g) * scale).to(dt)

        x = randn(batch, spec.cin, spec.h, spec.h).to(memory_format=cl)
        w = randn(spec.cout, spec.cin, 3, 3, scale=(9 * spec.cin) ** -0.5).to(memory_format=cl)
        entry = {"name": spec.name(), "count": count, "flop": 2 * batch * spec.h * spec.h * spec.cout * spec.cin * 9,
                 "cudnn_ms": graph_ms(lambda: F.conv2d(x, w, padding=1), args.iters, warmup=2), "rows": []}
        result["sites"].append(entry)
        ref = F.conv2d(x.float(), w.float(), padding=1)
        site_configs = configs_for(spec.h, spec.h)
        if "cutlass" in kinds:
            site_configs["cutlass"] = [c for c in cutlass_configs if not c.epilogue and c.op == conv_cutlass.OP_FPROP]
        for kind, configs in site_configs.items():
            for tiles in configs:
                if kind not in kinds or not tiles.fits(spec.h, spec.h, spec.cin, spec.cout):
                    continue
                row = {"kind": kind, "tiles": list(tiles)}
                try:
                    # the worst of three calls: a kernel that races gives a different answer from call to call
                    row["rel_err"] = max(rel_error(run(kind, x, w, tiles), ref) for _ in range(3))
                    row["ms"] = graph_ms(lambda: run(kind, x, w, tiles), args.iters, warmup=2)
                except Exception as e:  # noqa: BLE001 - a shape a kernel cannot build is a row with its error
                    row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
                entry["rows"].append(row)
        def correct(row: dict) -> bool:
            return "ms" in row and row["rel_err"] <= 2e-2

        def copy_gbs() -> float:  # the passes priced at the rate a copy of the site's output streams (size-dependent)
            if "copy_gbs" not in entry:  # once a site, for whichever fused rows ask first
                entry["copy_gbs"] = copy_gb_per_s(2 * batch * spec.out_h ** 2 * spec.cout, iters=args.iters)
            return entry["copy_gbs"]

        entry["best"] = {}
        for k in kinds:
            good = [r for r in entry["rows"] if r["kind"] == k and correct(r)]
            if good:
                entry["best"][k] = min(good, key=lambda r: r["ms"])
        want = conv_cutlass.EPI_STATS | (conv_cutlass.EPI_RESIDUAL if spec.residual else 0)
        # (not the input convolution: 8 padded channels, where CUTLASS's 64-channel K tiles run at half cuDNN's rate)
        if args.epilogue and spec.stats and spec.cin % 64 == 0 and \
                (fused := [c for c in cutlass_configs if c.epilogue == want]):
            entry["cutlass_epilogues"] = []
            for config in fused:  # each against the plain config it extends ("<plain> + residual + sums")
                plain = [r for r in entry["rows"] if r["kind"] == "cutlass" and correct(r)
                         and r["tiles"][1] == config.name.split(" +")[0]]
                entry["cutlass_epilogues"].append(
                    cutlass_epilogue_row(spec, batch, x, w, config, randn, args.iters, copy_gbs(), plain[0])
                    if plain else {"tiles": list(config), "error": "its plain config did not run correctly here"})
            good = [r for r in entry["cutlass_epilogues"] if "extra_ms" in r]
            entry["cutlass_epilogue"] = min(good, key=lambda r: r["extra_ms"]) if good else \
                entry["cutlass_epilogues"][0]
        if args.epilogue and (best := entry["best"].get("gluon")) and (spec.residual or spec.stats):
            fitting = [t for t in configs_for(spec.h, spec.h)["gluon"] if t.fits(spec.h, spec.h, spec.cin, spec.cout)]
            entry["epilogue"] = fused_row(spec, batch, x, w, fitting, randn, args.iters, copy_gbs(), best["ms"])
            if args.prologue and spec.norm and spec.silu and spec.c1 == spec.cin:  # one input (two-part: not yet)
                entry["fused"] = fused_row(spec, batch, x, w, fitting, randn, args.iters, copy_gbs(), best["ms"],
                                           prologue=True)
        write_json(args.out / "conv_tma.json", result)
        write_text(args.out / "conv_tma.md", render(result))
        found = ", ".join(f"{k} {b['ms']:.3f} ms {tuple(b['tiles'])}" for k, b in entry["best"].items())
        fused = "".join(f"; {key} {entry[key].get('ms', 0):.3f} ms, err {entry[key].get('rel_err')}"
                        for key in ("epilogue", "fused") if key in entry)
        print(f"conv_tma: [{time.time() - t0:.0f} s] {entry['name']}: cuDNN {entry['cudnn_ms']:.3f} ms; "
              f"{found or 'no correct config'}{fused}", flush=True)
        del x, w, ref
        torch.cuda.empty_cache()
    print(render(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
