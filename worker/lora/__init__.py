"""Multi-LoRA: the adapter slots activated each step and how an adapter is written into its slot."""
