"""Smaller UNets from a trained one: unstructured and structured pruning, int8 weights, and what a deployment counts.

    prune_unstructured(model, 0.5, method="l1", scope="global")   # torch.nn.utils.prune masks (kept while training)
    make_permanent(model)                                          # masks baked in: plain weights, zeros stay zeros
    small = prune_structured(model, 0.5)                           # a narrower network (a new module; model kept)
    quantize_int8(model, "weight-only")                            # torchao int8 weights on every Conv2d and Linear
    param_counts(model), checkpoint_mb(model), forward_gflops(model, cfg)

The layers compressed are every nn.Conv2d and nn.Linear except weight-standardized convs (WSConv2d: their weights
are standardized on every forward, so a zero would not stay zero and int8 codes would be renormalized); biases,
GroupNorm parameters and the label embedding are left alone.

Unstructured pruning zeroes single weights: "global" ranks all compressed weights together (one threshold for the
whole network), "local" removes the same fraction from each layer; "l1" removes the smallest magnitudes, "random"
a seeded random choice. Tensors keep their shapes, so a dense kernel does exactly the same work afterwards.

Structured pruning removes inner channels of every residual block: the output channels of its first 3x3 conv, which
are the input channels of its second, with the time-embedding rows that feed them (ddpm: the added projection;
FiLM scale and shift rows where a block has them) and their GroupNorm parameters. Whole GroupNorm groups go, ranked by
the L1 norm of the first conv's filters summed over the group, so the statistics of the groups that stay are
unchanged and the pruned network computes what the dense one computes with those channels masked to zero
(mask_channels). The residual stream (block outputs, skips, attention, resampling) keeps its width. That equality
needs plain convolutions: a weight-standardized conv (WSConv2d, model.arch=annotated) standardizes each filter over
its input channels, so the second conv's filters would change when inputs are removed (and a masked zero would not
stay zero). Such models are refused (structured_refusal).

int8 (torchao): "weight-only" stores each weight as int8 with one scale per output channel and dequantizes it for a
float convolution on every call (IntxWeightOnlyConfig); "dynamic" also quantizes each layer's input to int8 at run
time (asymmetric, one scale per row of the last dimension) and dequantizes it before the float op: torchao's
IntxUnpackedToInt8Tensor, which its Int8DynamicActivationIntxWeightConfig builds for 2-D (Linear) weights only, so it
is built directly here for the 4-D conv weights too. Its activation scales are per row of the input's last dimension,
which for a conv input (N, C, H, W) is one scale per (n, c, h): per row of pixels of one channel, not per token as for
a Linear (QUANT_LABELS says so in every report); "dynamic-linear" is torchao's true int8 path
(Int8DynamicActivationInt8WeightConfig: int8 x int8 matmuls through torch._int_mm), which exists for nn.Linear only.
PyTorch has no int8 convolution kernel for CUDA, so no mode makes the convolutions run in int8 on a GPU.
"""

from __future__ import annotations

import copy
import io
import logging
import warnings

import torch
from torch import nn
from torch.nn.utils import prune

from ffcv_ddpm.norm import GroupNormAct
from ffcv_ddpm.unet import AnnotatedResBlock, DDPMResBlock, DDPMUNet, ImageConv2d, SelfAttention, Upsample, WSConv2d

PRUNE_METHODS = {"l1": prune.L1Unstructured, "random": prune.RandomUnstructured}
PRUNE_SCOPES = ("global", "local")
QUANT_MODES = ("weight-only", "dynamic", "dynamic-linear")
QUANT_LABELS = {"weight-only": "int8 weight-only (per output channel)",
                "dynamic": "int8 dynamic (conv activations: one scale per (n, c, h) pixel row)",
                "dynamic-linear": "int8 dynamic, Linear layers only (int8 GEMMs)"}


# ---------------------------------------------------------------------------------------------------- counting


def compressible_layers(model: nn.Module) -> list[nn.Module]:
    """Every Conv2d and Linear whose stored weight is the weight it uses (so not WSConv2d)."""
    return [m for m in model.modules() if isinstance(m, (nn.Conv2d, nn.Linear)) and not isinstance(m, WSConv2d)]


def effective(module: nn.Module, name: str) -> torch.Tensor:
    """The tensor a forward uses: weight_orig * weight_mask while torch.nn.utils.prune masks it, else the parameter."""
    if hasattr(module, name + "_mask"):
        return getattr(module, name + "_orig").detach() * getattr(module, name + "_mask")
    return getattr(module, name).detach()


