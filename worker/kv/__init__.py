"""The KV cache on the device, its transfer to and from other servers (KV connectors, NIXL's block copies)
and sleep mode."""
