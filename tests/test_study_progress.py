"""The whole study's progress line: how much of a study is done and about how long is left, on every line."""

from __future__ import annotations

from pathlib import Path

import pytest

from pmakit.config import load
from pmakit.lab import context, pma
from pmakit.lab.context import StudyProgress
from pmakit.train import loop


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """``time.monotonic`` as the test sets it."""
    now = [0.0]
    monkeypatch.setattr(context.time, "monotonic", lambda: now[0])
    return now


def test_time_left_is_the_work_left_at_the_rate_worked_so_far(clock: list[float]) -> None:
    meter = StudyProgress({"train": 600, "evaluate": 400, "nothing": 0})
    assert meter.note() == "study 0% done"  # no rate before any work
    clock[0] = 60.0
    assert meter.at("train", 300) == "study 30% done, about 2 min left"  # 700 units at 5 a second: 140 s
    clock[0] = 120.0
    meter.at("train", 600)
    meter.end("train")
    # the evaluation turns out smaller than estimated: its exact size replaces the estimate when it starts
    meter.resize("evaluate", 150)
    assert meter.note() == "study 80% done, about 30 s left"
    clock[0] = 1200.0
    assert meter.at("evaluate", 75) == "study 90% done, about 2 min left"
    meter.end("evaluate")  # the stage's whole size counts as done when it ends
    assert meter.note().startswith("study 100% done, about 0 s left")


def test_a_resumed_stage_counts_neither_as_work_nor_as_time(clock: list[float]) -> None:
    meter = StudyProgress({"train": 1000, "evaluate": 1000})
    meter.resize("train", 0)  # trained by an earlier invocation
    clock[0] = 10.0
    assert meter.at("evaluate", 500) == "study 50% done, about 10 s left"
    assert meter.at("train", 50) == "study 50% done, about 10 s left"  # no work left there to count


def test_the_study_note_ends_the_training_and_evaluation_lines(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(loop._Progress, "every_s", 0.0)
    bar = loop._Progress(0, 1000, enabled=True, label="main", note=lambda n: f"study {n // 10}% done")
    bar.update(250, 5.5)
    assert capsys.readouterr().err.rstrip().endswith("s left; study 25% done")
    monkeypatch.setattr(pma._bar, "every_s", 0.0)
    with pma._bar(3, True, "evaluating (selection split)") as advance:
        advance("study 40% done, about 2 min left")
    assert (
        capsys.readouterr().err
        == "evaluating (selection split): 1/3 models; study 40% done, about 2 min left\n"
    )


def test_the_demo_estimate_adds_up_its_stages() -> None:
    """The demo's stages as ``pmakit experiment`` estimates them before it starts, next to what an idle 2-core
    machine took (docs/benchmarks.md, 2026-11-29: train 196 s, anneal 79 s, evaluations 159 s, plane 20 s,
    downstream 88 s at 12.3K trained tokens/s): each within a factor of two, the whole within a quarter."""
    study = pma.resolve(load(None, "demo", "demo"))
    work = pma._work(study, 0, Path("/nonexistent"))
    seconds = {"train": 196, "anneal": 79, "evaluate": 159, "plane": 20, "downstream": 88}
    rate = 12_300
    work["evaluate"] = work.pop("selection") + work.pop("test")
    for stage, took in seconds.items():
        assert 0.5 < work[stage] / rate / took < 2, (stage, work[stage] / rate, took)
    total = sum(work.values()) / rate
    assert 0.75 < total / sum(seconds.values()) < 1.25, total
