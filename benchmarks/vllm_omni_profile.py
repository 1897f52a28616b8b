"""Where an image's time goes in ardit and in vLLM-Omni, process by process: py-spy on every process of each
server's tree while it serves the same requests one at a time, the stacks sorted into the parts of an image.

Both serve the same Qwen-Image folder at the same dtype without CFG, as in ``vllm_omni_table.py``; each gets the
same ``--requests`` prompts (``peer_compare.py``'s, ``--traffic``) at concurrency 1, one server after the other,
after a warm-up request each. py-spy (25 Hz, Python frames only: at 100 Hz with native frames its own unwinding
slowed vLLM-Omni 17x on 2 cores) samples each Python thread that is not idle, so a part is the wall time a Python
thread spent in it; torch's own worker threads are native and not sampled: their work shows as the time of the
Python call that waits for it. A sample goes to the first part, in ``PARTS``' order, one of whose files is on its
stack; for the rest, the innermost frames that hold the most samples are listed.

    benchmarks/vllm_omni/setup.sh
    python benchmarks/vllm_omni_profile.py [--dtype bfloat16] [--size 64x64] [--steps 20] [--requests 16]
"""

from __future__ import annotations

import argparse
import collections
import json
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import paired
import psutil
from peer_compare import Server, cell, one, prompt, start_ardit, start_vllm_omni

SAMPLES_PER_SECOND = 25
# The parts of an image, each by the source files that do it (diffusers' and vLLM-Omni's own transformer and VAE,
# transformers' and vLLM's text encoder, image encoding), checked in this order.
PARTS = {
    "DiT transformer": ("transformer_qwenimage.py", "qwen_image_transformer.py"),
    "VAE": ("autoencoder_kl_qwenimage.py",),
    "text encoder": ("modeling_qwen2_5_vl.py", "qwen2_5_vl.py", "qwen2_5_vl_text.py", "qwen2.py"),
    "image encoding (PNG, base64)": ("PngImagePlugin.py", "base64.py", "image_encoder.py", "Image.py"),
    "scheduler and pipeline loop": (
        "scheduling_flow_match_euler_discrete.py",
        "pipeline_qwenimage.py",
        "pipeline_qwen_image.py",
    ),
}
OTHER = "the rest (serving, handoff, engine scheduling, event loops)"


class Spy:
    """py-spy recording every process of a server's tree until ``stop``."""

    def __init__(self, server: Server) -> None:
        self._dir = tempfile.TemporaryDirectory(prefix="ardit-py-spy-")
        py_spy = Path(sys.executable).with_name("py-spy")
        self._spies: list[tuple[str, Path, subprocess.Popen[bytes]]] = []
        root = psutil.Process(server.process.pid)
        for index, process in enumerate([root, *root.children(recursive=True)]):
            raw = Path(self._dir.name) / f"{index}.txt"
            command = [str(py_spy), "record", "--rate", str(SAMPLES_PER_SECOND), "--format", "raw"]
            spy = subprocess.Popen(
                [*command, "--output", str(raw), "--pid", str(process.pid)],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            self._spies.append((paired.role(process), raw, spy))
        time.sleep(1)  # py-spy attaches

    def stop(self, images: int) -> dict[str, dict[str, float]]:
        """Milliseconds per image of each process, by part; the rest's largest innermost frames under ``rest:``."""
        by_process: dict[str, collections.Counter[str]] = {}
        for name, raw, spy in self._spies:
            spy.send_signal(signal.SIGINT)
            spy.wait(timeout=120)
            parts = by_process.setdefault(name, collections.Counter())
            if raw.exists():
                parts.update(attribute(raw.read_text()))
        self._dir.cleanup()
        per_image = 1000 / SAMPLES_PER_SECOND / images
        return {
            name: {part: round(samples * per_image, 1) for part, samples in _largest(parts)}
            for name, parts in by_process.items()
            if parts
        }


def attribute(collapsed: str) -> collections.Counter[str]:
    """Samples by part, and the rest's also by innermost frame (``rest: FRAME``)."""
    parts: collections.Counter[str] = collections.Counter()
    for line in collapsed.splitlines():
        stack, _, count = line.rpartition(" ")
        part = next(
            (name for name, files in PARTS.items() if any(f"{file}:" in stack for file in files)),
            OTHER,
        )
        parts[part] += int(count)
        if part == OTHER:
            parts[f"rest: {stack.split(';')[-1]}"] += int(count)
    return parts


def _largest(parts: collections.Counter[str]) -> list[tuple[str, int]]:
    """Every part, and the rest's five largest innermost frames."""
    whole = [(part, samples) for part, samples in parts.most_common() if not part.startswith("rest: ")]
    return whole + [(part, samples) for part, samples in parts.most_common() if part.startswith("rest: ")][:5]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=Path("~/.cache/ardit/models/qwen-image-full-tiny"))
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    parser.add_argument("--size", default="64x64")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--traffic", choices=("unique", "shared_prefix"), default="unique")
    parser.add_argument("--out", type=Path, default=paired.RESULTS / "vllm_omni_profile.json")
    args = parser.parse_args()
    args.fields = {"guidance_scale": 1.0}  # no CFG on either side, as in peer_compare.py --peer vllm-omni
    model = args.model.expanduser()
    report: dict = {
        "command": "python benchmarks/vllm_omni_profile.py " + " ".join(sys.argv[1:]),
        "machine": paired.machine(),
        "load_before": paired.load(),
        "systems": {},
    }
    for name, start in (
        (
            "ardit",
            lambda: start_ardit(
                {
                    "ARDIT_AR_MODEL_DIR": str(model),
                    "ARDIT_DIT_MODEL_DIR": str(model),
                    "ARDIT_AR_DTYPE": args.dtype,
                    "ARDIT_DIT_DTYPE": args.dtype,
                }
            ),
        ),
        ("vLLM-Omni", lambda: start_vllm_omni(model, args.dtype)),
    ):
        server = start()
        try:
            server.wait_ready()
            with httpx.Client() as client:
                one(client, server.url, prompt(args.traffic, 10_000), 0, args)
            spy = Spy(server)
            result = cell(server, args.traffic, 1, args.requests, 0, args)
            report["systems"][name] = {
                "images_per_min": round(result["images_per_min"], 1),
                "cpu_seconds_per_image_by_process": {
                    process: round(seconds, 3)
                    for process, seconds in result["cpu_seconds_per_image_by_process"].items()
                },
                "ms_per_image_by_process_and_part": spy.stop(args.requests),
            }
        finally:
            server.stop()
        print(json.dumps({name: report["systems"][name]}, indent=1), flush=True)
    report["load_after"] = paired.load()
    args.out.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
