"""One typed config per run: model + diffusion + data + train, built from a named preset plus `key=value` overrides.

    cfg = load_config("ddpm-cifar10", ["data.batch_size=512", "precision=bf16"])

A bare key (`precision=bf16`) is accepted when exactly one section has a field of that name. Every value is parsed
to its field's annotated type (`1e-4`, `True`, `(1, 2, 2)`) and checked against RULES when the config is built
(load_config, RunConfig.from_dict, check_config): a bad one is a BadValue (a ValueError) of one line naming the
field, the value and what is allowed.
"""

import dataclasses
import json
import re
import typing
from dataclasses import dataclass, field

from ffcv_ddpm import unet
from ffcv_ddpm.checks import BadValue, Rule, above, at_least, coerce, each, in_range, matches, one_of
from ffcv_ddpm.data import FLIPS, LOADERS, ORDERS, DataConfig
from ffcv_ddpm.diffusion import PARAMS, DiffusionConfig
from ffcv_ddpm.sampling import SAMPLE_COMPILE_MODES
from ffcv_ddpm.unet import ATTN_IMPLS, PRESETS, SDPA_KERNELS, ModelConfig

PRECISIONS = ("fp32", "tf32", "bf16", "fp16")  # the keys of step.AMP_DTYPES
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
# train.sdpa_backend: torch's choice, or the one scaled_dot_product_attention kernel a step may use
# (ffcv_ddpm.step.set_sdpa_backend, unet.pin_sdpa_kernel)
SDPA_BACKENDS = ("auto", *SDPA_KERNELS)
PDL_MODES = ("off", "kernels", "all")  # train.pdl (ffcv_ddpm.step.set_pdl)
# Checkpoints are named by their step in 8 digits (ckpt-00800000.pt) and found again by that pattern; 125x the
# DDPM paper's 800k steps.
MAX_STEPS = 99_999_999


