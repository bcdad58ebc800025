"""The paged KV cache and attention in plain traceable torch: layout in device memory, the paged attention ops
and their kernel seam, the FP8 formats. The bottom layer: it imports no other package of the plugin and no
vLLM, so that the platform and the worker import it downward (tests/unit/test_module_graph.py)."""
