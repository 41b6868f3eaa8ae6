"""What a benchmark row's fresh process runs: one job, its result written as JSON for the parent (runner.py).

    python -m benchmarks.speed.jobs row SPEC.json RESULT.json     # internal: started by runner.spawn, not by hand

Jobs: `row` (build the trainer and loader, first step, warm-up, timed iterations), `probe` (the largest batch that
fits), `peaks` (matmul TFLOP/s per precision), `sampling` (DDIM and DDPM images/s), `env` (the environment, read
in a child so that the parent never creates a CUDA context). Each returns raw figures only; benchmarks.speed.report
derives the metrics.
"""

from __future__ import annotations

import json
import sys
import time
import traceback
import warnings
from pathlib import Path

from benchmarks.speed.rows import BATCH_LADDER


def _sdpa_backend(model, cfg, device) -> str:
    """Which attention kernel the row's forward runs: read off the aten op names of one small profiled forward."""
    import torch

    from ffcv_ddpm.step import AMP_DTYPES

    if cfg.model.attn_impl != "sdpa":
        return f"{cfg.model.attn_impl} (explicit matmul-softmax)"
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
    """Build, warm up, time. Returns the raw figures; no derived metrics (benchmarks.speed.report computes those)."""
    import torch

    from ffcv_ddpm.config import load_config
    from ffcv_ddpm.data import endless, make_loader
    from ffcv_ddpm.env import cache_size, compile_cache
    from ffcv_ddpm.step import build, resolve_device
    from ffcv_ddpm.timing import GcPauses, freeze_garbage, timed_steps, unfreeze_garbage, untimed_steps

    cfg = load_config(spec["preset"], [*spec["overrides"], f"data.batch_size={spec['batch_size']}"])
    device = resolve_device("auto")  # cuda:0, with its index: set_per_process_memory_fraction refuses a bare "cuda"
    if spec.get("mem_fraction") and device.type == "cuda":  # a warm-up job sharing the GPU (runner.warm_rows)
        torch.cuda.set_per_process_memory_fraction(spec["mem_fraction"], device)
    cfg.train.device = str(device)
    torch.manual_seed(cfg.train.seed)
    # What the compile cache held before this row: with the first step's seconds, "cold vs warm, same row".
    dirs = compile_cache()
    cache = {**dirs, **cache_size(dirs)}

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
    # As the trainer does (train.gc_freeze): what is alive after the warm-up is frozen, so a full collection in the
    # timed steps (311-392 ms on an H200: NOTES item 21) walks only what they make; their collections recorded.
    frozen = freeze_garbage() if cfg.train.gc_freeze else None
    pauses = GcPauses().start()
    try:
        timed = timed_steps(step, fetch, spec["iters"], device)
    finally:
        pauses.stop()
        unfreeze_garbage(frozen)  # an in-process caller gets its collector back as it was
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
        "compile_cache_before": cache,
        "warmup_s": warmup_s,
        "loader_build_s": loader_s,
        "trainer_build_s": build_s,
        "mean_loss": mean_loss,
        "gc_frozen_objects": frozen[0] if frozen else 0,
        "gc_frozen_before": frozen[1] if frozen else 0,  # > 0: the process had frozen objects; they stay frozen
        **pauses.take(),  # gc_ms, gc_max_ms, gc_collections: Python's collections during the timed iterations
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
    from benchmarks.speed.peaks import PRECISIONS, measure_peak

    return {p: measure_peak(p) for p in PRECISIONS}


