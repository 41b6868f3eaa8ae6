"""CUTLASS 3's sm90 implicit-GEMM 3x3 convolution, built with nvcc and called from torch (issue 47 item 2, NOTES 46-47).

    python -m ffcv_ddpm.conv_cutlass            # build .cutlass/build/libconv_fprop-<hash>.so (pip: headers)
    python -m benchmarks.speed.conv_tma --out DIR --kinds cutlass,gluon    # CUDA: each config against cuDNN per site

The kernels are cutlass/conv_fprop.cu: the forward convolution (bf16 NHWC in and out, fp32 accumulation), alone or
with the epilogue the next GroupNorm needs (the residual added, per-128-pixel sums and sums of squares of the output
per channel), one instantiation per kernel, tile and cluster shape, exported as C functions that take torch's
pointers and stream. The headers come from the `nvidia-cutlass` wheel (CUTLASS_VERSION; `pip download` needs the
network once): its `cutlass_library/source/include/{cute,cutlass}` and `tools/util/include/cutlass/util`, unpacked
into .cutlass/inc; the library lands in .cutlass/build. The GPU machine has nvcc but no network: build here (sm_90a,
2-3 min on two cores) and carry .cutlass/build to it (docs/gpu-runs.md).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import sys
import zipfile
from math import prod
from pathlib import Path
from typing import NamedTuple

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import Tensor
from torch.utils.flop_counter import register_flop_formula

ROOT = Path(__file__).resolve().parents[1]
SOURCE = Path(__file__).resolve().parent / "cutlass" / "conv_fprop.cu"
HOME = ROOT / ".cutlass"  # git-ignored: the wheel, the unpacked headers, the built library
CUTLASS_VERSION = "4.2.0.0"
WHEEL_GLOB = f"nvidia_cutlass-{CUTLASS_VERSION}-*.whl"
# The wheel's folders that hold the headers, and where they land under <home>/inc.
WHEEL_PARTS = {"cutlass_library/source/include/cute/": "cute/",
               "cutlass_library/source/include/cutlass/": "cutlass/",
               "cutlass_library/source/tools/util/include/cutlass/util/": "cutlass/util/"}
ERR_LEN = 512
EPI_RESIDUAL, EPI_STATS, EPI_ACT_SUMS = 1, 2, 4  # conv_fprop.cu's epilogue flags
OP_FPROP, OP_DGRAD = 0, 1  # what a config computes: the forward convolution, or its data gradient
TILE_M = 128  # the M tile of the configs with sums: a partial sum per 128 output pixels


class CutlassConfig(NamedTuple):
    """One compiled instantiation: its index in the library, tile MxNxK and cluster, pipeline stages, shared memory
    a block, blocks an SM, its epilogue's extras (EPI_* flags; 0: the plain convolution) and what it computes (OP_*).
    What conv_tma's rows record as the config's "tiles"."""
    index: int
    name: str
    stages: int
    smem: int
    blocks_per_sm: int
    epilogue: int = 0
    op: int = OP_FPROP

    def fits(self, h: int, w: int, cin: int, cout: int) -> bool:
        return cin % 8 == 0 and cout % 8 == 0  # 16-byte TMA rows; im2col tiles span samples, so any image size


def unpack_headers(wheel: Path, inc: Path) -> Path:
    """CUTLASS's headers out of its wheel into `inc` (written beside, then renamed: an interrupted unpack leaves no
    half a tree under the name the build reads)."""
    tmp = inc.with_name(inc.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    with zipfile.ZipFile(wheel) as z:
        found = set()
        for name in z.namelist():
            for prefix, dest in WHEEL_PARTS.items():
                if name.startswith(prefix) and not name.endswith("/"):
                    found.add(prefix)
                    target = tmp / dest / name[len(prefix):]
                    target.parent.mkdir(parents=True, exist_ok=True)
                    target.write_bytes(z.read(name))
    if missing := [p for p in WHEEL_PARTS if p not in found]:
        shutil.rmtree(tmp, ignore_errors=True)
        raise ValueError(f"{wheel}: no {', '.join(missing)} in it: expected nvidia-cutlass {CUTLASS_VERSION}'s wheel")
    shutil.rmtree(inc, ignore_errors=True)
    tmp.rename(inc)
    return inc


def headers(home: Path = HOME) -> Path:
    """<home>/inc with CUTLASS's headers: unpacked from the wheel in <home>, downloaded there first if absent."""
    inc = home / "inc"
    if (inc / "cute" / "tensor.hpp").is_file() and (inc / "cutlass" / "util" / "packed_stride.hpp").is_file():
        return inc
    wheels = sorted(home.glob(WHEEL_GLOB))
    if not wheels:
        home.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", str(home),
               f"nvidia-cutlass=={CUTLASS_VERSION}"]
        if subprocess.run(cmd).returncode != 0 or not (wheels := sorted(home.glob(WHEEL_GLOB))):
            raise RuntimeError(f"could not fetch CUTLASS's headers ({' '.join(cmd)}); on a machine without the network "
                               f"put {WHEEL_GLOB} in {home}, or a built library in {home / 'build'}")
    return unpack_headers(wheels[-1], inc)


