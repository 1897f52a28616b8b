"""deploy/checkpoints/build_tiny_qwen_image.py: loadable, sized from the AR model, deterministic, idempotent."""

from __future__ import annotations

import json

import pytest
import torch
from diffusers import QwenImagePipeline
from safetensors.torch import load_file

pytestmark = pytest.mark.slow


def weights(directory) -> dict[str, torch.Tensor]:
    return {
        **load_file(directory / "transformer" / "diffusion_pytorch_model.safetensors"),
        **load_file(directory / "vae" / "diffusion_pytorch_model.safetensors"),
    }


def test_output_loads_as_a_qwen_image_pipeline_without_text_encoder(tiny_checkpoint):
    pipeline = QwenImagePipeline.from_pretrained(str(tiny_checkpoint), text_encoder=None, tokenizer=None)
    config = pipeline.transformer.config
    assert config.joint_attention_dim == 576 and config.in_channels == 64 and config.out_channels == 16
    assert sum(config.axes_dims_rope) == config.attention_head_dim
    assert pipeline.vae.config.z_dim == 16
    assert pipeline.scheduler.config.use_dynamic_shifting is True
    marker = json.loads((tiny_checkpoint / ".complete").read_text())
    assert len(marker["config_sha256"]) == 64


def test_joint_attention_dim_comes_from_the_ar_model_and_can_be_overridden(tmp_path, build_script):
    ar_model = tmp_path / "ar"
    ar_model.mkdir()
    (ar_model / "config.json").write_text(json.dumps({"hidden_size": 64}))
    assert build_script.main(["--out", str(tmp_path / "from-ar"), "--ar-model", str(ar_model)]) == 0
    assert json.loads((tmp_path / "from-ar" / "transformer" / "config.json").read_text())["joint_attention_dim"] == 64
    out = tmp_path / "override"
    assert build_script.main(["--out", str(out), "--ar-model", str(ar_model), "--joint-attention-dim", "32"]) == 0
    assert json.loads((out / "transformer" / "config.json").read_text())["joint_attention_dim"] == 32


def test_weights_are_a_function_of_the_seed(tmp_path, build_script, tiny_checkpoint):
    assert build_script.main(["--out", str(tmp_path / "again")]) == 0
    assert build_script.main(["--out", str(tmp_path / "seed1"), "--seed", "1"]) == 0
    reference, again, seed1 = weights(tiny_checkpoint), weights(tmp_path / "again"), weights(tmp_path / "seed1")
    assert reference.keys() == again.keys()
    assert all(torch.equal(reference[k], again[k]) for k in reference)
    assert not torch.equal(reference["proj_out.weight"], seed1["proj_out.weight"])


def test_a_complete_build_is_left_alone_and_a_changed_recipe_rebuilds(tmp_path, build_script, capsys):
    out = tmp_path / "model"
    assert build_script.main(["--out", str(out)]) == 0
    marker = (out / ".complete").stat().st_mtime_ns
    assert build_script.main(["--out", str(out)]) == 0
    assert "nothing to do" in capsys.readouterr().out
    assert (out / ".complete").stat().st_mtime_ns == marker
    assert build_script.main(["--out", str(out), "--seed", "7"]) == 0
    assert json.loads((out / ".complete").read_text())["recipe"]["seed"] == 7
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".model.")]  # no temp dirs left behind


def test_an_interrupted_build_without_marker_is_rebuilt(tmp_path, build_script):
    out = tmp_path / "model"
    out.mkdir()
    (out / "model_index.json").write_text("{}")  # a half-written directory from a crash
    assert build_script.main(["--out", str(out)]) == 0
    assert (out / ".complete").is_file()
    QwenImagePipeline.from_pretrained(str(out), text_encoder=None, tokenizer=None)
