"""The model.* computation switches (concat_free, upsample, pad_image_channels, attn_linear, conv_bias_in_norm): the
reference network's function (fp64, forward and gradients) and state_dict, what each removes from the step, and FLOP
counts that stay the model's."""

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

from benchmarks.speed.flops import published_style_flops_per_image, train_flops_per_image
from benchmarks.speed.rows import Row
from benchmarks.speed.runner import flops_of
from ffcv_ddpm.checks import BadValue
from ffcv_ddpm.config import load_config
from ffcv_ddpm.unet import (FUSED_OFF, PRESETS, REFERENCE_COMPUTATION, DDPMResBlock, Upsample, build_model,
                            nearest_2x, reference_config)

pytestmark = pytest.mark.usefixtures("one_thread")

ALL = dict(concat_free=True, upsample="transposed", pad_image_channels=8, attn_linear=True, conv_bias_in_norm=True)
SWITCHES = {"concat_free": dict(concat_free=True), "expand": dict(upsample="expand"),
            "transposed": dict(upsample="transposed"), "pad": dict(pad_image_channels=8),
            "attn_linear": dict(attn_linear=True), "conv_bias_in_norm": dict(conv_bias_in_norm=True), "all": ALL}
# Base 12, 4 groups: the up path concatenates 24 + 12 channels in groups of 9, so a group straddles h and the skip
# (test_groups_straddle_the_concatenation checks it). Dropout on, to check that the masks line up too.
STRADDLE = dataclasses.replace(PRESETS["tiny"], base_channels=12, norm_groups=4, dropout=0.1)
ANNOTATED = dataclasses.replace(PRESETS["tiny"], arch="annotated", base_channels=8, attn_head_dim=8, norm_groups=4,
                                weight_standardize=True, stem_kernel=1, attn_resolutions=(32, 16))


def pair(cfg, switch: dict, channels_last: bool):
    """(reference model, switched model) in fp64 with the same weights, in training mode."""
    torch.manual_seed(0)
    ref = build_model(cfg).double()
    with torch.no_grad():  # GroupNorm's affine away from (1, 0), so a wrong channel-to-group map shows
        for m in ref.modules():
            if isinstance(m, torch.nn.GroupNorm):
                m.weight.uniform_(0.5, 1.5)
                m.bias.normal_()
    new = build_model(dataclasses.replace(cfg, **switch)).double()
    new.load_state_dict(ref.state_dict())  # strict: the same keys and shapes
    if channels_last:
        ref, new = (m.to(memory_format=torch.channels_last) for m in (ref, new))
    return ref, new


def run(model, x, t, seed=1):
    """Output and the gradients of every parameter and of the input, for a fixed random cotangent."""
    torch.manual_seed(seed)  # the same dropout masks in both models
    x = x.detach().clone().requires_grad_()
    out = model(x, t)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(2), dtype=out.dtype)
    grads = torch.autograd.grad(out, [x, *model.parameters()], dout)
    return out, grads


def rel_max(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-300)).item()


@pytest.mark.parametrize("channels_last", [False, True])
@pytest.mark.parametrize("impl", ["scale-shift", "torch", "fused"])
@pytest.mark.parametrize("switch", list(SWITCHES))
def test_switch_computes_the_reference_network(switch, impl, channels_last):
    ref, new = pair(dataclasses.replace(STRADDLE, norm_impl=impl), SWITCHES[switch], channels_last)
    x = torch.randn(3, 3, 32, 32, dtype=torch.float64)
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    t = torch.tensor([0, 517, 999])
    (out_r, grads_r), (out_n, grads_n) = run(ref, x, t), run(new, x, t)
    assert rel_max(out_n, out_r) < 1e-12
    names = ["input"] + [n for n, _ in ref.named_parameters()]
    for name, a, b in zip(names, grads_n, grads_r):
        assert rel_max(a, b) < 1e-11, name
    # The same layout out as the reference: nothing on the way turned channels_last into NCHW or back.
    assert out_n.stride() == out_r.stride() and grads_n[0].stride() == grads_r[0].stride()


