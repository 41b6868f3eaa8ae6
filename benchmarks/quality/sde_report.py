"""Markdown table, targets and quality-vs-NFE plot of a benchmarks.quality.sde JSON (pure: no GPU, re-renders a
saved run, reports made before the models, clip and targets existed included).

    python -m benchmarks.quality.sde_report benchmarks/results/h100/sde-quality/sde_quality.json   # .md, .png beside it

The plot: conditional accuracy (top) and FD-digits (bottom) against NFE on a log axis from 3 to 1,000, a column per
model, a colour per sampler, solid lines with the x0 prediction clipped and dotted without; the floor, twice the floor
and the targets drawn.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

from benchmarks.common import commit_text, pyplot, save_figure, write_json, write_text
from ffcv_ddpm.checks import SINGLE_FILE_HELP, Parser, fail


@dataclass(frozen=True)
class Target:
    text: str
    metric: str  # "cond_acc" (higher is better) or "fd_digits" (lower is better)
    goal: float  # cond_acc: the least accuracy; fd_digits: the most, as a multiple of the floor
    max_nfe: int
    deterministic_only: bool = False

    def goal_value(self, floor: float | None) -> float | None:
        if self.metric == "cond_acc":
            return self.goal
        return None if floor is None else self.goal * floor

    def meets(self, row: dict, floor: float | None) -> bool:
        goal = self.goal_value(floor)
        if goal is None or row["nfe"] > self.max_nfe or (self.deterministic_only and not deterministic(row)):
            return False
        return row[self.metric] >= goal if self.metric == "cond_acc" else row[self.metric] <= goal


TARGETS = (  # issue 48
    Target(">= 97% conditional accuracy at <= 10 NFE", "cond_acc", 0.97, 10),
    Target("a deterministic sampler >= 95% conditional accuracy at <= 20 NFE", "cond_acc", 0.95, 20,
           deterministic_only=True),
    Target("FD-digits within 2x the floor at <= 50 NFE", "fd_digits", 2.0, 50),
)


def deterministic(row: dict) -> bool:
    """The sampler draws no noise after the prior: heun without churn, dpm2m, ddim eta 0, the ODE."""
    return (row["sampler"] in ("dpm2m", "ode") or (row["sampler"] == "heun" and not row.get("churn"))
            or (row["sampler"] == "ddim" and not row.get("eta")))


def model_of(row: dict) -> str:
    return row.get("model") or row["process"]  # reports before the EDM models: one model per process


def clip_of(row: dict) -> str:
    """The row's clip mode; rows of reports made before the option existed: what those samplers did (ddpm and ddim
    clamped their x0 prediction, em, pc and ode did not)."""
    return row.get("clip") or ("static" if row["sampler"] in ("ddpm", "ddim") else "off")


def setting(row: dict) -> str:
    """What the row's step count means for its sampler."""
    if row["sampler"] == "ode":
        return f"rtol=atol={row['tol']:g}"
    return f"{row['steps']} steps"


def sampler_name(row: dict) -> str:
    if row.get("eta"):
        return f"{row['sampler']} eta {row['eta']:g}"
    return f"{row['sampler']} churn {row['churn']:g}" if row.get("churn") else row["sampler"]


def measured(rows: list[dict]) -> list[dict]:
    return [r for r in rows if r.get("status", "ok") == "ok" and r.get("cond_acc") is not None]


def describe(row: dict) -> str:
    return f"{sampler_name(row)}, clip {clip_of(row)}, NFE {row['nfe']}"


def target_results(result: dict) -> list[tuple[Target, dict[str, tuple[bool, dict | None]]]]:
    """Per target, per model: (met, the row): the cheapest row that meets it (fewest NFE, then the better metric),
    or else the best row within its NFE limit (None: no measured row within it)."""
    floor = result["reference"].get("fd_floor")
    rows = measured(result["rows"])
    models = list(result["models"]) or sorted({model_of(r) for r in rows})
    out = []
    for target in TARGETS:
        sign = -1 if target.metric == "cond_acc" else 1  # sort key: better first
        per_model = {}
        for model in models:
            mine = [r for r in rows if model_of(r) == model]
            hits = sorted((r for r in mine if target.meets(r, floor)),
                          key=lambda r: (r["nfe"], sign * r[target.metric]))
            within = sorted((r for r in mine if r["nfe"] <= target.max_nfe
                             and (deterministic(r) or not target.deterministic_only)),
                            key=lambda r: sign * r[target.metric])
            per_model[model] = (True, hits[0]) if hits else (False, within[0] if within else None)
        out.append((target, per_model))
    return out


def _value(target: Target, row: dict) -> str:
    return _pct(row["cond_acc"]) if target.metric == "cond_acc" else f"FD-digits {row['fd_digits']:.3f}"


