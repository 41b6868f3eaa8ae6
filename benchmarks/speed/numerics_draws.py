"""bf16 against fp32 decided over several draws of one numerics command (NOTES item 27's rule).

    python -m benchmarks.speed.numerics_draws benchmarks/results/h100/numerics-0c88903        # its draw-*/ reports
    python -m benchmarks.speed.numerics_draws RUN1/numerics-bf16.json RUN2 RUN3 --out DIR --need 6

One draw of `benchmarks.speed.numerics` with a control leg compares the candidate's deviation from the fp32
reference with `--noise-factor` times the control's (fp32 against fp32: how far two runs stray anyway). At today's
defaults on an H100 three draws gave fail, pass, fail, each within 0.3 points of the bound (results/h100/
numerics-0c88903): one draw of each is too noisy to decide. NOTES item 27 set the rule before the next draws: the
median of the candidate's deviations over --need draws (six) against --noise-factor times the median of the controls'.
This command applies it to the reports given (files, or folders searched for numerics-*.json): every draw must be of
the same check (preset, card, precisions, batch, logging interval, each leg's overrides; their commands may differ
in --out and --time-limit), each draw's deviations are its report's own; with fewer than --need draws the verdict is
"undecided", with the medians so far. It writes numerics-draws.json and .md to --out, or prints the table alone.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

from benchmarks.common import md_table, write_json, write_text
from ffcv_ddpm.checks import Parser, at_least, fail, option

# What makes two reports draws of one check: the same values of these (a leg's: its precision and overrides).
SAME = ("preset", "device", "batch_size", "log_every", "common_overrides")
LEGS = ("reference", "candidate", "control")


def find_reports(paths: list[Path]) -> list[Path]:
    """The numerics reports among `paths`: a file as given, a folder's numerics-*.json anywhere below it, sorted."""
    found = []
    for p in paths:
        if p.is_dir():
            found += sorted(q for q in p.rglob("numerics-*.json") if q.name != "numerics-draws.json")
        else:
            found.append(p)
    return found


def signature(report: dict) -> dict:
    """The settings that two draws of one check share."""
    sig = {k: report.get(k) for k in SAME}
    for leg in LEGS:
        sig[leg] = {k: (report.get(leg) or {}).get(k) for k in ("precision", "overrides")}
    return sig


def decide(reports: list[tuple[str, dict]], need: int, factor: float) -> dict:
    """The rule over the draws: median candidate deviation against factor x the median control deviation (each a
    report's max |smoothed ratio - 1| from step skip on); ValueError naming a draw that is not of the same check or
    has no control leg."""
    if not reports:
        raise ValueError("no numerics reports given (numerics-*.json, or folders holding them)")
    first_name, first = reports[0]
    sig = signature(first)
    draws = []
    for name, r in reports:
        if r.get("noise_floor") is None:
            raise ValueError(f"{name}: no control leg (numerics --control KEY=VALUE): the rule reads the control's "
                             "deviation")
        other = signature(r)
        if other != sig:
            diff = ", ".join(k for k in sig if sig[k] != other[k])
            raise ValueError(f"{name} is not a draw of the check in {first_name}: they differ in {diff}")
        nf = r["noise_floor"]
        draws.append({"report": name, "candidate": nf["candidate"], "control": nf["control"],
                      "steps": r.get("steps"), "ok_alone": (r.get("verdict") or {}).get("ok"),
                      "commit": (r.get("environment") or {}).get("commit")})
    cand = statistics.median(d["candidate"] for d in draws)
    ctl = statistics.median(d["control"] for d in draws)
    bound = factor * ctl
    decided = len(draws) >= need
    verdict = ("pass" if cand <= bound else "fail") if decided else "undecided"
    return {"signature": sig, "draws": draws, "need": need, "noise_factor": factor, "median_candidate": cand,
            "median_control": ctl, "bound": bound, "verdict": verdict,
            "leaning": "pass" if cand <= bound else "fail"}


def render(result: dict, command: str) -> str:
    sig = result["signature"]
    rows = [[d["report"], f"{d['steps']}", f"{100 * d['candidate']:.2f}%", f"{100 * d['control']:.2f}%",
             {True: "pass", False: "fail", None: "-"}[d["ok_alone"]], (d["commit"] or "?")[:10]]
            for d in result["draws"]]
    n, need = len(result["draws"]), result["need"]
    verdict = (f"**{result['verdict']}**: the median candidate deviation {100 * result['median_candidate']:.2f}% "
               f"against {result['noise_factor']:g} x the median control's {100 * result['median_control']:.2f}% = "
               f"{100 * result['bound']:.2f}%, over {n} draws")
    if result["verdict"] == "undecided":
        verdict += f" (the rule needs {need}; on these it leans {result['leaning']})"
    lines = [f"# bf16 against fp32 over {n} draws: {sig['preset']}, {sig['candidate']['precision']} vs "
             f"{sig['reference']['precision']} on {sig['device']}", "", f"`{command}`", "",
             f"Batch {sig['batch_size']}; control leg `{' '.join(sig['control']['overrides'] or [])}`; "
             f"deviation = a draw's max |smoothed loss ratio - 1| against its fp32 reference (numerics' check).", "",
             verdict + ".", ""]
    lines += md_table(["draw", "steps", "candidate deviation", "control deviation", "alone (its own verdict)",
                       "commit"], rows)
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = Parser(prog="python -m benchmarks.speed.numerics_draws", doc=__doc__,
               epilog="No --data and no KEY=VALUE overrides: the reports of earlier numerics runs are the input.")
    p.add_argument("reports", nargs="+", type=Path, help="numerics-*.json files, or folders holding them")
    p.add_argument("--need", type=option(int, at_least(1)), default=6, help="draws the rule needs to decide")
    p.add_argument("--noise-factor", type=option(float, at_least(0)), default=1.5,
                   help="the bound: this many times the median control deviation")
    p.add_argument("--out", type=Path, help="folder for numerics-draws.json and .md (default: print only)")
    args = p.parse_args(argv)
    command = "python -m benchmarks.speed.numerics_draws " + " ".join(sys.argv[1:] if argv is None else argv)
    try:
        paths = find_reports(args.reports)
        missing = [str(q) for q in paths if not q.is_file()]
        if missing:
            raise ValueError(f"no such file: {', '.join(missing)}")
        reports = []
        for q in paths:
            try:
                reports.append((str(q), json.loads(q.read_text())))
            except ValueError as e:
                raise ValueError(f"{q}: not a numerics report ({e})") from None
        result = decide(reports, args.need, args.noise_factor)
    except ValueError as e:
        return fail("numerics_draws", str(e))
    text = render(result, command)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        write_json(args.out / "numerics-draws.json", {"command": command, **result})
        write_text(args.out / "numerics-draws.md", text)
    print(text, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
