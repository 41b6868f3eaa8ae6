"""The results ledger: benchmarks/results/README.md, one index of every committed result JSON, generated from them.

    python -m benchmarks.ledger            # (re)writes benchmarks/results/README.md
    python -m benchmarks.ledger --check    # exit 1 (one line) if that page is stale or a file has no reader

Only files git tracks are indexed (staged ones included: `git add` new results, then run this): a local run's
git-ignored files (benchmarks/results/cpu/) or a fresh GPU run's untracked ones never make the page stale. Outside a
git checkout (a source archive) every file counts. Each JSON under the results folder (every card, every sub-folder)
is read by the one reader in READERS whose test
matches it (its keys, its `table`, or its file name); the reader returns the file's headline figure, computed from
the file by code, never typed in. Card, date and commit come from the file's own `environment` (dates never from
file times: a checkout sets those). A JSON that no reader matches stops the command with a line naming it, so a new
kind of result cannot land unlisted: add a reader, or add its name to NOT_RESULTS if it is no result of its own.
"""

from __future__ import annotations

import difflib
import json
import re
import shlex
import statistics
import subprocess
import sys
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Callable

from benchmarks.common import RESULTS, commit_text, md_table, write_text
from ffcv_ddpm.checks import Parser, fail

INDEX = "README.md"  # written in the results folder
CARD_NOTES = "README.md"  # a card's or a folder's hand-written notes, linked from the index
# JSON files that are parts of a result, not results: listed by name, with the reason, on the generated page.
NOT_RESULTS = {
    "config.json": "a trainer run folder's config (the run is listed by its environment.json)",
    "top_ops.json": "a profile's top-ops table (the profile is listed by its summary.json)",
    "ours-info.json": "a race side's settings (the race is listed by its race.json)",
    "peer-info.json": "a race side's settings (the race is listed by its race.json)",
    "kernels.json": "two profiles' kernels side by side (the profiles are listed by their summary.json)",
}


# ------------------------------------------------------------------------------------------------- formatting


def _ms(x: float) -> str:
    return f"{x:,.1f} ms"


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.1%}"


def _shape(shape: list) -> str:
    return "x".join(str(s) for s in shape if isinstance(s, int) and not isinstance(s, bool))


def _command(cmd) -> str | None:
    return cmd if isinstance(cmd, str) or cmd is None else shlex.join(cmd)


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


# ---------------------------------------------------------------------------------------------------- readers
# Each takes (path, data) and returns the headline: one line of figures read from the file.


def bench_table(path: Path, d: dict) -> str:
    """benchmarks.speed.bench: the fastest finished row (img/s) with its ms/step and MFU; the fastest sampling row."""
    from benchmarks.speed.report import add_metrics

    parts = []
    rows, ok = d.get("rows") or [], [r for r in d.get("rows") or [] if r.get("status") == "ok"]
    if ok and not all(r.get("metrics") for r in ok):  # a run cut short stored raw timings: derive as its report does
        add_metrics(d)
    timed = [r for r in ok if r.get("metrics")]
    if timed:
        best = max(timed, key=lambda r: r["metrics"]["img_per_s"])
        m = best["metrics"]
        parts.append(f"fastest of {len(ok)}/{len(rows)} rows ok, \"{best['name']}\" (batch {best['raw']['batch_size']})"
                     f": {_ms(m['ms_median'])}/step, {m['img_per_s']:,.0f} img/s, MFU {_pct(m.get('mfu'))}")
    elif rows:
        # ms/step, img/s and MFU are derived by the bench's report when the run ends: a run cut short before it
        # stored raw timings only (its Markdown may have been rendered from them later).
        md = path.with_suffix(".md")
        where = f"; figures in `{md.name}` beside it" if md.is_file() else ""
        parts.append(f"{len(ok)}/{len(rows)} rows ok, raw timings only (cut short before its report){where}")
    sampled = [s for s in d.get("sampling") or [] if s.get("status") == "ok"]
    if sampled:
        s = max(sampled, key=lambda s: s["img_per_s"])
        parts.append(f"fastest of {len(sampled)} sampling rows ok, {s['name']} {s['sampler'].upper()}-{s['steps']} "
                     f"{s['mode']} (batch {s['n']}): {s['seconds']:.2f} s, {s['img_per_s']:,.0f} img/s")
    if not parts:
        parts.append("no row finished")
    return "; ".join(parts) + ("" if d.get("complete", True) else " (run incomplete)")


