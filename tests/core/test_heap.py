"""Freezing a serving process's start-up heap (contract/heap.py)."""

import gc

from contract.heap import freeze_startup_heap


def test_objects_alive_at_start_up_leave_the_collected_generations_and_later_ones_do_not():
    at_start_up = [[]]
    try:
        assert freeze_startup_heap() > 0
        later = [[]]
        collected = {id(obj) for obj in gc.get_objects()}  # the three generations a collection walks
        assert id(at_start_up) not in collected and id(later) in collected
    finally:
        gc.unfreeze()  # the rest of the suite runs with the collector as it was
