"""DiT service settings, read from ``ARDIT_DIT_*`` environment variables (and ``ARDIT_HANDOFF_TOKEN``)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from services.checkpoints import DIT_MODEL, default_model_dir
from services.dtype import DtypeName, default_dtype
from services.heap import RELEASE_IDLE_SECONDS
from services.model_card import ModelCard
from services.settings import (
    DEFAULT_DRAIN_SECONDS,
    HEAD_BYTES,
    HEAD_SECONDS,
    HandoffToken,
    HeadBytes,
    HeadSeconds,
    LogLevel,
    MaxConnections,
    NonNegative,
    Port,
    Positive,
    ReleaseIdleSeconds,
    Seconds,
)
from shared.diffusion import MAX_IMAGES, Size
from shared.frame_codec import FrameLimits
from shared.handoff_assembler import AssemblyCaps


class DitSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="ARDIT_DIT_", populate_by_name=True, frozen=True)

    # --- model -------------------------------------------------------------------------------
    model_dir: Path = Field(
        default_factory=lambda: default_model_dir(DIT_MODEL),
        description="QwenImagePipeline directory (no text encoder needed).",
    )
    device: Literal["cpu", "cuda"] = Field("cpu", description="Where the pipeline runs.")
    dtype: DtypeName | None = Field(
        None,
        description="Model dtype (None: bfloat16 on CUDA, and on a CPU that multiplies bf16 natively, AVX512-BF16 or "
        "AMX; float32 on other CPUs).",
    )
    torch_threads: Positive | None = Field(
        None, description="torch intra-op threads (None: on CPU the model card's cpu_threads, else torch's default)."
    )
    expected_model: str | None = Field(
        None, description="If set, the AR model tag every handoff's open.model must equal (else 4xx)."
    )

    # --- HTTP ----------------------------------------------------------------------------------
    host: str = Field("127.0.0.1", description="Bind address.")
    port: Port = Field(8001, description="Bind port.")
    drain_seconds: Seconds = Field(
        DEFAULT_DRAIN_SECONDS,
        description="On SIGTERM, how long reserved and running handoffs may finish (new reservations get 503) "
        "before the service stops.",
    )
    handoff_token: HandoffToken = None
    request_head_timeout_seconds: HeadSeconds = HEAD_SECONDS
    max_request_head_bytes: HeadBytes = HEAD_BYTES
    max_connections: MaxConnections = None
    log_level: LogLevel = "INFO"
    release_memory_idle_seconds: ReleaseIdleSeconds = RELEASE_IDLE_SECONDS

    # --- admission -----------------------------------------------------------------------------
    max_concurrent_handoffs: Positive = Field(
        8, description="Requests this DiT holds at once, from reservation to the end of the run (with the next two)."
    )
    max_pipeline_runs: Positive = Field(1, description="Pipeline runs executing at once.")
    pipeline_queue_size: NonNegative = Field(
        4,
        description="Requests that may wait for a pipeline run; places are max_pipeline_runs plus this (at most "
        "max_concurrent_handoffs); beyond them: 429.",
    )
    retry_after_seconds: Positive = Field(1, description="Retry-After sent with 429/503.")
    reservation_seconds: Seconds = Field(
        30.0, description="A place an AR reserved is held this long for the handoff that names it."
    )
    stall_timeout_seconds: Seconds = Field(
        30.0, description="A handoff that sends no bytes for this long is ended and its memory released."
    )
    handoff_deadline_seconds: Seconds = Field(
        300.0, description="Longest handoff from its first byte to close, however steadily bytes trickle in."
    )
    progress_interval_seconds: Seconds = Field(
        2.0, description="A progress frame goes to the AR after this long without a result frame (queued or rendering)."
    )
    batch_max_size: Positive = Field(
        1, description="Compatible text-to-image requests denoised as one batch, at most (1: no batching)."
    )
    batch_window_ms: Annotated[float, Field(ge=0)] = Field(
        20.0, description="How long the next run waits for compatible requests to batch with (batching on)."
    )
    max_consecutive_pipeline_failures: Positive = Field(
        3, description="Pipeline runs failing in a row before the DiT declares itself broken and exits."
    )

    # --- receiver caps (shared AssemblyCaps / FrameLimits) -------------------------------------
    max_rows: Positive = Field(AssemblyCaps.max_rows, description="Max rows per stream.")
    max_row_width: Positive = Field(AssemblyCaps.max_row_width, description="Widest row an open frame may announce.")
    max_buffer_bytes: Positive = Field(
        AssemblyCaps.max_bytes, description="Max bytes of rows and edit pixels one handoff may allocate."
    )
    max_picture_pixels_per_handoff: Positive = Field(
        8 << 20, description="Max width*height of an edit's pictures together (each also within max_pixels)."
    )
    max_frame_header_bytes: Annotated[int, Field(ge=64)] = Field(
        FrameLimits.max_header_bytes, description="Max bytes of one frame's msgpack header."
    )
    max_frame_payload_bytes: Positive = Field(FrameLimits.max_payload_bytes, description="Max row bytes in one frame.")
    idle_row_buffer_bytes: NonNegative = Field(
        256 << 20, description="Released row buffers kept for reuse (0: allocate fresh each handoff)."
    )

    # --- conditioning ----------------------------------------------------------------------------
    special_token_ids: frozenset[int] = Field(
        frozenset(), description="Token ids whose rows ar_generated drops from the text part (JSON list in env)."
    )
    image_token_start_id: NonNegative | None = Field(
        None, description="ar_generated: only generated rows with token id >= this are image rows (None: all)."
    )
    max_sequence_length: Annotated[int, Field(ge=1, le=1024)] | None = Field(
        None,
        description="Most conditioning rows the DiT takes; more is a 4xx, never a silent truncation (None: its "
        "family's, from its model card: 512, or 1024 for an edit model whose rows hold the pictures).",
    )

    def conditioning_rows(self, card: ModelCard) -> int:
        """The most conditioning rows this DiT takes of ``card``'s family: the setting, else the card's."""
        return self.max_sequence_length or card.max_rows

    pad_to_multiple: Positive = Field(
        1, description="Right-pad conditioning to a multiple of this (with a mask) so few shapes occur."
    )

    # --- diffusion defaults (announced to the AR; None: the model's ardit.json, else the fallback) -
    default_size: Size | None = Field(
        None,
        description="WIDTHxHEIGHT for size=auto (None: the model card's, else the first listed size, else 256x256).",
    )
    default_num_inference_steps: Positive | None = Field(
        None, description="Steps when a request names neither steps nor quality (None: the model card's, else 8)."
    )
    default_guidance_scale: Annotated[float, Field(ge=0)] | None = Field(
        None,
        description="guidance_scale when a request gives none (None: the model card's, else 1.0); CFG above the "
        "family's cfg_above (Qwen-Image: 1, Z-Image: 0).",
    )

    # --- diffusion limits (announced to the AR, enforced on every open frame) ---------------------
    max_pixels: Positive = Field(2 * 1024 * 1024, description="Max width*height.")
    max_inference_steps: Positive = Field(100, description="Max num_inference_steps.")
    max_images_per_handoff: Annotated[int, Field(ge=1, le=MAX_IMAGES)] = Field(
        MAX_IMAGES, description="Max num_images (OpenAI's n goes up to 10)."
    )
    max_guidance_scale: Annotated[float, Field(ge=0)] = Field(50.0, description="Max guidance_scale.")
    sizes: list[Size] | None = Field(
        None,
        description="The only sizes drawn, a JSON list of WIDTHxHEIGHT (None: the model card's list; []: any size "
        "within max_pixels).",
    )

    @property
    def torch_dtype_name(self) -> DtypeName:
        return self.dtype if self.dtype is not None else default_dtype(self.device)

    @property
    def assembly_caps(self) -> AssemblyCaps:
        return AssemblyCaps(
            max_rows=self.max_rows,
            max_row_width=self.max_row_width,
            max_bytes=self.max_buffer_bytes,
            max_image_pixels=self.max_pixels,
            max_edit_pixels=self.max_picture_pixels_per_handoff,
        )

    @property
    def frame_limits(self) -> FrameLimits:
        return FrameLimits(max_header_bytes=self.max_frame_header_bytes, max_payload_bytes=self.max_frame_payload_bytes)
