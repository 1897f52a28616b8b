"""Types shared by the codec modules."""

from __future__ import annotations

Buffer = bytes | bytearray | memoryview
