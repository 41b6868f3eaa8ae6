"""benchmarks.speed.merge: one table from result files of several calls, each row keeping its commit and card."""

import copy
import json

from benchmarks.speed import merge
from tests.test_bench import _fake_result

H100 = "NVIDIA H100 80GB HBM3"


def _part(tmp_path, name, commit, rows, sampling=(), device=H100, complete=True):
    result = _fake_result(device)
    by_name = {r["name"]: r for r in result["rows"]}
    result["rows"] = [copy.deepcopy(by_name[r]) for r in rows]
    result["sampling"] = list(sampling)
    result["environment"]["commit"] = commit
    result["complete"] = complete
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(result))
    return path


def _sampling(mode, img_per_s):
    return {"name": "ddpm-cifar10", "sampler": "ddim", "steps": 50, "n": 8, "mode": mode, "precision": "bf16",
            "seconds": 8 / img_per_s, "img_per_s": img_per_s, "tflops": 1.0, "first_call_s": 1.0, "status": "ok"}


def test_parts_merge_into_one_table_and_each_row_keeps_its_commit(tmp_path, capsys):
    # Call 1 ran the baseline and hit OOM on "oom"; call 2 (another commit) ran "oom" again and "fast"; a third call
    # timed compiled sampling against the eager sampling of call 1.
    a = _part(tmp_path, "a", "aaa1111", ["base", "oom"], [_sampling("eager", 4.0)], complete=False)
    b = _part(tmp_path, "b", "bbb2222", ["fast"])
    ok_oom = json.loads(b.read_text())
    ok_oom["rows"] = [{**ok_oom["rows"][0], "name": "oom"}, ok_oom["rows"][0]]
    b.write_text(json.dumps(ok_oom))
    c = _part(tmp_path, "c", "ccc3333", [], [_sampling("reduce-overhead", 16.0)])
    out = tmp_path / "merged" / "small.json"
    assert merge.main([str(out), str(a), str(b), str(c)]) == 0
    got = json.loads(out.read_text())
    assert [(r["name"], r["status"], r["part"], r["source"]["commit"]) for r in got["rows"]] == [
        ("base", "ok", 1, "aaa1111"), ("oom", "ok", 2, "bbb2222"), ("fast", "ok", 2, "bbb2222")]  # in its place
    assert all(r["source"]["device_name"] == H100 for r in got["rows"])
    assert [s["mode"] for s in got["sampling"]] == ["eager", "reduce-overhead"] and not got["complete"]
    assert [src["environment"]["commit"] for src in got["sources"]] == ["aaa1111", "bbb2222", "ccc3333"]
    # Over the baseline row of call 1: another call (another process, perhaps machine), so no plain speedup.
    fast = got["rows"][2]["metrics"]
    assert fast["speedup"] is None and fast["speedup_cross_call"] == 2.0
    md = out.with_suffix(".md").read_text()
    assert "Part 2: `" in md and "commit bbb2222" in md and "part 2 (header)" in md
    assert "| 2.00x (other call) |" in md
    assert "| 4.00x (other call) |" in md  # compiled sampling of call 3 over the eager sampling of call 1
    assert out.with_suffix(".png").is_file() and "merge: wrote" in capsys.readouterr().out


