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
ReleaseIdleSeconds = Annotated[
    float,
    Field(ge=0, description="Seconds with nothing in flight before free memory goes back to the system (0: never)."),
]
