"""model.conv_cutlass: the fused GroupNorm's op running the 3x3 convolution before it (its `cw`), with the statistics
from the tile sums of the convolution's epilogue, against conv2d + nn.GroupNorm in fp64, forward and backward; the
model with the switch against the model without it; torch.compile's view of the op. Without a GPU the op's Triton
kernels run under Triton's interpreter and the convolution with its sums is conv_cutlass.conv_sums' torch stand-in;
the tests marked cuda run CUTLASS's kernel itself (the library built by python -m ffcv_ddpm.conv_cutlass)."""

import pytest
import torch
import torch.nn.functional as F

from ffcv_ddpm import conv_cutlass as CC
from ffcv_ddpm import norm as N
from ffcv_ddpm.norm import GroupNormAct, Pending

pytestmark = pytest.mark.usefixtures("one_thread")
CL = torch.channels_last


def needs_interpreter():
    """The op's Triton kernels on CPU tensors (the convolution by conv_sums' stand-in): under Triton's interpreter,
    which conftest turns on where there is no GPU; on a GPU test_cutlass_kernel_in_the_op_* runs the kernels."""
    import triton

    if not triton.knobs.runtime.interpret:
        pytest.skip("needs TRITON_INTERPRET=1 (a machine without a GPU)")


def rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    return ((a.double() - ref.double()).norm() / ref.double().norm()).item()


def case(n, cin, cout, h, w, residual, g, dtype=torch.float32, dev="cpu"):
    """(cx, cw, res, rbias, temb): a convolution's input and weight (outputs of unit scale), a residual and its bias,
    the time embedding the GroupNorm adds; channels with different means, so the statistics' shift matters."""
    cx = torch.randn(n, cin, h, w, generator=g)
    cw = torch.randn(cout, cin, 3, 3, generator=g) / (3 * cin ** 0.5)
    res = torch.randn(n, cout, h, w, generator=g) * 2 + torch.randn(1, cout, 1, 1, generator=g) if residual else None
    rbias = torch.randn(cout, generator=g) if residual else None
    temb = torch.randn(n, cout, generator=g)
    out = [t if t is None else t.to(dev, dtype) for t in (cx, cw, res, rbias, temb)]
    for i in (0, 1, 2):
        out[i] = out[i] if out[i] is None else out[i].contiguous(memory_format=CL)
    return out


def reference(cx, cw, res, rbias, temb, gn, keep, p):
    """conv2d (+ res + bias), then nn.GroupNorm of it + temb, SiLU and dropout with a given mask: (out, s)."""
    s = F.conv2d(cx, cw, None, 1, 1)
    if res is not None:
        s = s + res + rbias[:, None, None]
    y = F.silu(gn(s + temb[:, :, None, None]))
    return torch.where(keep, y / (1 - p), 0.0), s


@pytest.mark.parametrize("kernels", [False, True], ids=["plain-torch", "triton-kernels"])
@pytest.mark.parametrize("residual,cout,groups,h", [(False, 128, 32, 16), (True, 384, 32, 8)],
                         ids=["conv1-norm2", "conv2-residual-norm1"])
