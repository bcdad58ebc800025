"""The paged KV cache: layout in device memory, paged attention ops, and vLLM's attention backend for them."""
