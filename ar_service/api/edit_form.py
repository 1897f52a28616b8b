"""``POST /v1/images/edits``' body: multipart/form-data as the official client sends it.

The client sends every parameter as a text part (``n`` as ``2``, ``stream`` as ``true``, nested
objects in brackets: ``svg[model]``) and the files as file parts: ``image`` (one) or ``image[]``
(a list, up to 16), ``mask``, ``markup``. Starlette parses the body with python-multipart (the
RequestGate has already capped its size); each text part is typed by the JSON type its field has
in ``ImageEditRequest`` and then validated by that model, so a form edit and a JSON generation
accept and refuse exactly the same values, and an unknown part gets OpenAI's ``unknown_parameter``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cache
from typing import Any

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError
from starlette.datastructures import UploadFile
from starlette.exceptions import HTTPException

from ar_service.api.protocol import ImageEditRequest
from services.errors import ApiError

MAX_IMAGES = 16  # OpenAI's limit for image[]
MAX_MASK_BYTES = 4 << 20  # OpenAI's limit for the mask
# A text part holds at most a 32,000-character prompt, up to 4 bytes a character in UTF-8.
MAX_FIELD_BYTES = 128 << 10
IMAGE_PARTS = ("image", "image[]")
FILE_PARTS = (*IMAGE_PARTS, "mask", "markup")
_INTEGER = re.compile(r"^-?[0-9]{1,20}(\.0*)?$")  # "7" and "7.0", as JSON's integers are


@dataclass(frozen=True)
class Upload:
    filename: str | None
    data: bytes


@dataclass(frozen=True)
class EditForm:
    request: ImageEditRequest
    images: list[Upload]
    mask: Upload | None


async def read_edit_form(request: Request) -> EditForm:
    content_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if content_type != "multipart/form-data":
        raise ApiError(
            400, "an edit is sent as multipart/form-data (image files and form fields)", code="invalid_value"
        )
    fields: dict[str, Any] = {}
    files: dict[str, list[Upload]] = {}
    try:
        # Two file parts over 16 images (mask, markup) so that too many images get their own message.
        async with request.form(max_files=MAX_IMAGES + 2, max_fields=64, max_part_size=MAX_FIELD_BYTES) as form:
            for name, value in form.multi_items():
                if isinstance(value, UploadFile):
                    files.setdefault(name, []).append(Upload(value.filename, await value.read()))
                else:
                    _put(fields, name, value)
    except HTTPException as exc:  # python-multipart's refusals, as Starlette raises them
        param = "image" if "files" in str(exc.detail) else None
        raise ApiError(400, f"the form could not be read: {exc.detail}", param=param, code="invalid_value") from None
    images = [upload for part in IMAGE_PARTS for upload in files.pop(part, [])]
    masks = files.pop("mask", [])
    if files.pop("markup", []):
        raise ApiError(
            400,
            "markup is not supported by this model; a mask marks where to edit",
            param="markup",
            code="unsupported_value",
        )
    for name in files:  # a file part under any other name
        if name not in ImageEditRequest.model_fields:
            raise ApiError(400, f"Unknown parameter: '{name}'.", param=name, code="unknown_parameter")
        raise ApiError(400, f"{name} is a form field, not a file", param=name, code="invalid_value")
    for name in ("image", "mask", "markup"):  # ``image[]`` as text lands under "image" too (``_put``)
        if name in fields:
            raise ApiError(400, f"{name} must be sent as a file", param=name, code="invalid_value")
    if not images:
        raise ApiError(400, "image is required: the image to edit", param="image", code="missing_required_parameter")
    if len(images) > MAX_IMAGES:
        raise ApiError(400, f"at most {MAX_IMAGES} images may be sent", param="image", code="invalid_value")
    if len(masks) > 1:
        raise ApiError(400, "one mask at most", param="mask", code="invalid_value")
    mask = masks[0] if masks else None
    if mask is not None and len(mask.data) > MAX_MASK_BYTES:
        raise ApiError(400, f"the mask is over {MAX_MASK_BYTES} bytes", param="mask", code="image_too_large")
    try:
        body = ImageEditRequest.model_validate({name: _typed((name,), value) for name, value in fields.items()})
    except ValidationError as exc:
        # The same answer as a JSON body's (services/errors.py), e.g. unknown_parameter.
        raise RequestValidationError([{**e, "loc": ("body", *e["loc"])} for e in exc.errors()]) from None
    return EditForm(body, images, mask)


def _put(fields: dict[str, Any], name: str, value: str) -> None:
    """``svg[reasoning][effort]`` → ``fields["svg"]["reasoning"]["effort"]``; a repeated field is an error."""
    head, *keys = re.split(r"\[", name.replace("]", ""))
    path = [head, *keys]
    target = fields
    for key in path[:-1]:
        nested = target.setdefault(key, {})
        if not isinstance(nested, dict):
            raise ApiError(400, f"{name}: {key} is both a value and an object", param=head, code="invalid_value")
        target = nested
    if path[-1] in target:
        raise ApiError(400, f"{name} is given twice", param=head, code="invalid_value")
    target[path[-1]] = value


def _typed(path: tuple[str, ...], value: Any) -> Any:
    """A text part as the JSON value its field takes (a nested one, ``step_cache[threshold]``, by its
    place in the field's object); anything unreadable stays text, for the model to refuse naming the field."""
    if isinstance(value, dict):
        return {key: _typed((*path, key), inner) for key, inner in value.items()}
    kinds = _json_types().get(path, set())
    if "integer" in kinds and _INTEGER.match(value):
        return int(value.split(".")[0])
    if "number" in kinds:
        try:
            return float(value)
        except ValueError:
            return value
    if "boolean" in kinds and value in ("true", "false"):
        return value == "true"
    return value


@cache
def _json_types() -> dict[tuple[str, ...], set[str]]:
    """The JSON types of each field and each field of its objects, by path, from the model's own JSON
    Schema (every option of a union merged)."""
    schema = ImageEditRequest.model_json_schema()
    definitions = schema.get("$defs", {})
    types: dict[tuple[str, ...], set[str]] = {}

    def walk(path: tuple[str, ...], node: dict[str, Any]) -> None:
        if "$ref" in node:
            node = definitions[node["$ref"].rsplit("/", 1)[-1]]
        options = node.get("anyOf") or node.get("oneOf")
        if options:
            for option in options:
                walk(path, option)
            return
        types.setdefault(path, set()).add(node.get("type", "object"))
        for name, child in node.get("properties", {}).items():
            walk((*path, name), child)

    for name, field in schema["properties"].items():
        walk((name,), field)
    return types


def edit_form_openapi() -> dict[str, Any]:
    """The multipart body for the OpenAPI document, as the official client sends it: the request's
    fields as text parts, the files as file parts. (``svg``'s bracketed parts, ``svg[model]``, are
    accepted but not listed.)"""
    fields = ImageEditRequest.model_json_schema(ref_template="#/components/schemas/{model}")["properties"]
    fields.pop("svg")
    binary = {"type": "string", "format": "binary"}
    files = {
        "image": {**binary, "description": "The image to edit (PNG, JPEG or WebP); or send it as image[]."},
        "image[]": {"type": "array", "items": binary, "maxItems": MAX_IMAGES, "description": "One image, as a list."},
        "mask": {**binary, "description": "PNG of the image's size; fully transparent pixels are repainted."},
    }
    schema = {"type": "object", "properties": {**fields, **files}, "required": ["prompt", "image"]}
    return {"required": True, "content": {"multipart/form-data": {"schema": schema}}}