def test_the_op_runs_the_convolution_and_takes_the_statistics_from_its_sums(kernels, residual, cout, groups, h,
                                                                            monkeypatch):
    """A GroupNormAct reading Pending(conv=(cx, cw)) (and a residual with its bias): the op's output, the sum s it
    returns (Pending.value()) and every gradient (cx, cw, res, the bias, temb, weight, bias; s's gradient from its
    other readers added) against conv2d + nn.GroupNorm in fp64 with the same dropout mask. Without a residual the
    convolution's output is the GroupNorm's alone: value() refuses it after, and no gradient of it is taken (the
    op's backward would otherwise read a zero one). Odd batch; 384 channels in groups of 12 (not a power of 2) with
    128-pixel maps (one tile a sample), 128 in groups of 4 with 256 pixels (two tiles a sample: the finalize combines
    tiles)."""
    if kernels:
        needs_interpreter()
        monkeypatch.setattr(N, "_on_triton", lambda x: True)
    g = torch.Generator().manual_seed(4)
    n, cin, p = 3, 16, 0.2
    cx, cw, res, rbias, temb = case(n, cin, cout, h, 16, residual, g)
    m = GroupNormAct(groups, cout, "fused", dropout=p).train()
    with torch.no_grad():
        m.weight.copy_(torch.rand(cout, generator=g) + 0.5)
        m.bias.copy_(torch.randn(cout, generator=g))
    calls = []
    monkeypatch.setattr(CC, "conv_sums", lambda *a, f=CC.conv_sums: calls.append(1) or f(*a))
    monkeypatch.setattr(N, "conv_sum", lambda *a, f=N.conv_sum: calls.append(1) or f(*a))
    leaves = [t.clone().requires_grad_() for t in (cx, cw, res, rbias, temb) if t is not None]
    lx, lw, *rest = leaves
    lres, lbias, ltemb = rest if residual else (None, None, rest[0])
    pending = Pending(None, lres, bias=lbias, conv=(lx, lw))
    out = m(pending, add=ltemb)
    if residual:
        s = pending.value()
    else:
        with pytest.raises(ValueError, match="kept for its backward only"):
            pending.value()
    assert len(calls) == 1 and out.shape == (n, cout, h, 16) and out.is_contiguous(memory_format=CL)
    keep = out != 0  # SiLU of a normalised value is never exactly 0: the zeros are dropout's
    assert 0.7 < keep.double().mean() < 0.9
    dout, ds = torch.randn(out.shape, generator=g), torch.randn(out.shape, generator=g)
    outs, couts = ((out, s), (dout, ds)) if residual else ((out,), (dout,))
    got = torch.autograd.grad(outs, [*leaves, m.weight, m.bias], couts)

    gn = torch.nn.GroupNorm(groups, cout).double()
    gn.load_state_dict(m.state_dict())
    ref_leaves = [t.detach().double().requires_grad_() for t in leaves]
    rx, rw, *rrest = ref_leaves
    rres, rb, rt = rrest if residual else (None, None, rrest[0])
    ref, ref_s = reference(rx, rw, rres, rb, rt, gn, keep, p)
    want = torch.autograd.grad((ref, ref_s)[:len(outs)], [*ref_leaves, gn.weight, gn.bias],
                               tuple(t.double() for t in couts))
    assert rel(out, ref) < 1e-5 and (not residual or rel(s, ref_s) < 1e-6)
    names = ["dcx", "dcw", *(["dres", "dbias"] if residual else []), "dtemb", "dweight", "dbias_gn"]
    for name, a, b in zip(names, got, want, strict=True):
        assert rel(a, b) < 1e-4, name


def test_where_the_kernel_does_not_apply_the_convolution_runs_first():
    """A map of 64 pixels (a 128-pixel tile would span samples), a second residual, or a value() read first: the
    convolution in torch, then what the GroupNorm did before, the same numbers; applies() says which."""
    g = torch.Generator().manual_seed(5)
    cx, cw, res, rbias, temb = case(2, 8, 128, 8, 8, True, g)
    assert not CC.applies(cx, 128) and CC.applies(torch.empty(2, 8, 8, 16), 128)
    assert not CC.applies(torch.empty(2, 8, 8, 16), 96) and not CC.applies(torch.empty(2, 4, 8, 16), 128)
    m = GroupNormAct(8, 128, "fused").train()
    h = F.conv2d(cx, cw, None, 1, 1)
    want = m(Pending(h, res, bias=rbias), add=temb)
    assert torch.allclose(m(Pending(None, res, bias=rbias, conv=(cx, cw)), add=temb), want, atol=1e-6)
    res2 = torch.randn(res.shape, generator=g)
    want2 = m(Pending(h, res, res2, rbias), add=temb)
    assert torch.allclose(m(Pending(None, res, res2, rbias, conv=(cx, cw)), add=temb), want2, atol=1e-6)
    read = Pending(None, res, bias=rbias, conv=(cx, cw))
    assert torch.allclose(read.value(), N.residual_sum(h, res, None, rbias), atol=1e-6)
    with pytest.raises(ValueError, match="give h or conv"):
        Pending(h, res, conv=(cx, cw))
    with pytest.raises(ValueError, match="bias or second residual only with a residual"):
        Pending(None, None, bias=rbias, conv=(cx, cw))
    with pytest.raises(ValueError, match="is not one the kernel takes"):
        CC.conv_sums(cx, cw, res, rbias)