def target_lines(result: dict) -> list[str]:
    """One line per target: which models meet it and with which sampler at how many NFE; for the others, their best
    within the target's NFE."""
    floor = result["reference"].get("fd_floor")
    lines = []
    for target, per_model in target_results(result):
        if target.goal_value(floor) is None:
            lines.append(f"target {target.text}: not checked (no floor: the judge held no images out)")
            continue
        met = [f"{m} ({describe(r)}: {_value(target, r)})" for m, (ok, r) in per_model.items() if ok]
        missed = [f"{m} (best at <= {target.max_nfe} NFE: " + (f"{_value(target, r)}, {describe(r)})" if r else
                                                               "no row measured)")
                  for m, (ok, r) in per_model.items() if not ok]
        goal = "" if target.metric == "cond_acc" else f" (<= {target.goal_value(floor):.3g})"
        lines.append(f"target {target.text}{goal}: " + ("MET by " + "; ".join(met) if met else "NOT MET")
                     + ("; not by " + "; ".join(missed) if missed and met else ": " + "; ".join(missed) if missed
                        else ""))
    return lines


def markdown(result: dict) -> str:
    env, ref, s = result["environment"], result["reference"], result["settings"]
    ds = result["dataset"]
    floor = (f"FD-digits floor (FD of {ref['floor_n']} train images the judge held out to the test set) "
             f"{ref['fd_floor']:.3f}" if ref.get("fd_floor") is not None
             else "no FD-digits floor: the judge held no train images out (its own training images would bias it)")
    lines = [
        f"# Quality per network evaluation: the samplers on VE and DDPM models, {ds.get('source') or 'unknown'} "
        f"data, {result['device']}", "",
        f"- Commit {commit_text(env)}, {env.get('date_utc')}; torch {env.get('torch')}, CUDA {env.get('cuda')}",
        f"- Data: {ds['path']} ({ds['num_images']} train images"
        + (", SYNTHETIC: the numbers mean nothing" if ds.get("synthetic") else "") + f"); reference set for FD: "
        f"{ref['test_images']} test images",
        f"- Judge: {ref['judge']}; its accuracy on the test set {_pct(ref['judge_test_acc'])}; {floor}",
        f"- Each row: {s['n']} samples, labels 0..9 in turn, guidance weight w={s['guidance']:g} (0: none), one seed "
        "(the same prior noise for every row of a model); img/s from CUDA events around the whole sampler call (CPU: "
        "wall clock). NFE = network evaluations per image (a guided one is one forward of a doubled batch). clip: "
        "what every sampler does to its x0 prediction at each step (static: clamped to [-1, 1], the data's range; "
        "dynamic: Imagen's thresholding; off: nothing); reports made before the option existed clipped ddpm and "
        "ddim and not em, pc and ode, and are shown so.",
        "- Samplers: heun = EDM's Heun (Algorithm 1, NFE 2N - 1; with churn: Algorithm 2, S_tmin 0.05, S_tmax 1, "
        "S_noise 1.007), dpm2m = DPM-Solver++(2M) (NFE N), both on EDM's ρ = 7 noise levels; ddim (eta 0: "
        "deterministic; eta 1: DDPM's posterior variance at DDIM's strides), ddpm = ancestral over all T steps, em = "
        f"Euler–Maruyama, pc = reverse-diffusion predictor + Langevin corrector (snr {s['snr']}, NFE 2N), ode = "
        f"probability flow ({s['ode_method']}, adaptive; NFE counted). Deterministic: heun without churn, dpm2m, "
        "ddim eta 0, ode.",
    ]
    for part in result.get("parts", []):
        state = (f"{part['total_s']:.0f} s in all, {part['sampling_s']:.0f} s of sampling" if part.get("complete")
                 else "did not finish")
        lines.append(f"- Part {part['part']} ({', '.join(part['models'])}; {part.get('device', result['device'])}): "
                     f"`{part['command']}`: {state}")
    if not result.get("parts"):
        lines.append(f"- Command: `{result['command']}`")
    for name, m in result["models"].items():
        lines.append(f"- {name} model: {m['summary']}")
    if result.get("skipped"):
        lines.append(f"- Not run (sampling budget {s['budget_s']:.0f} s a part): " + ", ".join(result["skipped"]))
    if result.get("stopped"):
        lines.append(f"- STOPPED ({result['stopped']}): the rows below are those it finished")
    elif not result.get("complete"):
        lines.append("- INCOMPLETE: a part stopped before its last row, or is still to run; the rows below are those "
                     "measured")
    lines += ["", "## Targets", ""] + [f"- {line}" for line in target_lines(result)]
    lines += ["", "## Rows", "",
              "| model | sampler | clip | setting | NFE | precision | img/s | FD-digits | cond. acc | status |",
              "|" + "---|" * 10]
    order = {"ok": 0}
    precision = s.get("sample_precision", "")
    for r in sorted(result["rows"], key=lambda r: (model_of(r), sampler_name(r), clip_of(r),
                                                   order.get(r.get("status", "ok"), 1), r.get("nfe", 0),
                                                   r.get("tol") or 0)):
        head = (f"| {model_of(r)} | {sampler_name(r)} | {clip_of(r)} | {setting(r)} |")
        if r.get("status", "ok") == "ok":
            lines.append(f"{head} {r['nfe']} | {r.get('precision', precision)} | {_num(r['img_per_s'])} | "
                         f"{r['fd_digits']:.3f} | {_pct(r['cond_acc'])} | ok |")
        else:
            lines.append(f"{head} - | {r.get('precision', precision)} | - | - | - | {r['status']} |")
    return "\n".join(lines) + "\n"