def ddp(path: Path, d: dict) -> str:
    """benchmarks.speed.ddp: per mode, the largest GPU count's img/s and scaling efficiency, recomputed from the
    file's intervals by today's formula (ddp.rederive: images over seconds; files before it hold the median
    interval's rate, and say so here); the loss check if it ran."""
    from benchmarks.speed.ddp import rederive  # imports torch: only when a DDP file is listed

    parts = []
    for mode, points in rederive(d)["points"].items():
        ok = [p for p in points if "error" not in p and p.get("scaling_efficiency") is not None]
        p = max(ok, key=lambda p: p["nproc"], default=None)
        kept = " (the file's figure: no intervals kept)" if p and p.get("img_per_s_not_rederived") else ""
        if p is None:
            parts.append(f"{mode}: no point finished")
        elif p["nproc"] == 1:  # a run cut short after its one-GPU point: there is no scaling to report
            parts.append(f"{mode}: only the 1-GPU point finished, {p['img_per_s']:,.0f} img/s{kept}")
        else:
            parts.append(f"{mode}: {p['nproc']} GPUs {p['img_per_s']:,.0f} img/s{kept}, "
                         f"{p['scaling_efficiency']:.1%} scaling efficiency")
    for c in (d.get("loss_check") or {}).get("checks", []):
        parts.append(f"loss check, {c['nproc']} GPUs: largest deviation {c['max_abs_smoothed']:.2%} vs tolerance "
                     f"{c['tol']:.2%}: {'within' if c['ok'] else 'OUTSIDE'}")
    if any("img_per_s_median" not in p for points in d["points"].values() for p in points if "error" not in p):
        parts.append("img/s re-derived from the intervals (the file holds the median interval's rate)")
    return "; ".join(parts)


def loaders(path: Path, d: dict) -> str:
    """benchmarks.speed.loaders: the fastest loader configuration (median steady-epoch img/s)."""
    timed = [r for r in d["rows"] if r.get("img_s_median") is not None]
    skipped = sum(1 for r in d["rows"] if r.get("skipped"))
    if not timed:
        return f"no loader timed ({skipped} skipped)"
    best = max(timed, key=lambda r: r["img_s_median"])
    workers = "" if best.get("workers") is None else f", {best['workers']} workers"
    return (f"fastest of {len(timed)} timed ({skipped} skipped): {best['name']}{workers}, "
            f"{best['img_s_median']:,.0f} img/s")


def numerics(path: Path, d: dict) -> str:
    """benchmarks.speed.numerics: the largest smoothed loss deviation of the candidate against its tolerance."""
    c, nf, v = d["check"], d.get("noise_floor"), d.get("verdict")
    return (f"{d['candidate']['precision']} vs {d['reference']['precision']} over {d['steps']} steps: largest "
            f"deviation {c['max_abs_smoothed']:.2%} (step {c['at_step']}), tolerance {c['tol']:.1%}: "
            f"{'within' if c['ok'] else 'OUTSIDE'}"
            + (f"; the fp32 control strays {nf['control']:.2%}" if nf else "")
            + (f"; verdict {'pass' if v['ok'] else 'FAIL'} (bound {v['bound']:.2%}, the {v['by']})" if v else ""))


def numerics_draws(path: Path, d: dict) -> str:
    """benchmarks.speed.numerics_draws: NOTES 27's verdict over several numerics draws."""
    return (f"{d['verdict']} over {len(d['draws'])} draws (the rule needs {d['need']}): median candidate deviation "
            f"{d['median_candidate']:.2%} against {d['noise_factor']} x the median control's "
            f"{d['median_control']:.2%} = {d['bound']:.2%}")


def _profile(p: dict) -> str:
    top = max(p["classes"], key=lambda c: c["ms_per_step"])
    return (f"{_ms(p['gpu']['span_ms_per_step'])}/step on the GPU ({p['steps']} profiled steps), top class "
            f"{top['class']} {_ms(top['ms_per_step'])} ({top['pct_of_step']:.0f}% of the step)")


def profile(path: Path, d: dict) -> str:
    """benchmarks.speed.profile's summary.json."""
    return _profile(d["profile"])


def reanalysis(path: Path, d: dict) -> str:
    """benchmarks.speed.profile --from-trace: the same figures, from a saved trace analysed again."""
    return _profile(d)


def trainer_vs_bench(path: Path, d: dict) -> str:
    c = d["comparison"]
    return (f"trainer {d['trainer']['img_per_s']:,.0f} img/s vs bench {d['bench']['img_per_s']:,.0f} "
            f"({c['img_per_s_ratio'] - 1:+.1%}, tolerance {c['tol']:.0%}): {'agree' if c['agree'] else 'DISAGREE'}")


