"""The benchmark tables as data: each row a complete RunConfig (a preset plus overrides) and a batch rule.

    rows = TABLES["ddpm"](("data.loader=torch-memory",))    # the baseline loader: what the rows before FFCV use
    rows = resolve_rows(rows, "1,5,fused")                    # --rows: 1-based indices or name substrings

Tables: `headline` (`make bench` on a GPU: four rows of the DDPM UNet, minutes), `small`, `ddpm`, `both` = `full`
(the published table's rows and ours beyond it), `quick` (CPU), `loaders-e2e`, and `sampling` (no training rows:
benchmarks.speed.runner's sampling rows only).

A row is what benchmarks.speed.runner runs in a fresh process; benchmarks.speed.bench and benchmarks.speed.sweeps choose
the rows. Add a row here.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from benchmarks.common import JPEG_BETON, PNG_TRAIN, BenchError
from ffcv_ddpm.unet import FUSED_OFF, PRESETS, REFERENCE_COMPUTATION


@dataclass(frozen=True)
class Row:
    name: str  # what the row adds, as shown in the table
    preset: str  # model preset (ffcv_ddpm.unet.PRESETS); rows of one preset form one table section
    overrides: tuple[str, ...]  # load_config overrides, complete (not relative to another row)
    batch: int | str  # images per step: a number, "max" (largest that fits, probed), or an earlier row's name
    baseline: bool = False  # speedups in this preset's section are relative to this row


# The published table's starting point: true fp32 (no TF32), eager, explicit matmul-softmax attention, NCHW, the
# default (foreach) AdamW, flips done in the loader's worker processes as torchvision transforms do, nn.GroupNorm.
BASELINE = (
    *(f"model.{k}={v}" for k, v in REFERENCE_COMPUTATION.items()),  # the network computed as the paper wrote it
    "model.norm_impl=torch",
    *FUSED_OFF,  # the fused kernels' switches: the fused row turns the preset's on
    "train.precision=fp32",
    "train.compile=False",
    "model.attn_impl=math",
    "train.channels_last=False",
    "train.fused_adam=False",
    "data.flip=cpu",
    "train.cudnn_benchmark=False",  # cuDNN's heuristic choice, not its timed search (a row of its own below)
    "train.compile_mode=default",  # plain torch.compile once compiled; CUDA graphs are rows of their own below
)

# The computation switches every network takes, and those built for the DDPM one only (table_rows drops them).
ALL_SWITCHES = ("model.upsample=transposed", "model.pad_image_channels=8", "model.attn_linear=True")
DDPM_SWITCHES = ("model.concat_free=True", "model.conv_bias_in_norm=True")
# With the fused kernels, DDPM network only: the read of concat_free's parts, the residual sums left to the next norm.
DDPM_FUSED = ("model.fused_parts=True", "model.norm_residual=True")
# With the fused kernels, every network: SiLU through tanh.approx, one dropout hash for two channels, the backward's
# sums over x.
FUSED_ON = ("model.norm_fast_silu=True", "model.norm_pair_hash=True", "model.norm_x_sums=True")
SWITCHES_ROW = ("+ exact reformulations (no skip concat, folded upsample, padded image convs, linear attention "
                "projections, conv bias in the norm's add)")

# Each step adds its overrides to everything above it: (name, added overrides, batch rule).
STACK = (
    ("baseline (fp32, eager, math attention, PyTorch DataLoader)", (), 128),
    ("+ largest batch that fits", (), "max"),
    ("+ torch.compile", ("train.compile=True",), "prev"),
    ("+ SDPA attention", ("model.attn_impl=sdpa",), "max"),
    ("+ bf16 autocast", ("train.precision=bf16",), "max"),
    ("+ FFCV loading", ("data.loader=ffcv",), "prev"),
    ("+ channels_last", ("train.channels_last=True",), "prev"),
    ("+ fused AdamW", ("train.fused_adam=True",), "prev"),
    ("+ GPU-resident data, flips on GPU", ("data.loader=gpu", "data.flip=gpu"), "prev"),
    # A candidate fix for the layout copies inside cuDNN's convolution backward (benchmarks/NOTES.md, attempt 4).
    ("+ GroupNorm that keeps channels_last", ("model.norm_impl=scale-shift",), "prev"),
    # The same network computed differently (issue 25, NOTES item 11): no skip concatenation, the upsample folded
    # into its conv, the 3-channel convs padded to 8, the attention projections as matmuls. MFU keeps the
    # reference network's FLOPs. DDPM_SWITCHES are built for the DDPM network only (the small UNet skips them).
    (SWITCHES_ROW, (*ALL_SWITCHES, *DDPM_SWITCHES), "prev"),
    # GroupNorm + SiLU + dropout (+ the time-embedding add) as one Triton kernel each way (ffcv_ddpm.gn_kernels); on
    # the DDPM network the up blocks' first ones read (h, skip) where they lie (model.fused_parts, the preset's since
    # the 5f421de measurements: the rows of tables measured before leave it off, their JSON says so), SiLU through
    # tanh.approx (model.norm_fast_silu, the preset's since 74b8544: likewise), and since the x-sums-17a6ad0
    # measurements the pair hash, the residual sums and the sums over x (likewise).
    ("+ fused GroupNorm/SiLU/dropout kernels", ("model.norm_impl=fused", *FUSED_ON, *DDPM_FUSED), "prev"),
)

# Alternatives to one step of the stack (not stacked further): (name, the stack row they replace a setting of,
# overrides on top of that row[, the presets they apply to]). They run at that row's batch.
DDPM_ONLY = ("ddpm-cifar10",)  # DDPM_SWITCHES are built for the DDPM network only
VARIANTS = (
    # On the fused-AdamW row: with the foreach AdamW, GradScaler reads found_inf on the host every step (the bf16
    # rows have no such sync); the fused one takes it on the device.
    ("fp16 + GradScaler (instead of bf16)", "+ fused AdamW", ("train.precision=fp16",)),
    ("compile mode max-autotune-no-cudagraphs", "+ GPU-resident data, flips on GPU",
     ("train.compile_mode=max-autotune-no-cudagraphs",)),
    ("compile mode reduce-overhead (CUDA graphs)", "+ GPU-resident data, flips on GPU",
     ("train.compile_mode=reduce-overhead",)),
    ("inductor layout optimization forced", "+ GPU-resident data, flips on GPU", ("train.force_layout_opt=True",)),
    ("cuDNN algorithm search (cudnn.benchmark)", "+ fused GroupNorm/SiLU/dropout kernels",
     ("train.cudnn_benchmark=True",)),
    # Ablations of the reformulations row (issue 25): each switch back to the paper's computation, or the other
    # exact upsample, so each switch's share of the gain is measured against the row that has them all.
    *((name, SWITCHES_ROW, added, DDPM_ONLY) for name, added in (
        ("without concat-free skips (model.concat_free=False)", ("model.concat_free=False",)),
        ("upsample as a broadcast copy instead (model.upsample=expand)", ("model.upsample=expand",)),
        ("upsample as F.interpolate (model.upsample=nearest)", ("model.upsample=nearest",)),
        ("image convs not padded (model.pad_image_channels=0)", ("model.pad_image_channels=0",)),
        ("attention projections as 1x1 convs (model.attn_linear=False)", ("model.attn_linear=False",)),
    )),
    # NOTES item 15: the fused kernels' median step beat scale-shift's while their mean did not, and the host's
    # launches per step are the suspect; replayed CUDA graphs launch nothing per kernel. (Its scale-shift twin: the
    # reformulations row with the command override train.compile_mode=reduce-overhead.)
    ("fused kernels under CUDA graphs (reduce-overhead)", "+ fused GroupNorm/SiLU/dropout kernels",
     ("train.compile_mode=reduce-overhead",)),
    # The two together (H100, 27068e1: the search alone gave fused 8,018 then 8,822 img/s in two passes, its tail
    # coming and going; under graphs the tail went, 8,547): the candidate for the defaults (issue 25).
    ("fused + cuDNN search + CUDA graphs", "+ fused GroupNorm/SiLU/dropout kernels",
     ("train.cudnn_benchmark=True", "train.compile_mode=reduce-overhead")),
)

# End to end per loader (issue 6): the trainer's defaults (bf16, compile, SDPA, channels_last, fused AdamW, flips on
# the GPU, 8 workers or the cores there are) and only the loader changes. "{data}" stands for the --data folder; the
# JPEG row reads the JPEG .beton `make dataset` writes, the PNG row the folder only `make dataset-png` exports.
LOADER_ROWS = (
    ("FFCV raw .beton", ("data.loader=ffcv",)),
    ("FFCV JPEG .beton", ("data.loader=ffcv", f"data.path={{data}}/{JPEG_BETON}")),
    ("PyTorch DataLoader over in-memory uint8 arrays", ("data.loader=torch-memory",)),
    ("PyTorch DataLoader over PNG files (PIL decode)",
     ("data.loader=torch-files", f"data.png_dir={{data}}/{PNG_TRAIN}")),
    ("GPU-resident uint8 tensor", ("data.loader=gpu",)),
)


def loader_rows(preset: str, batch: int) -> list[Row]:
    return [Row(name, preset, added, batch, baseline=i == 0) for i, (name, added) in enumerate(LOADER_ROWS)]


def row_overrides(row: Row, data_overrides: tuple[str, ...], data_dir: Path) -> list[str]:
    """A row's overrides after the dataset's (a row that names its own .beton wins), with {data} filled in."""
    return [o.replace("{data}", str(data_dir)) for o in merge(data_overrides, row.overrides)]


def merge(*groups: tuple[str, ...]) -> tuple[str, ...]:
    """Overrides with one entry per key, the last value winning (a later step changes an earlier setting)."""
    out: dict[str, str] = {}
    for item in (i for g in groups for i in g):
        out[item.split("=", 1)[0]] = item
    return tuple(out.values())


def table_rows(preset: str, baseline_loader: tuple[str, ...]) -> list[Row]:
    """The published table's rows and ours beyond it, for one model preset."""
    rows, acc = [], merge(BASELINE, baseline_loader)
    for i, (name, added, batch) in enumerate(STACK):
        if PRESETS[preset].arch != "ddpm":
            added = tuple(o for o in added if o not in DDPM_SWITCHES + DDPM_FUSED)
        acc = merge(acc, added)
        rows.append(Row(name, preset, acc, rows[-1].name if batch == "prev" else batch, baseline=i == 0))
    last: dict[str, str] = {}  # parent -> the row a new variant goes after (the parent, then its earlier variants)
    for name, parent, added, *presets in VARIANTS:
        if presets and preset not in presets[0]:
            continue
        p = next(r for r in rows if r.name == parent)
        after = next(i for i, r in enumerate(rows) if r.name == last.get(parent, parent))
        rows.insert(after + 1, Row(name, preset, merge(p.overrides, added), p.name))
        last[parent] = name
    return rows


