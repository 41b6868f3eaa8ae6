"""Registers and shared memory of the fused GroupNorm's Triton kernels, built offline for a GPU architecture.

    python -m benchmarks.speed.kernel_regs                       # the default plan, sm_90 (H100, H200)
    python -m benchmarks.speed.kernel_regs --plan 2048,65536,4,2 --site 1024,256,16,16 --arch 90

No GPU is needed: Triton compiles each kernel of ffcv_ddpm.gn_kernels for the architecture with its own ptxas and
the launch constants a site would get (norm.plan_for: batch, channels, rows, the plan's tile, chunk, warps and
stages), once per variant the DDPM UNet uses, and cuobjdump reads the registers back. Printed per kernel and variant:
registers a thread, the stack bytes of spilled ones, shared memory a program, and how many programs an SM can hold
by those two and its thread limit.
Why it exists: a variant's registers decide how many of its programs an SM runs at once, which a GPU profile shows
only after the call. The backward reduction's add + dropout + SiLU variant builds here to 168 registers, 3 programs
an SM, as the H100 trace of benchmarks/results/h100/profile-best-0c88903 reports it (168, 19% occupancy; NOTES item
27); with its sum of xhat from the forward's means (model.norm_saved_means) 128, 4 programs an SM (NOTES item 31).
The counts are those of the installed Triton (requirements.txt pins it); the GPU machine's may differ.
"""

from __future__ import annotations

import inspect
import os
import re
import subprocess
import sys
import tempfile

from ffcv_ddpm.checks import Parser, fail

# The variants the DDPM UNet launches (GroupNormAct's flags): name -> (SILU, HAS_ADD, DROPOUT, TWO), then under the
# switches of NOTES item 31: the res blocks' norm2 with model.norm_saved_means (no third sum in the backward
# reduction: SUM_XHAT off) and model.norm_mask_bits (the mask read from bits: BITS on), and with model.norm_residual
# the first GroupNorms reading a residual sum (RES terms and a bias added in the statistics kernel, which writes
# the sum; HAS_DS: the sum's other gradients added in the dx kernel): a down block's (one term, its skip), an up
# block's (two terms, its skip convolution over the parts) with its second part. With model.norm_fast_silu (NOTES
# item 37) SILU is 2 and FAST_TANH on: SiLU and its derivative through tanh.approx.f32, inline PTX; with
# model.norm_pair_hash PAIR on: one hash for two channels' dropout masks; with model.norm_x_sums XSUMS on: the
# backward kernels' sums over x (NOTES item 38); with model.norm_dbias DBIAS on: the residual sum's bias gradient
# from the dx kernel's tile sums (NOTES item 41); with model.conv_parts OUT_TWO on (and DOUT_TWO with it): the up
# blocks' first GroupNorm writes its output, and reads its gradient, as two tensors (NOTES item 44).
FLAGS = ("SILU", "HAS_ADD", "DROPOUT", "TWO", "SUM_XHAT", "BITS", "RES", "RBIAS", "HAS_DS", "FAST_TANH", "PAIR",
         "XSUMS", "DBIAS", "OUT_TWO")
VARIANTS = {
    "res block norm1": (True, False, False, False),
    "res block norm2 (add, dropout)": (True, True, True, False),
    "up block norm1 (two parts)": (True, False, False, True),
    "attention norm": (False, False, False, False),
    "norm2, saved means": (True, True, True, False, False, False),
    "norm2, mask bits": (True, True, True, False, True, True),
    "norm2, saved means + mask bits": (True, True, True, False, False, True),
    "res block norm1, residual sum": (True, False, False, False, False, False, 1, True, True),
    "up block norm1, residual sum": (True, False, False, True, False, False, 2, True, True),
    "res block norm1, fast SiLU": (2, False, False, False, False, False, 0, False, False, True),
    "norm2, fast SiLU": (2, True, True, False, True, False, 0, False, False, True),
    "norm2, fast SiLU + mask bits": (2, True, True, False, True, True, 0, False, False, True),
    "norm2, fast SiLU + pair hash": (2, True, True, False, True, False, 0, False, False, True, True),
    "res block norm1, fast SiLU + x sums": (2, False, False, False, False, False, 0, False, False, True, False, True),
    "norm2, fast SiLU + pair hash + x sums": (2, True, True, False, True, False, 0, False, False, True, True, True),
    "res block norm1, residual sum, fast SiLU + x sums + dbias": (2, False, False, False, False, False, 1, True, True,
                                                                  True, False, True, True),
    "up block norm1, residual sum, fast SiLU + x sums + dbias": (2, False, False, True, False, False, 2, True, True,
                                                                 True, False, True, True),
    "up block norm1, residual sum, fast SiLU + x sums, two outputs": (2, False, False, True, False, False, 2, True,
                                                                      True, True, False, True, False, True),
}
# The optional pointers: the residual sum's, the bias gradient's, the second output's and its gradient's (norm.py
# passes None, a constant, where a variant reads none of them).
RESIDUAL_POINTERS = {"res_ptr": 1, "s_ptr": 1, "res2_ptr": 2, "rb_ptr": "RBIAS", "ds_ptr": "HAS_DS",
                     "dbias_ptr": "DBIAS", "out2_ptr": "OUT_TWO", "dout2_ptr": "DOUT_TWO"}
