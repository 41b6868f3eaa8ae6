"""Dense peak TFLOP/s per card and precision, for MFU.

Figures are NVIDIA's data-sheet numbers WITHOUT structured sparsity (the sheets often print the 2:4-sparse figure,
twice these). A card is found by substring of `torch.cuda.get_device_name()`; an unknown card gives None and a
message, never a guess. `measure_peak` times a large matmul on the spot as a second reference.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

PRECISIONS = ("fp32", "tf32", "bf16", "fp16")


@dataclass(frozen=True)
class Card:
    slug: str  # folder name for results (benchmarks/results/<slug>/), e.g. "h100": fresh and committed results share it
    label: str  # how the card is named in tables
    # Each pattern is a tuple of lowercase words that must ALL be words of the device name.
    patterns: tuple[tuple[str, ...], ...]
    tflops: dict  # precision -> dense peak TFLOP/s (None where the card has no tensor-core path for it)


# Order is precedence: the first card with a matching pattern wins, so the specific variants (PCIe, NVL) come before
# the catch-all of their family ("NVIDIA H100 80GB HBM3" is the SXM part and names no form factor).
CARDS: tuple[Card, ...] = (
    Card("h100-pcie", "H100 PCIe", (("h100", "pcie"),), {"fp32": 51.0, "tf32": 378.0, "bf16": 756.0, "fp16": 756.0}),
    Card("h100-nvl", "H100 NVL", (("h100", "nvl"),), {"fp32": 60.0, "tf32": 417.5, "bf16": 835.5, "fp16": 835.5}),
    Card("h200-nvl", "H200 NVL", (("h200", "nvl"),), {"fp32": 60.0, "tf32": 417.5, "bf16": 835.5, "fp16": 835.5}),
    Card("h200", "H200 SXM", (("h200",),), {"fp32": 67.0, "tf32": 494.7, "bf16": 989.4, "fp16": 989.4}),
    # GH200's GPU is the H100 SXM part (same peaks); its own slug keeps its results apart.
    Card("gh200", "GH200", (("gh200",),), {"fp32": 67.0, "tf32": 494.7, "bf16": 989.4, "fp16": 989.4}),
    Card("h100", "H100 SXM", (("h100",),), {"fp32": 67.0, "tf32": 494.7, "bf16": 989.4, "fp16": 989.4}),
    # A100 SXM and PCIe share their tensor-core peaks (the PCIe card only has a lower power limit).
    Card("a100", "A100", (("a100",),), {"fp32": 19.5, "tf32": 156.0, "bf16": 312.0, "fp16": 312.0}),
    Card("l4", "L4", (("l4",),), {"fp32": 30.3, "tf32": 60.0, "bf16": 121.0, "fp16": 121.0}),
    Card("a10", "A10", (("a10",),), {"fp32": 31.2, "tf32": 62.5, "bf16": 125.0, "fp16": 125.0}),
    # GeForce: tensor-core figures with FP32 accumulation (what PyTorch uses), half the FP16-accumulate figure.
    Card("rtx4090", "RTX 4090", (("4090",),), {"fp32": 82.6, "tf32": 82.6, "bf16": 165.2, "fp16": 165.2}),
    # Volta: no TF32 or BF16 tensor cores.
    Card("v100-pcie", "V100 PCIe", (("v100", "pcie"),), {"fp32": 14.0, "tf32": None, "bf16": None, "fp16": 112.0}),
    Card("v100", "V100 SXM2", (("v100",),), {"fp32": 15.7, "tf32": None, "bf16": None, "fp16": 125.0}),
)


def find_card(device_name: str) -> Card | None:
    """The first card (in CARDS order) whose pattern's words all occur among the device name's words, or None."""
    words = set(_words(device_name))
    for card in CARDS:
        if any(all(part in words for part in pattern) for pattern in card.patterns):
            return card
    return None


def _words(s: str) -> list[str]:
    # Whole words, not substrings: "l4" must not match "L40S", nor "a10" "A100" or "A10G" (different peaks).
    # Splitting on any non-alphanumeric reads "A100-PCIE-40GB" and "A100 80GB PCIe" alike.
    return re.findall(r"[a-z0-9]+", s.lower())


def peak_precision(precision: str, tf32_matmul: bool = False, tf32_cudnn: bool = False) -> str:
    """Which peak a run is measured against.

    An "fp32" run whose convolutions or matmuls were allowed TF32 tensor cores ran at the TF32 rate, so it counts
    against the TF32 peak: the published table divided such a run by the FP32 peak (19.5 on A100 instead of 156)
    and so overstated its MFU eightfold. Convolutions dominate a UNet, so either flag makes it a TF32 run.
    """
    if precision not in PRECISIONS:
        raise ValueError(f"unknown precision {precision!r}; expected one of {', '.join(PRECISIONS)}")
    if precision == "fp32" and (tf32_matmul or tf32_cudnn):
        return "tf32"
    return precision


@dataclass(frozen=True)
class Peak:
    tflops: float | None  # dense peak, None when unknown
    precision: str  # the peak's precision column (after the TF32 rule of peak_precision)
    card: str | None  # card label, None for an unknown card
    note: str  # one line for the reader: where the figure comes from, or why there is none


def lookup_peak(device_name: str | None, precision: str, tf32_matmul: bool = False, tf32_cudnn: bool = False) -> Peak:
    """Dense peak for a device name and a run's precision; tflops None (with the reason in .note) if unknown."""
    column = peak_precision(precision, tf32_matmul, tf32_cudnn)
    why = f" ({precision} with TF32 allowed counts as TF32)" if column != precision else ""
    if device_name is None:
        return Peak(None, column, None, "n/a (no CUDA)")
    card = find_card(device_name)
    if card is None:
        known = ", ".join(c.label for c in CARDS)
        return Peak(
            None, column, None, f"unknown card {device_name!r}: no dense peak on file (known: {known}); "
            "add it to benchmarks/speed/peaks.py CARDS or pass --measure-peak"
        )
    if card.tflops.get(column) is None and column == "tf32" and precision == "fp32":
        column, why = "fp32", " (no TF32 tensor cores on this card: TF32 flags are no-ops)"
    tflops = card.tflops.get(column)
    if tflops is None:
        return Peak(None, column, card.label, f"{card.label} has no {column} tensor-core peak")
    return Peak(tflops, column, card.label, f"{card.label} dense {column} peak {tflops:g} TFLOP/s{why}")


