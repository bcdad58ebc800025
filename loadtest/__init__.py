"""Load generator for OpenAI-compatible endpoints (`vllm-neuron loadtest`, `python -m loadtest`).

Modules, one job each: `workload` (what to send and when), `client` (one streamed request, timed),
`runner` (concurrency or Poisson arrivals, warm-up, bounds), `stats` (percentiles, ITL, throughput),
`metrics` (the server's /metrics before, during and after a run), `report` (table, JSON, plots), `cli`.
"""
