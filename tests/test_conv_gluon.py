"""ffcv_ddpm.conv_gluon, the Gluon convolution with GroupNorm's epilogue: built for sm_90 without a GPU (no
interpreter runs Gluon; its answers are checked on the GPU by benchmarks.speed.conv_tma), what the build did, its
torch reference, and what it refuses."""

import json
import os
import re
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from ffcv_ddpm import conv_gluon as CG


# Every offline build the tests below check: (tiles, h, cin, cout, keyword arguments).
BUILDS = [
    (CG.GluonTiles(4, 128, 64, 4, 4), 32, 128, {}),                                    # the plain convolution
    (CG.GluonTiles(8, 256, 64, 8, 3), 16, 256, {"bias": 1, "res": True, "stats": True}),  # a res block's conv2
    (CG.GluonTiles(16, 256, 64, 8, 3), 8, 512, {"bias": 2, "stats": True}),            # two 8x8 images, time bias
    (CG.GluonTiles(8, 128, 64, 8, 3, True), 16, 256, {"prologue": True, "bias": 2, "stats": True}),  # norm1 + conv1
    (CG.GluonTiles(4, 128, 64, 8, 3, True), 32, 128,  # norm2 + dropout + conv2 + the skip
     {"prologue": True, "dropout": True, "bias": 1, "res": True, "stats": True}),
]
LATE_KW = {"bias": 1, "res": True, "stats": True}
EARLY, LATE = CG.GluonTiles(4, 128, 64, 8, 3), CG.GluonTiles(4, 128, 64, 8, 3, late=True)


def key(tiles, h, cin, cout, kw) -> str:
    return repr((tiles, h, cin, cout, sorted(kw.items())))


