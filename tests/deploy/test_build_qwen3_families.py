"""The tiny Z-Image and FLUX.2 [klein] folders ``make checkpoints`` builds are their families' published layouts:
diffusers' own pipelines load and render them; their Qwen3 text encoders have norms that matter and the layers
each pipeline reads, at the widths their DiTs take; their tokenizer is Qwen3's, with its thinking switch."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest
import torch
from diffusers.pipelines.flux2.pipeline_flux2_klein import Flux2KleinPipeline
from diffusers.pipelines.z_image.pipeline_z_image import ZImagePipeline
from transformers import AutoTokenizer

from services.checkpoints import FLUX2_KLEIN_MODEL, Z_IMAGE_MODEL, default_model_dir

pytestmark = pytest.mark.slow

FAMILIES: dict[str, tuple[Any, dict[str, float]]] = {
    Z_IMAGE_MODEL: (ZImagePipeline, {"guidance_scale": 0.0}),  # Turbo: no CFG
    FLUX2_KLEIN_MODEL: (Flux2KleinPipeline, {"guidance_scale": 1.0}),  # distilled: no CFG
}


def folder_json(name: str, path: str) -> dict:
    return json.loads((default_model_dir(name) / path).read_text())


@pytest.mark.parametrize("name", FAMILIES)
def test_diffusers_own_pipeline_loads_the_folder_and_renders_a_picture(name):
    pipeline_class, call = FAMILIES[name]
    assert folder_json(name, "model_index.json")["_class_name"] == pipeline_class.__name__
    pipeline = pipeline_class.from_pretrained(str(default_model_dir(name)), dtype=torch.float32)
    image = pipeline(
        prompt="a red fox in the snow",
        width=64,
        height=64,
        num_inference_steps=2,
        generator=torch.Generator().manual_seed(0),
        output_type="np",
        **call,
    ).images[0]
    assert image.shape == (64, 64, 3) and np.isfinite(image).all() and image.std() > 0


@pytest.mark.parametrize("name", FAMILIES)
def test_the_text_encoders_norms_are_not_ones_so_a_missing_norm_changes_the_rows(name):
    pipeline = FAMILIES[name][0].from_pretrained(str(default_model_dir(name)), transformer=None, vae=None)
    norms = [p for n, p in pipeline.text_encoder.named_parameters() if "norm" in n and n.endswith("weight")]
    assert norms and all(not torch.allclose(p.float(), torch.ones_like(p.float())) for p in norms)


def test_z_images_dit_takes_the_width_of_the_text_encoders_rows():
    text = folder_json(Z_IMAGE_MODEL, "text_encoder/config.json")
    assert folder_json(Z_IMAGE_MODEL, "transformer/config.json")["cap_feat_dim"] == text["hidden_size"]
    assert text["num_hidden_layers"] >= 2  # hidden_states[-2] is a layer's output, not the embeddings


def test_flux2_kleins_three_layers_are_all_before_the_last_and_its_dit_takes_them_side_by_side():
    text = folder_json(FLUX2_KLEIN_MODEL, "text_encoder/config.json")
    assert text["num_hidden_layers"] > 27  # hidden_states[27] is not the final norm's output
    assert folder_json(FLUX2_KLEIN_MODEL, "transformer/config.json")["joint_attention_dim"] == 3 * text["hidden_size"]
    assert folder_json(FLUX2_KLEIN_MODEL, "model_index.json")["is_distilled"] is True


@pytest.mark.parametrize("name", FAMILIES)
def test_the_tokenizer_is_qwen3s_and_its_template_has_the_thinking_switch(name):
    tokenizer = AutoTokenizer.from_pretrained(str(default_model_dir(name) / "tokenizer"))
    messages = [{"role": "user", "content": "a cat"}]

    def rendered(thinking: bool) -> str:
        return str(
            tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=True, enable_thinking=thinking
            )
        )

    assert rendered(True) == "<|im_start|>user\na cat<|im_end|>\n<|im_start|>assistant\n"
    assert rendered(False) == rendered(True) + "<think>\n\n</think>\n\n"
    assert tokenizer.convert_tokens_to_ids(["<think>", "</think>"]) == [151667, 151668]
