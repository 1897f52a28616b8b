"""Start ``vllm-omni serve`` on a Qwen-Image folder, generate a few images, check they are PNGs, stop the server.

    python benchmarks/vllm_omni/smoke.py MODEL_DIR [--dtype bfloat16|float32] [--requests 5] [--port 8391]

Prints the time from launch to a 200 on /health, and each request's wall time (64x64, 4 steps, one image, a
different seed each). The server runs in its own process group, which is killed on exit, whatever happens.
Standard library only; any Python runs it.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
VLLM_OMNI = ROOT / ".venv-vllm-omni" / "bin" / "vllm-omni"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", type=Path)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--requests", type=int, default=5)
    parser.add_argument("--port", type=int, default=8391)
    parser.add_argument("--ready-timeout", type=float, default=300.0)
    parser.add_argument("--log", type=Path, default=None, help="server log (default: a file in /tmp)")
    parser.add_argument("--out", type=Path, default=None, help="write the first image here")
    args = parser.parse_args()

    base = f"http://127.0.0.1:{args.port}"
    log_path = args.log or Path(f"/tmp/vllm-omni-smoke-{args.dtype}-{args.port}.log")
    cmd = [
        str(VLLM_OMNI),
        "serve",
        str(args.model.expanduser()),
        "--omni",
        "--enforce-eager",
        "--dtype",
        args.dtype,
        "--port",
        str(args.port),
    ]
    print("$", " ".join(cmd), f"> {log_path}")
    started = time.monotonic()
    with open(log_path, "wb") as log:
        server = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        while True:
            if server.poll() is not None:
                print(f"FAIL: server exited with {server.returncode} before ready; see {log_path}")
                return 1
            if time.monotonic() - started > args.ready_timeout:
                print(f"FAIL: not ready in {args.ready_timeout:.0f} s; see {log_path}")
                return 1
            try:
                with urllib.request.urlopen(f"{base}/health", timeout=2) as response:
                    if response.status == 200:
                        break
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.5)
        print(f"ready in {time.monotonic() - started:.1f} s")

        times = []
        for seed in range(args.requests):
            body = {"prompt": "a red square", "size": "64x64", "n": 1, "num_inference_steps": 4, "seed": seed}
            request = urllib.request.Request(
                f"{base}/v1/images/generations",
                data=json.dumps(body).encode(),
                headers={"Content-Type": "application/json"},
            )
            t0 = time.monotonic()
            try:
                with urllib.request.urlopen(request, timeout=300) as response:
                    payload = json.loads(response.read())
            except urllib.error.HTTPError as error:
                print(f"FAIL: HTTP {error.code}: {error.read()[:2000]!r}")
                return 1
            times.append(time.monotonic() - t0)
            png = base64.b64decode(payload["data"][0]["b64_json"])
            if not png.startswith(PNG_MAGIC):
                print(f"FAIL: request {seed} returned no PNG ({png[:8]!r})")
                return 1
            if seed == 0 and args.out is not None:
                args.out.write_bytes(png)
            metrics = payload.get("metrics") or {}
            print(f"request {seed}: {times[-1] * 1000:.0f} ms, PNG {len(png)} bytes, server metrics {metrics}")
        later = times[1:] or times
        mean_ms = sum(later) / len(later) * 1000
        print(f"OK: {len(times)} PNGs; first {times[0] * 1000:.0f} ms, later mean {mean_ms:.0f} ms")
        return 0
    finally:
        try:
            os.killpg(server.pid, signal.SIGTERM)
            server.wait(timeout=30)
        except ProcessLookupError:
            pass
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()


if __name__ == "__main__":
    sys.exit(main())
