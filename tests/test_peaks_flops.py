"""Peak lookup by device name and the FLOP counts MFU is built on (CPU, a few seconds)."""

import dataclasses

import pytest

from benchmarks.speed.flops import published_style_flops_per_image, train_flops_per_image
from benchmarks.speed.peaks import card_slug, lookup_peak, peak_precision
from ffcv_ddpm.unet import PRESETS, ModelConfig


@pytest.mark.parametrize(
    "name, slug, bf16, tf32, fp32",
    [
        ("NVIDIA A100-SXM4-80GB", "a100", 312.0, 156.0, 19.5),
        ("NVIDIA A100-PCIE-40GB", "a100", 312.0, 156.0, 19.5),
        ("NVIDIA H100 80GB HBM3", "h100", 989.4, 494.7, 67.0),
        ("NVIDIA H100 PCIe", "h100-pcie", 756.0, 378.0, 51.0),
        ("NVIDIA H200", "h200", 989.4, 494.7, 67.0),
    ],
)
def test_peak_by_device_name(name, slug, bf16, tf32, fp32):
    assert card_slug(name) == slug
    assert lookup_peak(name, "bf16").tflops == bf16
    assert lookup_peak(name, "fp16").tflops == bf16
    assert lookup_peak(name, "tf32").tflops == tf32
    assert lookup_peak(name, "fp32").tflops == fp32


def test_fp32_with_tf32_allowed_counts_against_tf32_peak():
    assert peak_precision("fp32", tf32_cudnn=True) == "tf32"
    peak = lookup_peak("NVIDIA A100-SXM4-80GB", "fp32", tf32_matmul=True)
    assert peak.tflops == 156.0 and "TF32" in peak.note


def test_whole_word_matching_keeps_lookalike_cards_apart():
    # Substring matching would read "L40S" as an L4 and "A10G" as an A10 (different peaks).
    assert lookup_peak("NVIDIA L40S", "bf16").tflops is None
    assert lookup_peak("NVIDIA A10G", "bf16").tflops is None
    assert lookup_peak("NVIDIA A10", "bf16").tflops == 125.0


def test_unknown_card_and_no_cuda_give_none_with_a_reason():
    peak = lookup_peak("Some Future GPU 9000", "bf16")
    assert peak.tflops is None and "unknown card" in peak.note and "--measure-peak" in peak.note
    assert card_slug("Some Future GPU 9000") == "some-future-gpu-9000"
    none = lookup_peak(None, "bf16")
    assert none.tflops is None and none.note == "n/a (no CUDA)"
    assert card_slug(None) == "cpu"
    with pytest.raises(ValueError, match="precision"):
        lookup_peak("NVIDIA H200", "int8")


# A small explicit config (not a preset, so preset tuning cannot move the hand count): attention at 16x16 only.
SMALL = ModelConfig(base_channels=8, channel_mult=(1, 2), num_res_blocks=1, attn_resolutions=(16,), attn_heads=2,
                    norm_groups=4, dropout=0.0)


def test_forward_backward_is_about_three_forwards():
    f = train_flops_per_image(SMALL)
    # Backward = grads w.r.t. inputs + weights (2x forward), minus the stem's input gradient (the image needs none).
    assert 2.9 * f["fwd"] <= f["fwd_bwd"] <= 3.0 * f["fwd"]
    assert f["fwd"] == pytest.approx(sum(f["fwd_by_category"].values()))


def test_attention_is_counted_by_hand():
    with_attn = train_flops_per_image(SMALL)
    without = train_flops_per_image(dataclasses.replace(SMALL, attn_resolutions=()))
    # attn_resolutions=(16,) adds one attention module after each of the 1 down block and 2 up blocks at 16x16
    # (the middle has one either way), C = 16 channels, N = 256 positions. Per module, forward FLOPs:
    # qkv 1x1 conv 2*N*C*3C + output 1x1 conv 2*N*C*C + QK^T 2*N*N*C + AV 2*N*N*C (biases, softmax: not counted).
    C, N, modules = 16, 16 * 16, 3
    per_module = 2 * N * C * 4 * C + 4 * N * N * C
    assert with_attn["fwd"] - without["fwd"] == modules * per_module
    assert with_attn["fwd_bwd"] - without["fwd_bwd"] == 3 * modules * per_module
    # The weightless matmuls alone, all four modules (middle included):
    assert with_attn["fwd_by_category"]["attention"] == 4 * 4 * N * N * C


def test_sdpa_and_math_attention_count_the_same():
    sdpa = train_flops_per_image(dataclasses.replace(SMALL, attn_impl="sdpa"))
    math = train_flops_per_image(dataclasses.replace(SMALL, attn_impl="math"))
    assert sdpa["fwd_bwd"] == math["fwd_bwd"] > 0


def test_published_style_misses_attention():
    cfg = PRESETS["tiny"]
    ours, pub = train_flops_per_image(cfg), published_style_flops_per_image(cfg)
    assert pub["fwd_bwd"] < ours["fwd_bwd"]
    # torchinfo sees the convs and linears (plus biases), nothing of the attention matmuls.
    weighted = ours["fwd_by_category"]["conv"] + ours["fwd_by_category"]["linear"]
    assert pub["mult_adds_fwd"] * 2 == pytest.approx(weighted, rel=0.02)


def test_each_committed_card_folder_is_the_folder_a_fresh_run_writes():
    """One folder per card: benchmarks/results/<card_slug(device name)>/ holds the committed results and a fresh run's."""
    from benchmarks.common import RESULTS
    from benchmarks.speed.peaks import CARDS

    folders = {p.name for p in RESULTS.iterdir() if p.is_dir()}
    assert folders and folders <= {c.slug for c in CARDS} | {"cpu"}, folders
    assert card_slug("NVIDIA H100 80GB HBM3") in folders and card_slug("NVIDIA H200") in folders
