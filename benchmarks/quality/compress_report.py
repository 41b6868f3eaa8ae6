"""The compression report from its JSON: Markdown, quality vs size and latency, latency per variant.

    python -m benchmarks.quality.compress_report benchmarks/results/h100/compress/compress.json   # re-render .md + .png

Pure rendering: benchmarks.quality.compress measures and calls write_report after every row.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from benchmarks.common import pyplot, save_figure, write_json, write_text
from ffcv_ddpm.checks import SINGLE_FILE_HELP, Parser, fail

FAMILIES = ("reference", "int8", "unstructured", "structured", "architecture")
BASELINE = "dense (baseline)"
SCRATCH_REFERENCE = "dense convs (reference)"  # the dense network trained from scratch like the architecture rows
COLUMNS = ("family | variant | fine-tuned | params | non-zero | sparsity | GFLOP/img | MB | MB (CSR) | latency ms | "
           "img/s | train ms/step | FD-digits | cond. acc. | status")


def _fmt(x, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def ordered(rows: list[dict]) -> list[dict]:
    """Table order: by family, then as run, each fine-tuned row right after the same variant as pruned."""
    first = {}
    for i, r in enumerate(rows):
        first.setdefault((r["family"], r["variant"]), i)
    return sorted(rows, key=lambda r: (FAMILIES.index(r["family"]), first[(r["family"], r["variant"])],
                                       r.get("fine_tune_steps", 0)))


def by_model(rows: list[dict]) -> dict[str, list[dict]]:
    models: dict[str, list[dict]] = {}
    for r in rows:
        models.setdefault(r["model"], []).append(r)
    return models


def find(rows: list[dict], variant: str, fine_tuned: bool = False) -> dict | None:
    for r in rows:
        if r["variant"] == variant and bool(r.get("fine_tune_steps")) == fine_tuned and r.get("status") == "ok":
            return r
    return None


TARGET_ACC = 0.90  # the quality bar a dense model must pass before its compression means anything (issue 23)
SAME = 0.10  # latency ratios within 1 +- SAME are read as "unchanged" (stated in the sentence that uses it)


def _ratio_words(ratio: float) -> str:
    """A latency ratio to the baseline in words: unchanged within SAME, else faster or slower."""
    if abs(ratio - 1) <= SAME:
        return f"unchanged within {SAME:.0%} ({ratio:.2f}x)"
    return f"{'faster' if ratio < 1 else 'slower'} ({ratio:.2f}x)"


def findings(rows: list[dict]) -> list[str]:
    """Sentences computed from one model's measured rows: the quality bar, what sparsity, int8, structure and
    fine-tuning did. Every verdict in them follows from the ratios they quote."""
    base = find(rows, BASELINE)
    if base is None:
        return []
    ok = [r for r in rows if r.get("status") == "ok"]
    out = []
    if base.get("cond_acc") is not None:
        passed = base["cond_acc"] >= TARGET_ACC
        out.append(f"The dense model's samples: conditional accuracy {base['cond_acc']:.1%}, FD-digits "
                   f"{base['fd_digits']:.3f}: it {'passes' if passed else 'does NOT pass'} the quality bar "
                   f"(>= {TARGET_ACC:.0%})" + ("." if passed else ": the rows below measure damage to a model that "
                                                                  "had not learned, not compression."))
    sparse = [r for r in ok if r["family"] == "unstructured" and not r.get("fine_tune_steps")]
    if sparse:
        ratios = [r["latency_ms"] / base["latency_ms"] for r in sparse]
        top = max(sparse, key=lambda r: r["weight_sparsity"])
        same = all(abs(x - 1) <= SAME for x in ratios)
        out.append(f"Unstructured sparsity: latency {min(ratios):.2f}-{max(ratios):.2f}x the dense over {len(sparse)} "
                   f"rows, up to {top['weight_sparsity']:.0%} of the weights zero ({top['variant']}: latency "
                   f"{_ratio_words(top['latency_ms'] / base['latency_ms'])})"
                   + (": the zeros are still multiplied (same shapes, same dense kernels)." if same else
                      f": not all within {SAME:.0%} of the dense although they run its shapes and kernels, so that "
                      "spread is the timing's run-to-run variation here.")
                   + f" Checkpoint {top['size_mb']:.2f} MB against {base['size_mb']:.2f} MB dense; stored as CSR "
                   f"{_fmt(top.get('size_csr_mb'), '.2f')} MB.")
    for r in ok:
        if r["family"] == "int8":
            size, lat = r["size_mb"] / base["size_mb"], r["latency_ms"] / base["latency_ms"]
            out.append(f"{r['variant']}: checkpoint {size:.2f}x the baseline's, sampling latency "
                       f"{_ratio_words(lat)}"
                       + (f"; conditional accuracy {r['cond_acc']:.1%}" if r.get("cond_acc") is not None else "")
                       + ".")
    for r in ok:
        if (r["family"] in ("structured", "architecture") and not r.get("fine_tune_steps")
                and r["variant"] != SCRATCH_REFERENCE):
            flops, lat = r["gflops_per_image"] / base["gflops_per_image"], r["latency_ms"] / base["latency_ms"]
            follows = ("latency fell with the FLOPs" if lat < 1 - SAME and flops < 1 - SAME else
                       "latency did not fall with the FLOPs" if flops < 1 - SAME else "FLOPs unchanged")
            out.append(f"{r['variant']}: {flops:.2f}x the FLOPs, {lat:.2f}x the latency ({follows}), "
                       f"{r['params'] / base['params']:.2f}x the parameters.")
    arch_ref = find(rows, SCRATCH_REFERENCE)
    for r in ok:
        if r["family"] == "architecture" and arch_ref is not None and r is not arch_ref and r.get("cond_acc") is not None:
            out.append(f"{r['variant']} after {r.get('scratch_steps')} steps from scratch: FD-digits "
                       f"{r['fd_digits']:.3f}, conditional accuracy {r['cond_acc']:.1%}; the dense network trained "
                       f"the same way: {arch_ref['fd_digits']:.3f}, {arch_ref['cond_acc']:.1%}.")
    for r in ok:
        if r.get("fine_tune_steps") and r.get("fd_digits") is not None:
            before = find(rows, r["variant"])
            if before is not None and before.get("fd_digits") is not None:
                a, b = round(before["fd_digits"], 3), round(r["fd_digits"], 3)
                change = "left FD-digits as it was" if a == b else "improved FD-digits" if b < a else "worsened FD-digits"
                out.append(f"{r['variant']}: {r['fine_tune_steps']} fine-tuning steps {change} ({a:.3f} -> {b:.3f}; "
                           f"conditional accuracy {before['cond_acc']:.1%} -> {r['cond_acc']:.1%}).")
    return out


def render_markdown(result: dict) -> str:
    env, dense, s = result["environment"], result["dense"], result["settings"]
    sampler = result.get("sampler", "ddim").upper()
    trained = ""
    if dense.get("trained_here"):
        cfg = dense["config"]["train"]
        compiled = cfg["compile"] and result["device"] != "CPU"  # the trainer compiles on CUDA only
        trained = (f" (trained by this run as `make quality` trains it: {cfg['steps']} steps, "
                   f"{'compiled' if compiled else 'eager'}, {dense.get('seconds', 0):.0f} s)")
    lines = [f"# Compression study: `{result['model']}` ({result['device']})", "",
             f"- commit {env.get('commit')}{' (dirty)' if env.get('dirty') else ''}, torch {env.get('torch')}, "
             f"CUDA {env.get('cuda')}, torchao {env.get('torchao')}, {env.get('date_utc')}; "
             f"command: `{result['command']}`",
             f"- dense model: `{dense['run_dir']}` at step {dense['step']}{trained}; EMA weights",
             f"- every row: {sampler} {s['ddim_steps']} steps, batch {s['sample_batch']}, guidance w={s['guidance']:g}, "
             f"{s['reps']} calls (latency: median of the calls after the first; quality: all "
             f"{s['reps'] * s['sample_batch']} samples), eager, channels_last; fine-tuning: {s['ft_steps']} steps, "
             f"lr {s['ft_lr']:g}, EMA {s['ft_ema']}",
             f"- from-scratch rows: {s['scratch_steps']} steps each"
             + (f" (the dense model: {dense['step']})" if dense.get("step") else "")
             + ", eagerly, with the dense run's settings; raw weights; their reference is the dense network trained "
             "the same way (`dense convs (reference)`), not the dense model above",
             f"- elapsed {result.get('elapsed_s', 0):.0f} s of a {result['budget_s']:.0f} s budget for starting rows"]
    left_out = [f for f in FAMILIES if f not in s.get("families", FAMILIES)]
    if left_out:
        lines.append(f"- not studied (--families): {', '.join(left_out)}")
    if result.get("stopped"):
        lines.append(f"- **STOPPED** ({result['stopped']}): below is what it measured before")
    elif not result["complete"]:
        lines.append("- **INCOMPLETE**: the run stopped before its end; below is what it measured")
    lines += [f"- {note}" for note in result.get("notes", [])]
    judge, floor = result.get("judge") or {}, result.get("floor")
    if "test_accuracy" in judge:
        lines.append(f"- judge `{judge['path']}`: test accuracy {judge['test_accuracy']:.2%}"
                     + (f"; FD-digits floor ({floor['n']} train images the judge never saw, vs the test set): "
                        f"{floor['fd_digits']:.3f}" if floor else "; no floor (the judge held no images out)"))
    elif judge:
        lines.append(f"- quality: {judge.get('none')}")
    lines += ["", "What the columns mean: *params* counts every weight as the network computes (a pruned weight "
              "once); *non-zero* the ones that are not zero; *sparsity* the zero share of the compressed layers "
              "(Conv2d and Linear weights); *GFLOP/img* one forward pass; *MB* what torch.save writes for the "
              "state_dict, *MB (CSR)* the same with the pruned weights stored sparse (int32 indices); *latency* "
              "one whole sampling call (all steps) for the batch; *train ms/step* the trainer's step, eager, "
              "median after the warm-up steps; *FD-digits* (lower is better) and *cond. acc.* over all samples of "
              "the row."]
    for model, rows in by_model(result["rows"]).items():
        lines += ["", f"## {model}", ""]
        lines += [f"- {f}" for f in findings(rows)]
        lines += ["", f"| {COLUMNS} |", "|" + "---|" * len(COLUMNS.split(" | "))]
        for r in ordered(rows):
            ft = f"{r['fine_tune_steps']} steps" if r.get("fine_tune_steps") else "-"
            cells = [r["family"], r["variant"], ft, _fmt(r.get("params"), ","), _fmt(r.get("nonzero_params"), ","),
                     _fmt(r.get("weight_sparsity"), ".1%"), _fmt(r.get("gflops_per_image"), ".3f"),
                     _fmt(r.get("size_mb"), ".2f"), _fmt(r.get("size_csr_mb"), ".2f"), _fmt(r.get("latency_ms"), ".1f"),
                     _fmt(r.get("img_per_s"), ",.0f"), _fmt(r.get("train_step_ms"), ".1f"),
                     _fmt(r.get("fd_digits"), ".3f"), _fmt(r.get("cond_acc"), ".1%"), r["status"]]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot_quality(result: dict, path: Path) -> None:
    """FD-digits and conditional accuracy against checkpoint MB and latency: one colour per family, hollow markers
    as pruned, filled after fine-tuning."""
    plt = pyplot()
    rows = [r for r in result["rows"] if r.get("status") == "ok" and r.get("fd_digits") is not None]
    fig, axes = plt.subplots(2, 2, figsize=(12, 8.5))
    for (metric, ylabel), ax_row in zip([("fd_digits", "FD-digits to the test set (lower is better)"),
                                         ("cond_acc", "conditional accuracy (%)")], axes):
        for (x, xlabel), ax in zip([("size_mb", "checkpoint (MB)"), ("latency_ms", "sampling call (ms)")], ax_row):
            for i, family in enumerate(FAMILIES):
                for tuned in (False, True):
                    pts = [r for r in rows if r["family"] == family and bool(r.get("fine_tune_steps")) == tuned
                           and r.get(metric) is not None]
                    if not pts:
                        continue
                    scale = 100 if metric == "cond_acc" else 1
                    ax.scatter([r[x] for r in pts], [scale * r[metric] for r in pts], s=36,
                               facecolors=f"C{i}" if tuned or family not in ("unstructured", "structured") else "none",
                               edgecolors=f"C{i}", label=family + (" (fine-tuned)" if tuned else ""))
            if metric == "fd_digits" and result.get("floor"):
                ax.axhline(result["floor"]["fd_digits"], color="k", ls="--", lw=1, label="floor (held-out vs test)")
            ax.set(xlabel=xlabel, ylabel=ylabel, xscale="log")
    axes[0][0].legend(fontsize=7)
    fig.suptitle(f"{result['model']}: quality vs size and latency, {result['device']}, commit "
                 f"{(result['environment'].get('commit') or '?')[:10]}", fontsize=9)
    fig.tight_layout()
    save_figure(fig, path, 110)


def plot_latency(result: dict, path: Path) -> None:
    """Latency of every measured variant, one panel per model, the dense baseline as a dashed line."""
    plt = pyplot()
    models = {m: [r for r in ordered(rows) if r.get("status") == "ok"] for m, rows in by_model(result["rows"]).items()}
    models = {m: rows for m, rows in models.items() if rows}
    if not models:
        return
    height = max(len(rows) for rows in models.values())
    fig, axes = plt.subplots(1, len(models), figsize=(7 * len(models), 1.5 + 0.22 * height), squeeze=False)
    for ax, (model, rows) in zip(axes[0], models.items()):
        labels = [r["variant"] + (" +ft" if r.get("fine_tune_steps") else "") for r in rows]
        ax.barh(range(len(rows)), [r["latency_ms"] for r in rows],
                color=[f"C{FAMILIES.index(r['family'])}" for r in rows])
        ax.set_yticks(range(len(rows)), labels=labels, fontsize=7)
        ax.invert_yaxis()
        base = find(rows, BASELINE)
        if base:
            ax.axvline(base["latency_ms"], color="k", ls="--", lw=1)
        ax.set(xlabel="sampling call (ms; dashed: dense baseline)", title=model)
    fig.tight_layout()
    save_figure(fig, path, 110)


def write_report(result: dict, out: Path, draw: bool = True) -> None:
    """compress.json and compress.md; with `draw` also compress.png and latency.png (all written atomically)."""
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "compress.json", result, indent=2)
    write_text(out / "compress.md", render_markdown(result))
    if draw:
        plot_quality(result, out / "compress.png")
        plot_latency(result, out / "latency.png")


def main(argv: list[str] | None = None) -> int:
    p = Parser(prog="python -m benchmarks.quality.compress_report", doc=__doc__, epilog=SINGLE_FILE_HELP)
    p.add_argument("json", type=Path)
    args = p.parse_args(argv)
    try:
        result = json.loads(args.json.read_text())
        render_markdown(result)
    except (OSError, ValueError, KeyError) as e:
        return fail("compress_report", f"{args.json} is not a benchmarks.quality.compress result ({e})")
    write_report(result, args.json.parent)
    print(f"compress_report: wrote compress.md and the plots in {args.json.parent}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
