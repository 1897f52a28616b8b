"""ardit against a peer: the same client, the same models, the same images, two ways of serving them.

ardit runs as ``make run`` runs it (``python -m services.launcher``: the AR on vLLM and the DiT, two
processes, at their defaults, on free ports); the peer is ``benchmarks/peer_server.py`` (one process
in diffusers' example-server style: transformers computes the SmolLM2 rows for every request, the
same DiT code renders). Both are up at once and take turns: every cell (traffic x concurrency) is
run on one server then the other, in alternating order, ``--repeats`` times, so the machine's other
load hits both alike.

Traffic:

- ``shared_prefix``: a long common style prompt (its templated prompt fills 4 KV blocks of 128,
  then some) and a short unique subject per request: ardit's prefix cache holds the style;
- ``unique``: a short prompt that differs from its first word: nothing to share but the template.

Concurrency 1, 4, 8: that many clients, each sending its next request when the last one returns,
``--requests`` per cell. Reported per cell and server: images/min, latency p50/p99, the ardit/peer
ratios per repeat (median, p10-p90), CPU-seconds per image, and the peak RSS of each server's process tree from
launch and once ready (start-up's weights and warm-up apart from serving), each also process by process. At
concurrency 1, ardit's ``server-timing`` stages split its end-to-end time into compute (AR engine,
DiT denoise/VAE/encode) and serving overhead, per stage.

    python benchmarks/peer_compare.py [--requests 12] [--repeats 2] [--size 64x64] [--steps 4]

``--ardit-env KEY=VALUE ...`` adds settings to ardit's environment; ``--versus-ardit-env KEY=VALUE ...``
puts ardit with those settings in the peer's place (reported as "peer"): a setting against the
defaults, side by side on the same traffic. ``--background-load CORES`` keeps that many cores busy
(a spinning process each, ``paired.BackgroundLoad``) while the cells run, for both sides alike: a
machine something else is using.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import paired
import psutil

paired.use_this_checkout()

from load import server_timing  # noqa: E402

STYLE = (
    "In the style of a late nineteenth century oil painting on heavy linen canvas, with thick impasto "
    "brushwork, warm umber underpainting showing through thin glazes, soft diffused window light from the "
    "upper left, a muted palette of ochre, burnt sienna, olive green and slate blue, visible craquelure in "
    "the varnish, a shallow depth of field with the background dissolving into loose strokes, deep shadows "
    "that keep some colour, highlights laid on with a palette knife, a composition that follows the rule of "
    "thirds, a low horizon line, atmospheric perspective that cools and lightens the distance, subtle rim "
    "light separating the subject from the ground, gentle chromatic variation in the skin and cloth, a "
    "restrained use of pure white, and a gilded frame just visible at the edges of the picture, as if "
    "photographed in a quiet museum gallery on an overcast afternoon with no reflections on the glass. "
    "The mood is calm and contemplative, the light is golden and low, the air is slightly hazy, and the "
    "textures of wood, stone, fabric and foliage are rendered with loving care and a steady hand. "
    "Around the subject the painter leaves generous negative space, a wall of weathered plaster in grey "
    "and sand tones with faint traces of an older fresco, a wooden table whose grain catches the light, a "
    "folded linen cloth with crisp creases and soft blue shadows, a pewter jug reflecting the window, a "
    "few scattered petals, a brass candlestick with a burnt down candle, and a small bird perched on the "
    "window frame looking in. The brushwork is looser at the edges and tighter at the focal point, the "
    "paint is thin in the shadows and thick in the lights, and every edge is either lost or found on "
    "purpose. The colours are harmonised by a single warm light and a cool fill from the room, the "
    "values are grouped into three clear masses, and the whole picture reads at a glance from across the "
    "room while rewarding a closer look with small surprises in the details of the still life and cloth. "
    "A narrow strip of sky at the top of the window shows a pale lemon yellow fading into a cool grey, a "
    "distant church tower and a row of poplars sit on the far hill, and the glass itself has the slight "
    "ripples of old hand blown panes that bend the view of the garden outside into gentle waves. "
)
SUBJECTS = ["a red fox", "an old lighthouse", "a bowl of pears", "a sleeping cat", "a sailing boat", "a violin"]
WORDS = [
    "amber",
    "birch",
    "cobalt",
    "dune",
    "ember",
    "fjord",
    "garnet",
    "harbor",
    "indigo",
    "juniper",
    "kelp",
    "lagoon",
    "meadow",
    "nectar",
    "onyx",
]


def prompt(traffic: str, index: int) -> str:
    if traffic == "shared_prefix":
        return f"{STYLE}Subject {index}: {SUBJECTS[index % len(SUBJECTS)]} at number {index}."
    words = " ".join(WORDS[(index * 7 + k * 3) % len(WORDS)] for k in range(12))
    return f"{index} {words}, a small picture of {SUBJECTS[index % len(SUBJECTS)]}"


class Server:
    def __init__(
        self, name: str, url: str, process: subprocess.Popen, ready_path: str = "/readyz", group: bool = False
    ) -> None:
        """``group``: the process leads a process group of its own, stopped whole."""
        self.name, self.url, self.process, self.ready_path, self.group = name, url, process, ready_path, group
        self.peak_rss = 0
        self.peak_rss_by_role: dict[str, int] = {}  # each process's share of the peak, at the peak
        # The same once ready: start-up (weights read, a warm-up render) apart from serving.
        self.serving = False
        self.serving_peak_rss = 0
        self.serving_peak_rss_by_role: dict[str, int] = {}
        self._stop = threading.Event()
        self._sampler = threading.Thread(target=self._sample, daemon=True)
        self._sampler.start()

    def _sample(self) -> None:
        root = psutil.Process(self.process.pid)
        while not self._stop.wait(0.25):
            try:
                by_role = paired.tree_rss_by_role(root)
            except psutil.Error:
                continue
            total = sum(by_role.values())
            if total > self.peak_rss:
                self.peak_rss, self.peak_rss_by_role = total, by_role
            if self.serving and total > self.serving_peak_rss:
                self.serving_peak_rss, self.serving_peak_rss_by_role = total, by_role

    def wait_ready(self, seconds: float = 900) -> None:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.process.returncode}")
            try:
                if httpx.get(f"{self.url}{self.ready_path}", timeout=2).status_code == 200:
                    self.serving = True
                    return
            except httpx.TransportError:
                pass
            time.sleep(1)
        raise RuntimeError(f"{self.name} not ready in {seconds} s")

    def cpu_seconds(self) -> dict[str, float]:
        """CPU seconds so far of each role in the server's process tree."""
        return paired.tree_cpu_by_role(psutil.Process(self.process.pid))

    def stop(self) -> None:
        self._stop.set()
        if self.group:
            os.killpg(self.process.pid, signal.SIGINT)
        else:
            self.process.send_signal(signal.SIGINT)
        try:
            self.process.wait(120)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(30)
        if self.group:  # what it started goes with it
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)


