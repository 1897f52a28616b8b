"""Raw-bytes tensor codec: a tensor travels as its own C-contiguous memory plus dtype and shape.
Token ids travel the same way, as a little-endian uint32 array.

Byte order on the wire is little-endian, always. Every host ardit runs on (x86-64, aarch64,
CUDA devices) is little-endian, so encoding and decoding are plain memory views with no byte swap;
a big-endian host is refused rather than silently producing a different format.

No widening (BF16 stays 2 bytes a value), no base64, no pickle.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

import torch

from shared.errors import DtypeNotAllowed, ShapeMismatch

if TYPE_CHECKING:
    from typing_extensions import Buffer

if sys.byteorder != "little":  # pragma: no cover - no such host in use
    raise ImportError("ardit's wire format is little-endian; this host is big-endian")

TOKEN_ID_BYTES = 4
_TOKEN_ID_TYPECODE = "I"
# C's unsigned int is 32-bit on every platform ardit runs on; refuse to run where it is not.
if array(_TOKEN_ID_TYPECODE).itemsize != TOKEN_ID_BYTES:  # pragma: no cover
    raise ImportError("token ids need a 32-bit unsigned array type")

# The allow-list. Wire names are numpy/PyTorch spellings so any language can map them.
ALLOWED_DTYPES: dict[str, torch.dtype] = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
}
_WIRE_NAMES = {dtype: name for name, dtype in ALLOWED_DTYPES.items()}


@dataclass(frozen=True)
class TensorLayout:
    """What the header says about a tensor: enough to check a payload before touching it."""

    dtype: str
    shape: tuple[int, ...]

    @property
    def torch_dtype(self) -> torch.dtype:
        return ALLOWED_DTYPES[self.dtype]

    @property
    def itemsize(self) -> int:
        return self.torch_dtype.itemsize

    @property
    def nbytes(self) -> int:
        n = self.itemsize
        for dim in self.shape:
            n *= dim
        return n


def wire_dtype(dtype: torch.dtype) -> str:
    """The wire name of a torch dtype, or ``DtypeNotAllowed``."""
    try:
        return _WIRE_NAMES[dtype]
    except KeyError:
        raise DtypeNotAllowed(f"dtype {dtype} is not on the allow-list {sorted(ALLOWED_DTYPES)}") from None


def check_layout(dtype: str, shape: list[int] | tuple[int, ...]) -> TensorLayout:
    """The layout of a validated frame's ``dtype`` and ``shape``, or ``DtypeNotAllowed``."""
    if dtype not in ALLOWED_DTYPES:
        raise DtypeNotAllowed(f"dtype {dtype!r} is not on the allow-list {sorted(ALLOWED_DTYPES)}")
    return TensorLayout(dtype=dtype, shape=tuple(shape))


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """The memory of a tensor (one dimension or more) as a flat byte view: no copy for a
    contiguous CPU tensor.

    A CUDA tensor must be copied to host first (the AR connector does that on a side stream);
    a non-contiguous tensor is made contiguous, which is the only copy this function can make.
    """
    if not tensor.is_cpu:
        raise ValueError("tensor_bytes needs a host tensor; copy device tensors to (pinned) host memory first")
    wire_dtype(tensor.dtype)
    return _bytes_of(tensor.contiguous())


def tensor_from_bytes(data: bytes | bytearray | memoryview, layout: TensorLayout) -> torch.Tensor:
    """Build a tensor from received bytes (the plain path for tools; it copies once)."""
    view = memoryview(data).cast("B")
    if view.nbytes != layout.nbytes:
        raise ShapeMismatch(f"{view.nbytes} bytes do not hold shape {list(layout.shape)} of {layout.dtype}")
    if layout.nbytes == 0:
        return torch.empty(layout.shape, dtype=layout.torch_dtype)
    # bytearray(...) makes the result writable and independent of the caller's buffer.
    return torch.frombuffer(bytearray(view), dtype=layout.torch_dtype).reshape(layout.shape)


def byte_view(tensor: torch.Tensor) -> memoryview:
    """A writable flat byte view of a contiguous host tensor, for landing received bytes in place."""
    if not tensor.is_contiguous() or tensor.device.type != "cpu":
        raise ValueError("landing buffers must be contiguous host tensors")
    return _bytes_of(tensor.reshape(-1))


def token_ids_to_bytes(ids: Iterable[int]) -> bytes:
    """Token ids as little-endian uint32 bytes; ``ValueError`` for anything else than ints in [0, 2**32)."""
    try:
        return array(_TOKEN_ID_TYPECODE, ids).tobytes()
    except (TypeError, OverflowError) as exc:
        raise ValueError(f"token ids are integers in [0, 2**32): {exc}") from None


def token_ids_from_bytes(data: bytes | bytearray | memoryview) -> list[int]:
    ids = array(_TOKEN_ID_TYPECODE)
    ids.frombytes(data)
    return ids.tolist()


def _bytes_of(tensor: torch.Tensor) -> memoryview:
    """The flat bytes of a contiguous host tensor, without a copy (numpy exports the buffer)."""
    # numpy arrays export the buffer protocol; numpy's stubs do not say so for Python 3.11.
    return memoryview(cast("Buffer", tensor.view(torch.uint8).numpy())).cast("B")
