"""The AR service: vLLM with hidden-state capture, the public OpenAI image API, the handoff to DiTs.

Read it in the order a request travels (README.md, "How a request flows"): ``api/admission_door.py`` →
``api/router.py`` → ``api/serving.py`` → ``api/validation.py`` → ``admission.py`` → ``image_generation.py`` →
``engine/`` (vLLM) → ``handoff_body.py`` → ``dit_pool.py`` → ``handoff_client.py``. ``app.py``
composes them.

The names below are the in-process API: what code running beside the service in one process
(benchmarks, tools) may use. Everything else in this package is internal.
"""

from ar_service.app import ArRuntime, create_ar_app
from ar_service.dit_pool import dit_session
from ar_service.engine.final_norm import FinalNorm
from ar_service.engine.hidden_state_engine import (
    EngineEvent,
    EngineRequest,
    FinishedEvent,
    HiddenStateEngine,
    RowsEvent,
)
from ar_service.engine.row_channel import RowChannel, RowSender
from ar_service.handoff_body import HandoffBody
from ar_service.handoff_client import HandoffClient
from ar_service.prompt_builder import PromptBuilder
from ar_service.settings import ArSettings
from services.version import VERSION

__version__ = VERSION

__all__ = [
    "ArRuntime",
    "ArSettings",
    "EngineEvent",
    "EngineRequest",
    "FinalNorm",
    "FinishedEvent",
    "HandoffBody",
    "HandoffClient",
    "HiddenStateEngine",
    "PromptBuilder",
    "RowChannel",
    "RowSender",
    "RowsEvent",
    "create_ar_app",
    "dit_session",
]