def param_counts(model: nn.Module) -> tuple[int, int]:
    """(parameters, non-zero parameters) of the network as it computes (a pruned weight counts once, masked)."""
    total = nonzero = 0
    for module in model.modules():
        for name, _ in module.named_parameters(recurse=False):
            name = name.removesuffix("_orig")
            t = effective(module, name)
            total += t.numel()
            nonzero += int(torch.count_nonzero(t))
    return total, nonzero


def weight_sparsity(model: nn.Module) -> float:
    """Share of zeros among the weights of the compressible layers."""
    weights = [effective(m, "weight") for m in compressible_layers(model)]
    return sum(int((w == 0).sum()) for w in weights) / sum(w.numel() for w in weights)


def checkpoint_mb(model: nn.Module) -> float:
    """Megabytes (1e6) torch.save writes for the model's state_dict (pruning masks baked in first)."""
    model = _permanent_copy(model)
    buf = io.BytesIO()
    torch.save(model.state_dict(), buf)
    return len(buf.getvalue()) / 1e6


def sparse_checkpoint_mb(model: nn.Module) -> float:
    """checkpoint_mb with every compressible weight that is at least half zeros stored as a CSR matrix (out, rest)
    with int32 indices: 8 bytes per non-zero instead of 4 per element, so it only pays above 50% sparsity."""
    model = _permanent_copy(model)
    sparse = {id(m.weight) for m in compressible_layers(model) if (m.weight == 0).float().mean() >= 0.5}
    state = {}
    with warnings.catch_warnings():  # "sparse CSR support is in beta": storing it is all this does
        warnings.simplefilter("ignore", UserWarning)
        for key, t in model.state_dict(keep_vars=True).items():
            if id(t) in sparse:
                csr = t.detach().reshape(t.shape[0], -1).to_sparse_csr()
                t = torch.sparse_csr_tensor(csr.crow_indices().int(), csr.col_indices().int(), csr.values(),
                                            csr.shape)
            state[key] = t.detach()
    buf = io.BytesIO()
    torch.save(state, buf)
    return len(buf.getvalue()) / 1e6


def forward_gflops(model: nn.Module, in_channels: int, image_size: int, num_classes: int) -> float:
    """Forward GFLOP per image (convolutions, matmuls, attention; FlopCounterMode on a meta-device copy)."""
    from torch.utils.flop_counter import FlopCounterMode

    # A float32 copy (FLOPs do not depend on the dtype; fp32 inputs need fp32 weights): the model stays as it is.
    meta = make_permanent(copy.deepcopy(model)).to("meta", torch.float32)
    x = torch.randn(2, in_channels, image_size, image_size, device="meta")
    t = torch.zeros(2, dtype=torch.long, device="meta")
    y = torch.zeros(2, dtype=torch.long, device="meta") if num_classes else None
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        meta(x, t, y)
    return counter.get_total_flops() / 2 / 1e9


def _permanent_copy(model: nn.Module) -> nn.Module:
    if not any(prune.is_pruned(m) for m in model.modules()):
        return model
    return make_permanent(copy.deepcopy(model))


# ---------------------------------------------------------------------------------------------------- unstructured


def prune_unstructured(model: nn.Module, amount: float, method: str = "l1", scope: str = "global",
                       seed: int = 0) -> nn.Module:
    """Masks `amount` of the compressible weights in place (torch.nn.utils.prune: weight = weight_orig * weight_mask,
    so training keeps the zeros); returns the model."""
    if method not in PRUNE_METHODS:
        raise ValueError(f"pruning method {method!r}: use one of {', '.join(PRUNE_METHODS)}")
    if scope not in PRUNE_SCOPES:
        raise ValueError(f"pruning scope {scope!r}: use one of {', '.join(PRUNE_SCOPES)}")
    if not 0.0 <= amount < 1.0:
        raise ValueError(f"pruning amount {amount} must be in [0, 1)")
    # torch.nn.utils.prune views weights flat (view(-1)), which a channels_last 3x3 weight refuses: prune in NCHW,
    # then give the weights (weight_orig and its mask) their layout back.
    channels_last = any(p.dim() == 4 and not p.is_contiguous() for p in model.parameters())
    model.to(memory_format=torch.contiguous_format)
    params = [(m, "weight") for m in compressible_layers(model)]
    cls = PRUNE_METHODS[method]
    device = params[0][0].weight.device
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(seed)  # RandomUnstructured draws from the global generator
        if scope == "global":
            prune.global_unstructured(params, pruning_method=cls, amount=amount)
        else:
            for module, name in params:
                cls.apply(module, name, amount=amount)
    if channels_last:
        model.to(memory_format=torch.channels_last)
    with torch.no_grad():
        # The masked weight prune computed holds a graph (not a leaf), which deepcopy refuses; the next forward
        # computes it again with the graph, in the weight's layout.
        for module, name in params:
            setattr(module, name, effective(module, name))
    return model