# `make bench` on a GPU: the story in four rows and minutes. Two compiled graphs are compiled (the FFCV row's model
# graph is the compile row's: its process loads it from the compile cache, ffcv_ddpm.env.compile_cache).
HEADLINE_BATCH = 1024  # what the published DDPM-UNet table's compiled rows ran at (probed, capped at 1024); no probe
HEADLINE_STACK = ("+ torch.compile", "+ SDPA attention", "+ bf16 autocast")  # the STACK steps of the compile row
BEST = "the project's best: the trainer's defaults + GPU-resident data"


def headline_rows(preset: str, baseline_loader: tuple[str, ...]) -> list[Row]:
    """The published table's baseline, compile + SDPA + bf16 in one row, + FFCV, and the trainer's defaults (whatever
    they are today) with the GPU-resident loader: the project's best. Built from STACK, so they stay its rows."""
    added = {name: overrides for name, overrides, _ in STACK}
    base = merge(BASELINE, baseline_loader)
    compiled = merge(base, *(added[name] for name in HEADLINE_STACK))
    return [
        Row(STACK[0][0], preset, base, STACK[0][2], baseline=True),
        Row("+ torch.compile + SDPA + bf16 autocast", preset, compiled, HEADLINE_BATCH),
        Row("+ FFCV loading", preset, merge(compiled, added["+ FFCV loading"]), HEADLINE_BATCH),
        Row(BEST, preset, ("data.loader=gpu",), HEADLINE_BATCH),
    ]


