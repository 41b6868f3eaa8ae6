"""One typed config per run: model + diffusion + data + train, built from a named preset plus `key=value` overrides.

    cfg = load_config("ddpm-cifar10", ["data.batch_size=512", "precision=bf16"])

A bare key (`precision=bf16`) is accepted when exactly one section has a field of that name. Values are parsed as
Python literals where possible (`1e-4`, `True`, `(1, 2, 2)`), otherwise taken as strings.
"""

import ast
import dataclasses
import json
from dataclasses import dataclass, field

from ffcv_ddpm.data import DataConfig
from ffcv_ddpm.diffusion import DiffusionConfig
from ffcv_ddpm.unet import PRESETS, ModelConfig


@dataclass
class TrainConfig:
    steps: int = 800_000                 # optimizer steps in the whole run (the DDPM paper trained CIFAR-10 for 800k)
    lr: float = 2e-4                     # peak AdamW learning rate (DDPM paper: 2e-4)
    warmup_steps: int = 5000             # linear LR warm-up from 0 (DDPM paper: 5000)
    weight_decay: float = 0.0            # AdamW weight decay
    betas: tuple = (0.9, 0.999)          # AdamW betas
    grad_clip: float = 1.0               # max global grad norm; 0 disables clipping
    fused_adam: bool = True              # fused AdamW kernel (one launch for all params, no host sync); else foreach
    ema_decay: float = 0.9999            # EMA of weights for sampling (DDPM paper: 0.9999); 0 disables EMA
    precision: str = "bf16"              # fp32 | tf32 (fp32 weights, TF32 matmuls) | bf16 | fp16 (with GradScaler)
    compile: bool = True                 # torch.compile the model (forward + backward); ignored on CPU
    compile_mode: str = "default"        # default | reduce-overhead | max-autotune | max-autotune-no-cudagraphs
    channels_last: bool = True           # NHWC activations: what cuDNN's fastest convolution kernels want
    force_layout_opt: bool = False       # inductor: channels_last buffers around every conv even where its heuristic says no (see train.build)
    cudnn_benchmark: bool = False        # cuDNN times its algorithms for each conv shape at the first step instead of guessing
    seed: int = 0                        # seeds weights, noise, timesteps and data order
    device: str = "auto"                 # auto (cuda if available) | cuda | cuda:N | cpu
    log_every: int = 100                 # steps between stats.jsonl lines (the only host-device syncs)
    ckpt_every: int = 5000               # steps between checkpoints (rounded up to a multiple of log_every)
    keep_ckpts: int = 3                  # newest complete checkpoints kept on disk
    sample_every: int = 10_000           # steps between sample grids from the EMA model; 0 disables
    sample_n: int = 64                   # images per sample grid
    sample_steps: int = 100              # steps for the grids and evaluations: DDIM (ddpm process) or predictor-corrector (ve)
    eval_every: int = 0                  # steps between quality metrics in stats.jsonl (rounded up to a multiple of log_every); 0 = off
    eval_n: int = 1000                   # samples per evaluation (EMA weights, DDIM, plain conditional: see ffcv_ddpm.evaluate)
    eval_judge: str = ""                 # a saved digits judge: log FD-digits + conditional accuracy; "" = FID (Inception weights in the torch hub cache)
    eval_ref: str = ""                   # reference .beton or PNG folder of the metric; "" = data.path
    out_dir: str = "runs"                # parent folder of run folders
    desc: str = ""                       # extra words in the run folder name
    resume: str = ""                     # a run folder to continue from its newest complete checkpoint
    progress: bool = True                # tqdm progress bar
    telemetry: bool = True               # sample GPU power/util/memory/clocks via NVML into telemetry.jsonl (CUDA only)


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
        sections = {name: _from_dict(typ, d.get(name, {})) for name, typ in _SECTIONS.items()}
        return cls(preset=d["preset"], **sections)

    def summary(self) -> str:
        return json.dumps(self.to_dict(), indent=2, default=str)


_SECTIONS = {"model": ModelConfig, "diffusion": DiffusionConfig, "data": DataConfig, "train": TrainConfig}


def _from_dict(typ, d: dict):
    # JSON has no tuples: restore them where the field's default is a tuple, so a saved config round-trips equal.
    kwargs = {}
    for f in dataclasses.fields(typ):
        if f.name in d:
            v = d[f.name]
            kwargs[f.name] = tuple(v) if isinstance(f.default, tuple) and isinstance(v, list) else v
    return typ(**kwargs)


def _parse_value(text: str):
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


def apply_override(cfg: RunConfig, item: str) -> None:
    if "=" not in item:
        raise ValueError(f"override {item!r} is not of the form key=value (e.g. data.batch_size=512)")
    key, text = item.split("=", 1)
    key = key.strip().lstrip("-").replace("-", "_")
    if "." in key:
        section, name = key.split(".", 1)
        if section not in _SECTIONS:
            raise ValueError(f"unknown config section {section!r} in {item!r}; sections: {', '.join(_SECTIONS)}")
    else:
        owners = [s for s, typ in _SECTIONS.items() if name_in(typ, key)]
        if len(owners) != 1:
            hint = "no section has it" if not owners else f"it is in {', '.join(owners)}: write section.{key}"
            raise ValueError(f"unknown or ambiguous config key {key!r} ({hint})")
        section, name = owners[0], key
    obj = getattr(cfg, section)
    if not name_in(type(obj), name):
        valid = ", ".join(f.name for f in dataclasses.fields(obj))
        raise ValueError(f"{section} has no field {name!r}; valid fields: {valid}")
    value = _parse_value(text)
    current = getattr(obj, name)
    if isinstance(current, bool) and isinstance(value, str):
        raise ValueError(f"{section}.{name} expects True/False, got {text!r}")
    if isinstance(current, float) and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if isinstance(current, tuple) and isinstance(value, list):
        value = tuple(value)
    if isinstance(current, str) and not isinstance(value, str):
        value = text  # e.g. desc=123 stays the string "123"
    setattr(obj, name, value)


def name_in(typ, name: str) -> bool:
    return any(f.name == name for f in dataclasses.fields(typ))


def load_config(preset: str, overrides: list[str] = ()) -> RunConfig:
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; presets: {', '.join(PRESETS)}")
    cfg = RunConfig(preset=preset, model=dataclasses.replace(PRESETS[preset]))
    for item in overrides:
        apply_override(cfg, item)
    return cfg
