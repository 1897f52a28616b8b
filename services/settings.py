"""The value types both services' settings are made of, and the settings they share by name.

Each is declared once: a positive duration, a positive count, a port, the root log level, and the
handoff token both services read from the one variable ``ARDIT_HANDOFF_TOKEN`` (whatever their prefix).
"""

from __future__ import annotations

from typing import Annotated

from pydantic import Field, SecretStr

Seconds = Annotated[float, Field(gt=0)]
Positive = Annotated[int, Field(ge=1)]
NonNegative = Annotated[int, Field(ge=0)]
Port = Annotated[int, Field(ge=0, le=65535)]
# The bearer token the AR sends and the DiT requires on /v1/handoff (unset on the DiT: it answers 503).
HandoffToken = Annotated[
    SecretStr | None,
    Field(
        validation_alias="ARDIT_HANDOFF_TOKEN",
        description="Bearer token both services share (env ARDIT_HANDOFF_TOKEN); unset, the DiT answers 503.",
    ),
]
LogLevel = Annotated[str, Field(description="Root log level.")]
# How long a service asked to stop lets admitted work finish: a request admitted at the AR's longest wait before
# its render starts (120 s) and its render. Both services' default, and the launcher's when it stops them.
DEFAULT_DRAIN_SECONDS = 150.0
# Connections before a request (services.connection_guard): both services' defaults.
HEAD_SECONDS = 10.0
HEAD_BYTES = 32 << 10  # nginx's large_client_header_buffers (4 x 8k) is the same order; h11's is 16 KiB
HeadSeconds = Annotated[
    float,
    Field(
        gt=0,
        description="A request head must arrive within this many seconds of the connection opening (or of its "
        "first byte on a connection kept alive); else the connection closes (408 if the head had begun).",
    ),
]
HeadBytes = Annotated[
    int,
    Field(
        ge=1024,
        description="Largest request head (request line and headers); past it the answer is 431 and the "
        "connection closes.",
    ),
]
MaxConnections = Annotated[
    int | None,
    Field(
        ge=1,
        description="Most open connections; at the cap a new one closes the oldest that has sent no complete head. "
        "None: the open-file limit, raised to its hard limit, less 1024.",
    ),
]
ReleaseIdleSeconds = Annotated[
    float,
    Field(ge=0, description="Seconds with nothing in flight before free memory goes back to the system (0: never)."),
]
