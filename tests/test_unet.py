"""UNet presets (parameter counts, shapes), config round-trip, attention implementations, layout and compile checks."""

import dataclasses
import json

import pytest
import torch
import torch.nn.functional as F
from conftest import host_syncs

from ffcv_ddpm.unet import (
    PRESETS,
    Downsample,
    ModelConfig,
    SelfAttention,
    SeparableConv2d,
    WSConv2d,
    attention,
    build_model,
    count_params,
    timestep_embedding,
)



pytestmark = pytest.mark.usefixtures("one_thread")


# A tiny annotated-arch config, so both network families are exercised at CPU-test size.
TINY_ANNOTATED = ModelConfig(
    arch="annotated",
    base_channels=8,
    channel_mult=(1, 2),
    num_res_blocks=2,
    attn_resolutions=(32, 16),
    attn_heads=2,
    attn_head_dim=8,
    dropout=0.0,
    norm_groups=4,
    weight_standardize=True,
    stem_kernel=1,
)
TINY_CONFIGS = {"tiny": PRESETS["tiny"], "tiny-annotated": TINY_ANNOTATED,
                "tiny-torch-norm": dataclasses.replace(PRESETS["tiny"], norm_impl="torch"),
                "tiny-fused-norm": dataclasses.replace(PRESETS["tiny"], norm_impl="fused", dropout=0.1),
                "tiny-annotated-fused-norm": dataclasses.replace(TINY_ANNOTATED, norm_impl="fused", dropout=0.1),
                # Every model.* computation switch on (tests/test_computation_switches.py checks each is exact).
                "tiny-switches": dataclasses.replace(PRESETS["tiny"], concat_free=True, upsample="transposed",
                                                     pad_image_channels=8, attn_linear=True)}


def rel_rms(a: torch.Tensor, ref: torch.Tensor) -> float:
    a, ref = a.double(), ref.double()
    return ((a - ref).norm() / ref.norm()).item()


def inputs(b=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, 3, 32, 32, generator=g), torch.randint(0, 1000, (b,), generator=g)


def test_preset_parameter_counts():
    with torch.device("meta"):  # no memory, no init time: counting only needs shapes
        counts = {name: count_params(build_model(cfg)) for name, cfg in PRESETS.items()}
    assert abs(counts["ddpm-cifar10"] - 35.7e6) <= 0.1e6, counts  # Ho et al. 2020: 35.7M
    assert counts["ddpm-cifar10"] == 35_746_307  # pins the architecture; change only on purpose
    assert counts["annotated-small"] == 9_190_211  # the published MFU table's network
    assert counts["digits"] == 6_475_011  # the class-conditional network of the digits quality report
    assert 10_000 <= counts["tiny"] <= 100_000


@pytest.mark.parametrize("name", list(PRESETS))
def test_preset_shapes_meta(name):
    with torch.device("meta"):
        model = build_model(PRESETS[name])
        out = model(torch.empty(2, 3, 32, 32), torch.zeros(2, dtype=torch.long))
    assert out.shape == (2, 3, 32, 32)


@pytest.mark.parametrize("name", list(TINY_CONFIGS))
def test_tiny_forward_finite_and_depends_on_t(name):
    torch.manual_seed(0)
    model = build_model(TINY_CONFIGS[name]).eval()
    x, t = inputs()
    out = model(x, t)
    assert out.shape == x.shape and torch.isfinite(out).all()
    assert not torch.allclose(out, model(x, (t + 300) % 1000))  # the time embedding reaches the output
    assert torch.allclose(model(x, t), model(x, t.double()), atol=1e-6)  # integer and real t embed alike


def test_conditional_model_uses_labels_and_null_label_default():
    torch.manual_seed(0)
    cfg = dataclasses.replace(PRESETS["tiny"], num_classes=10)
    model = build_model(cfg).eval()
    assert count_params(model) - count_params(build_model(PRESETS["tiny"])) == 11 * 32  # (10 + null) x temb dim
    x, t = inputs()
    y = torch.tensor([0, 3, 7, 9])
    assert not torch.allclose(model(x, t, y), model(x, t, (y + 1) % 10))
    assert torch.equal(model(x, t), model(x, t, torch.full_like(y, 10)))  # y=None means the null label