def _num(x: float) -> str:
    return f"{x:,.0f}" if x >= 100 else f"{x:.3g}"


def _pct(x) -> str:
    return "n/a" if x is None else f"{100 * x:.1f}%"


def plot(result: dict, path: Path) -> None:
    plt = pyplot()

    rows = measured(result["rows"])
    models = [m for m in result["models"] if any(model_of(r) == m for r in rows)] or sorted({model_of(r) for r in rows})
    samplers = sorted({sampler_name(r) for r in rows})
    colours = {name: plt.get_cmap("tab10")(i % 10) for i, name in enumerate(samplers)}
    styles = {"static": "-", "dynamic": "--", "off": ":"}
    floor = result["reference"].get("fd_floor")
    fig, axes = plt.subplots(2, len(models), figsize=(3.6 * len(models) + 1.5, 7), squeeze=False, sharex=True)
    for col, model in enumerate(models):
        acc_ax, fd_ax = axes[0][col], axes[1][col]
        groups: dict[tuple[str, str], list[dict]] = {}
        for r in rows:
            if model_of(r) == model:
                groups.setdefault((sampler_name(r), clip_of(r)), []).append(r)
        for (sampler, clip), group in sorted(groups.items()):
            group = sorted(group, key=lambda r: r["nfe"])
            style = dict(color=colours[sampler], ls=styles.get(clip, "-"), marker="o", ms=3, lw=1.2,
                         label=f"{sampler}, clip {clip}")
            nfe = [r["nfe"] for r in group]
            acc_ax.plot(nfe, [100 * r["cond_acc"] for r in group], **style)
            fd_ax.plot(nfe, [r["fd_digits"] for r in group], **style)
        for target in TARGETS:
            goal = target.goal_value(floor)
            if goal is None:
                continue
            ax = acc_ax if target.metric == "cond_acc" else fd_ax
            value = 100 * goal if target.metric == "cond_acc" else goal
            ax.plot([2.5, target.max_nfe], [value, value], color="r", lw=1, ls="--")  # the target's region
            ax.axvline(target.max_nfe, color="r", lw=0.5, ls=":")
        if floor is not None:
            fd_ax.axhline(floor, color="k", ls=":", lw=1, label="floor (held-out vs test)")
        acc_ax.set_title(f"{model} ({result['models'].get(model, {}).get('param', 'eps')})", fontsize=10)
        fd_ax.set_yscale("log")
        for ax in (acc_ax, fd_ax):
            ax.set_xscale("log")
            ax.set_xlim(2.5, 1200)
            ax.grid(alpha=0.3, which="both")
        fd_ax.set_xlabel("network evaluations per image (NFE)")
    axes[0][0].set_ylabel("conditional accuracy (%)")
    axes[1][0].set_ylabel("FD-digits to the test set")
    handles = {}
    for ax in axes.flat:
        for h, label in zip(*ax.get_legend_handles_labels()):
            handles.setdefault(label, h)
    fig.legend(handles.values(), handles.keys(), loc="center right", fontsize=7)
    fig.suptitle(f"Quality against NFE; red: the targets (solid lines: x0 clipped, dotted: not), {result['device']}",
                 fontsize=10)
    fig.tight_layout(rect=(0, 0, 1 - 1.4 / (3.6 * len(models) + 1.5), 1))
    save_figure(fig, path, 120)


def render(result: dict, json_path: Path, with_plot: bool = True) -> None:
    """JSON, Markdown and (with_plot) the plot beside each other, each written atomically."""
    write_json(json_path, result)
    write_text(json_path.with_suffix(".md"), markdown(result))
    if with_plot and measured(result["rows"]):
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
