"""The performance guard (benchmarks/perf_guard.py, `make bench-check`): its comparison rule, and that a slowdown
planted in one kernel path (CANN_ATTN_TEST_PLANTED_DELAY, read only by the dense forward) is caught while a case
outside that path is not flagged. Tiny shapes: a few seconds."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "perf_guard.py"
_spec = importlib.util.spec_from_file_location("_perf_guard_under_test", SCRIPT)
perf_guard = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = perf_guard
_spec.loader.exec_module(perf_guard)


def test_compare_flags_only_drops_beyond_the_margin():
    rows = perf_guard.compare({"a": 1.0, "b": 2.0, "c": 1.0}, {"a": 0.86, "b": 1.6, "d": 3.0}, margin=0.15)
    verdicts = {r["case"]: r["verdict"] for r in rows}
    assert verdicts == {"a": "ok", "b": "fail", "d": "new"}  # c not measured: not judged


def test_a_case_margin_widens_only_its_own_case():
    rows = perf_guard.compare({"a": 1.0, "noisy": 1.0}, {"a": 0.8, "noisy": 0.8}, margin=0.12,
                              case_margins={"noisy": 0.25})
    assert {r["case"]: (r["verdict"], r["margin"]) for r in rows} == {"a": ("fail", 0.12), "noisy": ("ok", 0.25)}
    assert perf_guard.compare({"noisy": 1.0}, {"noisy": 0.7}, 0.12, {"noisy": 0.25})[0]["verdict"] == "fail"
    assert all(name in perf_guard.__doc__ for name in perf_guard.CASE_MARGINS)  # names of real cases


def test_planted_slowdown_is_caught(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys):
    baseline, out = tmp_path / "baseline.json", tmp_path / "out"
    cases = ["--only", "fa_forward.dense", "sfa.forward_bs1", "--config", "tiny", "--repeats", "3"]
    args = [*cases, "--baseline", str(baseline), "--out", str(out)]
    assert perf_guard.main([*args, "--update-baseline"]) == 0
    assert set(json.loads(baseline.read_text())["ratios"]) == {"fa_forward.dense", "sfa.forward_bs1"}

    # 20 ms of CPU time per dense forward call, against a tiny call of ~1 ms: the ratio falls ~20x. The margin of
    # 0.5 is far beyond the timing noise of the tiny shapes, so only the planted delay can fail a case.
    monkeypatch.setenv("CANN_ATTN_TEST_PLANTED_DELAY", "0.02")
    assert perf_guard.main([*args, "--margin", "0.5"]) == 1
    report = json.loads((out / "bench_check_cpu.json").read_text())
    verdicts = {r["case"]: r["verdict"] for r in report["rows"]}
    assert verdicts == {"fa_forward.dense": "fail", "sfa.forward_bs1": "ok"}
    assert "bench-check FAILED" in capsys.readouterr().out


def test_partial_update_keeps_the_other_cases_and_their_machine(tmp_path: Path):
    """`--update-baseline --only CASE` replaces that case's ratio, records the machine and commit it was measured on
    under case_machines, and leaves the other cases' ratios, machine and commit as they were."""
    baseline = tmp_path / "baseline.json"
    tiny = ["--config", "tiny", "--repeats", "3", "--rounds", "1", "--baseline", str(baseline), "--out",
            str(tmp_path / "out")]
    assert perf_guard.main([*tiny, "--update-baseline", "--only", "fa_forward.dense"]) == 0
    first = json.loads(baseline.read_text())
    first["machine"]["cpu"], first["commit"] = "an earlier machine", "0000000"
    baseline.write_text(json.dumps(first))
    assert perf_guard.main([*tiny, "--update-baseline", "--only", "sfa.forward_bs1"]) == 0
    second = json.loads(baseline.read_text())
    assert second["ratios"]["fa_forward.dense"] == first["ratios"]["fa_forward.dense"]
    assert set(second["ratios"]) == {"fa_forward.dense", "sfa.forward_bs1"}
    assert (second["machine"]["cpu"], second["commit"]) == ("an earlier machine", "0000000")
    assert set(second["case_machines"]) == {"sfa.forward_bs1"}
    assert second["case_machines"]["sfa.forward_bs1"]["machine"]["cpu"] != "an earlier machine"


def test_margins_benchmark_takes_the_lowest_case_median_and_keeps_every_round(tmp_path: Path,
                                                                              monkeypatch: pytest.MonkeyPatch):
    """benchmarks/bench_margins.py: every case measured in each round (kept in the JSON), a case's ratio the median of
    its rounds, a figure's the lowest of its cases'; --strict fails on a figure below its goal (a planted 20 ms per
    forward call against calls of about 1 ms at the tiny shapes)."""
    spec = importlib.util.spec_from_file_location("_bench_margins_under_test", SCRIPT.with_name("bench_margins.py"))
    margins = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = margins
    spec.loader.exec_module(margins)
    args = ["--config", "tiny", "--repeats", "1", "--rounds", "3", "--out", str(tmp_path)]
    assert margins.main(args) == 0
    report = json.loads((tmp_path / "margins_cpu.json").read_text())
    assert (tmp_path / "margins_cpu.png").is_file()
    cases = report["cases"]
    assert set(cases) == {name for f in margins.FIGURES for name in f.cases}
    for case in cases.values():
        rounds = sorted(r["ratio"] for r in case["rounds"])
        assert len(rounds) == 3 and case["ratio"] == rounds[1]
        assert (case["ratio_min"], case["ratio_max"]) == (rounds[0], rounds[2])
    for figure in report["figures"]:
        assert figure["ratio"] == min(cases[name]["ratio"] for name in figure["cases"])
        assert figure["passed"] == (figure["ratio"] >= figure["goal"])
    monkeypatch.setenv("CANN_ATTN_TEST_PLANTED_DELAY", "0.02")
    assert margins.main([*args, "--rounds", "1", "--strict"]) == 1
    forward = next(f for f in json.loads((tmp_path / "margins_cpu.json").read_text())["figures"]
                   if f["figure"] == "forward")
    assert not forward["passed"]
