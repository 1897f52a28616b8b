"""The DiT service: receives streamed AR hidden states, renders images with diffusers.

Read it in the order a handoff travels (README.md, "How a request flows"): ``handoff_endpoint.py`` →
``handoff_intake.py`` (``shared/handoff_assembler.py``) → ``conditioning.py`` →
``result_stream.py`` → ``render_scheduler.py`` → ``renderer.py`` → ``vae_codec.py`` →
``image_encoder.py``. ``app.py`` composes them.

The names below are the in-process API: what code running beside the service in one process
(benchmarks, tools) may use. Everything else in this package is internal.
"""

# ruff: noqa: E402 - the package's names are imported after gguf is marked absent, below
import sys

from services.version import VERSION

# diffusers imports the gguf package whenever it is installed (vLLM installs it beside the AR), for its GGUF
# loader, and gguf imports mistral_common and OpenCV: memory the DiT would hold for a format it never reads
# (it loads diffusers checkpoints; benchmarks/results/memory_table.md). Marked absent before diffusers looks;
# vLLM imports it for GGUF models only.
sys.modules.setdefault("gguf", None)  # type: ignore[arg-type]

from dit_service.app import create_dit_app
from dit_service.conditioning import Conditioning, ConditioningAdapters, ConditioningOptions
from dit_service.handoff_intake import HandoffIntake
from dit_service.image_encoder import ImageEncoder
from dit_service.metrics import DitMetrics
from dit_service.model import DitModel
from dit_service.render_job import RenderItem, RenderJob
from dit_service.renderer import Renderer
from dit_service.settings import DitSettings
from dit_service.vae_codec import VaeCodec

__version__ = VERSION

__all__ = [
    "Conditioning",
    "ConditioningAdapters",
    "ConditioningOptions",
    "DitMetrics",
    "DitModel",
    "DitSettings",
    "HandoffIntake",
    "ImageEncoder",
    "RenderItem",
    "RenderJob",
    "Renderer",
    "VaeCodec",
    "create_dit_app",
]
