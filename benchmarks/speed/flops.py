"""Model FLOPs per image for one training step, counted once per model config.

    python -m benchmarks.speed.flops                                               # every preset, both counts
    python -m benchmarks.speed.flops --preset ddpm-cifar10 model.base_channels=64  # one config, with overrides

Two counts, side by side:
- `train_flops_per_image`: torch.utils.flop_counter.FlopCounterMode over a forward and a backward pass, on the meta
  device. Convolutions, linears and attention matmuls are all counted; elementwise ops, norms and softmax are not
  (they are memory-bound and by convention not "model FLOPs"). This is the figure MFU uses. It counts the reference
  network (`ffcv_ddpm.unet.reference_config`): the model.* computation switches (zero padding, the folded upsample,
  ...) change the work done, not the model's work; `executed_fwd_bwd` beside it is what the configured computation
  runs.
- `published_style_flops_per_image`: how the published A100 table counted, torchinfo's mult-adds x 2 (FLOPs per
  MAC) x 3 (forward + backward). torchinfo only sees parameterised layers, so attention's QK^T and AV products,
  which have no weights, count as zero. For the small UNet that misses more than half the forward work.

Why the meta device: FlopCounterMode derives FLOPs from shapes, so no arithmetic has to run (the 35.7M UNet counts
in about a second), and it is the same on every machine. It also matters for attention: on CPU, SDPA can run
`_scaled_dot_product_flash_attention_for_cpu` (it does for contiguous inputs), which FlopCounterMode has no formula
for and counts as ZERO; on meta,
SDPA decomposes into its math form (two bmm forward, four backward), which is exactly what the counter's CUDA flash /
efficient-attention formulas give. `train_flops_per_image` counts both attn_impl="sdpa" and "math" and refuses to
return if they disagree, so a future PyTorch that stops decomposing SDPA on meta cannot silently drop attention.
"""

from __future__ import annotations

import dataclasses
import json

import torch
from torch.utils.flop_counter import FlopCounterMode

from ffcv_ddpm.unet import ModelConfig, build_model, reference_config

# Batch used for counting: FLOPs of every counted op are linear in the batch, so per-image = total / B. Two, not
# one, so no op can special-case a singleton batch.
_COUNT_BATCH = 2

_cache: dict[str, dict] = {}


def _key(model_cfg: ModelConfig, kind: str) -> str:
    return kind + json.dumps(dataclasses.asdict(model_cfg), sort_keys=True, default=str)


def _sized(model_cfg: ModelConfig, image_size: int | None) -> ModelConfig:
    # The config's image_size decides which levels get attention, so the input size and the config must agree.
    if image_size is None or image_size == model_cfg.image_size:
        return model_cfg
    return dataclasses.replace(model_cfg, image_size=image_size)


def _inputs(cfg: ModelConfig, batch: int, device: str):
    x = torch.randn(batch, cfg.in_channels, cfg.image_size, cfg.image_size, device=device)
    t = torch.randint(0, 1000, (batch,), device=device)
    y = torch.randint(0, cfg.num_classes, (batch,), device=device) if cfg.num_classes else None
    return x, t, y


def _category(op) -> str:
    name = str(op)
    if "convolution" in name or "group_norm_act" in name:  # the op's FLOPs are its convolution's (conv_cutlass)
        return "conv"
    if "mm" in name and "bmm" not in name:  # aten.mm / aten.addmm: nn.Linear (time embedding, FiLM)
        return "linear"
    return "attention"  # bmm and the scaled_dot_product_* ops: the only weightless matmuls in these UNets


def _count(cfg: ModelConfig) -> dict:
    """Forward and forward+backward FLOPs per image, with the forward split by op category."""
    with torch.device("meta"):
        model = build_model(cfg)
        x, t, y = _inputs(cfg, _COUNT_BATCH, "meta")
    with FlopCounterMode(display=False) as fwd_counter:
        out = model(x, t, y)
    by_cat: dict[str, float] = {"conv": 0, "linear": 0, "attention": 0}
    for op, flops in fwd_counter.get_flop_counts().get("Global", {}).items():
        by_cat[_category(op)] += flops / _COUNT_BATCH
    with FlopCounterMode(display=False) as train_counter:
        out = model(x, t, y)
        # The diffusion loss is an MSE on the output: its own FLOPs are elementwise (not counted either way).
        out.float().square().mean().backward()
    return {
        "fwd": fwd_counter.get_total_flops() / _COUNT_BATCH,
        "fwd_bwd": train_counter.get_total_flops() / _COUNT_BATCH,
        "fwd_by_category": by_cat,
    }


