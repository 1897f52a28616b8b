"""The contract's checksums (xxh3-64, written as 16 lowercase hex digits).

Each ``rows`` frame carries the checksum of its own payload, which the receiver computes while
the bytes land (cache-hot, and a corrupt frame is caught at once, whatever order frames come in).
``close`` carries, per stream, the checksum of the frame checksums in row order: a hash over
all row bytes of the stream that needs no second pass over them.

xxh3 rather than zlib's crc32: crc32 costs more than copying the rows (benchmarks/).
"""

from __future__ import annotations

from collections.abc import Callable

import xxhash

from shared.frame_types import Buffer


def payload_checksum(data: Buffer) -> str:
    return xxhash.xxh3_64_hexdigest(data)


class PayloadHasher:
    """Incremental ``payload_checksum`` for a payload that arrives in pieces."""

    def __init__(self) -> None:
        self._hash = xxhash.xxh3_64()
        # Bound once: the receiver calls it for every landing slice.
        self.update: Callable[[Buffer], None] = self._hash.update

    def hexdigest(self) -> str:
        return self._hash.hexdigest()


def stream_checksum(frame_checksums: dict[int, str]) -> str:
    """Checksum of a stream from its frames' checksums, keyed by each frame's first row."""
    combined = xxhash.xxh3_64()
    for start in sorted(frame_checksums):
        combined.update(bytes.fromhex(frame_checksums[start]))
    return combined.hexdigest()