def _best_conditional(rows: list[dict], label: Callable[[dict], str]) -> str:
    """The finished row with the highest conditional accuracy (lower FD-digits breaks ties), with its FD."""
    scored = [r for r in rows if r.get("status") == "ok" and r.get("cond_acc") is not None]
    if not scored:
        return "no conditional row finished"
    r = max(scored, key=lambda r: (r["cond_acc"], -r["fd_digits"]))
    return f"best {label(r)}: accuracy {r['cond_acc']:.1%}, FD-digits {r['fd_digits']:.3f}"


def quality(path: Path, d: dict) -> str:
    """benchmarks.quality.digits: the best sampling row and the FD floor (real held-out images against real ones)."""
    best = _best_conditional(d["rows"], lambda r: f"{r['weights']} {r['sampler'].upper()}-{r['steps']} "
                                                  f"w={r['guidance']:g}")
    ok = sum(r.get("status") == "ok" for r in d["rows"])
    return f"{best} (floor {d['floor']['fd_digits']:.3f}); {ok}/{len(d['rows'])} rows ok"


def _sde_label(r: dict) -> str:
    steps = f"{r['steps']} steps" if r.get("steps") else f"tol {r['tol']:g}"  # an adaptive ODE solver has no steps
    return f"{r['sampler'].upper()} {steps}" + (f" eta={r['eta']:g}" if r.get("eta") is not None else "")


def sde_quality(path: Path, d: dict) -> str:
    """benchmarks.quality.sde: the best row of each process (VE, DDPM)."""
    parts = []
    for process in d["models"]:
        rows = [r for r in d["rows"] if r["process"] == process]
        parts.append(f"{process}: " + _best_conditional(rows, _sde_label))
    return "; ".join(parts) + f" (floor {d['reference']['fd_floor']:.3f}); {len(d['skipped'])} skipped"


def race(path: Path, d: dict) -> str:
    """benchmarks.quality.race: the seconds each side took to each threshold, and the ratio where both got there."""
    def at(point):
        return "-" if point is None else f"{point['clock_s']:.0f} s"

    rows = [f"<= {r['threshold']:g}: {at(r['ours'])} / {at(r['peer'])}"
            + (f" ({r['ratio']:.2f}x)" if r["ratio"] is not None else "") for r in d["table"]]
    return f"FD-digits, ours / peer: {'; '.join(rows)} (floor {d['floor']['fd_digits']:.3f})"


def compress(path: Path, d: dict) -> str:
    """benchmarks.quality.compress: the dense model's quality, and how many rows ran."""
    dense = next(r for r in d["rows"] if r["model"] == d["model"] and r["family"] == "reference"
                 and r["variant"].startswith("dense") and r.get("status") == "ok")
    ok = sum(r.get("status") == "ok" for r in d["rows"])
    skipped = sum(str(r.get("status", "")).startswith("skipped") for r in d["rows"])
    return (f"dense {d['model']}: accuracy {_pct(dense.get('cond_acc'))}, FD-digits {dense['fd_digits']:.3f}; "
            f"{ok} rows ran, {skipped} skipped, {len(d['rows']) - ok - skipped} failed")


def norm_bench(path: Path, d: dict) -> str:
    """benchmarks.speed.norm_bench: per shape, the fastest implementation's forward+backward (and how many failed)."""
    parts = []
    for shape in dict.fromkeys(_shape(r["shape"]) for r in d["rows"]):
        rows = [r for r in d["rows"] if _shape(r["shape"]) == shape and "error" not in r]
        failed = sum(_shape(r["shape"]) == shape and "error" in r for r in d["rows"])
        if not rows:
            parts.append(f"{shape}: every one of {failed} failed")
            continue
        r = min(rows, key=lambda r: r["fwd_bwd_ms"])
        plan = f" {tuple(r['plan'])}" if r.get("plan") else ""
        parts.append(f"{shape}: {r['impl']}{plan} {r['fwd_bwd_ms']:.2f} ms fwd+bwd ({len(rows)} timed"
                     + (f", {failed} failed)" if failed else ")"))
    return "; ".join(parts)