def test_annotated_network_takes_the_switches_but_concat_free():
    switch = dict(upsample="transposed", pad_image_channels=8, attn_linear=True)
    ref, new = pair(ANNOTATED, switch, channels_last=True)
    x = torch.randn(2, 3, 32, 32, dtype=torch.float64).contiguous(memory_format=torch.channels_last)
    t = torch.tensor([3, 700])
    (out_r, grads_r), (out_n, grads_n) = run(ref, x, t), run(new, x, t)
    assert rel_max(out_n, out_r) < 1e-12
    assert all(rel_max(a, b) < 1e-11 for a, b in zip(grads_n, grads_r))
    with pytest.raises(BadValue, match="model.concat_free=True is built for arch='ddpm'"):
        load_config("annotated-small", ["model.concat_free=True"])


def test_groups_straddle_the_concatenation():
    """The exactness test above covers a GroupNorm group made of channels of both h and the skip."""
    model = build_model(dataclasses.replace(STRADDLE, concat_free=True))
    seen = []
    for stage in model.up:
        if hasattr(stage, "block"):
            norm = stage.block.norm1
            # (channels of h, channels per group) of the parts the block's first GroupNorm gets
            norm.register_forward_pre_hook(
                lambda m, args: seen.append((args[0][0].shape[1], m.num_channels // m.num_groups)))
    model(torch.randn(1, 3, 32, 32), torch.tensor([5]))
    assert len(seen) == len([s for s in model.up if hasattr(s, "block")])
    assert any(boundary % group for boundary, group in seen), seen


@pytest.mark.parametrize("preset", ["ddpm-cifar10", "annotated-small"])
def test_state_dict_unchanged(preset):
    ddpm_only = ("concat_free", "conv_bias_in_norm")
    switch = ALL if preset == "ddpm-cifar10" else {k: v for k, v in ALL.items() if k not in ddpm_only}
    with torch.device("meta"):
        ref = build_model(PRESETS[preset]).state_dict()
        new = build_model(dataclasses.replace(PRESETS[preset], **switch)).state_dict()
    assert {k: v.shape for k, v in new.items()} == {k: v.shape for k, v in ref.items()}


class ConvBackwardArgs(TorchDispatchMode):
    """The layouts of what every convolution_backward receives (grad_output, input)."""

    def __init__(self):
        super().__init__()
        self.dense = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.convolution_backward.default:
            self.dense.append(all(t.is_contiguous(memory_format=torch.channels_last) for t in args[:2]))
        return func(*args, **(kwargs or {}))


def test_concat_free_hands_cudnn_only_dense_tensors():
    """The reference's torch.cat([h, skip]) has a gradient whose channel slices reach convolution_backward as they are
    (cuDNN copies each into a dense tensor: 6.7 ms per step, benchmarks/NOTES.md item 9); without the cat, none."""
    x = torch.randn(2, 3, 32, 32, dtype=torch.float64).contiguous(memory_format=torch.channels_last)
    t = torch.tensor([3, 700])
    counts = {}
    for name, model in zip(("ref", "concat_free"), pair(STRADDLE, SWITCHES["concat_free"], channels_last=True)):
        out = model(x, t)
        with ConvBackwardArgs() as rec:
            out.square().sum().backward()
        counts[name] = (rec.dense.count(False), len(rec.dense))
    assert counts["ref"][0] > 0, counts  # the mechanism is there in the reference, so the next line means something
    assert counts["concat_free"][0] == 0, counts


def backward_ops(fn, x: torch.Tensor) -> set[str]:
    """The aten ops of fn's backward graph as AOT autograd hands it to inductor (with inductor's decompositions)."""
    from functorch.compile import make_boxed_func
    from torch._functorch.aot_autograd import aot_function
    from torch._inductor.decomposition import select_decomp_table

    ops = set()

    def record(gm, _example_inputs):
        ops.update(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return make_boxed_func(gm)

    traced = aot_function(fn, fw_compiler=lambda gm, _: make_boxed_func(gm), bw_compiler=record,
                          decompositions=select_decomp_table())
    traced(x.detach().requires_grad_()).sum().backward()
    return ops


@pytest.mark.parametrize("channels_last", [False, True])
def test_expand_upsample_backward_is_a_sum(channels_last):
    x = torch.randn(2, 5, 3, 4, dtype=torch.float64)
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    assert torch.equal(nearest_2x(x), F.interpolate(x, scale_factor=2.0, mode="nearest"))
    assert nearest_2x(x).is_contiguous(memory_format=torch.channels_last) == channels_last
    interp = backward_ops(lambda x: F.interpolate(x, scale_factor=2.0, mode="nearest"), x)
    expand = backward_ops(nearest_2x, x)
    assert any("index_put" in op for op in interp), interp  # what inductor runs for F.interpolate's backward
    assert not any("index" in op for op in expand) and any("sum" in op for op in expand), expand


def test_transposed_upsample_is_the_conv_of_the_upsampled_image_with_4_9_of_the_work():
    torch.manual_seed(0)
    ref, folded = Upsample(6, 5).double(), Upsample(6, 5, "transposed").double()
    folded.load_state_dict(ref.state_dict())
    x = torch.randn(2, 6, 5, 7, dtype=torch.float64, requires_grad=True)  # odd, non-square: every border case
    dout = torch.randn(2, 5, 10, 14, dtype=torch.float64)
    got = []
    for m in (ref, folded):
        with FlopCounterMode(display=False) as counter:
            out = m(x)
        got.append((out, *torch.autograd.grad(out, [x, *m.parameters()], dout), counter.get_total_flops()))
    (*r, flops_r), (*f, flops_f) = got
    assert all(rel_max(a, b) < 1e-12 for a, b in zip(f, r))
    assert flops_f * 9 == flops_r * 4  # 16 taps per low-resolution pixel instead of 9 per each of its 4 outputs


def test_flops_count_the_reference_network():
    """MFU divides by the model's FLOPs: padding (more work) must not raise it, the folded upsample (less work)
    is not charged less; what the computation executes is recorded beside it."""
    base = reference_config(PRESETS["ddpm-cifar10"])  # the preset itself has the switches on
    ref = train_flops_per_image(base)
    assert ref["executed_fwd_bwd"] == ref["fwd_bwd"]
    assert train_flops_per_image(PRESETS["ddpm-cifar10"])["fwd_bwd"] == ref["fwd_bwd"]
    for switch, executed in (("pad", "more"), ("transposed", "less"), ("concat_free", "same"),
                             ("attn_linear", "same"), ("conv_bias_in_norm", "same"), ("all", "less")):
        cfg = dataclasses.replace(base, **SWITCHES[switch])
        assert reference_config(cfg) == base
        f = train_flops_per_image(cfg)
        assert f["fwd_bwd"] == ref["fwd_bwd"] and f["fwd"] == ref["fwd"], switch
        assert published_style_flops_per_image(cfg)["fwd_bwd"] == published_style_flops_per_image(base)["fwd_bwd"]
        diff = f["executed_fwd_bwd"] - ref["fwd_bwd"]
        assert {"more": diff > 0, "less": diff < 0, "same": diff == 0}[executed], (switch, diff)
    assert set(REFERENCE_COMPUTATION) <= {f.name for f in dataclasses.fields(base)}
    # fused_parts reads concat_free's parts: the reference network turns it off with concat_free (the FLOP count of
    # a fused_parts row failed on an H200 at 8d99035, its reference network refused by ModelConfig.validate).
    parts = dataclasses.replace(PRESETS["ddpm-cifar10"], fused_parts=True)
    assert reference_config(parts) == base and train_flops_per_image(parts)["fwd_bwd"] == ref["fwd_bwd"]
    # norm_residual's Pending sums: counted on the reference network (torchinfo cannot follow a Pending), executed
    # as they are (the same convolutions: the same FLOPs).
    residual = dataclasses.replace(PRESETS["ddpm-cifar10"], norm_residual=True)
    assert reference_config(residual) == base
    assert train_flops_per_image(residual)["executed_fwd_bwd"] == train_flops_per_image(parts)["executed_fwd_bwd"]
    assert published_style_flops_per_image(residual)["fwd_bwd"] == published_style_flops_per_image(base)["fwd_bwd"]
    # norm_dbias needs norm_residual: off with it in the reference network (a dbias row's FLOPs were refused at
    # 0930219).
    dbias = dataclasses.replace(residual, norm_dbias=True)
    assert reference_config(dbias) == base and train_flops_per_image(dbias)["fwd_bwd"] == ref["fwd_bwd"]
    # conv_parts needs fused_parts: off with it; its two convolutions over the parts execute the one's FLOPs.
    conv = dataclasses.replace(parts, conv_parts=True)
    assert reference_config(conv) == base
    assert train_flops_per_image(conv)["executed_fwd_bwd"] == train_flops_per_image(parts)["executed_fwd_bwd"]
    # The benchmark's path: a row's FLOPs (hence its MFU) from its own overrides are the reference row's.
    row = lambda *o: Row("r", "ddpm-cifar10", o, 1024)  # noqa: E731
    padded = flops_of(row("model.pad_image_channels=8"), [])
    plain = flops_of(row("model.pad_image_channels=0"), [])
    assert padded["train"]["fwd_bwd"] == plain["train"]["fwd_bwd"]
    assert padded["train"]["executed_fwd_bwd"] > plain["train"]["executed_fwd_bwd"]
    assert flops_of(row("model.fused_parts=True"), [])["train"]["fwd_bwd"] == plain["train"]["fwd_bwd"]


@pytest.mark.parametrize("override,message", [
    ("model.upsample=bilinear", "model.upsample=bilinear: expected one of nearest, expand, transposed"),
    ("model.pad_image_channels=2", "model.pad_image_channels=2 is below in_channels=3"),
    ("model.pad_image_channels=-1", "model.pad_image_channels=-1: expected an integer >= 0"),
    ("model.conv_bias_in_norm=True model.weight_standardize=True", "model.conv_bias_in_norm=True is built for "
     "arch='ddpm' res blocks with plain 3x3 convs"),
])
def test_bad_switch_values_are_one_line(override, message):
    with pytest.raises(BadValue, match=message):
        load_config("ddpm-cifar10", override.split())
    with pytest.raises(BadValue, match="conv_bias_in_norm=True is built for arch='ddpm'"):
        load_config("annotated-small", ["model.conv_bias_in_norm=True"])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="inductor's GPU code generation needs CUDA")
def test_compiled_on_the_gpu_matches_eager_reference():
    """On the GPU, torch.compile of the switched network (channels_last, fp32 without TF32) against the eager
    reference network: forward and gradients. (Inductor's CPU backend miscompiles the concat_free GroupNorm where a
    group straddles the parts -- its loop split drops the last channels, torch 2.13 -- and the trainer never compiles
    on the CPU; benchmarks/NOTES.md item 11.)"""
    tf32 = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        cfg = dataclasses.replace(STRADDLE, base_channels=24, dropout=0.0)  # groups of 18 channels across 48 + 24
        ref, new = (m.float().cuda() for m in pair(cfg, ALL, channels_last=True))
        x = torch.randn(4, 3, 32, 32, device="cuda").contiguous(memory_format=torch.channels_last)
        t = torch.tensor([0, 10, 500, 999], device="cuda")
        outs = []
        for model, run_as in ((ref, ref), (new, torch.compile(new))):
            out = run_as(x, t)
            outs.append((out, *torch.autograd.grad(out.square().mean(), list(model.parameters()))))
        for a, b in zip(*outs):
            assert ((a - b).norm() / b.norm()).item() < 1e-4
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = tf32


def test_bench_rows_of_the_switches():
    """The reformulations row turns every switch on over the scale-shift row (the small UNet all but the DDPM ones);
    each ablation turns one back; the rows before keep the paper's computation; the defaults are the switches on."""
    from benchmarks.speed.rows import SWITCHES_ROW, table_rows

    ddpm = table_rows("ddpm-cifar10", ("data.loader=torch-memory",))
    small = table_rows("annotated-small", ("data.loader=torch-memory",))
    cfg = {r.name: load_config(r.preset, list(r.overrides)) for r in ddpm}
    names = [r.name for r in ddpm]
    before, switched = cfg["+ GroupNorm that keeps channels_last"].to_dict(), cfg[SWITCHES_ROW].to_dict()
    changed = {k for k in switched["model"] if switched["model"][k] != before["model"][k]}
    assert changed == set(REFERENCE_COMPUTATION)
    assert {k: switched["model"][k] for k in changed} == {k: getattr(PRESETS["ddpm-cifar10"], k) for k in changed}
    for name in names[:names.index(SWITCHES_ROW)]:
        assert all(getattr(cfg[name].model, k) == v for k, v in REFERENCE_COMPUTATION.items()), name
    ablations = [r for r in ddpm if r.batch == SWITCHES_ROW and r.name != "+ fused GroupNorm/SiLU/dropout kernels"]
    assert len(ablations) == 5 and not any("model.concat_free" in r.name for r in small)
    for row in ablations:
        got = cfg[row.name].to_dict()
        assert len({k for k in got["model"] if got["model"][k] != switched["model"][k]}) == 1, row.name
        assert {s: got[s] for s in ("train", "data")} == {s: switched[s] for s in ("train", "data")}, row.name
    small_cfg = load_config("annotated-small", list(next(r for r in small if r.name == SWITCHES_ROW).overrides))
    assert not small_cfg.model.concat_free and not small_cfg.model.conv_bias_in_norm
    assert small_cfg.model.upsample == "transposed"
    # fused_parts (the fused kernels' read of concat_free's parts) comes with the fused row, on the DDPM network only,
    # so the table's last row (fused + cuDNN search + CUDA graphs) computes the preset's model: the defaults.
    fused = names.index("+ fused GroupNorm/SiLU/dropout kernels")
    assert [cfg[n].model.fused_parts for n in names] == [i >= fused for i in range(len(names))]
    assert cfg[names[-1]].model == load_config("ddpm-cifar10").model
    assert not any(load_config(r.preset, list(r.overrides)).model.fused_parts for r in small)


class ConvBiases(TorchDispatchMode):
    """How many convolutions run without a bias of their own."""

    def __init__(self):
        super().__init__()
        self.no_bias = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.convolution.default and args[2] is None:
            self.no_bias += 1
        return func(*args, **(kwargs or {}))


def test_conv_bias_in_norm_takes_every_res_blocks_first_bias_into_the_norm():
    """With the switch each res block's conv1 runs bias-free (its bias rides in norm2's add), and nothing else
    changes; a pruned conv1 (a forward pre-hook makes its weight) is still called as a module."""
    ref, new = pair(STRADDLE, SWITCHES["conv_bias_in_norm"], channels_last=False)
    x, t = torch.randn(1, 3, 32, 32, dtype=torch.float64), torch.tensor([5])
    counts = []
    for model in (ref, new):
        with ConvBiases() as rec:
            model(x, t)
        counts.append(rec.no_bias)
    blocks = [m for m in new.modules() if isinstance(m, DDPMResBlock)]
    assert counts == [0, len(blocks)] and blocks
    from torch.nn.utils import prune

    prune.l1_unstructured(blocks[0].conv1, "weight", amount=0.5)
    with ConvBiases() as rec:
        new(x, t)
    assert rec.no_bias == len(blocks) - 1


def fused_switch_matches(cfg, switch: dict, kernels: bool, monkeypatch, size: int) -> torch.nn.Module:
    """The fused network with `switch` against it without, in training mode with the same dropout masks, forward and
    every gradient: through the op's plain-torch path in fp64, or its Triton kernels in fp32 (interpreted without a
    GPU). Returns the switched model."""
    from ffcv_ddpm import norm

    if kernels:
        import triton

        if not triton.knobs.runtime.interpret:  # the pair is built on the CPU; test_norm.py runs the kernels on CUDA
            pytest.skip("runs the Triton kernels on CPU tensors: needs TRITON_INTERPRET=1 (make test sets it)")
        monkeypatch.setattr(norm, "_on_triton", lambda x: True)
    ref, new = pair(cfg, switch, channels_last=True)
    ref, new = (m.float() for m in (ref, new)) if kernels else (ref, new)  # the kernels take fp32, not fp64
    x = torch.randn(2, 3, size, size, dtype=torch.float32 if kernels else torch.float64)
    x, t = x.contiguous(memory_format=torch.channels_last), torch.tensor([3, 700])
    (out_r, grads_r), (out_n, grads_n) = run(ref, x, t), run(new, x, t)
    tol = 1e-5 if kernels else 1e-12
    assert rel_max(out_n, out_r) < tol
    names = ["input"] + [n for n, _ in ref.named_parameters()]
    for name, a, b in zip(names, grads_n, grads_r):
        assert rel_max(a, b) < 10 * tol, name
    return new


@pytest.mark.parametrize("kernels", [False, True], ids=["op-on-cpu", "triton-kernels"])
def test_fused_parts_computes_the_reference_network(kernels, monkeypatch):
    """model.fused_parts: the up blocks' first fused GroupNorm reads (h, skip) as two tensors (no cat; a group
    straddles them in STRADDLE): the concatenating network's function and gradients, through the op's plain-torch
    path and through its Triton kernels (interpreted without a GPU; 8x8 images keep that fast: the reads of two
    parts do not depend on the image size, and tests/test_norm.py runs the kernels' tiling at larger ones)."""
    cfg = dataclasses.replace(STRADDLE, norm_impl="fused", concat_free=True, base_channels=8, norm_groups=4,
                              channel_mult=(1, 2), image_size=8, attn_resolutions=(4,))
    fused_switch_matches(cfg, dict(fused_parts=True), kernels, monkeypatch, 8)
    with pytest.raises(BadValue, match="fused_parts=True is the fused GroupNorm's read .* needs concat_free=True"):
        load_config("ddpm-cifar10", ["model.concat_free=False"])


# STRADDLE at 8x8 with the fused kernels reading the up blocks' parts: the base of model.conv_parts' tests.
PARTS = dataclasses.replace(STRADDLE, norm_impl="fused", concat_free=True, fused_parts=True, base_channels=8,
                            norm_groups=4, channel_mult=(1, 2), image_size=8, attn_resolutions=(4,))


# Where conv1's bias goes is the network's composition, not the kernels': the Triton kernels (interpreted: ~20 s on a
# 2-core machine) run with the preset's placement only; tests/test_norm.py checks them against the unsplit op.
@pytest.mark.parametrize("kernels,bias_in_norm", [(False, False), (False, True), (True, True)],
                         ids=["bias-in-conv-op-on-cpu", "bias-in-norm-op-on-cpu", "bias-in-norm-triton-kernels"])
def test_conv_parts_computes_the_reference_network(kernels, bias_in_norm, monkeypatch):
    """model.conv_parts: the up blocks' first fused GroupNorm writes (h, skip)'s outputs as two tensors and conv1
    runs as two convolutions over them (its weight's slices; its bias in the sum, or with conv_bias_in_norm in
    norm2's add): the network's function and gradients with the switch off, through the op's plain-torch path and
    its Triton kernels (interpreted without a GPU), a group straddling the parts. Each up block's conv1 is two
    convolutions without a bias of their own where it was one (with its bias) or one without; a pruned conv1 (a
    pre-hook makes its weight) is called as a module on the parts concatenated. Refused without fused_parts, without
    the fused kernels, and with convolutions other than plain dense ones."""
    cfg = dataclasses.replace(PARTS, conv_bias_in_norm=bias_in_norm)
    dtype = next(fused_switch_matches(cfg, dict(conv_parts=True), kernels, monkeypatch, 8).parameters()).dtype
    # The convolutions counted below are the network's, whichever path its GroupNorms take: they run on the op's
    # plain-torch path (three more forwards through the interpreted kernels took ~40% of this test's time).
    monkeypatch.undo()
    x, t = torch.randn(1, 3, 8, 8, dtype=dtype), torch.tensor([5])
    ref, new = (build_model(dataclasses.replace(cfg, conv_parts=on)).to(dtype) for on in (False, True))
    counts = []
    for model in (ref, new):
        with ConvBiases() as rec:
            model(x, t)
        counts.append(rec.no_bias)
    up = [m.block for m in new.up if hasattr(m, "block")]
    split = [b for b in up if b.norm1.split_out]  # the blocks whose parts differ in width, no others
    with torch.device("meta"):  # ddpm-cifar10's: the two 256 + 128 concatenations (32x32 and 16x16)
        blocks = [m.block for m in build_model(dataclasses.replace(PRESETS["ddpm-cifar10"], conv_parts=True)).up
                  if hasattr(m, "block")]
    assert [(b.conv1.in_channels, b.conv1.out_channels) for b in blocks if b.norm1.split_out] == [(384, 256),
                                                                                                 (384, 128)]
    assert 0 < len(split) < len(up) and counts[1] == counts[0] + len(split)
    up = split
    from torch.nn.utils import prune

    prune.l1_unstructured(up[0].conv1, "weight", amount=0.5)
    with ConvBiases() as rec:
        new(x, t)
    assert rec.no_bias == counts[1] - (2 if bias_in_norm else 1)  # conv1 one convolution again, with its bias
    with pytest.raises(BadValue, match=r"conv_parts=True convolves the two parts .* needs fused_parts=True \(and "
                                       r"concat_free=True\); set conv_parts=False"):
        load_config("ddpm-cifar10", ["model.fused_parts=False", "model.conv_parts=True"])
    with pytest.raises(BadValue, match=r"switches conv_parts are on, but norm_impl='scale-shift' runs no fused "
                                       r"kernels: turn them off with it \(model.conv_parts=False\)"):
        load_config("ddpm-cifar10", [*FUSED_OFF, "model.conv_parts=True", "model.norm_impl=scale-shift"])
    with pytest.raises(BadValue, match=r"conv_parts=True is built for res blocks with plain dense 3x3 convs"):
        load_config("ddpm-cifar10", ["model.conv_parts=True", "model.conv_groups=2"])


def test_conv_parts_loads_a_checkpoint_saved_without_it(tmp_path):
    """model.conv_parts changes how the network computes, not its parameters: a state_dict saved with the switch off
    loads (strict) into the network with it on and gives the same outputs; ddpm-cifar10's keys and shapes too."""
    torch.manual_seed(0)
    off = build_model(PARTS).double().eval()
    torch.save(off.state_dict(), tmp_path / "model.pt")
    on = build_model(dataclasses.replace(PARTS, conv_parts=True)).double().eval()
    on.load_state_dict(torch.load(tmp_path / "model.pt"))
    x, t = torch.randn(2, 3, 8, 8, dtype=torch.float64), torch.tensor([3, 700])
    with torch.no_grad():
        assert rel_max(on(x, t), off(x, t)) < 1e-12
    with torch.device("meta"):
        ref = build_model(PRESETS["ddpm-cifar10"]).state_dict()
        new = build_model(dataclasses.replace(PRESETS["ddpm-cifar10"], conv_parts=True)).state_dict()
    assert {k: v.shape for k, v in new.items()} == {k: v.shape for k, v in ref.items()}


@pytest.mark.parametrize("kernels", [False, True], ids=["op-on-cpu", "triton-kernels"])
def test_norm_switches_compute_the_reference_network(kernels, monkeypatch):
    """model.norm_saved_means, model.norm_mask_bits (the fused GroupNorm's backward from the forward's means and mask
    bits, at the res blocks' norm2: an add and dropout), model.norm_fast_silu (SiLU through tanh at every GroupNorm
    with SiLU; exact in math, so the interpreter's exact tanh matches), model.norm_x_sums (the backward's sums over x
    at every GroupNorm with SiLU), model.norm_dbias (a residual sum's bias gradient from the dx kernel) and
    model.norm_residual (each residual sum computed by the
    fused GroupNorm that reads it next, the up path's as the first of its two parts) and model.conv_parts (the up
    blocks' first GroupNorm writing two parts, conv1 over them) give the network's function and
    gradients, with the same dropout masks: through the op's plain-torch path and through its Triton kernels
    (interpreted without a GPU; 8x8 images keep that fast). Every sum is computed once, and in torch only where no
    GroupNorm reads it (the down- and upsampling convolutions). Refused without the fused kernels."""
    from ffcv_ddpm import norm
    from ffcv_ddpm.unet import Downsample

    cfg = dataclasses.replace(STRADDLE, norm_impl="fused", concat_free=True, fused_parts=True, image_size=8,
                              base_channels=8, norm_groups=4, channel_mult=(1, 2), attn_resolutions=(4,), dropout=0.3)
    switch = dict(norm_saved_means=True, norm_mask_bits=True, norm_residual=True, norm_fast_silu=True,
                  norm_x_sums=True, norm_dbias=True, conv_parts=True)
    made, in_torch = [], []
    value = norm.Pending.value
    monkeypatch.setattr(norm.Pending, "value", lambda p: (p.computed is None and in_torch.append(p), value(p))[1])
    init = norm.Pending.__init__
    monkeypatch.setattr(norm.Pending, "__init__", lambda p, *a, **k: (made.append(p), init(p, *a, **k))[0])
    new = fused_switch_matches(cfg, switch, kernels, monkeypatch, 8)
    norm2 = [m.norm2 for m in new.modules() if isinstance(m, DDPMResBlock)]
    assert norm2 and all(m.saved_means and m.mask_bits for m in norm2)
    acts = [m for m in new.modules() if isinstance(m, norm.GroupNormAct)]
    assert all(m.silu_mode == (2 if m.silu else 0) for m in acts) and {m.silu for m in acts} == {True, False}
    assert all(m.x_sums for m in acts if m.silu) and all(m.dbias for m in acts)
    blocks = [m for m in new.modules() if isinstance(m, DDPMResBlock)]
    assert 0 < sum(m.norm1.split_out for m in blocks) < len(blocks)  # conv_parts: the up blocks of uneven parts
    resamplers = [m for m in new.modules() if isinstance(m, (Downsample, Upsample))]
    assert len(in_torch) == len(resamplers) and len(made) > 2 * len(in_torch)
    assert all(p.computed is not None for p in made)
    # model.norm_pair_hash draws another mask (tests/test_norm.py checks it): here only where it goes, and refused
    pairs = build_model(load_config("ddpm-cifar10", ["model.norm_pair_hash=True"]).model)
    assert {m.norm2.pair_hash for m in pairs.modules() if isinstance(m, DDPMResBlock)} == {True}
    for key in (*switch, "norm_pair_hash"):  # norm_x_sums among them
        with pytest.raises(BadValue, match=rf"the fused GroupNorm kernels' switches {key} are on, but "
                                           rf"norm_impl='scale-shift' runs no fused kernels: turn them off with it "
                                           rf"\(model.{key}=False\) or set norm_impl=fused"):
            load_config("ddpm-cifar10", [*FUSED_OFF, f"model.{key}=True", "model.norm_impl=scale-shift"])
    # The preset's switches named at once, each with its override
    with pytest.raises(BadValue, match=r"switches fused_parts, norm_residual, norm_fast_silu, norm_pair_hash, "
                                       r"norm_x_sums are on, .* \(model.fused_parts=False model.norm_residual=False "
                                       r"model.norm_fast_silu=False model.norm_pair_hash=False "
                                       r"model.norm_x_sums=False\)"):
        load_config("ddpm-cifar10", ["model.norm_impl=torch"])
    with pytest.raises(BadValue, match="norm_dbias=True .* needs norm_residual=True; set norm_dbias=False"):
        load_config("ddpm-cifar10", ["model.norm_residual=False", "model.norm_dbias=True"])
    with pytest.raises(BadValue, match="norm_residual=True is built for arch='ddpm'"):
        load_config("annotated-small", ["model.norm_residual=True", "model.norm_impl=fused"])


def test_norm_residual_compiles_in_one_graph():
    """torch.compile (fullgraph, AOT autograd's eager backend: the graphs inductor would get) of the network with
    model.norm_residual (and norm_dbias, conv_parts): the Pending sums trace without a graph break, the fused GroupNorm
    calls that read one carry its terms (10 of the 21 here) and their backward calls return the bias's gradient, the
    up blocks' first ones (4) return two outputs and their backward calls take two gradients, and the forward and
    gradients are the eager reference network's."""
    from torch._dynamo.testing import AotEagerAndRecordGraphs

    torch._dynamo.reset()
    cfg = dataclasses.replace(STRADDLE, norm_impl="fused", concat_free=True, fused_parts=True, image_size=8,
                              base_channels=8, norm_groups=4, channel_mult=(1, 2), attn_resolutions=(4,), dropout=0.0)
    ref, new = pair(cfg, dict(norm_residual=True, norm_dbias=True, conv_parts=True), channels_last=True)
    x = torch.randn(2, 3, 8, 8, dtype=torch.float64).contiguous(memory_format=torch.channels_last)
    t = torch.tensor([3, 700])
    backend = AotEagerAndRecordGraphs()
    out_r, grads_r = run(ref, x, t)
    out_n, grads_n = run(torch.compile(new, backend=backend, fullgraph=True), x, t)
    calls = [n for gm in backend.fw_graphs for n in gm.graph.nodes if "group_norm_act" in str(n.target)]
    folded = [n for n in calls if n.args[16] is not None]  # res: the sum's terms go in
    assert len(calls) == 21 and len(folded) == 10 and sum(n.args[-1] is True for n in calls) == 2  # split_out:
    # the two up blocks whose parts differ in width
    # model.norm_dbias: the backward calls of the sums with a bias return its gradient (the fake's (C,) output);
    # model.conv_parts: those of the split outputs take out2's gradient (dout2)
    backward = [n for gm in backend.bw_graphs for n in gm.graph.nodes if "group_norm_act_backward" in str(n.target)]
    assert len(backward) == 21 and sum(n.args[-2] is True for n in backward) == 10
    assert sum(n.args[-1] is not None for n in backward) == 2
    assert rel_max(out_n, out_r) < 1e-12
    assert all(rel_max(a, b) < 1e-11 for a, b in zip(grads_n, grads_r))
