"""Markdown table and quality-vs-NFE plot of a benchmarks.quality.sde JSON (pure: no GPU, re-renders a saved run).

    python -m benchmarks.quality.sde_report benchmarks/results/h100/sde_quality.json   # writes .md and .png beside it
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from benchmarks.common import commit_text, pyplot, save_figure, write_json, write_text
from ffcv_ddpm.checks import SINGLE_FILE_HELP, Parser, fail


TARGET_ACC = 0.90  # issue 23: each model's best sampler reaches this conditional accuracy, or the report says not


def setting(row: dict) -> str:
    """What the row's step count means for its sampler."""
    if row["sampler"] == "ode":
        return f"rtol=atol={row['tol']:g}"
    return f"{row['steps']} steps"


def sampler_name(row: dict) -> str:
    return f"{row['sampler']} eta {row['eta']:g}" if row.get("eta") else row["sampler"]


def clip_of(row: dict) -> str:
    """The row's clip mode; rows of reports made before the option existed: what those samplers did (ddpm and ddim
    clamped their x0 prediction, em, pc and ode did not)."""
    return row.get("clip") or ("static" if row["sampler"] in ("ddpm", "ddim") else "off")


def measured(rows: list[dict]) -> list[dict]:
    return [r for r in rows if r.get("status", "ok") == "ok"]


def best_rows(rows: list[dict]) -> dict[str, dict]:
    """Per process, the measured row with the highest conditional accuracy (lower FD-digits breaks ties)."""
    best: dict[str, dict] = {}
    for r in measured(rows):
        if r.get("cond_acc") is not None:
            key = (r["cond_acc"], -r["fd_digits"])
            if r["process"] not in best or key > (best[r["process"]]["cond_acc"], -best[r["process"]]["fd_digits"]):
                best[r["process"]] = r
    return best


def markdown(result: dict) -> str:
    env, ref, s = result["environment"], result["reference"], result["settings"]
    ds = result["dataset"]
    floor = (f"FD-digits floor (FD of {ref['floor_n']} train images the judge held out to the test set) "
             f"{ref['fd_floor']:.3f}" if ref.get("fd_floor") is not None
             else "no FD-digits floor: the judge held no train images out (its own training images would bias it)")
    lines = [
        f"# Sample quality vs steps: VE-SDE and DDPM on {ds.get('source') or 'unknown'} data, {result['device']}", "",
        f"- Commit {commit_text(env)}, "
        f"{env.get('date_utc')}; torch {env.get('torch')}, CUDA {env.get('cuda')}; command: `{result['command']}`",
        f"- Data: {ds['path']} ({ds['num_images']} train images"
        + (", SYNTHETIC: the numbers mean nothing" if ds.get("synthetic") else "") + f"); reference set for FD: "
        f"{ref['test_images']} test images",
        f"- Judge: {ref['judge']}; its accuracy on the test set {_pct(ref['judge_test_acc'])}; {floor}",
        f"- Each row: {s['n']} samples, labels 0..9 in turn, guidance weight w={s['guidance']:g} (0: none), sampling "
        f"in {s['sample_precision']}, one seed; img/s from CUDA events around the whole sampler call (CPU: wall "
        "clock). NFE = network evaluations per image (a guided one is one forward of a doubled batch). clip: what "
        "every sampler does to its x0 prediction at each step (static: clamped to [-1, 1], the data's range; "
        "dynamic: Imagen's thresholding; off: nothing); reports made before the option existed clipped ddpm and "
        "ddim and not em, pc and ode, and are shown so.",
        "- Samplers: ddim (eta 0: deterministic; eta 1: stochastic, DDPM's posterior variance at DDIM's strides), "
        "ddpm = ancestral over all T steps (one NFE point by definition), em = Euler–Maruyama, pc = reverse-diffusion "
        f"predictor + Langevin corrector (snr {s['snr']}, NFE = 2 x steps), ode = probability flow "
        f"({s['ode_method']}, adaptive; NFE counted).",
    ]
    for proc, m in result["models"].items():
        lines.append(f"- {proc} model: {m['summary']}")
    if result.get("skipped"):
        lines.append(f"- Not run (sampling budget {s['budget_s']:.0f} s): " + ", ".join(result["skipped"]))
    if result.get("stopped"):
        lines.append(f"- STOPPED ({result['stopped']}): the rows below are those it finished")
    elif not result.get("complete"):
        lines.append("- INCOMPLETE: the run stopped before its last row; the rows below are those it finished")
    for proc, r in best_rows(result["rows"]).items():
        verdict = "meets" if r["cond_acc"] >= TARGET_ACC else "does NOT meet"
        lines.append(f"- **{proc} model: best conditional accuracy {_pct(r['cond_acc'])}** ({sampler_name(r)}, "
                     f"{setting(r)}, clip {clip_of(r)}, FD-digits {r['fd_digits']:.3f}): {verdict} the "
                     f"{TARGET_ACC:.0%} target")
    lines += ["", "| process | sampler | clip | setting | NFE | img/s | FD-digits | cond. acc | status |",
              "|" + "---|" * 9]
    order = {"ok": 0}
    for r in sorted(result["rows"], key=lambda r: (r["process"], sampler_name(r), clip_of(r),
                                                   order.get(r.get("status", "ok"), 1), r.get("nfe", 0),
                                                   r.get("tol") or 0)):
        head = f"| {r['process']} | {sampler_name(r)} | {clip_of(r)} | {setting(r)} |"
        if r.get("status", "ok") == "ok":
            lines.append(f"{head} {r['nfe']} | {_num(r['img_per_s'])} | {r['fd_digits']:.3f} | "
                         f"{_pct(r['cond_acc'])} | ok |")
        else:
            lines.append(f"{head} - | - | - | - | {r['status']} |")
    return "\n".join(lines) + "\n"