def make_permanent(model: nn.Module) -> nn.Module:
    """Bakes every pruning mask into its weight (plain parameters again); in place, returns the model."""
    for module in model.modules():
        for hook in list(module._forward_pre_hooks.values()):
            if isinstance(hook, prune.BasePruningMethod):
                prune.remove(module, hook._tensor_name)
    return model


# ---------------------------------------------------------------------------------------------------- structured


def _inner(block: nn.Module) -> tuple[GroupNormAct, nn.Linear, int]:
    """The GroupNorm over a res block's inner channels, the Linear whose rows feed them, and how many row sets it has
    (ddpm: the added time projection, one; annotated: FiLM scale then shift, two)."""
    if isinstance(block, DDPMResBlock):
        return block.norm2, block.temb, 1
    return block.norm1, block.temb[1], 2


def structured_refusal(model: nn.Module) -> str | None:
    """Why prune_structured refuses `model` (None: it does not)."""
    for name, block in ((n, m) for n, m in model.named_modules() if isinstance(m, (DDPMResBlock, AnnotatedResBlock))):
        convs = (block.conv1, block.conv2)
        if any(isinstance(c, WSConv2d) for c in convs):
            return (f"structured pruning needs plain convolutions; {name} has weight-standardized ones (WSConv2d, "
                    "model.arch=annotated), whose filters are standardized over the input channels that pruning "
                    "removes, so the pruned network would not be the dense one with those channels masked")
        if not all(type(c) is nn.Conv2d and c.groups == 1 for c in convs):
            return (f"structured pruning needs dense res-block convs; {name}.conv1 is {block.conv1}: use a model "
                    "with conv_groups=1 and depthwise_separable=False")
    return None


def res_blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The residual blocks structured pruning works on; ValueError (structured_refusal) for a model it refuses."""
    reason = structured_refusal(model)
    if reason:
        raise ValueError(reason)
    return [(n, m) for n, m in model.named_modules() if isinstance(m, (DDPMResBlock, AnnotatedResBlock))]


def structured_plan(model: nn.Module, ratio: float) -> dict[str, torch.Tensor]:
    """Per res block, the sorted inner channels to keep: the (1 - ratio) share of its GroupNorm groups (at least
    one) whose first-conv filters have the largest L1 norm summed over the group."""
    if not 0.0 <= ratio < 1.0:
        raise ValueError(f"structured pruning ratio {ratio} must be in [0, 1)")
    plan = {}
    for name, block in res_blocks(model):
        norm = _inner(block)[0]
        groups, size = norm.num_groups, norm.num_channels // norm.num_groups
        l1 = block.conv1.weight.detach().abs().sum(dim=(1, 2, 3)).view(groups, size).sum(1)  # (groups,)
        kept = l1.topk(max(1, round(groups * (1 - ratio)))).indices.sort().values
        plan[name] = (kept[:, None] * size + torch.arange(size, device=kept.device)).flatten()
    return plan


@torch.no_grad()
def mask_channels(model: nn.Module, plan: dict[str, torch.Tensor]) -> nn.Module:
    """Zeroes, in place, every parameter that writes or reads the inner channels the plan drops (conv1 filters, time
    rows, GroupNorm affine, conv2 inputs): the dense network that the structurally pruned one equals (ddpm family)."""
    blocks = dict(model.named_modules())
    for name, keep in plan.items():
        block = blocks[name]
        norm, linear, sets = _inner(block)
        drop = torch.ones(norm.num_channels, dtype=torch.bool, device=keep.device)
        drop[keep] = False
        for t in (block.conv1.weight, block.conv1.bias, norm.weight, norm.bias):
            if t is not None:
                t[drop] = 0
        block.conv2.weight[:, drop] = 0
        rows = drop.repeat(sets)  # FiLM: the scale rows, then the shift rows
        linear.weight[rows] = 0
        linear.bias[rows] = 0
    return model


def prune_structured(model: nn.Module, ratio: float) -> nn.Module:
    """A copy of `model` with `ratio` of every res block's inner channels removed (see the module docstring)."""
    plan = structured_plan(model, ratio)
    small = copy.deepcopy(model)
    blocks = dict(small.named_modules())
    for name, keep in plan.items():
        _shrink_block(blocks[name], keep)
    return small


