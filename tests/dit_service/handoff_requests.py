"""Handoffs as the AR service sends them, sent to a live DiT, and the DiT's metrics read back."""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from dataclasses import dataclass, field

import httpx
import torch
from prometheus_client.parser import text_string_to_metric_families

from shared.diffusion import DiffusionParams
from shared.frames import EditSpec, OpenFrame, StreamName, StreamSpec
from shared.handoff_encoder import HandoffEncoder
from shared.result_frames import HANDOFF_MEDIA_TYPE, ImageFrame, PartialImageFrame, ResultFrame, ResultReader
from shared.row_recipe import RowRecipe

HIDDEN = 576
TOKEN = "test-handoff-token"
AR_MODEL = "tiny-ar"


def params(**overrides) -> DiffusionParams:
    values = {"width": 32, "height": 32, "num_inference_steps": 2, "guidance_scale": 0.0, "seed": 0}
    return DiffusionParams(**{**values, **overrides})


def hidden_rows(count: int, seed: int = 0, dtype: torch.dtype = torch.float32, hidden: int = HIDDEN) -> torch.Tensor:
    return torch.randn(count, hidden, generator=torch.Generator().manual_seed(seed)).to(dtype)


def token_ids(count: int, first: int = 100) -> list[int]:
    return list(range(first, first + count))


def open_frame(
    cond_rows: int,
    *,
    uncond_rows: int | None = None,
    diffusion: DiffusionParams | None = None,
    hidden: int = HIDDEN,
    dtype: str = "float32",
    conditioning: str = "qwen_image",
    model: str = AR_MODEL,
    final_norm: bool = True,
    layers: tuple[int, ...] = (30,),
    max_rows: int | None = None,
    request_id: str = "req_test",
    prefix_tokens: int | None = 0,
    traceparent: str | None = None,
    rows: RowRecipe | None = None,
    edit: EditSpec | None = None,
) -> OpenFrame:
    """The open frame of a handoff: rows read by Qwen-Image's recipe at ``layers`` (or by ``rows``)."""
    streams: dict[StreamName, StreamSpec] = {
        "cond": StreamSpec(prompt_tokens=cond_rows, max_rows=max_rows or cond_rows, prefix_tokens=prefix_tokens)
    }
    if uncond_rows is not None:
        streams["uncond"] = StreamSpec(
            prompt_tokens=uncond_rows, max_rows=max_rows or uncond_rows, prefix_tokens=prefix_tokens
        )
    return OpenFrame(
        request_id=request_id,
        model=model,
        dtype=dtype,
        row_width=hidden,
        rows=rows or RowRecipe(layers=list(layers), final_norm=final_norm, conditioning=conditioning),
        streams=streams,
        diffusion=diffusion or params(),
        traceparent=traceparent,
        edit=edit,
    )


def complete_handoff(
    cond: torch.Tensor,
    *,
    uncond: torch.Tensor | None = None,
    diffusion: DiffusionParams | None = None,
    cond_ids: list[int] | None = None,
    answer_start: int | None = None,
    frame_rows: int | None = None,
    reverse: bool = False,
    **open_options,
) -> list[bytes]:
    """open, rows (split into frames of ``frame_rows``, optionally last first), close."""
    streams: dict[StreamName, torch.Tensor] = {"cond": cond} if uncond is None else {"cond": cond, "uncond": uncond}
    ids: dict[StreamName, list[int]] = {"cond": cond_ids or token_ids(cond.shape[0])}
    if uncond is not None:
        ids["uncond"] = token_ids(uncond.shape[0], first=500)
    encoder = HandoffEncoder(
        open_frame(
            cond.shape[0],
            uncond_rows=None if uncond is None else uncond.shape[0],
            diffusion=diffusion,
            dtype={torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}[cond.dtype],
            **open_options,
        )
    )
    parts = list(encoder.open_frame())
    for name, rows in streams.items():
        step = frame_rows or rows.shape[0]
        starts = list(range(0, rows.shape[0], step))
        for start in reversed(starts) if reverse else starts:
            parts += encoder.rows(name, start, ids[name][start : start + step], rows[start : start + step])
    answer_starts = {name: rows.shape[0] if answer_start is None else answer_start for name, rows in streams.items()}
    parts += encoder.close(ids, answer_starts, cached_tokens=0, cache_creation_tokens=0)
    return [bytes(p) for p in parts]


