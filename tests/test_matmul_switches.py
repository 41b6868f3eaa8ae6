"""train.bf16_reduced_reduction and the inductor switches train.autotune_gemm, tune_kernels, combo_kernels (NOTES item
56): set by every build, so that one build's choice does not outlive it in a process that makes several (the
benchmarks' rows); the inductor switches refused where nothing is compiled."""

import pytest
import torch

from ffcv_ddpm.checks import BadValue
from ffcv_ddpm.config import load_config
from ffcv_ddpm.step import build


@pytest.fixture
def flag_restored():
    before = torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction
    yield
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = before


def test_each_build_sets_cublas_reduction_flag(flag_restored):
    for value in (False, True, False):
        build(load_config("tiny", [f"train.bf16_reduced_reduction={value}", "train.compile=False"]),
              torch.device("cpu"))
        assert torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction is value


@pytest.mark.parametrize("key", ["autotune_gemm", "tune_kernels", "combo_kernels"])
def test_inductor_switches_need_a_compiled_step(key):
    assert getattr(load_config("tiny", [f"train.{key}=True"]).train, key)
    with pytest.raises(BadValue, match=f"train.{key}=True changes how inductor .* add train.compile=True"):
        load_config("tiny", [f"train.{key}=True", "train.compile=False"])
