"""train.bf16_reduced_reduction and train.autotune_gemm (NOTES item 56): set by every build, so that one build's
choice does not outlive it in a process that makes several (the benchmarks' rows); the autotuning refused where
nothing is compiled."""

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


def test_gemm_autotuning_needs_a_compiled_step():
    assert load_config("tiny", ["train.autotune_gemm=True"]).train.autotune_gemm
    with pytest.raises(BadValue, match="train.autotune_gemm=True .* add train.compile=True"):
        load_config("tiny", ["train.autotune_gemm=True", "train.compile=False"])