def trainer_run(path: Path, d: dict) -> str:
    """A trainer run folder (ffcv_ddpm.train), listed by its environment.json: its stats.jsonl's last line."""
    from ffcv_ddpm.train import read_stats  # the one reader of stats.jsonl (imports torch: only when a run is listed)

    if not (path.parent / "stats.jsonl").is_file():
        return "no stats.jsonl committed beside it"
    stats = read_stats(path.parent)
    if not stats:
        return "stats.jsonl is empty"
    last = stats[-1]
    return f"{last['step']:,} steps, last loss {last['loss']:.4f}, {last['img_per_s']:,.0f} img/s in the last interval"


def telemetry(path: Path, d: dict) -> str:
    """A trainer run's telemetry-summary.json (energy over the run)."""
    return (f"{d['energy_j']:,.0f} J over {d['images']:,} images = {d['j_per_img']:.3f} J/img, mean "
            f"{d['mean_power_w']:.0f} W ({d['energy_source']})")


def reducer_ops(path: Path, d: dict) -> str:
    """benchmarks.speed.reducer_ops: the operators DDP's reducer adds over the flat all-reduce, largest first."""
    extra = d["ddp_minus_flat"]
    added = sorted(((k, v) for k, v in extra["aten_ops"].items() if v > 0), key=lambda kv: (-kv[1], kv[0]))
    ops = ", ".join(f"{k} {v:+d}" for k, v in added[:3])
    kernels = sum(v for v in extra["gpu_kernels"].values())
    return (f"{d['preset']}, {d['params']} parameters, {d['device']}: DDP adds {ops}"
            + (f"; GPU kernels {kernels:+d}" if extra["gpu_kernels"] else ""))


def floors(path: Path, d: dict) -> str:
    """benchmarks.speed.floors: each compute class replayed alone, the memory-bound floors at the copy rate."""
    m = d["measured"]
    conv, norm = m["compute"].get("convolution", {}), m["memory"]["normalization"]
    return (f"{d['preset']}, batch {m['batch']}: convolutions alone {conv.get('fwd_ms', float('nan')):.2f} ms fwd + "
            f"{conv.get('bwd_ms', float('nan')):.2f} ms bwd; normalization floor {norm['floor_ms_5_passes']:.2f} ms "
            f"(5 passes at {m['copy_gb_per_s']:,.0f} GB/s)")


def copy_rate(path: Path, d: dict) -> str:
    """benchmarks.speed.copy_rate: a copy's streaming rate by size."""
    rows = d["rows"]
    lo, hi = min(rows, key=lambda r: r["gb_per_s"]), max(rows, key=lambda r: r["gb_per_s"])
    return (f"copy rate {lo['gb_per_s']:,.0f}-{hi['gb_per_s']:,.0f} GB/s over {rows[0]['mib']:,}-{rows[-1]['mib']:,} "
            f"MiB (slowest at {lo['mib']:,}, fastest at {hi['mib']:,})"
            + (f", {d['footprint_gib']:g} GiB held" if d["footprint_gib"] else ""))


def conv_sites(path: Path, d: dict) -> str:
    """benchmarks.speed.conv_sites: cuDNN alone at the step's edge sites, with the forms that could replace them."""
    rows = {(r["site"], r["case"]): r["ms"] for r in d["rows"]}
    cat = [f"{case} {rows[('up0-cat384', case)]:.3f}" for case in ("dgrad", "dgrad as 256 + 128")
           if ("up0-cat384", case) in rows]
    search = f"{d['benchmark_limit']} engines" if d["benchmark_limit"] else "every engine"
    return (f"{len(rows)} cases at batch {d['batch']}, cuDNN's search over {search}"
            + (f"; 384-channel {', '.join(cat)} ms" if cat else ""))


def conv_gn(path: Path, d: dict) -> str:
    """benchmarks.speed.conv_gn_bench: today's chains (cuDNN + the fused GroupNorm) against the fused convolution's,
    per step over the sites measured, and the convolution's rate alone in each."""
    done = [r for r in d["rows"] if "ms" in r]
    today = sum(r["ms"]["today"] * r["count"] for r in done)
    fused = sum(r["ms"]["fused"] * r["count"] for r in done)
    tflops = {k: sum(r["gflop"] * r["count"] for r in done) / sum(r["ms"][k] * r["count"] for r in done)  # GFLOP/ms = TFLOP/s
              for k in ("conv_cudnn", "conv_triton")}
    return (f"{len(done)} of {d['sites_total']} sites, batch {d['batch']}: today's chains {_ms(today)} a step, the "
            f"fused ones {_ms(fused)}; convolution alone {tflops['conv_cudnn']:.0f} TFLOP/s (cuDNN) against "
            f"{tflops['conv_triton']:.0f} (Triton)")


