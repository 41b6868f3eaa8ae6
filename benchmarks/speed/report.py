"""Turn a benchmark JSON into its Markdown table and PNG chart; every derived figure is recomputed from raw ones.

    python -m benchmarks.speed.report benchmarks/results/h100-sxm/small.json   # writes small.md and small.png beside it

Metrics are computed here, not in the timing loop, so a committed JSON can be re-rendered (or a formula fixed)
without rerunning the GPU. Definitions (also in benchmarks/README.md):
- ms/iter: median and p10/p90 of the per-iteration CUDA-event times; an iteration includes waiting for its batch.
- img/s: batch x iterations / total timed seconds (the sum, not the median: stalls count).
- data wait: sum of wait times / sum of iteration times (the share of GPU time spent idle waiting for the loader).
- TFLOP/s: model FLOPs per image (FlopCounterMode, forward+backward, attention included) x img/s.
- MFU: TFLOP/s / the card's dense peak for the precision the row ran at (fp32 with TF32 allowed -> TF32 peak).
- MFU (executed FLOPs): the same with the FLOPs the row's own computation executes (`executed_fwd_bwd`): lower than
  MFU where a reformulation does less work than the reference network (the folded upsample), "-" in older files.
- MFU (published count): the same, but with the published table's FLOPs (torchinfo mult-adds x 2 x 3, no attention).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

from benchmarks.common import commit_text, md_table, pyplot, save_figure, write_text
from benchmarks.speed.peaks import lookup_peak
from ffcv_ddpm.checks import SINGLE_FILE_HELP, Parser, fail

# The published table: the README of github.com/kimbochen/ddpm, section "Optimization Techniques" (read at its commit
# 3bc42ff): an A100, its DDPM UNet in the style of The Annotated Diffusion Model (our preset annotated-small), FLOPs
# as torchinfo mult-adds x 2 x 3 (attention counted as zero), the fp32 rows divided by the FP32 peak 19.5 although
# PyTorch lets cuDNN run fp32 convolutions on TF32 tensor cores by default. The batches 320, 2048 and 3072 are from
# its text; the baseline's 128 is as quoted in this project's issue 5.
PUBLISHED = {
    "source": "github.com/kimbochen/ddpm, README, \"Optimization Techniques\" (commit 3bc42ff)",
    "card": "A100",
    "preset": "annotated-small",
    "rows": [
        # (row, batch, TFLOP/s as published, speedup, precision whose peak the published MFU used, MFU as published)
        ("baseline (fp32)", 128, 2.096, 1.00, "fp32", 0.1075),
        ("scale up batch size", 320, 2.404, 1.15, "fp32", 0.1233),
        ("torch.compile", 320, 3.24, 1.54, "fp32", 0.1662),
        ("PyTorch SDPA", 2048, 6.06, 2.89, "fp32", 0.3108),
        ("mixed precision (fp16)", 3072, 16.47, 7.86, "fp16", 0.0528),
        ("FFCV data loading", 3072, 16.70, 7.97, "fp16", 0.0535),
    ],
}


# ---------------------------------------------------------------------------------------------------- metrics


def row_metrics(row: dict, flops: dict | None, device_name: str | None, measured_peaks: dict | None) -> dict:
    """Derived figures of one finished row from its raw timings; `flops` is the row's model entry of result["flops"]."""
    raw = row["raw"]
    iter_ms = np.asarray(raw["iter_ms"], dtype=np.float64)
    wait_ms = np.asarray(raw["wait_ms"], dtype=np.float64)
    total_s = iter_ms.sum() / 1e3
    img_s = raw["batch_size"] * len(iter_ms) / total_s
    peak = lookup_peak(device_name, raw["precision"], raw.get("tf32_matmul", False), raw.get("tf32_cudnn", False))
    m = {
        "iters": int(len(iter_ms)),
        "ms_median": float(np.median(iter_ms)),
        "ms_p10": float(np.percentile(iter_ms, 10)),
        "ms_p90": float(np.percentile(iter_ms, 90)),
        "img_per_s": float(img_s),
        "data_wait_share": float(wait_ms.sum() / iter_ms.sum()),
        "peak_precision": peak.precision,
        "peak_tflops": peak.tflops,
        "peak_note": peak.note,
    }
    if flops is not None:
        ours, published = flops["train"]["fwd_bwd"], flops["published"]["fwd_bwd"]
        tflops = ours * img_s / 1e12
        m.update(
            flops_per_img=ours,
            published_flops_per_img=published,
            tflops=tflops,
            published_tflops=published * img_s / 1e12,
            mfu=tflops / peak.tflops if peak.tflops else None,
            published_mfu=published * img_s / 1e12 / peak.tflops if peak.tflops else None,
        )
        # The FLOPs the row's computation executes (a reformulation such as the folded upsample does less work than
        # the reference network that MFU counts): its own MFU beside, so less work is seen as such (issue 47 item 5).
        executed = flops["train"].get("executed_fwd_bwd")  # older files: not recorded
        if executed is not None:
            m["executed_flops_per_img"] = executed
            m["executed_mfu"] = executed * img_s / 1e12 / peak.tflops if peak.tflops else None
        measured = (measured_peaks or {}).get(peak.precision)
        m["measured_peak_tflops"] = measured
        m["mfu_measured_peak"] = tflops / measured if measured else None
    return m


