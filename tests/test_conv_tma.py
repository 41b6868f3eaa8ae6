"""benchmarks.speed.conv_tma: its plain Triton TMA-fed convolution against F.conv2d, on the GPU or through Triton's
interpreter (conftest sets TRITON_INTERPRET=1, which reads tensor descriptors as TMA does: a box starting at -1 or
running past the edge reads zeros), the passes it prices, and what it refuses (the Gluon kernel it also times:
tests/test_conv_gluon.py)."""

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from benchmarks.speed import conv_tma as CT

pytestmark = pytest.mark.usefixtures("one_thread")
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def needs_triton():
    import triton

    if not (torch.cuda.is_available() or triton.knobs.runtime.interpret):
        pytest.skip("needs a GPU or TRITON_INTERPRET=1")


@pytest.mark.parametrize("n,c,co,h,w,tiles", [
    (2, 32, 32, 8, 8, CT.Tiles(4, 8, 16, 16, 4, 2)),    # two pixel tiles a sample, two channel blocks, two K steps
    (3, 16, 48, 4, 16, CT.Tiles(2, 16, 16, 16, 4, 2)),  # an odd batch, a wide image, three channel blocks
    (1, 32, 16, 8, 8, CT.Tiles(8, 8, 16, 32, 4, 1)),    # the whole image one tile: every box starts outside it
])
def test_the_tma_convolution_is_conv2d_with_zero_padding(n, c, co, h, w, tiles):
    needs_triton()
    g = torch.Generator().manual_seed(n * 100 + c)
    cl = torch.channels_last
    x = (torch.randn(n, c, h, w, generator=g) + 0.5).to(torch.bfloat16).to(DEV, memory_format=cl)
    wt = (torch.randn(co, c, 3, 3, generator=g) * (9 * c) ** -0.5).to(torch.bfloat16).to(DEV, memory_format=cl)
    out = CT.conv3x3(x, wt, tiles)
    ref = F.conv2d(x.double().cpu(), wt.double().cpu(), padding=1)
    assert out.shape == ref.shape and out.dtype == torch.bfloat16 and out.is_contiguous(memory_format=cl)
    assert CT.rel_error(out.cpu(), ref.float()) < 1e-2  # bf16 output rounding; a wrong tap or edge is O(1)


def test_shapes_it_cannot_tile_or_layouts_it_cannot_read_are_one_error():
    x = torch.randn(1, 32, 8, 8).to(memory_format=torch.channels_last)
    w = torch.randn(16, 32, 3, 3).to(memory_format=torch.channels_last)
    with pytest.raises(ValueError, match=r"does not tile a 8x8 image of 32 -> 16 channels"):
        CT.conv3x3(x, w, CT.Tiles(4, 8, 32, 16))
    with pytest.raises(ValueError, match="must be channels_last"):
        CT.conv3x3(x.contiguous(), w, CT.Tiles(4, 8, 16, 16))
    assert all(t.bh * t.bw in (64, 128, 256) for h in (32, 8) for t in CT.configs_for(h, h)["box"])
    assert all(t.fits(4, 4, 256, 256) for t in CT.configs_for(4, 4)["gluon"])  # whole 4x4 images a program


def test_without_a_hopper_gpu_it_is_one_line(tmp_path, capsys):
    if torch.cuda.is_available():
        pytest.skip("a GPU machine runs the benchmark itself")
    assert CT.main(["--out", str(tmp_path)]) == 2
    assert "needs a CUDA GPU with TMA (sm_90 or newer" in capsys.readouterr().err



def test_the_epilogue_is_priced_by_the_passes_todays_chain_makes():
    """A residual site: the inductor add reads the output and writes the sum, the statistics read the sum (3 passes
    of the output's bf16 bytes); a statistics-only site: 1; neither: 0; the prologue two of the input's."""
    from benchmarks.speed.conv_gn_bench import Site

    def site(residual, stats):
        return Site(cin=128, cout=256, h=16, stride=1, c1=128, norm=True, silu=True, p=0.0, norm_add=False,
                    bias="channel", residual=residual, stats=stats, groups=32)

    out = 2 * 8 * 16 * 16 * 256
    assert [CT.passes_removed(site(r, s), 8) for r, s in ((True, True), (False, True), (False, False))] == \
        [3 * out, out, 0]
    # the prologue: the apply pass's read of the input and write of the activation, less the dropout bits it reads
    assert CT.passes_removed(site(False, True), 8, prologue=True) == out + 2 * (2 * 8 * 16 * 16 * 128)
    dropped = dataclasses.replace(site(False, True), p=0.1)
    assert CT.passes_removed(dropped, 8, prologue=True) == out + 2 * (2 * 8 * 16 * 16 * 128) - 4 * 8 * 16 * 16 * 4
