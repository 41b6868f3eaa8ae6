"""The convolution that owns its GroupNorm (ffcv_ddpm.conv_gn) against plain torch, on the GPU or, on machines without
one, through Triton's interpreter (conftest sets TRITON_INTERPRET=1), and benchmarks.speed.conv_gn_bench end to end
(--smoke, interpreter only). The references are fp64 on the CPU; the kernels see the inputs on DEV."""

import json

import pytest
import torch
import torch.nn.functional as F

from ffcv_ddpm import conv_gn as CG
from ffcv_ddpm.norm import keep_mask

pytestmark = pytest.mark.usefixtures("one_thread")


def needs_triton():
    import triton

    if not (torch.cuda.is_available() or triton.knobs.runtime.interpret):
        pytest.skip("needs a GPU or TRITON_INTERPRET=1")


DEV = "cuda" if torch.cuda.is_available() else "cpu"


def rel(a, ref) -> float:
    return ((a.cpu().double() - ref.cpu().double()).norm() / ref.cpu().double().norm()).item()


def on(*ts):
    """The tensors on DEV, in their layouts (None stays None)."""
    return [t.to(DEV) if t is not None else None for t in ts]


def randn(*shape, g, scale=1.0, shift=0.0):
    return torch.randn(shape, generator=g, dtype=torch.float64) * scale + shift


# (name, N, C1, C2, C_out, H, W, stride, silu, p, bias, residual, groups, tile): every case has several tiles along
# the pixels, an odd batch or a tile of two samples, and groups of a size that is not a power of two.
CASES = [
    # K = 2 tiles a sample, 2 channel steps a tap (the second partial), groups of 5
    ("dropout-residual", 3, 40, 0, 20, 4, 8, 1, True, 0.3, "sample", True, 4, (16, 32, 32, 4, 1)),
    # two parts (24 + 16 channels), a tile holds 2 samples (H*W = 16 < 32 rows) and the last tile one, groups of 3
    ("two-parts", 3, 24, 16, 24, 4, 4, 1, True, 0.0, "channel", False, 8, (32, 32, 32, 4, 1)),
    # no prologue (the stem and the downsample), stride 2, 2 output-channel tiles
    ("stride-2", 3, 12, 0, 18, 8, 8, 2, False, 0.0, "channel", False, 6, (16, 16, 32, 4, 1)),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c[0])
def test_forward_and_statistics_match_torch(case):
    """out against F.conv2d of the activation (x * scale + shift, SiLU, dropout with the same mask; zero padding of
    the activation) + bias + residual, in fp32; the epilogue's statistics, through the finalize, against torch's
    per-group mean and variance of the output, and the coef they give against GroupNorm's. The output has
    |mean| >> std (the residual's offset): partial sums that were not centred would lose the variance."""
    needs_triton()
    name, n, c1, c2, co, h, w, stride, silu, p, bias_kind, residual, groups, tile = case
    g = torch.Generator().manual_seed(sum(map(ord, name)))
    cl = torch.channels_last
    c = c1 + c2
    x = randn(n, c, h, w, g=g, scale=2.0, shift=1.0).float().contiguous(memory_format=cl)
    x1, x2 = (x[:, :c1].contiguous(memory_format=cl), x[:, c1:].contiguous(memory_format=cl)) if c2 else (x, None)
    weight = randn(co, c, 3, 3, g=g, scale=c ** -0.5).float().contiguous(memory_format=cl)
    norm = c2 > 0 or silu  # the stride-2 case has no prologue
    coef = torch.stack((randn(n, c, g=g) + 1, randn(n, c, g=g)), 1).float() if norm else None
    bias = (randn(n, co, g=g) if bias_kind == "sample" else randn(co, g=g)).float()
    oh, ow = (h - 1) // stride + 1, (w - 1) // stride + 1
    res = randn(n, co, oh, ow, g=g, shift=1000.0).float().contiguous(memory_format=cl) if residual else None
    seed = torch.tensor([4321])
    bits = CG.keep_bits(seed.to(DEV), (n, c, h, w), p) if p else None
    # NaN first: an element the kernel does not write fails the comparisons
    out = torch.full((n, co, oh, ow), float("nan")).contiguous(memory_format=cl)
    part = torch.full((n, CG.stats_layout(oh * ow, tile[0])[0], 2, co), float("nan"))
    args = on(x1, weight, x2, coef, bias, res, out, part)
    out, part = CG.conv3x3(*args[:2], x2=args[2], coef=args[3], silu=silu, bits=bits, p=p, bias=args[4], res=args[5],
                           stats=True, stride=stride, config=CG.TileConfig(*tile), out=args[6], part=args[7])
    keep = keep_mask(seed, (n, c, h, w), p) if p else None
    ref = CG.reference(x, weight, coef=coef, silu=silu, keep=keep, p=p, bias=bias, res=res, stride=stride)
    assert out.shape == ref.shape and out.is_contiguous(memory_format=cl)
    assert torch.isfinite(out).all() and rel(out, ref) < 1e-5
    if p:  # the mask drops about p of the activations, and the same ones as keep_mask
        assert torch.equal(CG.unpack_bits(bits, (n, c, h, w)).cpu(), keep)
        assert abs(keep.double().mean() - (1 - p)) < 0.1

    a2, b2, e2 = (randn(n, co, g=g).float() + s for s in (1.0, 0.0, 0.0))
    coef2, mean, rstd = (t.cpu() for t in CG.finalize(part, oh * ow, tile[0], groups, *on(a2, b2, e2)))
    out = out.cpu()
    y = out.double() + e2.double()[:, :, None, None]
    var, ref_mean = torch.var_mean(y.reshape(n, groups, -1), dim=2, unbiased=False)
    assert abs(ref_mean.mean()) > 50 * var.sqrt().mean() or not residual
    assert rel(mean, ref_mean) < 1e-6 and rel(rstd, torch.rsqrt(var + 1e-5)) < 1e-5
    # coef is GroupNorm's: act(out) = GroupNorm(out + e2) * a2 + b2, which the next conv3x3 reads as its coef
    gn = F.group_norm(y, groups, eps=1e-5) * a2.double()[:, :, None, None] + b2.double()[:, :, None, None]
    assert rel(CG.activation(out, coef2, False, None, 0.0), gn) < 1e-5
    assert rel(coef2, CG.coef_of(ref_mean, torch.rsqrt(var + 1e-5), a2.double(), b2.double(), e2.double())) < 1e-5


