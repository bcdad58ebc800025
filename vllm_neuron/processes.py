"""Ending processes this one started: SIGTERM, then SIGKILL to those still there after a grace period
(the server's engine processes at a stopped start-up, server/launch.py; compiler processes at an engine's
shutdown, vllm_neuron/compiler/compile_pool.py)."""

import contextlib

import psutil


def end_processes(processes: list[psutil.Process], grace_seconds: float) -> None:
    for process in processes:
        with contextlib.suppress(psutil.NoSuchProcess):
            process.terminate()
    _, alive = psutil.wait_procs(processes, timeout=grace_seconds)
    for process in alive:
        with contextlib.suppress(psutil.NoSuchProcess):
            process.kill()
