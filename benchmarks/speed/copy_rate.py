"""How fast a device-to-device copy streams, by size: the rate the benchmarks price a memory pass at (NOTES item 36).

    python -m benchmarks.speed.copy_rate --out DIR                          # CUDA: 8 MiB to 2 GiB
    python -m benchmarks.speed.copy_rate --out DIR --mib 128,1024 --footprint-gib 60   # beside 60 GiB held

One bf16 `copy_` into a tensor allocated beforehand, bytes read + written per second. On CUDA --iters copies are
captured as one CUDA graph and replayed (clocks.graph_ms: the kernels alone, clocks settled); on the CPU the
median of --iters timed copies. The rate depends on the size: one H200 streamed 4.1-4.2 TB/s at 128 MB and 2.77 at
1 GiB in one process (eee22f5), so a pass is priced at the copy rate of its own size (floors per GroupNorm site,
conv_tma per convolution site), not at one size for all. --footprint-gib holds that much memory allocated (and
written) during the sweep, as a training step holds its activations, in case the rate depends on what else is
mapped.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from benchmarks.common import commit_text, md_table, write_json, write_text
from ffcv_ddpm.checks import Parser, at_least, fail, option

SIZES_MIB = (8, 32, 64, 128, 256, 384, 512, 768, 1024, 2048)


def copy_gb_per_s(nbytes: int, device: str = "cuda", iters: int = 10) -> float:
    """The rate a copy of `nbytes` streams at, bytes read + written per second, in GB/s."""
    from benchmarks.speed.clocks import clock_ms

    n = max(1, nbytes // 2)
    src = torch.empty(n, device=device, dtype=torch.bfloat16).normal_()  # never all zeros
    dst = torch.empty_like(src)
    return 2 * n * 2 / clock_ms(lambda: dst.copy_(src), device == "cuda", iters) / 1e6


def render(result: dict) -> str:
    rows = [[f"{r['mib']:,}", f"{r['gb_per_s']:,.0f}"] for r in result["rows"]]
    return "\n".join([f"# Copy rate by size ({result['device_name'] or 'CPU'})", "",
                      f"`{result['command']}`", "",
                      f"commit {commit_text(result['environment'])}, torch {result['environment'].get('torch')}; "
                      f"bf16 `copy_`, {result['iters']} copies a timing, {result['footprint_gib']} GiB held beside "
                      "(allocated and written) during the sweep.", "",
                      *md_table(["MiB copied", "GB/s (read + write)"], rows)]) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = Parser(prog="python -m benchmarks.speed.copy_rate", doc=__doc__,
               epilog="No --data and no KEY=VALUE overrides: the sizes are the whole input.")
    p.add_argument("--out", type=Path, required=True, help="folder for copy_rate.json and .md")
    p.add_argument("--mib", default=",".join(map(str, SIZES_MIB)), help="comma-separated sizes, MiB")
    p.add_argument("--iters", type=option(int, at_least(1)), default=10, help="copies a timing")
    p.add_argument("--footprint-gib", type=option(float, at_least(0)), default=0.0,
                   help="GiB held allocated during the sweep (default 0)")
    args = p.parse_args(argv)
    try:
        sizes = [int(s) for s in args.mib.split(",") if s.strip()]
        assert sizes and min(sizes) >= 1
    except (ValueError, AssertionError):
        return fail("copy_rate", f"--mib {args.mib!r}: expected comma-separated whole MiB >= 1, e.g. 128,1024")
    p.check_paths(outputs=[("--out", args.out)])
    from ffcv_ddpm.env import environment

    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    held = torch.ones(int(args.footprint_gib * 2**30) // 2, device=device, dtype=torch.bfloat16)  # noqa: F841
    result = {"command": "python -m benchmarks.speed.copy_rate " + " ".join(sys.argv[1:] if argv is None else argv),
              "environment": environment(), "device_name": torch.cuda.get_device_name() if cuda else None,
              "iters": args.iters, "footprint_gib": args.footprint_gib, "rows": []}
    args.out.mkdir(parents=True, exist_ok=True)
    for mib in sizes:
        result["rows"].append({"mib": mib, "gb_per_s": copy_gb_per_s(mib << 20, device, args.iters)})
        write_json(args.out / "copy_rate.json", result)  # after every row: a cut call keeps what it measured
        print(f"copy_rate: {mib:,} MiB: {result['rows'][-1]['gb_per_s']:,.0f} GB/s", flush=True)
        if cuda:
            torch.cuda.empty_cache()
    write_text(args.out / "copy_rate.md", render(result))
    print(render(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