def conv_autotune(path: Path, d: dict) -> str:
    """benchmarks.speed.conv_autotune: Inductor's Triton convolution templates against cuDNN, forward, per step."""
    done = [r for r in d["rows"] if "cudnn_ms" in r]
    cudnn, inductor = (sum(r[k] * r["count"] for r in done) for k in ("cudnn_ms", "inductor_ms"))
    compile_s = sum(r["compile_s"] for r in done)
    return (f"{len(done)} of {len(d['rows'])} shapes, batch {d['batch']}: cuDNN {_ms(cudnn)} a step forward, "
            f"Inductor's templates {_ms(inductor)}; compile {compile_s:,.0f} s")


def conv_tma(path: Path, d: dict) -> str:
    """benchmarks.speed.conv_tma: TMA-fed 3x3 convolutions (plain Triton, Gluon) against cuDNN over the step's sites;
    the Gluon kernel's epilogue and prologue, their time a step against the passes they remove."""
    parts = []
    for kind in d.get("kinds", ["box"]):  # before 9ca0b99 one kernel, its best row a site
        best = [(s, s.get("best", {}).get(kind) if "kinds" in d else s.get("best")) for s in d["sites"]]
        best = [(s, b) for s, b in best if b]
        if best:
            cudnn, ours = (sum(s["count"] * x for s, x in pairs) for pairs in
                           ([(s, s["cudnn_ms"]) for s, _ in best], [(s, b["ms"]) for s, b in best]))
            parts.append(f"{kind} {cudnn / ours:.2f}x cuDNN's rate at {len(best)} sites")
    for key, what in (("epilogue", "its epilogue"), ("fused", "prologue + epilogue")):
        rows = [(s, s[key]) for s in d["sites"] if "extra_ms" in s.get(key, {})]
        if rows:
            extra, passes = (sum(s["count"] * r[k] for s, r in rows) for k in ("extra_ms", "passes_ms"))
            parts.append(f"{what} {extra:+.2f} ms a step for {passes:.2f} ms of passes")
    return f"batch {d['batch']}: " + "; ".join(parts)


def conv_dgrad(path: Path, d: dict) -> str:
    """benchmarks.speed.conv_dgrad: CUTLASS's 3x3 dgrad against cuDNN's over the step's sites, and the backward
    reduction's passes an epilogue could take."""
    best = [s for s in d["sites"] if s.get("best")]
    cudnn, ours, passes = (sum(s["count"] * x for s, x in pairs) for pairs in
                           ([(s, s["cudnn_ms"]) for s in best], [(s, s["best"]["ms"]) for s in best],
                            [(s, s.get("passes_ms", 0.0)) for s in best]))
    rate = f"{cudnn / ours:.3f}x cuDNN's rate ({_ms(cudnn)} -> {_ms(ours)} a step)" if best else "no correct config"
    text = (f"batch {d['batch']}: CUTLASS dgrad at {len(best)} of {len(d['sites'])} sites, {rate}; the backward "
            f"reduction's passes there {_ms(passes)}")
    tried = [s for s in d["sites"] if s.get("act_sums")]  # the dgrad with the reduction's sums in its epilogue
    if tried:
        fused = [s for s in tried if s.get("fused")]
        saved = sum(s["count"] * s["fused"]["saved_ms"] for s in fused)
        text += (f"; with the sums in its epilogue: correct at {len(fused)} of {len(tried)} sites"
                 + (f", {-saved:+.2f} ms a step against the plain dgrad and the passes" if fused else ""))
    return text


def cudnn_fusion(path: Path, d: dict) -> str:
    """benchmarks.speed.cudnn_fusion: which of cuDNN's graphs run around each 3x3 site, and what they cost a step
    over the plain convolution against the passes they remove."""
    parts = []
    for graph in d["graphs"]:
        rows = [(s, r) for s in d["sites"] for r in s["graphs"] if r["graph"] == graph]
        ran = [(s, r) for s, r in rows if "ms" in r and r["rel_err"] <= 2e-2]  # cudnn_fusion.TOL
        wrong = sum("ms" in r for _, r in rows) - len(ran)
        text = f"{graph} {len(ran)}/{len(rows)}" + (f" ({wrong} wrong)" if wrong else "")
        if ran and graph != "conv":
            extra, passes = (sum(s["count"] * x for s, x in pairs) for pairs in
                             ([(s, r["ms"] - r["base_ms"]) for s, r in ran], [(s, r["passes_ms"]) for s, r in ran]))
            text += f" ({extra:+.1f} ms for {passes:.1f})"
        parts.append(text)
    return (f"{d.get('dtype', 'bf16')}, intermediates {d.get('intermediate', 'float')}, batch {d['batch']}, graphs "
            "run / sites: " + ", ".join(parts))


