"""`make bench`: the training-step table (the published MFU table's rows, then ours), each row in a fresh process.

    python -m benchmarks.bench --data data               # CUDA: both models; no CUDA: the CPU-sized 'quick' table
    python -m benchmarks.bench --data data --table small --measure-peak --sampling
    python -m benchmarks.bench --list --table both               # print the rows and their overrides, run nothing
    python -m benchmarks.bench --data data --table loaders-e2e   # end to end per loader, both models (issue 6)

A row is a RunConfig (`load_config(preset, overrides)`) plus a batch rule. For each row a child process builds the
trainer and loader, runs the first step (compilation: reported as seconds to first step, not timed), `--warmup`
more steps, then times `--iters` steps with timing.timed_steps: CUDA events per iteration, the wait for the next batch inside
each iteration, one sync at the end. Results (raw per-iteration times, environment, full configs, dataset source)
go to benchmarks/results/<card>/<table>.json, with the Markdown table and PNG chart beside it (benchmarks.report).

Why a fresh process per row: every row then starts from the same state -- an empty CUDA caching allocator (so peak
memory and "largest batch that fits" are the row's own), no compiled graphs or autotuning caches from earlier rows,
default backend flags -- and one row's OOM or crash cannot poison the next. Freeing in-process (dynamo reset, gc,
empty_cache) leaves allocator fragmentation and global state behind and is hard to prove clean. The cost is a few
seconds of process start per row, outside the timed region.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from dataclasses import dataclass
from pathlib import Path

from ffcv_ddpm.checks import Parser, above, at_least, matches, option

REPO = Path(__file__).resolve().parent.parent
BETON = "cifar10_train_raw.beton"  # what tools.make_dataset writes; the raw (uint8) train split
JPEG_BETON = "cifar10_train_jpg.beton"  # the same split, JPEG-encoded
PNG_TRAIN = Path("png") / "train"  # where `make dataset ... --export-png DATA/png` puts the Kaggle-layout folder

# ---------------------------------------------------------------------------------------------------- the rows


@dataclass(frozen=True)
class Row:
    name: str  # what the row adds, as shown in the table
    preset: str  # model preset (ffcv_ddpm.unet.PRESETS); rows of one preset form one table section
    overrides: tuple[str, ...]  # load_config overrides, complete (not relative to another row)
    batch: int | str  # images per step: a number, "max" (largest that fits, probed), or an earlier row's name
    baseline: bool = False  # speedups in this preset's section are relative to this row


# The published table's starting point: true fp32 (no TF32), eager, explicit matmul-softmax attention, NCHW, the
# default (foreach) AdamW, flips done in the loader's worker processes as torchvision transforms do, nn.GroupNorm.
BASELINE = (
    "model.norm_impl=torch",
    "train.precision=fp32",
    "train.compile=False",
    "model.attn_impl=math",
    "train.channels_last=False",
    "train.fused_adam=False",
    "data.flip=cpu",
)

# Each step adds its overrides to everything above it: (name, added overrides, batch rule).
STACK = (
    ("baseline (fp32, eager, math attention, PyTorch DataLoader)", (), 128),
    ("+ largest batch that fits", (), "max"),
    ("+ torch.compile", ("train.compile=True",), "prev"),
    ("+ SDPA attention", ("model.attn_impl=sdpa",), "max"),
    ("+ bf16 autocast", ("train.precision=bf16",), "max"),
    ("+ FFCV loading", ("data.loader=ffcv",), "prev"),
    ("+ channels_last", ("train.channels_last=True",), "prev"),
    ("+ fused AdamW", ("train.fused_adam=True",), "prev"),
    ("+ GPU-resident data, flips on GPU", ("data.loader=gpu", "data.flip=gpu"), "prev"),
    # A candidate fix for the layout copies inside cuDNN's convolution backward (benchmarks/NOTES.md, attempt 4).
    ("+ GroupNorm that keeps channels_last", ("model.norm_impl=scale-shift",), "prev"),
    # GroupNorm + SiLU + dropout (+ the time-embedding add) as one Triton kernel each way (ffcv_ddpm.gn_kernels).
    ("+ fused GroupNorm/SiLU/dropout kernels", ("model.norm_impl=fused",), "prev"),
)
# Alternatives to one step of the stack (not stacked further): (name, the stack row they replace a setting of,
# overrides on top of that row). They run at that row's batch.
VARIANTS = (
    ("fp16 + GradScaler (instead of bf16)", "+ bf16 autocast", ("train.precision=fp16",)),
    ("compile mode max-autotune-no-cudagraphs", "+ GPU-resident data, flips on GPU",
     ("train.compile_mode=max-autotune-no-cudagraphs",)),
    ("compile mode reduce-overhead (CUDA graphs)", "+ GPU-resident data, flips on GPU",
     ("train.compile_mode=reduce-overhead",)),
    ("inductor layout optimization forced", "+ GPU-resident data, flips on GPU", ("train.force_layout_opt=True",)),
    ("cuDNN algorithm search (cudnn.benchmark)", "+ fused GroupNorm/SiLU/dropout kernels",
     ("train.cudnn_benchmark=True",)),
)


# End to end per loader (issue 6): the trainer's defaults (bf16, compile, SDPA, channels_last, fused AdamW, flips on
# the GPU, 8 workers or the cores there are) and only the loader changes. "{data}" stands for the --data folder.
LOADER_ROWS = (
    ("FFCV raw .beton", ("data.loader=ffcv",)),
    ("FFCV JPEG .beton", ("data.loader=ffcv", f"data.path={{data}}/{JPEG_BETON}")),
    ("PyTorch DataLoader over in-memory uint8 arrays", ("data.loader=torch-memory",)),
    ("PyTorch DataLoader over PNG files (PIL decode)",
     ("data.loader=torch-files", f"data.png_dir={{data}}/{PNG_TRAIN}")),
    ("GPU-resident uint8 tensor", ("data.loader=gpu",)),
)


def loader_rows(preset: str, batch: int) -> list[Row]:
    return [Row(name, preset, added, batch, baseline=i == 0) for i, (name, added) in enumerate(LOADER_ROWS)]


def row_overrides(row: Row, data_overrides: tuple[str, ...], data_dir: Path) -> list[str]:
    """A row's overrides after the dataset's (a row that names its own .beton wins), with {data} filled in."""
    return [o.replace("{data}", str(data_dir)) for o in merge(data_overrides, row.overrides)]


def merge(*groups: tuple[str, ...]) -> tuple[str, ...]:
    """Overrides with one entry per key, the last value winning (a later step changes an earlier setting)."""
    out: dict[str, str] = {}
    for item in (i for g in groups for i in g):
        out[item.split("=", 1)[0]] = item
    return tuple(out.values())


def table_rows(preset: str, baseline_loader: tuple[str, ...]) -> list[Row]:
    """The published table's rows and ours beyond it, for one model preset."""
    rows, acc = [], merge(BASELINE, baseline_loader)
    for i, (name, added, batch) in enumerate(STACK):
        acc = merge(acc, added)
        rows.append(Row(name, preset, acc, rows[-1].name if batch == "prev" else batch, baseline=i == 0))
    last: dict[str, str] = {}  # parent -> the row a new variant goes after (the parent, then its earlier variants)
    for name, parent, added in VARIANTS:
        p = next(r for r in rows if r.name == parent)
        after = next(i for i, r in enumerate(rows) if r.name == last.get(parent, parent))
        rows.insert(after + 1, Row(name, preset, merge(p.overrides, added), p.name))
        last[parent] = name
    return rows


