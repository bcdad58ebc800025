"""Multi-LoRA on static shapes: adapters in fixed slots, chosen per token by a call input."""
