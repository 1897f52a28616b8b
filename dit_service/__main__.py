"""``python -m dit_service``: serve the DiT on ARDIT_DIT_HOST:ARDIT_DIT_PORT."""

from __future__ import annotations

import torch
import uvicorn

from dit_service.app import create_dit_app
from dit_service.settings import DitSettings
from services.request_context import configure_logging
from services.tracing import configure_tracing


def main() -> None:
    settings = DitSettings()
    configure_logging("dit", settings.log_level)
    configure_tracing("dit")
    if settings.torch_threads is not None:
        torch.set_num_threads(settings.torch_threads)
    uvicorn.run(create_dit_app(settings), host=settings.host, port=settings.port, log_config=None)


if __name__ == "__main__":
    main()
