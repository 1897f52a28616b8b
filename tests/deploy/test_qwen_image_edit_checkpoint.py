"""The tiny Qwen-Image-Edit-2511 ``make checkpoints`` builds is its published layout and sensitive enough to test with:
diffusers' own ``QwenImageEditPlusPipeline`` loads and renders it, transformers' ``AutoProcessor`` loads its
processor, and another picture or another word changes the 64x64 output by more than 10 of 255 levels.

One render takes seconds, not the DiT's milliseconds: the pipeline VAE-encodes each picture at the 1024x1024 area
whatever the output size, so the module renders three times (picture A with "a", picture B with "a", A with "b")
and every test reads those."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest
import torch
from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit_plus import (
    CONDITION_IMAGE_SIZE,
    QwenImageEditPlusPipeline,
    calculate_dimensions,
)
from PIL import Image
from transformers import AutoProcessor

from services.checkpoints import QWEN_IMAGE_EDIT_MODEL, default_model_dir

pytestmark = pytest.mark.slow

FOLDER = default_model_dir(QWEN_IMAGE_EDIT_MODEL)
LEVELS = 10 / 255  # the least change, as a fraction of the 255 levels, that a test may tell from noise


def folder_json(path: str) -> dict[str, Any]:
    value: dict[str, Any] = json.loads((FOLDER / path).read_text())
    return value


def picture(seed: int) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (64, 96, 3), dtype=np.uint8))


PICTURE_A, PICTURE_B = picture(1), picture(2)


@pytest.fixture(scope="module")
def pipe() -> QwenImageEditPlusPipeline:
    pipeline = QwenImageEditPlusPipeline.from_pretrained(str(FOLDER), dtype=torch.float32)
    pipeline.set_progress_bar_config(disable=True)
    return pipeline


@pytest.fixture(scope="module")
def renders(pipe: QwenImageEditPlusPipeline) -> dict[str, Any]:
    """The three renders, and the DiT's inputs at the first step of the first (kept for the zero_cond_t test)."""
    calls: list[dict[str, Any]] = []

    def keep(module: Any, args: Any, kwargs: dict[str, Any]) -> None:
        calls.append({key: value for key, value in kwargs.items() if key != "return_dict"})

    hook = pipe.transformer.register_forward_pre_hook(keep, with_kwargs=True)
    try:
        pictures = {"A": render(pipe, PICTURE_A, "a")}
    finally:
        hook.remove()
    pictures["B"] = render(pipe, PICTURE_B, "a")
    pictures["A b"] = render(pipe, PICTURE_A, "b")
    return {"pictures": pictures, "dit_inputs": calls[0]}


def render(pipe: QwenImageEditPlusPipeline, image: Image.Image, prompt: str) -> np.ndarray:
    result = pipe(
        image=[image],
        prompt=prompt,
        height=64,
        width=64,
        num_inference_steps=2,
        true_cfg_scale=1.0,
        generator=torch.Generator().manual_seed(0),
    )
    return np.asarray(result.images[0], dtype=np.int16)


def change(a: np.ndarray, b: np.ndarray) -> tuple[float, float]:
    """The largest and the mean change between two uint8 pictures, as fractions of the 255 levels."""
    levels = np.abs(a - b)
    return float(levels.max()) / 255, float(levels.mean()) / 255


def test_the_folder_is_laid_out_as_qwen_image_edit_2511_is_published():
    index = folder_json("model_index.json")
    assert index["_class_name"] == "QwenImageEditPlusPipeline"
    assert index["processor"] == ["transformers", "Qwen2VLProcessor"]
    assert index["text_encoder"] == ["transformers", "Qwen2_5_VLForConditionalGeneration"]
    assert {"scheduler", "tokenizer", "transformer", "vae"} <= index.keys()
    text = folder_json("text_encoder/config.json")
    assert "vision_config" in text  # the encoder reads the pictures
    transformer = folder_json("transformer/config.json")
    assert transformer["zero_cond_t"] is True  # what tells 2511's DiT from 2509's
    assert transformer["joint_attention_dim"] == text["hidden_size"]
    names = {path.name for path in (FOLDER / "processor").iterdir()}
    assert {"preprocessor_config.json", "tokenizer.json", "chat_template.jinja"} <= names


def test_autoprocessor_loads_the_processor_with_torchvisions_image_processor_and_the_published_settings():
    processor = AutoProcessor.from_pretrained(str(FOLDER / "processor"))
    assert type(processor).__name__ == "Qwen2VLProcessor"
    images = processor.image_processor
    assert type(images).__name__ == "Qwen2VLImageProcessor"  # the torchvision one, not Qwen2VLImageProcessorPil
    assert (images.patch_size, images.merge_size, images.temporal_patch_size) == (14, 2, 2)
    assert (images.size["shortest_edge"], images.size["longest_edge"]) == (3136, 12845056)
    assert list(images.image_mean) == [0.48145466, 0.4578275, 0.40821073]
    assert list(images.image_std) == [0.26862954, 0.26130258, 0.27577711]
    message = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "a"}]}]
    text = processor.apply_chat_template(message, add_vision_id=True, tokenize=False)
    assert "Picture 1: <|vision_start|><|image_pad|><|vision_end|>a" in text


def test_another_picture_of_the_same_size_changes_the_output_by_more_than_10_levels(renders):
    largest, mean = change(renders["pictures"]["A"], renders["pictures"]["B"])
    assert largest > LEVELS, f"picture A vs B: largest change {largest * 255:.0f}/255, mean {mean * 255:.1f}/255"


def test_another_word_with_the_same_picture_changes_the_output_by_more_than_10_levels(renders):
    largest, mean = change(renders["pictures"]["A"], renders["pictures"]["A b"])
    assert largest > LEVELS, f'"a" vs "b": largest change {largest * 255:.0f}/255, mean {mean * 255:.1f}/255'


def test_the_vision_tower_changes_the_rows_encode_prompt_gives_for_another_picture(pipe):
    # The picture as the pipeline hands it to its encoder: resized to the 384x384 area at its aspect.
    width, height = calculate_dimensions(CONDITION_IMAGE_SIZE, PICTURE_A.width / PICTURE_A.height)
    rows = [
        pipe.encode_prompt("a", image=[pipe.image_processor.resize(image, height, width)])[0]
        for image in (PICTURE_A, PICTURE_B)
    ]
    assert rows[0].shape == rows[1].shape
    assert (rows[0] - rows[1]).abs().max() > 0.1


def test_the_pipeline_takes_the_zero_cond_t_path_and_without_it_the_dit_predicts_otherwise(pipe, renders):
    inputs = renders["dit_inputs"]
    # The noise's tokens, then the condition picture's: zero_cond_t modulates the second at timestep 0.
    assert len(inputs["img_shapes"][0]) == 2
    transformer = pipe.transformer
    assert transformer.zero_cond_t and all(block.zero_cond_t for block in transformer.transformer_blocks)
    noise_tokens = inputs["hidden_states"].shape[1] - int(np.prod(inputs["img_shapes"][0][1]))

    def predict(zero_cond_t: bool) -> torch.Tensor:
        for module in (transformer, *transformer.transformer_blocks):
            module.zero_cond_t = zero_cond_t
        try:
            with torch.no_grad():
                return transformer(**inputs, return_dict=False)[0][:, :noise_tokens]
        finally:
            for module in (transformer, *transformer.transformer_blocks):
                module.zero_cond_t = True

    with_it, without_it = predict(True), predict(False)
    assert (with_it - without_it).abs().max() > 0.05 * with_it.abs().max()
