"""vLLM's NixlConnector (prefill/decode disaggregation over NIXL: UCX, or libfabric over EFA) on the plugin's
KV caches, staged through host memory in both modes.

NIXL moves each KV block as one contiguous page. The plugin's caches are head-major (a block is 2 * kv_heads
runs, kv_cache/layout.py), so NIXL never registers them: vLLM's host-buffer path gives each layer a contiguous
host copy of its block-major view ([blocks, 2 * kv_heads, block_size, head_size]), which NIXL registers and
reads remotely. After a step's compiled calls, the blocks that step wrote for a request a decode server will
read are copied to it (wait_for_save); once a transfer lands, its blocks are copied into the cache: both by
compiled graphs of fixed shape (worker/kv/nixl_blocks.py), set as the copy operation. On Trainium that is
vLLM's own rule for a device NIXL cannot register (kv_buffer_device "cpu"); vLLM skips it on a 'cpu' device
type, so CPU mode switches it on, to run the path Trainium runs. Both servers must share the page's layout:
the same tensor-parallel size and block size (page_layout_mismatch, docs/disaggregation.md)."""

from typing import TYPE_CHECKING

from vllm_neuron import refusals
from vllm_neuron.upstream import vllm_nixl

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.v1.kv_cache_interface import KVCacheConfig


class HostStagedNixlConnector(vllm_nixl.NixlPullConnector):
    """vLLM's pull (READ) NixlConnector, its KV staged through host buffers in CPU mode as on Trainium."""

    def __init__(
        self, vllm_config: "VllmConfig", role: "KVConnectorRole", kv_cache_config: "KVCacheConfig"
    ) -> None:
        # kv_connector_extra_config's progress_thread (vLLM's default: on) turns off nixl's progress thread,
        # which polls with no delay: a host CPU per rank, busy even when idle. On a small host the ranks'
        # threads starve the engines; without them NIXL progresses when vLLM polls it, every step of both
        # servers while a transfer is pending (docs/disaggregation.md).
        progress_thread = vllm_config.kv_transfer_config.get_from_extra_config(
            refusals.NIXL_PROGRESS_THREAD, True
        )
        with vllm_nixl.agent_progress_thread(progress_thread):
            super().__init__(vllm_config, role, kv_cache_config)
        vllm_nixl.stage_through_host_buffer(self)
        vllm_nixl.check_each_remote(self, page_layout_mismatch)

    def set_host_xfer_buffer_ops(self, copy_operation: vllm_nixl.CopyBlocks) -> None:
        vllm_nixl.set_copy_operation(self, copy_operation)


def page_layout_mismatch(
    local_tp: int, remote_tp: int, local_block_size: int, remote_block_size: int
) -> str | None:
    """Why a remote server's pages cannot be read as this one's, if they cannot. vLLM splits or merges pages
    by heads for servers of different tensor-parallel sizes, and by tokens for different block sizes, taking
    a page's heads as [kv_heads, ..., keys and values]: the plugin's page puts every head's keys before any
    head's values ([2 * kv_heads, block_size, head_size]), so only whole pages of the same shape move."""
    if (local_tp, local_block_size) == (remote_tp, remote_block_size):
        return None
    return (
        f"Neuron plugin: NIXL peer with tensor-parallel size {remote_tp} and block size {remote_block_size} "
        f"refused; this server has {local_tp} and {local_block_size}, and the plugin moves KV only between "
        "servers that share both (docs/disaggregation.md)"
    )


# The names --kv-transfer-config gives the pull connector: vLLM's factory looks the connector's name up in
# kv_connector_module_path, which the platform points here (vllm_neuron/platform.py).
NixlConnector = NixlPullConnector = HostStagedNixlConnector