def test_the_op_with_a_convolution_compiles_as_one_call_and_its_backward_as_cudnns():
    """torch.compile (fullgraph) of a GroupNormAct reading Pending(conv=...): one op call with the weight as its cw
    (the fake implementation's shapes: the convolution's output), the backward op, then aten's convolution_backward
    for the convolution's input and weight; the numbers of the eager call."""
    from torch._dynamo.testing import AotEagerAndRecordGraphs

    torch._dynamo.reset()
    g = torch.Generator().manual_seed(6)
    cx, cw, res, rbias, temb = case(2, 8, 128, 8, 16, True, g)
    m = GroupNormAct(16, 128, "fused").train()

    def f(cx, cw, res, rbias, temb):
        pending = Pending(None, res, bias=rbias, conv=(cx, cw))
        return m(pending, add=temb), pending.value()

    backend = AotEagerAndRecordGraphs()
    leaves = [t.clone().requires_grad_() for t in (cx, cw, res, rbias, temb)]
    out, s = torch.compile(f, backend=backend, fullgraph=True)(*leaves)
    (out.square().sum() + s.sum()).backward()
    fw = [n for gm in backend.fw_graphs for n in gm.graph.nodes if "group_norm_act" in str(n.target)]
    bw = [str(n.target) for gm in backend.bw_graphs for n in gm.graph.nodes if n.op == "call_function"]
    assert len(fw) == 1 and isinstance(fw[0].args[23], torch.fx.Node)  # cw
    assert fw[0].meta["val"][0].shape == (2, 128, 8, 16) and fw[0].meta["val"][5].shape == (2, 128, 8, 16)
    assert sum("group_norm_act_backward" in t for t in bw) == 1 and sum("convolution_backward" in t for t in bw) == 1
    ref = [t.clone().requires_grad_() for t in (cx, cw, res, rbias, temb)]
    want_out, want_s = f(*ref)
    (want_out.square().sum() + want_s.sum()).backward()
    assert torch.allclose(out, want_out) and torch.allclose(s, want_s)
    for a, b in zip(leaves, ref):
        assert torch.allclose(a.grad, b.grad, rtol=1e-5, atol=1e-6)


def small_ddpm(**switches):
    """A two-level ddpm of 128 channels at 16x16 (the kernel's sites) and 8x8 (not), attention at 8x8, the preset's
    switches: the up path's two residuals and the down path's Downsample reader take the other routes."""
    from ffcv_ddpm.unet import PRESETS, ModelConfig, build_model
    from dataclasses import replace

    cfg = replace(PRESETS["ddpm-cifar10"], image_size=16, channel_mult=(1, 1), num_res_blocks=1,
                  attn_resolutions=(8,), **switches)
    assert isinstance(cfg, ModelConfig)
    return build_model(cfg)


@pytest.mark.parametrize("dgrad,slot", [(False, False), (True, False), (True, True)],
                         ids=["cudnn-dgrad", "cutlass-dgrad", "cutlass-dgrad-skip-slot"])
