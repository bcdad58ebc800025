"""Writes docs/grafana/vllm-neuron.json: vLLM's latency and throughput panels beside the plugin's series.

    python docs/grafana/build_dashboard.py     (tests/unit/test_dashboard.py checks the file is up to date)

Import the JSON in Grafana (Dashboards > New > Import) and pick the Prometheus data source that scrapes
the server's /metrics.
"""

import json
from pathlib import Path

OUT = Path(__file__).with_name("vllm-neuron.json")
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}

# (title, unit, [(PromQL, legend)]); rows of three panels, vLLM's first.
VLLM_PANELS = [
    ("Output tokens/s", "short", [("sum(rate(vllm:generation_tokens_total[1m]))", "generated")]),
    (
        "Requests/s",
        "reqps",
        [("sum(rate(vllm:request_success_total[1m])) by (finished_reason)", "{{finished_reason}}")],
    ),
    (
        "Requests running / waiting",
        "short",
        [("sum(vllm:num_requests_running)", "running"), ("sum(vllm:num_requests_waiting)", "waiting")],
    ),
    (
        "Time to first token",
        "s",
        [
            (
                "histogram_quantile(0.5, sum(rate(vllm:time_to_first_token_seconds_bucket[5m])) by (le))",
                "p50",
            ),
            (
                "histogram_quantile(0.99, sum(rate(vllm:time_to_first_token_seconds_bucket[5m])) by (le))",
                "p99",
            ),
        ],
    ),
    (
        "Inter-token latency",
        "s",
        [
            (
                "histogram_quantile(0.5, sum(rate(vllm:inter_token_latency_seconds_bucket[5m])) by (le))",
                "p50",
            ),
            (
                "histogram_quantile(0.99, sum(rate(vllm:inter_token_latency_seconds_bucket[5m])) by (le))",
                "p99",
            ),
        ],
    ),
    (
        "KV cache usage and prefix-cache hit rate",
        "percentunit",
        [
            ("max(vllm:kv_cache_usage_perc)", "KV usage"),
            (
                "sum(rate(vllm:prefix_cache_hits_total[5m])) / "
                "sum(rate(vllm:prefix_cache_queries_total[5m]))",
                "prefix hits",
            ),
        ],
    ),
]
NEURON_PANELS = [
    (
        "Unexpected recompiles (should stay 0)",
        "short",
        [
            ("sum(increase(vllm_neuron:unexpected_recompiles_total[5m]))", "recompiles / 5 min"),
            ("max(vllm_neuron:compiled_graphs)", "compiled graphs"),
            ("max(vllm_neuron:graphs_ready)", "graphs ready"),
            ("max(vllm_neuron:graphs_pending)", "graphs compiling in the background"),
        ],
    ),
    (
        "Padding efficiency (real tokens / computed slots)",
        "percentunit",
        [
            (
                "sum(rate(vllm_neuron:padding_real_tokens_total[5m])) by (phase) / "
                "sum(rate(vllm_neuron:padding_slots_total[5m])) by (phase)",
                "{{phase}}",
            )
        ],
    ),
    (
        "Compiled calls by bucket",
        "ops",
        [("sum(rate(vllm_neuron:bucket_calls_total[1m])) by (phase, bucket)", "{{phase}} {{bucket}}")],
    ),
    (
        "Step time by part (p50, p99)",
        "s",
        [
            (
                "histogram_quantile(0.5, sum(rate(vllm_neuron:step_seconds_bucket[5m])) by (le, part))",
                "{{part}} p50",
            ),
            (
                "histogram_quantile(0.99, sum(rate(vllm_neuron:step_seconds_bucket[5m])) by (le, part))",
                "{{part}} p99",
            ),
        ],
    ),
    (
        "Bytes to host per step (p50, p99)",
        "bytes",
        [
            (
                "histogram_quantile(0.5, sum(rate(vllm_neuron:step_device_to_host_bytes_bucket[5m]))"
                " by (le))",
                "to host p50",
            ),
            (
                "histogram_quantile(0.99, sum(rate(vllm_neuron:step_device_to_host_bytes_bucket[5m]))"
                " by (le))",
                "to host p99",
            ),
        ],
    ),
    (
        "Steps by sampler",
        "ops",
        [("sum(rate(vllm_neuron:sampled_steps_total[1m])) by (sampler)", "{{sampler}}")],
    ),
    (
        "KV blocks",
        "short",
        [("max(vllm_neuron:kv_blocks_used)", "used"), ("max(vllm_neuron:kv_blocks_total)", "total")],
    ),
    (
        "LoRA adapters in device slots",
        "short",
        [("max(vllm_neuron:lora_adapters_loaded)", "loaded")],
    ),
    (
        "Device memory used",
        "bytes",
        [("max(vllm_neuron:device_memory_used_bytes)", "used")],
    ),
    (
        "Server processes: resident memory",
        "bytes",
        [("max(vllm_neuron:process_resident_memory_bytes) by (process)", "{{process}}")],
    ),
    (
        "Server processes: open files and threads",
        "short",
        [
            ("max(vllm_neuron:process_open_fds) by (process)", "fds {{process}}"),
            ("max(vllm_neuron:process_threads) by (process)", "threads {{process}}"),
        ],
    ),
    (
        "Requests refused (429)",
        "ops",
        [("sum(rate(vllm:admission_rejections_total[1m])) by (reason)", "{{reason}}")],
    ),
    (
        "Warm-up and compile seconds",
        "s",
        [
            ("max(vllm_neuron:warmup_seconds) by (phase)", "warm-up {{phase}}"),
            ("sum(vllm_neuron:compile_seconds_total) by (phase)", "compile {{phase}}"),
        ],
    ),
]


def panel(panel_id: int, spec: tuple, x: int, y: int) -> dict:
    title, unit, queries = spec
    return {
        "id": panel_id,
        "type": "timeseries",
        "title": title,
        "datasource": DATASOURCE,
        "gridPos": {"h": 8, "w": 8, "x": x, "y": y},
        "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
        "targets": [
            {"refId": chr(ord("A") + n), "datasource": DATASOURCE, "expr": expr, "legendFormat": legend}
            for n, (expr, legend) in enumerate(queries)
        ],
    }


def dashboard() -> dict:
    panels, y = [], 0
    for title, specs in (
        ("vLLM: latency and throughput", VLLM_PANELS),
        ("Neuron plugin: shapes, steps, memory", NEURON_PANELS),
    ):
        panels.append(
            {
                "id": 100 + len(panels),
                "type": "row",
                "title": title,
                "collapsed": False,
                "gridPos": {"h": 1, "w": 24, "x": 0, "y": y},
            }
        )
        y += 1
        for index, spec in enumerate(specs):
            panels.append(panel(len(panels) + 1, spec, x=8 * (index % 3), y=y + 8 * (index // 3)))
        y += 8 * -(-len(specs) // 3)
    return {
        "title": "vLLM on Trainium (vllm-torchneuron)",
        "uid": "vllm-neuron",
        "schemaVersion": 39,
        "version": 1,
        "editable": True,
        "time": {"from": "now-1h", "to": "now"},
        "refresh": "30s",
        "tags": ["vllm", "neuron", "trainium"],
        "templating": {
            "list": [
                {"name": "datasource", "type": "datasource", "query": "prometheus", "label": "Prometheus"}
            ]
        },
        "panels": panels,
    }


if __name__ == "__main__":
    OUT.write_text(json.dumps(dashboard(), indent=2) + "\n")
    print(f"wrote {OUT}")
