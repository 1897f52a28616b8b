"""The assembled app: health, readiness around the model load, and the metric families operators use."""

from __future__ import annotations

import httpx
import pytest

from dit_service.app import create_dit_app
from dit_service.metrics import DitMetrics
from dit_service.settings import DitSettings
from services.dtype import default_dtype
from services.metrics import new_registry
from shared.capabilities import DitCapabilities, Load
from tests.dit_service.handoff_requests import complete_handoff, hidden_rows, post_handoff, scrape
from tests.support.live_server import LiveServer
from tests.support.waiting import wait_for

REQUIRED_FAMILIES = [
    "ardit_dit_handoffs_in_flight",
    "ardit_dit_handoff_received_bytes_total",
    "ardit_dit_handoff_received_frames_total",
    "ardit_dit_handoff_receive_seconds_bucket",
    "ardit_dit_handoff_buffer_bytes",
    "ardit_dit_queue_wait_seconds_bucket",
    "ardit_dit_denoise_seconds_bucket",
    "ardit_dit_vae_decode_seconds_bucket",
    "ardit_dit_encode_seconds_bucket",
    "ardit_dit_request_seconds_bucket",
    "ardit_dit_images_total",
    "ardit_dit_pipeline_runs_in_flight",
    "ardit_dit_build_info",
]


def test_a_model_that_cannot_load_keeps_the_service_unready(tmp_path):
    settings = DitSettings(model_dir=tmp_path / "missing", handoff_token="t")
    server = LiveServer(create_dit_app(settings)).start()
    try:
        assert httpx.get(f"{server.url}/healthz").json() == {"status": "ok"}

        def readyz() -> dict:
            return httpx.get(f"{server.url}/readyz").json()

        wait_for(lambda: "failed" in readyz()["reason"], 30, "the load failed", state=readyz)
        assert readyz()["status"] == "not_ready"
        answer = post_handoff(
            server.url,
            complete_handoff(hidden_rows(4)),
            headers={"authorization": "Bearer t", "content-type": "application/vnd.ardit.handoff+msgpack"},
        )
        assert answer.status == 503 and answer.refusal["code"] == "model_not_ready"
        assert answer.headers["retry-after"]
    finally:
        server.stop()


@pytest.mark.slow
def test_ready_only_after_warm_up_and_metrics_are_exported(dit_server):
    ready = httpx.get(f"{dit_server.url}/readyz").json()
    assert (ready["status"], ready["reason"]) == ("ready", "ready")
    capabilities = DitCapabilities.model_validate(ready["capabilities"])
    # The server's settings and the loaded model, announced: max_sequence_length=64, two runs + four queued.
    assert capabilities.limits.max_conditioning_rows == 64 and capabilities.capacity.max_admitted == 6
    assert capabilities.row_width == 576 and capabilities.limits.size_multiple == 16
    # The warm-up timed its renders: the default request costs something at the pace announced, and so do steps,
    # though this model's VAE outweighs a few of them.
    pace = capabilities.pace
    assert pace is not None and pace.seconds(Load.of(capabilities.defaults.params())) > 0 and pace.per_work > 0
    assert post_handoff(dit_server.url, complete_handoff(hidden_rows(6))).status == 200
    samples = scrape(dit_server.url)
    names = {name for name, _ in samples}
    assert not [family for family in REQUIRED_FAMILIES if family not in names]
    [info] = [dict(labels) for name, labels in samples if name == "ardit_dit_build_info"]
    assert (
        info["dtype"] == default_dtype("cpu")
        and info["device"] == "cpu"
        and info["model"] == "tiny-ar"
        and info["version"]
    )
    assert samples[("ardit_dit_images_total", frozenset({("format", "png")}))] >= 1
    # No label carries a request id.
    assert not [labels for _, labels in samples if any("req_" in value for _, value in labels)]


def test_request_histogram_reaches_minutes():
    buckets = DitMetrics(new_registry()).request_seconds._upper_bounds
    assert buckets[0] <= 0.01 and buckets[-2] >= 300
