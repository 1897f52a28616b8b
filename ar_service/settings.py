"""AR service settings, from ``ARDIT_AR_*`` environment variables (and ``ARDIT_HANDOFF_TOKEN``).

``python -m ar_service --help`` lists the same settings as command-line flags.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field, SecretStr
from pydantic_settings import BaseSettings, SettingsConfigDict

from services.checkpoints import AR_MODEL, default_model_dir
from services.dtype import DtypeName, default_dtype
from services.heap import RELEASE_IDLE_SECONDS
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
from shared.row_recipe import RowRecipe

# The demo DiT is conditioned on this layer of SmolLM2's 30: its held-out colour x shape pairs came out right
# more often there than on the last layer, where every row after a colour word has read it (benchmarks/results/
# demo_dit_ablation.json). The recipe (deploy/checkpoints/train_demo_dit.py) trains on this default.
DEMO_HIDDEN_LAYER = 8
# How the demo DiT reads rows (its card says so too): what an AR serving a language model's own folder, which has
# no card, captures. Otherwise Qwen-Image's: its template, after the final norm, the template's rows dropped.
DEMO_ROWS = RowRecipe(layers=[DEMO_HIDDEN_LAYER])


class ArSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="ARDIT_AR_", populate_by_name=True, frozen=True)

    # --- model and engine ------------------------------------------------------------------------
    model_dir: Path = Field(
        default_factory=lambda: default_model_dir(AR_MODEL), description="HF checkpoint directory vLLM serves."
    )
    served_model_name: str = Field("ardit", description="The model id of the public API (/v1/models).")
    dtype: DtypeName | None = Field(
        None,
        description="Engine dtype (None: bfloat16 on a GPU, and on a CPU that multiplies bf16 natively, AVX512-BF16 "
        "or AMX; float32 on other CPUs, where bf16 is emulated).",
    )
    block_size: Annotated[int, Field(ge=16)] | None = Field(
        None, description="KV cache block size (None: the engine's default, 128 on CPU, 16 on GPU)."
    )
    enable_prefix_caching: bool = Field(True, description="Automatic prefix caching.")
    kv_cache_bytes: Positive | None = Field(
        None,
        description="KV cache size in bytes (None: room for the longest request and one block for each other "
        "sequence scheduled with it; a GPU host sets its own).",
    )
    max_model_len: Positive | None = Field(
        None,
        description="Longest prompt + generation (None: max_prompt_tokens + max_new_tokens_limit, the longest "
        "request the API admits).",
    )
    max_num_seqs: Positive = Field(16, description="Sequences the engine schedules together.")
    max_num_batched_tokens: Positive | None = Field(
        None, description="Tokens per engine step (chunked prefill chunk); None: vLLM's default."
    )
    compile: bool = Field(False, description="torch.compile the model (slow start on CPU; eager by default).")
    capture_hidden_states: bool = Field(
        True, description="Capture hidden rows (off only for measuring the capture's overhead)."
    )
    capture_without_draft: bool = Field(
        True,
        description="Decode one token per step with capture on: drop the duplicate draft token vLLM's "
        "extract_hidden_states schedules (off only for measuring its cost).",
    )
    # How rows are read (layer, final norm, template, adapter) is the DiT's model card's: the AR reads it from the
    # pipeline folder it serves, the same file the DiT announces from, and checks the DiT's announcement against
    # it. The four settings below override it, one part each, for experiments: a DiT reading rows otherwise
    # refuses them.
    hidden_layer: NonNegative | None = Field(
        None,
        description="Capture this one decoder layer's output (1 the first, 0 the embeddings, the model's layer count "
        "the last). None: the layers of the model card of the pipeline folder served (Qwen-Image as published: its "
        "text encoder's last; Z-Image: the one before; FLUX.2 [klein]: 9, 18 and 27), or for a language model's own "
        "folder the layer the demo DiT was trained on.",
    )
    final_norm: bool | None = Field(
        None, description="Apply the model's final norm to captured rows (None: as the model card says)."
    )
    seed: int = Field(0, description="Engine seed.")
    kv_events_publisher: Literal["off", "zmq"] = Field(
        "off", description="Publish vLLM's KV-cache events (BlockStored/BlockRemoved) for prefix-aware routers."
    )
    kv_events_endpoint: str = Field(
        "tcp://127.0.0.1:5557",
        description="Where the AR publishes KV-cache events (routers dial it): loopback unless set; they carry "
        "every prompt's token ids, so bind the pod's own address and let a NetworkPolicy pick the subscribers.",
    )
    kv_events_topic: str = Field("", description="ZMQ topic of the KV-cache events (llm-d: kv@<pod ip>@<model>).")

    # --- prompts ---------------------------------------------------------------------------------
    prompt_template: str | None = Field(
        None,
        description="Python format string with one {} for the prompt (None: the model card's, Qwen-Image's own or "
        "the tokenizer's chat template).",
    )
    default_negative_prompt: str | None = Field(
        None,
        description="Negative prompt for CFG when the request gives none (None: the one the DiT announces, its "
        "model card's, Qwen-Image's \" \" without one).",
    )
    max_new_tokens: Positive = Field(
        1, description="Default generated tokens: 1 = encoder mode (Qwen-Image); more = AR generation (MammothModa2)."
    )
    max_new_tokens_limit: Positive = Field(512, description="Largest max_new_tokens a request may ask.")
    max_prompt_tokens: Positive = Field(
        1024, description="Longest templated prompt accepted (the DiT's max_sequence_length bounds what it uses)."
    )
    conditioning: Literal["qwen_image", "every_row", "ar_generated"] | None = Field(
        None, description="DiT conditioning adapter (None: the model card's)."
    )

    # --- streaming and handoff -------------------------------------------------------------------
    row_buffer_bytes: Positive = Field(
        256 << 20, description="Rows a request may have waiting for the DiT before it is aborted."
    )
    row_timeout_seconds: Seconds = Field(300.0, description="Longest wait for the next rows from the engine.")
    negative_rows_bytes: NonNegative = Field(
        16 << 20,
        description="Rows of recent negative prompts kept so a repeat needs no engine run (CFG's negative side "
        "would otherwise wait for the engine step after the prompt's); 0 keeps none.",
    )
    overlap_handoff: bool = Field(True, description="Send rows while decoding (off: after the AR finishes).")
    dit_url: str = Field(
        "http://127.0.0.1:8001",
        description="DiT base URL(s), comma-separated; a DNS name is expanded to all its IPv4 addresses.",
    )
    dit_resolve_seconds: Seconds = Field(
        5.0, description="How often DiT host names are resolved again (replicas come and go)."
    )
    handoff_token: HandoffToken = None
    dit_timeout_seconds: Seconds = Field(
        600.0, description="Longest whole handoff exchange with the DiT (rows out, images back)."
    )
    dit_stall_timeout_seconds: Seconds = Field(
        15.0,
        description="Longest silence from the DiT mid-exchange (it sends progress meanwhile): a frozen DiT fails fast.",
    )
    dit_connect_timeout_seconds: Seconds = Field(5.0, description="DiT connect timeout.")

    # --- public API ------------------------------------------------------------------------------
    host: str = Field("127.0.0.1", description="Bind address.")
    port: Port = Field(8000, description="Bind port.")
    internal_port: Port | None = Field(
        None,
        description="A second port for the cluster's own callers: /v1/completions/render and the probes, no API key "
        "(a NetworkPolicy decides who reaches it); every other path there is a 404. None: no second port.",
    )
    drain_seconds: Seconds = Field(
        DEFAULT_DRAIN_SECONDS,
        description="On SIGTERM, how long admitted requests may finish (new ones get 503) before the service stops; "
        "covers a request admitted at the longest queue wait (120 s) and its render.",
    )
    api_keys: list[str] = Field(default_factory=list, description="Accepted bearer keys (JSON list); empty: no auth.")
    admin_token: SecretStr | None = Field(
        None, description="Enables /admin/* (prefix cache reset) with this bearer; unset or empty: no /admin/*."
    )
    max_request_body_bytes: Positive = Field(
        1 << 20, description="Largest request body (edits: the next setting); larger is a 413 before it is parsed."
    )
    max_edit_body_bytes: Positive = Field(
        64 << 20,
        description="Largest /v1/images/edits body (images, mask, fields); held in memory while it is read.",
    )
    max_edit_input_pixels: Positive = Field(
        4096 * 4096, description="Largest width*height of an uploaded image or mask, checked before decoding it."
    )
    max_edit_memory_bytes: Positive = Field(
        512 << 20,
        description="Memory the edits in hand may hold together (each counted at its decoding peak, from its decode "
        "to the end of its request); an edit past it is refused at once (429), one that alone needs more with 400.",
    )
    request_body_timeout_seconds: Seconds = Field(
        10.0,
        description="A request body must arrive within this, or the answer is 408; one nobody reads (after an early "
        "401 or 429) must end within it too, or the connection closes.",
    )
    max_queued_requests: NonNegative = Field(
        256, description="Requests waiting for room at the DiT (in flight: what the DiT announces); beyond: 429."
    )
    max_queue_wait_seconds: Seconds = Field(
        120.0,
        description="A request whose render would start later than this, by the work admitted before it at the "
        "pair's pace, is refused at once (429); one that is admitted is served.",
    )
    max_queue_wait_per_key_seconds: Seconds = Field(
        60.0,
        description="With API keys: the work one key's requests in flight and waiting may hold, at the pair's pace "
        "(half the longest wait); past it that key's next request is refused (429), so a key that floods the queue "
        "delays another key's request by at most this.",
    )
    send_timeout_seconds: Seconds = Field(
        60.0,
        description="A client that takes no byte of its answer for this long is cut off (its capacity was given "
        "back when the work ended); 60 s lets a 1 Mbit/s link drain the buffers in front of it.",
    )
    max_slow_readers: Positive = Field(
        64, description="Answers that may wait on clients that stopped reading; one more is cut off at once."
    )
    max_slow_reader_bytes: Positive = Field(
        256 << 20, description="Bytes that may wait for clients that stopped reading; past it they are cut off."
    )
    sse_keepalive_seconds: Seconds = Field(
        10.0, description="Keep-alive comment interval on event streams, so proxies do not cut a silent render."
    )
    image_store_size: Positive = Field(
        256,
        description="Images kept for response_format=url; when full, the oldest image of the API key holding the "
        "most goes first (one key cannot evict another's that holds less).",
    )
    image_store_bytes: Positive = Field(
        256 << 20,
        description="Bytes of images kept for response_format=url; when full, the oldest image of the API key "
        "holding the most bytes goes first.",
    )
    image_ttl_seconds: Seconds = Field(600.0, description="How long a url image lives.")
    image_store_url: str | None = Field(
        None,
        description="A Redis URL (redis://host:6379/0) for response_format=url images every replica can serve, under "
        "the same TTL and byte bound; None: images live in this process.",
    )
    public_base_url: str | None = Field(
        None,
        description="Base of returned image URLs, the address clients reach this service at (https://images.example.com"
        "). None: http://HOST:PORT where the service listens on one address; listening on every address (0.0.0.0), "
        "response_format=url is a 400 until this is set. A request's Host or X-Forwarded-* never names it.",
    )
    request_head_timeout_seconds: HeadSeconds = HEAD_SECONDS
    max_request_head_bytes: HeadBytes = HEAD_BYTES
    max_connections: MaxConnections = None
    log_level: LogLevel = "INFO"
    release_memory_idle_seconds: ReleaseIdleSeconds = RELEASE_IDLE_SECONDS

    @property
    def image_base_url(self) -> str | None:
        """Where returned url images live: ``public_base_url``, else the one address this service listens on
        (``make run``'s loopback). A link's host never comes from the request, which any client writes."""
        if self.public_base_url:
            return self.public_base_url
        if self.host in ("", "0.0.0.0", "::"):
            return None
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    @property
    def engine_dtype(self) -> DtypeName:
        """``dtype``, else the default for the device vLLM runs on (``services/dtype.py``)."""
        if self.dtype is not None:
            return self.dtype
        from vllm.platforms import current_platform

        return default_dtype("cpu" if current_platform.is_cpu() else "cuda")

    @property
    def model_len(self) -> int:
        """The engine's longest prompt + generation: ``max_model_len``, or the longest request the API admits."""
        if self.max_model_len is not None:
            return self.max_model_len
        return self.max_prompt_tokens + self.max_new_tokens_limit

    def kv_cache_tokens(self, block_size: int) -> int:
        """Tokens the KV cache holds when no byte size is set: the longest request, plus one block for each
        other sequence the engine schedules with it (a short prompt fills one)."""
        return (-(-self.model_len // block_size) + self.max_num_seqs - 1) * block_size

    def rows(self, card_rows: RowRecipe | None) -> RowRecipe:
        """How this AR reads rows: the served pipeline folder's card's (``card_rows``; None: a language model's own
        folder, the demo's), each part these settings set overridden."""
        overrides = {
            "layers": None if self.hidden_layer is None else [self.hidden_layer],
            "final_norm": self.final_norm,
            "template": self.prompt_template,
            "conditioning": self.conditioning,
        }
        return (card_rows or DEMO_ROWS).model_copy(update={k: v for k, v in overrides.items() if v is not None})