@torch.no_grad()
def _shrink_block(block: nn.Module, keep: torch.Tensor) -> None:
    norm, linear, sets = _inner(block)
    width = norm.num_channels
    block.conv1 = _conv(block.conv1, out_keep=keep)
    block.conv2 = _conv(block.conv2, in_keep=keep)
    rows = torch.cat([keep + i * width for i in range(sets)])
    small_linear = nn.Linear(linear.in_features, len(rows)).to(linear.weight)
    small_linear.weight.copy_(linear.weight[rows])
    small_linear.bias.copy_(linear.bias[rows])
    small_norm = GroupNormAct(norm.num_groups * len(keep) // width, len(keep), norm.impl, silu=norm.silu,
                              dropout=norm.p, eps=norm.eps, plan=norm.plan, **norm.switches()).to(norm.weight)
    small_norm.weight.copy_(norm.weight[keep])
    small_norm.bias.copy_(norm.bias[keep])
    if isinstance(block, DDPMResBlock):
        block.temb, block.norm2 = small_linear, small_norm
    else:
        block.temb[1], block.norm1 = small_linear, small_norm


def _conv(conv: nn.Conv2d, out_keep: torch.Tensor | None = None, in_keep: torch.Tensor | None = None) -> nn.Conv2d:
    """The same conv (class, kernel, padding, layout) restricted to some output or input channels."""
    w = conv.weight.detach()
    w = w[out_keep] if out_keep is not None else w
    w = w[:, in_keep] if in_keep is not None else w
    small = type(conv)(w.shape[1], w.shape[0], conv.kernel_size, stride=conv.stride, padding=conv.padding,
                       bias=conv.bias is not None).to(w)
    small.weight.copy_(w)
    if conv.bias is not None:
        small.bias.copy_(conv.bias[out_keep] if out_keep is not None else conv.bias)
    if conv.weight.is_contiguous(memory_format=torch.channels_last):
        small = small.to(memory_format=torch.channels_last)
    return small


# ---------------------------------------------------------------------------------------------------- int8


def import_torchao():
    """torchao, or ImportError saying how to install it. Its import warnings are quieted: without CUDA libraries its
    optional kernels do not load (the modes here do not use them), and torch 2.13 deprecates how it registers an
    enum with pytree."""
    quiet = [logging.getLogger(name) for name in ("torchao", "torch.utils._pytree")]
    levels = [log.level for log in quiet]
    for log in quiet:
        log.setLevel(logging.ERROR)
    try:
        import torchao
    except ImportError as e:
        raise ImportError(f"int8 quantization needs torchao ({e}): pip install --no-deps torchao==0.18.0") from None
    finally:
        for log, level in zip(quiet, levels):
            log.setLevel(level)
    return torchao


def reference_computation(model: nn.Module) -> nn.Module:
    """Switches a built network to the paper's computation (unet.REFERENCE_COMPUTATION) in place: the same function
    and weights. The faster forms compute with the weight itself, which torchao's int8 tensors cannot: the image
    convs pad it (constant_pad_nd), the linear attention projections flatten it (view), the concat-free skips slice
    it, the transposed upsample folds it (ddpm-cifar10's int8 rows failed on an H100 at 26cefa3 on the view); the
    res blocks' conv1 runs with its own bias again."""
    for m in model.modules():
        if isinstance(m, ImageConv2d):
            m.pad_to = 0
        elif isinstance(m, SelfAttention):
            m.linear = False
        elif isinstance(m, Upsample):
            m.impl = "nearest"
        elif isinstance(m, DDPMUNet):
            m.concat_free = False
        elif isinstance(m, DDPMResBlock):
            m.bias_in_norm = False
    return model


@torch.no_grad()
def quantize_int8(model: nn.Module, mode: str) -> nn.Module:
    """Replaces weights in place by torchao int8 tensors (see the module docstring for the modes); returns the model."""
    if mode not in QUANT_MODES:
        raise ValueError(f"int8 mode {mode!r}: use one of {', '.join(QUANT_MODES)}")
    import_torchao()
    from torchao.quantization import (
        Int8DynamicActivationInt8WeightConfig,
        IntxUnpackedToInt8Tensor,
        IntxWeightOnlyConfig,
        PerAxis,
        quantize_,
    )

    make_permanent(model)
    reference_computation(model)
    chosen = {id(m) for m in compressible_layers(model)}
    if mode == "weight-only":
        quantize_(model, IntxWeightOnlyConfig(weight_dtype=torch.int8, granularity=PerAxis(0)),
                  filter_fn=lambda m, _: id(m) in chosen)
    elif mode == "dynamic":
        for m in compressible_layers(model):
            w = m.weight.detach()
            block = (1, w.shape[1]) + (1,) * (w.dim() - 2)  # one scale per output channel
            q = IntxUnpackedToInt8Tensor.from_hp(w, block, torch.int8, activation_quantization="int8_asym_per_token")
            m.weight = nn.Parameter(q, requires_grad=False)
    else:
        quantize_(model, Int8DynamicActivationInt8WeightConfig())  # torchao's default filter: nn.Linear
    return model
