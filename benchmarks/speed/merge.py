"""One table measured over several GPU calls, merged into one file: each row keeps the commit and call it came from.

    python -m benchmarks.speed.merge benchmarks/results/h100-sxm/ddpm.json call1/ddpm.json call2/ddpm.json
    python -m benchmarks.speed.merge OUT.json headline.json headline-cudnn.json sampling.json --prefer-later

Writes OUT.json (+ .md, .png) from the result files of benchmarks.speed.bench given after it, in that order: every row
and sampling row of every part, each marked with its part (the header names each part's file, commit, torch, date
and command). Refused, in one line and nothing written: parts measured on different cards (a table is one card's
figures), on different datasets (synthetic vs CIFAR-10, other sizes), or the same row measured ok in two parts
(unless --prefer-later: the later part's row is kept). A failed row is replaced by the same row measured ok in
another part, in its place. A speedup over a baseline row (or an eager sampling row) of another part is another
call's, perhaps another machine's, clock and load: it is kept apart (speedup_cross_call) and the table marks it
"(other call)"; only a row of the baseline's own part gets a plain speedup (report.same_call).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from benchmarks.common import BenchError, write_json
from ffcv_ddpm.checks import Parser


def _read(path: Path) -> dict:
    try:
        result = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise BenchError(f"cannot read {path}: {e}") from None
    if not isinstance(result, dict) or "rows" not in result or "environment" not in result:
        raise BenchError(f"{path} is not a benchmarks.speed.bench result (no 'rows'/'environment')")
    return result


def _dataset_key(result: dict):
    ds = result.get("dataset")
    return None if not ds else (ds.get("source"), ds.get("synthetic"), ds.get("num_images"))


def merge(parts: list[tuple[Path, dict]], prefer_later: bool = False) -> dict:
    """The merged result of (file, result) parts; BenchError when they do not belong in one table."""
    if not parts:
        raise BenchError("give at least one result file to merge")
    cards = {p.name: r.get("device_name") or "CPU" for p, r in parts}
    if len(set(cards.values())) > 1:
        raise BenchError("the parts ran on different cards (" + ", ".join(f"{k}: {v}" for k, v in cards.items())
                         + "); a table holds one card's figures: merge each card's files separately")
    datasets = {p.name: _dataset_key(r) for p, r in parts if _dataset_key(r) is not None}
    if len(set(datasets.values())) > 1:
        raise BenchError("the parts read different datasets (" + ", ".join(f"{k}: {v}" for k, v in datasets.items())
                         + "); measure every part on the same data")

    first = parts[0][1]
    merged = {**first, "rows": [], "sampling": [], "sources": [], "flops": {}, "measured_peaks": None,
              "table": "+".join(dict.fromkeys(r["table"] for _, r in parts)),
              "complete": False,  # below: whether the parts together measured every row each of them planned
              "dataset": next((r["dataset"] for _, r in parts if r.get("dataset")), None),
              "command": ["python", "-m", "benchmarks.speed.merge", *(str(p) for p, _ in parts)]}
    where: dict[tuple, tuple[int, str]] = {}  # row key -> (index in merged rows or sampling, file it came from)
    for part, (path, result) in enumerate(parts, 1):
        env = result["environment"]
        merged["sources"].append({"file": str(path), "environment": env, "command": result.get("command", []),
                                  "settings": result.get("settings"), "rows": [r["name"] for r in result["rows"]],
                                  "sampling": len(result.get("sampling") or [])})
        merged["flops"].update(result.get("flops") or {})
        merged["measured_peaks"] = merged["measured_peaks"] or result.get("measured_peaks")
        stamp = {"part": part, "source": {"file": str(path), "commit": env.get("commit"),
                                          "commit_source": env.get("commit_source"), "dirty": env.get("dirty"),
                                          "device_name": result.get("device_name"), "date_utc": env.get("date_utc"),
                                          "torch": env.get("torch")}}
        entries = [("rows", (r["group"], r["name"]), r) for r in result["rows"]]
        entries += [("sampling", (s["name"], s.get("sampler"), s.get("steps"), s.get("n"), s.get("mode")), s)
                    for s in result.get("sampling") or []]
        for kind, key, entry in entries:
            entry = {**entry, **stamp}
            ok = entry.get("status", "ok") == "ok"
            if (kind, key) not in where:
                where[(kind, key)] = (len(merged[kind]), path.name)
                merged[kind].append(entry)
                continue
            index, earlier = where[(kind, key)]
            if merged[kind][index].get("status", "ok") == "ok" and ok and not prefer_later:
                raise BenchError(f"{kind[:-1] if kind == 'rows' else 'sampling row'} {' / '.join(map(str, key))!r} "
                                 f"was measured in {earlier} and in {path.name}; keep one (--prefer-later keeps the "
                                 "later file's)")
            if ok or merged[kind][index].get("status", "ok") != "ok":
                merged[kind][index] = entry  # an ok row replaces a failed one; --prefer-later: the later one
                where[(kind, key)] = (index, path.name)
    merged["rows"] = in_table_order(merged["rows"], merged["table"], [r.get("planned", []) for _, r in parts])
    merged["complete"] = is_complete([r for _, r in parts], merged["rows"])
    # Every part's planned rows (the first part's alone would name a sixth of a table split four ways).
    merged["planned"] = [list(k) for k in dict.fromkeys(tuple(row) for _, r in parts for row in r.get("planned", []))]
    return merged


def in_table_order(rows: list[dict], table: str, plans: list[list] = ()) -> list[dict]:
    """The rows as their table lists them: a row measured by a later call (row 4 after rows 1-24) goes in its place,
    not at the end. A row today's table no longer names (renamed since its call: the reformulations row at af0278d)
    keeps the place its own part's plan gave it, after the row planned before it (or before the row planned after
    it). Rows named nowhere (a row run with extra overrides) follow, in the order merged."""
    from benchmarks.speed.rows import TABLES

    order: dict[tuple, float] = {}
    for name in table.split("+"):
        for row in TABLES[name](()) if name in TABLES else []:
            order.setdefault((row.preset, row.name), len(order))
    for plan in plans:
        plan = [tuple(key) for key in plan]
        known = [i for i, key in enumerate(plan) if key in order]
        for i, key in enumerate(plan):
            if key in order or not known:
                continue
            before = [j for j in known if j < i]
            anchor, side = (before[-1], 1) if before else (next(j for j in known if j > i), -1)
            order[key] = order[plan[anchor]] + side * (1 - 1 / (abs(i - anchor) + 1)) / 2  # between it and the next
    return sorted(rows, key=lambda r: order.get((r["group"], r["name"]), len(order)))  # stable: ties keep order


def is_complete(parts: list[dict], rows: list[dict]) -> bool:
    """A call cut mid-table and finished by a later call makes one complete table: complete when every row any part
    planned was measured ok in some part. Parts written before results named their planned rows count as complete
    only if they finished."""
    ok = {(r["group"], r["name"]) for r in rows if r.get("status", "ok") == "ok"}
    for part in parts:
        if "planned" not in part:
            if not part.get("complete", False):
                return False
            continue
        if not all(tuple(row) in ok for row in part["planned"]):
            return False
    return True


def main(argv: list[str] | None = None) -> int:
    from benchmarks.speed.report import add_metrics, terminal_table, write_reports

    p = Parser(prog="python -m benchmarks.speed.merge", doc=__doc__,
               epilog="No --data and no KEY=VALUE overrides: the result files given are the whole input.")
    p.add_argument("out", type=Path, help="the merged result file to write (.json; its .md and .png beside it)")
    p.add_argument("parts", type=Path, nargs="+", help="result files of benchmarks.speed.bench, in order")
    p.add_argument("--prefer-later", action="store_true",
                   help="a row measured ok in two parts: keep the later file's instead of refusing")
    args = p.parse_args(argv)
    try:
        if args.out.suffix != ".json":
            raise BenchError(f"{args.out}: the merged file must end in .json (its .md and .png go beside it)")
        merged = merge([(path, _read(path)) for path in args.parts], args.prefer_later)
    except BenchError as e:
        print(f"merge: error: {e}", file=sys.stderr)
        return 2
    args.out.parent.mkdir(parents=True, exist_ok=True)
    add_metrics(merged)
    write_json(args.out, merged)
    md, png = write_reports(merged, args.out)
    print(terminal_table(merged))
    print(f"\nmerge: wrote {args.out}, {md.name}, {png.name}: {len(merged['rows'])} rows and "
          f"{len(merged['sampling'])} sampling rows from {len(args.parts)} files")
    return 0


if __name__ == "__main__":
    sys.exit(main())