@dataclass
class HandoffAnswer:
    status: int
    headers: httpx.Headers
    error: dict | None = None
    frames: list[ResultFrame] = field(default_factory=list)

    @property
    def refusal(self) -> dict:
        """The error body of a refused handoff."""
        assert self.error is not None, f"the handoff was not refused (status {self.status})"
        return self.error

    @property
    def images(self) -> list[ImageFrame]:
        return [f for f in self.frames if isinstance(f, ImageFrame)]

    @property
    def partials(self) -> list[PartialImageFrame]:
        return [f for f in self.frames if isinstance(f, PartialImageFrame)]

    @property
    def kinds(self) -> list[str]:
        """The frames' kinds, without progress frames (they come whenever the DiT was silent a while)."""
        return [f.kind for f in self.frames if f.kind != "progress"]


def handoff_headers(token: str | None = TOKEN) -> dict[str, str]:
    headers = {"content-type": HANDOFF_MEDIA_TYPE}
    if token is not None:
        headers["authorization"] = f"Bearer {token}"
    return headers


def post_handoff(base_url: str, parts: list[bytes], *, headers: dict[str, str] | None = None) -> HandoffAnswer:
    """Sends the parts as a chunked body from a generator, as the AR's client does."""

    def body() -> Iterator[bytes]:
        yield from parts

    with httpx.Client(timeout=60) as client:
        response = client.post(f"{base_url}/v1/handoff", content=body(), headers=headers or handoff_headers())
    return answer_of(response.status_code, response.headers, response.content)


def answer_of(status: int, headers: httpx.Headers, content: bytes) -> HandoffAnswer:
    if status != 200:
        return HandoffAnswer(status, headers, error=json.loads(content)["error"])
    return HandoffAnswer(status, headers, frames=list(ResultReader().feed(content)))


def scrape(base_url: str) -> dict[tuple[str, frozenset], float]:
    text = httpx.get(f"{base_url}/metrics").text
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def metric(base_url: str, name: str, **labels: str) -> float:
    return scrape(base_url).get((name, frozenset(labels.items())), 0.0)


class RawHandoff:
    """A chunked POST written by hand on a socket, so a test decides when the bytes stop."""

    def __init__(self, port: int, token: str = TOKEN) -> None:
        self._socket = socket.create_connection(("127.0.0.1", port), timeout=30)
        head = (
            f"POST /v1/handoff HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {token}\r\n"
            f"Content-Type: {HANDOFF_MEDIA_TYPE}\r\nTransfer-Encoding: chunked\r\n\r\n"
        )
        self._socket.sendall(head.encode())

    def send(self, data: bytes) -> None:
        self._socket.sendall(f"{len(data):x}\r\n".encode() + data + b"\r\n")

    def response(self) -> tuple[int, dict]:
        """Status and JSON body of a plain (error) response."""
        received = b""
        while b"\r\n\r\n" not in received:
            received += self._recv()
        head, body = received.split(b"\r\n\r\n", 1)
        lines = head.decode("latin-1").split("\r\n")
        length = next(int(line.split(":")[1]) for line in lines if line.lower().startswith("content-length"))
        while len(body) < length:
            body += self._recv()
        return int(lines[0].split()[1]), json.loads(body[:length])

    def _recv(self) -> bytes:
        chunk = self._socket.recv(65536)
        if not chunk:
            raise ConnectionError("server closed the connection")
        return chunk

    def close(self) -> None:
        self._socket.close()
