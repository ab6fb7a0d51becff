"""higgs_rt.timing: stages on one clock, nested, marks since the previous stage, a final mark that ends the
recording, and nothing at all without a timeline."""

from __future__ import annotations

import io
import time

import pytest

from higgs_rt import timing


@pytest.fixture
def timeline():
    t = timing.start(timing.Timeline(sync=False))
    yield t
    timing.stop()
    timing._active = None


def test_without_a_timeline_nothing_records():
    timing._active = None
    with timing.stage("anything") as s:
        s.detail = "ignored"
    timing.note("ignored")
    timing.mark("first audio", final=True)
    out = io.StringIO()
    timing.report(out)
    assert out.getvalue() == "" and timing.current() is None and not timing.recording()


def test_stages_nest_marks_run_from_the_previous_stage_and_a_final_mark_ends(timeline):
    with timing.stage("load"):
        with timing.stage("weights", "10 GB") as s:
            time.sleep(0.01)
            s.detail += ", staged"
        with timing.stage("tokenizer"):
            timing.note("tokenizer.json")
            timing.mark("inner point")  # the first at its depth inside "tokenizer": from that stage's start
    with timing.stage("prefill"):
        time.sleep(0.01)
    time.sleep(0.02)
    timing.mark("first audio", final=True)
    with timing.stage("second utterance"):  # after the final mark: not recorded
        pass
    timing.mark("first audio")
    names = [(s.name, s.depth) for s in timeline.stages]
    assert names == [("load", 0), ("weights", 1), ("tokenizer", 1), ("inner point", 2), ("prefill", 0),
                     ("first audio", 0)]
    by = {s.name: s for s in timeline.stages}
    assert by["weights"].detail == "10 GB, staged" and by["tokenizer"].detail == "tokenizer.json"
    assert by["weights"].seconds >= 0.01 and by["load"].seconds >= by["weights"].seconds + by["tokenizer"].seconds
    assert by["inner point"].start == pytest.approx(by["tokenizer"].start)  # no earlier sibling: its parent's start
    assert by["first audio"].start == pytest.approx(by["prefill"].end) and by["first audio"].seconds >= 0.02
    assert timeline.final is by["first audio"] and not timeline.recording
    lines = timeline.lines()
    assert lines[0].startswith("higgs-rt: cold start") and lines[2].endswith("    weights   [10 GB, staged]")
    assert lines[-1].startswith("higgs-rt: first audio ") and "import torch" not in lines[-1]
    assert timeline.to_dict()["final"] == "first audio"
    assert timeline.paths() == ["load", "load/weights", "load/tokenizer", "load/tokenizer/inner point", "prefill",
                                "first audio"]


def test_report_counts_from_import_torch_and_stops(timeline):
    with timing.stage("import torch"):
        time.sleep(0.01)
    timing.mark("ready", final=True)
    out = io.StringIO()
    timing.report(out)
    last = out.getvalue().strip().splitlines()[-1]
    assert last.startswith("higgs-rt: ready ") and last.endswith("s after import torch returned")
    assert timeline.to_dict()["import_torch_end_s"] >= 0.01


def test_process_start_is_before_now():
    start = timing.process_start()
    if start is None:
        pytest.skip("no /proc/self/stat here")
    assert 0 < time.perf_counter() - start < 3600
    t = timing.start()
    try:
        assert t.stages[0].name.startswith("start-up") and t.stages[0].start == 0.0 and t.stages[0].seconds > 0
    finally:
        timing.stop()
        timing._active = None