def nvcc_command(inc: Path, out: Path) -> list[str]:
    # sm_90a: wgmma and the TMA im2col loads exist only in the arch-specific target
    return ["nvcc", "-std=c++17", "-O3", "-DNDEBUG", "--expt-relaxed-constexpr",
            "-gencode=arch=compute_90a,code=sm_90a", "-Xcompiler", "-fPIC", "-shared", "-I", str(inc),
            str(SOURCE), "-o", str(out)]


def library_path(home: Path = HOME) -> Path:
    """Named by its source's hash: a library built from another version of conv_fprop.cu is never loaded (file
    times do not survive the copy to the GPU machine)."""
    return home / "build" / f"libconv_fprop-{hashlib.sha256(SOURCE.read_bytes()).hexdigest()[:12]}.so"


def build(home: Path = HOME) -> Path:
    """The library, compiled if it is missing (to a temporary name, then renamed)."""
    out = library_path(home)
    if out.is_file():
        return out
    if shutil.which("nvcc") is None:
        raise RuntimeError(f"no nvcc on PATH to build {out.name} (or carry a built {out} here)")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + f".{os.getpid()}.tmp")
    try:
        subprocess.run(nvcc_command(headers(home), tmp), check=True)
        tmp.rename(out)
    finally:
        tmp.unlink(missing_ok=True)
    return out


_LIB: ctypes.CDLL | None = None


def library() -> ctypes.CDLL:
    """The built library, loaded once (built first where nvcc is here and it is missing)."""
    global _LIB
    if _LIB is None:
        lib = ctypes.CDLL(str(build()))
        lib.cutconv_name.restype = ctypes.c_char_p
        lib.cutconv_fprop.argtypes = [ctypes.c_int, *[ctypes.c_void_p] * 7, *[ctypes.c_int] * 5, ctypes.c_void_p,
                                      ctypes.c_char_p, ctypes.c_int]
        lib.cutconv_dgrad_sums.argtypes = [ctypes.c_int, *[ctypes.c_void_p] * 7, *[ctypes.c_int] * 6,
                                           ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_float,
                                           ctypes.c_void_p, ctypes.c_char_p, ctypes.c_int]
        _LIB = lib
    return _LIB


def configs() -> list[CutlassConfig]:
    """Every compiled config (blocks an SM asks the CUDA runtime: needs a GPU)."""
    lib = library()
    return [CutlassConfig(i, lib.cutconv_name(i).decode(), lib.cutconv_stages(i), lib.cutconv_smem(i),
                          lib.cutconv_occupancy(i), lib.cutconv_epilogue(i), lib.cutconv_op(i))
            for i in range(lib.cutconv_count())]


def conv3x3(x: Tensor, w: Tensor, config: CutlassConfig) -> Tensor:
    """F.conv2d(x, w, padding=1) for bf16 CUDA tensors in channels_last (weights KRSC: [Cout, Cin, 3, 3] in
    channels_last memory), no bias, on torch's current stream, by a config without an epilogue."""
    return _call(x, w, config, None, None, False)[0]


