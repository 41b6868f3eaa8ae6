"""GroupNorm + SiLU (+ add, dropout) forward+backward alone, per implementation, at the DDPM UNet's shapes.

    python -m benchmarks.speed.norm_bench --out benchmarks/results/h200       # CUDA; bf16 channels_last inputs
    python -m benchmarks.speed.norm_bench --out /tmp/nb --impls fused data.batch_size=512 --iters 50
    python -m benchmarks.speed.norm_bench --out /tmp/nb --impls fused --plans grid   # 40 kernel plans per site
    python -m benchmarks.speed.norm_bench --out /tmp/nb --impls fused --plans stages # the reductions pipelined
    python -m benchmarks.speed.norm_bench --out /tmp/nb --impls fused --plans neighbours  # the default's neighbours
    python -m benchmarks.speed.norm_bench --out /tmp/nb --timing events --rounds 1   # launched from the host instead
    python -m benchmarks.speed.norm_bench --out /tmp/nb --impls fused --kernels     # each kernel against a copy

No --data: the inputs are random tensors at the sites' shapes (no dataset is read).
Each implementation of ffcv_ddpm.norm.GroupNormAct (torch, scale-shift, fused: with the config's model.norm_*
switches, the preset's fast SiLU among them) runs under torch.compile and bf16 autocast, as in the trainer, and its
output is cast to bf16 as the next convolution would. Timing (--timing graph,
the default): --iters calls captured as one CUDA graph and replayed, so the kernels are timed without the host's
launches between them (an H100 run launched from the host measured the same plan up to 1.9x apart in two runs:
NOTES item 15); every implementation and plan of a site is measured --rounds times, interleaved, and a row is its
median round. GB/s counts the fewest bytes such a layer must move: x read and out written forward, x and dout read
and dx written backward (5 passes of bf16), whatever the implementation actually moves.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from benchmarks.common import write_json
from benchmarks.speed.clocks import graph_ms, time_ms
from ffcv_ddpm.checks import Parser, at_least, fail, option
from ffcv_ddpm.config import load_config

# (C, H, W, dropout, add): ddpm-cifar10 sites (32x32 at 128 and 384 channels, 16x16 at 256), the residual block's
# second norm (time-embedding add + model.dropout) and its first (plain). N is data.batch_size (1024 here).
SITES = ((128, 32, 32, True, True), (384, 32, 32, False, False), (256, 16, 16, True, True))
DEFAULTS = ("data.batch_size=1024",)  # before the command's overrides
IMPLS = ("torch", "scale-shift", "fused")
# The fused kernels' plans swept: (elements per tile, elements per reduction program, num_warps), each passed to the
# layer as model.norm_plan passes it. "grid": every combination below, since fused v2's four plans spread 2.7-5.9 ms
# at one site (H200, 384 channels at 32x32) and the best differed between sites. Chunks go to 131072 because the
# fastest plan at every site was at the former edge, 65536 (H200, 57db305: benchmarks/results/h200/norm-plans-57db305).
# "default": norm.DEFAULT_PLAN, then the grid's fastest (its loops as written), the first default, and the grid's two
# runners-up. "stages": the grid's fastest with its reductions' loops as written, then pipelined 2, 3 and 4 tiles
# deep (norm.PLAN_STAGES; 4 is DEFAULT_PLAN), and a half chunk at 3 (more programs, each with fewer tiles to pipeline).
# "neighbours": DEFAULT_PLAN, then its tile and chunk halved or doubled, pipelined as it is: the grid was swept with
# its loops as written, and on an H100 (0c88903, one site) a 131072-element chunk beat the default's 65536 by 2% there.
FUSED_PLANS = {"default": ((2048, 65536, 4, 4), (2048, 65536, 4), (1024, 16384, 4), (2048, 32768, 4), (4096, 65536, 4)),
               "grid": tuple((t, c, w) for t in (1024, 2048, 4096, 8192) for c in (8192, 16384, 32768, 65536, 131072)
                             for w in (4, 8)),
               "stages": ((2048, 65536, 4), (2048, 65536, 4, 2), (2048, 65536, 4, 3), (2048, 65536, 4, 4),
                          (2048, 32768, 4, 3)),
               "neighbours": ((2048, 65536, 4, 4), (2048, 131072, 4, 4), (4096, 131072, 4, 4), (4096, 65536, 4, 4),
                              (2048, 32768, 4, 4), (1024, 65536, 4, 4))}


class Site:
    """One shape's inputs and each implementation's layer, built once and timed under any plan."""

    def __init__(self, shape: tuple, fused: tuple = ()):
        self.shape = shape
        self.fused = fused  # the fused layer's switches as the config sets them: (name, value) pairs
        n, c, h, w, _, add, _ = shape
        torch.manual_seed(0)
        x = (torch.randn(n, c, h, w, device="cuda") * 2 + 1).to(torch.bfloat16)
        self.x = x.contiguous(memory_format=torch.channels_last).requires_grad_()
        self.e = torch.randn(n, c, device="cuda", dtype=torch.bfloat16) if add else None
        self.dout = torch.randn_like(self.x)
        self.layers = {}

    def layer(self, impl: str, plan: tuple | None, switches: tuple = ()):
        """The implementation's forward at this site (the fused one with `plan`, None: its default), bf16 out as the
        next convolution takes it; switches, (name, value) pairs of GroupNormAct's arguments (silu, dropout,
        fast_silu, mask_bits), vary the layer for --kernels."""
        from ffcv_ddpm.norm import GroupNormAct

        _, c, _, _, site_p, _, groups = self.shape
        own = dict(self.fused) if impl == "fused" else {}
        m = GroupNormAct(groups, c, impl, plan=plan, **{"dropout": site_p, **own, **dict(switches)}).cuda()

        def fwd(x, e):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                return m(x, add=e).to(torch.bfloat16)

        # The fused op is one call either way; compiling it would recompile per swept plan for nothing.
        return fwd if impl == "fused" else torch.compile(fwd, dynamic=False)

    def step(self, impl: str, plan: tuple | None, switches: tuple = ()):
        """(forward, forward + backward) of the implementation at this site, as callables."""
        key = (impl, plan, switches)
        if key not in self.layers:
            self.layers[key] = self.layer(impl, plan, switches)
        fwd, x, e = self.layers[key], self.x, self.e

        def both():
            x.grad = None  # no gradient accumulation kernel in the timing
            fwd(x, e).backward(self.dout)

        return lambda: fwd(x, e), both

    def measure(self, impl: str, plan: tuple | None, timing: str, iters: int, warmup: int) -> dict:
        fwd, both = self.step(impl, plan)
        clock = graph_ms if timing == "graph" else time_ms
        return {"fwd_ms": clock(fwd, iters, warmup), "fwd_bwd_ms": clock(both, iters, warmup)}


# The fused op's kernels that stream the activations, and the passes of a site's (N, C, H, W) bf16 tensor each moves
# at these sites (no residual sum: norm_bench's layers): the statistics read x; the apply reads x and writes the
# output; the backward reduction reads x and dy; the backward dx reads x and dy and writes dx. With the mask as bits
# (mask_bits) the apply also writes them and both backward kernels read them: a sixteenth of a pass each.
KERNEL_PASSES = {"_stats_kernel": 1, "_apply_kernel": 2, "_bwd_reduce_kernel": 2, "_bwd_dx_kernel": 3}
BITS_KERNELS = ("_apply_kernel", "_bwd_reduce_kernel", "_bwd_dx_kernel")


# --kernels profiles the site's layer as the config has it (the preset: SiLU through tanh.approx), then with the
# exact SiLU, with the dropout mask a hash a pair of channels (pair_hash) or kept as bits (mask_bits) where the site
# has dropout, with the backward's sums over x (x_sums), then without its dropout and without SiLU either: what each
# kernel's arithmetic costs it beside its bytes, and what each switch wins back of it. (name, switches over the
# config's, whether it needs the site's dropout)
KERNEL_VARIANTS = (
    ("as at the site", (), False),
    ("exact SiLU", (("fast_silu", False),), False),
    ("pair hash", (("pair_hash", True),), True),
    ("x sums", (("x_sums", True),), False),
    ("pair hash + x sums", (("pair_hash", True), ("x_sums", True)), True),
    ("mask bits", (("mask_bits", True),), True),
    ("no dropout", (("dropout", 0.0),), True),
    ("no SiLU, no dropout", (("silu", False), ("dropout", 0.0)), False),
)


def kernel_ms(step, iters: int) -> dict[str, float]:
    """ms a call of each GPU kernel `step` launches, by name, from torch.profiler's device times over `iters` eager
    calls (launched from the host: a kernel's own time is the same, the gaps between them are not counted)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            step()
        torch.cuda.synchronize()
    total: dict[str, float] = {}
    for e in prof.events():
        if e.device_type == DeviceType.CUDA:
            total[e.name] = total.get(e.name, 0.0) + e.time_range.elapsed_us() / 1e3
    return {name: ms / iters for name, ms in total.items()}


def pass_bytes(shape: tuple) -> int:
    """One pass over a site's (N, C, H, W) bf16 tensor."""
    n, c, h, w = shape[:4]
    return n * c * h * w * 2


def kernel_rows(times: dict[str, float], shape: tuple, copy_gbs: float, bits: bool = False) -> list[dict]:
    """Each streaming kernel's ms a call, the bytes its passes move (with `bits`, the mask's too) and its rate
    against a copy of one pass's size (`copy_gbs`, measured in the same process: copy_rate.copy_gb_per_s)."""
    one_pass = pass_bytes(shape)
    rows = []
    for name, passes in KERNEL_PASSES.items():
        ms = sum(t for k, t in times.items() if k == name or k.startswith(name + "_"))  # Triton may suffix names
        if ms:
            moved = passes * one_pass + (one_pass // 16 if bits and name in BITS_KERNELS else 0)
            gbs = moved / ms / 1e6
            rows.append({"kernel": name, "ms": ms, "passes": passes, "gb_per_s": gbs, "of_copy": gbs / copy_gbs})
    return rows


def sweep(measure, runs: list[tuple], rounds: int) -> tuple[dict, dict]:
    """Each (impl, plan) of `runs` measured `rounds` times, interleaved (a clock or neighbour that drifts during the
    sweep lands on every plan alike): ({run: [round, ...]}, {run: error}). A run that raises is left out of later
    rounds and reported with its error, the others go on: a plan Triton cannot compile (a pipelined loop,
    norm.PLAN_STAGES) is one failed row, not a lost sweep."""
    got, failed = {run: [] for run in runs}, {}
    for _ in range(rounds):
        for run in runs:
            if run in failed:
                continue
            try:
                got[run].append(measure(*run))
            except Exception as e:  # whatever the compiler or the launch raised, named in the row
                failed[run] = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
    return got, failed


def summarize(impl: str, plan: tuple | None, shape: tuple, rounds: list[dict]) -> dict:
    """A row from its rounds: the median round's times, every round's, and GB/s at the fewest bytes."""
    fwd = sorted(r["fwd_ms"] for r in rounds)
    both = sorted(r["fwd_bwd_ms"] for r in rounds)
    bytes_min = 5 * pass_bytes(shape)
    mid = both[len(both) // 2]
    return {"impl": impl, "plan": plan, "shape": list(shape[:6]), "fwd_ms": fwd[len(fwd) // 2], "fwd_bwd_ms": mid,
            "rounds": rounds, "min_gb": bytes_min / 1e9, "gb_per_s_at_min_bytes": bytes_min / mid / 1e6}


def main(argv: list[str] | None = None) -> int:
    p = Parser(prog="python -m benchmarks.speed.norm_bench", doc=__doc__, overrides=True,
               epilog="Overrides read here: data.batch_size (N, default 1024), model.dropout and model.norm_groups "
                      "(of ddpm-cifar10: 0.1 and 32).")
    p.add_argument("--out", type=Path, required=True, help="folder for norm_bench.json")
    p.add_argument("--iters", type=option(int, at_least(1)), default=20,
                   help="calls per measurement (graph timing: calls per captured graph)")
    p.add_argument("--warmup", type=option(int, at_least(0)), default=5, help="calls before timing")
    p.add_argument("--impls", default=",".join(IMPLS), help="model.norm_impl values, comma-separated")
    p.add_argument("--plans", choices=tuple(FUSED_PLANS), default="default",
                   help="the fused kernels' tile/chunk/warp plans to sweep (default: 4, the default plan first; "
                        "grid: 40 per site; stages: the default plan with its reductions' loops pipelined; "
                        "neighbours: the default's tile and chunk halved and doubled, pipelined)")
    p.add_argument("--timing", choices=("graph", "events"), default="graph",
                   help="graph: the calls replayed as one CUDA graph (the kernels alone); events: launched one by "
                        "one from the host, CUDA events per call (what a step without CUDA graphs pays)")
    p.add_argument("--rounds", type=option(int, at_least(1)), default=3,
                   help="each site's implementations and plans measured this many times, interleaved; a row is its "
                        "median round (the spread between rounds is in the JSON)")
    p.add_argument("--kernels", action="store_true",
                   help="also each fused kernel's ms a call at the plans' first (torch.profiler) and its rate against "
                        "a copy of one pass's size measured here, as the site has it (the config's model.norm_* "
                        "switches) and in KERNEL_VARIANTS' variants: exact SiLU, pair hash, x sums (alone and with the "
                        "pair hash), mask bits, no dropout, neither SiLU nor dropout (NOTES items 36-38)")
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
    result = {"environment": environment(), "device_name": torch.cuda.get_device_name(), "rows": [],
              "settings": {"timing": args.timing, "rounds": args.rounds, "iters": args.iters, "warmup": args.warmup,
                           "plans": args.plans, "kernels": args.kernels}}
    for shape in shapes:
        # the fused layer as the model builds its GroupNorms: the config's switches (not its plan: swept here)
        switches = {k: v for k, v in cfg.model.act_norm().items() if k != "plan"}
        site = Site(shape, fused=tuple({**cfg.model.norm_switches(), **switches}.items()))
        runs = [(impl, plan) for impl in args.impls.split(",")
                for plan in (FUSED_PLANS[args.plans] if impl == "fused" else (None,))]
        got, failed = sweep(lambda impl, plan: site.measure(impl, plan, args.timing, args.iters, args.warmup),
                            runs, args.rounds)
        for impl, plan in runs:
            if (impl, plan) in failed:
                result["rows"].append({"impl": impl, "plan": plan, "shape": list(shape[:6]),
                                       "error": failed[(impl, plan)]})
                print(f"norm_bench: {impl:12s} {str(plan or ''):12s} {str(shape[:6]):32s} FAILED: "
                      f"{failed[(impl, plan)]}", flush=True)
                continue
            row = summarize(impl, plan, shape, got[(impl, plan)])
            result["rows"].append(row)
            spread = max(r["fwd_bwd_ms"] for r in row["rounds"]) / min(r["fwd_bwd_ms"] for r in row["rounds"])
            print(f"norm_bench: {impl:12s} {str(plan or ''):12s} {str(shape[:6]):32s} fwd {row['fwd_ms']:7.3f} ms  "
                  f"fwd+bwd {row['fwd_bwd_ms']:7.3f} ms (rounds {spread:.2f}x apart)  "
                  f"{row['gb_per_s_at_min_bytes']:6.0f} GB/s at the minimum bytes", flush=True)
        if args.kernels and "fused" in args.impls.split(","):
            from benchmarks.speed.copy_rate import copy_gb_per_s

            row = next(r for r in result["rows"] if r["impl"] == "fused" and r["shape"] == list(shape[:6]))
            if "error" not in row:
                row["copy_gb_per_s"] = copy_gb_per_s(pass_bytes(shape))
                row["kernels"] = []
                # without dropout at the site, the variants of its dropout are the site's layer again
                for variant, switches, of_dropout in KERNEL_VARIANTS:
                    if of_dropout and not shape[4]:
                        continue
                    times = kernel_ms(site.step("fused", row["plan"], switches)[1], args.iters)
                    bits = dict(switches).get("mask_bits", False)
                    for k in kernel_rows(times, shape, row["copy_gb_per_s"], bits):
                        row["kernels"].append({"variant": variant, **k})
                        print(f"norm_bench:   {variant:20s} {k['kernel']:20s} {k['ms']:7.3f} ms, {k['passes']} "
                              f"passes: {k['gb_per_s']:5.0f} GB/s, {k['of_copy']:.0%} of a copy's "
                              f"{row['copy_gb_per_s']:.0f}", flush=True)
        write_json(args.out / "norm_bench.json", result)  # after every site: a cut run keeps the sites measured
        del site
        torch.cuda.empty_cache()
    for site, best in best_plans(result["rows"]).items():
        print(f"norm_bench: fastest fused plan at {site}: {best['plan']} ({best['fwd_bwd_ms']:.3f} ms fwd+bwd)")
    return 0


def best_plans(rows: list[dict]) -> dict[str, dict]:
    """The fused row with the shortest forward + backward at each site (shape); failed rows are not candidates."""
    best = {}
    for r in rows:
        key = str(r["shape"])
        if "error" in r:
            continue
        if r["impl"] == "fused" and (key not in best or r["fwd_bwd_ms"] < best[key]["fwd_bwd_ms"]):
            best[key] = r
    return best


if __name__ == "__main__":
    sys.exit(main())
