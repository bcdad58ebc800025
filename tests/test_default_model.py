import json

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