def quick_rows(baseline_loader: tuple[str, ...]) -> list[Row]:
    """CPU-sized: the tiny preset at batch 32, the stack's first steps (the quick start on a CPU: 41 s on 2 cores).
    The small UNet's rows at batch 4 took ~0.64 s a step and as long again in process start-up each, and said
    nothing the tiny rows do not: a CPU times the harness, not the model."""
    # Two loader processes / threads: the quick table has to run on a 2-core CI machine.
    base = merge(BASELINE, baseline_loader, ("data.num_workers=2",))
    sdpa = merge(base, ("model.attn_impl=sdpa",))
    return [
        Row("baseline (fp32, eager, math attention, PyTorch DataLoader)", "tiny", base, 32, baseline=True),
        Row("+ SDPA attention", "tiny", sdpa, 32),
        Row("+ FFCV loading", "tiny", merge(sdpa, ("data.loader=ffcv",)), 32),
    ]


def _both(loader: tuple[str, ...]) -> list[Row]:
    return table_rows("annotated-small", loader) + table_rows("ddpm-cifar10", loader)


TABLES = {
    "headline": lambda loader: headline_rows("ddpm-cifar10", loader),
    "small": lambda loader: table_rows("annotated-small", loader),
    "ddpm": lambda loader: table_rows("ddpm-cifar10", loader),
    "both": _both,
    "full": _both,  # the name `make bench ARGS="--table full"` is documented under
    "quick": quick_rows,
    "loaders-e2e": lambda loader: loader_rows("ddpm-cifar10", 512) + loader_rows("annotated-small", 1024),
    "sampling": lambda loader: [],  # the sampling rows alone (bench --sampling is implied)
}

# Batch sizes tried for "max" rows (the published table's 320 / 2048 / 3072 sit between these steps).
BATCH_LADDER = (128, 192, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096, 6144, 8192)


def resolve_rows(rows: list[Row], selected: str | None) -> list[Row]:
    """The rows to run: all, or those whose 1-based index or name substring is listed (comma-separated)."""
    if not selected:
        return rows
    keep = []
    for i, row in enumerate(rows, 1):
        for token in selected.split(","):
            token = token.strip()
            # A number is an index only: "3" must not pick every row whose name says "fp32".
            if token and (token == str(i) if token.isdigit() else token.lower() in row.name.lower()):
                keep.append(row)
                break
    if not keep:
        raise BenchError(f"--rows {selected!r} matches no row; see --list")
    return keep