def same_call(a: dict, b: dict) -> bool:
    """Whether two rows (or sampling rows) were measured in one call: in one result file, or in a merged file
    (benchmarks.speed.merge) from the same part, one bench run on one machine. The environment names no machine, so
    two parts are two calls even where they shared one."""
    return a.get("part") == b.get("part")


def speedup_of(img_per_s: float, base_img_per_s: float, same: bool) -> dict:
    """{"speedup": ratio} over a baseline of the same call (same_call); over one of another call (a merged file's
    other part: another process, possibly another machine, clock or load) {"speedup": None, "speedup_cross_call":
    ratio}, which the tables mark as such."""
    ratio = img_per_s / base_img_per_s
    return {"speedup": ratio} if same else {"speedup": None, "speedup_cross_call": ratio}


def _speedup_cell(m: dict) -> str:
    if m.get("speedup"):
        return f"{m['speedup']:.2f}x"
    return f"{m['speedup_cross_call']:.2f}x (other call)" if m.get("speedup_cross_call") else "-"


def add_metrics(result: dict) -> dict:
    """Fills each ok row's "metrics" and its speedup over its group's baseline row (same card; another call's
    baseline: speedup_of)."""
    baselines = {}
    for row in result["rows"]:
        if row.get("status") != "ok":
            row["metrics"] = None
            continue
        flops = row.get("flops") or result.get("flops", {}).get(row["preset"])  # the row's own; older files: per preset
        row["metrics"] = row_metrics(row, flops, result.get("device_name"), result.get("measured_peaks"))
        if row.get("baseline"):
            baselines[row["group"]] = row
    for row in result["rows"]:
        if row["metrics"] is not None:
            base = baselines.get(row["group"])
            row["metrics"].update(speedup_of(row["metrics"]["img_per_s"], base["metrics"]["img_per_s"],
                                             same_call(row, base)) if base else {"speedup": None})
    return result


# ---------------------------------------------------------------------------------------------------- Markdown


def _num(x: float) -> str:
    # Three significant figures for small values (CPU rows run at a few img/s), thousands separators for large.
    return f"{x:,.0f}" if x >= 100 else f"{x:.3g}"


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:.1f}%"


def _mfu(x: float | None, note: str) -> str:
    # Without CUDA (or for an unknown card) the reason is the cell: "n/a (no CUDA)".
    return _pct(x) if x is not None else ("n/a (no CUDA)" if note == "n/a (no CUDA)" else "n/a")