def train_flops_per_image(model_cfg: ModelConfig, image_size: int | None = None) -> dict:
    """FLOPs per image of one training step's model forward and backward (FlopCounterMode, attention included).

    Returns {"fwd", "fwd_bwd", "fwd_by_category": {"conv", "linear", "attention"}, "params", "method",
    "executed_fwd_bwd"}, FLOPs (not MACs). The count is the reference network's (unet.reference_config: every
    computation switch off), the work the model needs: MFU divides by it, so zero padding does not raise MFU and a
    folded upsample is not charged less. `executed_fwd_bwd` is what the configured computation runs. Cached per model
    config; attn_impl does not change the count (checked on every uncached call).
    """
    executed = _sized(model_cfg, image_size)
    cfg = reference_config(executed)
    key = _key(dataclasses.replace(cfg, attn_impl="any"), "train")
    if key not in _cache:
        sdpa = _count(dataclasses.replace(cfg, attn_impl="sdpa"))
        math = _count(dataclasses.replace(cfg, attn_impl="math"))
        if (sdpa["fwd"], sdpa["fwd_bwd"]) != (math["fwd"], math["fwd_bwd"]):
            raise RuntimeError(
                f"FlopCounterMode counts SDPA ({sdpa['fwd_bwd']:.4g}) differently from the math attention "
                f"({math['fwd_bwd']:.4g}) on the meta device with torch {torch.__version__}; benchmarks/speed/flops.py "
                "assumes they agree. Count with attn_impl='math' and check the SDPA formulas in "
                "torch.utils.flop_counter."
            )
        with torch.device("meta"):
            params = sum(p.numel() for p in build_model(cfg).parameters())
        _cache[key] = {
            **math,
            "params": params,
            "method": "torch.utils.flop_counter.FlopCounterMode, meta device, forward + backward; "
            "attention included (SDPA and math counts checked equal)",
        }
    out = dict(_cache[key])
    out["executed_fwd_bwd"] = out["fwd_bwd"]
    if executed != cfg:
        ekey = _key(dataclasses.replace(executed, attn_impl="any"), "executed")
        if ekey not in _cache:
            _cache[ekey] = _count(dataclasses.replace(executed, attn_impl="math"))["fwd_bwd"]
        out["executed_fwd_bwd"] = _cache[ekey]
    return out


def published_style_flops_per_image(model_cfg: ModelConfig, image_size: int | None = None) -> dict:
    """The published table's count: torchinfo total mult-adds per image x 2 x 3 (attention matmuls count as zero).

    Returns {"mult_adds_fwd", "fwd_bwd", "method"}. Runs torchinfo on CPU with a batch of 1 (a second or two for the
    35.7M UNet); cached per model config.
    """
    import torchinfo

    cfg = reference_config(_sized(model_cfg, image_size))  # the model's work, as train_flops_per_image counts it
    key = _key(dataclasses.replace(cfg, attn_impl="any"), "published")
    if key not in _cache:
        torch.manual_seed(0)
        model = build_model(dataclasses.replace(cfg, attn_impl="math")).eval()
        x, t, y = _inputs(cfg, 1, "cpu")
        inputs = [x, t] if y is None else [x, t, y]
        with torch.no_grad():
            stats = torchinfo.summary(model, input_data=inputs, verbose=0, device="cpu")
        _cache[key] = {
            "mult_adds_fwd": float(stats.total_mult_adds),
            "fwd_bwd": float(stats.total_mult_adds) * 2 * 3,
            "method": "torchinfo total_mult_adds x 2 x 3 (attention matmuls not counted), as in the published table",
        }
    return dict(_cache[key])


def main(argv: list[str] | None = None) -> int:
    import sys

    from ffcv_ddpm.checks import Parser, fail
    from ffcv_ddpm.config import load_config
    from ffcv_ddpm.unet import PRESETS

    p = Parser(prog="python -m benchmarks.speed.flops", doc=__doc__, overrides=True,
               epilog="No --data: FLOPs follow from the model config and the image size alone (meta device).")
    p.add_argument("--preset", choices=list(PRESETS), help="one preset (default: every preset, no overrides)")
    args, overrides = p.parse_with_overrides(sys.argv[1:] if argv is None else argv)
    if overrides and not args.preset:
        return fail("flops", "KEY=VALUE overrides need --preset (the config they change)")
    try:
        configs = ({args.preset: load_config(args.preset, overrides).model} if args.preset
                   else {name: preset for name, preset in PRESETS.items()})
    except ValueError as e:
        return fail("flops", str(e))
    for name, model in configs.items():
        ours, pub = train_flops_per_image(model), published_style_flops_per_image(model)
        cats = ", ".join(f"{k} {v / 2e6:.1f}M" for k, v in ours["fwd_by_category"].items())
        print(
            f"{name:16s} params {ours['params'] / 1e6:6.2f}M  fwd {ours['fwd'] / 1e9:7.3f} GFLOP  "
            f"fwd+bwd {ours['fwd_bwd'] / 1e9:7.3f} GFLOP  (fwd MACs: {cats})  "
            f"published-style fwd+bwd {pub['fwd_bwd'] / 1e9:7.3f} GFLOP  ratio {ours['fwd_bwd'] / pub['fwd_bwd']:.2f}x"
            + (f"  (executed by this computation: {ours['executed_fwd_bwd'] / 1e9:.3f} GFLOP)"
               if ours["executed_fwd_bwd"] != ours["fwd_bwd"] else "")
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
