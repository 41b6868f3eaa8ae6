"""ffcv_ddpm.conv_cutlass on the CPU: the headers out of CUTLASS's wheel, the library named by its source, the
calls' checks and the sums' reference, and conv_tma's table with the CUTLASS epilogue's column. The kernels
themselves run on an H100/H200 only (results/h200/conv-cutlass-*)."""

import shutil
import subprocess
import zipfile

import pytest
import torch

from ffcv_ddpm import conv_cutlass as CC
from benchmarks.speed import conv_tma as CT


def fake_wheel(path, parts=CC.WHEEL_PARTS):
    with zipfile.ZipFile(path, "w") as z:
        for prefix in parts:
            z.writestr(prefix + "a/header.hpp", f"// {prefix}\n")
        z.writestr("cutlass_library/__init__.py", "")
    return path


def test_the_headers_come_out_of_the_wheel_into_inc(tmp_path):
    inc = CC.unpack_headers(fake_wheel(tmp_path / "w.whl"), tmp_path / "inc")
    assert (inc / "cute" / "a" / "header.hpp").read_text() == "// cutlass_library/source/include/cute/\n"
    assert (inc / "cutlass" / "util" / "a" / "header.hpp").is_file()
    assert not (inc / "cutlass_library").exists() and not (tmp_path / "inc.partial").exists()


def test_a_wheel_without_the_headers_is_one_error_and_leaves_no_tree(tmp_path):
    wheel = fake_wheel(tmp_path / "w.whl", list(CC.WHEEL_PARTS)[:1])
    with pytest.raises(ValueError, match="tools/util/include"):
        CC.unpack_headers(wheel, tmp_path / "inc")
    assert not (tmp_path / "inc").exists() and not (tmp_path / "inc.partial").exists()


def test_without_the_network_or_a_wheel_it_says_what_to_put_where(tmp_path, monkeypatch):
    monkeypatch.setattr(CC.subprocess, "run", lambda *a, **k: subprocess.CompletedProcess(a, 1))
    with pytest.raises(RuntimeError, match="could not fetch CUTLASS's headers.*nvidia_cutlass-4.2.0.0"):
        CC.headers(tmp_path)


def test_the_library_is_named_by_its_source(tmp_path, monkeypatch):
    src = tmp_path / "conv_fprop.cu"
    src.write_text("// one version\n")
    monkeypatch.setattr(CC, "SOURCE", src)
    first = CC.library_path(tmp_path)
    src.write_text("// another\n")
    assert CC.library_path(tmp_path) != first and first.parent == tmp_path / "build"


def test_a_built_library_is_used_without_nvcc_and_a_missing_one_needs_it(tmp_path, monkeypatch):
    monkeypatch.setattr(CC.shutil, "which", lambda name: None)
    with pytest.raises(RuntimeError, match="no nvcc"):
        CC.build(tmp_path)
    built = CC.library_path(tmp_path)
    built.parent.mkdir(parents=True)
    built.write_bytes(b"\x7fELF")
    assert CC.build(tmp_path) == built


