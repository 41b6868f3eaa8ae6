"""The trainer's state and its one training step, shared by the training loop, the benchmarks and the profiler.

    t = build(cfg, device)                  # model, diffusion, AdamW, GradScaler, EMA and the (compiled) step
    loss = t.step(images_u8, labels, lr)    # one full iteration; the loss stays on the device (no host sync)

ffcv_ddpm.train runs this step in its loop (run folder, checkpoints, DDP set-up); benchmarks.speed.bench and
benchmarks.speed.profile time the same step, so a benchmark measures exactly what training runs.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable

import torch
from torch.nn.parallel import DistributedDataParallel

from ffcv_ddpm.config import RunConfig
from ffcv_ddpm.data import prepare_batch
from ffcv_ddpm.diffusion import GaussianDiffusion
from ffcv_ddpm.ema import EMA
from ffcv_ddpm.flat_allreduce import FlatGradReducer, broadcast_parameters
from ffcv_ddpm.sde import VEDiffusion, make_diffusion
from ffcv_ddpm.unet import build_model, pin_sdpa_kernel

AMP_DTYPES = {"fp32": None, "tf32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


class TrainingError(Exception):
    """A fault the user should read as a message, not a traceback (bad input, NaN loss, out of memory)."""


@dataclass
class Dist:
    """This process's place in a torchrun process group (one plain process: rank 0 of 1)."""
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1

    @property
    def main(self) -> bool:
        return self.rank == 0


@dataclass
class Trainer:
    cfg: RunConfig
    device: torch.device
    model: torch.nn.Module          # the uncompiled module: its state_dict has no _orig_mod. prefixes
    diffusion: GaussianDiffusion | VEDiffusion
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler
    ema: EMA | None
    step: Callable                  # step(images_u8, labels, lr) -> loss tensor; one full iteration, no host sync
    reducer: FlatGradReducer | None = None  # train.ddp_reduce=flat's averaging (its all-reduce times: take_ms)


