"""The handoff at full size over real HTTP: AR handoff client -> DiT intake on loopback, beside a raw socket.

The seed payload (5,900 rows x 3,584 BF16, 42.3 MB, 5,901 token ids) leaves this process through the
service's own send path: ``HandoffBody`` (fed by stand-in engine runs that yield the rows the way
``HiddenStateEngine`` does) -> ``HandoffClient`` -> aiohttp, as the AR service configures it. It lands in
a second process, a receiver built from the DiT's own ``HandoffIntake`` (the real frame reader, row
buffer, pool and checks) under uvicorn as the DiT service runs it. The receiver answers as soon as
it holds the assembled conditioning (no pipeline: that is not the point here), with a ``done`` frame.

Modes, each measured back to back with the baselines in every repetition, in rotating order:

- ``encoder``: every row ready at once (Qwen-Image's encoder mode: all rows after prefill), for
  5,900 rows and 1,000 rows;
- ``streamed``: the same 5,900 rows in decode-sized pieces (1 row each), as fast as the body takes them;
- ``prompt+decode``: a 5,868-row prompt block then 32 one-row decode pieces;
- ``raw socket``: the same bytes over a loopback TCP socket into a preallocated buffer in the
  receiver process, acknowledged with one byte (the transport's limit on this machine);
- ``memcpy``: the same bytes copied in this process (single thread).

Reported per mode: milliseconds and GB/s from rows ready to the DiT holding the conditioning
(``acknowledged``, when the DiT's answer starts), the ratio to the raw socket within each
repetition (median, p10-p90), and the handoff tail as the service reports it
(``HandoffStats.handoff_latency``: its last rows event seen -> acknowledged) beside the tail
from the moment the last row was ready.

    python benchmarks/handoff_http.py [--reps 10]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import socket
import sys
import threading
import time
from collections.abc import AsyncGenerator, AsyncIterator
from pathlib import Path

import paired
import torch
from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

paired.use_this_checkout()

from ar_service import (  # noqa: E402
    ArSettings,
    EngineEvent,
    FinishedEvent,
    HandoffBody,
    HandoffClient,
    RowsEvent,
    dit_session,
)
from shared.diffusion import DiffusionParams  # noqa: E402
from shared.frames import OpenFrame, StreamSpec  # noqa: E402
from shared.handoff_encoder import HandoffEncoder  # noqa: E402
from shared.row_recipe import RowRecipe  # noqa: E402
from shared.tensor_codec import byte_view, tensor_bytes  # noqa: E402

ROWS, HIDDEN = 5900, 3584
DECODE_ROWS = 32
VOCAB = 151643  # Qwen2.5's
TOKEN = "bench-handoff-token"  # sent as the AR sends it; the bare receiver does not check it


# ---- receiver process -------------------------------------------------------------------------


def serve_receiver(http_port: int, raw_port: int, raw_bytes: int) -> None:
    import uvicorn
    from prometheus_client import CollectorRegistry

    from dit_service import DitMetrics, DitSettings, HandoffIntake
    from shared.result_frames import HANDOFF_MEDIA_TYPE, DoneFrame, encode_result
    from shared.row_buffer_pool import RowBufferPool

    torch.set_num_threads(1)
    settings = DitSettings()  # the DiT's defaults: caps, frame limits, stall timeout, pool size
    intake = HandoffIntake(
        settings.assembly_caps,
        settings.frame_limits,
        settings.stall_timeout_seconds,
        settings.handoff_deadline_seconds,
        DitMetrics(CollectorRegistry()),
        RowBufferPool(settings.idle_row_buffer_bytes) if settings.idle_row_buffer_bytes else None,
    )
    app = FastAPI()

    @app.post("/v1/handoff/reservations", status_code=201)
    async def reserve() -> dict[str, object]:
        return {"reservation": "bench", "expires_in": 30.0}  # a sink with room for everyone

    @app.post("/v1/handoff")
    async def handoff(request: Request) -> StreamingResponse:
        started = time.monotonic()
        async with intake.receive(request.stream(), lambda _: None) as received:
            rows = sum(s.rows.shape[0] for s in received.handoff.streams.values())
        done = DoneFrame(request_id=received.handoff.open.request_id, timings={"receive": time.monotonic() - started})

        async def frames() -> AsyncIterator[bytes]:
            yield encode_result(done)

        response = StreamingResponse(frames(), media_type=HANDOFF_MEDIA_TYPE)
        response.headers["x-rows"] = str(rows)
        return response

    threading.Thread(target=raw_sink, args=(raw_port, raw_bytes), daemon=True).start()
    uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=http_port, log_config=None)).run()


def raw_sink(port: int, size: int) -> None:
    """Accepts connections; reads ``size`` bytes into one preallocated buffer, then answers one byte."""
    buffer = bytearray(size)
    view = memoryview(buffer)
    with socket.create_server(("127.0.0.1", port)) as server:
        while True:
            conn, _ = server.accept()
            with conn:
                while True:
                    got = 0
                    while got < size:
                        n = conn.recv_into(view[got:], size - got)
                        if n == 0:
                            break
                        got += n
                    if got < size:
                        break
                    conn.sendall(b"k")


# ---- sender (this process) --------------------------------------------------------------------


def open_frame(rows: int) -> OpenFrame:
    return OpenFrame(
        request_id=f"bench-{time.monotonic_ns()}",
        model="bench",
        dtype="bfloat16",
        row_width=HIDDEN,
        rows=RowRecipe(layers=[28]),
        streams={"cond": StreamSpec(prompt_tokens=rows, max_rows=rows)},
        diffusion=DiffusionParams(width=1024, height=1024, num_inference_steps=50, guidance_scale=4.0, seed=0),
    )


class StandInRun:
    """An engine run as ``HiddenStateEngine.submitted`` gives it: rows events in pieces, then finished."""

    def __init__(self, rows: torch.Tensor, token_ids: list[int], pieces: list[tuple[int, int]]) -> None:
        self.rows, self.token_ids, self.pieces = rows, token_ids, pieces
        self.first_ready: float | None = None
        self.last_ready: float | None = None

    @contextlib.asynccontextmanager
    async def submitted(self) -> AsyncGenerator[AsyncIterator[EngineEvent], None]:
        yield self.events()

    async def events(self) -> AsyncGenerator[EngineEvent, None]:
        n = self.rows.shape[0]
        for start, end in self.pieces:
            now = time.perf_counter()
            self.first_ready = self.first_ready or now
            self.last_ready = now
            yield RowsEvent(start=start, rows=self.rows[start:end], token_ids=self.token_ids[start:end])
        yield FinishedEvent(
            token_ids=self.token_ids,
            prompt_tokens=n,
            generated_token_ids=self.token_ids[n:],
            row_count=n,
            cached_tokens=0,
            cache_creation_tokens=n,
            submitted_at=self.first_ready or time.perf_counter(),
            first_token_at=self.first_ready or time.perf_counter(),
            finished_at=time.perf_counter(),
        )


async def http_handoff(client: HandoffClient, rows: torch.Tensor, token_ids: list[int], pieces) -> dict:
    run = StandInRun(rows, token_ids, pieces)
    n = rows.shape[0]
    encoder = HandoffEncoder(open_frame(n))
    body = HandoffBody(encoder, {"cond": run.submitted()}, overlap=True, received_at=time.perf_counter(), pixels={})
    async with body:
        reservation = await client.reserve(encoder.open.request_id)
        result = await client.exchange(encoder.open.request_id, reservation, body)
    report = result.report
    assert run.first_ready is not None and run.last_ready is not None
    assert result.done.request_id == encoder.open.request_id
    return {
        "seconds": report.acknowledged_at - run.first_ready,
        "tail_from_last_row_ready": report.acknowledged_at - run.last_ready,
        "tail_reported": report.handoff_latency,
        "receiver_seconds": result.done.timings["receive"],
        "wire_bytes": report.bytes_sent,
    }


def raw_socket(port: int, payload: memoryview) -> float:
    with socket.create_connection(("127.0.0.1", port)) as conn:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        started = time.perf_counter()
        conn.sendall(payload)
        if conn.recv(1) != b"k":
            raise RuntimeError("raw sink did not acknowledge")
        return time.perf_counter() - started


def memcpy(src: torch.Tensor, dst: torch.Tensor) -> float:
    started = time.perf_counter()
    byte_view(dst)[:] = tensor_bytes(src)
    return time.perf_counter() - started


def wait_for(port: int, deadline: float = 60.0) -> None:
    until = time.monotonic() + deadline
    while time.monotonic() < until:
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
            return
        time.sleep(0.2)
    raise RuntimeError(f"receiver port {port} never opened")


async def measure(args: argparse.Namespace, http_port: int, raw_port: int) -> dict:
    generator = torch.Generator().manual_seed(0)
    rows = torch.randn(ROWS, HIDDEN, generator=generator).to(torch.bfloat16)
    token_ids = [(i * 7919) % VOCAB for i in range(ROWS + 1)]
    dst = torch.empty_like(rows)
    prompt = ROWS - DECODE_ROWS
    modes = {
        "encoder 5900 rows": (rows, token_ids, [(0, ROWS)]),
        "encoder 1000 rows": (rows[:1000], token_ids[:1001], [(0, 1000)]),
        "streamed 1-row pieces": (rows, token_ids, [(i, i + 1) for i in range(ROWS)]),
        f"prompt {prompt} + {DECODE_ROWS} one-row decode pieces": (
            rows,
            token_ids,
            [(0, prompt)] + [(i, i + 1) for i in range(prompt, ROWS)],
        ),
    }
    results: dict[str, list[dict]] = {name: [] for name in [*modes, "raw socket", "memcpy"]}
    raw_payload = tensor_bytes(rows)
    # As the AR service configures its DiT client (ar_service/dit_pool.py).
    settings = ArSettings(dit_stall_timeout_seconds=60.0)
    async with dit_session(settings) as http:
        url, stall = f"http://127.0.0.1:{http_port}", settings.dit_stall_timeout_seconds
        client = HandoffClient(http, url, TOKEN, deadline_seconds=600, stall_seconds=stall)
        steps = [*modes, "raw socket", "memcpy"]
        for rep in range(args.reps + 1):  # repetition 0 warms the connection, pool and caches
            order = steps[rep % len(steps) :] + steps[: rep % len(steps)]
            for name in order:
                if name == "raw socket":
                    sample = {"seconds": raw_socket(raw_port, raw_payload), "wire_bytes": raw_payload.nbytes}
                elif name == "memcpy":
                    sample = {"seconds": memcpy(rows, dst), "wire_bytes": rows.nbytes}
                else:
                    sample = await http_handoff(client, *modes[name])
                if rep:
                    results[name].append(sample)
            if rep:
                print(
                    f"rep {rep}/{args.reps}: "
                    + ", ".join(f"{k} {v[-1]['seconds'] * 1e3:.1f} ms" for k, v in results.items()),
                    flush=True,
                )
    report: dict = {"payload": {"rows": ROWS, "hidden": HIDDEN, "dtype": "bfloat16", "bytes": rows.nbytes}, "modes": {}}
    raw = results["raw socket"]
    for name, samples in results.items():
        payload_bytes = samples[0]["wire_bytes"]
        entry = {
            "wire_bytes": payload_bytes,
            "ms": paired.spread([s["seconds"] * 1e3 for s in samples]),
            "GB_per_s": paired.spread([payload_bytes / s["seconds"] / 1e9 for s in samples]),
        }
        if name not in ("raw socket", "memcpy"):
            row_bytes = 1000 * HIDDEN * 2 if name.startswith("encoder 1000") else rows.nbytes
            entry["throughput_vs_raw_socket"] = paired.spread(
                [(row_bytes / s["seconds"]) / (rows.nbytes / r["seconds"]) for s, r in zip(samples, raw, strict=True)]
            )
            entry["tail_from_last_row_ready_ms"] = paired.spread([s["tail_from_last_row_ready"] * 1e3 for s in samples])
            entry["tail_reported_by_service_ms"] = paired.spread([s["tail_reported"] * 1e3 for s in samples])
            entry["receiver_first_byte_to_assembled_ms"] = paired.spread([s["receiver_seconds"] * 1e3 for s in samples])
        report["modes"][name] = entry
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--out", type=Path, default=paired.RESULTS / "handoff_http.json")
    parser.add_argument("--receiver", nargs=2, type=int, metavar=("HTTP_PORT", "RAW_PORT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.receiver:
        http_port, raw_port = args.receiver
        serve_receiver(http_port, raw_port, raw_bytes=ROWS * HIDDEN * 2)
        return
    torch.set_num_threads(1)
    http_port, raw_port = paired.free_port(), paired.free_port()
    receiver = paired.child([sys.executable, __file__, "--receiver", str(http_port), str(raw_port)])
    report: dict = {
        "command": f"python benchmarks/handoff_http.py --reps {args.reps}",
        "machine": paired.machine(),
        "load_before": paired.load(),
    }
    try:
        wait_for(http_port)
        wait_for(raw_port)
        report |= asyncio.run(measure(args, http_port, raw_port))
    finally:
        receiver.terminate()
        receiver.wait(timeout=30)
    report["load_after"] = paired.load()
    encoder = report["modes"]["encoder 5900 rows"]["throughput_vs_raw_socket"]["p50"]
    report["targets"] = {">= 50% of raw-socket throughput (encoder mode, 5900 rows, median)": encoder >= 0.5}
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    summary = {
        name: {k: v for k, v in entry.items() if k in ("ms", "GB_per_s", "throughput_vs_raw_socket")}
        for name, entry in report["modes"].items()
    }
    print(json.dumps({"modes": summary, "targets": report["targets"]}, indent=1))


if __name__ == "__main__":
    main()
