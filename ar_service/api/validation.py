"""Validate once: a public request in, a ``ValidGeneration`` out, or a 400 that names the parameter.

Everything a request can be refused for without running a model is checked here, before it is
admitted: the shape (``protocol``), what the ready DiTs announced they can render (the same
``DiffusionLimits.check`` the DiT runs on every ``open``), the AR's own limits, the templated
prompts' token counts, and an edit's uploads (decoded here, in a worker thread). After this only
the validated type travels (TGI's ``validation.rs`` shape): the generator takes the
``GenerationRequest`` it holds, the response is shaped by its ``ResponseOptions``.

An edit of a model that draws from text (Qwen-Image's img2img and inpaint) starts from one picture: its text model
reads no pictures, so ``image[]`` with more than one file is refused rather than silently reduced to its first. An
edit model whose encoder reads the pictures (Qwen-Image-Edit-2511) takes as many as its card says, the encoder reading
each one with every stream's prompt (``reference_pictures``).
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Literal

from ar_service import reference_pictures
from ar_service.api.edit_form import EditForm
from ar_service.api.protocol import STEPS_BY_QUALITY, EventPrefix, ImageEditRequest, ImageRequest, RequestedFormat
from ar_service.image_generation import EditHandoff, GenerationRequest
from ar_service.input_images import EditMemory, EditPixels, Held, OutputSize, decode_edit, read_upload
from ar_service.prompt_builder import BuiltPrompt, PromptBuilder, PromptError
from ar_service.settings import ArSettings
from services.errors import ApiError
from services.model_card import PictureReading
from shared.capabilities import DitCapabilities
from shared.diffusion import DiffusionParams, OutputFormat, ReferencePictureRules, StepCache, parse_size
from shared.errors import InvalidDiffusionParams
from shared.frames import PUBLIC_PARAM, StreamName

# An edit's strength when the request names none, by input_fidelity (default "low"): diffusers'
# own img2img default, and less of the schedule re-run where the input should be kept closely.
STRENGTH_BY_FIDELITY = {"low": 0.6, "high": 0.3}
# The OpenAI error code of a parameter the DiT cannot render as asked (invalid_value otherwise).
_CODE_BY_PARAM = {"size": "invalid_size", "output_format": "unsupported_value"}


@dataclass(frozen=True)
class ResponseOptions:
    """How the answer is shaped: a JSON body or an event stream, what it echoes, whose url images."""

    event_prefix: EventPrefix
    stream: bool
    response_format: Literal["b64_json", "url"]
    quality: str | None  # as echoed (None where OpenAI reports none)
    safety_identifier: str | None
    owner: str = ""  # the API key's tenant ("" without keys): its url images are kept in its share


@dataclass(frozen=True)
class ValidGeneration:
    generation: GenerationRequest
    response: ResponseOptions
    # An edit's share of the AR's edit memory, held until the request is over.
    held: Held | None = None

    def release(self) -> None:
        if self.held is not None:
            self.held.release()

    def with_edit(self, edit: EditHandoff, size: tuple[int, int], held: Held) -> ValidGeneration:
        """This (checked) request with its decoded edit: the output size the upright pixels have (an
        EXIF turn swaps the sides, within the same checks) and the memory they hold."""
        diffusion = self.generation.diffusion.model_copy(update={"width": size[0], "height": size[1]})
        generation = dataclasses.replace(self.generation, diffusion=diffusion, edit=edit)
        return ValidGeneration(generation, self.response, held)


@dataclass(frozen=True)
class RequestValidator:
    settings: ArSettings
    prompts: PromptBuilder
    edit_memory: EditMemory

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.settings.served_model_name:
            raise ApiError(404, f"the model '{model}' does not exist", param="model", code="model_not_found")

    def prompt_token_ids(self, prompt: str) -> list[int]:
        """The ids the engine gets for ``prompt`` (in the template): what its prefix cache holds."""
        return self.prompts.build(prompt).token_ids

    def generation(
        self,
        body: ImageRequest,
        request_id: str,
        received_at: float,
        dit: DitCapabilities,
        tenant: str | None = None,
    ) -> ValidGeneration:
        """A generation (JSON body) checked against the ready DiTs' announcement; ``tenant``: whose API
        key sent it (None without keys)."""
        self.check_model(body.model)
        with _public_errors():
            dit.limits.check_edit(None)
        size = (dit.defaults.width, dit.defaults.height) if body.size == "auto" else _size(body.size, dit)
        return self._valid(body, "image_generation", request_id, received_at, dit, size, tenant)

    async def edit(
        self, form: EditForm, request_id: str, received_at: float, dit: DitCapabilities, tenant: str | None = None
    ) -> ValidGeneration:
        """An edit (multipart form): also decodes the uploads, in a worker thread."""
        body = form.request
        self.check_model(body.model)
        if not dit.limits.edits:
            raise _invalid(f"{dit.model} does not edit images: it draws from text only", "image", "unsupported_value")
        if not dit.limits.edit_strength:
            return await self._reference_edit(form, request_id, received_at, dit, tenant)
        if len(form.images) > 1:
            raise _invalid(
                f"{len(form.images)} images were sent; this model edits one image (it has no image encoder "
                "that reference images could condition), so image[] may hold one file",
                "image",
                "unsupported_value",
            )
        limits = dit.limits
        requested = None if body.size == "auto" else _size(body.size, dit)
        listed = None if limits.sizes is None else tuple(parse_size(s) for s in limits.sizes)
        size = OutputSize(requested, limits.size_multiple, limits.max_pixels, listed)
        mask = form.mask.data if form.mask is not None else None
        upload = read_upload(form.images[0].data, mask, self.settings.max_edit_input_pixels)
        width, height = size.for_input(*upload.size)
        if requested is None:
            _drawable(upload.size, (width, height), dit)
        # Every other refusal before the decode (the cheapest first), then the memory, then the pixels.
        valid = self._valid(body, "image_edit", request_id, received_at, dit, (width, height), tenant)
        with _public_errors():
            dit.limits.check_edit_steps(edit_strength(body), valid.generation.diffusion.num_inference_steps)
        held = self.edit_memory.hold(upload.memory(width, height))
        try:
            pixels = await asyncio.to_thread(decode_edit, upload, size)
            edit = EditHandoff.of(edit_strength(body), pixels)
            return valid.with_edit(edit, (pixels.pictures[0].width, pixels.pictures[0].height), held)
        except BaseException:
            held.release()
            raise

    async def _reference_edit(
        self, form: EditForm, request_id: str, received_at: float, dit: DitCapabilities, tenant: str | None
    ) -> ValidGeneration:
        """An edit of a model whose encoder reads the pictures (``reference_pictures``): 1 to its most pictures, no
        mask, no strength; the output sized from the last picture, as its pipeline sizes it, unless asked."""
        body, reading = form.request, self.prompts.reading
        if reading is None and (rules := dit.limits.reference_pictures) is not None:
            return await self._pipeline_reference_edit(form, request_id, received_at, dit, tenant, rules)
        if reading is None:
            raise _invalid(
                f"{dit.model} edits from pictures its text encoder reads, and this AR's encoder reads none",
                "image",
                "unsupported_value",
            )
        for field, given in (("strength", body.strength), ("input_fidelity", body.input_fidelity)):
            if given is not None:
                raise _invalid(f"{dit.model} takes no {field}: it redraws from the pictures it reads", field)
        if form.mask is not None:
            raise _invalid(f"{dit.model} takes no mask: it edits from the pictures it reads", "mask")
        if len(form.images) > (most := dit.limits.max_edit_pictures):
            raise _invalid(f"{len(form.images)} pictures were sent; this model reads at most {most}", "image")
        uploads = [read_upload(file.data, None, self.settings.max_edit_input_pixels) for file in form.images]
        read_sizes = reference_pictures.checked_sizes(uploads, reading)
        requested = None if body.size == "auto" else _size(body.size, dit)
        size = requested or _auto_reference_size(uploads[-1].size, reading, dit)
        if requested is None:
            _drawable(uploads[-1].size, size, dit)
        valid = self._valid(body, "image_edit", request_id, received_at, dit, size, tenant, read_sizes)
        held = self.edit_memory.hold(reference_pictures.memory(uploads, reading))
        try:
            pictures = await asyncio.to_thread(reference_pictures.decode_references, uploads, reading)
            # An upright turn swaps the last picture's sides, and so the size drawn from it.
            upright = requested or _auto_reference_size(pictures.read[-1].size, reading, dit)
            generation = dataclasses.replace(valid.generation, pictures=pictures.read)
            edit = EditHandoff.of(None, EditPixels(pictures.sent, None))
            return ValidGeneration(generation, valid.response).with_edit(edit, upright, held)
        except BaseException:
            held.release()
            raise

    async def _pipeline_reference_edit(
        self,
        form: EditForm,
        request_id: str,
        received_at: float,
        dit: DitCapabilities,
        tenant: str | None,
        rules: ReferencePictureRules,
    ) -> ValidGeneration:
        """An edit of a model whose pipeline reads the pictures itself beside a text-only encoder's rows (FLUX.2
        [klein]'s, ``DiffusionLimits.reference_pictures``): 1 to its most pictures; no strength, unless a mask (on the
        first picture) makes it an inpaint, which takes one; unsized, drawn at the first picture's size as its
        pipeline draws it (the inpaint always is)."""
        body = form.request
        masked = form.mask is not None
        if masked and not dit.limits.edit_mask:
            raise _invalid(f"{dit.model} takes no mask", "mask")
        if not masked:
            for field, given in (("strength", body.strength), ("input_fidelity", body.input_fidelity)):
                if given is not None:
                    raise _invalid(
                        f"{dit.model} takes no {field} without a mask: it redraws from the pictures it reads", field
                    )
        if len(form.images) > (most := dit.limits.max_edit_pictures):
            raise _invalid(f"{len(form.images)} pictures were sent; this model reads at most {most}", "image")
        mask = form.mask.data if form.mask is not None else None
        limit = self.settings.max_edit_input_pixels
        uploads = [read_upload(file.data, mask if n == 0 else None, limit) for n, file in enumerate(form.images)]
        reference_pictures.checked_for_pipeline(uploads, rules)
        drawn = rules.drawn_size(*uploads[0].size)
        requested = None if body.size == "auto" else _size(body.size, dit)
        if masked and requested is not None and requested != drawn:
            raise _invalid(
                f"size {body.size}: an edit with a mask is drawn at its picture's size, {drawn[0]}x{drawn[1]} (auto)",
                "size",
            )
        size = requested or drawn
        if requested is None:
            _drawable(uploads[0].size, size, dit)
        valid = self._valid(body, "image_edit", request_id, received_at, dit, size, tenant)
        strength = edit_strength(body) if masked else None
        with _public_errors():
            dit.limits.check_edit_steps(strength, valid.generation.diffusion.num_inference_steps)
        held = self.edit_memory.hold(reference_pictures.pipeline_memory(uploads, rules))
        try:
            pixels = await asyncio.to_thread(reference_pictures.decode_for_pipeline, uploads, rules)
            # An upright turn swaps the first picture's sides, and so the size drawn from it.
            first = pixels.pictures[0]
            upright = requested or rules.drawn_size(first.width, first.height)
            return valid.with_edit(EditHandoff.of(strength, pixels), upright, held)
        except BaseException:
            held.release()
            raise

    def _valid(
        self,
        body: ImageRequest,
        prefix: EventPrefix,
        request_id: str,
        received_at: float,
        dit: DitCapabilities,
        size: tuple[int, int],
        tenant: str | None,
        picture_sizes: Sequence[tuple[int, int]] = (),
    ) -> ValidGeneration:
        s = self.settings
        if body.background == "transparent":
            raise _invalid("background 'transparent' is not supported by this model", "background", "unsupported_value")
        if body.output_compression is not None and body.output_format == "png":
            raise _invalid("output_compression applies to jpeg and webp only", "output_compression")
        if body.response_format == "url" and s.image_base_url is None:
            raise _invalid(
                "response_format=url needs this server's public address (ARDIT_AR_PUBLIC_BASE_URL); ask for b64_json",
                "response_format",
                "unsupported_value",
            )
        max_new = body.max_new_tokens or s.max_new_tokens
        if max_new > s.max_new_tokens_limit:
            raise _invalid(f"max_new_tokens is limited to {s.max_new_tokens_limit}", "max_new_tokens")
        with _public_errors():
            diffusion = self._diffusion(body, request_id, dit, size)
        texts: dict[StreamName, str] = {"cond": body.prompt}
        if diffusion.cfg:  # the negative prompt is encoded only where CFG uses it
            negative = s.default_negative_prompt if body.negative_prompt is None else body.negative_prompt
            texts["uncond"] = dit.defaults.negative_prompt if negative is None else negative
        generation = GenerationRequest(
            request_id=request_id,
            prompts={name: self._prompt(name, text, dit, picture_sizes) for name, text in texts.items()},
            diffusion=diffusion,
            max_new_tokens=max_new,
            cache_salt=cache_salt(tenant, body.cache_salt),
            received_at=received_at,
        )
        response = ResponseOptions(
            event_prefix=prefix,
            stream=body.stream,
            response_format=body.response_format,
            quality=body.echoed_quality,
            safety_identifier=body.effective_safety_identifier,
            owner=tenant or "",
        )
        return ValidGeneration(generation, response)

    @staticmethod
    def _diffusion(body: ImageRequest, request_id: str, dit: DitCapabilities, size: tuple[int, int]) -> DiffusionParams:
        """The request's diffusion parameters (the DiT's defaults where it names none), checked
        against the DiT's announced limits."""
        defaults = dit.defaults
        # A request without a seed gets one derived from its id: reproducible from the logs.
        seed = body.seed if body.seed is not None else int.from_bytes(request_id.encode()[-6:], "big") % (2**31)
        steps = body.num_inference_steps or STEPS_BY_QUALITY.get(body.quality, defaults.num_inference_steps)
        if body.sigmas is not None:
            if body.num_inference_steps not in (None, len(body.sigmas)):
                raise _invalid(
                    f"{len(body.sigmas)} sigmas for num_inference_steps {body.num_inference_steps}", "sigmas"
                )
            steps = len(body.sigmas)
        params = DiffusionParams(
            width=size[0],
            height=size[1],
            num_inference_steps=steps,
            guidance_scale=float(body.guidance_scale if body.guidance_scale is not None else defaults.guidance_scale),
            seed=seed,
            num_images=body.n,
            output_format=_output_format(body.output_format, dit),
            output_compression=body.output_compression,
            partial_images=body.partial_images if body.stream else 0,
            sigmas=body.sigmas,
            step_cache=_default_step_cache(dit) if body.step_cache is None else body.step_cache.on_wire(),
            cfg_above=dit.cfg_above,
        )
        dit.limits.check(params)
        return params

    def _prompt(
        self, name: StreamName, text: str, dit: DitCapabilities, picture_sizes: Sequence[tuple[int, int]]
    ) -> BuiltPrompt:
        """``text`` in the model's template with the pictures it reads, within the AR's and the DiT's token limits."""
        param = PUBLIC_PARAM[name]
        try:
            prompt = self.prompts.build(text, picture_sizes)
        except PromptError as exc:
            raise _invalid(f"{param}: {exc}", param) from None
        limit = self.settings.max_prompt_tokens
        if len(prompt.token_ids) > limit:
            raise _too_long(f"{param} is {len(prompt.token_ids)} tokens with the template; the limit is {limit}", param)
        rows, most = len(prompt.token_ids) - prompt.prefix_tokens, dit.limits.max_conditioning_rows
        if rows > most:
            raise _too_long(f"{param} is {rows} tokens; the image model takes at most {most}", param)
        return prompt


