"""What every module of the contract shares: byte buffers, the base of every wire model, and how a
decoded map becomes the model its ``kind`` names."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from shared.errors import MalformedFrame, UnknownFrameKind

Buffer = bytes | bytearray | memoryview


class WireModel(BaseModel):
    """A model that crosses the wire: immutable, strict (a float where an int belongs is an error,
    not a silent cast), and tolerant of keys it does not know (adding an optional field is not a
    breaking change). A field whose wire key is older than its name in the code carries the key as its alias:
    read and written on the wire by the key, named in the code by the name."""

    model_config = ConfigDict(
        frozen=True, strict=True, extra="ignore", validate_by_name=True, validate_by_alias=True, serialize_by_alias=True
    )


PosInt = Annotated[int, Field(gt=0)]
NonNegInt = Annotated[int, Field(ge=0)]


Model = TypeVar("Model", bound=WireModel)


def model_of_kind(obj: Mapping[str, Any], by_kind: Mapping[str, type[Model]], what: str) -> Model:
    """``obj``, a decoded msgpack map, validated into the model its ``kind`` names; ``what`` names the
    family in errors ("frame", "result frame")."""
    kind = obj.get("kind")
    model = by_kind.get(kind) if isinstance(kind, str) else None
    if model is None:
        raise UnknownFrameKind(f"unknown {what} kind {kind!r}")
    try:
        return model.model_validate(obj)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or what
        raise MalformedFrame(f"{kind} {what}: {where}: {first['msg']}") from None
