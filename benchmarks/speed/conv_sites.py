"""cuDNN's convolutions at the step's costliest-for-their-FLOPs sites, alone, and the reformulations that might run them
faster (issue 47; NOTES item 43).

    python -m benchmarks.speed.conv_sites --out DIR                      # torch's cuDNN search (10 engines)
    python -m benchmarks.speed.conv_sites --out DIR --benchmark-limit 0  # every engine cuDNN offers

The profile of today's preset (results/h200/profile-1f28a9b) shows three kinds of convolution far under the rate of
the others: the up path's 384-channel 3x3 (its data gradient at ~370 TFLOP/s where the 256-channel one runs ~760),
the output convolution (128 -> 8 padded channels) and the input one (8 padded -> 128 channels), both memory-bound
and several times their bytes' time. Each site's forward, data gradient (dgrad) and weight gradient (wgrad) is timed
alone with torch.backends.cudnn.benchmark on, bf16, channels_last, random data, as CUDA graphs of --iters calls
(clocks.graph_ms), beside the forms that could replace it: the 384-channel dgrad as two (the concatenation's parts,
256 + 128 channels), the padded channel counts of the edge convolutions, the input convolution's bias in the GEMM
(a channel of ones: its centre tap never reads the zero padding) against a bias pass of its own.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks.common import commit_text, md_table, write_json, write_text
from ffcv_ddpm.checks import Parser, at_least, fail, option

# (name, input channels, output channels, side): the sites of ddpm-cifar10 the profile flags, and two of its 3x3
# convolutions at cuDNN's usual rate for comparison.
SITES = (("up0-cat384", 384, 128, 32), ("up0-cat256", 256, 128, 32), ("res128", 128, 128, 32),
         ("out-pad8", 128, 8, 32), ("out-3", 128, 3, 32), ("out-pad16", 128, 16, 32),
         ("in-pad8", 8, 128, 32), ("in-3", 3, 128, 32), ("in-pad16", 16, 128, 32))


def _dgrad(dy, x, w):
    return torch.ops.aten.convolution_backward(dy, x, w, None, [1, 1], [1, 1], [1, 1], False, [0, 0], 1,
                                               [True, False, False])[0]


def _wgrad(dy, x, w):
    return torch.ops.aten.convolution_backward(dy, x, w, None, [1, 1], [1, 1], [1, 1], False, [0, 0], 1,
                                               [False, True, False])[1]


def site_cases(name: str, cin: int, cout: int, side: int, batch: int, device: str):
    """(case, fn, GFLOP) for one site: forward, dgrad, wgrad, and the site's alternative forms."""
    cl = torch.channels_last
    x = torch.randn(batch, cin, side, side, device=device, dtype=torch.bfloat16).to(memory_format=cl)
    w = (torch.randn(cout, cin, 3, 3, device=device, dtype=torch.bfloat16) / (9 * cin) ** 0.5).to(memory_format=cl)
    dy = torch.randn(batch, cout, side, side, device=device, dtype=torch.bfloat16).to(memory_format=cl)
    gflop = 2 * batch * side * side * cout * cin * 9 / 1e9
    cases = [("fwd", lambda: F.conv2d(x, w, None, 1, 1), gflop), ("dgrad", lambda: _dgrad(dy, x, w), gflop),
             ("wgrad", lambda: _wgrad(dy, x, w), gflop)]
    if name == "up0-cat384":  # the concatenation's parts (the upsampled 256 channels, the skip's 128) apart
        parts = [(x[:, :256].contiguous(memory_format=cl), w[:, :256].contiguous(memory_format=cl)),
                 (x[:, 256:].contiguous(memory_format=cl), w[:, 256:].contiguous(memory_format=cl))]
        cases.append(("dgrad as 256 + 128", lambda: [_dgrad(dy, xp, wp) for xp, wp in parts], gflop))
        cases.append(("wgrad as 256 + 128", lambda: [_wgrad(dy, xp, wp) for xp, wp in parts], gflop))
    if name.startswith("in-"):  # the bias: a pass of its own (eager conv2d's), or a channel of ones in the GEMM
        b = torch.randn(cout, device=device, dtype=torch.bfloat16)
        cases.append(("fwd + bias", lambda: F.conv2d(x, w, b, 1, 1), gflop))
        x1 = x.clone()
        x1[:, -1] = 1
        cases.append(("fwd, bias in a ones channel", lambda: F.conv2d(x1, w, None, 1, 1), gflop))
    return cases


def render(result: dict) -> str:
    rows = [[r["site"], r["case"], f"{r['ms']:.3f}", f"{r['tflops']:.0f}"] for r in result["rows"]]
    return "\n".join([f"# cuDNN at the step's edge sites ({result['device_name'] or 'CPU'})", "",
                      f"`{result['command']}`", "",
                      f"commit {commit_text(result['environment'])}, torch {result['environment'].get('torch')}; "
                      f"batch {result['batch']}, bf16, channels_last, cudnn.benchmark with benchmark_limit "
                      f"{result['benchmark_limit']}; {result['iters']} calls a timing.", "",
                      *md_table(["site", "case", "ms", "TFLOP/s"], rows)]) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = Parser(prog="python -m benchmarks.speed.conv_sites", doc=__doc__,
               epilog="No --data and no KEY=VALUE overrides: the sites are the whole input.")
    p.add_argument("--out", type=Path, required=True, help="folder for conv_sites.json and .md")
    p.add_argument("--batch", type=option(int, at_least(1)), default=1024, help="images a call (default 1024)")
    p.add_argument("--iters", type=option(int, at_least(1)), default=20, help="calls a timing")
    p.add_argument("--benchmark-limit", type=option(int, at_least(0)), default=10,
                   help="torch.backends.cudnn.benchmark_limit: engines cuDNN's search tries (0: all; torch's 10)")
    p.add_argument("--sites", default=",".join(s[0] for s in SITES), help="comma-separated site names")
    args = p.parse_args(argv)
    known = {s[0]: s for s in SITES}
    chosen = [s.strip() for s in args.sites.split(",") if s.strip()]
    if not chosen or any(s not in known for s in chosen):
        return fail("conv_sites", f"--sites {args.sites!r}: name sites among {', '.join(known)}")
    from benchmarks.speed.clocks import clock_ms
    from ffcv_ddpm.env import environment

    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    torch.backends.cudnn.benchmark = True
    torch.backends.cudnn.benchmark_limit = args.benchmark_limit
    result = {"command": " ".join(["python -m benchmarks.speed.conv_sites", *(sys.argv[1:] if argv is None else argv)]),
              "environment": environment(), "device_name": torch.cuda.get_device_name() if cuda else None,
              "batch": args.batch, "iters": args.iters, "benchmark_limit": args.benchmark_limit, "rows": []}
    args.out.mkdir(parents=True, exist_ok=True)
    for name in chosen:
        for case, fn, gflop in site_cases(*known[name], args.batch, device):
            ms = clock_ms(fn, cuda, args.iters)
            result["rows"].append({"site": name, "case": case, "ms": ms, "tflops": gflop / ms})
            print(f"conv_sites: {name:11s} {case:28s} {ms:8.3f} ms  {gflop / ms:6.0f} TFLOP/s", flush=True)
            write_json(args.out / "conv_sites.json", result)  # after every row: a cut call keeps what it measured
    write_text(args.out / "conv_sites.md", render(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
