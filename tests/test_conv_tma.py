"""benchmarks.speed.conv_tma's TMA-fed convolutions: the Triton one against F.conv2d, on the GPU or through Triton's
interpreter (conftest sets TRITON_INTERPRET=1, which reads tensor descriptors as TMA does: a box starting at -1 or
running past the edge reads zeros); the Gluon one built for sm_90 (no interpreter runs Gluon; the GPU call checks
its answers); and what the benchmark refuses."""

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
    with pytest.raises(ValueError, match=r"does not tile a 8x8 image"):  # Gluon's tiles are whole image rows
        CT.conv3x3(x, w, CT.Tiles(8, 4, 16, 16, kind="gluon"))
    with pytest.raises(ValueError, match="must be channels_last"):
        CT.conv3x3(x.contiguous(), w, CT.Tiles(4, 8, 16, 16))
    assert all(t.bh * t.bw in (64, 128, 256) for t in CT.configs_for(32, 32) + CT.configs_for(8, 8))
    assert all(t.fits(4, 4, 256, 256) for t in CT.configs_for(4, 4) if t.kind == "gluon")  # 32 images of 4x4


def test_without_a_hopper_gpu_it_is_one_line(tmp_path, capsys):
    if torch.cuda.is_available():
        pytest.skip("a GPU machine runs the benchmark itself")
    assert CT.main(["--out", str(tmp_path)]) == 2
    assert "needs a CUDA GPU with TMA (sm_90 or newer" in capsys.readouterr().err


@pytest.mark.parametrize("tiles,h,cin", [
    (CT.Tiles(4, 32, 128, 64, 4, 4, "gluon"), 32, 128),  # 4 rows of a 32x32 image, one warpgroup
    (CT.Tiles(8, 16, 256, 64, 8, 3, "gluon"), 16, 256),  # 256 output channels, two warpgroups
    (CT.Tiles(16, 8, 128, 64, 4, 4, "gluon"), 8, 512),   # two 8x8 images a program
])
def test_the_gluon_kernel_builds_for_hopper_with_both_operands_in_shared_memory(tiles, h, cin):
    """An offline sm_90 build (Triton's own ptxas, no GPU): the input box reshaped to the GEMM's operand must stay a
    view in shared memory (no load into registers, which is where the plain Triton kernel went wrong), the loads be
    TMA and the wgmma asynchronous with one group in flight."""
    import os
    import re
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # a build, not an interpreted run
    code = ("import sys; from benchmarks.speed import conv_tma as CT; "
            f"sys.stdout.write(CT.build_gluon(CT.{tiles!r}, {h}, {cin}, {2 * tiles.bn}))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    ptx = done.stdout
    assert "cp.async.bulk.tensor" in ptx and "wgmma.mma_async" in ptx
    assert not re.search(r"ld\.shared|ldmatrix", ptx)
    assert set(re.findall(r"wgmma\.wait_group\.sync\.aligned (\d+)", ptx)) == {"0", "1"}
