"""The flow-run timeline: moments on the wall clock, per flow run, nested runs each their own."""

from __future__ import annotations

import time

from prefect_ml.integrations import services
from prefect_ml.tasks.report import timeline_markdown


def test_moments_go_to_every_recording_flow_run_in_time_order_and_none_outside() -> None:
    now = time.time()
    services.mark("before any flow run")  # recorded nowhere
    with services.recording("outer started") as outer:
        services.mark("data ready", at=now + 10)
        with services.recording("inner started") as inner:
            services.mark("worker ready", at=now + 5)  # another process's moment, stamped there
        services.mark("outer ends", at=now + 20)

    assert [m.name for m in inner.moments] == ["inner started", "worker ready"]
    rows = outer.rows()
    names = [name for name, _at, _took in rows]
    assert names == ["outer started", "inner started", "worker ready", "data ready", "outer ends"]
    assert rows[0][1] == rows[0][2] > 0, "the first moment counts from the process's start"
    assert [round(took, 6) for _n, _at, took in rows[3:]] == [5.0, 10.0]
    assert rows[-1][1] - rows[0][1] > 19.9


def test_the_artifact_is_a_table_with_a_bar_for_each_step_that_took_time() -> None:
    recorded = services.Timeline(process_started=100.0)
    recorded.moments += [services.Moment("started", 110.0), services.Moment("done", 110.01)]

    markdown = timeline_markdown(recorded, "train-model")

    assert "# Timeline of train-model" in markdown
    assert "| started | 10.0 | 10.0 | " + "█" * 24 + " |" in markdown
    assert "| done | 10.0 | 0.0 |  |" in markdown


def test_a_commands_start_up_goes_to_its_first_flow_run_only() -> None:
    with services.start_up():
        services.mark("local Ray started")
        with services.recording("first started") as first:
            services.mark("first ends")
        with services.recording("second started") as second:
            pass
    services.mark("after the command")  # recorded nowhere
    with services.recording("later started") as later:
        pass

    assert [m.name for m in first.moments] == ["local Ray started", "first started", "first ends"]
    assert [m.name for m in second.moments] == ["second started"]
    assert [m.name for m in later.moments] == ["later started"]
