"""An edit model's encoder reads the pictures on the real engine: Qwen-Image-Edit-2511's tiny checkpoint, its
Qwen2.5-VL served with its vision tower (``TextModel`` for a family that reads pictures).

The rows are transformers' own ``hidden_states[-1]`` of the same prompt and pictures, picture tokens included, with
the model's 3-D M-RoPE positions (transformers' processor gives ``mm_token_type_ids``; diffusers 0.42.1's
``encode_prompt`` drops them: docs/picture_encoders.md). The prefix cache reuses a picture's rows: the same picture
with another instruction hits every whole block of the shared prefix, bitwise; another picture of the same size
misses after the system prompt (64 tokens, under one 128-token block). The connector counts the pictures the
vision tower encoded for each request (``scheduled_encoder_inputs``): none for a picture vLLM's encoder cache holds.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import numpy as np
import PIL.Image
import pytest
import torch
from transformers import AutoProcessor, Qwen2_5_VLForConditionalGeneration

from ar_service.engine.hidden_state_engine import EngineRequest, FinishedEvent, HiddenStateEngine, RowsEvent
from ar_service.prompt_builder import BuiltPrompt, PromptBuilder
from ar_service.settings import ArSettings
from services.checkpoints import QWEN_IMAGE_EDIT_MODEL, default_model_dir
from tests.support.background_loop import BackgroundLoop

pytestmark = pytest.mark.slow

FOLDER = default_model_dir(QWEN_IMAGE_EDIT_MODEL)
# fp32 kernels of two implementations agree to rounding: measured 2.4e-6 (docs/picture_encoders.md).
ROW_TOLERANCE = 5e-5


def picture(seed: int, width: int = 448, height: int = 336) -> PIL.Image.Image:
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    return PIL.Image.fromarray(pixels)


class Encoder:
    def __init__(self, loop: BackgroundLoop, engine: HiddenStateEngine) -> None:
        self.loop, self.engine = loop, engine
        self.prompts = PromptBuilder.of_text_model(engine.text_model, engine.rows)
        reading = engine.text_model.pictures
        assert reading is not None
        self.reading = reading

    def condition(self, image: PIL.Image.Image) -> PIL.Image.Image:
        return image.resize(self.reading.condition_size(*image.size), PIL.Image.Resampling.LANCZOS)

    def encode(
        self, text: str, *images: PIL.Image.Image, salt: str | None = None
    ) -> tuple[BuiltPrompt, torch.Tensor, FinishedEvent]:
        pictures = [self.condition(image) for image in images]
        built = self.prompts.build(text, [p.size for p in pictures])
        request = EngineRequest(
            f"test:{uuid.uuid4().hex[:8]}",
            built.token_ids,
            pictures=tuple(pictures),
            engine_token_ids=built.engine_token_ids,
            cache_salt=salt,
        )

        async def run() -> tuple[torch.Tensor, FinishedEvent]:
            rows, finished = [], None
            async for event in self.engine.run(request):
                if isinstance(event, RowsEvent):
                    rows.append(event.rows)
                else:
                    finished = event
            assert finished is not None
            return torch.cat(rows), finished

        return built, *self.loop.call(run())

    def transformers_rows(self, text: str, *images: PIL.Image.Image) -> tuple[list[int], torch.Tensor]:
        processor = AutoProcessor.from_pretrained(str(FOLDER / "processor"))
        model = Qwen2_5_VLForConditionalGeneration.from_pretrained(str(FOLDER / "text_encoder"), dtype=torch.float32)
        prompt = self.prompts.template.format(self.reading.prompt(len(images), text))
        inputs = processor(text=[prompt], images=[self.condition(i) for i in images], return_tensors="pt")
        with torch.no_grad():
            hidden = model(**inputs, output_hidden_states=True).hidden_states[-1][0]
        return inputs["input_ids"][0].tolist(), hidden


@pytest.fixture(scope="module")
def encoder() -> Iterator[Encoder]:
    loop = BackgroundLoop()
    engine = HiddenStateEngine(
        ArSettings(model_dir=FOLDER, dtype="float32", kv_cache_bytes=256 << 20, max_model_len=4096)
    )
    engine.start()
    yield Encoder(loop, engine)
    loop.call(engine.aclose())
    loop.stop()


def test_the_rows_of_an_edit_prompt_are_transformers_own_picture_tokens_included(encoder):
    built, rows, finished = encoder.encode("make the sky red", picture(1))
    ids, expected = encoder.transformers_rows("make the sky red", picture(1))
    assert built.token_ids == ids == finished.token_ids[: finished.prompt_tokens]
    assert built.picture_tokens == 176 and built.prefix_tokens == 64  # 448x320 read at 14-pixel patches, merged 2x2
    assert rows.shape[0] == len(ids) and (rows - expected).abs().max().item() < ROW_TOLERANCE


def test_three_pictures_of_three_sizes_are_read_in_order(encoder):
    images = picture(2), picture(3, 300, 500), picture(4, 640, 200)
    built, rows, finished = encoder.encode("put the first on the second", *images)
    assert finished.pictures_encoded == 3
    ids, expected = encoder.transformers_rows("put the first on the second", *images)
    assert built.token_ids == ids and built.engine_token_ids is not None
    assert built.engine_token_ids.count(encoder.prompts.pictures.placeholder_id) == 3
    assert (rows - expected).abs().max().item() < ROW_TOLERANCE


def test_the_same_picture_with_another_instruction_reuses_its_cached_rows_bitwise(encoder):
    salt = uuid.uuid4().hex
    image = picture(5)
    _, cold, first = encoder.encode("make it blue", image, salt=salt)
    _, warm, again = encoder.encode("make it green", image, salt=salt)
    assert first.cached_tokens == 0 and again.cached_tokens == 128  # the whole blocks of 64 + 176 shared tokens
    assert torch.equal(cold[:128], warm[:128])
    # vLLM's encoder cache held the picture's embeddings: the vision tower did not run again for it.
    assert (first.pictures_encoded, again.pictures_encoded) == (1, 0)


def test_another_picture_of_the_same_size_misses_after_the_system_prompt(encoder):
    salt = uuid.uuid4().hex
    encoder.encode("make it blue", picture(6), salt=salt)
    _, _, other = encoder.encode("make it blue", picture(7), salt=salt)
    assert other.cached_tokens == 0  # the 64 system-prompt tokens fill no 128-token block
    assert other.pictures_encoded == 1


def test_a_prompt_that_types_the_picture_placeholder_is_refused(encoder):
    from ar_service.prompt_builder import PromptError

    with pytest.raises(PromptError, match=r"image_pad"):
        encoder.prompts.build("<|image_pad|> here", [(448, 320)])