def quick_rows(baseline_loader: tuple[str, ...]) -> list[Row]:
    """CPU-sized: the tiny preset and the small UNet at small batches, the rows that mean something on a CPU."""
    rows = []
    for preset, batch in (("tiny", 32), ("annotated-small", 4)):
        # Two loader processes / threads: the quick table has to run on a 2-core CI machine.
        base = merge(BASELINE, baseline_loader, ("data.num_workers=2",))
        sdpa = merge(base, ("model.attn_impl=sdpa",))
        rows += [
            Row("baseline (fp32, eager, math attention, PyTorch DataLoader)", preset, base, batch, baseline=True),
            Row("+ SDPA attention", preset, sdpa, batch),
            Row("+ FFCV loading", preset, merge(sdpa, ("data.loader=ffcv",)), batch),
        ]
    return rows


TABLES = {
    "small": lambda loader: table_rows("annotated-small", loader),
    "ddpm": lambda loader: table_rows("ddpm-cifar10", loader),
    "both": lambda loader: table_rows("annotated-small", loader) + table_rows("ddpm-cifar10", loader),
    "quick": quick_rows,
    "loaders-e2e": lambda loader: loader_rows("ddpm-cifar10", 512) + loader_rows("annotated-small", 1024),
}

# Batch sizes tried for "max" rows (the published table's 320 / 2048 / 3072 sit between these steps).
BATCH_LADDER = (128, 192, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096, 6144, 8192)