def test_a_speedup_is_plain_only_over_a_baseline_of_the_same_call(tmp_path):
    """A row and the baseline it is measured against in one part: one call, one machine, a plain speedup; the same
    figures from two parts: the ratio kept apart as cross-call, and the table says so."""
    together = _part(tmp_path, "a", "aaa", ["base", "fast"], [_sampling("eager", 4.0), _sampling("compiled", 12.0)])
    out = tmp_path / "one.json"
    assert merge.main([str(out), str(together)]) == 0
    got = json.loads(out.read_text())
    assert [r["metrics"]["speedup"] for r in got["rows"]] == [1.0, 2.0]
    assert not any("speedup_cross_call" in r["metrics"] for r in got["rows"])
    md = out.with_suffix(".md").read_text()
    cells = [line for line in md.splitlines() if line.startswith(("| base |", "| fast |", "| ddpm-cifar10 |"))]
    assert len(cells) == 4 and not any("other call" in line for line in cells)
    assert "| 2.00x |" in md and "| 3.00x |" in md
    apart = [_part(tmp_path, "b", "bbb", ["base"], [_sampling("eager", 4.0)]),
             _part(tmp_path, "c", "bbb", ["fast"], [_sampling("compiled", 12.0)])]
    assert merge.main([str(out), *map(str, apart)]) == 0
    got = json.loads(out.read_text())
    assert [(r["metrics"]["speedup"], r["metrics"].get("speedup_cross_call")) for r in got["rows"]] == [
        (1.0, None), (None, 2.0)]
    md = out.with_suffix(".md").read_text()
    assert "| 2.00x (other call) |" in md and "| 3.00x (other call) |" in md


def test_different_cards_datasets_or_twice_measured_rows_are_refused(tmp_path, capsys):
    a = _part(tmp_path, "a", "aaa", ["base"])
    out = tmp_path / "m.json"
    h200 = _part(tmp_path, "h200", "bbb", ["fast"], device="NVIDIA H200")
    assert merge.main([str(out), str(a), str(h200)]) == 2
    assert "different cards (a.json: NVIDIA H100 80GB HBM3, h200.json: NVIDIA H200)" in capsys.readouterr().err

    cifar = json.loads(_part(tmp_path, "cifar", "bbb", ["fast"]).read_text())
    cifar["dataset"] = {**cifar["dataset"], "source": "cifar10", "synthetic": False}
    (tmp_path / "cifar.json").write_text(json.dumps(cifar))
    assert merge.main([str(out), str(a), str(tmp_path / "cifar.json")]) == 2
    assert "different datasets" in capsys.readouterr().err

    again = _part(tmp_path, "again", "bbb", ["base"])
    assert merge.main([str(out), str(a), str(again)]) == 2
    assert "'annotated-small / base' was measured in a.json and in again.json" in capsys.readouterr().err
    assert not out.exists()
    assert merge.main([str(out), str(a), str(again), "--prefer-later"]) == 0
    assert json.loads(out.read_text())["rows"][0]["source"]["commit"] == "bbb"


def test_a_file_that_is_not_a_result_is_one_line(tmp_path, capsys):
    bad = tmp_path / "x.json"
    bad.write_text("[]")
    assert merge.main([str(tmp_path / "m.json"), str(bad)]) == 2
    assert capsys.readouterr().err.strip() == f"merge: error: {bad} is not a benchmarks.speed.bench result (no 'rows'/'environment')"
    assert merge.main([str(tmp_path / "m.md"), str(bad)]) == 2
    assert "must end in .json" in capsys.readouterr().err