def _header(result: dict) -> list[str]:
    env = result["environment"]
    ds = result.get("dataset") or {}
    gpu = result.get("device_name") or f"CPU only ({env.get('cpu_count')} cores)"
    source = ds.get("source") or "unknown"
    synthetic = ds.get("synthetic")
    data_line = f"{ds.get('path')} ({ds.get('num_images')} images, source: {source}"
    data_line += ", SYNTHETIC images: throughput only, not a training result)" if synthetic else ")"
    if result.get("dataset_built_now"):
        data_line += "; built by this run because no .beton was present"
    if not ds:
        data_line = "none (sampling rows only: random weights, no data read)"
    sources = result.get("sources")
    if sources:  # a merged file (benchmarks.speed.merge): each part's commit, date and command
        runs = [f"- Part {i}: `{src['file']}`: commit {commit_text(src['environment'])}, torch "
                f"{src['environment'].get('torch')}, {src['environment'].get('date_utc')}, {len(src['rows'])} row(s), "
                f"{src['sampling']} sampling row(s)" + (f", {src['settings']['warmup']} warm-up + "
                                                         f"{src['settings']['iters']} timed iterations per row"
                                                         if src.get("settings") else "")
                + f"; command `{' '.join(src.get('command', []))}`" for i, src in enumerate(sources, 1)]
    else:
        runs = [f"- Commit {commit_text(env)}, {env.get('date_utc')}; command: `{' '.join(result.get('command', []))}`"]
    lines = [
        f"- Device: {gpu}; torch {env.get('torch')}, CUDA {env.get('cuda')}, cuDNN {env.get('cudnn')}, "
        f"Python {env.get('python')}" + (" (of part 1)" if sources else ""),
        *runs,
        f"- Data: {data_line}",
        (f"- Timing: {result['settings']['warmup']} warm-up iterations (plus the first, compiling, step), then "
         f"{result['settings']['iters']} timed iterations per row" if not sources else
         "- Timing: the first (compiling) step, the warm-up iterations, then the timed ones (counts per part above)")
        + ", each row in a fresh process; the wait for data is inside every timed iteration.",
    ]
    if result.get("note"):
        lines.append(f"- {result['note']}")
    if not result.get("complete", True):
        done = {(r["group"], r["name"]) for r in result.get("rows") or [] if r.get("status", "ok") == "ok"}
        planned = result.get("planned") or []
        several = len({group for group, _ in planned}) > 1  # row names repeat across presets (loaders-e2e)
        missing = [f"{group}: {name}" if several else name for group, name in planned if (group, name) not in done]
        lines.append("- INCOMPLETE: the run stopped before its last row; the rows below are those it finished"
                     + (f"; not measured: {'; '.join(missing)}" if missing else ""))
    for preset, f in result.get("flops", {}).items():
        tr, pub = f["train"], f["published"]
        cat = tr["fwd_by_category"]
        lines.append(
            f"- FLOPs/img {preset}: {tr['fwd_bwd'] / 1e9:.2f} GFLOP fwd+bwd (FlopCounterMode; forward "
            f"{tr['fwd'] / 1e9:.2f} = conv {cat['conv'] / 1e9:.2f} + linear {cat['linear'] / 1e9:.3f} + attention "
            f"{cat['attention'] / 1e9:.2f}); published-style count {pub['fwd_bwd'] / 1e9:.2f} GFLOP "
            f"({tr['fwd_bwd'] / pub['fwd_bwd']:.2f}x less)"
        )
    peaks = result.get("measured_peaks")
    if peaks:
        lines.append("- Measured matmul peaks (TFLOP/s): " + ", ".join(f"{k} {v:.0f}" for k, v in peaks.items()))
    return lines


_COLUMNS = (
    "row", "batch", "ms/iter median (p10-p90)", "img/s", "speedup", "data wait", "first step s", "TFLOP/s",
    "MFU", "MFU (executed FLOPs)", "MFU (published count)", "peak mem GiB", "notes",
)


def graphs_peak(compile_mode: str | None, compiled: bool, timed, incl_warmup) -> tuple:
    """(a step's peak memory, whether it is the peak including the warm-up), from the peak of the timed steps and
    the one including the warm-up (bytes or GiB alike). The peak is reset after the warm-up so that compilation and
    autotuning do not count; under CUDA graphs (compile mode reduce-overhead) the step's tensors live in the graphs'
    private pool, allocated while recording in the warm-up and reused by every replay, so the timed steps allocate
    almost nothing (0.8 GiB seen for a 20-GiB step on an H100) and the peak that includes the warm-up is the step's.
    The bench rows and the profile both read their peak through this."""
    if compile_mode == "reduce-overhead" and compiled and incl_warmup is not None:
        return incl_warmup, True
    return timed, False


def row_peak_mem(row: dict) -> tuple[int | None, bool]:
    """(a bench row's peak memory in bytes, whether it includes the warm-up): graphs_peak."""
    raw = row.get("raw") or {}
    return graphs_peak((row.get("config") or {}).get("train", {}).get("compile_mode"), bool(raw.get("compiled")),
                       raw.get("peak_mem_bytes"), raw.get("peak_mem_bytes_incl_warmup"))


