"""The GroupNorm(+SiLU, dropout, add, FiLM) implementations against nn.GroupNorm, and the fused op's Triton kernels
(run by Triton's interpreter: conftest sets TRITON_INTERPRET=1 on machines without a GPU)."""

import pytest
import torch
import torch.nn.functional as F

from ffcv_ddpm import norm as N
from ffcv_ddpm.norm import GroupNormAct

pytestmark = pytest.mark.usefixtures("one_thread")


def rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    return ((a.double() - ref.double()).norm() / ref.double().norm()).item()


def spread_input(shape, g: torch.Generator, dtype=torch.float64) -> torch.Tensor:
    """Channels with different means and spreads, so within-group and between-channel variance both count."""
    c = shape[1]
    return (torch.randn(shape, generator=g, dtype=torch.float64) * (torch.rand(1, c, 1, 1, generator=g, dtype=torch.float64) * 3 + 0.1)
            + torch.randn(1, c, 1, 1, generator=g, dtype=torch.float64) * 2).to(dtype)


def torch_reference(x, weight, bias, groups, add=None, film=None, silu=True, keep=None, p=0.0):
    """What the UNets computed before GroupNormAct: nn.GroupNorm and separate ops, with a given dropout mask."""
    if add is not None:
        x = x + add[:, :, None, None]
    y = F.group_norm(x, groups, weight, bias, 1e-5)
    if film is not None:
        y = y * (film[0][:, :, None, None] + 1) + film[1][:, :, None, None]
    if silu:
        y = F.silu(y)
    return y if keep is None else torch.where(keep, y / (1 - p), 0.0)


def grads(fn, leaves, dout):
    leaves = [t.detach().clone().requires_grad_() for t in leaves]
    out = fn(*leaves)
    return (out, *torch.autograd.grad(out, leaves, dout))


@pytest.mark.parametrize("impl", ["torch", "scale-shift", "fused"])
@pytest.mark.parametrize("channels_last", [False, True])
@pytest.mark.parametrize("variant", ["plain", "no-silu", "add", "film"])
def test_group_norm_act_matches_torch_fp64(impl, channels_last, variant):
    """Forward and backward (input, weight, bias, add, FiLM) in fp64 on CPU against F.group_norm and friends; the
    input's layout is kept by the output and by the input's gradient."""
    g = torch.Generator().manual_seed(0)
    n, c, groups = 3, 12, 4
    x = spread_input((n, c, 5, 7), g)
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    m = GroupNormAct(groups, c, impl, silu=variant != "no-silu").double()
    with torch.no_grad():
        m.weight.copy_(torch.randn(c, generator=g) + 1)
        m.bias.copy_(torch.randn(c, generator=g))
    extra = [torch.randn(n, c, generator=g, dtype=torch.float64) for _ in range({"add": 1, "film": 2}.get(variant, 0))]

    dout = torch.randn(x.shape, generator=g, dtype=torch.float64)
    ref = grads(lambda x, w, b, *e: torch_reference(x, w, b, groups, e[0] if variant == "add" else None,
                                                    tuple(e) if variant == "film" else None, variant != "no-silu"),
                [x, m.weight.detach(), m.bias.detach(), *extra], dout)
    m.zero_grad()
    xi, ei = x.detach().clone().requires_grad_(), [e.detach().clone().requires_grad_() for e in extra]
    y = m(xi, add=ei[0] if variant == "add" else None, film=tuple(ei) if variant == "film" else None)
    y.backward(dout)
    got = (y, xi.grad, m.weight.grad, m.bias.grad, *(e.grad for e in ei))
    for name, a, b in zip(["out", "dx", "dweight", "dbias", "dextra0", "dextra1"], got, ref):
        assert rel(a, b) < 1e-10, name
    if channels_last:
        assert y.is_contiguous(memory_format=torch.channels_last) and xi.grad.is_contiguous(memory_format=torch.channels_last)


@pytest.mark.parametrize("pair_hash", [False, True], ids=["hash-an-element", "hash-a-pair"])
def test_fused_dropout_mask_is_shared_by_forward_and_backward(pair_hash):
    """The backward recomputes the forward's mask (one hash an element, or a pair of channels: pair_hash): gradients
    match the reference with the mask read off the output; a new call draws a new mask; eval mode has none."""
    g = torch.Generator().manual_seed(1)
    x = spread_input((4, 8, 6, 6), g)
    m = GroupNormAct(2, 8, "fused", dropout=0.3, pair_hash=pair_hash).double()
    xi = x.clone().requires_grad_()
    y = m(xi)
    keep = y != 0
    assert 0.6 < keep.double().mean() < 0.8
    dout = torch.randn(x.shape, generator=g, dtype=torch.float64)
    y.backward(dout)
    ref_y, ref_dx = grads(lambda x: torch_reference(x, m.weight.detach(), m.bias.detach(), 2, keep=keep, p=0.3), [x], dout)
    assert rel(y, ref_y) < 1e-12 and rel(xi.grad, ref_dx) < 1e-10
    assert not torch.equal(m(x) != 0, keep)
    assert (m.eval()(x) != 0).all()


# ---------------------------------------------------------------------------------------------------- Triton kernels

CASES = [  # (n, c, h, w, groups, silu, p, add, channels_last, dtype); n >= 8 takes the one-launch path
    (2, 16, 4, 4, 4, True, 0.0, False, True, torch.float32),
    (2, 16, 4, 4, 4, True, 0.0, True, False, torch.float32),
    (3, 24, 5, 3, 2, True, 0.3, True, True, torch.float32),   # groups of 12 channels: padded tiles
    (3, 12, 8, 8, 4, False, 0.0, False, True, torch.float32),
    (16, 24, 4, 4, 8, True, 0.1, True, True, torch.float32),
    (2, 32, 16, 16, 8, True, 0.1, True, True, torch.bfloat16),
    # silu=2 (model.norm_fast_silu): SiLU and its derivative through tanh(y / 2); the interpreter's tanh is exact
    (3, 24, 5, 3, 2, 2, 0.3, True, True, torch.float32),
    (2, 32, 16, 16, 8, 2, 0.1, True, True, torch.bfloat16),
]


# The first default plan: at these tests' small shapes it splits a sample's reductions over several programs (the
# default's 65536-element chunks hold a whole test sample).
FIRST_PLAN = (1024, 16384, 4)