def test_any_image_size_without_statistics():
    """5 x 6 pixels against 16-row tiles (neither divides the other): no statistics, the per-sample scale, shift and
    bias loaded per row; dropout's bits at pixels a tile boundary splits."""
    needs_triton()
    g = torch.Generator().manual_seed(7)
    n, c, co, h, w, p = 3, 16, 8, 5, 6, 0.2
    x = randn(n, c, h, w, g=g).float().contiguous(memory_format=torch.channels_last)
    weight = randn(co, c, 3, 3, g=g, scale=c ** -0.5).float()
    coef = torch.stack((randn(n, c, g=g) + 1, randn(n, c, g=g)), 1).float()
    bias = randn(n, co, g=g).float()
    seed = torch.tensor([11])
    bits = CG.keep_bits(seed.to(DEV), (n, c, h, w), p)
    xd, wd, coefd, biasd = on(x, weight, coef, bias)
    out, part = CG.conv3x3(xd, wd, coef=coefd, silu=True, bits=bits, p=p, bias=biasd,
                           config=CG.TileConfig(16, 16, 32, 4, 1))
    ref = CG.reference(x, weight, coef=coef, silu=True, keep=keep_mask(seed, (n, c, h, w), p), p=p, bias=bias)
    assert part is None and rel(out, ref) < 1e-5


def test_bf16_operands_with_fp32_accumulation():
    """The GPU's dtype through the same kernel: bf16 in and out, the error of one bf16 rounding of the activation
    and of the output."""
    needs_triton()
    g = torch.Generator().manual_seed(5)
    n, c, co, h = 2, 32, 16, 4
    x = randn(n, c, h, h, g=g).to(torch.bfloat16).contiguous(memory_format=torch.channels_last)
    weight = randn(co, c, 3, 3, g=g, scale=c ** -0.5).to(torch.bfloat16)
    coef = torch.stack((randn(n, c, g=g) + 1, randn(n, c, g=g)), 1).float()
    out, _ = CG.conv3x3(*on(x, weight), coef=on(coef)[0], silu=True, config=CG.TileConfig(16, 16, 32, 4, 1))
    assert out.dtype == torch.bfloat16
    assert rel(out, CG.reference(x.double(), weight.double(), coef=coef.double(), silu=True)) < 1e-2


def test_what_the_kernel_cannot_do_is_refused_in_one_line():
    x = torch.zeros(2, 8, 6, 8)
    w = torch.zeros(4, 8, 3, 3)
    with pytest.raises(ValueError, match="divide one another"):
        CG.stats_layout(6 * 8, 32)
    with pytest.raises(ValueError, match=r"is not \(4, 16, 3, 3\)"):
        CG.conv3x3(x, torch.zeros(4, 8, 3, 3), x2=x, coef=torch.zeros(2, 2, 16))
    with pytest.raises(ValueError, match="needs its keep bits"):
        CG.conv3x3(x, w, coef=torch.zeros(2, 2, 8), p=0.1)
    with pytest.raises(ValueError, match="pass coef"):
        CG.conv3x3(x, w, silu=True)
    assert CG.stats_layout(64, 16) == (4, 16, 1) and CG.stats_layout(16, 64) == (1, 16, 4)


# ---------------------------------------------------------------------------------------------------- the bench