def test_the_cli_fails_in_one_line_without_nvcc(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(CC.shutil, "which", lambda name: None)
    assert CC.main(["--home", str(tmp_path)]) == 2
    assert "no nvcc" in capsys.readouterr().err


PLAIN = CC.CutlassConfig(0, "pingpong 128x128x64", 6, 205824, 1)
SUMS = CC.CutlassConfig(1, "pingpong 128x128x64 + residual + sums", 6, 205824, 1, CC.EPI_STATS | CC.EPI_RESIDUAL)


def test_a_call_that_does_not_match_the_configs_epilogue_is_refused_before_any_launch():
    x = torch.randn(2, 64, 8, 8).bfloat16().to(memory_format=torch.channels_last)
    w = torch.randn(128, 64, 3, 3).bfloat16().to(memory_format=torch.channels_last)
    with pytest.raises(ValueError, match="epilogue flags 3, the call asks for 0"):
        CC.conv3x3(x, w, SUMS)
    with pytest.raises(ValueError, match="epilogue flags 0, the call asks for 2"):
        CC.conv3x3_sums(x, w, PLAIN)
    with pytest.raises(ValueError, match="expected bf16 CUDA tensors"):
        CC.conv3x3(x, w, PLAIN)


def test_the_sums_reference_is_per_128_pixels_in_nhwc_order():
    g = torch.Generator().manual_seed(0)
    out = torch.randn(2, 128, 16, 16, generator=g).bfloat16().to(memory_format=torch.channels_last)
    sums = CC.tile_sums(out)
    assert sums.shape == (2, 4, 128)
    # tile 3 = the second half of sample 1's rows (pixels 128..255 of its 256, rows 8..15)
    block = out[1, :, 8:, :].float()
    assert torch.allclose(sums[0, 3], block.sum((1, 2)), rtol=1e-5, atol=1e-4)
    assert torch.allclose(sums[1, 3], (block * block).sum((1, 2)), rtol=1e-5, atol=1e-3)


def test_the_table_has_the_cutlass_epilogues_column_and_its_total():
    site = {"name": "128->128 32x32/s1", "count": 5, "flop": 2.0e12, "cudnn_ms": 0.41,
            "best": {"cutlass": {"ms": 0.40, "tiles": list(PLAIN)}},
            "cutlass_epilogue": {"ms": 0.45, "tiles": list(SUMS), "extra_ms": 0.05, "passes_ms": 0.2}}
    result = {"command": "python -m benchmarks.speed.conv_tma --out OUT --kinds cutlass", "environment": {},
              "device_name": "H200", "batch": 1024, "kinds": ["cutlass"], "sites": [site]}
    md = CT.render(result)
    assert "CUTLASS + residual + sums ms" in md
    assert "| 0.450 'pingpong 128x128x64 + residual + sums': +0.050 for 0.200 |" in md
    assert "+0.25 ms a step over the plain kernel, for 1.00 ms of passes removed" in md


@pytest.mark.parametrize("add", [None, "channel", "sample"])
def test_group_stats_from_the_tile_sums_are_the_group_norms(add):
    """The next GroupNorm's (mean, rstd) from the kernel's tile sums, with the bias it adds folded in exactly."""
    g = torch.Generator().manual_seed(1)
    n, c, h, groups = 3, 256, 16, 32
    out = (torch.randn(n, c, h, h, generator=g) * 2 + 1).bfloat16().to(memory_format=torch.channels_last)
    b = {None: None, "channel": torch.randn(c, generator=g), "sample": torch.randn(n, c, generator=g)}[add]
    mean, rstd = CC.group_stats(CC.tile_sums(out), n, h * h, groups, b)  # the Triton kernel, interpreted
    ref = CC.group_stats_torch(CC.tile_sums(out), n, h * h, groups, b)
    assert torch.allclose(mean, ref[0], atol=1e-5) and torch.allclose(rstd, ref[1], rtol=1e-5)
    x = out.float() + (0 if b is None else b.view(-1, c, 1, 1) if b.dim() == 2 else b.view(1, c, 1, 1))
    xg = x.reshape(n, groups, -1)
    assert torch.allclose(mean, xg.mean(-1), atol=1e-4)
    assert torch.allclose(rstd, torch.rsqrt(xg.var(-1, unbiased=False) + 1e-5), rtol=1e-4)


def test_group_stats_refuse_tiles_that_span_samples():
    with pytest.raises(ValueError, match="64 pixels a sample is not a whole number of 128-pixel tiles"):
        CC.group_stats(torch.zeros(2, 1, 128), 2, 64, 32)


def test_the_table_sums_the_chains_where_they_ran():
    chain = {"today_ms": 0.70, "fused_ms": 0.50, "saved_ms": 0.20, "mean_err": 1e-6, "rstd_err": 2e-6}
    site = {"name": "128->128 32x32/s1", "count": 5, "flop": 2.0e12, "cudnn_ms": 0.41, "best": {},
            "cutlass_epilogue": {"ms": 0.45, "tiles": list(SUMS), "extra_ms": 0.05, "passes_ms": 0.2,
                                 "chain": chain}}
    result = {"command": "c", "environment": {}, "device_name": "H200", "batch": 1024, "kinds": ["cutlass"],
              "sites": [site]}
    md = CT.render(result)
    assert "; chain 0.700 -> 0.500 |" in md
    assert ("statistics kernel, which reads the residual and writes the sum where there is one, and its finalize) "
            "3.50 ms") in md
    assert "2.50 ms (-1.00); (mean, rstd) within 2.0e-06" in md


def test_the_presets_chain_takes_the_statistics_of_the_residual_sum_as_the_added_chain_does():
    """conv_gn_bench.gn_coef with res and rbias (the statistics kernel adding them as it reads, norm_residual) gives
    the (mean, rstd) of the sum written first: the two 'today' chains of conv_tma's chain rows agree. Eighths below
    16, so that every sum is exact in bf16 (Triton's interpreter truncates where the GPU rounds to nearest)."""
    from benchmarks.speed.conv_gn_bench import gn_coef

    g = torch.Generator().manual_seed(2)
    n, c, h, groups = 2, 64, 8, 8

    def eighths(*shape):
        return torch.randint(-40, 41, shape, generator=g) / 8

    y, res = (eighths(n, c, h, h).bfloat16().to(memory_format=torch.channels_last) for _ in "ab")
    bias = eighths(c)
    a, b = torch.ones(n, c), torch.zeros(n, c)
    summed = (y.float() + res.float() + bias.view(1, c, 1, 1)).bfloat16()
    _, m0, r0 = gn_coef(summed.contiguous(memory_format=torch.channels_last), groups, a, b)
    _, m1, r1 = gn_coef(y, groups, a, b, res=res, rbias=bias)
    assert torch.allclose(m1, m0, atol=1e-5) and torch.allclose(r1, r0, rtol=1e-5)
    _, m2, _ = gn_coef(y, groups, a, b, res=res)  # without the bias: off, so the check above can fail
    assert not torch.allclose(m2, m0, atol=1e-2)


DGRAD = CC.CutlassConfig(2, "dgrad pingpong 128x128x64", 6, 205824, 1, 0, CC.OP_DGRAD)


def test_a_forward_config_does_not_run_a_data_gradient_nor_the_other_way():
    dy = torch.randn(2, 128, 8, 8).bfloat16().to(memory_format=torch.channels_last)
    w = torch.randn(128, 64, 3, 3).bfloat16().to(memory_format=torch.channels_last)
    with pytest.raises(ValueError, match="computes the forward; the call asks for the data gradient"):
        CC.conv3x3_dgrad(dy, w, PLAIN)
    with pytest.raises(ValueError, match="computes the data gradient; the call asks for the forward"):
        CC.conv3x3(dy, w, DGRAD)
    with pytest.raises(ValueError, match=r"expected dy \[N, K, H, W\]"):  # dy has the forward's output channels
        CC.conv3x3_dgrad(dy[:, :64].contiguous(memory_format=torch.channels_last), w, DGRAD)


def test_the_dgrad_table_sums_a_step_over_the_sites_that_ran():
    from benchmarks.speed import conv_dgrad as CD

    ok = {"name": "128->128 32x32/s1 [GN+SiLU; -]", "count": 5, "flop": 2.0e12, "cudnn_ms": 0.50, "cudnn_err": 1e-3,
          "passes_ms": 0.13, "rows": [{"config": "dgrad pingpong 128x128x64", "rel_err": 1e-3, "ms": 0.40}],
          "best": {"config": "dgrad pingpong 128x128x64", "rel_err": 1e-3, "ms": 0.40}}
    bad = {"name": "256->256 8x8/s1 [-; -]", "count": 3, "flop": 1.0e11, "cudnn_ms": 0.05, "cudnn_err": 1e-3,
           "rows": [{"config": "dgrad 128x128x64", "error": "RuntimeError: launch failed"}]}
    result = {"command": "python -m benchmarks.speed.conv_dgrad --out OUT", "environment": {}, "device_name": "H200",
              "batch": 1024, "library": "libconv_fprop-x.so", "sites": [ok, bad]}
    md = CD.render(result)
    assert ("| 128->128 32x32/s1 [GN+SiLU; -] | 5 | 0.500 (4000) | 0.400 (5000) | dgrad pingpong 128x128x64 | 0.130 "
            "| - | - |") in md
    assert "no correct config: RuntimeError: launch failed" in md
    assert "cuDNN 2.50 ms, CUTLASS 2.00 ms (1.250x cuDNN's rate)" in md and "GroupNorm feeds: 0.65 ms" in md
    assert "with the sums in its epilogue" not in md  # no fused rows ran: no line for them
    # with the epilogue's row: its time against the plain dgrad's plus the passes, and a wrong one named
    ok["act_sums"] = [{"config": CC.DGRAD_SUMS_CONFIG, "silu": 2, "rel_err": 1e-3, "sums_err": 1e-4, "ms": 0.45},
                      {"config": CC.DGRAD_SUMS_CONFIG + CC.BARE, "silu": 0, "rel_err": 1e-3, "sums_err": 1e-4,
                       "ms": 0.41},
                      {"config": CC.DGRAD_SUMS_CONFIG, "silu": 0, "rel_err": 1e-3, "sums_err": 1e-4, "ms": 0.42}]
    ok["fused"] = dict(ok["act_sums"][0], saved_ms=0.40 + 0.13 - 0.45)
    bad["act_sums"] = [{"config": CC.DGRAD_SUMS_CONFIG, "silu": 0, "rel_err": 1e-3, "sums_err": 0.3, "ms": 0.1}]
    md = CD.render(result)
    assert "| dgrad pingpong 128x128x64 | 0.130 | 0.450 (no SiLU: 0.420, bare: 0.410) | +0.080 |" in md
    assert "wrong: dx 0.001, sums 0.3" in md
    assert "+0.40 ms a step saved against the plain dgrad and the passes" in md


DGRAD_SUMS = CC.CutlassConfig(3, CC.DGRAD_SUMS_CONFIG, 6, 205824, 1, CC.EPI_STATS | CC.EPI_ACT_SUMS, CC.OP_DGRAD)


@pytest.mark.parametrize("p", [0.0, 0.3])
def test_the_act_sums_are_the_group_norm_backwards_reduction(p):
    """act_sums' (g, g x), summed over a sample's tiles, give what autograd gives GroupNorm + SiLU (+ dropout)'s
    affine: db = sum g, da = sum g xhat = rstd (sum g x - mean sum g), with (u, v) the affine output's coefficients."""
    g = torch.Generator().manual_seed(0)
    n, c, groups, hw = 2, 128, 32, 16
    x = (torch.randn(n, c, hw, hw, generator=g, dtype=torch.float64) * 2 + 0.5).to(memory_format=torch.channels_last)
    a = (torch.rand(n, c, generator=g, dtype=torch.float64) + 0.5).requires_grad_()
    b = (torch.randn(n, c, generator=g, dtype=torch.float64) * 0.3).requires_grad_()
    xg = x.reshape(n, groups, -1)
    mean = xg.mean(-1, keepdim=True)
    rstd = (xg.var(-1, unbiased=False, keepdim=True) + 1e-5).rsqrt()
    xhat = ((xg - mean) * rstd).reshape(x.shape)
    dout = torch.randn(x.shape, generator=g, dtype=torch.float64)
    keep = torch.rand(x.shape, generator=g) >= p  # dropout's mask (all kept at p = 0)
    out = torch.nn.functional.silu(xhat * a[:, :, None, None] + b[:, :, None, None])
    (out * keep / (1 - p)).backward(dout)
    # the affine output is x u + v per (sample, channel)
    m, r = mean.expand(n, groups, c // groups).reshape(n, c), rstd.expand(n, groups, c // groups).reshape(n, c)
    coef = torch.stack([r * a.detach(), -m * r * a.detach() + b.detach()], 1)
    sums = CC.act_sums(dout, x, coef, 2, keep if p else None, 1 / (1 - p)).view(2, n, hw * hw // CC.TILE_M, c).sum(2)
    torch.testing.assert_close(sums[0], b.grad)
    torch.testing.assert_close(r * (sums[1] - m * sums[0]), a.grad)
    plain = CC.act_sums(dout, x, coef, silu=0).view(2, n, -1, c).sum(2)  # without SiLU: dout's own sums
    torch.testing.assert_close(plain[0], dout.sum((2, 3)))


def test_a_dgrad_with_sums_is_refused_before_any_launch_where_its_operands_do_not_fit():
    cl = torch.channels_last
    dy = torch.randn(2, 128, 16, 16).bfloat16().to(memory_format=cl)
    w = torch.randn(128, 128, 3, 3).bfloat16().to(memory_format=cl)
    x = torch.randn(2, 128, 16, 16).bfloat16().to(memory_format=cl)
    coef = torch.randn(2, 2, 128)
    with pytest.raises(ValueError, match="is not a dgrad with the activation's sums"):
        CC.conv3x3_dgrad_sums(dy, w, DGRAD, x, coef, 2)
    with pytest.raises(ValueError, match=r"x must be torch.bfloat16 \[2, 128, 16, 16\] channels_last"):
        CC.conv3x3_dgrad_sums(dy, w, DGRAD_SUMS, x.contiguous(), coef, 2)
    with pytest.raises(ValueError, match=r"coef must be contiguous fp32 \[2, 2, 128\]"):
        CC.conv3x3_dgrad_sums(dy, w, DGRAD_SUMS, x, coef[:, :1], 2)
    small = lambda t: t[:, :, :8, :8].contiguous(memory_format=cl)  # noqa: E731 - 64 pixels a sample
    with pytest.raises(ValueError, match="needs H\\*W a multiple of 128 \\(got 64\\)"):
        CC.conv3x3_dgrad_sums(small(dy), w, DGRAD_SUMS, small(x), coef, 2)
    seed = torch.tensor([7])
    for bad in (dict(thr=100), dict(seed=seed), dict(thr=-1), dict(thr=100, seed=seed.int())):
        with pytest.raises(ValueError, match="dropout takes a threshold > 0 and the forward's seed"):
            CC.conv3x3_dgrad_sums(dy, w, DGRAD_SUMS, x, coef, 2, **bad)
    with pytest.raises(ValueError, match="expected bf16 CUDA tensors"):
        CC.conv3x3_dgrad_sums(dy, w, DGRAD_SUMS, x, coef, 2, seed=seed, thr=100)


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++ to compile keep_hash.h on the host")
@pytest.mark.parametrize("pair", [False, True])
def test_the_epilogues_dropout_hash_is_the_kernels_mask(tmp_path, pair):
    """keep_hash.h (the dgrad epilogue's replay of the forward's dropout), compiled for the host, against
    norm.keep_mask (what the Triton kernels draw): the same mask for every element of an (N, C, H, W) output."""
    from ffcv_ddpm import norm

    n, c, h, w, p, seed = 2, 6, 3, 5, 0.3, 123456789
    thr = norm._dropout_args(p, pair)[0]
    src = tmp_path / "keep.cpp"
    src.write_text(f'#include "{CC.SOURCE.parent / "keep_hash.h"}"\n#include <cstdio>\n'
                   f"int main() {{ uint32_t s = keep_mix_seed({seed}u);\n"
                   f"  for (uint32_t i = 0; i < {n * h * w * c}u; ++i) putchar(keep_at(s, i, {thr}u, {int(pair)}) ? '1' : '0');\n"
                   "  return 0; }\n")
    subprocess.run(["g++", "-std=c++17", "-O1", str(src), "-o", str(tmp_path / "keep")], check=True)
    bits = subprocess.run([str(tmp_path / "keep")], capture_output=True, text=True, check=True).stdout
    ours = torch.tensor([b == "1" for b in bits]).view(n, h, w, c).permute(0, 3, 1, 2)  # (n, hw, c) order
    ref = norm.keep_mask(torch.tensor([seed]), (n, c, h, w), p, pair)
    assert 0 < int(ref.sum()) < ref.numel()  # a mask that keeps some and drops some: the check can fail
    assert torch.equal(ours, ref)


def test_the_dgrad_benchmark_says_it_needs_an_sm90_gpu(tmp_path, capsys):
    from benchmarks.speed import conv_dgrad as CD

    assert CD.main(["--out", str(tmp_path)]) == 2
    assert "needs an sm90 GPU" in capsys.readouterr().err
