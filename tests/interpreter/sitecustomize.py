"""Every Python process of the tests (pytest's workers, the scripts and servers they start, the engine cores
vLLM spawns) finds this module on PYTHONPATH (tests/conftest.py puts it there) and runs it at start-up: the
cyclic garbage collector runs far less often. An engine's heap grows with each graph's dynamo and FX objects,
and the automatic collections walk it again and again: one 15-graph engine of the tests took 55.6 s with
Python's thresholds and 49.1 s with these (Intel Xeon, AVX-512 BF16/AMX, 2026-12-07). The processes live for
minutes, so the garbage kept between collections stays small. Served engines keep Python's defaults."""

import gc

THRESHOLDS = (200_000, 100, 1000)
gc.set_threshold(*THRESHOLDS)