def _output_format(requested: RequestedFormat, dit: DitCapabilities) -> OutputFormat:
    for announced in dit.limits.output_formats:
        if announced == requested:
            return announced
    raise _invalid(f"output_format {requested!r} is not supported here", "output_format", "unsupported_value")


def _auto_reference_size(picture: tuple[int, int], reading: PictureReading, dit: DitCapabilities) -> tuple[int, int]:
    """``size=auto`` of an edit model: what its pipeline draws, the last picture's shape at its VAE area; where the DiT
    lists the sizes it draws, the listed size nearest that shape (as Qwen-Image's edits choose)."""
    drawn = reading.vae_size(*picture)
    if dit.limits.sizes is None:
        return drawn
    listed = tuple(parse_size(s) for s in dit.limits.sizes)
    return OutputSize(None, dit.limits.size_multiple, dit.limits.max_pixels, listed).for_input(*drawn)


def _drawable(upload: tuple[int, int], size: tuple[int, int], dit: DitCapabilities) -> None:
    """``size=auto``: the input's shape, scaled and rounded to what the DiT draws, must be drawable (a very
    thin image comes out at a side of one multiple and far more pixels than the limit). Refused naming
    ``image``: the request asked for no size, the image is what cannot be drawn."""
    try:
        dit.limits.check_size(*size)
    except InvalidDiffusionParams as exc:
        raise _invalid(
            f"the image is {upload[0]}x{upload[1]}: at this model's sizes it would be drawn at {size[0]}x{size[1]} "
            f"({exc.message}); send a less elongated image, or a size",
            "image",
            "invalid_image_size",
        ) from None


