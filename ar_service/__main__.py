"""``python -m ar_service``: serve the AR service (settings from ARDIT_AR_* and flags)."""

from __future__ import annotations

import logging
import sys

from pydantic_settings import CliApp

from ar_service.app import create_ar_app
from ar_service.engine.text_model import TextModelError
from ar_service.image_store import ImageNamesHidden
from ar_service.settings import ArSettings
from services.fatal import EXIT_SETTINGS
from services.request_context import configure_logging
from services.serve import serve
from services.tracing import configure_tracing


class ArCli(ArSettings, cli_parse_args=True, cli_prog_name="python -m ar_service"):
    pass


def main() -> int:
    settings = CliApp.run(ArCli)
    configure_logging("ar", settings.log_level)
    logging.getLogger("uvicorn.access").addFilter(ImageNamesHidden())
    configure_tracing("ar")
    ports = [settings.port] if settings.internal_port is None else [settings.port, settings.internal_port]
    try:
        app = create_ar_app(settings)
    except TextModelError as exc:  # a folder that cannot serve: what is missing, in one line
        print(f"ardit AR service: {exc}", file=sys.stderr)
        return EXIT_SETTINGS
    return serve(app, settings.host, ports)


if __name__ == "__main__":
    sys.exit(main())
