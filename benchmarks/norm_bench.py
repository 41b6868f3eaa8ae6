"""GroupNorm + SiLU (+ add, dropout) forward+backward alone, per implementation, at the DDPM UNet's shapes.

    python -m benchmarks.norm_bench --out benchmarks/results/h200       # CUDA; bf16 channels_last inputs

Each implementation of ffcv_ddpm.norm.GroupNormAct (torch, scale-shift, fused) runs under torch.compile and bf16
autocast, as in the trainer, and its output is cast to bf16 as the next convolution would. Times are medians of
CUDA-event-timed iterations; GB/s counts the fewest bytes such a layer must move: x read and out written forward,
x and dout read and dx written backward (5 passes of bf16), whatever the implementation actually moves.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from benchmarks.common import write_json

# (N, C, H, W, dropout, add): the ddpm-cifar10 sites at batch 1024 (32x32 at 128 and 384 channels, 16x16 at 256,
# 8x8 at 512), with the residual block's second norm (time-embedding add + dropout) and its first (plain).
SHAPES = ((1024, 128, 32, 32, 0.1, True), (1024, 384, 32, 32, 0.0, False), (1024, 256, 16, 16, 0.1, True))
IMPLS = ("torch", "scale-shift", "fused")
# The fused kernels' plans swept: (elements per tile, elements per reduction program, num_warps)
FUSED_PLANS = ((1024, 16384, 4), (2048, 16384, 8), (1024, 8192, 4), (2048, 32768, 4))


def time_ms(fn, iters: int, warmup: int) -> float:
    """Median ms of `iters` calls after `warmup` (timing.timed_steps: CUDA events, one sync)."""
    from ffcv_ddpm.timing import timed_steps

    for _ in range(warmup):
        fn()

    def call(_batch, _i):
        fn()  # returns None: nothing for timed_steps to sum

    return sorted(timed_steps(call, lambda: None, iters, "cuda").iter_ms)[iters // 2]


def bench_one(impl: str, shape: tuple, iters: int, warmup: int, plan: tuple | None = None) -> dict:
    from ffcv_ddpm import norm
    from ffcv_ddpm.norm import GroupNormAct

    if plan:
        norm.TILE_ELEMENTS, norm.CHUNK_ELEMENTS, norm.NUM_WARPS = plan

    n, c, h, w, p, add = shape
    torch.manual_seed(0)
    m = GroupNormAct(32, c, impl, dropout=p).cuda()
    x = (torch.randn(n, c, h, w, device="cuda") * 2 + 1).to(torch.bfloat16)
    x = x.contiguous(memory_format=torch.channels_last).requires_grad_()
    e = torch.randn(n, c, device="cuda", dtype=torch.bfloat16) if add else None
    dout = torch.randn_like(x)

    def fwd(x, e):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            return m(x, add=e).to(torch.bfloat16)

    # The fused op is one call either way; compiling it would recompile per swept plan for nothing.
    fwd = fwd if impl == "fused" else torch.compile(fwd, dynamic=False)

    def step():
        x.grad = None  # no gradient accumulation kernel in the timing
        fwd(x, e).backward(dout)

    fwd_ms = time_ms(lambda: fwd(x, e), iters, warmup)
    both_ms = time_ms(step, iters, warmup)
    bytes_min = 5 * x.numel() * x.element_size()
    return {"impl": impl, "plan": plan, "shape": list(shape), "fwd_ms": fwd_ms, "fwd_bwd_ms": both_ms,
            "min_gb": bytes_min / 1e9, "gb_per_s_at_min_bytes": bytes_min / both_ms / 1e6}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.norm_bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True, help="folder for norm_bench.json")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--impls", default=",".join(IMPLS))
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("norm_bench: needs CUDA", file=sys.stderr)
        return 2
    from ffcv_ddpm.env import environment

    args.out.mkdir(parents=True, exist_ok=True)
    result = {"environment": environment(), "device_name": torch.cuda.get_device_name(), "rows": []}
    for shape in SHAPES:
        runs = [(impl, plan) for impl in args.impls.split(",")
                for plan in (FUSED_PLANS if impl == "fused" else (None,))]
        for impl, plan in runs:
            row = bench_one(impl, shape, args.iters, args.warmup, plan)
            result["rows"].append(row)
            write_json(args.out / "norm_bench.json", result)
            print(f"norm_bench: {impl:12s} {str(plan or ''):12s} {str(shape):32s} fwd {row['fwd_ms']:7.3f} ms  fwd+bwd "
                  f"{row['fwd_bwd_ms']:7.3f} ms  {row['gb_per_s_at_min_bytes']:6.0f} GB/s at the minimum bytes",
                  flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