def test_the_model_with_conv_cutlass_compiles_in_one_graph_and_computes_the_models_function(dgrad, slot, monkeypatch):
    """ddpm with model.conv_cutlass, compiled (fullgraph, AOT autograd's eager backend: the graphs inductor would
    get), against the same weights without it, eager: output and every parameter's gradient, and the sites that took
    the op's convolution: conv1 of each block at 16x16 (down 1, up 2: conv1's input is one tensor) and the last up
    block's conv2 (its residual one tensor, skip_over_parts; the output GroupNorm reads the sum alone); not the down
    block's conv2, whose sum the Downsample reads (value(), in torch), nor the first up block's, which the next
    block's GroupNorm reads with the skip as two parts: 4 calls. With model.conv_cutlass_skip_slot the up blocks'
    skip GEMMs give their parts' gradients to norm1's backward (mm_acc's slot). With model.conv_cutlass_dgrad their
    backward takes
    dx from conv_cutlass.dgrad (4 calls in the backward graph; on the CPU the transposed convolution) and only the
    weight's gradient from aten's. The op's plain-torch path: its kernels are the op tests' (under Triton's
    interpreter this network of 128 channels took 144 s)."""
    from torch._dynamo.testing import AotEagerAndRecordGraphs

    torch._dynamo.reset()
    torch.manual_seed(0)
    base = small_ddpm().train()
    fast = small_ddpm(conv_cutlass=True, conv_cutlass_dgrad=dgrad, conv_cutlass_skip_slot=slot).train()
    fast.load_state_dict(base.state_dict())
    calls = []
    monkeypatch.setattr(CC, "conv_sums", lambda *a, f=CC.conv_sums: calls.append(1) or f(*a))
    monkeypatch.setattr(N, "conv_sum", lambda *a, f=N.conv_sum: calls.append(1) or f(*a))
    g = torch.Generator().manual_seed(7)
    x = torch.randn(3, 3, 16, 16, generator=g)
    t = torch.randint(0, 1000, (3,), generator=g)
    outs, backend = [], AotEagerAndRecordGraphs()
    for model in (base, torch.compile(fast, backend=backend, fullgraph=True)):
        torch.manual_seed(1)  # the same dropout seeds, drawn in the same order
        y = model(x, t)
        y.square().mean().backward()
        outs.append((y, {k.removeprefix("_orig_mod."): p.grad for k, p in model.named_parameters()}))
    assert len(calls) == 4
    ops = [n for gm in backend.fw_graphs for n in gm.graph.nodes if "ffcv_ddpm.group_norm_act" in str(n.target)]
    assert sum(len(n.args) > 23 and isinstance(n.args[23], torch.fx.Node) for n in ops) == 4  # their cw
    # s's gradient from other readers (ds, argument 19 of the backward op) only where there is a residual sum (res,
    # argument 16 of the op): not at the convolutions the op ran alone, where it would be a zero fill and a read
    backward = [n for gm in backend.bw_graphs for n in gm.graph.nodes if "group_norm_act_backward" in str(n.target)]
    assert sum(n.args[19] is not None for n in backward) == sum(n.args[16] is not None for n in ops) > 0
    # with the slot the four up blocks' norm1 take their skip GEMM's output gradient (dres, argument 24; NOTES 52)
    assert sum(len(n.args) > 24 and n.args[24] is not None for n in backward) == (4 if slot else 0)
    targets = [str(n.target) for gm in backend.bw_graphs for n in gm.graph.nodes if n.op == "call_function"]
    assert sum("conv3x3_dgrad" in t for t in targets) == (4 if dgrad else 0)
    (y0, g0), (y1, g1) = outs
    assert rel(y1, y0) < 1e-5
    for k in g0:
        assert rel(g1[k], g0[k]) < 1e-4, k


def test_flop_counter_counts_the_convolutions_the_op_runs():
    """FlopCounterMode over a training step (on the meta device, as benchmarks.speed.flops counts): the same FLOPs
    with model.conv_cutlass as without (the op's convolutions by its formula, their backward as aten's) and with
    conv_cutlass_dgrad (conv_cutlass.dgrad's formula), where without the formulas 4 convolutions would go
    uncounted each way."""
    from torch.utils.flop_counter import FlopCounterMode

    counts = []
    for on in (False, True, "dgrad", "slot"):
        with torch.device("meta"):
            model = small_ddpm(conv_cutlass=bool(on), conv_cutlass_dgrad=on in ("dgrad", "slot"),
                               conv_cutlass_skip_slot=on == "slot")
            x, t = torch.randn(2, 3, 16, 16), torch.randint(0, 1000, (2,))
        with FlopCounterMode(display=False) as counter:
            model(x, t).square().mean().backward()
        counts.append(counter.get_total_flops())
    assert counts[3] == counts[2] == counts[1] == counts[0] > 0