def levers(path: Path, d: dict) -> str:
    """benchmarks.speed.levers: row 24 and each variant in one process; per setting the median of its rounds' median
    steps, against the defaults'."""
    by: dict[str, list[float]] = {}
    for r in d["rows"]:
        if (r.get("metrics") or {}).get("ms_median") is not None:
            by.setdefault(r["name"], []).append(r["metrics"]["ms_median"])
    base = statistics.median(by["defaults"])
    return ", ".join(f"{name} {_ms(statistics.median(ms))}" + ("" if name == "defaults" else
                     f" ({statistics.median(ms) / base - 1:+.1%})") + f" x{len(ms)}" for name, ms in by.items())


def _run_environment(path: Path, d: dict) -> dict | None:
    """The telemetry summary has no stamp of its own: its run's environment.json beside it is the run's."""
    env = path.parent / "environment.json"
    return json.loads(env.read_text()) if env.is_file() else None


@dataclass(frozen=True)
class Reader:
    kind: str  # what the index calls this kind of file
    matches: Callable[[Path, dict], bool]  # recognises the kind from the file's name and keys
    headline: Callable[[Path, dict], str]
    stamp: Callable[[Path, dict], dict | None] = lambda path, d: d.get("environment")  # commit, date, GPUs
    command: Callable[[Path, dict], str | None] = lambda path, d: _command(d.get("command"))  # None: not recorded


READERS = (
    Reader("bench table", lambda p, d: "table" in d and "rows" in d, bench_table),
    Reader("DDP scaling", lambda p, d: "points" in d and "flops_per_image" in d, ddp),
    Reader("loaders", lambda p, d: d.get("benchmark") == "loaders", loaders),
    Reader("numerics", lambda p, d: {"check", "reference", "candidate"} <= d.keys(), numerics),
    Reader("numerics draws", lambda p, d: {"draws", "median_candidate", "bound"} <= d.keys(), numerics_draws,
           stamp=lambda p, d: None),  # each draw's own report carries its commit, card and date
    Reader("profile", lambda p, d: "profile" in d and "telemetry" in d, profile),
    Reader("profile re-analysis", lambda p, d: {"trace", "classes", "gpu"} <= d.keys(), reanalysis,
           stamp=lambda p, d: None,  # the file has no environment: analysed later than the trace was taken
           # what writes this kind (the file records no command of its own)
           command=lambda p, d: f"python -m benchmarks.speed.profile --from-trace {d['trace']}"),
    Reader("trainer vs bench", lambda p, d: "comparison" in d and "trainer" in d, trainer_vs_bench),
    Reader("quality study", lambda p, d: {"best", "judge", "floor", "rows"} <= d.keys(), quality),
    Reader("SDE quality study", lambda p, d: {"models", "reference", "rows"} <= d.keys(), sde_quality),
    Reader("race", lambda p, d: {"thresholds", "sides", "table", "floor"} <= d.keys(), race),
    Reader("compression study", lambda p, d: {"dense", "rows", "model"} <= d.keys(), compress),
    Reader("GroupNorm layer", lambda p, d: {"environment", "device_name", "rows"} <= d.keys()
           <= {"environment", "device_name", "rows", "settings"}  # settings: since the plan grid's graph timing
           and all("fwd_bwd_ms" in r or "error" in r for r in d["rows"]), norm_bench),
    Reader("trainer run", lambda p, d: p.name == "environment.json" and "world_size" in d, trainer_run,
           stamp=lambda p, d: d),
    Reader("trainer telemetry", lambda p, d: p.name == "telemetry-summary.json", telemetry, stamp=_run_environment),
    Reader("DDP reducer ops", lambda p, d: "ddp_minus_flat" in d, reducer_ops),
    Reader("op-class floors", lambda p, d: {"measured", "profile_ms", "table"} <= d.keys(), floors),
    Reader("levers in the step", lambda p, d: {"row", "batch_size", "rows"} <= d.keys() and "table" not in d, levers),
    Reader("conv autotune", lambda p, d: d.get("benchmark") == "conv_autotune", conv_autotune),
    Reader("conv + GroupNorm forward", lambda p, d: {"sites_total", "rows", "configs"} <= d.keys(), conv_gn),
    Reader("TMA convolutions", lambda p, d: {"triton", "sites", "batch"} <= d.keys(), conv_tma),
    Reader("copy rate by size", lambda p, d: {"rows", "iters", "footprint_gib"} <= d.keys(), copy_rate),
    Reader("conv sites", lambda p, d: {"rows", "benchmark_limit", "batch"} <= d.keys(), conv_sites),
    Reader("cuDNN fusions", lambda p, d: "cudnn_frontend" in d and "sites" in d, cudnn_fusion),
    Reader("CUTLASS dgrad", lambda p, d: {"library", "sites", "batch"} <= d.keys() and "triton" not in d, conv_dgrad),
)