def _row_cells(row: dict, measured: bool) -> list[str]:
    raw, m = row.get("raw") or {}, row["metrics"]
    batch = str(raw.get("batch_size", "?"))
    if m is None:
        return [row["name"], batch] + ["-"] * (len(_COLUMNS) - 3 + measured) + [f"FAILED: {row.get('error', '')}"]
    mem, graphs = row_peak_mem(row)
    notes = [raw["precision"] + (f" vs {m['peak_precision']} peak" if m["peak_tflops"] else "")]
    if graphs:
        notes.append("peak mem includes the warm-up (the CUDA graphs' memory pool is allocated when they are recorded)")
    if raw.get("sdpa_backend"):
        notes.append(f"attention: {raw['sdpa_backend']}")
    if raw.get("batch_note"):
        notes.append(raw["batch_note"])
    if row.get("part"):
        notes.append(f"part {row['part']} (header)")  # a merged file: the part whose commit and call it came from
    cache = raw.get("compile_cache_before")
    if cache and raw.get("compiled"):
        notes.append("compile cache cold (empty)" if not cache["files"] else
                     f"compile cache warm ({cache['bytes'] / 2**20:,.0f} MB before the row)")
    warm = row.get("warm") or {}
    if warm.get("status") == "ok":  # bench --warm: the row's cold compile happened there, beside other rows'
        notes.append(f"compiled in the --warm warm-up beside other rows (first step {warm['first_step_s']:.0f} s)")
    elif warm:
        notes.append(f"its --warm warm-up failed ({warm.get('error')}); it compiled in its turn")
    cells = [
        row["name"],
        batch,
        f"{m['ms_median']:.1f} ({m['ms_p10']:.1f}-{m['ms_p90']:.1f})",
        _num(m["img_per_s"]),
        _speedup_cell(m),
        _pct(m["data_wait_share"]),
        f"{raw['first_step_s']:.1f}",
        _num(m["tflops"]) if "tflops" in m else "-",
        _mfu(m.get("mfu"), m["peak_note"]),
    ]
    if measured:
        cells.append(_mfu(m.get("mfu_measured_peak"), m["peak_note"]))
    cells += [
        _mfu(m.get("executed_mfu"), m["peak_note"]) if "executed_flops_per_img" in m else "-",
        _mfu(m.get("published_mfu"), m["peak_note"]),
        f"{mem / 2**30:.1f}" if mem is not None else "n/a",
        "; ".join(notes),
    ]
    return cells


_SAMPLING_COLUMNS = ("model", "sampler", "steps", "mode", "precision", "images", "first call s", "seconds", "img/s",
                     "TFLOP/s", "vs eager", "images vs eager")


def _mode(s: dict) -> str:
    # Files from before the sampling rows had modes hold one compiled row per sampler.
    return s.get("mode") or ("compiled" if s.get("compiled") else "eager")


def sampling_speedup(entry: dict, result: dict) -> dict:
    """img/s of a sampling row over the eager row of the same model and sampler in the same file (speedup_of:
    marked when that row is another call's)."""
    eager = next((s for s in result.get("sampling") or [] if s.get("status", "ok") == "ok" and _mode(s) == "eager"
                  and s["name"] == entry["name"] and s["sampler"] == entry["sampler"]
                  and s["steps"] == entry["steps"] and s["n"] == entry["n"]), None)
    return speedup_of(entry["img_per_s"], eager["img_per_s"], same_call(entry, eager)) if eager else {}


def _sampling_cells(s: dict, result: dict) -> list[str]:
    if s.get("status", "ok") != "ok":
        return [s["name"], "-", "-", _mode(s)] + ["-"] * (len(_SAMPLING_COLUMNS) - 5) + [f"FAILED: {s['error']}"]
    diff = (f"max {s['vs_eager_max_abs']}, mean {s['vs_eager_mean_abs']:.3f}" if "vs_eager_max_abs" in s else "-")
    mode = _mode(s)
    if s.get("cudagraph_skips"):
        mode += " (CUDA graph skipped: inductor's log says why)"
    return [s["name"], s["sampler"], str(s["steps"]), mode,
            s["precision"], str(s["n"]), f"{s['first_call_s']:.1f}" if "first_call_s" in s else "-",
            f"{s['seconds']:.3f}", _num(s["img_per_s"]), _num(s["tflops"]) if s.get("tflops") is not None else "-",
            _speedup_cell(sampling_speedup(s, result)), diff]