def resolve_device(name: str, ddp: Dist = Dist()) -> torch.device:
    """train.device (and every command's --device): auto | cpu | cuda | cuda:N; auto = cuda when there is one."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(name)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", ddp.local_rank)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise TrainingError(f"device {name!r} asked for, but this machine has no CUDA GPU; use train.device=cpu")
    return device


def set_precision(precision: str, device: torch.device) -> None:
    if precision not in AMP_DTYPES:
        raise TrainingError(f"train.precision={precision!r}: choose one of {', '.join(AMP_DTYPES)}")
    if precision == "fp16" and device.type != "cuda":
        raise TrainingError("train.precision=fp16 needs a CUDA GPU (GradScaler); use bf16 or fp32 on CPU")
    # PyTorch lets cuDNN use TF32 by default; "fp32" means true fp32 here, so a baseline row is what it says.
    tf32 = precision != "fp32"
    torch.backends.cuda.matmul.allow_tf32 = tf32
    torch.backends.cudnn.allow_tf32 = tf32


def set_sdpa_backend(backend: str, device: torch.device) -> None:
    """train.sdpa_backend: which of F.scaled_dot_product_attention's backends may run (torch.backends.cuda's flags,
    which CPU calls read too; build also pins the model's attention to it, in the traced graph, where the flags alone
    let a compile reuse a cached graph of another backend: NOTES item 39). One backend alone, so a call it cannot run
    is an error ("No viable backend"), never a fallback that changes what a timing means; "auto" enables them all
    (torch's default, its own priority order)."""
    if backend in ("cudnn", "efficient") and device.type != "cuda":
        raise TrainingError(f"train.sdpa_backend={backend} runs on CUDA GPUs only; on {device.type} use auto, flash or "
                            "math")
    enable = {"cudnn": torch.backends.cuda.enable_cudnn_sdp, "flash": torch.backends.cuda.enable_flash_sdp,
              "efficient": torch.backends.cuda.enable_mem_efficient_sdp, "math": torch.backends.cuda.enable_math_sdp}
    for name, set_enabled in enable.items():
        set_enabled(backend in ("auto", name))


def set_pdl(mode: str, device: torch.device) -> None:
    """train.pdl: programmatic dependent launch (Hopper and later) for the process's kernels, so that a kernel's launch
    overlaps the end of the one before it (NOTES item 53). "kernels": the fused GroupNorm's Triton kernels
    (ffcv_ddpm.gn_kernels.PDL); "all": inductor's generated Triton kernels too (its triton.enable_pdl, read when it
    compiles: a graph compiled with it is cached apart). Set for every build, so that one build's choice does not
    outlive it in a process that makes several (the benchmarks' rows)."""
    if mode != "off" and (device.type != "cuda" or torch.cuda.get_device_capability(device)[0] < 9):
        raise TrainingError(f"train.pdl={mode} needs an sm90 GPU or later (H100, H200); on this "
                            f"{device.type} device use train.pdl=off")
    if device.type != "cuda":
        return  # nothing launches on the GPU
    import torch._inductor.config as inductor_config

    from ffcv_ddpm import gn_kernels

    gn_kernels.PDL = mode != "off"
    if hasattr(inductor_config.triton, "enable_pdl"):
        inductor_config.triton.enable_pdl = mode == "all"
    elif mode == "all":
        raise TrainingError(f"train.pdl=all: torch {torch.__version__}'s inductor has no triton.enable_pdl; use "
                            "train.pdl=kernels")


def make_step(model, compiled, diffusion, optimizer, scaler, ema, cfg: RunConfig,
              reduce_grads: Callable | None = None) -> Callable:
    """One training iteration. Everything stays on the device: the caller reads the loss at log intervals.
    reduce_grads: averages the gradients over the ranks after the backward (train.ddp_reduce=flat); None with
    DDP's wrapper (its hooks do it inside the backward) or one process."""
    amp_dtype = AMP_DTYPES[cfg.train.precision]
    device_type = next(model.parameters()).device.type
    conditional = cfg.model.num_classes > 0
    params = [p for p in model.parameters() if p.requires_grad]

    def step(images, labels, lr: float):
        # Eager, before the compiled model: uint8 -> [-1, 1] (+ flips) is a few elementwise kernels.
        x = prepare_batch(images, flip=cfg.data.flip == "gpu", channels_last=cfg.train.channels_last)
        with torch.autocast(device_type, dtype=amp_dtype or torch.float32, enabled=amp_dtype is not None):
            loss = diffusion.loss(compiled, x, labels if conditional else None,
                                  null_label=cfg.model.num_classes if conditional else None)
        scaler.scale(loss).backward()
        if reduce_grads is not None:
            reduce_grads()
        if cfg.train.grad_clip > 0:
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(params, cfg.train.grad_clip, foreach=True)
        for group in optimizer.param_groups:
            group["lr"] = lr
        # With the fused AdamW, GradScaler hands found_inf to the kernel instead of reading it on the host.
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        if ema is not None:
            ema.update(model)
        return loss.detach()

    return step


def wrap_ddp(model: torch.nn.Module, device: torch.device, cfg: RunConfig) -> DistributedDataParallel:
    """DDP with the train.ddp_* settings: bucket size, and the all-reduce in bf16 (half the bytes) if asked."""
    # Gradients as views into the all-reduce buckets: no copy in or out of them.
    net = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None,
                                  gradient_as_bucket_view=True, bucket_cap_mb=cfg.train.ddp_bucket_mb)
    if cfg.train.ddp_grad_dtype == "bf16":
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import bf16_compress_hook

        net.register_comm_hook(None, bf16_compress_hook)
    return net


def data_parallel(model: torch.nn.Module, device: torch.device,
                  cfg: RunConfig) -> tuple[torch.nn.Module, FlatGradReducer | None]:
    """(the module the step calls, the averaging to run after its backward) by train.ddp_reduce, for a process group:
    DDP's wrapper, which averages inside the backward (None after it), or the model itself and a FlatGradReducer
    over its weights, broadcast from rank 0 first."""
    if cfg.train.ddp_reduce == "ddp":
        return wrap_ddp(model, device, cfg), None
    params = [p for p in model.parameters() if p.requires_grad]
    broadcast_parameters(params)
    return model, FlatGradReducer(params, {"fp32": torch.float32, "bf16": torch.bfloat16}[cfg.train.ddp_grad_dtype])


def noise_seed(cfg: RunConfig, rank: int) -> int:
    """The seed of a rank's noise, timestep and dropout draws: train.noise_seed (else train.seed) + rank. Apart from
    the weights' seed so that two runs can start from the same weights and differ in these draws alone."""
    return (cfg.train.seed if cfg.train.noise_seed < 0 else cfg.train.noise_seed) + rank


