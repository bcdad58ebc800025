"""Tests that start no engine and no vLLM process: the rules, the plans, the math and the pins, in seconds."""
