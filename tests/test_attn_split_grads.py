"""model.attn_split_grads: the attention's qkv projection backward from q, k and v's gradients where SDPA wrote them
(unet.QKVProjection), against the stacked gradient autograd builds without it: the same function and gradients, and
no stacked gradient in the compiled backward."""

import dataclasses

import pytest
import torch

from ffcv_ddpm.unet import PRESETS, ModelConfig, build_model, reference_config

pytestmark = pytest.mark.usefixtures("one_thread")


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def pair(cfg: ModelConfig):
    """(without, with) the switch, fp64, channels_last, the same weights."""
    torch.manual_seed(0)
    ref = build_model(cfg).double().to(memory_format=torch.channels_last)
    new = build_model(dataclasses.replace(cfg, attn_split_grads=True)).double().to(memory_format=torch.channels_last)
    new.load_state_dict(ref.state_dict())
    return ref, new


def run(model, x, t):
    torch.manual_seed(1)  # the same dropout masks
    out = model(x, t)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(2), dtype=out.dtype)
    return out, torch.autograd.grad(out, [x, *model.parameters()], dout)


@pytest.mark.parametrize("preset,heads", [("tiny", 2), ("annotated-small", 4)])
def test_the_split_backward_computes_the_same_gradients(preset, heads):
    """Eager, fp64: two heads (the tiny ddpm: (B, HW, heads, d) gradients are copies, not views) and the annotated
    network's four heads of 32, attention at every level."""
    cfg = dataclasses.replace(PRESETS[preset], attn_linear=True, image_size=8)
    assert cfg.attn_heads == heads
    ref, new = pair(cfg)
    x = torch.randn(2, 3, 8, 8, dtype=torch.float64).contiguous(memory_format=torch.channels_last).requires_grad_()
    t = torch.tensor([3, 700])
    (o0, g0), (o1, g1) = run(ref, x, t), run(new, x, t)
    assert rel(o1, o0) < 1e-12
    for a, b in zip(g1, g0, strict=True):
        assert rel(a, b) < 1e-11


def test_the_compiled_backward_has_no_stacked_qkv_gradient():
    """torch.compile (fullgraph, AOT autograd's eager backend) of one attention block (a head of 16 channels at 4x4):
    without the switch the backward stacks q, k and v's gradients (an aten.stack of three (B, heads, HW, d) tensors);
    with it not, two addmm instead, and the numbers are the eager block's."""
    from torch._dynamo.testing import AotEagerAndRecordGraphs

    from ffcv_ddpm.unet import SelfAttention

    torch.manual_seed(0)
    blocks = [SelfAttention(16, 1, None, 4, True, "sdpa", "scale-shift", linear=True, split_grads=split).double()
              for split in (False, True)]
    blocks[1].load_state_dict(blocks[0].state_dict())
    x = torch.randn(2, 16, 4, 4, dtype=torch.float64).contiguous(memory_format=torch.channels_last)
    dout = torch.randn(x.shape, dtype=torch.float64)
    want_x = x.clone().requires_grad_()
    want = blocks[0](want_x)
    want_grads = torch.autograd.grad(want, [want_x, *blocks[0].parameters()], dout)
    counts = []
    for block in blocks:
        torch._dynamo.reset()
        backend = AotEagerAndRecordGraphs()
        leaf = x.clone().requires_grad_()
        out = torch.compile(block, backend=backend, fullgraph=True)(leaf)
        grads = torch.autograd.grad(out, [leaf, *block.parameters()], dout)
        assert rel(out, want) < 1e-12 and all(rel(a, b) < 1e-11 for a, b in zip(grads, want_grads, strict=True))
        targets = [str(n.target) for gm in backend.bw_graphs for n in gm.graph.nodes if n.op == "call_function"]
        counts.append((sum("stack" in t for t in targets), sum("addmm" in t for t in targets)))
    (stack_off, addmm_off), (stack_on, addmm_on) = counts
    assert stack_off == 1 and stack_on == 0 and addmm_on - addmm_off == 2


def test_the_switch_goes_with_attn_linear():
    with pytest.raises(ValueError, match="attn_split_grads=True is the backward of attention's qkv matmul"):
        ModelConfig(attn_split_grads=True).validate()
    cfg = dataclasses.replace(PRESETS["ddpm-cifar10"], attn_split_grads=True)
    cfg.validate()
    assert not reference_config(cfg).attn_split_grads