def needs_triton():
    import triton

    if not (torch.cuda.is_available() or triton.knobs.runtime.interpret):
        pytest.skip("needs a GPU or TRITON_INTERPRET=1")


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c[:9])) + f"-{c[9]}".replace("torch.", ""))
def test_triton_kernels_against_reference(case):
    """The kernels (interpreted without a GPU) against fp64 math with the same per-(n, c) a, b, e and the same
    dropout mask (the kernels' hash, which keep_mask reproduces): forward, mean/rstd, every gradient. The inputs have
    |mean| >> std in places (shifted-sum stability)."""
    check_kernels(case, N.DEFAULT_PLAN)


def check_kernels(case, plan, pair_hash=False, x_sums=False):
    """test_triton_kernels_against_reference's checks, the kernels launched with `plan` (tile, chunk, warps[,
    stages]), the dropout mask hashed a pair of channels at a time with pair_hash, the backward's sums over x with
    x_sums."""
    needs_triton()
    n, c, h, w, groups, silu, p, add, cl, dtype = case
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(0)
    x = (spread_input((n, c, h, w), g) + 20).to(dtype).to(dev)
    if cl:
        x = x.contiguous(memory_format=torch.channels_last)
    a, b = (torch.randn(n, c, generator=g).to(dev) for _ in range(2))
    e = torch.randn(n, c, generator=g).to(dev) if add else None
    seed = torch.tensor([1234], device=dev)
    out, mean, rstd, cmean, bits, s, out2 = N.triton_forward(x, a, b, e, seed, groups, 1e-5, silu, p, *plan,
                                                             pair_hash=pair_hash)
    # only when asked for (test_saved_means_..., _residual_..., _split_output_...)
    assert cmean.numel() == bits.numel() == s.numel() == out2.numel() == 0
    xd = x.double()
    leaves = [xd, a.double(), b.double()] + ([e.double()] if add else [])

    def fn(x, a, b, *e):
        return N._reference_math(x, a, b, e[0] if e else None, seed.cpu(), groups, 1e-5, silu, p, pair_hash)[0]

    ref_out, ref_mean, ref_rstd, _, _ = N._reference_math(*leaves[:3], leaves[3] if add else None, seed.cpu(),
                                                          groups, 1e-5, silu, p, pair_hash)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    if silu == 2 and dev == "cuda":
        tol = max(tol, 2e-3)  # tanh.approx.f32: ~2^-11 relative, what the switch trades for one MUFU op
    assert torch.isfinite(out).all() and rel(out, ref_out) < tol
    if p > 0:  # the same elements dropped, and about p of them
        assert torch.equal(out == 0, ref_out == 0)
        assert abs((out == 0).double().mean().item() - p) < 0.05
    assert rel(mean, ref_mean) < 1e-6 and rel(rstd, ref_rstd) < 1e-5
    assert out.stride() == x.stride()

    dout = torch.randn(x.shape, generator=g).to(dtype).to(dev)
    dx, da, db, de, dx2, _ = N.triton_backward(dout, x, a, b, e, seed, mean, rstd, groups, silu, p, *plan,
                                               pair_hash=pair_hash, x_sums=x_sums)
    assert dx2.numel() == 0  # one part
    _, *ref_grads = grads(fn, leaves, dout.double())
    for name, got, want in zip(["dx", "da", "db", "de"], [dx, da, db, de], ref_grads):
        assert rel(got, want) < tol, name
    assert dx.stride() == x.stride()


@pytest.mark.parametrize("plan,cases", [((1024, 8192, 4), (2, 5)), ((8192, 131072, 8), (2, 5)), ((16, 16, 1), (2,)),
                                        ((1024, 16384, 4, 3), (2, 5)), ((16, 16, 1, 4), (2,))],
                         ids=["grid-smallest", "grid-largest", "a-row-per-tile", "stages-3", "stages-4-row-per-tile"])
def test_triton_kernels_under_the_swept_plans(plan, cases):
    """benchmarks.speed.norm_bench --plans grid times the kernels under other tile, chunk and warp plans: the
    extremes of its grid, and the least plan model.norm_plan allows (a tile of fewer elements than a row has
    channels: one row per tile), compute the same as the default plan (padded tiles, dropout, add, bf16); --plans
    stages the reductions' loops pipelined (the interpreter runs them as plain loops: on a GPU this checks what
    Triton's pipeliner makes of them)."""
    for i in cases:
        check_kernels(CASES[i], plan)


# 120 channels in groups of 12, NCHW, 3x3 pixels: a group straddles the two parts' boundary (c1 = 41).
WIDE_CASE = (2, 120, 3, 3, 10, False, 0.0, True, False, torch.float32)


@pytest.mark.parametrize("plan", [N.DEFAULT_PLAN, FIRST_PLAN], ids=["default-plan", "first-plan"])
@pytest.mark.parametrize("case", [CASES[2], CASES[4], CASES[5], WIDE_CASE], ids=lambda c: f"c{c[1]}-g{c[4]}")
def test_two_parts_compute_what_their_concatenation_does(case, plan):
    """model.fused_parts: the kernels read the parts of a channel concatenation where they lie (the up path's
    (h, skip), a group straddling both) and write dx as two tensors: the same numbers as the concatenated tensor,
    forward, statistics and every gradient, under both plans. Equal to fp32 rounding: the GPU's code for the two
    reads may contract or order the arithmetic differently (a bf16 output then differs by one bf16 step in a few
    elements: H200, 8d99035); a part read from the wrong place would differ everywhere by O(1)."""
    needs_triton()
    n, c, h, w, groups, silu, p, add, cl, dtype = case
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(1)
    x = (spread_input((n, c, h, w), g) + 3).to(dtype).to(dev)
    fmt = torch.channels_last if cl else torch.contiguous_format
    c1 = c // 3 + 1  # not on a group boundary
    x1, x2 = (t.contiguous(memory_format=fmt) for t in x.split([c1, c - c1], 1))
    x = x.contiguous(memory_format=fmt)
    a, b = (torch.randn(n, c, generator=g).to(dev) for _ in range(2))
    e = torch.randn(n, c, generator=g).to(dev) if add else None
    seed = torch.tensor([99], device=dev)
    whole = N.triton_forward(x, a, b, e, seed, groups, 1e-5, silu, p, *plan)
    split = N.triton_forward(x1, a, b, e, seed, groups, 1e-5, silu, p, *plan, x2=x2)
    step = 1e-6 if dtype == torch.float32 else 2**-7  # fp32 rounding; one bf16 step (8 significant bits)
    for name, got, want, rtol in zip(("out", "mean", "rstd"), split, whole, (step, 1e-5, 1e-5)):
        assert torch.allclose(got.float(), want.float(), rtol=rtol, atol=1e-6), name
    assert split[0].stride() == whole[0].stride()
    dout = torch.randn(x.shape, generator=g).to(dtype).to(dev).contiguous(memory_format=fmt)
    dx, da, db, de, empty, _ = N.triton_backward(dout, x, a, b, e, seed, whole[1], whole[2], groups, silu, p, *plan)
    dx1, da1, db1, de1, dx2, _ = N.triton_backward(dout, x1, a, b, e, seed, whole[1], whole[2], groups, silu, p,
                                                   *plan, x2=x2)
    assert empty.numel() == 0 and dx1.stride() == x1.stride() and dx2.stride() == x2.stride()
    for name, got, want, rtol in zip(("dx", "da", "db", "de"), (torch.cat((dx1, dx2), 1), da1, db1, de1),
                                     (dx, da, db, de), (step, 1e-5, 1e-5, 1e-5)):
        assert torch.allclose(got.float(), want.float(), rtol=rtol, atol=1e-6), name