def start_ardit(settings: dict[str, str], name: str = "ardit") -> Server:
    """ardit as ``make run`` starts it, with ``settings`` added to its environment."""
    ar_port, dit_port = paired.free_port(), paired.free_port()
    env = os.environ | {
        "ARDIT_AR_PORT": str(ar_port),
        "ARDIT_DIT_PORT": str(dit_port),
        "ARDIT_AR_LOG_LEVEL": "WARNING",
        "ARDIT_DIT_LOG_LEVEL": "WARNING",
        **settings,
    }
    process = paired.child(
        [sys.executable, "-m", "services.launcher"], env=env, cwd=paired.REPO, stdout=subprocess.DEVNULL
    )
    return Server(name, f"http://127.0.0.1:{ar_port}", process)


OMNI_VENV = paired.REPO / ".venv-vllm-omni"


def omni_model(model: Path, dtype: str) -> Path:
    """The folder vLLM-Omni serves at ``dtype``: the model's own in bf16; in fp32 a copy whose text encoder is saved
    in fp32 (vLLM-Omni loads the text encoder in its saved dtype, whatever ``--dtype`` says)."""
    if dtype == "bfloat16":
        return model
    copy = model.with_name(model.name + "-fp32te")
    if not copy.exists():
        script = Path(__file__).parent / "vllm_omni" / "fp32_text_encoder.py"
        subprocess.run([str(OMNI_VENV / "bin" / "python"), str(script), str(model), str(copy)], check=True)
    return copy