@dataclass
class TrainConfig:
    steps: int = 800_000                 # optimizer steps in the whole run (the DDPM paper trained CIFAR-10 for 800k)
    lr: float = 2e-4                     # peak AdamW learning rate (DDPM paper: 2e-4)
    warmup_steps: int = 5000             # linear LR warm-up from 0 (DDPM paper: 5000)
    weight_decay: float = 0.0            # AdamW weight decay
    betas: tuple = (0.9, 0.999)          # AdamW betas
    grad_clip: float = 1.0               # max global grad norm; 0 disables clipping
    fused_adam: bool = True              # fused AdamW (one kernel; takes fp16's found_inf on the device); else foreach
    ema_decay: float = 0.9999            # EMA of weights for sampling (DDPM paper: 0.9999); 0 disables EMA
    precision: str = "bf16"              # fp32 | tf32 (fp32 weights, TF32 matmuls) | bf16 | fp16 (with GradScaler)
    compile: bool = True                 # torch.compile the model (forward + backward); ignored on CPU
    # CUDA graphs replay the step without a launch per kernel (H100, fused GroupNorm: 8,248 -> 8,533 img/s at 1024).
    compile_mode: str = "reduce-overhead"  # default | reduce-overhead | max-autotune | max-autotune-no-cudagraphs
    channels_last: bool = True           # NHWC activations: what cuDNN's fastest convolution kernels want
    force_layout_opt: bool = False       # inductor: channels_last buffers around every conv even where its heuristic says no (NOTES.md)
    cudnn_benchmark: bool = True         # cuDNN times its algorithms per conv shape at the first step (H100: 124.7 -> 119.5 ms per step of 1024)
    cudnn_benchmark_limit: int = 10      # engines the search times per shape (torch's 10; 0: all, NOTES item 43)
    sdpa_backend: str = "auto"           # auto (torch's choice) | cudnn | flash | efficient | math: SDPA's only backend (NOTES item 39)
    # cuBLAS may reduce a bf16 GEMM's split-K partial sums in bf16 (torch's default, True); False asks for fp32 ones
    # (another kernel choice: the attention's 256 x 256 weight gradients ran cuBLAS's sm80 split-K kernel, NOTES 56).
    bf16_reduced_reduction: bool = True
    # Inductor times its Triton GEMM templates against cuBLAS per matmul shape at the first step (max_autotune_gemm;
    # the convolutions stay cuDNN's), and fuses the winners' epilogues (NOTES 56).
    autotune_gemm: bool = False
    # Inductor's own Triton kernels (the elementwise ops, the small reductions, the layout copies): their block sizes
    # tuned by coordinate descent at the first step (coordinate_descent_tuning), and independent small kernels
    # launched as one (combo_kernels) (NOTES 56).
    tune_kernels: bool = False
    combo_kernels: bool = False
    pdl: str = "off"                     # off | kernels | all: programmatic dependent launch, step.set_pdl
    deterministic: bool = False          # deterministic kernels where torch has them (ffcv_ddpm.step.set_deterministic): slower; for run-to-run equality; needs cudnn_benchmark=False
    seed: int = 0                        # seeds weights, noise, timesteps and data order
    noise_seed: int = -1                 # seeds noise, timesteps and dropout alone (rank r: + r); -1 = train.seed
    device: str = "auto"                 # auto (cuda if available) | cuda | cuda:N | cpu
    log_every: int = 100                 # steps between stats.jsonl lines (the only host-device syncs)
    ckpt_every: int = 5000               # steps between checkpoints (rounded up to a multiple of log_every)
    keep_ckpts: int = 3                  # newest complete checkpoints kept on disk
    sample_every: int = 10_000           # steps between sample grids from the EMA model; 0 disables
    sample_n: int = 64                   # images per sample grid
    sample_steps: int = 100              # steps for the grids and evaluations: DDIM (ddpm process) or predictor-corrector (ve)
    sample_compile: str = "off"          # compile the denoiser of grids and evaluations (CUDA only): off | default | reduce-overhead (ffcv_ddpm.sampling)
    eval_every: int = 0                  # steps between quality metrics in stats.jsonl (rounded up to a multiple of log_every); 0 = off
    eval_n: int = 1000                   # samples per evaluation (EMA weights, DDIM, plain conditional: see ffcv_ddpm.evaluate)
    eval_judge: str = ""                 # a saved digits judge: log FD-digits + conditional accuracy; "" = FID (Inception weights in the torch hub cache)
    eval_ref: str = ""                   # reference .beton or PNG folder of the metric; "" = data.path
    out_dir: str = "runs"                # parent folder of run folders
    desc: str = ""                       # extra words in the run folder name
    resume: str = ""                     # a run folder to continue from its newest complete checkpoint
    progress: bool = True                # tqdm progress bar
    telemetry: bool = True               # sample GPU power/util/memory/clocks via NVML into telemetry.jsonl (CUDA only)
    tensorboard: bool = False            # also stats.jsonl's numbers and the sample grids as TensorBoard events (<run>/tensorboard/)
    # After the first log interval (the compiled graphs built): gc.collect(), then gc.freeze(): the objects alive
    # then are left out of every later collection, so a full one walks only what training made since, not the
    # compiled graphs. Without it a full collection stalled one step by 311-392 ms on 4 H200s, and under DDP every
    # rank waits for it; with it none did (benchmarks/results/h200/ddp-scaling/flat-1024, NOTES.md item 21).
    gc_freeze: bool = True
    # How the ranks' gradients are averaged: flat = no wrapper, one all-reduce of all gradients after the backward
    # (ffcv_ddpm.flat_allreduce: no per-gradient bucket copies); ddp = torch's DistributedDataParallel (buckets, the
    # train.ddp_bucket_mb and ddp_split settings). Flat scaled better in the same call on 4 H200s with the compiled
    # step (95.0% against 94.3% on 4 GPUs at 512 each: benchmarks/results/h200/ddp-scaling/flat); eager
    # (train.compile=False), where DDP overlaps its buckets with the backward, was not compared.
    ddp_reduce: str = "flat"
    ddp_bucket_mb: float = 25.0          # DDP gradient bucket size (MB): each bucket's all-reduce starts when its grads are ready
    ddp_grad_dtype: str = "fp32"         # all-reduce precision: fp32 | bf16 (halves the bytes; averaged in bf16, DDP's bf16_compress_hook)
    # Compiled DDP: True splits the graph at bucket boundaries (all-reduce overlapped with the backward); False keeps
    # one graph, all-reduce after it: 96.7% vs 88.8% scaling on 2 H100s, same run (benchmarks/results/h100/ddp-scaling).
    ddp_split: bool = False