def test_the_sites_are_every_3x3_convolution_of_the_network():
    """One forward records each 3x3 convolution once: the stem, two per residual block, the downsamples and the
    output conv; conv1 takes the time embedding as a per-(sample, channel) bias (model.conv_bias_in_norm), conv2
    the dropout and the residual, the up path's conv1 two parts."""
    from benchmarks.speed import conv_gn_bench as B
    from ffcv_ddpm.config import load_config

    cfg = load_config("ddpm-cifar10", list(B.SMOKE_OVERRIDES)).model
    sites = dict(B.record_sites(cfg))
    levels, blocks = len(cfg.channel_mult), cfg.num_res_blocks
    res_blocks = levels * blocks + 2 + levels * (blocks + 1)
    assert sum(sites.values()) == 1 + 2 * res_blocks + (levels - 1) + 1
    by = lambda **kw: sum(n for s, n in sites.items() if all(getattr(s, k) == v for k, v in kw.items()))  # noqa: E731
    assert by(norm=True, p=cfg.dropout, residual=True, bias="channel") == res_blocks  # conv2
    assert by(norm=True, p=0.0, bias="sample", stats=True) == res_blocks  # conv1, normalised by norm2 next
    assert by(stride=2, norm=False, stats=True) == levels - 1
    assert by(norm=False, stride=1, stats=True) == 1  # the stem
    assert by(norm=True, stats=False, residual=False) == 1  # the output conv
    assert all(s.c1 < s.cin for s in sites if s.norm and s.bias == "sample" and s.cin > s.cout)  # up conv1: parts
    assert all(s.stats for s in sites if s.residual and s.h == cfg.image_size)  # a GroupNorm reads each block out


def test_bench_runs_end_to_end_on_the_cpu(tmp_path):
    """--smoke: one site (the richest: dropout, residual, statistics) through the interpreter, its check passing, the
    JSON and the table written."""
    needs_triton()
    import triton

    from benchmarks.speed import conv_gn_bench as B

    if not triton.knobs.runtime.interpret:
        pytest.skip("--smoke runs under Triton's interpreter")
    assert B.main(["--out", str(tmp_path), "--smoke", "--sites", "1"]) == 0
    result = json.loads((tmp_path / "conv_gn_bench.json").read_text())
    row = result["rows"][0]
    assert row["site"]["p"] > 0 and row["site"]["residual"] and row["site"]["stats"]
    assert row["check"]["out"] < 1e-5 and row["check"]["mean"] < 1e-5 and row["check"]["plain_vs_cudnn"] < 1e-5
    assert {"conv_cudnn", "conv_triton", "conv_epilogue", "fused_conv", "today", "fused", "keep_bits"} <= set(row["ms"])
    assert f"| {row['name']} | {row['count']} |" in (tmp_path / "conv_gn_bench.md").read_text()


def test_the_table_marks_failed_checks_and_sites_that_did_not_run():
    """A row whose check failed says FAILED beside its error; a site no tile config ran is a row with the reason; the
    rows not measured yet are left out (a run cut short)."""
    from benchmarks.speed import conv_gn_bench as B

    ms = {"conv_cudnn": 1.0, "conv_triton": 2.0, "conv_epilogue": 2.5, "fused_conv": 3.0, "today": 4.0, "fused": 3.5}
    check = {"out": 0.5, "written": True, "plain_vs_cudnn": 1e-3}
    rows = [{"name": "a", "count": 2, "gflop": 100.0, "ms": ms, "check": check, "bytes_saved": 3e8},
            {"name": "b", "count": 1, "gflop": 10.0, "error": "no tile config ran"},
            {"name": "c", "count": 1, "site": {}}]
    result = {"rows": rows, "preset": "p", "batch": 8, "device_name": None, "triton": "3", "command": "cmd",
              "environment": {}, "sites_total": 3}
    md = B.render(result)
    assert "| a | 2 | 100 | 100 | 50 | 40 | 33 | 4.000 | 3.500 | 300 | +1.000 | 5.0e-01 FAILED |" in md
    assert "| b | 1 | 10 |" + " - |" * 8 + " no tile config ran |" in md
    assert "| c |" not in md and "1 of 3 distinct" in md


def test_conv_autotune_measures_each_distinct_shape_once():
    """benchmarks.speed.conv_autotune: the sites deduplicated by what a plain convolution sees, their counts summed,
    and the FLOPs of a stride-2 shape counted on its output."""
    from benchmarks.speed.conv_autotune import gflop, shapes_of
    from ffcv_ddpm.config import load_config

    from benchmarks.speed.conv_gn_bench import record_sites

    sites = record_sites(load_config("ddpm-cifar10").model)
    shapes = shapes_of(sites)
    assert sum(s["count"] for s in shapes) == sum(c for _, c in sites) == 49
    assert len({(s["cin"], s["cout"], s["h"], s["stride"]) for s in shapes}) == len(shapes) < len(sites)
    down = next(s for s in shapes if s["stride"] == 2 and s["h"] == 32)
    assert gflop(down, 2) == 2 * 2 * 16 * 16 * down["cout"] * down["cin"] * 9 / 1e9