# (case, plan): dropout and an add, as the res blocks' norm2. 40 channels take two mask words a row, the second one
# partly (a tile of 64 channels), 8 channels one word of 8 bits. The default plan holds a test sample in one
# reduction program; the small plans split it over several, whose partial sums of xhat the means replace.
SWITCH_CASES = [(CASES[2], N.DEFAULT_PLAN), ((2, 32, 8, 8, 8, True, 0.1, True, True, torch.bfloat16), N.DEFAULT_PLAN),
                ((2, 40, 3, 5, 4, True, 0.25, True, True, torch.float32), (128, 256, 2)),
                ((3, 8, 4, 4, 2, False, 0.5, True, False, torch.float32), (32, 64, 1))]


@pytest.mark.parametrize("case,plan", SWITCH_CASES, ids=lambda c: f"c{c[1]}-p{c[6]}-{str(c[9])[6:]}"
                         if len(c) == 10 else ",".join(map(str, c)))
def test_saved_means_and_mask_bits_compute_what_the_kernels_did(case, plan):
    """model.norm_saved_means and model.norm_mask_bits: the forward keeps the per-channel means of x + e and the
    dropout mask as bits (norm.keep_mask's mask, in conv_gn.keep_bits' layout), and the backward reads them: the
    same forward, dx, da and db to the last bit, dL/de (the one gradient the means give) to fp32 rounding. The
    backward is handed another seed, so that only a mask read from the bits can give the same numbers."""
    needs_triton()
    from ffcv_ddpm import conv_gn

    n, c, h, w, groups, silu, p, add, cl, dtype = case
    plan4 = N.plan_args(plan)  # x2 and the switches come after all four parts
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(4)
    x = (spread_input((n, c, h, w), g) + 20).to(dtype).to(dev)
    x = x.contiguous(memory_format=torch.channels_last if cl else torch.contiguous_format)
    assert plan == N.DEFAULT_PLAN or N._plan(x, groups, *plan[:2])["K"] > 1
    a, b, e = (torch.randn(n, c, generator=g).to(dev) for _ in range(3))
    seed = torch.tensor([4321], device=dev)
    plain = N.triton_forward(x, a, b, e, seed, groups, 1e-5, silu, p, *plan4)
    kept = N.triton_forward(x, a, b, e, seed, groups, 1e-5, silu, p, *plan4, None, True, True)
    for name, got, want in zip(("out", "mean", "rstd"), kept, plain):
        assert torch.equal(got, want), name
    cmean, bits = kept[3:5]
    want_mean = (x.double().mean((2, 3)) + e.double()).float()
    assert cmean.shape == (n, c) and rel(cmean, want_mean) < 1e-6
    assert torch.equal(bits, N.pack_bits(N.keep_mask(seed.cpu(), tuple(x.shape), p)).to(dev))
    assert torch.equal(bits, conv_gn.keep_bits(seed, tuple(x.shape), p))
    assert torch.equal(conv_gn.unpack_bits(bits, tuple(x.shape)), plain[0] != 0)  # the zeros are dropout's
    dout = torch.randn(x.shape, generator=g).to(dtype).to(dev)
    want = N.triton_backward(dout, x, a, b, e, seed, *plain[1:3], groups, silu, p, *plan4)
    other_seed = torch.tensor([1], device=dev)
    got = N.triton_backward(dout, x, a, b, e, other_seed, *kept[1:3], groups, silu, p, *plan4, None, cmean, bits)
    for name, u, v in zip(("dx", "da", "db"), got, want):
        assert torch.equal(u, v), name
    assert rel(got[3], want[3]) < 1e-5, "de"
    # Each switch alone: the means without the bits, the bits without the means.
    assert torch.equal(N.triton_backward(dout, x, a, b, e, seed, *kept[1:3], groups, silu, p, *plan4, None,
                                         cmean, None)[3], got[3])
    assert torch.equal(N.triton_backward(dout, x, a, b, e, other_seed, *kept[1:3], groups, silu, p, *plan4, None,
                                         None, bits)[3], want[3])
    # Without an add there are no means to keep, without dropout no bits: empty outputs, the kernels as before.
    none = N.triton_forward(x, a, b, None, seed, groups, 1e-5, silu, 0.0, *plan4, None, True, True)
    assert none[3].numel() == none[4].numel() == 0


