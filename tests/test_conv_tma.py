"""benchmarks.speed.conv_tma's TMA-fed convolution against F.conv2d, on the GPU or through Triton's interpreter
(conftest sets TRITON_INTERPRET=1, which reads tensor descriptors as TMA does: a box starting at -1 or running past
the edge reads zeros), and what the benchmark refuses."""

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
    (2, 32, 32, 8, 8, CT.Tiles(4, 8, 16, 16, 4, 2, True)),   # rows: half an image a program
    (5, 16, 16, 4, 4, CT.Tiles(8, 4, 16, 16, 4, 2, True)),   # rows across samples: 2 images a program, an odd batch
    (3, 16, 32, 4, 16, CT.Tiles(4, 16, 32, 16, 4, 1, True)),  # rows: a whole image a program
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
    with pytest.raises(ValueError, match=r"does not tile a 8x8 image"):  # rows take whole image rows
        CT.conv3x3(x, w, CT.Tiles(8, 4, 16, 16, rows=True))
    with pytest.raises(ValueError, match="must be channels_last"):
        CT.conv3x3(x.contiguous(), w, CT.Tiles(4, 8, 16, 16))
    assert all(t.bh * t.bw in (64, 128, 256) for t in CT.configs_for(32, 32) + CT.configs_for(8, 8))
    assert all(t.fits(4, 4, 256, 256) for t in CT.configs_for(4, 4) if t.rows)  # 8 images of 4x4 a program


def test_without_a_hopper_gpu_it_is_one_line(tmp_path, capsys):
    if torch.cuda.is_available():
        pytest.skip("a GPU machine runs the benchmark itself")
    assert CT.main(["--out", str(tmp_path)]) == 2
    assert "needs a CUDA GPU with TMA (sm_90 or newer" in capsys.readouterr().err