# ----------------------------------------------------------------------------------------------------- ledger


@dataclass
class Entry:
    path: Path  # relative to the results folder
    kind: str
    gpu: str
    date: str
    commit: str
    command: str | None
    headline: str


class LedgerError(Exception):
    """Files the ledger cannot list: one line each."""


def _gpu(d: dict, env: dict | None) -> str:
    env = env or {}
    gpus = env.get("gpus") or [{}]
    name = d.get("device_name") or d.get("device") or gpus[0].get("name")
    if not name:
        return "-"
    return f"{name} ({env['gpu_count']} visible)" if (env.get("gpu_count") or 1) > 1 else name


def _date(env: dict | None) -> str:
    stamp = (env or {}).get("date_utc")
    return datetime.fromisoformat(stamp).strftime("%Y-%m-%d %H:%M") if stamp else "not stamped"


def read_entry(path: Path, root: Path) -> Entry:
    rel = path.relative_to(root)
    try:
        d = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise LedgerError(f"{rel}: not readable JSON ({e})") from None
    matched = [r for r in READERS if isinstance(d, dict) and r.matches(path, d)]
    if not matched:
        raise LedgerError(f"{rel}: no reader recognises this JSON; add one to READERS in benchmarks/ledger.py "
                          "(or its name to NOT_RESULTS if it is no result of its own)")
    if len(matched) > 1:
        raise LedgerError(f"{rel}: matched by several readers ({', '.join(r.kind for r in matched)}); make their "
                          "tests in benchmarks/ledger.py disjoint")
    reader = matched[0]
    try:
        env = reader.stamp(path, d)
        return Entry(rel, reader.kind, _gpu(d, env), _date(env),
                     commit_text(env, 7) if env and env.get("commit") else "not stamped",
                     reader.command(path, d), reader.headline(path, d))
    except (KeyError, TypeError, ValueError, AttributeError, IndexError, StopIteration) as e:
        raise LedgerError(f"{rel}: the {reader.kind} reader cannot read it ({type(e).__name__}: {e}); fix the "
                          "reader in benchmarks/ledger.py") from None


def result_files(root: Path) -> list[Path]:
    """The JSON files under `root` that git tracks (the index: committed or staged), every one where `root` is not
    in a git work tree."""
    try:
        listed = subprocess.run(["git", "ls-files", "-z", "--", "*.json"], cwd=root, capture_output=True,
                                check=True).stdout
    except (OSError, subprocess.CalledProcessError):  # no git, or not a checkout
        return sorted(root.rglob("*.json"))
    return sorted(root / name for name in listed.decode().split("\0") if name)


def collect(root: Path) -> tuple[list[Entry], list[Path]]:
    """(every result JSON under `root` as an entry, the JSON files skipped by NOT_RESULTS). Raises LedgerError
    naming every file that cannot be listed."""
    entries, skipped, problems = [], [], []
    for path in result_files(root):
        if path.name in NOT_RESULTS:
            skipped.append(path.relative_to(root))
            continue
        try:
            entries.append(read_entry(path, root))
        except LedgerError as e:
            problems.append(str(e))
    if problems:
        raise LedgerError("\n".join(problems))
    return entries, skipped


