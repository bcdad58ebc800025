"""A process multiprocessing started freezes its heap at exit (vllm_neuron/process_exit.py); the process that
started it is left as it is."""

import atexit
import gc
import multiprocessing
from pathlib import Path

import pytest

from vllm_neuron import process_exit


def _child(report: str) -> None:
    # Registered before the freeze, so run after it (atexit runs its handlers last in, first out).
    atexit.register(lambda: Path(report).write_text(str(gc.get_freeze_count())))
    process_exit.skip_final_collections_in_child()


def test_a_spawned_process_exits_with_its_heap_frozen(tmp_path):
    report = tmp_path / "frozen"
    child = multiprocessing.get_context("spawn").Process(target=_child, args=(str(report),))
    child.start()
    child.join(timeout=120)
    assert child.exitcode == 0
    assert int(report.read_text()) > 0


def test_the_starting_process_is_left_as_it_is():
    if multiprocessing.parent_process() is not None:
        pytest.skip("this test process was itself started by multiprocessing")
    before = gc.get_freeze_count()
    process_exit._freeze_in_child()
    assert gc.get_freeze_count() == before
