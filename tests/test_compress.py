"""ffcv_ddpm.compress: pruned models have the sparsity they claim and keep it through training, structurally pruned
models are smaller and equal their masked dense model, int8 models stay close to the float one."""
from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from benchmarks.speed.flops import train_flops_per_image
from ffcv_ddpm import compress
from ffcv_ddpm.unet import PRESETS, REFERENCE_COMPUTATION, AnnotatedResBlock, ModelConfig, build_model, count_params

pytestmark = pytest.mark.usefixtures("one_thread")

TINY = dataclasses.replace(PRESETS["tiny"], num_classes=10)  # norm_groups 4 over 8 / 16 channels
TINY_ANNOTATED = ModelConfig(arch="annotated", base_channels=8, channel_mult=(1, 2), num_res_blocks=1,
                             attn_resolutions=(16,), attn_heads=2, attn_head_dim=8, dropout=0.0, norm_groups=4,
                             weight_standardize=True, stem_kernel=1, num_classes=10)


def model_of(cfg: ModelConfig, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return build_model(cfg).eval()


def inputs(b: int = 3, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, 3, 32, 32, generator=g), torch.randint(0, 1000, (b,), generator=g), \
        torch.randint(0, 10, (b,), generator=g)


def rel_rms(a: torch.Tensor, ref: torch.Tensor) -> float:
    return ((a.double() - ref.double()).norm() / ref.double().norm()).item()


# ---------------------------------------------------------------------------------------------------- unstructured


@pytest.mark.parametrize("method", ["l1", "random"])
@pytest.mark.parametrize("scope", ["global", "local"])
@pytest.mark.parametrize("amount, channels_last", [(0.3, False), (0.9, True)])
def test_unstructured_pruning_has_the_sparsity_it_claims(method, scope, amount, channels_last):
    model = model_of(TINY)
    if channels_last:  # how the trainer and load_run keep models
        model = model.to(memory_format=torch.channels_last)
    before, nonzero_before = compress.param_counts(model)
    compress.prune_unstructured(model, amount, method=method, scope=scope, seed=1)
    layers = compress.compressible_layers(model)
    weights = [compress.effective(m, "weight") for m in layers]
    total = sum(w.numel() for w in weights)
    zeros = [int((w == 0).sum()) for w in weights]
    # torch.nn.utils.prune removes round(amount * n) entries: of all weights at once (global) or of each layer.
    if scope == "global":
        assert sum(zeros) == round(amount * total)
    else:
        assert zeros == [round(amount * w.numel()) for w in weights]
    assert compress.weight_sparsity(model) == pytest.approx(sum(zeros) / total)
    params, nonzero = compress.param_counts(model)
    assert params == before and nonzero == nonzero_before - sum(zeros)
    if method == "l1" and scope == "global":  # one threshold: every removed weight is no larger than any kept one
        flat_orig = torch.cat([m.weight_orig.detach().abs().flatten() for m in layers])
        flat_mask = torch.cat([m.weight_mask.flatten() for m in layers]).bool()
        assert flat_orig[~flat_mask].max() <= flat_orig[flat_mask].min()
    copy.deepcopy(model)  # the trainer's EMA and the study copy pruned models
    if channels_last:
        conv = model.down[0].block.conv1
        assert conv.weight_orig.is_contiguous(memory_format=torch.channels_last) and not conv.weight_orig.is_contiguous()
    x, t, y = inputs()
    assert torch.isfinite(model(x, t, y)).all()


def test_random_pruning_is_seeded():
    masks = []
    for seed in (3, 3, 4):
        model = compress.prune_unstructured(model_of(TINY), 0.5, method="random", scope="global", seed=seed)
        masks.append(torch.cat([m.weight_mask.flatten() for m in compress.compressible_layers(model)]))
    assert torch.equal(masks[0], masks[1]) and not torch.equal(masks[0], masks[2])


def test_masks_survive_training_and_make_permanent():
    model = model_of(TINY).train()
    compress.prune_unstructured(model, 0.7, scope="local")
    sparsity = compress.weight_sparsity(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x, t, y = inputs()
    for _ in range(3):
        model(x, t, y).square().mean().backward()
        opt.step()
        opt.zero_grad()
    assert compress.weight_sparsity(model) == sparsity  # weight_orig moved, the masked entries stay zero
    with torch.no_grad():
        expected = model.eval()(x, t, y)
    size_masked = compress.checkpoint_mb(model)  # measured as deployed: masks baked in
    compress.make_permanent(model)
    keys = model.state_dict().keys()
    assert not any(k.endswith(("_orig", "_mask")) for k in keys)
    assert compress.weight_sparsity(model) == sparsity
    with torch.no_grad():
        assert torch.equal(model(x, t, y), expected)
    assert compress.checkpoint_mb(model) == size_masked
    dense = model_of(TINY)
    # FLOPs of any dtype and sparsity, counted on an fp32 copy.
    assert compress.forward_gflops(copy.deepcopy(model).to(torch.bfloat16), 3, 32, 10) == \
        compress.forward_gflops(dense, 3, 32, 10)
    # Same shapes, so the same dense checkpoint; stored sparse (CSR, int32 indices) it is smaller at 70% zeros.
    assert abs(compress.checkpoint_mb(dense) - size_masked) < 0.01
    assert compress.sparse_checkpoint_mb(model) < 0.8 * size_masked


def test_pruning_refuses_bad_arguments():
    with pytest.raises(ValueError, match="method"):
        compress.prune_unstructured(model_of(TINY), 0.5, method="l2")
    with pytest.raises(ValueError, match="scope"):
        compress.prune_unstructured(model_of(TINY), 0.5, scope="layer")
    with pytest.raises(ValueError, match="amount"):
        compress.prune_unstructured(model_of(TINY), 1.0)


# ---------------------------------------------------------------------------------------------------- structured


def test_structured_pruning_shrinks_and_equals_the_masked_dense_model():
    dense = model_of(TINY)
    # Non-zero GroupNorm affines, so that a channel masked without its norm parameters would not normalize to zero.
    with torch.no_grad():
        for m in dense.modules():
            if isinstance(m, torch.nn.GroupNorm):
                m.weight.uniform_(0.5, 1.5)
                m.bias.uniform_(-0.5, 0.5)
    plan = compress.structured_plan(dense, 0.5)
    small = compress.prune_structured(dense, 0.5)
    blocks = compress.res_blocks(dense)
    assert len(plan) == len(blocks) > 0
    for (name, block), (_, sblock) in zip(blocks, compress.res_blocks(small)):
        width, keep = block.conv1.out_channels, plan[name]
        assert len(keep) == width // 2 and sblock.conv1.out_channels == width // 2
        assert sblock.conv1.weight.shape == (width // 2, block.conv1.in_channels, 3, 3)
        assert sblock.conv2.weight.shape == (block.conv2.out_channels, width // 2, 3, 3)
        assert sblock.temb.weight.shape == (width // 2, block.temb.in_features)
        assert (sblock.norm2.num_groups, sblock.norm2.num_channels) == (block.norm2.num_groups // 2, width // 2)
        assert sblock.skip.__class__ is block.skip.__class__  # the residual path keeps its width
        # The kept groups are those with the largest filter L1 norms.
        size = width // block.norm2.num_groups
        l1 = block.conv1.weight.detach().abs().sum((1, 2, 3)).view(-1, size).sum(1)
        kept_groups = keep.view(-1, size)[:, 0] // size
        dropped = torch.ones_like(l1, dtype=torch.bool)
        dropped[kept_groups] = False
        assert l1[kept_groups].min() >= l1[dropped].max()
    assert count_params(small) < count_params(dense)
    x, t, y = inputs()
    masked = compress.mask_channels(copy.deepcopy(dense), plan)
    with torch.no_grad():
        out_small, out_masked, out_dense = small(x, t, y), masked(x, t, y), dense(x, t, y)
    torch.testing.assert_close(out_small, out_masked, rtol=1e-4, atol=1e-5)
    assert rel_rms(out_masked, out_dense) > 1e-3  # masking changed the network, so the equality above means something
    assert compress.checkpoint_mb(small) < compress.checkpoint_mb(dense)
    flops = compress.forward_gflops(dense, 3, 32, 10)
    assert flops == pytest.approx(train_flops_per_image(TINY)["fwd"] / 1e9)
    assert next(dense.parameters()).device.type == "cpu"  # counted on a meta copy
    assert compress.forward_gflops(small, 3, 32, 10) < flops


def test_structured_pruning_keeps_the_fused_kernels_plan():
    """The shrunk GroupNorms run the fused kernels with the model's model.norm_plan, as the dense ones did."""
    from ffcv_ddpm.norm import GroupNormAct

    small = compress.prune_structured(model_of(dataclasses.replace(TINY, norm_impl="fused", norm_plan="2048,65536,8")),
                                      0.5)
    assert {m.plan for m in small.modules() if isinstance(m, GroupNormAct)} == {(2048, 65536, 8)}


def test_structured_pruning_refuses_weight_standardized_convs():
    """The annotated block's convs standardize each filter over its inputs: removing inputs changes the kept
    filters, and even masking them does not give the pruned network (a masked zero is standardized to non-zero).
    So the claim "pruned = dense with those channels masked" does not hold there, and such models are refused."""
    dense = model_of(TINY_ANNOTATED)
    plan = {name: torch.arange(block.conv1.out_channels // 2) for name, block in dense.named_modules()
            if isinstance(block, AnnotatedResBlock)}
    masked = compress.mask_channels(copy.deepcopy(dense), plan)
    conv2 = next(m for m in masked.modules() if isinstance(m, AnnotatedResBlock)).conv2
    var, mean = torch.var_mean(conv2.weight, dim=(1, 2, 3), keepdim=True, correction=0)
    used = (conv2.weight - mean) * torch.rsqrt(var + 1e-5)  # the weights its forward uses
    assert (used[:, conv2.in_channels // 2:] != 0).any()  # the masked inputs are read after all
    reason = compress.structured_refusal(dense)
    assert reason and "weight-standardized" in reason
    with pytest.raises(ValueError, match="weight-standardized"):
        compress.prune_structured(dense, 0.5)
    assert compress.structured_refusal(model_of(TINY)) is None


def test_structured_pruning_refuses_grouped_convs():
    with pytest.raises(ValueError, match="conv_groups=1"):
        compress.prune_structured(model_of(dataclasses.replace(TINY, conv_groups=2)), 0.5)
    with pytest.raises(ValueError, match="conv_groups=1"):
        compress.prune_structured(model_of(dataclasses.replace(TINY, depthwise_separable=True)), 0.5)
    with pytest.raises(ValueError, match="ratio"):
        compress.prune_structured(model_of(TINY), 1.0)


# ---------------------------------------------------------------------------------------------------- int8


# ddpm-cifar10's computation switches: its int8 rows failed on an H100 on each in turn (the padded image convs at
# 80f184a, the flattened attention weights at 26cefa3) before quantize_int8 switched them back to the reference.
DDPM_SWITCHES = {k: v for k, v in vars(PRESETS["ddpm-cifar10"]).items() if k in REFERENCE_COMPUTATION}


@pytest.mark.parametrize("mode, tolerance", [("weight-only", 0.02), ("dynamic", 0.05), ("dynamic-linear", 0.02)])
@pytest.mark.parametrize("switches", [REFERENCE_COMPUTATION, DDPM_SWITCHES], ids=["reference", "ddpm-cifar10-switches"])
def test_int8_output_stays_close_to_float(mode, tolerance, switches):
    """Also with ddpm-cifar10's exact reformulations, which compute with the weight itself (pad, flatten, slice,
    fold): torchao's int8 tensors support none of that."""
    pytest.importorskip("torchao")
    from torchao.utils import TorchAOBaseTensor

    assert DDPM_SWITCHES == {"concat_free": True, "upsample": "transposed", "pad_image_channels": 8,
                             "attn_linear": True, "conv_bias_in_norm": True}
    dense = model_of(dataclasses.replace(TINY, **switches))
    x, t, y = inputs()
    with torch.no_grad():
        ref = dense(x, t, y)
        q = compress.quantize_int8(copy.deepcopy(dense), mode)
        out = q(x, t, y)
    quantized = [m for m in compress.compressible_layers(q) if isinstance(m.weight, TorchAOBaseTensor)]
    linears = [m for m in compress.compressible_layers(q) if isinstance(m, torch.nn.Linear)]
    assert quantized == (linears if mode == "dynamic-linear" else compress.compressible_layers(q))
    err = rel_rms(out, ref)
    assert 0 < err < tolerance, f"{mode}: relative RMS error {err:.4f}"
    if mode != "dynamic-linear":  # int8 codes + per-channel scales: well under the fp32 checkpoint
        assert compress.checkpoint_mb(q) < 0.7 * compress.checkpoint_mb(dense)


def test_reference_computation_switches_a_built_network_back():
    """quantize_int8's first step: every switch of a built ddpm-cifar10-style network back to the value a network
    built with REFERENCE_COMPUTATION has."""
    names = ("pad_to", "linear", "impl", "concat_free", "bias_in_norm")

    def flags(model):
        return [(type(m).__name__, a, getattr(m, a)) for m in model.modules() for a in names if hasattr(m, a)]

    switched = model_of(dataclasses.replace(TINY, **DDPM_SWITCHES))
    reference = model_of(dataclasses.replace(TINY, **REFERENCE_COMPUTATION))
    assert flags(switched) != flags(reference)
    assert flags(compress.reference_computation(switched)) == flags(reference)


def test_int8_refuses_unknown_mode():
    with pytest.raises(ValueError, match="int8 mode"):
        compress.quantize_int8(model_of(TINY), "int4")
