"""A `vllm-neuron serve` process for benchmarks: started on 127.0.0.1, waited for, scraped, ended by pid."""

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VLLM_NEURON = str(Path(sys.executable).with_name("vllm-neuron"))


@dataclass
class Config:
    name: str
    model: str
    serve_args: list[str]
    max_model_len: int
    backend: str = "eager"
    env: dict[str, str] = field(default_factory=dict)
    cwd: str | None = None  # the server's working directory (default: this process's)
    cpus: list[int] | None = None  # the CPUs the server's processes may use (default: this process's)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            return response.status, response.read().decode()
    except OSError:
        return 0, ""


def stop_process(process: subprocess.Popen) -> None:
    """SIGTERM (the server drains), then after a minute SIGKILL to its process group."""
    if process.poll() is not None:
        return
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()


class Server:
    """`vllm-neuron serve` in its own process group, ended by pid."""

    def __init__(self, config: Config, cache_root: str, log_path: Path) -> None:
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        # Every graph before the load starts (unless a configuration says otherwise): throughput beside
        # background compiles is benchmarks/cold_start.py's subject.
        env = {
            **os.environ,
            "VLLM_NEURON_CACHE_ROOT": cache_root,
            "VLLM_NEURON_READINESS": "full",
            **config.env,
        }
        env["VLLM_NEURON_COMPILE_BACKEND"] = config.backend
        for name in ("VLLM_ENABLE_V1_MULTIPROCESSING", "TORCHINDUCTOR_CACHE_DIR", "PROMETHEUS_MULTIPROC_DIR"):
            env.pop(name, None)
        self.log_path = log_path
        with open(log_path, "w") as log:
            self.process = subprocess.Popen(
                self.command(config),
                env=env,
                cwd=config.cwd,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=(lambda: os.sched_setaffinity(0, config.cpus)) if config.cpus else None,
            )
        self.started = time.monotonic()

    def command(self, config: Config) -> list[str]:
        """The server's command line (benchmarks/compare.py starts vLLM's own server instead)."""
        command = [VLLM_NEURON, "serve", config.model, "--served-model-name", "m", "--host", "127.0.0.1"]
        return [
            *command,
            "--port",
            str(self.port),
            "--max-model-len",
            str(config.max_model_len),
            *config.serve_args,
        ]

    def wait_healthy(self, limit_s: float = 3600) -> float:
        while time.monotonic() - self.started < limit_s:
            if self.process.poll() is not None:
                raise RuntimeError(f"server exited; see {self.log_path}")
            if get(self.base + "/health")[0] == 200:
                return time.monotonic() - self.started
            time.sleep(0.5)
        raise TimeoutError(f"not healthy after {limit_s} s; see {self.log_path}")

    def metrics(self) -> dict[str, float]:
        values: dict[str, float] = {}
        for line in get(self.base + "/metrics")[1].splitlines():
            if line.startswith("vllm_neuron:"):
                name, _, value = line.rpartition(" ")
                values[name] = float(value)
        return values

    def stop(self) -> None:
        stop_process(self.process)
