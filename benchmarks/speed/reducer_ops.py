"""The operators that averaging the gradients adds to a step: DDP's reducer against the flat all-reduce.

    python -m benchmarks.speed.reducer_ops --out benchmarks/results/cpu/reducer-ops       # 2 gloo ranks, any machine
    python -m benchmarks.speed.reducer_ops --device cuda --out /tmp/ops                    # 2 GPUs, NCCL; kernels too
    python -m benchmarks.speed.reducer_ops --preset tiny --out /tmp/ops model.image_size=8   # seconds, for the tests

Two ranks run one backward of the preset's model (batch 1, channels_last, .grad set to None first, as the trainer's
optimizer leaves it) and the averaging, rank 0 under torch.profiler: once with `train.ddp_reduce=ddp`
(DistributedDataParallel as the trainer wraps it: train.ddp_bucket_mb, gradient_as_bucket_view) and once with `flat`
(ffcv_ddpm.flat_allreduce), each built by ffcv_ddpm.step.data_parallel. Counted per aten operator (and per GPU
kernel with --device cuda); the backward is the same in both, so the difference is the averaging's own
(benchmarks/NOTES.md item 19). Counts, not times: on a CPU they say what a GPU step would launch.
"""

from __future__ import annotations

import collections
import contextlib
import sys
import tempfile
from pathlib import Path

from benchmarks.common import results_dir, write_json, write_text
from ffcv_ddpm.checks import Parser, fail

MODES = ("ddp", "flat")


def _worker(rank: int, store: str, preset: str, overrides: list, device_type: str, results) -> None:
    import torch
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile

    from ffcv_ddpm.config import load_config
    from ffcv_ddpm.step import data_parallel
    from ffcv_ddpm.unet import build_model

    cuda = device_type == "cuda"
    if cuda:
        torch.cuda.set_device(rank)
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]
    out = {}
    for mode in MODES:
        cfg = load_config(preset, [*overrides, f"train.ddp_reduce={mode}"])
        torch.manual_seed(0)
        model = build_model(cfg.model).to(device, memory_format=torch.channels_last)
        params = [p for p in model.parameters() if p.requires_grad]
        net, reduce = data_parallel(model, device, cfg)  # what the trainer builds for this mode
        g = torch.Generator(device=device).manual_seed(rank)
        x = torch.randn(1, cfg.model.in_channels, cfg.model.image_size, cfg.model.image_size, device=device,
                        generator=g).to(memory_format=torch.channels_last)
        t = torch.randint(0, 1000, (1,), device=device, generator=g)
        labels = [torch.zeros(1, dtype=torch.long, device=device)] if cfg.model.num_classes > 0 else []
        for i in range(3):  # the third is counted: DDP rebuilds its buckets after the first
            for p in params:
                p.grad = None
            loss = net(x, t, *labels).square().mean()
            with profile(activities=activities) if i == 2 else contextlib.nullcontext() as prof:
                loss.backward()
                if reduce is not None:
                    reduce()
                if cuda:
                    torch.cuda.synchronize()
        ops = collections.Counter(e.name for e in prof.events() if e.device_type.name == "CPU"
                                  and e.name.startswith("aten::"))
        kernels = collections.Counter(e.name for e in prof.events() if e.device_type.name == "CUDA")
        out[mode] = {"aten_ops": dict(ops), "gpu_kernels": dict(kernels), "params": len(params)}
        del net, reduce, model
    if rank == 0:
        results.update(out)
    dist.destroy_process_group()


def count(preset: str, overrides: list[str], device_type: str) -> dict:
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        results = mp.Manager().dict()
        mp.spawn(_worker, args=(f"{tmp}/store", preset, overrides, device_type, results), nprocs=2)
        return dict(results)


def difference(a: dict, b: dict) -> dict:
    """a - b per name, the names that differ, largest first."""
    d = {k: a.get(k, 0) - b.get(k, 0) for k in set(a) | set(b)}
    return dict(sorted(((k, v) for k, v in d.items() if v), key=lambda kv: (-abs(kv[1]), kv[0])))


def render(result: dict) -> str:
    lines = [f"# Operators the averaging adds: DDP's reducer against the flat all-reduce ({result['preset']}, "
             f"{result['params']} parameters, 2 ranks, {result['device']})", "",
             f"- commit {result['environment'].get('commit')}, torch {result['environment'].get('torch')}; "
             f"command: `{result['command']}`", "",
             "| operator | ddp | flat | ddp - flat |", "|---|---|---|---|"]
    for kind in ("aten_ops", "gpu_kernels"):
        diff = result["ddp_minus_flat"][kind]
        for name, d in list(diff.items())[:15]:
            lines.append(f"| {name} | {result['counts']['ddp'][kind].get(name, 0)} | "
                         f"{result['counts']['flat'][kind].get(name, 0)} | {d:+d} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = Parser(prog="python -m benchmarks.speed.reducer_ops", doc=__doc__, overrides=True,
               epilog="No --data: the inputs are random tensors at the preset's image size.")
    p.add_argument("--preset", default="ddpm-cifar10")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="cpu: gloo; cuda: NCCL on 2 GPUs")
    p.add_argument("--out", type=Path, help="folder for reducer_ops.json and .md (default: "
                                            "benchmarks/results/<card or cpu>/reducer-ops)")
    args, overrides = p.parse_with_overrides(argv)
    import torch

    from ffcv_ddpm.config import load_config
    from ffcv_ddpm.env import environment

    try:
        load_config(args.preset, overrides)
    except ValueError as e:
        return fail("reducer_ops", str(e))
    if args.device == "cuda" and torch.cuda.device_count() < 2:
        return fail("reducer_ops", f"--device cuda needs 2 GPUs, this machine has {torch.cuda.device_count()}")
    out = args.out or results_dir(torch.cuda.get_device_name(0) if args.device == "cuda" else None) / "reducer-ops"
    counts = count(args.preset, overrides, args.device)
    result = {"preset": args.preset, "device": args.device, "params": counts["ddp"]["params"],
              "overrides": overrides,
              "command": "python -m benchmarks.speed.reducer_ops " + " ".join(sys.argv[1:] if argv is None else argv),
              "environment": environment(), "counts": counts,
              "ddp_minus_flat": {k: difference(counts["ddp"][k], counts["flat"][k])
                                 for k in ("aten_ops", "gpu_kernels")}}
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "reducer_ops.json", result, indent=1)
    write_text(out / "reducer_ops.md", render(result))
    print(render(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
