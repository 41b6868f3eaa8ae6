"""The 3x3 convolutions' data gradient, CUTLASS's against cuDNN's, per site (NOTES 48: the dgrad whose epilogue
would take the backward reduction's sums of the GroupNorm before the convolution).

    python -m ffcv_ddpm.conv_cutlass                                   # build the library (here, with nvcc)
    python -m benchmarks.speed.conv_dgrad --out DIR                    # CUDA, sm90: every dgrad config per site

Per stride-1 site of the network (conv_gn_bench's sites, the costliest first): cuDNN's dgrad as the step runs it
(aten.convolution_backward for dx alone, cuDNN's search on), and each CUTLASS dgrad config, checked against the fp32
transposed convolution; each one CUDA graph of --iters calls. Where a GroupNorm + SiLU produced the convolution's
input, the pass its backward reduction makes over x and dx (2 passes of dx's bytes, at the copy rate of that size) is
what an epilogue taking the reduction's sums would remove: the `passes` column, against which a CUTLASS dgrad's time
over cuDNN's is read. There, too, the dgrad config whose epilogue takes those sums (EPI_ACT_SUMS:
conv_cutlass.conv3x3_dgrad_sums, on random GroupNorm inputs and coefficients; its sums checked against act_sums on
its own dx): its time against the plain dgrad's plus the passes is what it would save (the passes at the copy rate,
under the reduction kernel's own time: NOTES 44 measured it at 63-75% of that rate). Writes conv_dgrad.json and .md
under --out after every site.
"""

from __future__ import annotations

import re
import sys
import time

import torch
import torch.nn.functional as F
from torch import Tensor

from benchmarks.common import commit_text, write_json, write_text
from benchmarks.speed.conv_tma import rel_error
from ffcv_ddpm import conv_cutlass
from ffcv_ddpm.checks import fail


def cudnn_dgrad(dy: Tensor, x: Tensor, w: Tensor) -> Tensor:
    """dx of F.conv2d(x, w, padding=1) as autograd asks cuDNN for it (x gives the shape and layout only)."""
    return torch.ops.aten.convolution_backward(dy, x, w, None, [1, 1], [1, 1], [1, 1], False, [0, 0], 1,
                                               [True, False, False])[0]