def card_slug(device_name: str | None) -> str:
    """Results folder name: the card's slug, "cpu" without CUDA, or a cleaned device name for unknown cards."""
    if device_name is None:
        return "cpu"
    card = find_card(device_name)
    if card is not None:
        return card.slug
    return "-".join(w for w in _words(device_name) if w not in ("nvidia", "tesla", "geforce")) or "unknown-gpu"


_DTYPES = {"fp32": "float32", "tf32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def measure_peak(precision: str, n: int = 8192, iters: int = 50, device: str = "cuda") -> float:
    """Achieved TFLOP/s of an n x n x n matmul at `precision`, timed with CUDA events after a warm-up.

    Random normal operands: tensor cores draw less power (and so clock higher) on zeros, which would flatter the
    peak. The result is a practical ceiling for dense GEMM on this card right now (clocks, power cap), usually
    70-90% of the data-sheet figure.
    """
    import torch

    if precision not in _DTYPES:
        raise ValueError(f"unknown precision {precision!r}; expected one of {', '.join(PRECISIONS)}")
    if not torch.cuda.is_available():
        raise RuntimeError("measure_peak needs a CUDA device")
    dtype = getattr(torch, _DTYPES[precision])
    gen = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(n, n, device=device, dtype=dtype, generator=gen)
    b = torch.randn(n, n, device=device, dtype=dtype, generator=gen)
    saved = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = precision == "tf32"
    try:
        for _ in range(5):
            torch.mm(a, b)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            torch.mm(a, b)
        end.record()
        torch.cuda.synchronize()
    finally:
        torch.backends.cuda.matmul.allow_tf32 = saved
    seconds = start.elapsed_time(end) / 1e3
    return 2 * n**3 * iters / seconds / 1e12