def run_sampling(spec: dict) -> list[dict]:
    """Whole sampling calls of one model in one mode ("eager" or a ffcv_ddpm.sampling compile mode), timed with CUDA
    events: images/s and TFLOP/s per sampler (DDIM with spec["ddim_steps"], ancestral DDPM over all T steps). bf16
    autocast and channels_last on CUDA, fp32 on a CPU; random weights (speed only).

    The first call (DDIM, 3 network calls at the measured batch: compilation, and a CUDA graph's recording) is
    reported as first_call_s, not timed. A compiled mode also samples DDIM eagerly (untimed) from the same seed and
    records how far its images are from those, in uint8 levels: the compiled sampler must draw the same images."""
    import torch

    from benchmarks.speed.flops import train_flops_per_image
    from ffcv_ddpm.config import load_config
    from ffcv_ddpm.diffusion import GaussianDiffusion
    from ffcv_ddpm.sampling import compile_denoiser
    from ffcv_ddpm.timing import sync, timed_call
    from ffcv_ddpm.unet import build_model

    cfg = load_config(spec["preset"], spec.get("overrides", []))
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cuda = device.type == "cuda"
    torch.manual_seed(0)
    layout = torch.channels_last if cuda else torch.contiguous_format
    model = build_model(cfg.model).to(device, memory_format=layout).eval()
    mode = spec["mode"]
    net = model if mode == "eager" else compile_denoiser(model, mode)
    diffusion = GaussianDiffusion(cfg.diffusion).to(device)
    shape = (cfg.model.in_channels, cfg.model.image_size, cfg.model.image_size)
    fwd = train_flops_per_image(cfg.model)["fwd"]
    # bf16 on the GPU (the figure asked for); CPUs without bf16 units run autocast-bf16 slower than fp32.
    precision = "bf16" if cuda else "fp32"
    n = spec["n"]

    def sample(m, sampler: str, steps: int):
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=precision == "bf16"):
            return diffusion.sample(m, n, sampler=sampler, steps=steps, seed=0, shape=shape, device=device,
                                    memory_format=layout)

    t0 = time.perf_counter()
    sample(net, "ddim", min(3, cfg.diffusion.timesteps))
    sync(device)
    first_call_s = time.perf_counter() - t0
    eager_ddim = None if mode == "eager" else sample(model, "ddim", spec["ddim_steps"])
    out = []
    for sampler in spec["samplers"]:
        steps = spec["ddim_steps"] if sampler == "ddim" else cfg.diffusion.timesteps
        images, ms = timed_call(lambda: sample(net, sampler, steps), device)
        if images.float().std() == 0:
            raise RuntimeError(f"{sampler} sampling returned constant images")
        entry = {
            "name": spec["preset"], "sampler": sampler, "steps": steps, "n": n, "mode": mode,
            "compiled": mode != "eager", "precision": precision, "first_call_s": first_call_s,
            "seconds": ms / 1e3, "img_per_s": n / (ms / 1e3), "tflops": fwd * n * steps / (ms / 1e3) / 1e12,
            "fwd_flops_per_img": fwd,
            "device_name": torch.cuda.get_device_name(device) if cuda else None,
        }
        if mode == "reduce-overhead":
            from torch._dynamo.utils import counters

            # Inductor runs the graph without CUDA graphs when it cannot capture it (and logs why): count those.
            entry["cudagraph_skips"] = int(counters["inductor"]["cudagraph_skips"])
        if sampler == "ddim" and eager_ddim is not None:
            diff = (images.int() - eager_ddim.int()).abs()
            entry["vs_eager_max_abs"] = int(diff.max())
            entry["vs_eager_mean_abs"] = float(diff.float().mean())
        out.append(entry)
    return out


def environment(_spec: dict) -> dict:
    from ffcv_ddpm.env import environment as env

    return env()


WORKERS = {"row": run_row, "probe": probe_batch, "peaks": measure_peaks, "sampling": run_sampling, "env": environment}


def worker_main(kind: str, spec_path: str, result_path: str) -> int:
    """Child entry: run one job, write {"status": "ok", "result": ...} or {"status": "failed", "error": ...}."""
    from ffcv_ddpm.env import compile_cache

    compile_cache()  # before any job compiles (inherited from bench's process when it started this one)
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


if __name__ == "__main__":
    if len(sys.argv) != 4 or sys.argv[1] not in WORKERS:
        sys.exit(f"usage: python -m benchmarks.speed.jobs {{{','.join(WORKERS)}}} SPEC.json RESULT.json (started by "
                 "benchmarks.speed.runner)")
    sys.exit(worker_main(*sys.argv[1:4]))