# ---------------------------------------------------------------------------------------------------- child side


def _sdpa_backend(model, cfg, device) -> str:
    """Which attention kernel the row's forward runs: read off the aten op names of one small profiled forward."""
    import torch

    from ffcv_ddpm.step import AMP_DTYPES

    if cfg.model.attn_impl != "sdpa":
        return "math (explicit matmul-softmax)"
    amp = AMP_DTYPES[cfg.train.precision]
    x = torch.randn(2, cfg.model.in_channels, cfg.model.image_size, cfg.model.image_size, device=device)
    if cfg.train.channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    t = torch.randint(0, cfg.diffusion.timesteps, (2,), device=device)
    with warnings.catch_warnings():  # the profiler warns about its own event buffering; nothing to act on
        warnings.simplefilter("ignore")
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            with torch.autocast(device.type, dtype=amp or torch.float32, enabled=amp is not None):
                model(x, t)
    names = {e.name for e in prof.events() if "scaled_dot_product" in e.name or "attention" in e.name}
    for key, label in (("cudnn", "cuDNN attention"), ("flash_attention_for_cpu", "flash (CPU kernel)"),
                       ("flash", "flash"), ("efficient", "memory-efficient"), ("math", "math (SDPA fallback)")):
        if any(key in n for n in names):
            return f"SDPA {label}"
    return "SDPA (kernel not identified: " + ", ".join(sorted(names)) + ")"


def _tf32_flags() -> dict:
    import torch

    return {"tf32_matmul": bool(torch.backends.cuda.matmul.allow_tf32),
            "tf32_cudnn": bool(torch.backends.cudnn.allow_tf32)}


def run_row(spec: dict) -> dict:
    """Build, warm up, time. Returns the raw figures; no derived metrics (benchmarks.report computes those)."""
    import torch

    from ffcv_ddpm.config import load_config
    from ffcv_ddpm.data import endless, make_loader
    from ffcv_ddpm.step import build
    from ffcv_ddpm.timing import timed_steps, untimed_steps

    cfg = load_config(spec["preset"], [*spec["overrides"], f"data.batch_size={spec['batch_size']}"])
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cfg.train.device = str(device)
    torch.manual_seed(cfg.train.seed)

    t0 = time.perf_counter()
    loader = make_loader(cfg.data, device)
    loader_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    trainer = build(cfg, device)
    build_s = time.perf_counter() - t0
    flags = _tf32_flags()  # as build() left them for this precision
    backend = _sdpa_backend(trainer.model, cfg, device)
    lr = cfg.train.lr
    data = endless(loader)

    def step(batch, _i):
        return trainer.step(*batch, lr)

    def fetch():
        return next(data)

    # The first step compiles (when compile=True) and autotunes: reported on its own, never timed with the rest.
    first_step_s = untimed_steps(step, fetch, 1, device)
    warmup_s = untimed_steps(step, fetch, spec["warmup"], device)

    cuda = device.type == "cuda"
    peak_incl_warmup = torch.cuda.max_memory_allocated(device) if cuda else None
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    timed = timed_steps(step, fetch, spec["iters"], device)
    iter_ms, wait_ms = timed.iter_ms, timed.wait_ms
    mean_loss = float(timed.loss_sum) / spec["iters"]
    if not torch.isfinite(torch.tensor(mean_loss)):
        raise RuntimeError(f"non-finite training loss ({mean_loss}) during the timed iterations")
    return {
        "batch_size": cfg.data.batch_size,
        "precision": cfg.train.precision,
        **flags,
        "sdpa_backend": backend,
        "compiled": bool(cfg.train.compile and cuda),
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if cuda else None,
        "iter_ms": iter_ms,
        "wait_ms": wait_ms,
        "first_step_s": first_step_s,
        "warmup_s": warmup_s,
        "loader_build_s": loader_s,
        "trainer_build_s": build_s,
        "mean_loss": mean_loss,
        "peak_mem_bytes": torch.cuda.max_memory_allocated(device) if cuda else None,
        "peak_mem_bytes_incl_warmup": peak_incl_warmup,
        "peak_reserved_bytes": torch.cuda.max_memory_reserved(device) if cuda else None,
        "config": cfg.to_dict(),
    }