def test_the_skip_over_two_parts_as_one_gemm_accumulated_onto_another():
    """skip_over_parts: the 1x1 conv over the concatenation of (h, skip) as one tensor, in fp64 the convolution's
    (without its bias), in channels_last, and its gradients (the parts' and the weight's) autograd's of it; mm_acc's
    schema, fake and autograd registration (torch.library.opcheck); compiled in one graph; bf16 activations with an
    fp32 weight under autocast."""
    from ffcv_ddpm.unet import mm_acc, skip_over_parts

    g = torch.Generator().manual_seed(9)
    conv = torch.nn.Conv2d(24, 16, 1).double()
    parts = tuple(torch.randn(3, c, 4, 8, generator=g, dtype=torch.float64).contiguous(memory_format=CL)
                  .requires_grad_() for c in (16, 8))
    out = skip_over_parts(conv, parts)
    want = F.conv2d(torch.cat(parts, 1), conv.weight)
    assert out.shape == want.shape and out.is_contiguous(memory_format=CL) and rel(out, want) < 1e-12
    dy = torch.randn(want.shape, generator=g, dtype=torch.float64)
    got = torch.autograd.grad(out, (*parts, conv.weight), dy)
    ref = torch.autograd.grad(want, (*parts, conv.weight), dy)
    assert all(rel(a, b) < 1e-12 for a, b in zip(got, ref))
    mats = [torch.randn(s, generator=g, dtype=torch.float64) for s in ((6, 5), (5, 4), (6, 3), (3, 4))]
    torch.library.opcheck(mm_acc, mats)
    with pytest.raises(ValueError, match="two parts"):
        skip_over_parts(conv, parts[:1])
    # compiled in one graph (on torch 2.11, d322256's question to autocast, torch.amp.is_autocast_available, broke
    # dynamo's graph at every up block; 2.13 traces it)
    compiled = torch.compile(lambda *p: skip_over_parts(conv, p), backend="aot_eager", fullgraph=True)
    out2 = compiled(*parts)
    assert rel(out2, want) < 1e-12
    assert all(rel(a, b) < 1e-12 for a, b in zip(torch.autograd.grad(out2, (*parts, conv.weight), dy), ref))
    with torch.autocast("cpu", dtype=torch.bfloat16):  # bf16 activations, an fp32 weight (.float() in place: last)
        low = skip_over_parts(conv.float(), tuple(p.detach().bfloat16() for p in parts))
    assert low.dtype == torch.bfloat16 and rel(low.double(), want) < 2e-2


def test_the_dgrad_op_is_the_transposed_convolution_and_its_fake_agrees():
    """conv_cutlass.dgrad on CPU tensors (the transposed convolution, in dy's layout) against autograd's dx of
    conv2d, and its fake implementation's shape and layout (torch.library.opcheck)."""
    g = torch.Generator().manual_seed(10)
    x = torch.randn(2, 16, 8, 16, generator=g, dtype=torch.float64).contiguous(memory_format=CL).requires_grad_()
    w = torch.randn(24, 16, 3, 3, generator=g, dtype=torch.float64)
    dy = torch.randn(2, 24, 8, 16, generator=g, dtype=torch.float64).contiguous(memory_format=CL)
    want, = torch.autograd.grad(F.conv2d(x, w, None, 1, 1), x, dy)
    got = CC.dgrad(dy, w)
    assert got.is_contiguous(memory_format=CL) and rel(got, want) < 1e-12
    torch.library.opcheck(torch.ops.ffcv_ddpm.conv3x3_dgrad, (dy, w), test_utils=("test_schema", "test_faketensor"))


def test_conv_cutlass_is_a_switch_of_the_fused_ddpm_blocks():
    from ffcv_ddpm.unet import PRESETS, ModelConfig, reference_config
    from dataclasses import replace

    with pytest.raises(ValueError, match="model.conv_cutlass=False"):
        replace(PRESETS["ddpm-cifar10"], norm_impl="scale-shift", fused_parts=False, norm_fast_silu=False,
                norm_residual=False, norm_pair_hash=False, norm_x_sums=False, conv_cutlass=True).validate()
    with pytest.raises(ValueError, match="conv_cutlass=True is built for arch='ddpm'"):
        ModelConfig(norm_impl="fused", conv_cutlass=True, conv_groups=2).validate()
    assert not reference_config(replace(PRESETS["ddpm-cifar10"], conv_cutlass=True)).conv_cutlass
    with pytest.raises(ValueError, match="conv_cutlass_dgrad=True is the backward of the convolutions conv_cutlass"):
        replace(PRESETS["ddpm-cifar10"], conv_cutlass_dgrad=True).validate()
    with pytest.raises(ValueError, match="conv_cutlass_skip_slot=True routes the skip GEMM of conv_cutlass's"):
        replace(PRESETS["ddpm-cifar10"], conv_cutlass_skip_slot=True).validate()


