"""Types every module of the contract shares: byte buffers, and the base of every wire model."""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field

Buffer = bytes | bytearray | memoryview


class WireModel(BaseModel):
    """A model that crosses the wire: immutable, strict (a float where an int belongs is an error,
    not a silent cast), and tolerant of keys it does not know (adding an optional field is not a
    breaking change)."""

    model_config = ConfigDict(frozen=True, strict=True, extra="ignore")


PosInt = Annotated[int, Field(gt=0)]
NonNegInt = Annotated[int, Field(ge=0)]
