"""A DiT's announcement for tests that need one without a DiT running."""

from __future__ import annotations

from shared.capabilities import DiffusionDefaults, DiffusionLimits, DitCapabilities, DitCapacity

DIT = DitCapabilities(
    model="qwen-image-tiny",
    description="a test model",
    row_width=576,
    conditioning=["qwen_image"],
    limits=DiffusionLimits(
        size_multiple=16,
        max_pixels=256 * 256,
        min_inference_steps=2,
        max_inference_steps=40,
        max_guidance_scale=10.0,
        max_images=4,
        max_conditioning_rows=64,
        output_formats=["png", "jpeg"],
        step_caches=["first_block", "taylorseer"],
    ),
    defaults=DiffusionDefaults(width=64, height=48, num_inference_steps=12, guidance_scale=1.0),
    capacity=DitCapacity(max_concurrent_handoffs=8, max_pipeline_runs=1, pipeline_queue_size=4),
)
