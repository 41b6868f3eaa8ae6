"""train.pdl (NOTES item 53): the fused GroupNorm's kernels launched with programmatic dependent launch compute what
they compute without it, bit for bit, eagerly and replayed from a CUDA graph (GPU); the switch is refused where it
cannot run and never reaches Triton's interpreter (CPU)."""

import pytest
import torch

from ffcv_ddpm import gn_kernels as K
from ffcv_ddpm import norm as N
from ffcv_ddpm.checks import BadValue
from ffcv_ddpm.config import load_config
from ffcv_ddpm.step import TrainingError, set_pdl


@pytest.fixture
def pdl_restored():
    before = K.PDL
    yield
    K.PDL = before


def test_the_config_takes_the_three_modes_and_refuses_others():
    for mode in ("off", "kernels", "all"):
        assert load_config("tiny", [f"train.pdl={mode}"]).train.pdl == mode
    with pytest.raises(BadValue, match="train.pdl"):
        load_config("tiny", ["train.pdl=on"])


def test_a_device_without_it_refuses_the_switch(pdl_restored):
    for mode in ("kernels", "all"):
        with pytest.raises(TrainingError, match=f"train.pdl={mode} needs an sm90 GPU"):
            set_pdl(mode, torch.device("cpu"))
    set_pdl("off", torch.device("cpu"))


def test_the_interpreter_never_gets_the_launch_argument(pdl_restored):
    """Triton's interpreter has no griddepcontrol: with the switch on, the CPU tests' kernels launch as before."""
    import triton

    K.PDL = True
    assert K.pdl_args() == ({} if triton.knobs.runtime.interpret else {"PDL": True, "launch_pdl": True})


def _fused_forward_backward(seed_value: int):
    """The op's forward and backward kernels (two parts, a residual addend's gradient, dropout, FiLM's add) on
    random bf16 data at a UNet site's layout."""
    g = torch.Generator().manual_seed(seed_value)
    n, c, h, w, groups = 8, 128, 16, 16, 32
    x = (torch.randn(n, c, h, w, generator=g) * 2 + 1).to(torch.bfloat16).cuda()
    x = x.contiguous(memory_format=torch.channels_last)
    a, b, e = (torch.randn(n, c, generator=g).cuda() for _ in range(3))
    seed = torch.tensor([seed_value], device="cuda")
    dout = torch.randn(x.shape, generator=g).to(torch.bfloat16).cuda().contiguous(memory_format=torch.channels_last)

    def run():
        out, mean, rstd, *_ = N.triton_forward(x, a, b, e, seed, groups, 1e-5, 2, 0.1, *N.DEFAULT_PLAN,
                                               pair_hash=True)
        grads = N.triton_backward(dout, x, a, b, e, seed, mean, rstd, groups, 2, 0.1, *N.DEFAULT_PLAN,
                                  pair_hash=True, x_sums=True)
        return [out, mean, rstd, *grads[:4]]

    return run


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
                    reason="programmatic dependent launch: an sm90 GPU")
def test_the_kernels_compute_the_same_with_it_eagerly_and_in_a_cuda_graph(pdl_restored):
    run = _fused_forward_backward(7)
    set_pdl("off", torch.device("cuda"))
    want = [t.clone() for t in run()]
    set_pdl("kernels", torch.device("cuda"))
    assert K.pdl_args() == {"PDL": True, "launch_pdl": True}
    for got, ref in zip(run(), want):
        assert torch.equal(got, ref)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        run()  # compiled and warmed outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = run()
    for _ in range(3):
        for t in outs:
            t.zero_()
        graph.replay()
        torch.cuda.synchronize()
        for got, ref in zip(outs, want):
            assert torch.equal(got, ref)