@pytest.mark.parametrize("two", [False, True], ids=["one-part", "two-parts"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_residual_sum_folded_into_the_statistics(two, dtype):
    """model.norm_residual: the first part given as the terms of s = h + res + res2 + bias (one term NCHW, to be read
    in the input's layout): the statistics kernel writes s (rounded once, as inductor's fused sum) and the op computes
    what it computes on s, forward and backward; the backward adds the gradient s gets elsewhere (ds) to dx, dx2 without
    it. Two parts: the sum is the first (the up path's h), a group straddling both (c1 = 9, groups of 4)."""
    needs_triton()
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(6)
    n, c1, c2, h, w, groups, p = 2, 9 if two else 24, 7, 3, 5, 4, 0.2
    c = c1 + (c2 if two else 0)
    cl = torch.channels_last

    def tensor(ch, fmt=cl):
        return torch.randn(n, ch, h, w, generator=g).to(dtype).to(dev).contiguous(memory_format=fmt)

    x, res, res2 = tensor(c1), tensor(c1), tensor(c1, torch.contiguous_format)
    rbias = torch.randn(c1, generator=g).to(dev)
    x2 = tensor(c2) if two else None
    a, b, e = (torch.randn(n, c, generator=g).to(dev) for _ in range(3))
    seed = torch.tensor([11], device=dev)
    # The sum in fp32, rounded once (inductor's fused add; eager bf16 would round after each term).
    s = N.residual_sum(x.float(), res.float(), res2.float(), rbias.to(dtype)).to(dtype).contiguous(memory_format=cl)
    want = N.triton_forward(s, a, b, e, seed, groups, 1e-5, True, p, *N.DEFAULT_PLAN, x2)
    got = N.triton_forward(x, a, b, e, seed, groups, 1e-5, True, p, *N.DEFAULT_PLAN, x2, False, False, res, res2,
                           rbias)
    step = 1e-6 if dtype == torch.float32 else 2**-7  # fp32 rounding; one bf16 step (the kernel's order of the sum)
    assert got[5].stride() == x.stride() and torch.allclose(got[5].float(), s.float(), rtol=step, atol=step)
    assert want[5].numel() == 0
    for name, u, v in zip(("out", "mean", "rstd"), got, want):
        assert torch.allclose(u.float(), v.float(), rtol=10 * step, atol=10 * step), name
    dout, ds = torch.randn(want[0].shape, generator=g).to(dtype).to(dev), tensor(c1)
    plain = N.triton_backward(dout, got[5], a, b, e, seed, *got[1:3], groups, True, p, *N.DEFAULT_PLAN, x2)
    summed = N.triton_backward(dout, got[5], a, b, e, seed, *got[1:3], groups, True, p, *N.DEFAULT_PLAN, x2, None,
                               None, ds)
    assert torch.allclose(summed[0].float(), (plain[0].float() + ds.float()).to(dtype).float(), rtol=step, atol=step)
    for name, u, v in zip(("da", "db", "de", "dx2"), summed[1:], plain[1:]):
        assert torch.equal(u, v), name
    # model.norm_dbias: the bias's gradient from the dx kernel's tile sums (a row a tile under the smallest plan: 15
    # tiles a sample), the sum of dx as stored; the other outputs as without it.
    assert summed[5].numel() == 0
    for plan in (N.DEFAULT_PLAN, (16, 16, 1)):
        off, on = (N.triton_backward(dout, got[5], a, b, e, seed, *got[1:3], groups, True, p, *plan, x2=x2, ds=ds,
                                     dbias=dbias) for dbias in (False, True))
        for name, u, v in zip(("dx", "da", "db", "de", "dx2"), on, off):
            assert torch.equal(u, v), name
        assert on[5].dtype == torch.float32 and on[5].shape == (c1,)
        assert torch.allclose(on[5], N.bias_grad(off[0]), rtol=1e-5, atol=1e-5)


def test_two_parts_of_one_sample_through_the_plain_torch_path():
    """The op's plain-torch path (CPU tensors) splits dx into the two parts' gradients: with one NCHW sample each
    slice is dense already, and the two were views of one tensor, which a custom op's outputs may not be (refused)."""
    m = GroupNormAct(4, 12, "fused", parts=True).double()
    x1, x2 = (torch.randn(1, c, 4, 4, dtype=torch.float64, requires_grad=True) for c in (5, 7))
    m((x1, x2)).square().sum().backward()
    r = torch.cat((x1, x2), 1).detach().requires_grad_()
    torch_reference(r, m.weight.detach(), m.bias.detach(), 4).square().sum().backward()
    assert rel(torch.cat((x1.grad, x2.grad), 1), r.grad) < 1e-10


def test_parts_that_differ_in_more_than_channels_are_refused():
    needs_triton()
    x1, x2 = torch.randn(2, 8, 4, 4), torch.randn(2, 8, 4, 2)
    with pytest.raises(ValueError, match="differ in more than their channels"):
        N.triton_forward(x1, torch.ones(2, 16), torch.zeros(2, 16), None, torch.tensor([0]), 4, 1e-5, True, 0.0,
                         *N.DEFAULT_PLAN, x2=x2)
    with pytest.raises(ValueError, match="parts=True is a switch of the fused kernels"):
        GroupNormAct(4, 16, "scale-shift", parts=True)


@pytest.mark.parametrize("case", [CASES[2], CASES[5], CASES[7]], ids=["c24-p0.3", "bf16", "fast-silu-bf16"])
def test_pair_hash_kernels_against_reference(case):
    """model.norm_pair_hash: the kernels draw one hash for channels 2j and 2j + 1 (its two 16-bit halves), forward
    and both backward kernels alike, and keep_mask(pair_hash=True) is that mask: the same checks as the per-element
    hash's (the same elements dropped, every gradient), and a mask that is not the per-element one."""
    check_kernels(case, N.DEFAULT_PLAN, pair_hash=True)
    n, c, h, w, p = case[0], case[1], case[2], case[3], case[6]
    seed = torch.tensor([1234])
    assert not torch.equal(N.keep_mask(seed, (n, c, h, w), p, True), N.keep_mask(seed, (n, c, h, w), p))


@pytest.mark.parametrize("case,plan", [(CASES[2], FIRST_PLAN), (CASES[1], N.DEFAULT_PLAN), (CASES[4], N.DEFAULT_PLAN),
                                       (CASES[6], (16, 16, 1)), (CASES[7], N.DEFAULT_PLAN)],
                         ids=["c24-p0.3-first-plan", "add-nchw", "one-launch", "fast-silu-a-row-per-tile",
                              "fast-silu-bf16"])
def test_x_sums_kernels_against_reference(case, plan):
    """model.norm_x_sums: the backward reduction sums dy * x and x and turns them into xhat's sums per chunk (its
    rows counted where the sample ends inside it: several chunks a sample under the first plan and a row a tile),
    dx is formed from x; the same checks against fp64, on inputs whose |mean| >> std in places (the sums over x
    are where cancellation would show)."""
    check_kernels(case, plan, x_sums=True)


def test_x_sums_with_two_parts_and_a_residual_gradient():
    """The up blocks' reads of two parts and the residual sum's ds added in dx, with the sums over x: what the sums
    over xhat give, to fp32 rounding."""
    needs_triton()
    dev = "cuda" if torch.cuda.is_available() else "cpu"  # on the GPU machine the kernels take CUDA tensors only
    g = torch.Generator().manual_seed(3)
    n, c1, c2, h, w, groups, p = 2, 9, 7, 3, 5, 4, 0.2
    x, x2, dout = (spread_input((n, k, h, w), g, torch.float32).add(5).to(dev)
                   .contiguous(memory_format=torch.channels_last) for k in (c1, c2, c1 + c2))
    ds = torch.randn(n, c1, h, w, generator=g).to(dev).contiguous(memory_format=torch.channels_last)
    a, b, e = (torch.randn(n, c1 + c2, generator=g).to(dev) for _ in range(3))
    seed = torch.tensor([5], device=dev)
    fwd = N.triton_forward(x, a, b, e, seed, groups, 1e-5, True, p, *N.DEFAULT_PLAN, x2)
    want, got = (N.triton_backward(dout, x, a, b, e, seed, *fwd[1:3], groups, True, p, *N.DEFAULT_PLAN, x2, None,
                                   None, ds, x_sums=on) for on in (False, True))
    for name, u, v in zip(("dx", "da", "db", "de", "dx2"), got, want):
        assert rel(u, v) < 1e-5, name


@pytest.mark.parametrize("kernels", [True, False], ids=["triton-kernels", "op-on-cpu"])
def test_split_output_is_the_whole_outputs_parts(kernels, monkeypatch):
    """model.conv_parts: GroupNormAct(split_out=True) on two parts returns the output as two tensors, the parts'
    channels in the parts' layouts, and its backward reads their two gradients where they lie: the one output's
    numbers, forward and the gradients of both parts, the weight, the bias and the add (the one output's gradient
    given as its two channel slices), through the Triton kernels (interpreted without a GPU) and through the op's
    plain-torch path. 40 channels split at 24 in groups of 10 (one straddles the split), an odd batch, dropout; the
    plan (128, 256, 2) makes tiles of two rows and chunks of four: 18 tiles and 9 chunks a sample."""
    if kernels:
        needs_triton()
        monkeypatch.setattr(N, "_on_triton", lambda x: True)
    dev = "cuda" if kernels and torch.cuda.is_available() else "cpu"
    # The same arithmetic on the same numbers: exact (a GPU's code for two reads may round differently, as
    # test_two_parts_compute_what_their_concatenation_does says: fp32 rounding there)
    same = torch.equal if dev == "cpu" else lambda u, v: torch.allclose(u, v, rtol=1e-6, atol=1e-6)
    g = torch.Generator().manual_seed(8)
    n, c1, c2, groups, p = 3, 24, 16, 4, 0.2
    x1 = spread_input((n, c1, 5, 7), g, torch.float32).to(dev).contiguous(memory_format=torch.channels_last)
    x2 = spread_input((n, c2, 5, 7), g, torch.float32).to(dev)  # NCHW: each output in its own part's layout
    temb, dout = torch.randn(n, c1 + c2, generator=g).to(dev), torch.randn(n, c1 + c2, 5, 7, generator=g).to(dev)
    results = []
    for split in (False, True):
        m = GroupNormAct(groups, c1 + c2, "fused", dropout=p, plan=(128, 256, 2), parts=True, split_out=split)
        m = m.to(dev).train()
        with torch.no_grad():
            m.weight.copy_(torch.linspace(0.5, 1.5, c1 + c2))
            m.bias.copy_(torch.linspace(-1, 1, c1 + c2))
        leaves = [t.clone().requires_grad_() for t in (x1, x2, temb)]
        torch.manual_seed(0)  # the same dropout mask
        out = m((leaves[0], leaves[1]), add=leaves[2])
        douts = (dout[:, :c1], dout[:, c1:]) if split else dout  # the slices as they are: strided reads
        results.append((out, torch.autograd.grad(out, [*leaves, m.weight, m.bias], douts)))
    (whole, want), ((out1, out2), got) = results
    assert out1.stride() == x1.stride() and out2.stride() == x2.stride()
    assert same(out1, whole[:, :c1]) and same(out2, whole[:, c1:])
    assert 0.7 < (whole != 0).double().mean() < 0.9
    for name, u, v in zip(("dx1", "dx2", "dtemb", "dweight", "dbias"), got, want):
        assert same(u, v), name


def test_split_output_needs_two_parts_read_by_the_fused_kernels():
    """split_out goes with parts (and so with the fused kernels); one tensor in, one out; the op refuses it without a
    second part."""
    with pytest.raises(ValueError, match="split_out=True is a switch of the fused kernels"):
        GroupNormAct(4, 16, "scale-shift", split_out=True)
    with pytest.raises(ValueError, match="split_out=True .* needs parts=True; set split_out=False"):
        GroupNormAct(4, 16, "fused", split_out=True)
    m = GroupNormAct(4, 16, "fused", parts=True, split_out=True)
    assert "parts=True, split_out=True" in repr(m)
    x = torch.randn(2, 16, 3, 3)
    assert torch.equal(m(x), GroupNormAct(4, 16, "fused")(x))
    with pytest.raises(ValueError, match="split_out writes the output of two parts as two tensors; x2 is None"):
        N.group_norm_act(x, torch.ones(2, 16), torch.zeros(2, 16), None, torch.tensor([0]), 4, 1e-5, 1, 0.0,
                         *N.plan_args(N.DEFAULT_PLAN), None, False, False, None, None, None, False, False, False, True)


def test_pair_hash_refuses_an_odd_channel_count():
    with pytest.raises(ValueError, match="15 channels is odd; set pair_hash=False"):
        GroupNormAct(5, 15, "fused", dropout=0.1, pair_hash=True)
    with pytest.raises(ValueError, match="pair_hash=True is a switch of the fused kernels"):
        GroupNormAct(4, 16, "torch", pair_hash=True)


def test_pair_hash_mask_is_a_fair_coin_per_element_and_pair():
    """The pair mask: about 1 - p kept, per channel and per row, and the two channels of a pair independent (their
    halves of one hash): both dropped about p^2 of the time, not p."""
    shape = (8, 16, 16, 16)
    k = N.keep_mask(torch.tensor([1]), shape, 0.25, pair_hash=True).double()
    assert abs(k.mean().item() - 0.75) < 0.01
    assert k.mean((0, 2, 3)).sub(0.75).abs().max() < 0.03 and k.mean((0, 1, 3)).sub(0.75).abs().max() < 0.03
    both_dropped = ((1 - k[:, 0::2]) * (1 - k[:, 1::2])).mean().item()
    assert abs(both_dropped - 0.25 ** 2) < 0.01


def test_keep_mask_is_a_fair_coin_per_element():
    """The hash mask: about 1 - p kept, independent of position (rows, channels) and different per seed."""
    shape = (8, 16, 16, 16)
    k1, k2 = (N.keep_mask(torch.tensor([s]), shape, 0.25) for s in (1, 2))
    assert abs(k1.double().mean().item() - 0.75) < 0.01
    assert k1.double().mean((0, 2, 3)).sub(0.75).abs().max() < 0.03  # per channel
    assert k1.double().mean((0, 1, 3)).sub(0.75).abs().max() < 0.03  # per row
    assert 0.5 < (k1 == k2).double().mean() < 0.7  # two seeds agree only by chance (0.75^2 + 0.25^2 = 0.625)


@pytest.mark.parametrize("n,plan,tiles", [(16, FIRST_PLAN, 8), (2, FIRST_PLAN, 1), (16, N.DEFAULT_PLAN, 4)],
                         ids=["one-chunk-of-8-tiles", "8-chunks-of-one-tile", "default-plan"])
def test_fused_op_through_its_triton_kernels_against_nn_group_norm(n, plan, tiles, monkeypatch):
    """GroupNormAct("fused") as the UNet calls it (time-embedding add, FiLM, SiLU, dropout, channels_last, training
    mode), with the custom op routed to its Triton kernels (interpreted without a GPU): forward and every gradient
    against nn.GroupNorm + autograd in fp64 with the same dropout mask. 3 channels per group (not a power of 2:
    padded tiles); under the interpreter 16x16 pixels make one chunk of 8 row tiles per sample at n=16 and 8
    one-tile chunks at n=2 with the first plan, and one chunk of 4 tiles with the default (a GPU's SM count splits
    small batches further)."""
    needs_triton()
    monkeypatch.setattr(N, "_on_triton", lambda x: True)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    c, groups, p = 24, 8, 0.2
    pl = N._plan(torch.empty(n, c, 16, 16, device=dev), groups, *plan[:2])
    assert pl["CPG"] == 3 and (dev == "cuda" or pl["CHUNK"] // pl["BLOCK_R"] == tiles)
    g = torch.Generator().manual_seed(3)
    x = spread_input((n, c, 16, 16), g, torch.float32).to(dev).contiguous(memory_format=torch.channels_last)
    temb, scale, shift = (torch.randn(n, c, generator=g).to(dev) for _ in range(3))
    m = GroupNormAct(groups, c, "fused", dropout=p, plan=plan).to(dev).train()
    with torch.no_grad():
        m.weight.copy_(torch.rand(c, generator=g) + 0.5)
        m.bias.copy_(torch.randn(c, generator=g))
    leaves = [t.clone().requires_grad_() for t in (x, temb, scale, shift)]
    out = m(leaves[0], add=leaves[1], film=(leaves[2], leaves[3]))
    keep = out != 0  # SiLU of a normalised value is never exactly 0: the zeros are dropout's
    assert 0.7 < keep.double().mean() < 0.9 and out.is_contiguous(memory_format=torch.channels_last)
    dout = torch.randn(out.shape, generator=g).to(dev)
    got = torch.autograd.grad(out, [*leaves, m.weight, m.bias], dout)

    ref_gn = torch.nn.GroupNorm(groups, c).double().to(dev)
    ref_gn.load_state_dict(m.state_dict())
    ref_leaves = [t.detach().double().requires_grad_() for t in (x, temb, scale, shift)]
    xd, td, sd, bd = ref_leaves
    y = ref_gn(xd + td[:, :, None, None]) * (1 + sd[:, :, None, None]) + bd[:, :, None, None]
    ref = torch.where(keep, F.silu(y) / (1 - p), 0.0)
    want = torch.autograd.grad(ref, [*ref_leaves, ref_gn.weight, ref_gn.bias], dout.double())
    assert rel(out, ref) < 1e-5
    for name, a, b in zip(["dx", "dtemb", "dscale", "dshift", "dweight", "dbias"], got, want):
        assert rel(a, b) < 1e-4, name
    assert got[0].is_contiguous(memory_format=torch.channels_last)


# ---------------------------------------------------------------------------------------------------- the plan


@pytest.mark.parametrize("text,message", [
    ("2048,65536", "expected three or four comma-separated integers TILE,CHUNK,WARPS[,STAGES]"),
    ("a,b,c", "expected three or four comma-separated integers"),
    ("2048;65536;4", "expected three or four comma-separated integers"),
    ("0,65536,4", "every part must be a positive integer"),
    ("2048,65536,-4", "every part must be a positive integer"),
    # CHUNK 0 was the rows plan (NOTES 23), then the slab plan with a fourth part ROWS (NOTES 33): both slower, removed
    ("2048,0,4", "every part must be a positive integer"),
    ("16,0,8,256", "every part must be a positive integer"),
    ("1000,65536,4", "TILE=1000 is not a power of two"),
    ("2048,60000,4", "CHUNK=60000 is not a power of two"),
    ("4096,2048,4", "CHUNK=2048 is below TILE=4096"),
    ("2048,65536,3", "WARPS=3 is not one of 1, 2, 4, 8, 16"),
    ("2048,65536,32", "WARPS=32 is not one of"),
    ("2048,65536,4,1", "STAGES=1 is not one of 0, 2, 3, 4"),
    ("2048,65536,4,8", "STAGES=8 is not one of"),
    ("2048,65536,4,3,1", "expected three or four comma-separated integers"),
])
def test_a_bad_plan_says_what_is_wrong_and_what_to_write(text, message):
    with pytest.raises(ValueError) as e:
        N.parse_plan(text)
    assert str(e.value).startswith(f"norm_plan={text!r}: ") and message in str(e.value)
    assert "e.g. '1024,16384,4' or '2048,65536,4,3', or '' for the default 2048,65536,4,4" in str(e.value)


def test_a_plan_parses_to_its_three_or_four_integers():
    assert N.parse_plan("") == N.DEFAULT_PLAN == (2048, 65536, 4, 4)
    assert N.parse_plan("1024,16384,4") == (1024, 16384, 4) and N.parse_plan(" 64, 64, 1") == (64, 64, 1)
    assert N.parse_plan("2048,65536,4,3") == (2048, 65536, 4, 3)
    assert N.parse_plan("2048,65536,4,0") == (2048, 65536, 4, 0)
    # The ops take four: a plan of three runs the reductions' loops as written (stages 0).
    assert N.plan_args((2048, 65536, 4)) == N.plan_args((2048, 65536, 4, 0)) == (2048, 65536, 4, 0)
    assert N.plan_args((2048, 65536, 4, 3)) == (2048, 65536, 4, 3)


def test_group_norm_act_takes_a_plan_only_for_the_fused_kernels():
    assert GroupNormAct(2, 8, "fused").plan == N.DEFAULT_PLAN
    assert GroupNormAct(2, 8, "fused", plan=(2048, 65536, 8)).plan == (2048, 65536, 8)
    assert GroupNormAct(2, 8, "scale-shift").plan is None
    assert "plan=(2048, 65536, 8)" in repr(GroupNormAct(2, 8, "fused", plan=(2048, 65536, 8)))
    with pytest.raises(ValueError, match="norm_impl='torch' has none: pass plan=None"):
        GroupNormAct(2, 8, "torch", plan=(2048, 65536, 8))
    with pytest.raises(ValueError, match=r"plan=\(2048, 1024, 4\): CHUNK=1024 is below TILE=2048"):
        GroupNormAct(2, 8, "fused", plan=(2048, 1024, 4))


def test_the_plan_sets_the_reductions_split():
    """_plan's K (programs per sample) and CHUNK (rows per program) follow the plan's chunk, and BLOCK_R (rows per
    tile) its tile: samples of 32 channels at 64x64, 4096 rows of 32 channels each. 4 samples per SM (4 SMs under
    the interpreter), so that the batch fills the GPU with any K: fewer samples take the small-batch split instead
    (16 samples on an H200 at b1e09eb got K=32)."""
    needs_triton()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device == "cuda" else 4
    x = torch.empty(4 * sms, 32, 64, 64, device=device)
    default = N._plan(x, 8, 1024, 16384)
    assert (default["BLOCK_R"], default["K"], default["CHUNK"]) == (32, 8, 512)  # 1024 / 32, 16384 / 32 rows
    wide = N._plan(x, 8, 2048, 65536)
    assert (wide["BLOCK_R"], wide["K"], wide["CHUNK"]) == (64, 2, 2048)
    with pytest.raises(ValueError, match="tile=1000, chunk=16384: TILE=1000 is not a power of two"):
        N._plan(x, 8, 1000, 16384)


class LaunchSpy:
    """A Triton kernel whose launches record their num_warps and grid, then run."""

    def __init__(self, kernel):
        self.kernel, self.launches = kernel, []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.launches.append((kwargs["num_warps"], grid))
            return self.kernel[grid](*args, **kwargs)
        return launch


def run_fused(plan, x, temb, dout, p=0.2):
    """GroupNormAct("fused") with `plan` through the op and its Triton kernels: (out, dx, dtemb, dweight, dbias)."""
    c = x.shape[1]
    m = GroupNormAct(8, c, "fused", dropout=p, plan=plan).to(x.device).train()
    with torch.no_grad():
        m.weight.copy_(torch.linspace(0.5, 1.5, c))
        m.bias.copy_(torch.linspace(-1, 1, c))
    xi, ti = x.clone().requires_grad_(), temb.clone().requires_grad_()
    torch.manual_seed(0)  # the same dropout seed for every plan
    out = m(xi, add=ti)
    return (out, *torch.autograd.grad(out, [xi, ti, m.weight, m.bias], dout))


def test_two_plans_compute_the_same_and_reach_the_kernels(monkeypatch):
    """GroupNormAct's plan is what the op launches: the reductions split each sample differently (K) and every
    kernel, forward and backward, gets its num_warps; outputs and gradients agree to fp32 rounding, dropout mask
    included (it is a hash of the seed and the element, whatever the tiles)."""
    needs_triton()
    from ffcv_ddpm import gn_kernels

    monkeypatch.setattr(N, "_on_triton", lambda x: True)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(5)
    n, c = 8, 24
    x = spread_input((n, c, 8, 8), g, torch.float32).to(dev).contiguous(memory_format=torch.channels_last)
    temb, dout = torch.randn(n, c, generator=g).to(dev), torch.randn(x.shape, generator=g).to(dev)
    plans = (FIRST_PLAN, (128, 512, 2))
    ks = [N._plan(x, 8, *plan[:2])["K"] for plan in plans]
    # Two reduction programs per sample, then four (a GPU's SM count splits this small batch's rows further: 16):
    # the plans really split differently.
    assert ks == ([2, 4] if dev == "cpu" else [2, 16])

    kernels = ("_stats_kernel", "_finalize_kernel", "_apply_kernel", "_bwd_reduce_kernel", "_bwd_finalize_kernel",
               "_bwd_dx_kernel")
    results = []
    for plan in plans:
        spies = {k: LaunchSpy(getattr(gn_kernels, k)) for k in kernels}
        for k, spy in spies.items():
            monkeypatch.setattr(gn_kernels, k, spy)
        results.append(run_fused(plan, x, temb, dout))
        for k, spy in spies.items():
            assert [w for w, _ in spy.launches] == [plan[2]], k  # launched once, with the plan's warps
        for k in ("_stats_kernel", "_bwd_reduce_kernel"):  # the reductions' grids: K programs per sample
            assert spies[k].launches[0][1] == (n, ks[len(results) - 1]), k
        for k in kernels:
            monkeypatch.setattr(gn_kernels, k, spies[k].kernel)
    (out0, *grads0), (out1, *grads1) = results
    assert torch.equal(out0 == 0, out1 == 0) and 0.7 < (out0 != 0).double().mean() < 0.9
    assert rel(out1, out0) < 1e-6
    for name, a, b in zip(["dx", "dtemb", "dweight", "dbias"], grads1, grads0):
        assert rel(a, b) < 1e-5, name


def test_the_plan_is_an_argument_of_the_compiled_op():
    """torch.compile (fullgraph) keeps the plan as the op's constant arguments: the traced graph calls
    ffcv_ddpm::group_norm_act with the module's tile, chunk, warps and stages (0 for a plan of three), then the
    second part and the two switches (saved_means, mask_bits); forward and backward run through the fake
    implementations and the autograd registration with them (on CPU: the plain-torch path, as without a plan)."""
    from torch._dynamo.testing import EagerAndRecordGraphs

    torch._dynamo.reset()
    m = GroupNormAct(2, 8, "fused", plan=(2048, 65536, 8))
    backend = EagerAndRecordGraphs()
    x = torch.randn(2, 8, 4, 4, requires_grad=True)
    y = torch.compile(m, backend=backend, fullgraph=True)(x)
    y.sum().backward()
    calls = [node for graph in backend.graphs for node in graph.graph.nodes
             if node.op == "call_function" and "group_norm_act" in str(node.target)]
    # the plan, then no second part, the switches off, no residual sum, the per-element hash, the sums over xhat,
    # the bias gradient (of a residual sum: none here) in torch, one output
    assert len(calls) == 1 and calls[0].args[-14:] == (2048, 65536, 8, 0, None, False, False, None, None, None,
                                                       False, False, False, False)
    torch._dynamo.reset()
    staged, backend = GroupNormAct(2, 8, "fused", plan=(2048, 65536, 8, 3)), EagerAndRecordGraphs()
    torch.compile(staged, backend=backend, fullgraph=True)(x)
    assert [node.args[-14:-7] for graph in backend.graphs for node in graph.graph.nodes
            if node.op == "call_function" and "group_norm_act" in str(node.target)] == [
        (2048, 65536, 8, 3, None, False, False)]
    ref = GroupNormAct(2, 8, "fused")
    x2 = x.detach().clone().requires_grad_()
    ref(x2).sum().backward()
    assert torch.allclose(x.grad, x2.grad)


def test_the_switches_compile_into_the_op_and_its_backward():
    """torch.compile (fullgraph) of a fused GroupNormAct with an add and dropout and its switches (saved_means,
    mask_bits, pair_hash, x_sums): the forward call carries them, its extra outputs (the means, the mask's bits: the
    fake implementation's shapes) reach the backward op, pair_hash and x_sums too, and the numbers are the eager
    module's with the same seed."""
    from torch._dynamo.testing import AotEagerAndRecordGraphs

    torch._dynamo.reset()
    m = GroupNormAct(2, 40, "fused", dropout=0.3, saved_means=True, mask_bits=True, pair_hash=True,
                     x_sums=True).train()
    backend = AotEagerAndRecordGraphs()
    x = torch.randn(2, 40, 3, 3).contiguous(memory_format=torch.channels_last).requires_grad_()
    temb = torch.randn(2, 40, requires_grad=True)
    torch.manual_seed(0)
    y = torch.compile(m, backend=backend, fullgraph=True)(x, add=temb)
    y.square().sum().backward()
    fw = [n for gm in backend.fw_graphs for n in gm.graph.nodes if "group_norm_act" in str(n.target)]
    bw = [n for gm in backend.bw_graphs for n in gm.graph.nodes if "group_norm_act_backward" in str(n.target)]
    assert len(fw) == 1 and fw[0].args[-9:] == (True, True, None, None, None, True, True, False, False) and len(bw) == 1
    cmean, bits = (fw[0].meta["val"][i] for i in (3, 4))
    assert cmean.shape == (2, 40) and bits.shape == (2 * 9, 2) and bits.dtype == torch.int32
    assert all(isinstance(arg, torch.fx.Node) for arg in bw[0].args[-7:-5])  # the forward's means and bits
    # pair_hash: the backward draws the forward's mask; x_sums; the bias gradient in torch (no residual sum here); one
    # output's gradient
    assert bw[0].args[-4:] == (True, True, False, None)
    r, rt = x.detach().clone().requires_grad_(), temb.detach().clone().requires_grad_()
    torch.manual_seed(0)
    want = m(r, add=rt)
    want.square().sum().backward()
    assert torch.allclose(y, want) and torch.allclose(x.grad, r.grad) and torch.allclose(temb.grad, rt.grad)


def test_two_parts_compile_as_one_call_of_the_op():
    """torch.compile (fullgraph) of a fused GroupNormAct with parts=True: one op call taking both parts (the fake
    implementation gives the concatenation's shape and the first part's layout), the numbers of the eager call."""
    from torch._dynamo.testing import EagerAndRecordGraphs

    torch._dynamo.reset()
    m = GroupNormAct(4, 12, "fused", parts=True)
    backend = EagerAndRecordGraphs()
    x1 = torch.randn(2, 5, 4, 4).contiguous(memory_format=torch.channels_last).requires_grad_()
    x2 = torch.randn(2, 7, 4, 4).contiguous(memory_format=torch.channels_last).requires_grad_()
    y = torch.compile(m, backend=backend, fullgraph=True)((x1, x2))
    y.square().sum().backward()
    calls = [node for graph in backend.graphs for node in graph.graph.nodes
             if node.op == "call_function" and "group_norm_act" in str(node.target)]
    assert len(calls) == 1 and calls[0].args[13] is not None  # x2: the second part goes in as it is
    assert y.shape == (2, 12, 4, 4) and y.is_contiguous(memory_format=torch.channels_last)
    ref = GroupNormAct(4, 12, "fused")  # concatenates first
    r1, r2 = (t.detach().clone().requires_grad_() for t in (x1, x2))
    want = ref((r1, r2))
    want.square().sum().backward()
    assert torch.allclose(y, want) and torch.allclose(x1.grad, r1.grad) and torch.allclose(x2.grad, r2.grad)


def test_a_split_output_compiles_as_one_call_of_the_op():
    """torch.compile (fullgraph, AOT autograd's eager backend) of a fused GroupNormAct with split_out on two parts
    (model.conv_parts): one forward call returning the parts' outputs (the fake implementation's shapes and layouts),
    one backward call taking both gradients, the numbers of the eager call."""
    from torch._dynamo.testing import AotEagerAndRecordGraphs

    torch._dynamo.reset()
    m = GroupNormAct(4, 12, "fused", parts=True, split_out=True)
    backend = AotEagerAndRecordGraphs()
    x1 = torch.randn(2, 5, 4, 4).contiguous(memory_format=torch.channels_last).requires_grad_()
    x2 = torch.randn(2, 7, 4, 4).requires_grad_()
    y1, y2 = torch.compile(m, backend=backend, fullgraph=True)((x1, x2))
    (y1.square().sum() + y2.mul(3).square().sum()).backward()
    fw = [n for gm in backend.fw_graphs for n in gm.graph.nodes if "group_norm_act" in str(n.target)]
    bw = [n for gm in backend.bw_graphs for n in gm.graph.nodes if "group_norm_act_backward" in str(n.target)]
    assert len(fw) == 1 and fw[0].args[-1] is True and len(bw) == 1 and isinstance(bw[0].args[-1], torch.fx.Node)
    assert y1.shape == x1.shape and y1.stride() == x1.stride() and y2.shape == x2.shape and y2.stride() == x2.stride()
    r1, r2 = (t.detach().clone().requires_grad_() for t in (x1, x2))
    w1, w2 = m((r1, r2))
    (w1.square().sum() + w2.mul(3).square().sum()).backward()
    assert torch.allclose(y1, w1) and torch.allclose(y2, w2)
    assert torch.allclose(x1.grad, r1.grad) and torch.allclose(x2.grad, r2.grad)