# ---------------------------------------------------------------------------------------------------- on a GPU


def needs_cutlass():
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("needs an sm90 GPU (H100/H200)")
    try:
        CC.library()
    except RuntimeError as e:
        pytest.skip(str(e))


@pytest.mark.parametrize("dgrad", [False, True], ids=["cudnn-dgrad", "cutlass-dgrad"])
@pytest.mark.parametrize("residual,cout,h", [(False, 128, 32), (True, 256, 16)])
def test_cutlass_kernel_in_the_op_against_the_presets_path(residual, cout, h, dgrad):
    """On an H100/H200, bf16: the op running CUTLASS's convolution with its sums (and with model.conv_cutlass_dgrad
    its backward's dx by CUTLASS's dgrad) against the preset's path (cuDNN's convolution, then the op's statistics
    kernel, which adds the residual and bias as it reads): s, out and every gradient within bf16's rounding; the
    kernel's sums those of the s it wrote."""
    needs_cutlass()
    g = torch.Generator().manual_seed(8)
    cx, cw, res, rbias, temb = case(8, 128, cout, h, h, residual, g, torch.bfloat16, "cuda")
    rbias, temb = (None if rbias is None else rbias.float()), temb.float()
    m = GroupNormAct(32, cout, "fused", dropout=0.1).cuda().train()
    s_k, sums = CC.conv_sums(cx, cw, res, rbias)
    assert rel(sums, CC.tile_sums(s_k)) < 1e-5
    results, dout, ds = [], None, None
    for kernel in (True, False):
        leaves = [t.clone().requires_grad_() for t in (cx, cw, res, rbias, temb) if t is not None]
        lx, lw, *rest = leaves
        lres, lbias, ltemb = rest if residual else (None, None, rest[0])
        if kernel:
            x = Pending(None, lres, bias=lbias, conv=(lx, lw), cutlass_dgrad=dgrad)
        else:
            h = F.conv2d(lx, lw, None, 1, 1)
            x = Pending(h, lres, bias=lbias) if residual else h
        torch.manual_seed(2)  # the same dropout mask
        out = m(x, add=ltemb)
        s = N.resolved(x) if residual else out  # (without a residual the op keeps the convolution's output)
        if dout is None:
            dout, ds = torch.randn(out.shape, generator=g).to(out), torch.randn(s.shape, generator=g).to(s)
        results.append((out, s, torch.autograd.grad((out, s), leaves, (dout, ds))))
    (o1, s1, g1), (o0, s0, g0) = results
    assert rel(s1, s0) < 1e-2 and rel(o1, o0) < 2e-2
    for a, b in zip(g1, g0, strict=True):
        assert rel(a, b) < 3e-2