def site_row(spec, count: int, batch: int, configs, iters: int, copy_gbs) -> dict:
    """One site: cuDNN's dgrad and each config's (error against fp32, ms a call), the reduction's passes."""
    from benchmarks.speed.clocks import graph_ms

    g = torch.Generator(device="cuda").manual_seed(0)
    cl = torch.channels_last
    dy = torch.randn(batch, spec.cout, spec.h, spec.h, device="cuda", generator=g).bfloat16().to(memory_format=cl)
    x = torch.empty(batch, spec.cin, spec.h, spec.h, device="cuda", dtype=torch.bfloat16, memory_format=cl)
    w = (torch.randn(spec.cout, spec.cin, 3, 3, device="cuda", generator=g) * (9 * spec.cout) ** -0.5).bfloat16()
    w = w.to(memory_format=cl)
    ref = F.conv_transpose2d(dy.float(), w.float(), padding=1)
    entry = {"name": spec.name(), "count": count, "flop": spec.flops(batch),
             "cudnn_ms": graph_ms(lambda: cudnn_dgrad(dy, x, w), iters, warmup=2),
             "cudnn_err": rel_error(cudnn_dgrad(dy, x, w), ref), "rows": []}
    if spec.norm:  # the GroupNorm backward's reduction reads x and dx: 2 passes of dx's bytes
        nbytes = 2 * batch * spec.cin * spec.h ** 2
        entry["passes_ms"] = 2 * nbytes / copy_gbs(nbytes) / 1e6
    act = None  # the activation's operands where a GroupNorm made the input and its tiles lie in one sample
    drop, keep = {}, {}  # with its dropout: the kernel's arguments, the reference's mask
    if spec.norm and spec.h ** 2 % conv_cutlass.TILE_M == 0 and spec.cin % 128 == 0:
        xg = torch.randn(batch, spec.cin, spec.h, spec.h, device="cuda", generator=g).bfloat16().to(memory_format=cl)
        u = 1 + 0.3 * torch.randn(batch, spec.cin, device="cuda", generator=g)
        coef = torch.stack([u, 0.5 * torch.randn(batch, spec.cin, device="cuda", generator=g)], 1).contiguous()
        act = (xg, coef)
        if spec.p:  # the GroupNorm's dropout, replayed from a seed as the preset draws it (norm_pair_hash)
            from ffcv_ddpm import norm

            seed = torch.randint(0, 2**31 - 1, (1,), device="cuda", generator=g)
            thr, inv_keep = norm._dropout_args(spec.p, True)
            drop = dict(seed=seed, thr=thr, inv_keep=inv_keep, pair=True)
            keep = dict(keep=norm.keep_mask(seed.cpu(), tuple(xg.shape), spec.p, True), inv_keep=inv_keep)
    # the act-sums configs with the site's SiLU (2: the preset's, norm_fast_silu), and with none as well, which
    # times the epilogue without SiLU's derivative (its tanh.approx and arithmetic)
    silus = (2, 0) if spec.silu else (0,)
    runs = [(c, None) for c in configs if not c.epilogue & conv_cutlass.EPI_ACT_SUMS]
    for c in configs:  # the bare config (conv_cutlass.BARE): its data movement alone, its sums without SiLU or mask
        if c.epilogue & conv_cutlass.EPI_ACT_SUMS and act is not None:
            runs += [(c, 0)] if c.name.endswith(conv_cutlass.BARE) else [(c, s) for s in silus]
    for config, silu in runs:
        row = {"config": config.name}
        sums = silu is not None
        try:
            if sums:
                row["silu"] = silu
                operands = (*act, silu)
                bare = config.name.endswith(conv_cutlass.BARE)
                mask, ref_mask = ({}, {}) if bare else (drop, keep)
                dx, out = conv_cutlass.conv3x3_dgrad_sums(dy, w, config, *operands, **mask)
                row["rel_err"] = rel_error(dx, ref)
                row["sums_err"] = max(rel_error(s, r) for s, r in
                                      zip(out, conv_cutlass.act_sums(dx, *operands, **ref_mask)))
                row["ms"] = graph_ms(lambda: conv_cutlass.conv3x3_dgrad_sums(dy, w, config, *operands, **mask),
                                     iters, warmup=2)
            else:
                row["rel_err"] = max(rel_error(conv_cutlass.conv3x3_dgrad(dy, w, config), ref) for _ in range(3))
                row["ms"] = graph_ms(lambda: conv_cutlass.conv3x3_dgrad(dy, w, config), iters, warmup=2)
        except Exception as e:  # noqa: BLE001 - a config that cannot run a shape is a row with its error
            row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        (entry.setdefault("act_sums", []) if sums else entry["rows"]).append(row)
    good = [r for r in entry["rows"] if "ms" in r and r["rel_err"] <= 2e-2]
    if good:
        entry["best"] = min(good, key=lambda r: r["ms"])
    fused = [r for r in entry.get("act_sums", []) if "ms" in r and r["rel_err"] <= 2e-2 and r["sums_err"] <= 1e-2
             and r["silu"] == silus[0] and not r["config"].endswith(conv_cutlass.BARE)]  # the site's own SiLU
    if fused and good and "passes_ms" in entry:  # what the epilogue saves: the plain dgrad and the passes it takes
        entry["fused"] = min(fused, key=lambda r: r["ms"])
        entry["fused"]["saved_ms"] = entry["best"]["ms"] + entry["passes_ms"] - entry["fused"]["ms"]
    return entry