def probe_batch(spec: dict) -> dict:
    """Largest BATCH_LADDER size whose training step fits in `mem_fraction` of GPU memory, tried eagerly.

    Eager because compiling per candidate size would take minutes; a compiled step needs no more memory than the
    eager one (Inductor frees intermediates earlier), so the batch found also fits the compiled row. Memory grows
    linearly with the batch, so the next size's peak is predicted from the two last measured ones and not tried
    when it would not fit: the probe never has to recover from an out-of-memory error (though it can).
    """
    import torch

    from ffcv_ddpm.config import load_config
    from ffcv_ddpm.step import build

    cfg = load_config(spec["preset"], [*spec["overrides"], "train.compile=False"])
    device = torch.device("cuda")
    trainer = build(cfg, device)
    total = torch.cuda.get_device_properties(device).total_memory
    limit = spec["mem_fraction"] * total
    size = cfg.model.image_size
    trace, fits = [], []
    for b in BATCH_LADDER:
        if b > spec["cap"]:
            break
        if len(fits) >= 2:
            (b0, m0), (b1, m1) = fits[-2], fits[-1]
            if m1 + (m1 - m0) * (b - b1) / (b1 - b0) > limit:
                trace.append({"batch": b, "skipped": "predicted not to fit"})
                break
        images = torch.randint(0, 256, (b, 3, size, size), dtype=torch.uint8, device=device)
        labels = torch.randint(0, 10, (b,), device=device)
        torch.cuda.reset_peak_memory_stats(device)
        try:
            trainer.step(images, labels, 0.0)
            torch.cuda.synchronize(device)
        except torch.cuda.OutOfMemoryError:
            trace.append({"batch": b, "oom": True})
            break
        finally:
            del images, labels
            trainer.optimizer.zero_grad(set_to_none=True)
        peak = torch.cuda.max_memory_allocated(device)
        trace.append({"batch": b, "peak_bytes": peak})
        if peak > limit:
            break
        fits.append((b, peak))
    if not fits:
        raise RuntimeError(f"not even batch {BATCH_LADDER[0]} fits in {spec['mem_fraction']:.0%} of GPU memory")
    return {"batch_size": fits[-1][0], "trace": trace, "total_memory": total}


def measure_peaks(_spec: dict) -> dict:
    from benchmarks.peaks import PRECISIONS, measure_peak

    return {p: measure_peak(p) for p in PRECISIONS}


