"""The test suite's own guard against collector pauses (tests/conftest.py, ``settled_heap``): a test that measures
wall-clock time runs with what earlier tests left frozen, so that a full collection of a large worker heap cannot
land inside its measurement; the other tests run on an ordinary heap."""

from __future__ import annotations

import gc
import time


def test_a_test_that_measures_wall_clock_time_runs_on_a_frozen_heap() -> None:
    time.perf_counter()  # what makes this a timed test (its source measures wall-clock time)
    assert gc.get_freeze_count() > 1000  # at least the imports' objects


def test_a_test_that_does_not_runs_on_an_ordinary_heap() -> None:
    assert gc.get_freeze_count() == 0