@pytest.mark.parametrize("silu,drop", [(2, "pair"), (2, "value"), (2, None), (1, "pair"), (1, None), (0, "value")])
def test_cutlass_kernel_dgrad_sums_in_every_mode(silu, drop):
    """On an H100/H200: the act-sums dgrad (NOTES 50's measurement config) in each SiLU mode and dropout form its
    epilogue compiles (the benchmark runs the preset's, mode 2 with the pair hash, only): dx the plain dgrad's, the
    sums act_sums' of that dx with norm.keep_mask's mask."""
    needs_cutlass()
    g = torch.Generator().manual_seed(11)
    n, c, k, h = 4, 128, 128, 16
    dy = torch.randn(n, k, h, h, generator=g).to("cuda", torch.bfloat16).contiguous(memory_format=CL)
    w = (torch.randn(k, c, 3, 3, generator=g) / 30).to("cuda", torch.bfloat16).contiguous(memory_format=CL)
    x = (torch.randn(n, c, h, h, generator=g) * 2 + 0.5).to("cuda", torch.bfloat16).contiguous(memory_format=CL)
    coef = torch.stack([torch.rand(n, c, generator=g) + 0.5, torch.randn(n, c, generator=g)], 1).cuda()
    kw, keep = {}, None
    if drop:
        pair = drop == "pair"
        thr, inv_keep = N._dropout_args(0.1, pair)
        seed = torch.tensor([1234], device="cuda")
        kw = dict(seed=seed, thr=thr, inv_keep=inv_keep, pair=pair)
        keep = N.keep_mask(seed.cpu(), (n, c, h, h), 0.1, pair)
    dx, sums = CC.conv3x3_dgrad_sums(dy, w, CC.config_named(CC.DGRAD_SUMS_CONFIG), x, coef, silu, **kw)
    assert rel(dx, F.conv_transpose2d(dy.float(), w.float(), padding=1)) < 1e-2
    want = CC.act_sums(dx, x, coef, silu, keep, kw.get("inv_keep", 1.0))
    assert max(rel(a, b) for a, b in zip(sums, want)) < 1e-4


def test_a_skip_weight_the_op_cannot_take_is_refused():
    """group_norm_act's skip_w: a 1x1 weight over the two parts it reads, nothing else."""
    x, x2 = torch.randn(2, 8, 4, 4), torch.randn(2, 4, 4, 4)
    args = (torch.ones(2, 12), torch.zeros(2, 12), None, torch.tensor([0]), 4, 1e-5, 1, 0.0, *N.plan_args(N.DEFAULT_PLAN))
    flags = (False, False, None, None, None, False, False, False, False)
    with pytest.raises(ValueError, match="skip_w is a 1x1 weight over two parts of 8 \\+ 4 channels; got \\(16, 10\\)"):
        N.group_norm_act(x, *args, x2, *flags, None, False, torch.randn(16, 10))
    out = N.group_norm_act(x, *args, x2, *flags, None, False, torch.randn(16, 12))
    assert out[-1].shape == (32, 16)  # the slot: N*H*W x Cout


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_cutlass_kernel_skip_gradients_through_the_slot_are_the_gemms(device):
    """The up block's skip GEMM (unet.mm_acc) with norm1's slot: the parts' gradients accumulated into the fused
    GroupNorm's dx and dx2 by its backward, against mm_acc's own (the GEMMs, then autograd's add): fp64 on the CPU
    (exact), bf16 through the Triton kernels on an H100/H200 (within bf16's rounding: one rounding fewer)."""
    from ffcv_ddpm.unet import mm_acc

    if device == "cuda":
        needs_cutlass()
    dt = torch.float64 if device == "cpu" else torch.bfloat16
    g = torch.Generator().manual_seed(12)
    n, c1, c2, cout, h = 2, 64, 32, 48, 8
    parts = [torch.randn(n, c, h, h, generator=g).to(device, dt).contiguous(memory_format=CL) for c in (c1, c2)]
    w = (torch.randn(cout, c1 + c2, generator=g) / 10).to(device, dt)
    m = GroupNormAct(16, c1 + c2, "fused", parts=True).to(device, torch.float64 if device == "cpu" else torch.float32)
    dout = torch.randn(n, c1 + c2, h, h, generator=g).to(device, dt)
    dy = torch.randn(n * h * h, cout, generator=g).to(device, dt)
    grads = []
    for slot_path in (True, False):
        leaves = [p.clone().requires_grad_() for p in parts]
        out, slot = m(leaves, skip=w if slot_path else None) if slot_path else (m(leaves), None)
        assert (slot is not None) == slot_path
        a, a2 = (p.permute(0, 2, 3, 1).reshape(n * h * h, -1) for p in leaves)
        y = mm_acc(a, w[:, :c1].t(), a2, w[:, c1:].t(), slot, True)  # (the first part no residual sum: both)
        grads.append(torch.autograd.grad(((out.float() * dout.float()).sum(), (y.float() * dy.float()).sum()),
                                         leaves))
    for got, want in zip(*grads):
        assert got.is_contiguous(memory_format=CL) and rel(got, want) < (1e-12 if device == "cpu" else 1e-2)