def conv3x3_dgrad(dy: Tensor, w: Tensor, config: CutlassConfig) -> Tensor:
    """The data gradient of F.conv2d(x, w, padding=1): dx [N, Cin, H, W] from dy [N, Cout, H, W] (bf16, CUDA,
    channels_last; w KRSC as conv3x3 takes it), by a dgrad config (OP_DGRAD)."""
    return _call(dy, w, config, None, None, False, OP_DGRAD)[0]


def conv3x3_dgrad_sums(dy: Tensor, w: Tensor, config: CutlassConfig, x: Tensor, coef: Tensor, silu: int,
                       seed: Tensor | None = None, thr: int = 0, inv_keep: float = 1.0,
                       pair: bool = False) -> tuple[Tensor, Tensor]:
    """(dx, sums): conv3x3_dgrad's dx, and the backward reduction's sums of the GroupNorm + SiLU that made the
    convolution's input (NOTES 48, 50), by a dgrad config with EPI_ACT_SUMS: x is that GroupNorm's input (bf16,
    dx's shape, channels_last), coef fp32 [N, 2, Cin] its per-(sample, channel) (u, v) (its affine output is
    x u + v), silu its GroupNormAct.silu_mode; sums fp32 [2, N*H*W / 128, Cin] of g = dx SiLU'(x u + v) and of g x
    over each 128 pixels (act_sums is the same in torch). H*W a multiple of 128: a tile within one sample. With the
    GroupNorm's dropout, thr > 0 and inv_keep as norm._dropout_args(p, pair) gives them and seed its forward's (int64
    [1] on the device): g = dx keep inv_keep SiLU'(...), the mask replayed as the kernels draw it (norm.keep_mask)."""
    n, k, h, wd = dy.shape
    c = w.shape[1]
    cl = torch.channels_last
    if config.op != OP_DGRAD or config.epilogue != EPI_STATS | EPI_ACT_SUMS:
        raise ValueError(f"conv3x3_dgrad_sums: CUTLASS config {config.name!r} is not a dgrad with the activation's sums")
    if tuple(x.shape) != (n, c, h, wd) or x.dtype != dy.dtype or not x.is_contiguous(memory_format=cl):
        raise ValueError(f"conv3x3_dgrad_sums: x must be {dy.dtype} [{n}, {c}, {h}, {wd}] channels_last (dx's shape), "
                         f"got {x.dtype} {tuple(x.shape)} {x.stride()}")
    if coef.shape != (n, 2, c) or coef.dtype != torch.float32 or not coef.is_contiguous() or coef.device != dy.device:
        raise ValueError(f"conv3x3_dgrad_sums: coef must be contiguous fp32 [{n}, 2, {c}] on {dy.device}, got "
                         f"{coef.dtype} {tuple(coef.shape)} on {coef.device}")
    if h * wd % TILE_M or c % 128 or silu not in (0, 1, 2):
        raise ValueError(f"conv3x3_dgrad_sums: needs H*W a multiple of {TILE_M} (got {h * wd}), Cin of 128 (got {c}) "
                         f"and silu 0, 1 or 2 (got {silu})")
    if thr < 0 or (thr > 0) != (seed is not None) or (seed is not None and (
            seed.dtype != torch.int64 or seed.numel() != 1 or seed.device != dy.device)):
        raise ValueError(f"conv3x3_dgrad_sums: dropout takes a threshold > 0 and the forward's seed, an int64 [1] on "
                         f"{dy.device}; got thr {thr} and seed "
                         f"{None if seed is None else (seed.dtype, tuple(seed.shape), str(seed.device))}")
    _check_operands("conv3x3_dgrad_sums", dy, w, True)
    dx = torch.empty(n, c, h, wd, device=dy.device, dtype=dy.dtype, memory_format=cl)
    sums = torch.empty(2, n * h * wd // TILE_M, c, device=dy.device, dtype=torch.float32)
    _launch(library().cutconv_dgrad_sums, config, dy.data_ptr(), w.data_ptr(), dx.data_ptr(), x.data_ptr(),
            coef.data_ptr(), sums[0].data_ptr(), sums[1].data_ptr(), n, h, wd, c, k, silu,
            seed.data_ptr() if seed is not None else None, thr, int(pair), inv_keep)
    return dx, sums


def act_sums(dx: Tensor, x: Tensor, coef: Tensor, silu: int, keep: Tensor | None = None, inv_keep: float = 1.0,
             rows: int = TILE_M) -> Tensor:
    """conv3x3_dgrad_sums' sums in torch (fp32), from its dx: per `rows` pixels and channel, of g = dx SiLU'(y) and
    g x, y = x u + v (SiLU' exact: silu 1 and 2 are the same function), dx taken back through dropout first where
    `keep` (a bool mask of dx's shape, norm.keep_mask's) is given; in fp32, fp64 for fp64 inputs."""
    c = x.shape[1]
    dt = torch.promote_types(x.dtype, torch.float32)
    x, dx, coef = x.to(dt), dx.to(dt), coef.to(dt)
    if keep is not None:
        dx = torch.where(keep.to(dx.device), dx * inv_keep, 0)
    y = x * coef[:, 0, :, None, None] + coef[:, 1, :, None, None]
    if silu:
        s = torch.sigmoid(y)
        g = dx * s * (1 + y * (1 - s))
    else:
        g = dx
    flat = lambda t: t.permute(0, 2, 3, 1).reshape(-1, rows, c)  # noqa: E731 - [tiles, rows, C] in NHWC order
    return torch.stack([flat(g).sum(1), flat(g * x).sum(1)])


def conv3x3_sums(x: Tensor, w: Tensor, config: CutlassConfig, res: Tensor | None = None,
                 bias: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """(out, sums): out = bf16(F.conv2d(x, w, padding=1) + bias + res) (one rounding), sums fp32
    [2, N*H*W / 128, Cout]: the sum and the sum of squares of out's bf16 values over each 128 consecutive output
    pixels (NHWC order), per channel, by a config whose epilogue has them (EPI_STATS; EPI_RESIDUAL exactly when res
    is given). bias: fp32 [Cout], with a residual only (the residual configs' epilogue adds it)."""
    return _call(x, w, config, res, bias, True)


# The configs model.conv_cutlass runs (ping-pong 128x128x64: 1.01-1.035x cuDNN over the step's sites, NOTES 47).
SUMS_CONFIG, RESIDUAL_SUMS_CONFIG = "pingpong 128x128x64 + sums", "pingpong 128x128x64 + residual + sums"


def applies(x: Tensor, cout: int) -> bool:
    """Whether conv_sums takes a 3x3 convolution of x to cout channels: each 128-pixel tile in one sample (its sums
    are per-sample partials), whole 128-channel tiles, 16-byte rows; on CUDA in bf16 (the kernel's type), on the CPU
    in any float type (the torch stand-in the tests run through Triton's interpreter)."""
    return (x[0, 0].numel() % TILE_M == 0 and cout % 128 == 0 and x.shape[1] % 8 == 0
            and (x.dtype == torch.bfloat16 or not x.is_cuda))


@functools.cache
def config_named(name: str) -> CutlassConfig:
    for config in configs():
        if config.name == name:
            return config
    raise RuntimeError(f"{library_path().name} has no config {name!r}")


def conv_sums(x: Tensor, w: Tensor, res: Tensor | None = None, bias: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """(s, sums): s = conv3x3(x, w) (+ bias + res) in x's dtype and layout, and its tiles' sums (conv3x3_sums'
    [2, N*H*W / 128, Cout]), for x where applies(x, Cout). CUDA: the CUTLASS kernel (bias fp32, with a residual
    only); CPU: the same in torch (fp32 sum, one rounding), the stand-in under which the tests run the fused
    GroupNorm's Triton kernels without a GPU."""
    if not applies(x, w.shape[0]):
        raise ValueError(f"conv_sums: a 3x3 convolution of {tuple(x.shape)} {x.dtype} to {w.shape[0]} channels is not "
                         f"one the kernel takes (H*W a multiple of {TILE_M}, Cout of 128, Cin of 8, bf16 on CUDA)")
    if x.is_cuda:
        name = SUMS_CONFIG if res is None else RESIDUAL_SUMS_CONFIG
        cl = torch.channels_last
        return conv3x3_sums(x.contiguous(memory_format=cl), w.contiguous(memory_format=cl), config_named(name),
                            None if res is None else res.contiguous(memory_format=cl),
                            None if bias is None else bias.float().contiguous())
    s = F.conv2d(x.float(), w.float(), None, 1, 1)
    s = s if res is None else s + res.float() + (0 if bias is None else bias.float()[:, None, None])
    s = s.to(x.dtype).contiguous(memory_format=_layout(x))
    return s, tile_sums(s)


# The dgrad config the op's backward runs (model.conv_cutlass_dgrad): 1.024x cuDNN's rate over the step's sites,
# 2.21 -> 1.40 ms at the 384 -> 128 32x32 one (results/h200/conv-dgrad-1d24bf8, NOTES 48); and the same with the
# backward reduction's sums in its epilogue (conv3x3_dgrad_sums).
DGRAD_CONFIG, DGRAD_SUMS_CONFIG = "dgrad pingpong 128x128x64", "dgrad pingpong 128x128x64 + act sums"
# A measurement config (NOTES 50): the act-sums epilogue's data movement alone, its sums those of dx and dx x (act_sums
# with silu 0 and no mask); conv3x3_dgrad_sums runs it like the others.
BARE = " (bare)"


def _layout(t: Tensor) -> torch.memory_format:
    """norm._format's rule (channels_last where the tensor is laid out so), here: norm imports this module."""
    return torch.channels_last if t.is_contiguous(memory_format=torch.channels_last) and not t.is_contiguous() \
        else torch.contiguous_format


def _on_kernel(dy: Tensor) -> bool:
    return dy.is_cuda and dy.dtype == torch.bfloat16


@torch.library.custom_op("ffcv_ddpm::conv3x3_dgrad", mutates_args=())
def dgrad(dy: Tensor, w: Tensor) -> Tensor:
    """dx of F.conv2d(x, w, padding=1) from its output's gradient dy: CUTLASS's dgrad (DGRAD_CONFIG) for bf16 CUDA
    tensors, in channels_last; elsewhere the transposed convolution in torch, in dy's layout (the CPU tests)."""
    if _on_kernel(dy):
        cl = torch.channels_last
        return conv3x3_dgrad(dy.contiguous(memory_format=cl), w.contiguous(memory_format=cl),
                             config_named(DGRAD_CONFIG))
    return F.conv_transpose2d(dy, w, None, 1, 1).contiguous(memory_format=_layout(dy))


@dgrad.register_fake
def _(dy, w):
    fmt = torch.channels_last if _on_kernel(dy) else _layout(dy)
    return torch.empty((dy.shape[0], w.shape[1], *dy.shape[2:]), dtype=dy.dtype, device=dy.device,
                       memory_format=fmt)


@register_flop_formula(torch.ops.ffcv_ddpm.conv3x3_dgrad)
def _dgrad_flops(dy_shape, w_shape, *args, out_shape=None, **kwargs) -> int:
    """As aten.convolution_backward's formula counts a data gradient: 2 N H W Cout Cin 9."""
    n, _, h, w = dy_shape
    return 2 * n * h * w * prod(w_shape)


def tile_sums(out: Tensor, rows: int = TILE_M) -> Tensor:
    """conv3x3_sums' sums in torch, from its out."""
    flat = out.permute(0, 2, 3, 1).reshape(-1, rows, out.shape[1]).float()
    return torch.stack([flat.sum(1), (flat * flat).sum(1)])


def group_stats(sums: Tensor, n: int, hw: int, groups: int, add: Tensor | None = None,
                eps: float = 1e-5) -> tuple[Tensor, Tensor]:
    """(mean, rstd) fp32 (N, groups) of the GroupNorm of out + add, from conv3x3_sums' sums of out; add: None, fp32
    (C,) or (N, C) (a bias the GroupNorm adds: sum(x + b) = sum(x) + hw b, sum((x + b)^2) = sumsq + 2 b sum + hw b^2).
    The tiles must not span samples (hw a multiple of TILE_M). One Triton program a sample (the finalize the fused
    GroupNorm would run from these sums); group_stats_torch is its reference."""
    if hw % TILE_M:
        raise ValueError(f"group_stats: {hw} pixels a sample is not a whole number of {TILE_M}-pixel tiles")
    c = sums.shape[-1]
    mean = sums.new_empty(n, groups)
    rstd = sums.new_empty(n, groups)
    a = add if add is not None else sums
    _group_stats_kernel[(n,)](sums, a, mean, rstd, n * (hw // TILE_M), hw // TILE_M, float(hw), eps,
                              a.stride(0) if add is not None and add.dim() == 2 else 0,
                              C=c, G=groups, HAS_ADD=add is not None, BLOCK_T=triton.next_power_of_2(hw // TILE_M))
    return mean, rstd


@triton.jit
def _group_stats_kernel(sums, add, mean_out, rstd_out, rows, T, hw, eps, add_stride, C: tl.constexpr,
                        G: tl.constexpr, HAS_ADD: tl.constexpr, BLOCK_T: tl.constexpr):
    i = tl.program_id(0)
    t = tl.arange(0, BLOCK_T)[:, None]
    c = tl.arange(0, C)[None, :]
    offs = (i * T + t) * C + c
    mask = t < T
    s1 = tl.sum(tl.load(sums + offs, mask=mask, other=0.0), 0)  # (C,)
    s2 = tl.sum(tl.load(sums + rows * C + offs, mask=mask, other=0.0), 0)
    if HAS_ADD:
        b = tl.load(add + i * add_stride + tl.arange(0, C))
        s2 = s2 + 2 * b * s1 + hw * b * b
        s1 = s1 + hw * b
    count = hw * (C // G)
    g1 = tl.sum(tl.reshape(s1, (G, C // G)), 1) / count
    g2 = tl.sum(tl.reshape(s2, (G, C // G)), 1) / count
    var = tl.maximum(g2 - g1 * g1, 0.0)
    tl.store(mean_out + i * G + tl.arange(0, G), g1)
    tl.store(rstd_out + i * G + tl.arange(0, G), 1.0 / tl.sqrt(var + eps))


def group_stats_torch(sums: Tensor, n: int, hw: int, groups: int, add: Tensor | None = None,
                      eps: float = 1e-5) -> tuple[Tensor, Tensor]:
    """group_stats in torch ops (its reference; ~10 small kernels, 30-120 us a site on an H200: 2c50675's chain)."""
    c = sums.shape[-1]
    s1, s2 = sums.view(2, n, hw // TILE_M, c).sum(2)
    if add is not None:
        b = add.float().expand(n, c)
        s1, s2 = s1 + hw * b, s2 + 2 * b * s1 + hw * b * b
    count = hw * (c // groups)
    mean = s1.view(n, groups, -1).sum(-1) / count
    var = (s2.view(n, groups, -1).sum(-1) / count - mean * mean).clamp_min(0)
    return mean, torch.rsqrt(var + eps)


def _call(x: Tensor, w: Tensor, config: CutlassConfig, res: Tensor | None, bias: Tensor | None, stats: bool,
          op: int = OP_FPROP):
    """One call of a config: x is the forward's input, or with a dgrad config dy (what the kernel reads first); the
    output y, or dx."""
    what = ("the forward", "the data gradient")  # by OP_*
    if config.op != op:
        raise ValueError(f"conv3x3: CUTLASS config {config.name!r} computes {what[config.op]}; the call asks for "
                         f"{what[op]}")
    is_dgrad = op == OP_DGRAD
    n, _, h, wd = x.shape
    k, c = w.shape[:2]  # the forward's output and input channels
    cl = torch.channels_last
    want = (EPI_STATS if stats else 0) | (EPI_RESIDUAL if res is not None else 0)
    if config.epilogue != want:
        raise ValueError(f"conv3x3: CUTLASS config {config.name!r} has epilogue flags {config.epilogue}, the call "
                         f"asks for {want} (residual {res is not None}, sums {stats})")
    _check_operands("conv3x3", x, w, is_dgrad)
    if res is not None and (res.shape != (n, k, h, wd) or res.dtype != x.dtype
                            or not res.is_contiguous(memory_format=cl)):
        raise ValueError(f"conv3x3: the residual must be bf16 [{n}, {k}, {h}, {wd}] channels_last, got "
                         f"{res.dtype} {tuple(res.shape)} {res.stride()}")
    if bias is not None and (res is None or bias.shape != (k,) or bias.dtype != torch.float32
                             or not bias.is_contiguous() or bias.device != x.device):
        raise ValueError(f"conv3x3: a bias goes with a residual, fp32 [{k}] on {x.device}; got {bias.dtype} "
                         f"{tuple(bias.shape)} on {bias.device} (residual {res is not None})")
    if stats and (n * h * wd % TILE_M or k % 128):
        raise ValueError(f"conv3x3: sums need N*H*W a multiple of {TILE_M} and Cout of 128 (got {n * h * wd}, {k})")
    y = torch.empty(n, c if is_dgrad else k, h, wd, device=x.device, dtype=x.dtype, memory_format=cl)
    sums = torch.empty(2, n * h * wd // TILE_M, k, device=x.device, dtype=torch.float32) if stats else None
    _launch(library().cutconv_fprop, config, x.data_ptr(), w.data_ptr(), y.data_ptr(),
            res.data_ptr() if res is not None else None, bias.data_ptr() if bias is not None else None,
            sums[0].data_ptr() if stats else None, sums[1].data_ptr() if stats else None, n, h, wd, c, k)
    return y, sums


def _check_operands(who: str, x: Tensor, w: Tensor, is_dgrad: bool) -> None:
    """What every call of the kernels needs of x (dy for a dgrad) and w: a 3x3 w [K, C] whose channels match x's,
    both channels_last, bf16 on CUDA."""
    k, c = w.shape[:2]  # the forward's output and input channels
    cl = torch.channels_last
    if w.shape[2:] != (3, 3) or x.shape[1] != (k if is_dgrad else c) or not (
            x.is_contiguous(memory_format=cl) and w.is_contiguous(memory_format=cl)):
        raise ValueError(f"{who}: expected {'dy [N, K' if is_dgrad else 'x [N, C'}, H, W] and w [K, C, 3, 3] both "
                         f"channels_last, got {tuple(x.shape)} {x.stride()}, w {tuple(w.shape)} {w.stride()}")
    if not (x.is_cuda and w.is_cuda and x.dtype == w.dtype == torch.bfloat16):
        raise ValueError(f"{who}: expected bf16 CUDA tensors, got {'dy' if is_dgrad else 'x'} {x.dtype} on "
                         f"{x.device}, w {w.dtype} on {w.device}")


def _launch(fn, config: CutlassConfig, *args) -> None:
    """fn(config's index, *args, torch's current stream, an error buffer): a C entry of the library; its error as one
    RuntimeError naming the config."""
    err = ctypes.create_string_buffer(ERR_LEN)
    if fn(config.index, *args, torch.cuda.current_stream().cuda_stream, err, ERR_LEN):
        raise RuntimeError(f"CUTLASS {config.name}: {err.value.decode()}")


def main(argv: list[str] | None = None) -> int:
    from ffcv_ddpm.checks import Parser, fail

    p = Parser(prog="python -m ffcv_ddpm.conv_cutlass", doc=__doc__,
               epilog="Builds the library (no KEY=VALUE overrides): nvcc, and the headers from the network once.")
    p.add_argument("--home", type=Path, default=HOME, help="where the wheel, the headers and the build live")
    args = p.parse_args(argv)
    try:
        path = build(args.home)
    except (RuntimeError, ValueError, subprocess.CalledProcessError) as e:
        return fail("conv_cutlass", str(e))
    print(f"conv_cutlass: {path} ({path.stat().st_size / 2**20:.1f} MiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
