"""An edit model's pictures: each decoded once, read by the encoder at one size, sent to the DiT at another.

A family whose encoder reads the user's pictures (``PictureReading``, Qwen-Image-Edit-2511's) prepares each picture
twice in its pipeline's ``__call__``: resized to its condition area for the vision tower, and to its VAE area for the
latents the transformer reads beside the rows. The AR does both, as the pipeline does them (Lanczos, each from the
decoded picture, sides by the card's rounding): the condition pictures go to the engine, the VAE pictures travel in
the handoff at their own sizes. The pipeline then resizes each VAE picture to the size it already has, which leaves
it as it is, and the DiT fetches nothing from the AR.

The checks and the memory follow ``input_images``: headers first (format, pixels), the memory held before anything
is decoded, the decode in a worker thread. A picture whose sides would round to nothing at either area (an extremely
elongated one) is refused naming ``image``. Pictures reduced more than ``2 x REDUCING_GAP`` times are first reduced by
whole factors (``input_images``' memory bound), which rounds a little otherwise than the pipeline's one Lanczos pass;
pictures within that ratio of their condition size are resized exactly as the pipeline resizes them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import PIL.Image

from ar_service.input_images import EditPixels, EditUpload, PicturePixels, decoded_upright, repaint_pixels, resized
from services.errors import ApiError
from services.model_card import PictureReading
from shared.diffusion import ReferencePictureRules

# Bytes a condition picture takes per pixel while it is resized and then held for the engine (RGB, 4 bytes a pixel in
# Pillow, its intermediate pass and its result).
CONDITION_BYTES_PER_PIXEL = 3 * 4


@dataclass(frozen=True)
class ReferencePictures:
    """An edit's pictures as the encoder reads them (for the engine) and as the DiT gets them, in the same order."""

    read: tuple[PIL.Image.Image, ...]
    sent: tuple[PicturePixels, ...]


def checked_sizes(uploads: Sequence[EditUpload], reading: PictureReading) -> list[tuple[int, int]]:
    """The size the encoder reads each picture at, every side at least one rounding step; a 400 naming ``image``
    otherwise. An upright turn swaps a picture's sides, which changes neither check nor its token count."""
    sizes = []
    for n, upload in enumerate(uploads, start=1):
        condition, vae = reading.condition_size(*upload.size), reading.vae_size(*upload.size)
        if min(*condition, *vae) == 0:
            width, height = upload.size
            raise ApiError(
                400,
                f"picture {n} is {width}x{height}: too elongated for this model, which reads it at a "
                f"{reading.condition_side}x{reading.condition_side} area; send a less elongated picture",
                param="image",
                code="invalid_image_size",
            )
        sizes.append(condition)
    return sizes


def memory(uploads: Sequence[EditUpload], reading: PictureReading) -> int:
    """Bytes the pictures hold at most while they are decoded and resized, and then as they are sent and read."""
    total = 0
    for upload in uploads:
        width, height = reading.condition_size(*upload.size)
        total += upload.memory(*reading.vae_size(*upload.size)) + width * height * CONDITION_BYTES_PER_PIXEL
    return total


def decode_references(uploads: Sequence[EditUpload], reading: PictureReading) -> ReferencePictures:
    """Each picture decoded, upright, in RGB, resized for the encoder and for the DiT. Blocking: call it in a worker
    thread."""
    read, sent = [], []
    for upload in uploads:
        picture = decoded_upright(upload.image, "image").convert("RGB")
        read.append(resized(picture, *reading.condition_size(*picture.size), PIL.Image.Resampling.LANCZOS))
        width, height = reading.vae_size(*picture.size)
        pixels = resized(picture, width, height, PIL.Image.Resampling.LANCZOS).tobytes()
        sent.append(PicturePixels(width, height, pixels))
    return ReferencePictures(tuple(read), tuple(sent))


def checked_for_pipeline(uploads: Sequence[EditUpload], rules: ReferencePictureRules) -> None:
    """A 400 naming ``image`` for a picture the family's pipeline would refuse (``rules``: FLUX.2 [klein]'s); an upright
    turn swaps a picture's sides, which changes neither check."""
    for n, upload in enumerate(uploads, start=1):
        if (why := rules.refusal(*upload.size)) is not None:
            raise ApiError(400, f"picture {n} {why}", param="image", code="invalid_image_size")


def pipeline_memory(uploads: Sequence[EditUpload], rules: ReferencePictureRules) -> int:
    """Bytes the pictures (and the first one's mask) hold at most while decoded and scaled, then as they are sent."""
    return sum(upload.memory(*rules.within_area(*upload.size)) for upload in uploads)


def decode_for_pipeline(uploads: Sequence[EditUpload], rules: ReferencePictureRules) -> EditPixels:
    """Each picture decoded, upright, in RGB, at its own size but scaled into the pipeline's area as the pipeline would
    scale it (Lanczos, sides truncated), so that the pipeline leaves it as it is; the first one's mask, where it has
    one, at that picture's size (255 where its alpha is 0: repaint). Blocking: call it in a worker thread."""
    sent: list[PicturePixels] = []
    mask = None
    for upload in uploads:
        picture = decoded_upright(upload.image, "image").convert("RGB")
        width, height = rules.within_area(*picture.size)
        scaled = resized(picture, width, height, PIL.Image.Resampling.LANCZOS)
        sent.append(PicturePixels(width, height, scaled.tobytes()))
        if upload.mask is not None:
            mask = repaint_pixels(upload.mask, width, height)
    return EditPixels(tuple(sent), mask)
