"""The compression report from its JSON: Markdown, quality vs size and latency, latency per variant.

    python -m benchmarks.compress_report benchmarks/results/h100-sxm/compress/compress.json   # re-render .md + .png

Pure rendering: benchmarks.compress measures and calls write_report after every row.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from ffcv_ddpm.checks import SINGLE_FILE_HELP, Parser, fail
from tools.atomic import Staged, write_json

FAMILIES = ("reference", "int8", "unstructured", "structured", "architecture")
BASELINE = "dense (baseline)"
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


def findings(rows: list[dict]) -> list[str]:
    """Sentences computed from one model's measured rows: what sparsity, int8 and structure did to latency."""
    base = find(rows, BASELINE)
    if base is None:
        return []
    out = []
    sparse = [r for r in rows if r["family"] == "unstructured" and r.get("status") == "ok"]
    if sparse:
        top = max(sparse, key=lambda r: r["weight_sparsity"])
        out.append(f"Unstructured sparsity: with {top['weight_sparsity']:.0%} of the weights zero ({top['variant']}) "
                   f"a sampling call took {top['latency_ms']:.1f} ms against {base['latency_ms']:.1f} ms dense "
                   f"({top['latency_ms'] / base['latency_ms']:.2f}x): dense kernels multiply the zeros too. Its "
                   f"checkpoint is {top['size_mb']:.2f} MB against {base['size_mb']:.2f} MB "
                   f"({_fmt(top.get('size_csr_mb'), '.2f')} MB stored as CSR).")
    for r in rows:
        if r["family"] == "int8" and r.get("status") == "ok":
            out.append(f"{r['variant']}: {r['size_mb']:.2f} MB ({r['size_mb'] / base['size_mb']:.2f}x the fp32 "
                       f"checkpoint), {r['latency_ms']:.1f} ms per call ({r['latency_ms'] / base['latency_ms']:.2f}x "
                       "the baseline).")
    for r in rows:
        if r["family"] in ("structured", "architecture") and r.get("status") == "ok" and not r.get("fine_tune_steps"):
            out.append(f"{r['variant']}: {r['gflops_per_image'] / base['gflops_per_image']:.2f}x the FLOPs, "
                       f"{r['latency_ms'] / base['latency_ms']:.2f}x the latency, "
                       f"{r['params'] / base['params']:.2f}x the parameters.")
    return out


def render_markdown(result: dict) -> str:
    env, dense, s = result["environment"], result["dense"], result["settings"]
    lines = [f"# Compression study: `{result['model']}` ({result['device']})", "",
             f"- commit {env.get('commit')}{' (dirty)' if env.get('dirty') else ''}, torch {env.get('torch')}, "
             f"CUDA {env.get('cuda')}, torchao {env.get('torchao')}, {env.get('date_utc')}; "
             f"command: `{result['command']}`",
             f"- dense model: `{dense['run_dir']}` at step {dense['step']}"
             f"{' (trained by this run, eager)' if dense.get('trained_here') else ''}; EMA weights",
             f"- every row: DDIM {s['ddim_steps']} steps, batch {s['sample_batch']}, guidance w={s['guidance']:g}, "
             f"{s['reps']} calls (latency: median of the calls after the first), eager, channels_last; "
             f"fine-tuning: {s['ft_steps']} steps, lr {s['ft_lr']:g}, EMA {s['ft_ema']}",
             f"- elapsed {result.get('elapsed_s', 0):.0f} s of a {result['budget_s']:.0f} s budget for starting rows"]
    if not result["complete"]:
        lines.append("- **INCOMPLETE**: the run stopped before its end; below is what it measured")
    judge, floor = result.get("judge") or {}, result.get("floor")
    if "test_accuracy" in judge:
        lines.append(f"- judge `{judge['path']}`: test accuracy {judge['test_accuracy']:.2%}"
                     + (f"; FD-digits floor (train vs test, {floor['n']} images): {floor['fd_digits']:.3f}"
                        if floor else ""))
    elif judge:
        lines.append(f"- quality: {judge.get('none')}")
    lines += ["", "What the columns mean: *params* counts every weight as the network computes (a pruned weight "
              "once); *non-zero* the ones that are not zero; *sparsity* the zero share of the compressed layers "
              "(Conv2d and Linear weights); *GFLOP/img* one forward pass; *MB* what torch.save writes for the "
              "state_dict, *MB (CSR)* the same with the pruned weights stored sparse (int32 indices); *latency* "
              "one whole sampling call (all DDIM steps) for the batch; *train ms/step* the trainer's step, eager, "
              "median after 10 warm-up steps; *FD-digits* (lower is better) and *cond. acc.* over all samples of "
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


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: Path) -> None:
    with Staged() as staged:
        fig.savefig(staged.path(path), dpi=110, format="png")
        staged.commit()


def plot_quality(result: dict, path: Path) -> None:
    """FD-digits and conditional accuracy against checkpoint MB and latency: one colour per family, hollow markers
    as pruned, filled after fine-tuning."""
    plt = _pyplot()
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
                ax.axhline(result["floor"]["fd_digits"], color="k", ls="--", lw=1, label="floor (train vs test)")
            ax.set(xlabel=xlabel, ylabel=ylabel, xscale="log")
    axes[0][0].legend(fontsize=7)
    fig.suptitle(f"{result['model']}: quality vs size and latency, {result['device']}, commit "
                 f"{(result['environment'].get('commit') or '?')[:10]}", fontsize=9)
    fig.tight_layout()
    _save(fig, path)
    plt.close(fig)


def plot_latency(result: dict, path: Path) -> None:
    """Latency of every measured variant, one panel per model, the dense baseline as a dashed line."""
    plt = _pyplot()
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
    _save(fig, path)
    plt.close(fig)


def write_report(result: dict, out: Path, draw: bool = True) -> None:
    """compress.json and compress.md; with `draw` also compress.png and latency.png (all written atomically)."""
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "compress.json", result)
    with Staged() as staged:
        staged.path(out / "compress.md").write_text(render_markdown(result))
        staged.commit()
    if draw:
        plot_quality(result, out / "compress.png")
        plot_latency(result, out / "latency.png")


def main(argv: list[str] | None = None) -> int:
    p = Parser(prog="python -m benchmarks.compress_report", doc=__doc__, epilog=SINGLE_FILE_HELP)
    p.add_argument("json", type=Path)
    args = p.parse_args(argv)
    try:
        result = json.loads(args.json.read_text())
        render_markdown(result)
    except (OSError, ValueError, KeyError) as e:
        return fail("compress_report", f"{args.json} is not a benchmarks.compress result ({e})")
    write_report(result, args.json.parent)
    print(f"compress_report: wrote compress.md and the plots in {args.json.parent}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
