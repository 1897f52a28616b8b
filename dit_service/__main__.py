"""``python -m dit_service``: serve the DiT on ARDIT_DIT_HOST:ARDIT_DIT_PORT."""

from __future__ import annotations

import sys

import torch

from dit_service.app import create_dit_app
from dit_service.settings import DitSettings
from services.model_card import ModelCard
from services.request_context import configure_logging
from services.serve import serve
from services.tracing import configure_tracing


def intra_op_threads(settings: DitSettings) -> int | None:
    """The operator's thread count, else on CPU the one the model card measured, else None (torch's default).

    Set here, by the process's owner, because torch's thread count is the whole process's. A folder whose card
    cannot be read has none: its load fails next, and says why."""
    if settings.torch_threads is not None:
        return settings.torch_threads
    if settings.device != "cpu":
        return None
    try:
        return ModelCard.read(settings.model_dir).cpu_threads
    except ValueError:
        return None


def main() -> int:
    settings = DitSettings()
    configure_logging("dit", settings.log_level)
    configure_tracing("dit")
    if (threads := intra_op_threads(settings)) is not None:
        torch.set_num_threads(threads)
    return serve(create_dit_app(settings), settings.host, [settings.port])


if __name__ == "__main__":
    sys.exit(main())
