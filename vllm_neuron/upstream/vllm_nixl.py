"""vLLM 0.32's NIXL connector as worker/kv/nixl.py reaches it: the pull connector it subclasses, and the
switches that stage its KV through host memory. tests/unit/test_upstream.py pins each one; docs/maintaining.md
says what to do when one moves. Imported only where a NIXL connector is created."""

import functools
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.nixl import NixlPullConnector, base_worker

CopyBlocks = Callable[[dict[str, torch.Tensor], dict[str, torch.Tensor], list[int], list[int], str], None]

__all__ = [
    "CopyBlocks",
    "NixlPullConnector",
    "agent_progress_thread",
    "set_copy_operation",
    "stage_through_host_buffer",
]


def stage_through_host_buffer(connector: NixlPullConnector) -> None:
    """The connector's scheduler side (which lists the blocks each step must save) and worker side (which
    registers host buffers with NIXL and copies blocks in and out of them) both stage KV through host memory.
    vLLM 0.32 sets `use_host_buffer` in each side's __init__, from the platform's device type: never for
    'cpu', where it registers the caches themselves."""
    for side in (connector.connector_scheduler, connector.connector_worker):
        if side is not None:
            side.use_host_buffer = True


@contextmanager
def agent_progress_thread(enabled: bool) -> Iterator[None]:
    """Whether the NIXL agent a connector's worker side creates inside runs nixl's progress thread. vLLM 0.32
    builds the agent's config in NixlBaseConnectorWorker.__init__ from base_worker's `nixl_agent_config`,
    whose progress thread nixl's Python API turns on."""
    make_config = base_worker.nixl_agent_config
    if enabled or make_config is None:  # vLLM's own agent; without NIXL, vLLM raises its own error
        yield
        return
    base_worker.nixl_agent_config = functools.partial(make_config, enable_prog_thread=False)
    try:
        yield
    finally:
        base_worker.nixl_agent_config = make_config


def set_copy_operation(connector: NixlPullConnector, copy_operation: CopyBlocks) -> None:
    """The worker side's block copy (vLLM 0.32's `copy_blocks`), which its set_host_xfer_buffer_ops ignores
    on a 'cpu' device type."""
    assert connector.connector_worker is not None
    connector.connector_worker.copy_blocks = copy_operation


def check_each_remote(
    connector: NixlPullConnector, refusal: Callable[[int, int, int, int], str | None]
) -> None:
    """Before the worker side accepts a remote server (vLLM 0.32's _validate_remote_agent_handshake, run once
    per remote engine), `refusal(local_tp, remote_tp, local_block_size, remote_block_size)` may refuse it:
    its message is raised, and vLLM fails that handshake's transfers (the requests compute their prompts)."""
    worker = connector.connector_worker
    if worker is None:
        return
    validate = worker._validate_remote_agent_handshake

    @functools.wraps(validate)
    def refusing(nixl_agent_meta, remote_tp_size: int, *args, **kwargs):
        message = refusal(
            worker.transfer_topo.tp_size, remote_tp_size, worker.block_size, nixl_agent_meta.block_size
        )
        if message is not None:
            raise RuntimeError(message)
        return validate(nixl_agent_meta, remote_tp_size, *args, **kwargs)

    worker._validate_remote_agent_handshake = refusing
