"""Tests that serve: engines, servers and the processes around them, compared with HF, the fake TorchNeuron's
rules and each other."""
