"""GroupNorm + SiLU (+ add, dropout) forward+backward alone, per implementation, at the DDPM UNet's shapes.

    python -m benchmarks.speed.norm_bench --out benchmarks/results/h200       # CUDA; bf16 channels_last inputs
    python -m benchmarks.speed.norm_bench --out /tmp/nb --impls fused data.batch_size=512 --iters 50
    python -m benchmarks.speed.norm_bench --out /tmp/nb --impls fused --plans grid   # 32 kernel plans per site

No --data: the inputs are random tensors at the sites' shapes (no dataset is read).
Each implementation of ffcv_ddpm.norm.GroupNormAct (torch, scale-shift, fused) runs under torch.compile and bf16
autocast, as in the trainer, and its output is cast to bf16 as the next convolution would. Times are medians of
CUDA-event-timed iterations; GB/s counts the fewest bytes such a layer must move: x read and out written forward,
x and dout read and dx written backward (5 passes of bf16), whatever the implementation actually moves.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from benchmarks.common import write_json
from ffcv_ddpm.checks import Parser, at_least, fail, option
from ffcv_ddpm.config import load_config

# (C, H, W, dropout, add): ddpm-cifar10 sites (32x32 at 128 and 384 channels, 16x16 at 256), the residual block's
# second norm (time-embedding add + model.dropout) and its first (plain). N is data.batch_size (1024 here).
SITES = ((128, 32, 32, True, True), (384, 32, 32, False, False), (256, 16, 16, True, True))
DEFAULTS = ("data.batch_size=1024",)  # before the command's overrides
IMPLS = ("torch", "scale-shift", "fused")
# The fused kernels' plans swept: (elements per tile, elements per reduction program, num_warps). "default": the four
# of fused v2's call; "grid": every combination below, since those four spread 2.7-5.9 ms at one site (H200, 384
# channels at 32x32) and the best differed between sites.
FUSED_PLANS = {"default": ((1024, 16384, 4), (2048, 16384, 8), (1024, 8192, 4), (2048, 32768, 4)),
               "grid": tuple((t, c, w) for t in (1024, 2048, 4096, 8192) for c in (8192, 16384, 32768, 65536)
                             for w in (4, 8))}


def time_ms(fn, iters: int, warmup: int) -> float:
    """Median ms of `iters` calls after `warmup` (timing.timed_steps: CUDA events, one sync)."""
    from ffcv_ddpm.timing import timed_steps, untimed_steps

    def call(_batch, _i):
        fn()  # returns None: nothing for timed_steps to sum

    untimed_steps(call, lambda: None, warmup, "cuda")
    return sorted(timed_steps(call, lambda: None, iters, "cuda").iter_ms)[iters // 2]


def bench_one(impl: str, shape: tuple, iters: int, warmup: int, plan: tuple | None = None) -> dict:
    from ffcv_ddpm import norm
    from ffcv_ddpm.norm import GroupNormAct

    if plan:
        norm.TILE_ELEMENTS, norm.CHUNK_ELEMENTS, norm.NUM_WARPS = plan

    n, c, h, w, p, add, groups = shape
    torch.manual_seed(0)
    m = GroupNormAct(groups, c, impl, dropout=p).cuda()
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
    return {"impl": impl, "plan": plan, "shape": list(shape[:6]), "fwd_ms": fwd_ms, "fwd_bwd_ms": both_ms,
            "min_gb": bytes_min / 1e9, "gb_per_s_at_min_bytes": bytes_min / both_ms / 1e6}


def main(argv: list[str] | None = None) -> int:
    p = Parser(prog="python -m benchmarks.speed.norm_bench", doc=__doc__, overrides=True,
               epilog="Overrides read here: data.batch_size (N, default 1024), model.dropout and model.norm_groups "
                      "(of ddpm-cifar10: 0.1 and 32).")
    p.add_argument("--out", type=Path, required=True, help="folder for norm_bench.json")
    p.add_argument("--iters", type=option(int, at_least(1)), default=20, help="timed calls per measurement")
    p.add_argument("--warmup", type=option(int, at_least(0)), default=5, help="calls before timing")
    p.add_argument("--impls", default=",".join(IMPLS), help="model.norm_impl values, comma-separated")
    p.add_argument("--plans", choices=tuple(FUSED_PLANS), default="default",
                   help="the fused kernels' tile/chunk/warp plans to sweep (grid: 32 per site)")
    args, overrides = p.parse_with_overrides(argv)
    try:
        cfg = load_config("ddpm-cifar10", [*DEFAULTS, *overrides])
    except ValueError as e:
        return fail("norm_bench", str(e))
    shapes = [(cfg.data.batch_size, c, h, w, cfg.model.dropout if drop else 0.0, add, cfg.model.norm_groups)
              for c, h, w, drop, add in SITES]
    if not torch.cuda.is_available():
        return fail("norm_bench", "needs a CUDA GPU (it times Triton and compiled kernels)")
    from ffcv_ddpm.env import environment

    args.out.mkdir(parents=True, exist_ok=True)
    result = {"environment": environment(), "device_name": torch.cuda.get_device_name(), "rows": []}
    for shape in shapes:
        runs = [(impl, plan) for impl in args.impls.split(",")
                for plan in (FUSED_PLANS[args.plans] if impl == "fused" else (None,))]
        for impl, plan in runs:
            row = bench_one(impl, shape, args.iters, args.warmup, plan)
            result["rows"].append(row)
            write_json(args.out / "norm_bench.json", result)
            print(f"norm_bench: {impl:12s} {str(plan or ''):12s} {str(shape[:6]):32s} fwd {row['fwd_ms']:7.3f} ms  "
                  f"fwd+bwd {row['fwd_bwd_ms']:7.3f} ms  {row['gb_per_s_at_min_bytes']:6.0f} GB/s at the minimum bytes",
                  flush=True)
    for site, best in best_plans(result["rows"]).items():
        print(f"norm_bench: fastest fused plan at {site}: {best['plan']} ({best['fwd_bwd_ms']:.3f} ms fwd+bwd)")
    return 0


def best_plans(rows: list[dict]) -> dict[str, dict]:
    """The fused row with the shortest forward + backward at each site (shape)."""
    best = {}
    for r in rows:
        key = str(r["shape"])
        if r["impl"] == "fused" and (key not in best or r["fwd_bwd_ms"] < best[key]["fwd_bwd_ms"]):
            best[key] = r
    return best


if __name__ == "__main__":
    sys.exit(main())