def published_lines(result: dict) -> list[str]:
    """The published A100 table beside a recount with the FLOPs and peaks used here."""
    f = result.get("flops", {}).get(PUBLISHED["preset"])
    ratio = f["train"]["fwd_bwd"] / f["published"]["fwd_bwd"] if f else None
    header = ["row (published, A100)", "batch", "TFLOP/s as published", "speedup", "MFU as published"]
    if ratio:
        header += ["TFLOP/s recounted", "MFU recounted"]
    rows = []
    for name, batch, tflops, speedup, precision, mfu in PUBLISHED["rows"]:
        cells = [name, str(batch), f"{tflops:.2f}", f"{speedup:.2f}x", f"{100 * mfu:.2f}% (of {precision})"]
        if ratio:
            # fp32 rows ran their convolutions on TF32 tensor cores (PyTorch's cuDNN default), so their peak is TF32.
            peak = lookup_peak("A100", precision, tf32_cudnn=True)
            cells += [f"{tflops * ratio:.2f}", f"{100 * tflops * ratio / peak.tflops:.2f}% (of {peak.precision})"]
        rows.append(cells)
    lines = [f"### The published table ({PUBLISHED['card']}, {PUBLISHED['preset']})", "",
             f"Source: {PUBLISHED['source']}; its model is our `{PUBLISHED['preset']}` preset, its card an "
             f"{PUBLISHED['card']}.", ""]
    if ratio:
        lines += [
            f"Recounted: TFLOP/s x {ratio:.2f} (FlopCounterMode FLOPs / the published torchinfo count, which left "
            "out attention), divided by the dense peak of the precision the row really ran at (fp32 rows: TF32, "
            "because cuDNN used TF32 for fp32 convolutions by default).",
            "",
        ]
    return lines + md_table(header, rows)


def _groups(result: dict) -> dict[str, list[dict]]:
    """Rows by table section (model preset), in order."""
    groups: dict[str, list[dict]] = {}
    for row in result["rows"]:
        groups.setdefault(row["group"], []).append(row)
    return groups


_TERMINAL_COLUMNS = ("row", "batch", "ms/iter median (p10-p90)", "img/s", "speedup", "data wait", "TFLOP/s", "MFU",
                     "MFU (executed FLOPs)")


def terminal_table(result: dict) -> str:
    """The Markdown report's tables, aligned for a terminal: the main columns, a failed row's error at its end."""
    out = []
    for group, rows in _groups(result).items():
        table = [list(_TERMINAL_COLUMNS)]
        for row in rows:
            cells = dict(zip(_COLUMNS, _row_cells(row, measured=False)))
            table.append([cells[c] for c in _TERMINAL_COLUMNS] + ([cells["notes"]] if row["metrics"] is None else []))
        out += ["", group] + _aligned(table, len(_TERMINAL_COLUMNS))
    if result.get("sampling"):
        table = [list(_SAMPLING_COLUMNS)] + [_sampling_cells(s, result) for s in result["sampling"]]
        out += ["", "sampling"] + _aligned(table, len(_SAMPLING_COLUMNS))
    return "\n".join(out)


def _aligned(table: list[list[str]], ncols: int) -> list[str]:
    """First column left-aligned, the others right-aligned; cells past ncols (a failure's note) trail the line."""
    widths = [max(len(r[i]) for r in table if i < len(r)) for i in range(ncols)]
    return ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
            + ("  " + r[-1] if len(r) > len(widths) else "") for r in table]