def test_config_json_roundtrip_and_errors():
    for cfg in PRESETS.values():
        back = ModelConfig.from_dict(json.loads(json.dumps(cfg.to_dict())))
        assert back == cfg and isinstance(back.channel_mult, tuple) and isinstance(back.attn_resolutions, tuple)
    with pytest.raises(ValueError, match="chanel_mult"):
        ModelConfig.from_dict({"chanel_mult": [1, 2]})
    with pytest.raises(ValueError, match="norm_groups"):
        build_model(dataclasses.replace(PRESETS["tiny"], norm_groups=3))
    with pytest.raises(ValueError, match="conv_groups"):
        build_model(dataclasses.replace(PRESETS["tiny"], conv_groups=5))
    with pytest.raises(ValueError, match="arch"):
        build_model(dataclasses.replace(PRESETS["tiny"], arch="vit"))
    with pytest.raises(ValueError, match="image_size"):
        build_model(dataclasses.replace(PRESETS["ddpm-cifar10"], image_size=28))


def test_grouped_convs():
    dense = build_model(PRESETS["tiny"])
    depthwise = build_model(dataclasses.replace(PRESETS["tiny"], conv_groups=8))  # 8 = base width: depthwise there
    assert depthwise.down[0].block.conv1.groups == 8
    assert count_params(depthwise) < count_params(dense)
    x, t = inputs(2)
    assert depthwise(x, t).shape == x.shape


@pytest.mark.parametrize("name", ["tiny", "tiny-annotated"])
def test_depthwise_separable_convs(name):
    cfg = TINY_CONFIGS[name]
    dense = build_model(cfg)
    sep = build_model(dataclasses.replace(cfg, depthwise_separable=True))
    res_convs = [m for n, m in dense.named_modules() if n.endswith(("conv1", "conv2"))]
    assert res_convs and all(c.kernel_size == (3, 3) and c.groups == 1 for c in res_convs)
    # Each res-block 3x3 conv (9 cin cout weights) becomes 9 cin depthwise + cin cout pointwise weights; bias kept.
    saved = sum(9 * c.in_channels * c.out_channels - 9 * c.in_channels - c.in_channels * c.out_channels
                for c in res_convs)
    assert count_params(sep) == count_params(dense) - saved > 0
    seps = [m for m in sep.modules() if isinstance(m, SeparableConv2d)]
    assert len(seps) == len(res_convs)
    assert all(s.depthwise.groups == s.depthwise.in_channels and s.depthwise.bias is None
               and s.pointwise.kernel_size == (1, 1) for s in seps)
    assert all(isinstance(s.depthwise, WSConv2d) == cfg.weight_standardize for s in seps)
    x, t = inputs(2)
    out = sep(x, t)
    assert out.shape == x.shape and torch.isfinite(out).all()
    with pytest.raises(ValueError, match="conv_groups=1"):
        build_model(dataclasses.replace(cfg, depthwise_separable=True, conv_groups=2))
    with pytest.raises(ValueError, match="True or False"):
        build_model(dataclasses.replace(cfg, depthwise_separable="yes"))


def test_attention_sdpa_matches_math():
    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(3, 2, 4, 256, 32, generator=g).unbind(0)  # (B, heads, HW, d)
    ref = attention(q.double(), k.double(), v.double(), "math")
    for impl in ("sdpa", "math"):
        assert (attention(q, k, v, impl) - ref).abs().max() < 1e-5
        # bf16 keeps ~3 significant digits: 2% relative RMS error is the stated tolerance (measured ~0.5-1%).
        assert rel_rms(attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), impl), ref) < 2e-2