def render(result: dict) -> str:
    lines = [f"# CUTLASS's 3x3 dgrad against cuDNN's ({result.get('device_name')})", "",
             f"`{result['command']}`", "",
             f"commit {commit_text(result['environment'])}, torch {result['environment'].get('torch')}, "
             f"{result.get('library')}; batch {result['batch']}, bf16, channels_last, stride 1, fp32 accumulation; "
             "ms a call, CUDA-graph replays; the fastest config a site among those within 2e-2 of fp32 (the json "
             "has every config).", "",
             "| site | a step | cuDNN ms (TFLOP/s) | CUTLASS ms (TFLOP/s) | config | the reduction's passes ms | "
             "dgrad + act sums ms | saved ms |",
             "|---|---|---|---|---|---|---|---|"]
    tot = [0.0, 0.0, 0.0, 0.0]  # a step, over the sites with a correct config: cuDNN, CUTLASS, the passes, saved
    for s in result["sites"]:
        best = s.get("best")
        cells = [s["name"], str(s["count"]), f"{s['cudnn_ms']:.3f} ({s['flop'] / s['cudnn_ms'] / 1e9:.0f})"]
        if best:
            cells += [f"{best['ms']:.3f} ({s['flop'] / best['ms'] / 1e9:.0f})", best["config"]]
            tot[0] += s["count"] * s["cudnn_ms"]
            tot[1] += s["count"] * best["ms"]
            tot[2] += s["count"] * s.get("passes_ms", 0.0)
        else:
            errors = "; ".join(r["error"] if "error" in r else f"wrong ({r['rel_err']:.2g})" for r in s["rows"])
            cells += ["-", ("no correct config: " + errors)[:120].replace("|", "/")]
        cells.append(f"{s['passes_ms']:.3f}" if "passes_ms" in s else "-")
        fused = s.get("fused")
        if fused:
            tot[3] += s["count"] * fused["saved_ms"]
            extra = []  # the same epilogue without SiLU's derivative, and the bare config's data movement alone
            for r in s["act_sums"]:
                if "ms" not in r or (r["config"], r.get("silu")) == (fused["config"], fused.get("silu")):
                    continue
                if r["config"].endswith(conv_cutlass.BARE):
                    extra.append(f"bare: {r['ms']:.3f}")
                elif r.get("silu") == 0:
                    extra.insert(0, f"no SiLU: {r['ms']:.3f}")
            cells += [f"{fused['ms']:.3f}" + (f" ({', '.join(extra)})" if extra else ""), f"{fused['saved_ms']:+.3f}"]
        else:
            wrong = [r for r in s.get("act_sums", []) if "error" in r or r["rel_err"] > 2e-2 or r["sums_err"] > 1e-2]
            cells += ["-" if not wrong else ("wrong: " + "; ".join(
                r.get("error") or f"dx {r['rel_err']:.2g}, sums {r['sums_err']:.2g}" for r in wrong))[:100]
                .replace("|", "/"), "-"]
        lines.append("| " + " | ".join(cells) + " |")
    if tot[0]:
        lines += ["", f"A step, over the sites with a correct config: cuDNN {tot[0]:.2f} ms, CUTLASS {tot[1]:.2f} ms "
                      f"({tot[0] / tot[1]:.3f}x cuDNN's rate); the backward reduction's passes at the sites a "
                      f"GroupNorm feeds: {tot[2]:.2f} ms, what an epilogue with its sums could remove."]
        if any("act_sums" in s for s in result["sites"]):
            lines.append(f"The dgrad with the sums in its epilogue, where it applies (a GroupNorm's output, 128-pixel "
                         f"tiles in one sample; its dropout replayed where it had one): {tot[3]:+.2f} ms a step saved "
                         f"against the plain dgrad and the passes (negative: it costs; the passes at the copy rate).")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    from benchmarks.speed.conv_gn_bench import site_parser

    p = site_parser("conv_dgrad", __doc__)
    p.add_argument("--cutlass-match", default="", metavar="REGEX",
                   help="only the dgrad configs whose name matches (re.search; default: every one)")
    args, overrides = p.parse_with_overrides(argv)
    from ffcv_ddpm.config import load_config

    try:
        cfg = load_config(args.preset, ["data.batch_size=1024", *overrides])
    except ValueError as e:
        return fail("conv_dgrad", str(e))
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        return fail("conv_dgrad", "needs an sm90 GPU (H100, H200): the kernels are built for sm_90a")
    try:
        configs = [c for c in conv_cutlass.configs()
                   if c.op == conv_cutlass.OP_DGRAD and re.search(args.cutlass_match, c.name)]
    except RuntimeError as e:
        return fail("conv_dgrad", str(e))
    if not configs:
        return fail("conv_dgrad", f"no dgrad config matches {args.cutlass_match!r}")
    from benchmarks.speed.conv_gn_bench import sites_by_cost
    from benchmarks.speed.copy_rate import copy_gb_per_s
    from ffcv_ddpm.env import environment

    torch.backends.cudnn.benchmark = True  # cuDNN's dgrad as the step runs it
    batch = cfg.data.batch_size
    # the input convolution's 8 padded channels are no dgrad the step runs (its input needs no gradient)
    sites = [(s, c) for s, c in sites_by_cost(cfg.model, batch) if s.stride == 1 and s.cin % 64 == 0][:args.sites]
    result = {"command": "python -m benchmarks.speed.conv_dgrad " + " ".join(sys.argv[1:] if argv is None else argv),
              "environment": environment(), "device_name": torch.cuda.get_device_name(), "batch": batch,
              "library": conv_cutlass.library_path().name, "sites": []}
    rates: dict[int, float] = {}

    def copy_gbs(nbytes: int) -> float:  # the copy rate at this size (item 36: it depends on the size)
        if nbytes not in rates:
            rates[nbytes] = copy_gb_per_s(nbytes, iters=args.iters)
        return rates[nbytes]

    args.out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    for spec, count in sites:
        entry = site_row(spec, count, batch, configs, args.iters, copy_gbs)
        result["sites"].append(entry)
        write_json(args.out / "conv_dgrad.json", result)
        write_text(args.out / "conv_dgrad.md", render(result))
        best = entry.get("best")
        print(f"conv_dgrad: [{time.time() - t0:.0f} s] {entry['name']}: cuDNN {entry['cudnn_ms']:.3f} ms; "
              + (f"{best['config']} {best['ms']:.3f} ms" if best else "no correct config"), flush=True)
        torch.cuda.empty_cache()
    print(render(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