def render_markdown(result: dict) -> str:
    """The whole report: provenance header, one table per model, sampling throughput, the published table."""
    measured = bool(result.get("measured_peaks"))
    columns = list(_COLUMNS)
    if measured:
        columns.insert(columns.index("MFU") + 1, "MFU (measured peak)")
    lines = [f"# Training-step benchmark: {result['table']} table on {result.get('card', '?')}", ""]
    lines += _header(result) + [""]
    for group, rows in _groups(result).items():
        lines += [f"## {group}", ""] + md_table(columns, [_row_cells(r, measured) for r in rows]) + [""]
        lines += [f"Overrides per row (on top of `load_config({rows[0]['preset']!r})`):", ""]
        lines += [f"- {r['name']}: `{' '.join(r['overrides'])}`" for r in rows] + [""]
    if result.get("sampling"):
        lines += ["## Sampling throughput", "",
                  "Whole sampling calls timed with CUDA events (one call per row, after an untimed first call that "
                  "compiles and records the CUDA graph); TFLOP/s = forward FLOPs per image x images x network calls "
                  "/ seconds; *vs eager*: img/s over the eager row of the same model, sampler and batch in this file "
                  "(\"other call\": that row is another part's); "
                  "*images vs eager*: max and mean |difference| in uint8 levels from the eager sampler's images, "
                  "same seed (DDIM).", ""]
        lines += md_table(list(_SAMPLING_COLUMNS), [_sampling_cells(s, result) for s in result["sampling"]]) + [""]
    lines += published_lines(result) + [""]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------- chart


def plot(result: dict, path: Path) -> None:
    """Horizontal bars of img/s per row, one panel per model, each bar labelled with its MFU (or 'n/a')."""
    plt = pyplot()

    # One panel per model of training rows, one for the sampling rows: (title, bar names, img/s, labels, x label).
    panels = []
    for group, rows in _groups(result).items():
        ms = [r["metrics"] for r in rows]
        labels = ["FAILED" if m is None else f" {_num(m['img_per_s'])} img/s, MFU {_mfu(m.get('mfu'), m['peak_note'])}"
                  for m in ms]
        panels.append((group, [r["name"] for r in rows], [m["img_per_s"] if m else 0.0 for m in ms], labels,
                       "images / s (training step, data loading in the loop)"))
    ok = [s for s in result.get("sampling") or [] if s.get("status", "ok") == "ok"]
    if ok:
        panels.append(("sampling", [f"{s['name']} {s['sampler']}-{s['steps']} {_mode(s)}" for s in ok],
                       [s["img_per_s"] for s in ok],
                       [f" {_num(s['img_per_s'])} img/s, {_num(s['tflops'])} TFLOP/s" for s in ok],
                       "images / s (whole sampling calls)"))
    bars_total = sum(len(p[1]) for p in panels)
    fig, axes = plt.subplots(max(1, len(panels)), 1, figsize=(10, 1.0 + 0.45 * bars_total + len(panels)),
                             squeeze=False)
    for ax, (title, names, values, labels, xlabel) in zip(axes[:, 0], panels):
        bars = ax.barh(names[::-1], values[::-1], color="#4c72b0")
        for bar, label in zip(bars, labels[::-1]):
            ax.text(bar.get_width(), bar.get_y() + bar.get_height() / 2, label, va="center", fontsize=8)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel(xlabel)
        ax.set_xlim(0, max(values + [1.0]) * 1.45)  # room for the labels
    env = result["environment"]
    fig.suptitle(f"{result.get('device_name') or 'CPU'} - torch {env.get('torch')} - "
                 f"{commit_text(env)}", fontsize=9)
    fig.tight_layout()
    save_figure(fig, path, 120)


def write_reports(result: dict, json_path: Path) -> tuple[Path, Path]:
    """(Markdown, PNG) written beside the JSON, metrics recomputed first."""
    add_metrics(result)
    md, png = json_path.with_suffix(".md"), json_path.with_suffix(".png")
    write_text(md, render_markdown(result))
    plot(result, png)
    return md, png


def main(argv: list[str] | None = None) -> int:
    p = Parser(prog="python -m benchmarks.speed.report", doc=__doc__, epilog=SINGLE_FILE_HELP)
    p.add_argument("json", type=Path, help="a result file written by benchmarks.speed.bench")
    args = p.parse_args(argv)
    try:
        result = json.loads(args.json.read_text())
    except (OSError, json.JSONDecodeError) as e:
        return fail("report", f"cannot read {args.json}: {e}")
    if not isinstance(result, dict) or "rows" not in result or "environment" not in result:
        return fail("report", f"{args.json} is not a benchmarks.speed.bench result (no 'rows'/'environment')")
    md, png = write_reports(result, args.json)
    print(f"report: wrote {md} and {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