@dataclass
class RunConfig:
    preset: str                          # name of the model preset in ffcv_ddpm.unet.PRESETS
    model: ModelConfig
    diffusion: DiffusionConfig = field(default_factory=DiffusionConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "RunConfig":
        sections = {name: _from_dict(name, typ, d.get(name, {})) for name, typ in _SECTIONS.items()}
        return check_config(cls(preset=d["preset"], **sections))

    def summary(self) -> str:
        return json.dumps(self.to_dict(), indent=2, default=str)


_SECTIONS = {"model": ModelConfig, "diffusion": DiffusionConfig, "data": DataConfig, "train": TrainConfig}

_NONEMPTY = matches("a non-empty string", bool)
# What each field allows beyond its annotated type (bool and free-text fields need no entry; tests/test_config.py
# asserts that every int, float, tuple and choice field has one).
RULES = {
    "model.arch": one_of(("ddpm", "annotated")),
    "model.image_size": at_least(1),  # divisible by 2**(levels - 1): ModelConfig.validate
    "model.in_channels": at_least(1),
    "model.base_channels": at_least(1),
    "model.channel_mult": each(at_least(1), nonempty=True),
    "model.num_res_blocks": at_least(1),
    "model.attn_resolutions": each(at_least(1)),
    "model.attn_heads": at_least(1),
    "model.attn_head_dim": at_least(1),
    "model.dropout": in_range(0, 1, high_open=True),
    "model.norm_groups": at_least(1),
    "model.conv_groups": at_least(1),
    "model.attn_impl": one_of(ATTN_IMPLS),
    "model.norm_impl": one_of(lambda: tuple(unet.NORM_IMPLS)),
    # model.norm_plan (text "TILE,CHUNK,WARPS[,STAGES]"): no rule here; ModelConfig.validate (norm.parse_plan) checks
    # it with a message naming the part that is wrong, and that it goes with norm_impl=fused.
    "model.num_classes": at_least(0),
    "model.stem_kernel": at_least(1),
    "model.upsample": one_of(lambda: tuple(unet.UPSAMPLES)),
    "model.pad_image_channels": at_least(0),  # 0 or at least in_channels: ModelConfig.validate
    "diffusion.schedule": one_of(("linear", "cosine")),
    "diffusion.timesteps": at_least(1),
    "diffusion.beta_start": Rule("in (0, 1)", lambda v: 0 < v < 1),
    "diffusion.beta_end": Rule("in (0, 1)", lambda v: 0 < v < 1),
    "diffusion.p_uncond": in_range(0, 1),
    "diffusion.process": one_of(("ddpm", "ve")),
    "diffusion.sigma_min": above(0),  # below sigma_max: check_config
    "diffusion.sigma_max": above(0),
    "diffusion.param": one_of(PARAMS),
    "diffusion.sigma_data": above(0),
    "data.path": _NONEMPTY,
    "data.loader": one_of(LOADERS),
    "data.batch_size": at_least(1),
    "data.num_workers": at_least(-1),
    "data.order": one_of(ORDERS),
    "data.flip": one_of(FLIPS),
    "data.png_dir": _NONEMPTY,
    "data.seed": at_least(0),
    "train.steps": in_range(1, MAX_STEPS),
    "train.lr": above(0),
    "train.warmup_steps": at_least(0),
    "train.cudnn_benchmark_limit": at_least(0),
    "train.weight_decay": at_least(0),
    "train.betas": each(in_range(0, 1, high_open=True), length=2),
    "train.grad_clip": at_least(0),
    "train.ema_decay": in_range(0, 1, high_open=True),
    "train.precision": one_of(PRECISIONS),
    "train.compile_mode": one_of(COMPILE_MODES),
    "train.sdpa_backend": one_of(SDPA_BACKENDS),
    "train.pdl": one_of(PDL_MODES),
    "train.seed": at_least(0),
    "train.noise_seed": at_least(-1),
    "train.device": matches("auto, cpu, cuda or cuda:N", lambda v: re.fullmatch(r"auto|cpu|cuda(:\d+)?", v)),
    "train.log_every": at_least(1),
    "train.ckpt_every": at_least(1),
    "train.keep_ckpts": at_least(0),
    "train.sample_every": at_least(0),
    "train.sample_n": at_least(1),
    "train.sample_steps": at_least(1),
    "train.sample_compile": one_of(SAMPLE_COMPILE_MODES),
    "train.eval_every": at_least(0),
    "train.eval_n": at_least(1),
    "train.out_dir": _NONEMPTY,
    "train.ddp_bucket_mb": above(0),
    "train.ddp_grad_dtype": one_of(("fp32", "bf16")),
    "train.ddp_reduce": one_of(("ddp", "flat")),
    "train.desc": matches("a string without '/' (it becomes part of a folder name)", lambda v: "/" not in v),
}


def field_types(typ) -> dict:
    """{field name: annotated type} of a config dataclass (string annotations resolved)."""
    return typing.get_type_hints(typ)


def _default(f: dataclasses.Field):
    return f.default if f.default is not dataclasses.MISSING else None


def check_field(section: str, f: dataclasses.Field, typ, value):
    """`value` (text or a Python/JSON value) as the field's type, range-checked; BadValue otherwise."""
    return coerce(f"{section}.{f.name}", value, typ, RULES.get(f"{section}.{f.name}"), _default(f))


def check_config(cfg: "RunConfig") -> "RunConfig":
    """Every field parsed to its type and range-checked, then the rules that join fields; returns cfg."""
    for section, typ in _SECTIONS.items():
        obj = getattr(cfg, section)
        hints = field_types(typ)
        for f in dataclasses.fields(obj):
            setattr(obj, f.name, check_field(section, f, hints[f.name], getattr(obj, f.name)))
    # Rules across fields: the sections' own validation ("image_size=31 must be ..." -> "model.image_size=31 ..."),
    # then those that join two sections.
    for section in ("model", "data"):
        try:
            getattr(cfg, section).validate()
        except ValueError as e:
            msg = str(e)
            raise BadValue(msg if msg.startswith(f"{section}.") else f"{section}.{msg}" if re.match(r"\w+=", msg)
                           else f"{section}: {msg}") from None
    d = cfg.diffusion
    if d.schedule == "linear" and d.beta_start > d.beta_end:
        raise BadValue(f"diffusion.beta_start={d.beta_start}: expected at most diffusion.beta_end={d.beta_end}")
    if d.process == "ve" and d.sigma_min >= d.sigma_max:
        raise BadValue(f"diffusion.sigma_min={d.sigma_min}: expected below diffusion.sigma_max={d.sigma_max}")
    if cfg.train.ddp_reduce == "flat":  # the default: a bucket setting alone would otherwise do nothing
        bucket = [f"train.{k}={getattr(cfg.train, k)}" for k in ("ddp_split", "ddp_bucket_mb")
                  if getattr(cfg.train, k) != getattr(TrainConfig, k)]
        if bucket:
            raise BadValue(f"{' and '.join(bucket)} set{'s' if len(bucket) == 1 else ''} DDP's gradient buckets; "
                           "train.ddp_reduce=flat (the default) has none (one all-reduce after the backward): add "
                           "train.ddp_reduce=ddp")
    if cfg.train.deterministic and cfg.train.cudnn_benchmark:  # the search would pick by timing, run by run
        raise BadValue("train.deterministic=True with train.cudnn_benchmark=True (the default): cuDNN's search picks "
                       "each convolution's algorithm by timing, so two runs can pick different ones; add "
                       "train.cudnn_benchmark=False")
    if not cfg.train.cudnn_benchmark and cfg.train.cudnn_benchmark_limit != TrainConfig.cudnn_benchmark_limit:
        raise BadValue(f"train.cudnn_benchmark_limit={cfg.train.cudnn_benchmark_limit} sets how many engines cuDNN's "
                       "search times, and train.cudnn_benchmark=False turns the search off: drop the limit or "
                       "add train.cudnn_benchmark=True")
    compiled_only = [f"train.{k}=True" for k in ("autotune_gemm", "tune_kernels", "combo_kernels")
                     if getattr(cfg.train, k)]
    if compiled_only and not cfg.train.compile:
        raise BadValue(f"{' and '.join(compiled_only)} change{'s' if len(compiled_only) == 1 else ''} how inductor "
                       "compiles the step, and train.compile=False runs it eagerly: drop "
                       f"{'it' if len(compiled_only) == 1 else 'them'} or add train.compile=True")
    if cfg.train.sample_every and cfg.train.sample_steps > d.timesteps:
        raise BadValue(f"train.sample_steps={cfg.train.sample_steps}: expected at most diffusion.timesteps="
                       f"{d.timesteps}")
    return cfg


def _from_dict(section: str, typ, d: dict):
    known = {f.name for f in dataclasses.fields(typ)}
    unknown = sorted(set(d) - known)
    if unknown:
        raise BadValue(f"{section} has no field(s) {', '.join(unknown)}; valid fields: {', '.join(sorted(known))}")
    return typ(**d)  # types and ranges: check_config


def apply_override(cfg: RunConfig, item: str) -> None:
    """One `section.key=value` (or unambiguous `key=value`) parsed and checked; check_config joins the fields."""
    if "=" not in item:
        raise BadValue(f"override {item!r} is not of the form key=value (e.g. data.batch_size=512)")
    key, text = item.split("=", 1)
    key = key.strip().lstrip("-").replace("-", "_")
    if "." in key:
        section, name = key.split(".", 1)
        if section not in _SECTIONS:
            raise BadValue(f"unknown config section {section!r} in {item!r}; sections: {', '.join(_SECTIONS)}")
    else:
        owners = [s for s, typ in _SECTIONS.items() if name_in(typ, key)]
        if len(owners) != 1:
            hint = "no section has it" if not owners else f"it is in {', '.join(owners)}: write section.{key}"
            raise BadValue(f"unknown or ambiguous config key {key!r} ({hint})")
        section, name = owners[0], key
    obj = getattr(cfg, section)
    if not name_in(type(obj), name):
        valid = ", ".join(f.name for f in dataclasses.fields(obj))
        raise BadValue(f"{section} has no field {name!r}; valid fields: {valid}")
    f = next(f for f in dataclasses.fields(obj) if f.name == name)
    setattr(obj, name, check_field(section, f, field_types(type(obj))[name], text))


def name_in(typ, name: str) -> bool:
    return any(f.name == name for f in dataclasses.fields(typ))


def load_config(preset: str, overrides: list[str] = ()) -> RunConfig:
    if preset not in PRESETS:
        raise BadValue(f"unknown preset {preset!r}; presets: {', '.join(PRESETS)}")
    cfg = RunConfig(preset=preset, model=dataclasses.replace(PRESETS[preset]))
    for item in overrides:
        apply_override(cfg, item)
    return check_config(cfg)