def _size(size: str, dit: DitCapabilities) -> tuple[int, int]:
    width, height = parse_size(size)
    with _public_errors():
        dit.limits.check_size(width, height)
    return width, height


@contextmanager
def _public_errors() -> Iterator[None]:
    """The limits' refusal of a parameter (``InvalidDiffusionParams``) as the public API's 400."""
    try:
        yield
    except InvalidDiffusionParams as exc:
        param = exc.param or "prompt"
        raise _invalid(exc.message, param, _CODE_BY_PARAM.get(param, "invalid_value")) from None


def cache_salt(tenant: str | None, asked: str | None) -> str | None:
    """vLLM's prefix-cache salt: the tenant's own namespace first, so one API key's cached prefixes are
    never another's hits (``cached_tokens`` tells a tenant nothing of another's prompts; the template
    prefix is cached once per tenant), then the salt the request asked for."""
    if tenant is None:
        return asked
    return f"{tenant}:{asked or ''}"


def edit_strength(body: ImageEditRequest) -> float:
    """``strength`` as given, else the one ``input_fidelity`` implies."""
    return float(body.strength if body.strength is not None else STRENGTH_BY_FIDELITY[body.input_fidelity or "low"])


def _invalid(message: str, param: str, code: str = "invalid_value") -> ApiError:
    return ApiError(400, message, param=param, code=code)


def _too_long(message: str, param: str) -> ApiError:
    return ApiError(400, message, param=param, code="context_length_exceeded")


def _default_step_cache(dit: DitCapabilities) -> StepCache | None:
    """The model card's step cache, where every DiT runs its method: a replica that cannot (several runs
    at once, or older) would refuse a request that never named one."""
    default = dit.defaults.step_cache
    return default if default is not None and default.method in dit.limits.step_caches else None