def set_deterministic() -> None:
    """Deterministic kernels where torch has them (train.deterministic), for the process: cuDNN's deterministic
    algorithms, cuBLAS's fixed workspace, inductor's deterministic mode (no timing-based kernel choices) and
    torch.use_deterministic_algorithms. With warn_only, an op that has no deterministic kernel warns, naming itself,
    and runs anyway: a run that should be reproducible says which ops keep it from being so (NOTES item 16: two
    identical fp32 runs drift apart on a GPU)."""
    import torch._inductor.config

    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # read when cuBLAS makes its handle
    torch.backends.cudnn.deterministic = True
    torch._inductor.config.deterministic = True
    torch.use_deterministic_algorithms(True, warn_only=True)


def build(cfg: RunConfig, device: torch.device, ddp: Dist = Dist()) -> Trainer:
    """Model, diffusion, optimizer, scaler, EMA and the (compiled) step, for the trainer and the benchmarks."""
    set_precision(cfg.train.precision, device)
    set_sdpa_backend(cfg.train.sdpa_backend, device)
    set_pdl(cfg.train.pdl, device)
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = cfg.train.bf16_reduced_reduction
    torch.backends.cudnn.benchmark = cfg.train.cudnn_benchmark
    # Process-wide, like the choices it makes: cuDNN's search caches one engine per shape for the process, so a
    # later build with another limit reuses the first one's picks (benchmarks compare limits in fresh processes).
    torch.backends.cudnn.benchmark_limit = cfg.train.cudnn_benchmark_limit
    if cfg.train.deterministic:
        set_deterministic()
    torch.manual_seed(cfg.train.seed)
    model = build_model(cfg.model).to(device)
    pin_sdpa_kernel(model, cfg.train.sdpa_backend)
    if cfg.train.channels_last:
        model = model.to(memory_format=torch.channels_last)
    diffusion = make_diffusion(cfg.diffusion).to(device)
    # Fused AdamW: one kernel for all parameters, and under GradScaler (fp16) it takes found_inf on the device;
    # with the foreach AdamW the scaler reads found_inf on the host every step.
    fused = cfg.train.fused_adam
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.train.lr, betas=cfg.train.betas,
                                  weight_decay=cfg.train.weight_decay, fused=fused or None, foreach=not fused)
    scaler = torch.amp.GradScaler(device.type, enabled=cfg.train.precision == "fp16")
    ema = EMA(model, decay=cfg.train.ema_decay) if cfg.train.ema_decay > 0 else None
    net, reduce_grads = data_parallel(model, device, cfg) if ddp.world_size > 1 else (model, None)
    if cfg.train.compile and device.type == "cuda":
        import torch._dynamo.config as dynamo_config
        import torch._inductor.config as inductor_config

        from ffcv_ddpm.env import compile_cache

        compile_cache()  # kernels compiled here are kept for the next process (a no-op after the entry point's call)

        # Inductor's channels_last heuristic never fires for these UNets (benchmarks/NOTES.md, moved from the code).
        inductor_config.force_layout_optimization = cfg.train.force_layout_opt
        # NOTES 56's switches, set by every build (one process, many rows: the benchmarks' levers)
        inductor_config.max_autotune_gemm = cfg.train.autotune_gemm
        if cfg.train.autotune_gemm:
            inductor_config.max_autotune_gemm_backends = "ATEN,TRITON"
        inductor_config.coordinate_descent_tuning = cfg.train.tune_kernels
        inductor_config.combo_kernels = cfg.train.combo_kernels
        # With train.ddp_reduce=ddp the DDP wrapper is compiled: with ddp_split dynamo cuts the graph at bucket
        # boundaries, so each bucket's all-reduce starts while the backward of the graphs before it runs; without
        # (the default), one graph and the all-reduce after the whole backward: 0.55 ms for all 143 MB on NVLink,
        # less than the cuts cost. With ddp_reduce=flat the model alone is compiled: the one-GPU graph.
        # dynamic=False: batches have one size (drop_last); a dynamic recompile once failed (NOTES.md).
        dynamo_config.optimize_ddp = cfg.train.ddp_split
        net = torch.compile(net, mode=None if cfg.train.compile_mode == "default" else cfg.train.compile_mode,
                            dynamic=False)
    # Each rank draws its own noise and timesteps (the weights above were seeded alike).
    torch.manual_seed(noise_seed(cfg, ddp.rank))
    step = make_step(model, net, diffusion, optimizer, scaler, ema, cfg, reduce_grads)
    return Trainer(cfg, device, model, diffusion, optimizer, scaler, ema, step, reduce_grads)
