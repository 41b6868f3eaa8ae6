"""benchmarks.speed.cudnn_fusion on a CPU machine: what it refuses, what it prices and how it reports (its graphs
need cuDNN on a GPU: benchmarks/results/<card>/cudnn-fusion-*/ hold what they measured)."""

import pytest
import torch

from benchmarks.speed import cudnn_fusion as cf


def test_without_a_gpu_or_with_a_bad_graph_it_is_one_line(tmp_path, capsys):
    assert cf.main(["--out", str(tmp_path), "--graphs", "conv,conv+bn"]) == 2
    assert "--graphs conv+bn: expected some of conv, conv+genstats" in capsys.readouterr().err
    if not torch.cuda.is_available():
        assert cf.main(["--out", str(tmp_path)]) == 2
        assert "needs a CUDA GPU" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


def test_the_passes_a_fusion_removes():
    n, cin, cout, h = 4, 8, 16, 10
    act, out = 2 * n * h * h * cin, 2 * n * 5 * 5 * cout  # bf16 input and a stride-2 output
    removed = {g: cf.passes_removed(g, n, cin, cout, h, 5) for g in cf.GRAPHS}
    assert removed == {"conv": 0, "conv+genstats": out, "conv+stats_nc": out, "sbr+conv": 2 * act,
                       "gn_silu+conv": 2 * act, "gn_silu+conv+stats_nc": 2 * act + out, "gn_silu+wgrad": act,
                       "dgrad+dsilu": 2 * act}


def test_the_report_marks_unsupported_graphs_and_wrong_results():
    ok = {"graph": "conv", "ms": 1.0, "base_ms": 0.9, "passes_ms": 0.0, "rel_err": 1e-3, "timing": "graph"}
    wrong = {"graph": "gn_silu+conv", "ms": 1.1, "base_ms": 0.9, "passes_ms": 0.4, "rel_err": 0.3, "timing": "events"}
    unsupported = {"graph": "conv+stats_nc", "error": "cudnnGraphNotSupportedError: no engine | for\nthis graph"}
    failed = {"graph": "dgrad+dsilu", "error": "TypeError: conv_dgrad() got an unexpected keyword argument 'w'"}
    result = {"command": "python -m benchmarks.speed.cudnn_fusion --out x", "environment": {"commit": "abc1234567",
              "torch": "2.11"}, "device_name": "NVIDIA H200", "batch": 1024, "copy_gbs": 3900.0,
              "sites": [{"name": "128->128 32x32/s1 [GN+SiLU; stats]", "count": 6,
                         "graphs": [ok, wrong, unsupported, failed]}]}
    md = cf.render(result)
    assert "| 128->128 32x32/s1 [GN+SiLU; stats] | 6 | conv | 1.000 | +0.100 | 0.000 | ok, base 0.900 ms |" in md
    assert "| gn_silu+conv | 1.100 | +0.200 | 0.400 | WRONG (3.0e-01), base 0.900 ms, events |" in md
    assert "| conv+stats_nc | - | - | - | unsupported: cudnnGraphNotSupportedError: no engine / for this graph |" in md
    assert "| dgrad+dsilu | - | - | - | error: TypeError: conv_dgrad() got an unexpected keyword argument 'w' |" in md


@pytest.mark.parametrize("dtype,intermediate", [("bf16", "io"), ("fp16", "io"), ("bf16", "float")])
def test_every_graph_is_built_through_the_frontends_python_api(dtype, intermediate):
    """Where nvidia-cudnn-frontend is importable (not a dependency: the GPU call installs its wheel; 1.32.0 on the CPU
    machine at 553b4c7), each graph of one small site is built node by node, which needs no GPU: argument names and
    output dims as the frontend takes them, so that a GPU call finds only what cuDNN's engines support or not."""
    cudnn = pytest.importorskip("cudnn")
    site = cf.Site(cudnn, None, cin=8, cout=16, h=6, stride=2, batch=3, device="cpu", dtype=dtype,
                   intermediate=intermediate)
    assert site.x.dtype == {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    for name in cf.GRAPHS:
        _, outs, refs = site.build(name, lower=False)
        assert outs.keys() == refs.keys() and all(o.shape == refs[k].shape for k, o in outs.items()), name
        assert all(o.dtype in (site.x.dtype, torch.float32) for o in outs.values()), name