def _num(x: float) -> str:
    return f"{x:,.0f}" if x >= 100 else f"{x:.3g}"


def _pct(x) -> str:
    return "n/a" if x is None else f"{100 * x:.1f}%"


def plot(result: dict, path: Path) -> None:
    plt = pyplot()

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    groups: dict[tuple[str, str], list[dict]] = {}
    for r in measured(result["rows"]):
        groups.setdefault((r["process"], sampler_name(r), clip_of(r)), []).append(r)
    for (proc, sampler, clip), rows in sorted(groups.items()):
        rows = sorted(rows, key=lambda r: r["nfe"])
        style = dict(marker="o" if proc == "ve" else "s", ls=":" if clip == "off" else "-",
                     label=f"{proc} / {sampler} / clip {clip}")
        axes[0].plot([r["nfe"] for r in rows], [r["fd_digits"] for r in rows], **style)
        if rows[0]["cond_acc"] is not None:
            axes[1].plot([r["nfe"] for r in rows], [100 * r["cond_acc"] for r in rows], **style)
    floor = result["reference"].get("fd_floor")
    if floor is not None:
        axes[0].axhline(floor, color="k", ls=":", lw=1, label="floor (held-out vs test)")
    axes[1].axhline(100 * TARGET_ACC, color="r", ls=":", lw=1, label=f"{TARGET_ACC:.0%} target")
    axes[0].set_yscale("log")
    axes[0].set_ylabel("FD-digits to the test set (lower is better)")
    axes[1].set_ylabel("conditional accuracy (%)")
    for ax in axes:
        ax.set_xscale("log")
        ax.set_xlabel("network evaluations per image (NFE)")
        ax.grid(alpha=0.3, which="both")
    axes[0].legend(fontsize=7)
    fig.suptitle(f"Quality vs NFE, {result['device']}", fontsize=10)
    fig.tight_layout()
    save_figure(fig, path, 120)


def render(result: dict, json_path: Path) -> None:
    """JSON, Markdown and plot beside each other, each written atomically."""
    write_json(json_path, result)
    write_text(json_path.with_suffix(".md"), markdown(result))
    if measured(result["rows"]):
        plot(result, json_path.with_suffix(".png"))


def main(argv: list[str] | None = None) -> int:
    p = Parser(prog="python -m benchmarks.quality.sde_report", doc=__doc__, epilog=SINGLE_FILE_HELP)
    p.add_argument("json", type=Path, help="an sde_quality.json written by benchmarks.quality.sde")
    args = p.parse_args(argv)
    try:
        render(json.loads(args.json.read_text()), args.json)
    except (OSError, ValueError, KeyError) as e:
        return fail("sde_report", f"{args.json} is not a benchmarks.quality.sde result ({e})")
    print(f"wrote {args.json.with_suffix('.md')} and {args.json.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
