"""Where a vLLM model worker's time goes: py-spy on the process it runs in (the AR runs it in vLLM's
engine core), its stacks sorted into parts.

``WorkerProfile(pid)`` samples that process (100 Hz, native frames included) until ``stop()``; the
samples are sorted into the parts of an engine step by the first frame that marks one, and given
as milliseconds per unit of work (per generated token, per request). py-spy samples wall time,
so a part that waits for a core on a busy machine grows with it; the split between parts is what
these profiles are for.
"""

from __future__ import annotations

import collections
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

SAMPLES_PER_SECOND = 100
# Checked in this order: the first part whose frame is on the stack takes the sample.
PARTS = {
    "rejection sampler": "RejectionSampler",
    "sampler": "GPUModelRunner._sample",
    "row write (draft layer)": "propose_draft_token_ids",
    "row read, final norm, send (connector)": "finalize_kv_connector",
    "attention kernel": "cpu_attention_with_kv_cache",
    "linear layers (oneDNN)": "onednn_mm",
    "rest of the forward (norms, rotary, cache write, activations)": "GPUModelRunner._model_forward",
    "input preparation": "GPUModelRunner._prepare_inputs",
    "logits": "compute_logits",
}
BETWEEN_STEPS = "between steps (scheduler, outputs, other threads and processes)"
IN_A_STEP = ("execute_model", "sample_tokens")


class WorkerProfile:
    def __init__(self, pid: int) -> None:
        self._dir = tempfile.TemporaryDirectory(prefix="ardit-py-spy-")
        self._raw = Path(self._dir.name) / "stacks.txt"
        py_spy = Path(sys.executable).with_name("py-spy")
        command = [str(py_spy), "record", "--native", "--rate", str(SAMPLES_PER_SECOND), "--format", "raw"]
        self._spy = subprocess.Popen(
            [*command, "--output", str(self._raw), "--pid", str(pid)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )

    def stop(self, units: float) -> dict:
        """Stop sampling; milliseconds per unit (``units``: tokens, requests) in each part."""
        self._spy.send_signal(signal.SIGINT)
        self._spy.wait(timeout=120)
        try:
            return attribute(self._raw.read_text(), units)
        finally:
            self._dir.cleanup()


def attribute(collapsed: str, units: float) -> dict:
    parts: collections.Counter[str] = collections.Counter()
    for line in collapsed.splitlines():
        stack, _, count = line.rpartition(" ")
        frames = [frame.split(" (")[0] for frame in stack.split(";")]
        if not any(mark in frame for frame in frames for mark in IN_A_STEP):
            part = BETWEEN_STEPS
        else:
            part = next((name for name, mark in PARTS.items() if any(mark in f for f in frames)), "other")
        parts[part] += int(count)
    per_unit = 1000 / SAMPLES_PER_SECOND / units
    return {
        "units": units,
        "samples": sum(parts.values()),
        "ms_per_unit": {name: round(samples * per_unit, 2) for name, samples in parts.most_common()},
    }