def render(root: Path) -> str:
    entries, skipped = collect(root)
    excluded = [f"{sum(p.name == name for p in skipped)} x `{name}`, {why}" for name, why in NOT_RESULTS.items()]
    lines = ["# Results ledger", "",
             "Generated by `python -m benchmarks.ledger` from every JSON file git tracks under `benchmarks/results/`",
             "(local runs' ignored or untracked files are not listed): do not edit by hand; `python -m benchmarks.ledger",
             "--check` (run by `tests/test_ledger.py`) fails when this page and the files differ. Every figure is read",
             "from the file it links. Dates (UTC) and commits are the files' own: \"declared, not verified\" was passed",
             "to the GPU machine in `FFCV_DDPM_COMMIT`, \"not stamped\" means the file records none. Each card's and",
             "folder's hand-written notes are linked beside its heading. Commands are the files' own, as they ran: before",
             "issue 27 the modules were `benchmarks.X`, now `benchmarks.speed.X` or `benchmarks.quality.X`.", "",
             f"{len(entries)} result files; not listed: " + "; ".join(excluded) + "."]
    cards: dict[str, dict[str, list[Entry]]] = {}
    for e in entries:  # a file directly in the results folder has no card: it is grouped under "."
        card = e.path.parts[0] if len(e.path.parts) > 1 else "."
        cards.setdefault(card, {}).setdefault(e.path.parent.relative_to(card).as_posix(), []).append(e)
    for card, folders in cards.items():
        lines += ["", f"## {card}/" + _notes(root, Path(card))]
        for folder in sorted(folders, key=lambda f: (f != ".", f)):  # the card's own files first
            heading = (f"### {card}/ (top level)" if folder == "."
                       else f"### {card}/{folder}/" + _notes(root, Path(card, folder), Path(card)))
            lines += ["", heading, ""]
            lines += md_table(["file", "kind", "GPU", "date (UTC)", "commit", "headline (read from the file)",
                               "command"],
                              [[f"[{e.path.name}]({e.path.as_posix()})", e.kind, _cell(e.gpu), e.date, e.commit,
                                _cell(e.headline), f"`{_cell(e.command)}`" if e.command else "not recorded"]
                               for e in folders[folder]])
    return "\n".join(lines) + "\n"


def _notes(root: Path, folder: Path, card: Path | None = None) -> str:
    """A link to the notes of `folder`, or of the nearest folder above it below `card` (notes on a study's
    sub-folders sit in the study's folder)."""
    for f in (folder, *folder.parents):
        if f == card or f == Path("."):
            break
        if (root / f / CARD_NOTES).is_file():
            return f" ([notes]({(f / CARD_NOTES).as_posix()}))"
    return ""


def staleness(committed: str | None, fresh: str, root: Path) -> str | None:
    """None if the committed page equals the generated one, else one line saying how it differs."""
    if committed == fresh:
        return None
    if committed is None:
        return f"{root / INDEX} does not exist"
    linked = set(re.findall(r"\]\(([^)]+\.json)\)", committed))
    missing = [p for p in re.findall(r"\]\(([^)]+\.json)\)", fresh) if p not in linked]
    gone = sorted(linked - set(re.findall(r"\]\(([^)]+\.json)\)", fresh)))
    old, new = committed.splitlines(), fresh.splitlines()
    changed = [d for d in difflib.unified_diff(old, new, lineterm="", n=0)
               if d[:1] in "+-" and d[:3] not in ("+++", "---")]
    first = next((i for i, (a, b) in enumerate(zip(old, new)) if a != b), min(len(old), len(new))) + 1
    what = [f"{label}: {', '.join(paths[:3])}{', ...' if len(paths) > 3 else ''} ({len(paths)} files)"
            for label, paths in (("not listed", missing), ("listed but gone", gone)) if paths]
    what += [f"{len(changed)} changed lines, the first at line {first}"]
    return f"{root / INDEX} is stale: " + "; ".join(what)


def main(argv: list[str] | None = None) -> int:
    p = Parser(prog="python -m benchmarks.ledger", doc=__doc__,
               epilog="No --data and no KEY=VALUE overrides: the committed result files are the whole input.")
    p.add_argument("--check", action="store_true", help="write nothing; exit 1 if the page is stale or a JSON "
                                                        "has no reader")
    p.add_argument("--results", type=Path, default=RESULTS, help="the results folder to index")
    args = p.parse_args(argv)
    if not args.results.is_dir():
        return fail(p.prog, f"--results {args.results}: no such folder; give the folder holding the result files")
    try:
        fresh = render(args.results)
    except LedgerError as e:
        for line in str(e).splitlines():
            fail(p.prog, line)
        return 1 if args.check else 2
    index = args.results / INDEX
    if args.check:
        stale = staleness(index.read_text() if index.is_file() else None, fresh, args.results)
        if stale:
            return fail(p.prog, f"{stale}; run `python -m benchmarks.ledger` and commit it", 1)
        print(f"ledger: {index} is current")
        return 0
    write_text(index, fresh)
    print(f"ledger: wrote {index}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
