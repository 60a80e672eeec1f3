"""Progress events: the tracker's counting, the plain-line throttle, the default logger, and
the events profiling, the bench and verify send."""

from __future__ import annotations

import itertools
import logging

import pytest
import torch

from actplan.cli import main
from actplan.models import load_model
from actplan.planning.profile import profile_model
from actplan.progress import PlainLines, ProgressEvent, ProgressTracker


def test_an_event_reads_as_stage_count_share_and_time_left():
    event = ProgressEvent("profiling: Block: greedy 3/8", done=5, total=20, elapsed_s=10.0)
    assert event.fraction == 0.25 and event.eta_s == 30.0
    assert str(event) == "profiling: Block: greedy 3/8 [5/20, 25%, 10.0 s, about 30 s left]"
    assert ProgressEvent("x", 0, 4, 0.5).eta_s is None
    assert "left" not in str(ProgressEvent("done", 4, 4, 2.0))


def test_the_tracker_counts_grows_its_total_and_never_reports_past_it():
    events: list[ProgressEvent] = []
    tracker = ProgressTracker(events.append, total=2, prefix="job: ")
    tracker.step("a")
    tracker.expect(2)
    tracker.step("b", units=2)
    tracker.step("c", units=3)  # more than expected: the total follows
    assert [(e.stage, e.done, e.total) for e in events] == [
        ("job: a", 1, 2), ("job: b", 3, 4), ("job: c", 6, 6)
    ]
    assert all(later.elapsed_s >= earlier.elapsed_s for earlier, later in itertools.pairwise(events))
    with pytest.raises(ValueError, match="negative"):
        ProgressTracker(None, total=-1)


def test_without_a_callback_events_go_to_the_actplan_logger(caplog):
    with caplog.at_level(logging.INFO, logger="actplan"):
        ProgressTracker(None, total=1, prefix="verify: ").step("step 1/1")
    assert [r.name for r in caplog.records] == ["actplan"]
    assert caplog.records[0].getMessage().startswith("verify: step 1/1 [1/1, 100%")


def test_plain_lines_are_few_the_first_every_tenth_and_the_last():
    lines: list[str] = []
    plain = PlainLines(lines.append, share=0.1, seconds=1e9)
    for done in range(1, 101):
        plain(ProgressEvent(f"s{done}", done, 100, done * 0.01))
    assert len(lines) == 11
    assert lines[0].startswith("s1 ") and lines[-1].startswith("s100 ")
    # A slow stretch writes a line even when the share has not moved.
    lines.clear()
    slow = PlainLines(lines.append, share=0.5, seconds=5.0)
    for done, at in ((1, 0.0), (2, 1.0), (3, 7.0), (4, 8.0)):
        slow(ProgressEvent("s", done, 100, at))
    assert len(lines) == 2


def test_profiling_sends_events_that_reach_their_total():
    bundle = load_model("moe", "tiny")
    events: list[ProgressEvent] = []
    profile_model(bundle, spec="moe", device=torch.device("cpu"), repeats=3, progress=events.append)
    assert events[-1].done == events[-1].total and events[-1].stage == "profiling: MoEDecoderLayer: offload"
    assert [e.done for e in events] == list(range(1, len(events) + 1))
    # The total is known from the start: it never changes on this model (two layer classes).
    assert {e.total for e in events} == {events[-1].total}
    assert any("greedy" in e.stage for e in events)


def test_the_cli_writes_plain_progress_lines_to_stderr_when_not_a_terminal(capsys):
    assert main(["verify", "--size", "tiny", "--config", "full", "--steps", "2"]) == 0
    captured = capsys.readouterr()
    assert "verify: step 2/2 [2/2, 100%" in captured.err
    assert "verify: step" not in captured.out  # stdout holds only the results
    assert main(["verify", "--size", "tiny", "--config", "full", "--steps", "2", "--quiet"]) == 0
    assert "verify: step" not in capsys.readouterr().err
