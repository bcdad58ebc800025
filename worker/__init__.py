"""The worker vLLM's engine talks to, and the model runner that executes one scheduler step at a time."""