KERNELS = ("_stats_kernel", "_finalize_kernel", "_apply_kernel", "_bwd_reduce_kernel", "_bwd_finalize_kernel",
           "_bwd_dx_kernel")
# The layout the launches see: channels_last bf16 (unit channel stride, Triton specialises an int argument equal to
# 1 as a constant) and 16-divisible sizes and strides, as at the DDPM sites. C1 (the first part's channels: 128 or
# 256) among them: built as not divisible, the up blocks' two-part variants lost their vector loads and pipelining
# here, where the H100 trace of profile-best-0c88903 shows them with both (its reduction 125 registers, 36 KB).
UNIT_STRIDES = {"s_xc", "s_2c", "s_dc", "s_oc", "s_ac", "s_ec", "s_gc", "s_o2c", "s_d2c"}
NOT_DIVISIBLE = {"K", "CPG", "CW", "G", "thr", "eps", "inv_keep"}
BF16_POINTERS = {"x_ptr", "x2_ptr", "dout_ptr", "dx_ptr", "dx2_ptr", "out_ptr", "res_ptr", "res2_ptr", "s_ptr",
                 "ds_ptr", "out2_ptr", "dout2_ptr"}
# An SM's limits by compute capability: registers, shared memory (bytes, 1 KB of it reserved per program), threads,
# programs (CUDA's occupancy tables: 8.0 is the A100, 9.0 the H100 and H200).
SM = {80: dict(registers=65536, shared=167936, threads=2048, programs=32),
      90: dict(registers=65536, shared=233472, threads=2048, programs=32)}