def run_sampling(spec: dict) -> list[dict]:
    """Images/s of DDPM (all T steps) and DDIM sampling, bf16 on CUDA (random weights: speed only)."""
    import torch

    from benchmarks.flops import train_flops_per_image
    from ffcv_ddpm.config import load_config
    from ffcv_ddpm.diffusion import GaussianDiffusion
    from ffcv_ddpm.timing import sync
    from ffcv_ddpm.unet import build_model

    cfg = load_config(spec["preset"], [])
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    model = build_model(cfg.model).to(device).to(memory_format=torch.channels_last).eval()
    net = torch.compile(model) if device.type == "cuda" else model
    diffusion = GaussianDiffusion(cfg.diffusion).to(device)
    shape = (cfg.model.in_channels, cfg.model.image_size, cfg.model.image_size)
    fwd = train_flops_per_image(cfg.model)["fwd"]
    # bf16 on the GPU (the figure asked for); CPUs without bf16 units run autocast-bf16 slower than fp32.
    precision = "bf16" if device.type == "cuda" else "fp32"

    def sample(sampler: str, steps: int, n: int):
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=precision == "bf16"):
            return diffusion.sample(net, n, sampler=sampler, steps=steps, seed=0, shape=shape, device=device,
                                    memory_format=torch.channels_last)

    t0 = time.perf_counter()
    sample("ddim", 2, spec["n"])  # compiles the model at this batch
    sync(device)
    compile_s = time.perf_counter() - t0
    out = []
    for sampler, steps in (("ddim", spec["ddim_steps"]), ("ddpm", cfg.diffusion.timesteps)):
        t0 = time.perf_counter()
        images = sample(sampler, steps, spec["n"])
        sync(device)
        seconds = time.perf_counter() - t0
        if images.float().std() == 0:
            raise RuntimeError(f"{sampler} sampling returned constant images")
        out.append({
            "name": spec["preset"], "sampler": sampler, "steps": steps, "n": spec["n"], "seconds": seconds,
            "img_per_s": spec["n"] / seconds, "precision": precision, "compiled": device.type == "cuda",
            "compile_s": compile_s,
            "tflops": fwd * spec["n"] * steps / seconds / 1e12,
            "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        })
    return out


def environment(_spec: dict) -> dict:
    from ffcv_ddpm.env import environment as env

    return env()


WORKERS = {"row": run_row, "probe": probe_batch, "peaks": measure_peaks, "sampling": run_sampling, "env": environment}


def worker_main(kind: str, spec_path: str, result_path: str) -> int:
    """Child entry: run one job, write {"status": "ok", "result": ...} or {"status": "failed", "error": ...}."""
    spec = json.loads(Path(spec_path).read_text())
    try:
        out = {"status": "ok", "result": WORKERS[kind](spec)}
    except Exception as e:  # the parent reports it in the table and goes on with the next row
        import torch

        oom = isinstance(e, torch.cuda.OutOfMemoryError)
        msg = "out of memory" if oom else f"{type(e).__name__}: {e}"
        traceback.print_exc()
        out = {"status": "failed", "error": msg.splitlines()[0][:300]}
    Path(result_path).write_text(json.dumps(out))
    return 0


# ---------------------------------------------------------------------------------------------------- parent side


class BenchError(Exception):
    """A user-facing problem (bad arguments, missing dataset tool); printed without a traceback."""


def spawn(kind: str, spec: dict, timeout: float) -> dict:
    """Run one worker job in a fresh Python process; its output streams through, its result comes back as JSON."""
    with tempfile.TemporaryDirectory(prefix="bench-") as tmp:
        spec_path, result_path = Path(tmp) / "spec.json", Path(tmp) / "result.json"
        spec_path.write_text(json.dumps(spec))
        cmd = [sys.executable, "-m", "benchmarks.bench", "--worker", kind, str(spec_path), str(result_path)]
        try:
            proc = subprocess.run(cmd, cwd=REPO, timeout=timeout)
        except subprocess.TimeoutExpired:
            return {"status": "failed", "error": f"timed out after {timeout:.0f} s (raise --row-timeout)"}
        if not result_path.is_file():
            return {"status": "failed", "error": f"worker exited with code {proc.returncode} and no result"}
        return json.loads(result_path.read_text())


def ensure_dataset(data_dir: Path, beton: Path, num_synthetic: int) -> bool:
    """Builds a synthetic dataset when the .beton is missing; True if it did."""
    if beton.is_file():
        return False
    if beton.parent != data_dir:
        raise BenchError(f"--beton {beton} does not exist")
    print(f"bench: NOTE: no {BETON} in {data_dir}/, so building a SYNTHETIC dataset there first "
          f"({num_synthetic} images, tools.make_dataset --source synthetic). Its numbers measure speed only; "
          "run `make dataset` for CIFAR-10.", flush=True)
    cmd = [sys.executable, "-m", "tools.make_dataset", "--source", "synthetic", "--out", str(data_dir),
           "--num-synthetic", str(num_synthetic), "--num-synthetic-test", str(max(64, num_synthetic // 5))]
    if subprocess.run(cmd, cwd=REPO).returncode != 0 or not beton.is_file():
        raise BenchError(f"building the synthetic dataset failed (command: {' '.join(cmd)})")
    return True


def resolve_rows(rows: list[Row], selected: str | None) -> list[Row]:
    """The rows to run: all, or those whose 1-based index or name substring is listed (comma-separated)."""
    if not selected:
        return rows
    keep = []
    for i, row in enumerate(rows, 1):
        for token in selected.split(","):
            token = token.strip()
            # A number is an index only: "3" must not pick every row whose name says "fp32".
            if token and (token == str(i) if token.isdigit() else token.lower() in row.name.lower()):
                keep.append(row)
                break
    if not keep:
        raise BenchError(f"--rows {selected!r} matches no row; see --list")
    return keep


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = Parser(prog="python -m benchmarks.bench", description=__doc__.split("\n\n")[0],
               formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--data", type=Path, default=Path("data"), help="dataset folder (made by `make dataset`)")
    p.add_argument("--beton", type=Path, help=f"train .beton (default: DATA/{BETON})")
    p.add_argument("--table", choices=sorted(TABLES), help="row set (default: both with CUDA, quick without)")
    p.add_argument("--rows", help="run only these rows: 1-based indices or name substrings, comma-separated")
    p.add_argument("--list", action="store_true", help="print the rows and their overrides and exit")
    p.add_argument("--iters", type=option(int, at_least(1)),
                   help="timed iterations per row (default: 50 on CUDA, 5 on CPU)")
    p.add_argument("--warmup", type=option(int, at_least(0)),
                   help="warm-up iterations after the first step (default: 10 CUDA, 1 CPU)")
    p.add_argument("--baseline-loader", choices=("auto", "torch-memory", "torch-files"), default="auto",
                   help="loader of the rows before '+ FFCV loading'; auto = torch-files (PNG decode per image) if "
                        f"DATA/{PNG_TRAIN} exists, else torch-memory (a DataLoader over arrays in RAM)")
    p.add_argument("--max-batch", type=option(int, at_least(1)), default=4096,
                   help="cap for the 'largest batch that fits' rows")
    p.add_argument("--batch", type=option(int, at_least(1)),
                   help="run every row at this batch (no probing; for subsets and CPUs)")
    p.add_argument("--mem-fraction", type=option(float, matches("a number in (0, 1]", lambda v: 0 < v <= 1)),
                   default=0.9, help="GPU memory share a probed batch may use")
    p.add_argument("--measure-peak", action="store_true", help="also time large matmuls for a measured peak")
    p.add_argument("--sampling", action="store_true", help="also time DDPM (1000 steps) and DDIM sampling, bf16")
    p.add_argument("--sample-n", type=option(int, at_least(1)),
                   help="images per sampling run (default: 1024 on CUDA, 4 on CPU)")
    p.add_argument("--ddim-steps", type=option(int, at_least(1)), default=50, help="DDIM steps for the sampling figure")
    p.add_argument("--num-synthetic", type=option(int, at_least(1)),
                   help="images in a synthetic dataset built when none exists (default: 50000 on CUDA, 4096 on CPU)")
    p.add_argument("--row-timeout", type=option(float, above(0)), default=1800,
                   help="seconds before a row's process is stopped")
    p.add_argument("--out", type=Path, help="output folder (default: benchmarks/results/<card>)")
    p.add_argument("--name", help="output file stem (default: the table name)")
    return p.parse_args(argv)


def _summary_line(row: Row, raw: dict, flops: dict, device_name: str | None) -> str:
    from benchmarks.report import row_metrics

    m = row_metrics({"raw": raw}, flops, device_name, None)
    mfu = f"{100 * m['mfu']:.1f}%" if m.get("mfu") is not None else m["peak_note"]
    return (f"{raw['sdpa_backend']}; {m['ms_median']:.2f} ms/iter (p10 {m['ms_p10']:.2f}, p90 {m['ms_p90']:.2f}), "
            f"{m['img_per_s']:,.1f} img/s, data wait {100 * m['data_wait_share']:.1f}%, "
            f"{m['tflops']:.3g} TFLOP/s, MFU {mfu}, first step {raw['first_step_s']:.1f} s")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"]:
        return worker_main(*argv[1:4])
    try:
        return bench(parse_args(argv), argv)
    except BenchError as e:
        print(f"bench: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("bench: interrupted", file=sys.stderr)
        return 130


def bench(args: argparse.Namespace, argv: list[str]) -> int:
    import torch

    from benchmarks.flops import published_style_flops_per_image, train_flops_per_image
    from benchmarks.peaks import card_slug
    from benchmarks.report import add_metrics, terminal_table, write_reports
    from ffcv_ddpm.unet import PRESETS

    cuda = torch.cuda.is_available()  # does not create a CUDA context: the children own the GPU
    table = args.table or ("both" if cuda else "quick")
    iters = args.iters or (50 if cuda else 5)
    warmup = args.warmup if args.warmup is not None else (10 if cuda else 1)
    data_dir = args.data
    beton = args.beton or data_dir / BETON
    png_dir = data_dir / PNG_TRAIN
    if args.baseline_loader == "torch-files" and not png_dir.is_dir():
        raise BenchError(f"--baseline-loader torch-files needs the PNG folder {png_dir}; write it with "
                         f"`python -m tools.make_dataset ... --export-png {data_dir / 'png'}`")
    use_png = args.baseline_loader == "torch-files" or (args.baseline_loader == "auto" and png_dir.is_dir())
    baseline_loader = (("data.loader=torch-files", f"data.png_dir={png_dir}") if use_png
                       else ("data.loader=torch-memory",))
    rows = resolve_rows(TABLES[table](baseline_loader), args.rows)
    if args.list:
        for i, row in enumerate(rows, 1):
            batch = row.batch if isinstance(row.batch, int) or row.batch == "max" else f"as in '{row.batch}'"
            print(f"{i:2d}. [{row.preset}] {row.name}  (batch: {batch})\n    {' '.join(row.overrides)}")
        return 0

    # ---- first lines: what runs, on what, with which data --------------------------------------------------------
    # The environment (GPU name included) comes from a child too: asking torch here would create a CUDA context
    # in this process, holding GPU memory the rows' processes should have.
    env = spawn("env", {}, 120)
    if env["status"] != "ok":
        raise BenchError(f"could not read the environment: {env['error']}")
    env = env["result"]
    gpu = env["gpus"][0]["name"] if cuda and env["gpus"] else None
    where = f"CUDA ({gpu})" if cuda else "CPU only: MFU is n/a (no CUDA)"
    print(f"bench: {where}; table '{table}', {len(rows)} rows; {warmup} warm-up + {iters} timed iterations per row, "
          "each row in a fresh process", flush=True)
    if not cuda and table != "quick":
        print(f"bench: WARNING: table '{table}' on a CPU will take a long time; --table quick is sized for CPUs")
    built = ensure_dataset(data_dir, beton, args.num_synthetic or (50_000 if cuda else 4096))
    from ffcv_ddpm.data import dataset_info

    try:
        dataset = dataset_info(beton)
    except (FileNotFoundError, ValueError) as e:
        raise BenchError(str(e)) from None
    print(f"bench: data {beton}: {dataset['num_images']} images, source {dataset['source']}"
          + (" -- SYNTHETIC: speed only, not a training result" if dataset["synthetic"] else "")
          + (f"; baseline loader reads PNGs from {png_dir}" if use_png else ""), flush=True)
    data_overrides = (f"data.path={beton}",)

    # ---- FLOPs per image, once per model (meta device, no GPU) ------------------------------------------------------
    flops = {}
    for preset in dict.fromkeys(r.preset for r in rows):
        flops[preset] = {"train": train_flops_per_image(PRESETS[preset]),
                         "published": published_style_flops_per_image(PRESETS[preset])}
        f = flops[preset]
        print(f"bench: {preset}: {f['train']['fwd_bwd'] / 1e9:.3f} GFLOP/img fwd+bwd (FlopCounterMode), "
              f"{f['published']['fwd_bwd'] / 1e9:.3f} counted the published way", flush=True)

    result = {
        "schema": 1,
        "table": table,
        "complete": False,  # True once every row has run (the file is rewritten after each row)
        "command": ["python", "-m", "benchmarks.bench", *argv],
        "environment": env,
        "device_name": gpu,
        "card": card_slug(gpu) if cuda else "cpu",
        "dataset": dataset,
        "dataset_built_now": built,
        "settings": {"iters": iters, "warmup": warmup, "max_batch": args.max_batch,
                     "mem_fraction": args.mem_fraction, "batch_ladder": list(BATCH_LADDER),
                     "baseline_loader": baseline_loader[0].split("=")[1]},
        "flops": flops,
        "measured_peaks": None,
        "rows": [],
        "sampling": None,
    }

    out_dir = args.out or REPO / "benchmarks" / "results" / result["card"]
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path = out_dir / f"{args.name or table}.json"

    def save() -> None:
        # Rewritten after every row, so a crash or timeout mid-table keeps the rows already measured.
        tmp = json_path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(result, indent=1) + "\n")
        tmp.replace(json_path)

    if args.measure_peak:
        if not cuda:
            print("bench: --measure-peak needs CUDA; skipped")
        else:
            got = spawn("peaks", {}, args.row_timeout)
            result["measured_peaks"] = got.get("result")
            print(f"bench: measured peaks (TFLOP/s): {got.get('result') or got.get('error')}", flush=True)

    # ---- the rows --------------------------------------------------------------------------------------------------
    resolved: dict[tuple[str, str], int] = {}  # (preset, row name) -> the batch it ran at
    cap = min(args.max_batch, dataset["num_images"])
    for i, row in enumerate(rows, 1):
        overrides = row_overrides(row, data_overrides, data_dir)
        entry = {"name": row.name, "group": row.preset, "preset": row.preset, "baseline": row.baseline,
                 "overrides": overrides, "batch_rule": row.batch, "status": None, "raw": None}
        batch_note, probe, why = None, None, None
        if args.batch:
            batch, batch_note = args.batch, "fixed by --batch"
        elif isinstance(row.batch, int):
            batch = min(row.batch, dataset["num_images"])
        elif row.batch == "max" and cuda:
            probe = spawn("probe", {"preset": row.preset, "overrides": overrides, "cap": cap,
                                    "mem_fraction": args.mem_fraction}, args.row_timeout)
            batch = (probe.get("result") or {}).get("batch_size")
            why = probe.get("error")
            batch_note = (f"largest batch of the ladder fitting {args.mem_fraction:.0%} of GPU memory "
                          f"(eager probe, cap {cap})")
        elif row.batch == "max":
            batch, why = None, "the largest-batch probe needs CUDA; pass --batch N"
        else:
            batch = resolved.get((row.preset, row.batch))
            why = f"its batch comes from row '{row.batch}', which did not run (failed or not selected); pass --batch N"
        print(f"\nbench: [{i}/{len(rows)}] {row.preset}: {row.name} (batch {batch})", flush=True)
        if batch is None:
            entry.update(status="failed", error=why)
        else:
            got = spawn("row", {"preset": row.preset, "overrides": overrides, "batch_size": batch,
                                "iters": iters, "warmup": warmup}, args.row_timeout)
            entry.update(status=got["status"], error=got.get("error"), raw=got.get("result"))
            if entry["raw"] is not None:
                entry["raw"]["batch_note"] = batch_note
                entry["raw"]["batch_probe"] = (probe or {}).get("result")
                entry["config"] = entry["raw"].pop("config")
                resolved[(row.preset, row.name)] = batch
        result["rows"].append(entry)
        save()
        if entry["status"] == "ok":
            print(f"bench:   {_summary_line(row, entry['raw'], flops[row.preset], result['device_name'])}", flush=True)
        else:
            print(f"bench:   FAILED: {entry['error']}", flush=True)

    if args.sampling:
        preset = "ddpm-cifar10" if cuda else "tiny"
        n = args.sample_n or (1024 if cuda else 4)
        print(f"\nbench: sampling throughput, {preset}, {'bf16' if cuda else 'fp32'}, {n} images", flush=True)
        got = spawn("sampling", {"preset": preset, "n": n, "ddim_steps": args.ddim_steps}, args.row_timeout)
        result["sampling"] = got.get("result")
        if got["status"] != "ok":
            print(f"bench:   sampling FAILED: {got['error']}")
        for s in result["sampling"] or []:
            print(f"bench:   {s['sampler']} {s['steps']} steps: {s['img_per_s']:,.1f} img/s ({s['seconds']:.1f} s)")

    # ---- write ---------------------------------------------------------------------------------------------------
    result["complete"] = True
    add_metrics(result)
    save()
    md, png = write_reports(result, json_path)
    failed = [r["name"] for r in result["rows"] if r["status"] != "ok"]
    print(terminal_table(result))
    print(f"\nbench: wrote {json_path}, {md.name}, {png.name}"
          + (f"; {len(failed)} row(s) FAILED: {', '.join(failed)}" if failed else ""))
    return 1 if failed and len(failed) == len(result["rows"]) else 0


if __name__ == "__main__":
    sys.exit(main())