def test_a_cut_call_finished_by_a_later_call_is_one_complete_table(tmp_path):
    # Call 1 planned "base", "oom", "fast" and was cut after "base"; call 2 ran the other two.
    g = "annotated-small"
    a = _part(tmp_path, "a", "aaa", ["base"], complete=False)
    cut = json.loads(a.read_text())
    cut["planned"] = [[g, "base"], [g, "oom"], [g, "fast"]]
    a.write_text(json.dumps(cut))
    b = _part(tmp_path, "b", "bbb", ["fast"])
    rest = json.loads(b.read_text())
    rest["rows"] = [{**rest["rows"][0], "name": "oom"}, rest["rows"][0]]
    rest["planned"] = [[g, "oom"], [g, "fast"]]
    b.write_text(json.dumps(rest))
    out = tmp_path / "m.json"
    assert merge.main([str(out), str(a), str(b)]) == 0
    got = json.loads(out.read_text())
    assert got["complete"] and got["planned"] == [[g, "base"], [g, "oom"], [g, "fast"]]  # every part's plan, once
    assert "INCOMPLETE" not in out.with_suffix(".md").read_text()
    # Without the second call, or with its "oom" row failed, the table is not complete.
    assert merge.main([str(out), str(a)]) == 0 and not json.loads(out.read_text())["complete"]
    assert "; not measured: oom; fast" in out.with_suffix(".md").read_text()  # the rows still to measure, named
    rest["rows"][0]["status"] = "failed"
    b.write_text(json.dumps(rest))
    assert merge.main([str(out), str(a), str(b)]) == 0 and not json.loads(out.read_text())["complete"]
    assert "; not measured: oom" in out.with_suffix(".md").read_text()
    # Row names repeat across presets (the loaders-e2e table): with two presets planned, each missing row names its own.
    cut["planned"].append(["ddpm-cifar10", "base"])
    a.write_text(json.dumps(cut))
    assert merge.main([str(out), str(a), str(b)]) == 0
    assert "; not measured: annotated-small: oom; ddpm-cifar10: base" in out.with_suffix(".md").read_text()


def test_rows_from_later_calls_go_in_their_table_place(tmp_path):
    # Call 1 measured the small table's rows 1 and 3; call 2 its row 2 and a row with extra overrides, which the
    # table does not name: the merged table reads 1, 2, 3, then the extra row.
    from benchmarks.speed.rows import TABLES
    names = [row.name for row in TABLES["small"](())][:3]
    a, b = (json.loads(_part(tmp_path, n, n, ["base"]).read_text()) for n in ("a", "b"))
    base = a["rows"][0]
    a["rows"] = [{**base, "name": names[0]}, {**base, "name": names[2]}]
    b["rows"] = [{**base, "name": names[1] + " [train.cudnn_benchmark=True]"}, {**base, "name": names[1]}]
    for name, result in (("a", a), ("b", b)):
        result["table"] = "small"
        (tmp_path / f"{name}.json").write_text(json.dumps(result))
    out = tmp_path / "m.json"
    assert merge.main([str(out), str(tmp_path / "a.json"), str(tmp_path / "b.json")]) == 0
    assert [r["name"] for r in json.loads(out.read_text())["rows"]] == [*names, names[1] + " [train.cudnn_benchmark=True]"]


def test_a_row_renamed_since_its_call_keeps_the_place_its_plan_gave_it(tmp_path):
    # The reformulations row was renamed at af0278d: a part of an older commit planned "renamed" between the table's
    # rows 1 and 3 (here its first row, anchored on the row after it), another "late" after row 3; a later part
    # measured row 2. Merged: 1, 2, renamed, 3, late - not the renamed rows at the end.
    from benchmarks.speed.rows import TABLES
    g = "annotated-small"
    names = [row.name for row in TABLES["small"](())][:3]
    a, b, c = (json.loads(_part(tmp_path, n, n, ["base"]).read_text()) for n in ("a", "b", "c"))
    base = a["rows"][0]
    a["rows"] = [{**base, "name": names[0]}]
    a["planned"] = [[g, names[0]]]
    b["rows"] = [{**base, "name": n} for n in ("renamed", names[2], "late")]
    b["planned"] = [[g, "renamed"], [g, names[2]], [g, "late"]]
    c["rows"] = [{**base, "name": names[1]}]
    c["planned"] = [[g, names[1]]]
    for name, result in (("a", a), ("b", b), ("c", c)):
        result["table"] = "small"
        (tmp_path / f"{name}.json").write_text(json.dumps(result))
    out = tmp_path / "m.json"
    assert merge.main([str(out), *(str(tmp_path / f"{n}.json") for n in "abc")]) == 0
    got = json.loads(out.read_text())
    assert [r["name"] for r in got["rows"]] == [names[0], names[1], "renamed", names[2], "late"]
    assert got["complete"]