def programs_per_sm(registers: int, shared: int, warps: int, sm: dict = SM[90]) -> int:
    """How many programs of `warps` warps an SM holds at `registers` a thread and `shared` bytes a program: registers
    are allocated per warp in units of 256, shared memory with 1 KB reserved per program."""
    per_warp = -(-registers * 32 // 256) * 256
    by_registers = sm["registers"] // (per_warp * warps)
    by_shared = sm["shared"] // (shared + 1024)
    return min(by_registers, by_shared, sm["threads"] // (32 * warps), sm["programs"])


def build(kernel, constants: dict, warps: int, arch: int) -> tuple[int, int, int]:
    """(registers a thread, shared memory bytes a program, stack bytes a thread: spilled registers) of `kernel`
    compiled for sm_<arch> with `constants` for its constexpr parameters."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    if not isinstance(kernel, triton.runtime.jit.JITFunction):  # TRITON_INTERPRET=1 made it an interpreted one
        raise RuntimeError("the kernels were imported under Triton's interpreter (TRITON_INTERPRET=1): unset it to "
                           "build them")
    names = list(inspect.signature(kernel.fn).parameters)
    constants = {**constants, **{n: 1 for n in UNIT_STRIDES if n in names}}
    signature, attrs = {}, {}
    for i, name in enumerate(names):
        if name in constants:
            signature[name] = "constexpr"
            continue
        if name.endswith("_ptr"):
            signature[name] = ("*bf16" if name in BF16_POINTERS else "*i64" if name == "seed_ptr" else
                               "*i32" if name == "bits_ptr" else "*fp32")
        else:
            signature[name] = "fp32" if name in ("eps", "inv_keep") else "i32"
        if name not in NOT_DIVISIBLE:
            attrs[(i,)] = [["tt.divisibility", 16]]
    source = ASTSource(fn=kernel, signature=signature, attrs=attrs,
                       constexprs={(names.index(k),): v for k, v in constants.items()})
    compiled = triton.compile(source, target=GPUTarget("cuda", arch, 32), options={"num_warps": warps})
    with tempfile.TemporaryDirectory() as d:
        cubin = os.path.join(d, "kernel.cubin")
        with open(cubin, "wb") as f:
            f.write(compiled.asm["cubin"])
        tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
        usage = subprocess.run([tool, "--dump-resource-usage", cubin], capture_output=True, text=True, check=True)
    found = re.search(r"REG:(\d+)", usage.stdout)
    if found is None:
        raise RuntimeError(f"cuobjdump printed no register count for {kernel.fn.__name__}: {usage.stdout[:200]}")
    stack = re.search(r"STACK:(\d+)", usage.stdout)
    return int(found.group(1)), compiled.metadata.shared, int(stack.group(1)) if stack else 0


def rows(plan: tuple[int, ...], site: tuple[int, int, int, int], arch: int, groups: int = 32,
         sms: int = 132) -> list[dict]:
    """One row per kernel and variant at `site` (N, C, H, W) with `plan` (tile, chunk, warps[, stages]), on a GPU of
    `sms` SMs (132: the H100 and H200; it sets how the reductions split small batches)."""
    from ffcv_ddpm import gn_kernels
    from ffcv_ddpm.norm import plan_args, plan_for

    tile, chunk, warps, stages = plan_args(plan)
    n, c, h, w = site
    pl = plan_for(n, c, h * w, groups, tile, chunk, sms)
    given = dict(CHUNK=pl["CHUNK"], BLOCK_R=pl["BLOCK_R"], BLOCK_C=pl["BLOCK_C"], STAGES=stages or None,
                 WORD=pl["WORD"], BLOCK_K=pl["BLOCK_K"], BLOCK_G=pl["BLOCK_G"], BLOCK_CPG=pl["BLOCK_CPG"])
    out = []
    for name in KERNELS:
        kernel = getattr(gn_kernels, name)
        params = inspect.signature(kernel.fn).parameters
        builds: dict[tuple, list[str]] = {}  # the flags this kernel reads -> the variants that launch it with them
        for variant, flags in VARIANTS.items():
            flags = {**dict(SUM_XHAT=flags[1], BITS=False, RES=0, RBIAS=False, HAS_DS=False, FAST_TANH=False,
                            PAIR=False, XSUMS=False, DBIAS=False, OUT_TWO=False),
                     **dict(zip(FLAGS, flags))}
            flags["DOUT_TWO"] = flags["OUT_TWO"]  # the backward kernels read the gradients of the forward's outputs
            # the finalize kernels keep and read the means where the reduction does not sum xhat
            flags["SAVE_MEANS"] = flags["FROM_MEANS"] = flags["HAS_ADD"] and not flags["SUM_XHAT"]
            unused = tuple((k, None) for k, on in RESIDUAL_POINTERS.items() if k in params and not (
                flags[on] if isinstance(on, str) else flags["RES"] >= on))
            read = tuple((k, v) for k, v in flags.items() if k in params) + unused
            builds.setdefault(read, []).append(variant)
        for read, launched in builds.items():
            constants = {**{k: v for k, v in given.items() if k in params}, **dict(read)}
            registers, shared, stack = build(kernel, constants, warps, arch)
            out.append(dict(kernel=name, variants=launched, registers=registers, shared=shared, stack=stack,
                            warps=warps, programs_per_sm=programs_per_sm(registers, shared, warps, SM[arch])))
    return out


def parse_site(text: str, groups: int = 32) -> tuple[int, int, int, int]:
    """--site's N,C,H,W; ValueError saying what to write instead."""
    try:
        site = tuple(int(v) for v in text.split(","))
    except ValueError:
        site = ()
    if len(site) != 4 or min(site) < 1 or site[1] % groups:
        raise ValueError(f"--site {text}: give four positive integers N,C,H,W with C a multiple of the {groups} "
                         "groups, e.g. 1024,128,32,32")
    return site


def main(argv: list[str] | None = None) -> int:
    from ffcv_ddpm.norm import DEFAULT_PLAN, PLAN_HELP, parse_plan

    p = Parser(prog="python -m benchmarks.speed.kernel_regs", doc=__doc__,
               epilog="No --data and no KEY=VALUE overrides: the plan, the site and the architecture are the input.")
    p.add_argument("--plan", default="", help=PLAN_HELP)
    p.add_argument("--site", default="1024,128,32,32", help="N,C,H,W of the site the launch constants come from")
    p.add_argument("--arch", type=int, default=90, choices=tuple(SM),
                   help="compute capability without the dot (90: H100, H200; 80: A100)")
    args = p.parse_args(argv)
    try:
        plan = parse_plan(args.plan)
        site = parse_site(args.site)
    except ValueError as e:
        return fail("kernel_regs", str(e))
    print(f"kernel_regs: plan {plan} (default {DEFAULT_PLAN}), site {site}, sm_{args.arch}", file=sys.stderr)
    try:
        built = rows(plan, site, args.arch)
    except RuntimeError as e:
        return fail("kernel_regs", str(e))
    print("| kernel | variant | registers a thread | spilled (stack bytes a thread) | shared memory a program | "
          "programs an SM |")
    print("|---|---|---|---|---|---|")
    for r in built:
        print(f"| `{r['kernel']}` | {', '.join(r['variants'])} | {r['registers']} | {r['stack']} | "
              f"{r['shared'] // 1024} KB | {r['programs_per_sm']} ({r['programs_per_sm'] * r['warps']} warps) |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
