"""Multi-LoRA on static shapes (issue 39): adapters in fixed slots, chosen per token by a call input."""
