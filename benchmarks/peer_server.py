"""The baseline ardit is compared with: one process, in the style of diffusers' example server.

diffusers' ``examples/server``: FastAPI, the weights loaded once and shared, each request building
its own pipeline object with a fresh scheduler, the pipeline run in the event loop's default thread
pool (``run_in_executor``) so concurrent requests run in threads side by side. Here the text encoder
is the SmolLM2 ardit serves, run by transformers for every request (no prefix cache, no vLLM): the
hidden states of the layer the DiT was trained on (its card's) after the final norm, for ardit's templated
prompt, the rows after the template prefix (what ardit's ``qwen_image`` adapter selects). The image side is
the same code ardit's DiT runs: ``DitModel`` (shared weights, a pipeline per request), the same conditioning
adapter and ``Renderer`` (denoise, VAE decode, PNG encode), from ``dit_service``'s in-process API. So the two
servers compute the same rows and render the same images; they differ in how the work is served.

API subset (what ``benchmarks/peer_compare.py`` sends): ``POST /v1/images/generations`` with
``prompt``, ``size``, ``seed``, ``num_inference_steps`` (``response_format`` b64_json) answering
``{created, data: [{b64_json}]}``; ``GET /readyz``.

    python benchmarks/peer_server.py --port 8100
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import threading
import time
from types import SimpleNamespace

import paired
import torch
import uvicorn

paired.use_this_checkout()

from fastapi import FastAPI  # noqa: E402
from prometheus_client import CollectorRegistry  # noqa: E402
from pydantic import BaseModel  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from ar_service import ArSettings, PromptBuilder  # noqa: E402
from ar_service.engine.text_model import TextModel  # noqa: E402
from dit_service import (  # noqa: E402
    ConditioningAdapters,
    ConditioningOptions,
    DitMetrics,
    DitModel,
    DitSettings,
    ImageEncoder,
    Renderer,
    RenderItem,
    RenderJob,
    VaeCodec,
)
from shared.diffusion import DiffusionParams, parse_size  # noqa: E402
from shared.handoff_assembler import AssembledStream  # noqa: E402
from shared.result_frames import ImageFrame  # noqa: E402


class TextToImageInput(BaseModel):
    prompt: str
    size: str = "256x256"
    seed: int = 0
    num_inference_steps: int = 8
    response_format: str = "b64_json"


class SharedModels:
    """Loaded once, read by every request's thread."""

    def __init__(self, ar: ArSettings, dit: DitSettings) -> None:
        text_model = TextModel.read(ar.model_dir)
        self.prompts = PromptBuilder.of_text_model(text_model, ar.rows(text_model.card_rows))
        self.llm = AutoModelForCausalLM.from_pretrained(str(ar.model_dir), dtype=torch.float32).eval()
        self.dit = DitModel.load(dit.model_dir, dit.device, dit.torch_dtype_name)
        options = ConditioningOptions(
            special_token_ids=dit.special_token_ids,
            image_token_start_id=dit.image_token_start_id,
            max_sequence_length=dit.conditioning_rows(self.dit.card),
            pad_to_multiple=dit.pad_to_multiple,
            dtype=self.dit.facts.dtype,
        )
        self.adapter = ConditioningAdapters(options).get("qwen_image")
        self.renderer = Renderer(self.dit, VaeCodec(self.dit.vae), ImageEncoder(), DitMetrics(CollectorRegistry()))

    @torch.inference_mode()
    def generate(self, request: TextToImageInput) -> bytes:
        built = self.prompts.build(request.prompt)
        ids = torch.tensor([built.token_ids])
        # The layer the DiT was trained on, through the final norm: the rows ardit captures and normalises
        # (transformers' last entry is normed already). Like a diffusers pipeline's text encoder, the whole
        # model runs, as ardit's engine does.
        states = self.llm.model(input_ids=ids, output_hidden_states=True).hidden_states
        layer = None if self.dit.card.rows is None else self.dit.card.rows.layers[0]
        last = layer is None or layer == len(states) - 1
        rows = (states[-1] if last else self.llm.model.norm(states[layer]))[0]
        stream = AssembledStream(
            rows=rows,
            token_ids=built.token_ids,
            answer_start_index=len(built.token_ids),
            prefix_tokens=built.prefix_tokens,
        )
        conditioning = self.adapter.select(SimpleNamespace(streams={"cond": stream}))  # type: ignore[arg-type]
        width, height = parse_size(request.size)
        params = DiffusionParams(
            width=width,
            height=height,
            num_inference_steps=request.num_inference_steps,
            guidance_scale=1.0,
            seed=request.seed,
        )
        images: list[bytes] = []

        def emit(frame: object) -> None:
            if isinstance(frame, ImageFrame):
                images.append(frame.data)

        self.renderer.render([RenderItem(RenderJob("peer", conditioning, params), emit, threading.Event())])
        return images[0]


def create_app(models: SharedModels) -> FastAPI:
    app = FastAPI()

    @app.get("/readyz")
    async def ready() -> dict:
        return {"status": "ready"}

    @app.post("/v1/images/generations")
    async def generate_image(image_input: TextToImageInput) -> dict:
        loop = asyncio.get_event_loop()
        png = await loop.run_in_executor(None, lambda: models.generate(image_input))
        return {"created": int(time.time()), "data": [{"b64_json": base64.b64encode(png).decode()}]}

    return app


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8100)
    args = parser.parse_args()
    models = SharedModels(ArSettings(), DitSettings())
    uvicorn.run(create_app(models), host=args.host, port=args.port, log_config=None)


if __name__ == "__main__":
    main()