@pytest.mark.parametrize("channels_last", [False, True])
def test_attention_block_sdpa_matches_math(channels_last):
    torch.manual_seed(0)
    blocks = {impl: SelfAttention(64, 4, 16, 8, True, impl) for impl in ("sdpa", "math")}
    blocks["math"].load_state_dict(blocks["sdpa"].state_dict())
    x = torch.randn(2, 64, 16, 16)
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    with torch.no_grad():
        ref = blocks["math"].double()(x.double())
        out = {impl: b.float()(x) for impl, b in blocks.items()}
        bf16 = {impl: b.bfloat16()(x.bfloat16()) for impl, b in blocks.items()}
    for impl in blocks:
        assert (out[impl] - ref).abs().max() < 1e-5
        assert rel_rms(bf16[impl], ref) < 2e-2
    assert (out["sdpa"] - out["math"]).abs().max() < 1e-5


@pytest.mark.parametrize("name", list(TINY_CONFIGS))
def test_whole_model_sdpa_matches_math(name):
    torch.manual_seed(0)
    sdpa = build_model(TINY_CONFIGS[name]).eval()
    math_ = build_model(dataclasses.replace(TINY_CONFIGS[name], attn_impl="math")).eval()
    math_.load_state_dict(sdpa.state_dict())
    x, t = inputs(2)
    with torch.no_grad():
        a, b = sdpa(x, t), math_(x, t)
        assert (a - b).abs().max() < 1e-5
        with torch.autocast("cpu", dtype=torch.bfloat16):
            a16, b16 = sdpa(x, t), math_(x, t)
    assert a16.dtype == torch.bfloat16
    # Whole network under bf16 autocast: 3% relative RMS vs fp32 (measured ~1%), either attention.
    assert rel_rms(a16, a) < 3e-2 and rel_rms(b16, a) < 3e-2


@pytest.mark.parametrize("name", list(TINY_CONFIGS))
def test_channels_last_same_result_and_layout(name):
    torch.manual_seed(0)
    model = build_model(TINY_CONFIGS[name]).eval()
    x, t = inputs()
    with torch.no_grad():
        ref = model(x, t)
        model = model.to(memory_format=torch.channels_last)
        out = model(x.contiguous(memory_format=torch.channels_last), t)
    assert out.is_contiguous(memory_format=torch.channels_last)  # nothing on the way forced an NCHW copy out
    assert (out - ref).abs().max() < 1e-5


@pytest.mark.parametrize("name", list(TINY_CONFIGS))
def test_compiles_as_one_graph(name):
    """fullgraph=True fails on any graph break (data-dependent Python branching, untraceable calls); the eager
    backend keeps the check fast on CPU (no code generation), the tracing is the same as inductor's."""
    torch._dynamo.reset()
    model = build_model(TINY_CONFIGS[name])
    x, t = inputs(2)
    compiled = torch.compile(model, fullgraph=True, backend="eager")
    outs = []
    for m in (compiled, model):
        torch.manual_seed(0)  # the same dropout masks
        outs.append(m(x, t))
    assert torch.equal(*outs)


@pytest.mark.parametrize("base", ["tiny", "tiny-annotated"])
def test_norm_plan_reaches_every_fused_norm(base):
    """model.norm_plan is handed to every GroupNormAct of the network (res blocks, attention, output); the network
    still compiles as one graph with it, and it changes neither the state_dict nor, on CPU, the output."""
    from ffcv_ddpm.norm import DEFAULT_PLAN, GroupNormAct

    cfg = dataclasses.replace(TINY_CONFIGS[base], norm_impl="fused", dropout=0.1)
    torch.manual_seed(0)
    default = build_model(cfg)
    model = build_model(dataclasses.replace(cfg, norm_plan="2048,65536,8"))
    norms = [m for m in model.modules() if isinstance(m, GroupNormAct)]
    assert len(norms) > 4 and {m.plan for m in norms} == {(2048, 65536, 8)}
    assert {m.plan for m in default.modules() if isinstance(m, GroupNormAct)} == {DEFAULT_PLAN}
    model.load_state_dict(default.state_dict())
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend="eager")
    x, t = inputs(2)
    outs = []
    for m in (compiled, default):
        torch.manual_seed(0)  # the same dropout masks
        outs.append(m(x, t))
    assert torch.equal(*outs)
    with pytest.raises(ValueError, match="norm_plan='2048,65536,8' is the fused .* norm_impl=fused or norm_plan=''"):
        build_model(dataclasses.replace(cfg, norm_impl="scale-shift", norm_plan="2048,65536,8"))


