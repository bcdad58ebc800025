"""Run `vllm-neuron` (server.cli.main) once per argument list, all in this one process, and print each run's
exit code, stdout and stderr as JSON. What a CLI run that stops before serving costs is mostly importing
vLLM: paid here once.

    python tests/cli_runs.py '[["serve", "--help"], ["serve", MODEL, "--context-buckets", "100,256"]]'

Each run starts from the environment this process started with, and its output is caught at file
descriptors 1 and 2, so that what loggers write through the streams they kept from import is caught too. An
exception other than SystemExit is printed as the interpreter would print it, and the run's code is 1."""

import json
import os
import sys
import tempfile
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository's packages, as under pytest


def run(argv: list[str], folder: Path) -> dict:
    from server.cli import main

    environment = dict(os.environ)
    saved = {fd: os.dup(fd) for fd in (1, 2)}
    paths = {1: folder / "stdout", 2: folder / "stderr"}
    for fd, path in paths.items():
        with open(path, "w") as out:
            os.dup2(out.fileno(), fd)
    try:
        main(argv)
        code = 0
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
        if isinstance(stop.code, str):
            print(stop.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 - reported as an uncaught exception would be
        traceback.print_exc()
        code = 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        for fd, copy in saved.items():
            os.dup2(copy, fd)
            os.close(copy)
        os.environ.clear()
        os.environ.update(environment)
    return {"code": code, "stdout": paths[1].read_text(), "stderr": paths[2].read_text()}


def main() -> None:
    runs = json.loads(sys.argv[1])
    results = []
    for argv in runs:
        with tempfile.TemporaryDirectory(prefix="cli-run-") as folder:
            results.append(run(argv, Path(folder)))
    print("RESULT " + json.dumps(results), flush=True)


if __name__ == "__main__":
    main()
    from tests.helpers import end_script

    end_script()