@pytest.fixture(scope="module")
def built() -> dict[str, tuple[str, int]]:
    """{key(build): (PTX, shared memory bytes a program)} of every offline sm_90 build above, in one process without
    TRITON_INTERPRET (one process for the seven builds: each costs ~3 s of imports)."""
    jobs = [(tiles, h, cin, 2 * tiles.bn, kw) for tiles, h, cin, kw in BUILDS]
    jobs += [(tiles, 32, 128, 256, LATE_KW) for tiles in (EARLY, LATE)]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # a build, not an interpreted run
    code = ("import json, sys; from ffcv_ddpm import conv_gluon as CG; from ffcv_ddpm.conv_gluon import GluonTiles; "
            f"json.dump([CG.build(tiles, h, cin, cout, **kw) for tiles, h, cin, cout, kw in {jobs!r}], sys.stdout)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return {key(*job): tuple(out) for job, out in zip(jobs, json.loads(done.stdout))}


@pytest.mark.parametrize("tiles,h,cin,kw", BUILDS)
def test_it_builds_for_hopper_with_both_operands_in_shared_memory(built, tiles, h, cin, kw):
    """The input box reshaped to the GEMM's operand stays a view in shared memory (no load into registers, where
    plain Triton's kernel went wrong, NOTES 34), the loads are TMA, the wgmma asynchronous with one group in flight;
    with the epilogue, the residual arrives by TMA too and the statistics are stored."""
    ptx, _ = built[key(tiles, h, cin, 2 * tiles.bn, kw)]
    assert "wgmma.mma_async" in ptx
    assert set(re.findall(r"wgmma\.wait_group\.sync\.aligned (\d+)", ptx)) == {"0", "1"}
    loads = len(re.findall(r"cp\.async\.bulk\.tensor\.\dd\.shared::cluster\.global", ptx))
    assert loads >= 2 + kw.get("res", False)  # the input box and the weights (+ the residual)
    if not kw:  # the main loop, alone: no operand read from shared memory into registers (the epilogue's
        assert not re.search(r"ld\.shared|ldmatrix", ptx)  # residual and cross-warp sums are)
    if kw.get("prologue"):  # the activation computed where wgmma takes it: SiLU as one tanh a value, no exponential
        assert "tanh.approx.f32" in ptx and "ex2.approx" not in ptx
    assert ("st.global" in ptx) == kw.get("stats", False)  # the statistics; the output goes by TMA


def test_a_late_output_buffer_takes_the_rings_memory_two_programs_an_sm(built):
    """late=True allocates the output's buffer after the main loop: the allocator gives it the ring's memory, so a
    128 x 128 tile with three slots fits twice in an SM's 228 KB (the residual then read after the loop)."""
    _, early = built[key(EARLY, 32, 128, 256, LATE_KW)]
    _, late = built[key(LATE, 32, 128, 256, LATE_KW)]
    ring, out = 3 * 2 * 128 * 64 * 2, 128 * 128 * 2
    assert early >= ring + out and ring <= late < ring + out and 2 * late <= 228 * 1024


def test_the_reference_is_conv2d_plus_bias_and_residual_and_its_tile_statistics():
    g = torch.Generator().manual_seed(0)
    cl = torch.channels_last
    x = torch.randn(3, 16, 8, 8, generator=g).to(torch.bfloat16).to(memory_format=cl)
    w = (torch.randn(8, 16, 3, 3, generator=g) * 0.1).to(torch.bfloat16).to(memory_format=cl)
    bias, res = torch.randn(3, 8, generator=g), torch.randn(3, 8, 8, 8, generator=g).to(torch.bfloat16)
    out, part = CG.reference(x, w, 4, bias, res)
    want = (F.conv2d(x.double(), w.double(), padding=1) + bias.double()[:, :, None, None] + res.double())
    assert (out.double() - want).abs().max() < 0.05  # bf16 rounding of |values| up to ~8
    assert part.shape == (3, 2, 2, 8)  # (sample, tile of 4 rows, mean and M2, channel)
    top = out[:, :, :4].float()
    torch.testing.assert_close(part[:, 0, 0], top.mean((2, 3)))
    torch.testing.assert_close(part[:, 0, 1], ((top - top.mean((2, 3), keepdim=True)) ** 2).sum((2, 3)))
    # whole images a tile where rows exceed H: one tile a sample
    assert CG.reference(x, w, 16)[1].shape == (3, 1, 2, 8)
    # the prologue: SiLU of the input's affine per (sample, channel), zero padding applied to the activation
    scale, shift = 1 + torch.rand(3, 16, generator=g), torch.randn(3, 16, generator=g)
    act = F.silu(x.double() * scale.double()[:, :, None, None] + shift.double()[:, :, None, None])
    out, _ = CG.reference(x, w, 4, prologue=(scale, shift))
    assert (out.double() - F.conv2d(act, w.double(), padding=1)).abs().max() < 0.05
    # dropout: the bits' kept values, scaled by 1 / (1 - p)
    keep = torch.rand(3, 16, 8, 8, generator=g) > 0.25
    words = torch.zeros(3 * 8 * 8, 1, dtype=torch.int64)
    for c in range(16):
        words[:, 0] |= keep[:, c].permute(0, 1, 2).reshape(-1).long() << c
    out, _ = CG.reference(x, w, 4, prologue=(scale, shift), dropout=(words.to(torch.int32), 0.25))
    want = F.conv2d(act * keep.double() / 0.75, w.double(), padding=1)
    assert (out.double() - want).abs().max() < 0.05


def test_shapes_it_cannot_tile_or_layouts_it_cannot_read_are_one_error():
    x = torch.randn(1, 64, 8, 8).to(torch.bfloat16).to(memory_format=torch.channels_last)
    w = torch.randn(128, 64, 3, 3).to(torch.bfloat16).to(memory_format=torch.channels_last)
    with pytest.raises(ValueError, match=r"does not tile a 8x8 image of 64 -> 128 channels"):
        CG.conv3x3(x, w, CG.GluonTiles(3))
    with pytest.raises(ValueError, match="must be channels_last"):
        CG.conv3x3(x.contiguous(), w, CG.GluonTiles(8))
    bits = torch.zeros(64, 2, dtype=torch.int32)
    with pytest.raises(ValueError, match="dropout is applied to the prologue's activation: give a prologue too"):
        CG.conv3x3(x, w, CG.GluonTiles(8), dropout=(bits, 0.1))
