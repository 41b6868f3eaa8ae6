"""Inductor's own Triton convolution templates (`max-autotune`) against cuDNN, per 3x3 convolution shape (issue 47).

    python -m benchmarks.speed.conv_autotune --out DIR                  # CUDA: every distinct 3x3 shape, batch 1024
    python -m benchmarks.speed.conv_autotune --out DIR --budget-s 300   # stop starting shapes after 300 s

The DDPM table's row 11 (`max-autotune` for the whole step) never finished inside one GPU call: autotuning every
convolution and matmul of the step at once takes longer than a call. This measures the convolutions alone, one
distinct shape at a time (the sites of benchmarks.speed.conv_gn_bench, deduplicated by what a plain convolution
sees: input channels, output channels, size, stride), forward, bf16, channels_last, at the step's batch:

- cuDNN: F.conv2d with cudnn.benchmark on, as the step runs it;
- Inductor: the same call compiled with max_autotune and the convolution backends limited to Triton's templates
  (`max_autotune_conv_backends="TRITON"`), so the time is the template's, not cuDNN's through inductor.

Both timed as CUDA graphs of --iters calls (clocks.graph_ms). The compile seconds of each shape are recorded:
Inductor's autotune results and kernels live in its cache folder (TORCHINDUCTOR_CACHE_DIR; on the GPU machine point
it at a folder outside $OUT, e.g. /tmp/inductor-cache), so a second call on the same warm machine measures what a
persistent cache buys. conv_autotune.json and .md are rewritten after every shape, heaviest a step first.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks.common import commit_text, md_table, write_json, write_text
from ffcv_ddpm.checks import Parser, at_least, fail, option


def shapes_of(sites) -> list[dict]:
    """Distinct (cin, cout, h, stride) of the recorded sites, with the convolutions a step each accounts for."""
    out: dict[tuple, int] = {}
    for site, count in sites:
        key = (site.cin, site.cout, site.h, site.stride)
        out[key] = out.get(key, 0) + count
    return [{"cin": k[0], "cout": k[1], "h": k[2], "stride": k[3], "count": c} for k, c in out.items()]


def gflop(shape: dict, batch: int) -> float:
    ho = shape["h"] // shape["stride"]
    return 2 * batch * ho * ho * shape["cout"] * shape["cin"] * 9 / 1e9


def measure(shape: dict, batch: int, iters: int) -> dict:
    from benchmarks.speed.clocks import graph_ms

    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(batch, shape["cin"], shape["h"], shape["h"], device="cuda", generator=gen, dtype=torch.bfloat16)
    x = x.contiguous(memory_format=torch.channels_last)
    w = (torch.randn(shape["cout"], shape["cin"], 3, 3, device="cuda", generator=gen, dtype=torch.bfloat16)
         / (9 * shape["cin"]) ** 0.5).contiguous(memory_format=torch.channels_last)
    stride = shape["stride"]

    def conv(x, w):
        return F.conv2d(x, w, stride=stride, padding=1)

    ref = conv(x, w)
    row = {"cudnn_ms": graph_ms(lambda: conv(x, w), iters, warmup=3)}
    torch._dynamo.reset()
    with torch._inductor.config.patch(max_autotune=True, max_autotune_conv_backends="TRITON"):
        compiled = torch.compile(conv, dynamic=False)
        t0 = time.time()
        out = compiled(x, w)
        torch.cuda.synchronize()
        row["compile_s"] = time.time() - t0
    row["rel_err"] = float((out.float() - ref.float()).norm() / ref.float().norm())
    row["inductor_ms"] = graph_ms(lambda: compiled(x, w), iters, warmup=3)
    return row


def render(result: dict) -> str:
    done = [r for r in result["rows"] if "cudnn_ms" in r]
    per_step = {k: sum(r[k] * r["count"] for r in done) for k in ("cudnn_ms", "inductor_ms")}
    rows = [[f"{r['cin']}->{r['cout']} {r['h']}x{r['h']}/s{r['stride']}", str(r["count"]), f"{r['gflop']:.0f}",
             f"{r['gflop'] / r['cudnn_ms']:.0f}", f"{r['gflop'] / r['inductor_ms']:.0f}",
             f"{r['inductor_ms'] / r['cudnn_ms']:.2f}", f"{r['compile_s']:.1f}", f"{r['rel_err']:.1e}"] for r in done]
    return "\n".join([
        f"# Inductor's Triton convolution templates against cuDNN: {result['preset']}, batch {result['batch']} - "
        f"{result['device_name']}", "",
        f"- {commit_text(result['environment'])}, torch {result['environment']['torch']}; command: "
        f"`{result['command']}`; TORCHINDUCTOR_CACHE_DIR={result['cache_dir']}",
        f"- {len(done)} of {len(result['rows'])} distinct shapes measured; at these, cuDNN {per_step['cudnn_ms']:.2f} ms "
        f"a step forward, Inductor's templates {per_step['inductor_ms']:.2f} ms", "",
        "TFLOP/s: the convolution's FLOPs over its time (a CUDA graph of the calls). compile s: the first call of the "
        "compiled function (autotuning included, or read from the cache). err: against cuDNN.", "",
        *md_table(["shape", "per step", "GFLOP", "cuDNN TFLOP/s", "Inductor TFLOP/s", "Inductor / cuDNN time",
                   "compile s", "err"], rows), ""])


def main(argv: list[str] | None = None) -> int:
    p = Parser(prog="python -m benchmarks.speed.conv_autotune", doc=__doc__, overrides=True,
               epilog="Overrides: data.batch_size (default 1024) and model.* configure the network the shapes come "
                      "from.")
    p.add_argument("--out", type=Path, required=True, help="folder for conv_autotune.json and .md")
    p.add_argument("--preset", default="ddpm-cifar10")
    p.add_argument("--iters", type=option(int, at_least(1)), default=10, help="calls per captured graph")
    p.add_argument("--budget-s", type=option(float, at_least(1)), default=420,
                   help="no shape is started after this many seconds (the rest are listed, unmeasured)")
    args, overrides = p.parse_with_overrides(argv)
    from benchmarks.speed.conv_gn_bench import record_sites
    from ffcv_ddpm.config import load_config
    from ffcv_ddpm.env import environment

    try:
        cfg = load_config(args.preset, ["data.batch_size=1024", *overrides])
    except ValueError as e:
        return fail("conv_autotune", str(e))
    if not torch.cuda.is_available():
        return fail("conv_autotune", "needs a CUDA GPU: Inductor's convolution templates are Triton kernels for CUDA")
    batch = cfg.data.batch_size
    shapes = sorted(shapes_of(record_sites(cfg.model)), key=lambda s: -gflop(s, batch) * s["count"])
    torch.backends.cudnn.benchmark = True
    args.out.mkdir(parents=True, exist_ok=True)
    result = {"benchmark": "conv_autotune", "preset": args.preset, "overrides": overrides, "batch": batch,
              "device_name": torch.cuda.get_device_name(),
              "command": "python -m benchmarks.speed.conv_autotune " + " ".join(sys.argv[1:] if argv is None else argv),
              "environment": environment(), "cache_dir": os.environ.get("TORCHINDUCTOR_CACHE_DIR", "(default)"),
              "settings": {"iters": args.iters, "budget_s": args.budget_s},
              "rows": [{**s, "gflop": gflop(s, batch)} for s in shapes]}
    t0 = time.time()
    for i, row in enumerate(result["rows"]):
        if time.time() - t0 > args.budget_s:
            print(f"conv_autotune: budget of {args.budget_s:.0f} s spent; {len(shapes) - i} shapes left unmeasured")
            break
        try:
            row.update(measure(row, batch, args.iters))
        except Exception as e:  # one shape's failure (an autotune error) is its row's, not the table's
            row["error"] = f"{type(e).__name__}: {e}"[:500]
        torch.cuda.empty_cache()
        write_json(args.out / "conv_autotune.json", result)
        write_text(args.out / "conv_autotune.md", render(result))
        print(f"conv_autotune: [{time.time() - t0:.0f} s] {row['cin']}->{row['cout']} {row['h']}/s{row['stride']}: "
              + (row["error"] if "error" in row else
                 f"cuDNN {row['cudnn_ms']:.3f} ms, Inductor {row['inductor_ms']:.3f} ms "
                 f"(compile {row['compile_s']:.1f} s), err {row['rel_err']:.1e}"), flush=True)
    print(render(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
