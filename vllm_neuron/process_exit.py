"""A process vLLM started (the engine core, a worker) exits without the interpreter's last cycle collections.

vLLM stops an engine process with SIGTERM and kills it 5 s later (vllm/v1/utils.py: `shutdown`, its default
timeout). The engine's own shutdown already ran a full collection (vllm/distributed/parallel_state.py:
`cleanup_dist_env_and_memory`); a spawned process then ends in `sys.exit`, and the interpreter's finalization
collects the whole heap again (torch, vLLM, dynamo's graphs: some 800,000 objects). On our CPU host that took
3 of the 4 s from SIGTERM to exit, and a loaded host went past the 5 s. Freezing the objects at exit
(`gc.freeze`: collections skip them) leaves that memory to the operating system, which reclaims a process's
memory when it ends; vLLM's engine does the same on ROCm after a clean shutdown (vllm/v1/engine/core.py:
`run_engine_core`). The process that started vLLM (a server, a user's script) is left as it is. An extension
built with nanobind (triton's, where it is installed) reports the objects it still had at exit as "leaked":
they are the frozen ones, reclaimed with the process.
"""

import atexit
import gc
import multiprocessing


def _freeze_in_child() -> None:
    # Decided at exit: a spawned process imports the platform while it unpickles its target, before
    # multiprocessing has made it a child (parent_process() is None until then).
    if multiprocessing.parent_process() is not None:
        gc.freeze()


def skip_final_collections_in_child() -> None:
    """Freeze the heap at the exit of a process multiprocessing started (see the module's docstring): called
    as vllm_neuron/platform.py is imported, once in each process that runs the platform."""
    atexit.register(_freeze_in_child)