@pytest.mark.parametrize("impl", ["scale-shift", "fused"])
@pytest.mark.parametrize("base", ["tiny", "tiny-annotated"])
def test_norm_impls_load_torch_norm_weights(impl, base):
    """The switch changes how GroupNorm is computed, not the network: the same state_dict, the same outputs."""
    torch.manual_seed(0)
    cfg = TINY_CONFIGS[base]
    ref = build_model(dataclasses.replace(cfg, norm_impl="torch")).eval()
    model = build_model(dataclasses.replace(cfg, norm_impl=impl)).eval()
    model.load_state_dict(ref.state_dict())
    x, t = inputs()
    with torch.no_grad():
        assert (model(x, t) - ref(x, t)).abs().max() < 1e-5
    with pytest.raises(ValueError, match="norm_impl='triton'"):
        ModelConfig(norm_impl="triton").validate()


def test_host_sync_detector_sees_item():
    x = torch.ones(3)
    assert host_syncs(lambda: x.sum().item()) == ["_local_scalar_dense"]
    assert "nonzero" in host_syncs(lambda: x.nonzero())


@pytest.mark.parametrize("name", list(TINY_CONFIGS))
def test_forward_backward_without_host_sync(name):
    model = build_model(dataclasses.replace(TINY_CONFIGS[name], num_classes=10))
    x, t = inputs(2)
    assert host_syncs(lambda: model(x, t, torch.tensor([1, 2])).square().mean().backward()) == []


def test_pixel_unshuffle_downsample_keeps_neighbourhoods():
    """The annotated net's downsample must put each 2x2 patch into channels (the original reshape did not)."""
    down = Downsample(1, 4, unshuffle=True)
    with torch.no_grad():
        down.conv.weight.copy_(torch.eye(4)[:, :, None, None])  # 1x1 identity: expose the unshuffled channels
        down.conv.bias.zero_()
    x = torch.arange(64.0).reshape(1, 1, 8, 8)
    out = down(x)  # (1, 4, 4, 4)
    for i in range(2):
        for j in range(2):
            assert torch.equal(out[0, 2 * i + j], x[0, 0, i::2, j::2])
    assert not torch.equal(out, x.reshape(1, 4, 4, 4))  # what the original network computed


def test_weight_standardized_conv():
    torch.manual_seed(0)
    conv = WSConv2d(4, 6, 3, padding=1)
    x = torch.randn(2, 4, 8, 8)
    w = conv.weight
    w_std = (w - w.mean(dim=(1, 2, 3), keepdim=True)) / torch.sqrt(w.var(dim=(1, 2, 3), keepdim=True, unbiased=False) + 1e-5)
    assert torch.allclose(conv(x), F.conv2d(x, w_std, conv.bias, padding=1), atol=1e-5)
    ref = conv(x)
    with torch.no_grad():  # per-filter affine changes of the weight are standardized away
        conv.weight.mul_(torch.rand(6, 1, 1, 1) * 3 + 0.5).add_(torch.randn(6, 1, 1, 1))
    assert rel_rms(conv(x), ref) < 2e-3  # not exact: eps in the variance (1e-5 vs a filter variance ~1e-2)


def test_timestep_embedding():
    t = torch.tensor([0, 1, 999])
    emb = timestep_embedding(t, 16)
    assert emb.shape == (3, 16)
    assert torch.equal(emb[0], torch.cat([torch.zeros(8), torch.ones(8)]))  # sin 0, cos 0
    assert timestep_embedding(t, 15).shape == (3, 15)
