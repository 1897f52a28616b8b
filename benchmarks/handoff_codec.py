"""Handoff codec benchmark: ardit's raw-bytes frames against memcpy and the naive paths.

Payload: the seed workload, 5,900 rows x 3,584 hidden (5,627 prompt + 273 generated rows at
Qwen2.5-7B width), BF16, with token ids spread over a 151,643-token vocabulary. Every method
runs in the same process, single-threaded, all methods back to back in each repetition:

1. memcpy       one copy of the payload bytes into a preallocated buffer (the physical limit)
2. naive_fp32   widen to FP32, tobytes, msgpack packb/unpackb, rebuild the BF16 tensor
3. bf16_packb   BF16 bytes through plain packb/unpackb, rebuild the tensor
4. data_floor   the data work the contract requires and nothing else: per frame, the sender's
                xxh3 of the rows, the receiver's copy into place and xxh3 of what landed
5. ardit        the payload through HandoffEncoder -> buffers -> HandoffReceiver, one frame at a
                time as the services run it: each frame is handed to the receiver as soon as it
                is encoded. Row buffer from the receiver's RowBufferPool, payload landed in
                place, checksums on both sides, all validation on; rows released to the pool
                after the check.
6. ardit_decode_steps  the same, with the rows split as the AR sends them: the prompt rows
                after prefill, then the generated rows in 16-row pieces (28 frames instead of 11)
7. ardit_batch  ardit with every frame encoded before any is decoded (nothing still in cache)
8. ardit_cold   ardit with a fresh allocation per handoff (no pool): first-touch page faults

Ratios to memcpy are taken within each repetition (the methods run back to back, so a slow
spell of the machine slows both sides of a ratio) and reported as the median with the 10th and
90th percentiles.

    python benchmarks/handoff_codec.py [--reps 30] [--out benchmarks/results/handoff_codec.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

import msgpack
import torch

from shared.checksum import PayloadHasher, payload_checksum
from shared.diffusion import DiffusionParams
from shared.frame_codec import LANDING_SLICE
from shared.frame_types import Buffer
from shared.frames import OpenFrame, StreamSpec
from shared.handoff_assembler import HandoffAssembler, HandoffReceiver
from shared.handoff_encoder import DEFAULT_MAX_FRAME_PAYLOAD, HandoffEncoder
from shared.row_buffer_pool import RowBufferPool
from shared.row_recipe import RowRecipe
from shared.tensor_codec import byte_view, tensor_bytes

ROWS, HIDDEN, PROMPT = 5900, 3584, 5627
VOCAB = 151643  # Qwen2.5's


def memcpy(src: torch.Tensor, dst: torch.Tensor) -> int:
    byte_view(dst)[:] = tensor_bytes(src)
    return src.nbytes


def naive_fp32(src: torch.Tensor) -> tuple[int, torch.Tensor]:
    wire = msgpack.packb({"shape": list(src.shape), "data": src.float().numpy().tobytes()})
    obj = msgpack.unpackb(wire)
    rebuilt = torch.frombuffer(bytearray(obj["data"]), dtype=torch.float32).reshape(obj["shape"]).to(torch.bfloat16)
    return len(wire), rebuilt


def bf16_packb(src: torch.Tensor) -> tuple[int, torch.Tensor]:
    wire = msgpack.packb({"shape": list(src.shape), "dtype": "bfloat16", "data": bytes(tensor_bytes(src))})
    obj = msgpack.unpackb(wire)
    rebuilt = torch.frombuffer(bytearray(obj["data"]), dtype=torch.bfloat16).reshape(obj["shape"])
    return len(wire), rebuilt


def data_floor(src: torch.Tensor, dst: torch.Tensor) -> tuple[int, torch.Tensor]:
    """The data work the contract asks for, with no framing: the sender hashes each frame's rows,
    the receiver copies them in landing slices and hashes what it copied."""
    src_bytes, dst_bytes = tensor_bytes(src), byte_view(dst)
    for start in range(0, src.nbytes, DEFAULT_MAX_FRAME_PAYLOAD):
        sent = src_bytes[start : start + DEFAULT_MAX_FRAME_PAYLOAD]
        landing = dst_bytes[start : start + DEFAULT_MAX_FRAME_PAYLOAD]
        payload_checksum(sent)
        hasher = PayloadHasher()
        for at in range(0, sent.nbytes, LANDING_SLICE):
            piece = landing[at : at + LANDING_SLICE]
            piece[:] = sent[at : at + LANDING_SLICE]
            hasher.update(piece)
        hasher.hexdigest()
    return src.nbytes, dst


def ardit(
    src: torch.Tensor,
    token_ids: list[int],
    pool: RowBufferPool | None,
    streamed: bool = True,
    decode_steps: bool = False,
) -> tuple[int, HandoffAssembler, torch.Tensor]:
    opened = OpenFrame(
        request_id="bench",
        model="bench",
        dtype="bfloat16",
        row_width=HIDDEN,
        rows=RowRecipe(layers=[28]),
        streams={"cond": StreamSpec(prompt_tokens=PROMPT, max_rows=ROWS)},
        diffusion=DiffusionParams(width=1024, height=1024, num_inference_steps=50, guidance_scale=4.0, seed=0),
    )
    enc = HandoffEncoder(opened)
    receiver = HandoffReceiver(pool=pool)
    held: list[Buffer] = []
    wire = 0

    def send(buffers: list[Buffer]) -> None:
        # What the transport hands the receiver: the same buffers, now (streamed) or at the end.
        nonlocal wire
        for buf in buffers:
            wire += memoryview(buf).nbytes
            if streamed:
                receiver.feed(buf)
            else:
                held.append(buf)

    # The payload as one block of rows, or as the AR sends it: the prompt rows after prefill,
    # then the generated rows in decode-sized pieces.
    blocks = [(0, ROWS)]
    if decode_steps:
        blocks = [(0, PROMPT)] + [(start, min(start + 16, ROWS)) for start in range(PROMPT, ROWS, 16)]
    send(enc.open_frame())
    for start, end in blocks:
        for frame in enc.row_frames("cond", start, token_ids[start:end], src[start:end]):
            send(frame)
    send(enc.close({"cond": token_ids}, {"cond": PROMPT}, cached_tokens=0, cache_creation_tokens=PROMPT))
    for buf in held:
        receiver.feed(buf)
    handoff = receiver.finish()
    return wire, receiver.assembler, handoff.streams["cond"].rows


def timed(fn, *args):
    start = time.perf_counter()
    out = fn(*args)
    return time.perf_counter() - start, out


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def machine() -> dict:
    cpu = platform.processor() or platform.machine()
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text()
        cpu = next(line.split(":", 1)[1].strip() for line in cpuinfo.splitlines() if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return {
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "threads_used": torch.get_num_threads(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "node": platform.platform(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "handoff_codec.json")
    args = parser.parse_args()
    torch.set_num_threads(1)  # single-threaded everywhere: the comparison is per byte copied

    src = torch.randn(ROWS, HIDDEN, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    token_ids = [(i * 7919) % VOCAB for i in range(ROWS + 1)]
    dst = torch.empty_like(src)
    pool = RowBufferPool(max_idle_bytes=2 * src.nbytes)
    names = (
        "memcpy",
        "naive_fp32",
        "bf16_packb",
        "data_floor",
        "ardit",
        "ardit_decode_steps",
        "ardit_batch",
        "ardit_cold",
    )
    times: dict[str, list[float]] = {name: [] for name in names}
    wire: dict[str, int] = {}
    for rep in range(args.reps + 1):
        runs = {
            "memcpy": lambda: (memcpy(src, dst), dst),
            "naive_fp32": lambda: naive_fp32(src),
            "bf16_packb": lambda: bf16_packb(src),
            "data_floor": lambda: data_floor(src, dst),
            "ardit": lambda: ardit(src, token_ids, pool),
            "ardit_decode_steps": lambda: ardit(src, token_ids, pool, decode_steps=True),
            "ardit_batch": lambda: ardit(src, token_ids, pool, streamed=False),
            "ardit_cold": lambda: ardit(src, token_ids, None),
        }
        for name, run in runs.items():
            seconds, (nbytes, *owner, out) = timed(run)
            assert torch.equal(out.view(torch.int16), src.view(torch.int16)), name
            wire[name] = nbytes
            if rep:  # rep 0 warms caches, the allocator and the pool
                times[name].append(seconds)
            del out
            for assembler in owner:
                assembler.release()

    median = {name: statistics.median(ts) for name, ts in times.items()}
    ratios = {name: [t / m for t, m in zip(ts, times["memcpy"], strict=True)] for name, ts in times.items()}
    ardit_ratio = statistics.median(ratios["ardit"])
    result = {
        "command": f"python benchmarks/handoff_codec.py --reps {args.reps}",
        "machine": machine(),
        "payload": {"rows": ROWS, "hidden": HIDDEN, "dtype": "bfloat16", "bytes": src.nbytes},
        "reps": args.reps,
        "median_ms": {k: round(v * 1e3, 2) for k, v in median.items()},
        "ratio_to_memcpy": {k: round(statistics.median(v), 2) for k, v in ratios.items()},
        "ratio_to_memcpy_p10_p90": {
            k: [round(percentile(v, 0.1), 2), round(percentile(v, 0.9), 2)] for k, v in ratios.items()
        },
        "speedup_vs_naive_fp32": {k: round(median["naive_fp32"] / v, 2) for k, v in median.items()},
        "wire_bytes": wire,
        "wire_ratio_to_naive_fp32": {k: round(v / wire["naive_fp32"], 4) for k, v in wire.items() if k != "memcpy"},
        "target": "ardit <= 2x memcpy, >= 5x faster than naive_fp32, wire = half of naive_fp32 + header",
        "target_met": ardit_ratio <= 2 and median["naive_fp32"] >= 5 * median["ardit"],
        "wire_overhead_bytes_vs_half_fp32": wire["ardit"] - src.nbytes,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
