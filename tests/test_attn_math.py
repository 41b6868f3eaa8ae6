"""model.attn_impl=math-qkv (ffcv_ddpm.attn_math, NOTES item 55): the math attention's arithmetic, q, k and v's
gradients written as one tensor by the op qkv_grads."""

from dataclasses import replace

import pytest
import torch

from ffcv_ddpm.attn_math import math_attention, qkv_grads
from ffcv_ddpm.unet import PRESETS, SelfAttention, attention, build_model, reference_config

pytestmark = pytest.mark.usefixtures("one_thread")


def reference(qkv: torch.Tensor) -> torch.Tensor:
    """unet.attention's math path over one head, q, k and v split as SelfAttention splits the qkv GEMM's output."""
    b, n, c3 = qkv.shape
    q, k, v = qkv.reshape(b, n, 3, 1, c3 // 3).permute(2, 0, 3, 1, 4).unbind(0)
    return attention(q, k, v, "math")[:, 0]


def out_and_grad(fn, qkv, g, autocast=False):
    qkv = qkv.detach().clone().requires_grad_()
    with torch.autocast(qkv.device.type, dtype=torch.bfloat16, enabled=autocast):
        out = fn(qkv)
    return out, torch.autograd.grad(out, qkv, g)[0]


def test_fp64_forward_and_gradient_are_the_math_attentions():
    g = torch.Generator().manual_seed(0)
    qkv = torch.randn(3, 10, 36, generator=g, dtype=torch.float64) * 2
    grad = torch.randn(3, 10, 12, generator=g, dtype=torch.float64)
    out, dqkv = out_and_grad(math_attention, qkv, grad)
    ref_out, ref_dqkv = out_and_grad(reference, qkv, grad)
    assert torch.allclose(out, ref_out, rtol=0, atol=1e-12) and torch.allclose(dqkv, ref_dqkv, rtol=0, atol=1e-12)
    assert dqkv.is_contiguous() and dqkv.shape == qkv.shape


def test_bf16_under_autocast_rounds_as_the_math_attention_does():
    """The forward bit for bit (the same roundings in the same order); the gradient within a bf16 step (the
    reference's matmul backward computes dk^T = q^T ds where the op computes dk = ds^T q: another GEMM, another
    summation order)."""
    g = torch.Generator().manual_seed(1)
    qkv = torch.randn(2, 16, 48, generator=g).bfloat16()
    grad = torch.randn(2, 16, 16, generator=g).bfloat16()
    out, dqkv = out_and_grad(math_attention, qkv, grad, autocast=True)
    ref_out, ref_dqkv = out_and_grad(reference, qkv, grad, autocast=True)
    assert out.dtype == dqkv.dtype == torch.bfloat16 and torch.equal(out, ref_out)
    assert ((dqkv.float() - ref_dqkv.float()).norm() / ref_dqkv.float().norm()).item() < 4e-3


def test_qkv_grads_is_a_well_formed_op():
    g = torch.Generator().manual_seed(2)
    b, n, c = 2, 5, 4
    args = (torch.randn(b, n, n, generator=g), torch.randn(b, n, n, generator=g), torch.randn(b, n, c, generator=g),
            torch.randn(b, n, 3 * c, generator=g))
    torch.library.opcheck(qkv_grads, args)
    ds, p, do, qkv = args
    want = torch.cat([ds @ qkv[..., c:2 * c], ds.transpose(1, 2) @ qkv[..., :c], p.transpose(1, 2) @ do], -1)
    assert torch.allclose(qkv_grads(*args), want, atol=1e-6)


def block(impl: str) -> SelfAttention:
    torch.manual_seed(0)
    return SelfAttention(32, 1, None, 8, True, impl, linear=True).double().to(memory_format=torch.channels_last)


def test_the_block_with_it_computes_the_math_block_and_compiles_in_one_graph():
    """SelfAttention with math-qkv against the same weights with math: output and every gradient in fp64, eager and
    traced whole (fullgraph, aot_eager: the op and the autograd.Function inside one graph, no break)."""
    x = torch.randn(2, 32, 4, 4, dtype=torch.float64).contiguous(memory_format=torch.channels_last)
    want = None
    for impl, compiled in (("math", False), ("math-qkv", False), ("math-qkv", True)):
        m = block(impl)
        f = torch.compile(m, backend="aot_eager", fullgraph=True) if compiled else m
        xi = x.clone().requires_grad_()
        out = f(xi)
        grads = torch.autograd.grad(out.square().sum(), [xi, *m.parameters()])
        if want is None:
            want = (out, grads)
            continue
        assert torch.allclose(out, want[0], atol=1e-12)
        for got, ref in zip(grads, want[1]):
            assert torch.allclose(got, ref, atol=1e-10)


def test_the_config_asks_for_its_one_head_over_the_qkv_matmul():
    cfg = replace(PRESETS["ddpm-cifar10"], attn_impl="math-qkv")
    cfg.validate()
    assert reference_config(cfg).attn_impl == "math"  # the reference network's attention: the same arithmetic
    for bad in (dict(attn_linear=False), dict(attn_heads=2), dict(attn_split_grads=True)):
        with pytest.raises(ValueError, match="attn_impl='math-qkv' is one head's attention"):
            replace(cfg, **bad).validate()


def test_flops_count_it_as_the_math_attention():
    """FlopCounterMode sees the op's three GEMMs (its formula): the network's count with math-qkv is math's."""
    from torch.utils.flop_counter import FlopCounterMode

    counts = {}
    for impl in ("math", "math-qkv"):
        cfg = replace(PRESETS["tiny"], attn_impl=impl, attn_linear=True, attn_heads=1, attn_head_dim=None)
        torch.manual_seed(0)
        model = build_model(cfg)
        x = torch.randn(2, cfg.in_channels, cfg.image_size, cfg.image_size)
        with FlopCounterMode(display=False) as fc:
            model(x, torch.tensor([3, 7])).sum().backward()
        counts[impl] = fc.get_total_flops()
    assert counts["math"] == counts["math-qkv"] > 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_bf16_on_the_gpu_against_the_math_attention():
    """cuBLAS's GEMMs writing their thirds in place (strided outputs) give what the math path's three GEMMs and
    their stack give, within bf16's rounding, at a UNet site's shape (one image of 16x16, 256 channels, 8 of them)."""
    g = torch.Generator().manual_seed(3)
    qkv = (torch.randn(8, 256, 3 * 256, generator=g) * 0.5).bfloat16().cuda()
    grad = torch.randn(8, 256, 256, generator=g).bfloat16().cuda()
    out, dqkv = out_and_grad(math_attention, qkv, grad, autocast=True)
    ref_out, ref_dqkv = out_and_grad(reference, qkv, grad, autocast=True)
    for got, want in ((out, ref_out), (dqkv, ref_dqkv)):  # cuBLAS may pick other kernels for the two layouts
        assert ((got.float() - want.float()).norm() / want.float().norm()).item() < 4e-3


def test_checkpoints_load_across_the_attention_paths():
    """A network trained with one attention path resumes with another: the same state_dict (strict), the same
    function (fp64)."""
    nets = {}
    for impl in ("sdpa", "math-qkv"):
        cfg = replace(PRESETS["tiny"], attn_impl=impl, attn_linear=True, attn_heads=1, attn_head_dim=None)
        torch.manual_seed(impl == "sdpa")  # different weights until loaded
        nets[impl] = build_model(cfg).double()
    nets["math-qkv"].load_state_dict(nets["sdpa"].state_dict(), strict=True)
    x = torch.randn(2, 3, PRESETS["tiny"].image_size, PRESETS["tiny"].image_size, dtype=torch.float64)
    t = torch.tensor([3, 7])
    assert torch.allclose(nets["math-qkv"](x, t), nets["sdpa"](x, t), atol=1e-10)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_gemms_write_their_thirds_without_a_copy():
    """cuBLAS takes the strided thirds as they are: the op allocates its output and nothing else (a copy of a third,
    which bmm makes where it cannot write a layout, would show as a second allocation)."""
    b, n, c = 8, 256, 256
    ds, p = (torch.randn(b, n, n, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    do = torch.randn(b, n, c, device="cuda", dtype=torch.bfloat16)
    qkv = torch.randn(b, n, 3 * c, device="cuda", dtype=torch.bfloat16)
    qkv_grads(ds, p, do, qkv)  # cuBLAS's handle and workspace made outside the measurement
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    out = qkv_grads(ds, p, do, qkv)
    torch.cuda.synchronize()
    assert torch.cuda.max_memory_allocated() - before == out.untyped_storage().nbytes()
