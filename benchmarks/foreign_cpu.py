"""CPU that processes outside a benchmark run use while it measures, and waiting for a quiet machine
(benchmarks/compare.py, benchmarks/backends.py)."""

import os
import threading
import time
from pathlib import Path


class ForeignCpu:
    """CPU used by processes outside this run (other users of the machine) while a phase runs, in cores:
    the machine's busy time (/proc/stat) minus the CPU time of this process and every descendant seen. A
    thread samples the descendants every second, so those that end (and may be reaped by init, as vLLM's
    workers are) keep their last-seen time."""

    def __init__(self) -> None:
        self.ticks = os.sysconf("SC_CLK_TCK")
        self._seen: dict[tuple[int, str], int] = {}  # (pid, start time) -> utime + stime
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._reset()
        threading.Thread(target=self._watch, daemon=True).start()

    @staticmethod
    def _busy_ticks() -> int:
        fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        return sum(fields) - fields[3] - fields[4]  # all but idle and iowait

    def _scan(self) -> None:
        children: dict[int, list[int]] = {}
        stats: dict[int, list[str]] = {}
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            stats[int(entry.name)] = fields
            children.setdefault(int(fields[1]), []).append(int(entry.name))
        todo = [os.getpid()]
        with self._lock:
            while todo:
                pid = todo.pop()
                if pid in stats:
                    fields = stats[pid]
                    self._seen[(pid, fields[19])] = int(fields[11]) + int(fields[12])  # utime + stime
                todo.extend(children.get(pid, []))

    def _tree_ticks(self) -> int:
        self._scan()
        with self._lock:
            return sum(self._seen.values())

    def _watch(self) -> None:
        while not self._stop.wait(1.0):
            self._scan()

    def _reset(self) -> None:
        self._start = (time.monotonic(), self._busy_ticks(), self._tree_ticks())

    def cores(self) -> float:
        """Mean foreign cores since the last call (or creation)."""
        now = (time.monotonic(), self._busy_ticks(), self._tree_ticks())
        seconds = now[0] - self._start[0]
        foreign = (now[1] - self._start[1]) - (now[2] - self._start[2])
        self._start = now
        return max(0.0, foreign / self.ticks / seconds) if seconds > 0 else 0.0

    def close(self) -> None:
        self._stop.set()


QUIET_LIMIT_S = [1800.0]  # --quiet-limit


def wait_quiet(limit_s: float | None = None, threshold: float = 0.15) -> float:
    """Wait (at most limit_s) until other processes use under `threshold` cores over 10 s."""
    limit_s = QUIET_LIMIT_S[0] if limit_s is None else limit_s
    monitor, waited = ForeignCpu(), 0.0
    while True:
        time.sleep(10)
        waited += 10
        cores = monitor.cores()
        if cores < threshold or waited >= limit_s:
            monitor.close()
            if waited > 10:
                print(f"waited {waited:.0f} s for a quiet machine (other processes: {cores:.2f} cores)")
            return cores