def start_vllm_omni(model: Path, dtype: str) -> Server:
    """vLLM-Omni (``benchmarks/vllm_omni/setup.sh``) serving ``model`` on its OpenAI Images API."""
    port = paired.free_port()
    process = paired.child(
        [
            str(OMNI_VENV / "bin" / "vllm-omni"),
            "serve",
            str(omni_model(model, dtype)),
            "--omni",
            "--enforce-eager",
            "--dtype",
            dtype,
            "--port",
            str(port),
        ],
        cwd=paired.REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    return Server("peer", f"http://127.0.0.1:{port}", process, ready_path="/health", group=True)


def start_peer() -> Server:
    port = paired.free_port()
    process = paired.child(
        [sys.executable, str(Path(__file__).with_name("peer_server.py")), "--port", str(port)],
        cwd=paired.REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    return Server("peer", f"http://127.0.0.1:{port}", process)


def one(client: httpx.Client, url: str, text: str, seed: int, args: argparse.Namespace) -> dict:
    """One image, as a client gets it: a 429 is waited out (its Retry-After) and sent again, as OpenAI's SDK does,
    and counted; the latency is the whole of it."""
    started, refused = time.perf_counter(), 0
    while True:
        response = client.post(
            f"{url}/v1/images/generations",
            json={"prompt": text, "size": args.size, "seed": seed, "num_inference_steps": args.steps, **args.fields},
            timeout=900,
        )
        if response.status_code != 429:
            break
        refused += 1
        time.sleep(float(response.headers.get("retry-after", "1")))
    seconds = time.perf_counter() - started
    if response.status_code != 200 or not response.json()["data"][0]["b64_json"]:
        raise RuntimeError(f"{url}: {response.status_code} {response.text[:300]}")
    return {"seconds": seconds, "refused": refused, "stages": server_timing(response.headers.get("server-timing", ""))}


def cell(server: Server, traffic: str, concurrency: int, requests: int, first: int, args: argparse.Namespace) -> dict:
    indices = list(range(first, first + requests))
    lock = threading.Lock()
    results: list[dict] = []

    def client_loop() -> None:
        with httpx.Client() as client:
            while True:
                with lock:
                    if not indices:
                        return
                    index = indices.pop(0)
                result = one(client, server.url, prompt(traffic, index), index, args)
                with lock:
                    results.append(result)

    started, cpu_before = time.perf_counter(), server.cpu_seconds()
    with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
        for future in [pool.submit(client_loop) for _ in range(concurrency)]:
            future.result()
    wall = time.perf_counter() - started
    latencies = sorted(r["seconds"] for r in results)
    cpu_after = server.cpu_seconds()
    by_process = {name: (seconds - cpu_before.get(name, 0.0)) / len(results) for name, seconds in cpu_after.items()}
    return {
        "images_per_min": 60 * len(results) / wall,
        "cpu_seconds_per_image": sum(by_process.values()),
        "cpu_seconds_per_image_by_process": by_process,
        "refused": sum(r["refused"] for r in results),
        "latency_p50_s": statistics.median(latencies),
        "latency_p99_s": latencies[min(len(latencies) - 1, round(0.99 * (len(latencies) - 1)))],
        "samples": results,
    }


def overhead(samples: list[dict]) -> dict:
    """ardit at concurrency 1: end-to-end = compute (AR engine, DiT) + serving overhead, per stage."""
    parts: dict[str, list[float]] = {}
    for s in samples:
        st = s["stages"]
        ar_compute = st["ar_total"] - st["queue"]
        dit_compute = sum(st.get(f"dit_{k}", 0.0) for k in ("denoise", "previews", "vae_decode", "encode"))
        # With CFG the handoff also waits for the negative prompt's engine run (``negative_tail``).
        negative = st.get("negative_tail", 0.0)
        staged = st["ar_total"] + negative + st["handoff_tail"] + st["dit_queue"] + dit_compute
        split = {
            "AR engine (compute)": ar_compute,
            "AR engine, the negative prompt's run after the prompt's (CFG)": negative,
            "DiT denoise + VAE + encode (compute)": dit_compute,
            "AR before the engine (HTTP, admission, template)": st["queue"],
            "handoff tail (AR's last row -> DiT holds the rows)": st["handoff_tail"],
            "DiT queue": st["dit_queue"],
            "rest of the server (images back, response)": st["total"] - staged,
            "client <-> server (HTTP, JSON, base64)": s["seconds"] - st["total"],
        }
        compute = ar_compute + dit_compute
        split["overhead share of end-to-end"] = (s["seconds"] - compute) / s["seconds"]
        for k, v in split.items():
            parts.setdefault(k, []).append(v)
    return {
        k: paired.spread(v) if k.endswith("end-to-end") else paired.spread([x * 1e3 for x in v])
        for k, v in parts.items()
    }


def _settings(pairs: list[str]) -> dict[str, str]:
    return dict(pair.split("=", 1) for pair in pairs)


def _env_flags(args: argparse.Namespace) -> list[tuple[str, list[str]]]:
    flags = [("ardit-env", args.ardit_env)] if args.ardit_env else []
    return flags + ([("versus-ardit-env", args.versus_ardit_env)] if args.versus_ardit_env is not None else [])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=12, help="requests per cell")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--size", default="64x64")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--concurrency", default="1,4,8")
    parser.add_argument("--out", type=Path, default=paired.RESULTS / "peer_compare.json")
    parser.add_argument("--ardit-env", nargs="*", default=[], metavar="KEY=VALUE", help="added to ardit's environment")
    parser.add_argument(
        "--versus-ardit-env",
        nargs="*",
        metavar="KEY=VALUE",
        help="the other side is ardit with these added to its environment, not the peer: ardit against itself",
    )
    parser.add_argument(
        "--background-load",
        type=int,
        default=0,
        metavar="CORES",
        help="keep this many cores busy while the cells run (both sides alike): a machine in use",
    )
    parser.add_argument(
        "--peer",
        choices=("stand-in", "vllm-omni"),
        default="stand-in",
        help="the peer: benchmarks/peer_server.py (a secondary baseline), or vLLM-Omni (benchmarks/vllm_omni/setup.sh) "
        "serving --model at --dtype, ardit serving the same folder at the same dtype, both without CFG",
    )
    parser.add_argument("--model", type=Path, help="with --peer vllm-omni: a Qwen-Image folder, text encoder included")
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), help="with --peer vllm-omni: both sides' dtype")
    args = parser.parse_args()
    omni = args.peer == "vllm-omni"
    if omni and (args.model is None or args.dtype is None or args.versus_ardit_env is not None):
        parser.error("--peer vllm-omni takes --model and --dtype, and no --versus-ardit-env")
    if omni:
        model = str(args.model.expanduser())
        args.ardit_env = [
            *args.ardit_env,
            f"ARDIT_AR_MODEL_DIR={model}",
            f"ARDIT_DIT_MODEL_DIR={model}",
            f"ARDIT_AR_DTYPE={args.dtype}",
            f"ARDIT_DIT_DTYPE={args.dtype}",
        ]
    # The same work on both sides: vLLM-Omni runs Qwen-Image's CFG only for a negative prompt, so ardit is asked
    # for none either (its card's default is CFG 4); the stand-in renders as it does (see its page).
    args.fields = {"guidance_scale": 1.0} if omni else {}
    concurrencies = [int(c) for c in args.concurrency.split(",")]
    report: dict = {
        "command": "python benchmarks/peer_compare.py "
        + f"--requests {args.requests} --repeats {args.repeats} --size {args.size} --steps {args.steps} "
        + f"--concurrency {args.concurrency}"
        + (f" --peer vllm-omni --model {args.model} --dtype {args.dtype}" if omni else "")
        + (f" --background-load {args.background_load}" if args.background_load else "")
        + "".join(f" --{flag} {' '.join(values)}" for flag, values in _env_flags(args)),
        "machine": paired.machine(),
        "load_before": paired.load(),
        "settings": "ardit: make run's defaults (launcher), ports only"
        + (f", and {' '.join(args.ardit_env)}" if args.ardit_env else "")
        + "; peer: "
        + (
            f"vLLM-Omni 0.30.0 (vllm-omni serve {args.model} --omni --enforce-eager --dtype {args.dtype})"
            if omni
            else "benchmarks/peer_server.py"
            if args.versus_ardit_env is None
            else f"ardit, make run's defaults and {' '.join(args.versus_ardit_env) or 'nothing else'}"
        ),
    }
    started = time.time()
    if omni:
        other = start_vllm_omni(args.model.expanduser(), args.dtype)
    elif args.versus_ardit_env is None:
        other = start_peer()
    else:
        other = start_ardit(_settings(args.versus_ardit_env), "peer")
    servers = [start_ardit(_settings(args.ardit_env)), other]
    runs: dict = {}
    background = paired.BackgroundLoad(args.background_load)
    try:
        for server in servers:
            server.wait_ready()
        for server in servers:  # warm: first request of each traffic (ardit: fills the style's cache)
            for traffic in ("shared_prefix", "unique"):
                with httpx.Client() as client:
                    one(client, server.url, prompt(traffic, 10_000), 0, args)
        index = 0
        background.start()
        for repeat in range(args.repeats):
            for traffic in ("shared_prefix", "unique"):
                for concurrency in concurrencies:
                    order = servers if (repeat + concurrency) % 2 == 0 else servers[::-1]
                    for server in order:
                        result = cell(server, traffic, concurrency, args.requests, index, args) | {
                            "load_1m": paired.load()["load_1m"]
                        }
                        runs.setdefault(f"{traffic} c={concurrency}", {}).setdefault(server.name, []).append(result)
                        print(
                            f"{traffic} c={concurrency} {server.name}: {result['images_per_min']:.1f} img/min, "
                            f"p50 {result['latency_p50_s']:.2f} s (load {result['load_1m']})",
                            flush=True,
                        )
                    index += args.requests
    finally:
        background.stop()
        for server in servers:
            server.stop()
    report["peak_rss_mb"] = {server.name: round(server.peak_rss / 2**20) for server in servers}
    report["peak_rss_mb_by_process"] = {
        server.name: {name: round(rss / 2**20) for name, rss in sorted(server.peak_rss_by_role.items())}
        for server in servers
    }
    report["serving_peak_rss_mb"] = {server.name: round(server.serving_peak_rss / 2**20) for server in servers}
    report["serving_peak_rss_mb_by_process"] = {
        server.name: {name: round(rss / 2**20) for name, rss in sorted(server.serving_peak_rss_by_role.items())}
        for server in servers
    }
    report["cells"] = {}
    for name, by_server in runs.items():
        a, p = by_server["ardit"], by_server["peer"]
        report["cells"][name] = {
            server: {
                "images_per_min": paired.spread([r["images_per_min"] for r in rs]),
                "latency_p50_s": paired.spread([r["latency_p50_s"] for r in rs]),
                "latency_p99_s": paired.spread([r["latency_p99_s"] for r in rs]),
                "cpu_seconds_per_image": paired.spread([r["cpu_seconds_per_image"] for r in rs]),
                "cpu_seconds_per_image_by_process": {
                    name: statistics.median(r["cpu_seconds_per_image_by_process"].get(name, 0.0) for r in rs)
                    for name in sorted({name for r in rs for name in r["cpu_seconds_per_image_by_process"]})
                },
                "refused_429": sum(r["refused"] for r in rs),
                "load_1m": [r["load_1m"] for r in rs],
            }
            for server, rs in by_server.items()
        } | {
            "ardit/peer images_per_min": paired.spread(
                [x["images_per_min"] / y["images_per_min"] for x, y in zip(a, p, strict=True)]
            ),
            "ardit/peer latency_p50": paired.spread(
                [x["latency_p50_s"] / y["latency_p50_s"] for x, y in zip(a, p, strict=True)]
            ),
            "ardit/peer latency_p99": paired.spread(
                [x["latency_p99_s"] / y["latency_p99_s"] for x, y in zip(a, p, strict=True)]
            ),
            "ardit/peer cpu_seconds_per_image": paired.spread(
                [x["cpu_seconds_per_image"] / y["cpu_seconds_per_image"] for x, y in zip(a, p, strict=True)]
            ),
        }
    ardit_c1 = [s for name in runs if name.endswith("c=1") for r in runs[name]["ardit"] for s in r["samples"]]
    report["ardit_serving_overhead_c1"] = overhead(ardit_c1) if ardit_c1 else None
    report["load_after"] = paired.load()
    report["wall_seconds"] = round(time.time() - started)
    cells = report["cells"]
    report["targets"] = {
        "ardit >= 2x images/min on shared_prefix at c=8 (median)": cells["shared_prefix c=8"][
            "ardit/peer images_per_min"
        ]["p50"]
        >= 2.0
        if "shared_prefix c=8" in cells
        else None,
        "ardit <= 1.1x peer latency on unique at c=1 (median)": cells["unique c=1"]["ardit/peer latency_p50"]["p50"]
        <= 1.1
        if "unique c=1" in cells
        else None,
        "serving overhead <= 5% of end-to-end at c=1 (median)": report["ardit_serving_overhead_c1"][
            "overhead share of end-to-end"
        ]["p50"]
        <= 0.05
        if ardit_c1
        else None,
    }
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps({"cells": {k: {kk: vv for kk, vv in v.items() if "/" in kk} for k, v in cells.items()}}, indent=1))
    print(json.dumps({"overhead": report["ardit_serving_overhead_c1"], "targets": report["targets"]}, indent=1))


if __name__ == "__main__":
    main()
