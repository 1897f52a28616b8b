"""The channel that carries hidden rows out of the vLLM worker process into the AR service.

vLLM runs the model in a separate worker process (on CPU: API → EngineCore → worker). The
``HiddenStateConnector`` in the worker pushes each step's rows over ZMQ PUSH/PULL on an ``ipc://``
socket (vLLM already depends on pyzmq); the AR service binds the PULL end before starting the
engine and demultiplexes chunks to per-request ``RowStream`` queues by stream id.

Nothing is dropped silently: ZMQ PUSH/PULL over ipc is reliable and ordered, the receiver thread
drains the socket continuously, and a request whose consumer falls behind by more than its bound
is failed with ``RowStreamOverflow`` (its caller aborts it) rather than losing rows. Chunks that
arrive for a stream nobody holds any more (an aborted request's last step) are counted and freed.

A message is two ZMQ frames: a msgpack header (``RowChunkHeader``) and the rows' raw bytes
([count, hidden] C-contiguous in ``dtype``; empty for a bare ``final`` marker).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from dataclasses import asdict, dataclass

import msgpack
import torch
import zmq

from shared.tensor_codec import ALLOWED_DTYPES, tensor_bytes, wire_dtype

log = logging.getLogger("ardit.ar.row_channel")


@dataclass(frozen=True)
class RowChunkHeader:
    stream_id: str
    start: int
    count: int
    dtype: str
    hidden: int
    # Last chunk of the stream; ``total_rows`` is then the stream's row count.
    final: bool = False
    total_rows: int | None = None


@dataclass(frozen=True)
class RowChunk:
    start: int
    rows: torch.Tensor  # [count, hidden]
    final: bool
    total_rows: int | None


class RowStreamOverflow(RuntimeError):
    """The consumer of a request's rows fell behind by more than its configured bound."""


class RowSender:
    """Worker side: push rows. Used from inside the vLLM worker process (the connector)."""

    def __init__(self, endpoint: str) -> None:
        self._socket = zmq.Context.instance().socket(zmq.PUSH)
        # An unreachable peer must not keep the worker alive at shutdown.
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.connect(endpoint)

    def send(self, stream_id: str, start: int, rows: torch.Tensor, final: bool = False, total_rows: int | None = None) -> None:
        rows = rows.contiguous()
        header = RowChunkHeader(
            stream_id=stream_id,
            start=start,
            count=rows.shape[0],
            dtype=wire_dtype(rows.dtype),
            hidden=rows.shape[1],
            final=final,
            total_rows=total_rows,
        )
        payload = tensor_bytes(rows) if rows.numel() else b""
        # copy=False: ZMQ keeps a reference to the tensor's memory until it is sent.
        self._socket.send_multipart([msgpack.packb(asdict(header)), payload], copy=False)

    def close(self) -> None:
        self._socket.close(linger=0)


class RowStream:
    """One request's rows, in arrival order, as an async iterator of ``RowChunk``."""

    def __init__(self, stream_id: str, max_buffered_bytes: int, loop: asyncio.AbstractEventLoop) -> None:
        self.stream_id = stream_id
        self._max_buffered = max_buffered_bytes
        self._loop = loop
        self._queue: asyncio.Queue[RowChunk | BaseException] = asyncio.Queue()
        self._buffered = 0  # bytes handed to the loop and not yet taken by the consumer
        self._lock = threading.Lock()
        self.failed = False

    def _push(self, chunk: RowChunk) -> None:
        """Receiver thread."""
        with self._lock:
            if self.failed:
                return
            self._buffered += chunk.rows.nbytes
            if self._buffered > self._max_buffered:
                self.failed = True
                error: RowChunk | BaseException = RowStreamOverflow(
                    f"rows for {self.stream_id} buffered past {self._max_buffered} bytes: consumer too slow"
                )
            else:
                error = chunk
        self._loop.call_soon_threadsafe(self._queue.put_nowait, error)

    async def next(self, timeout: float | None = None) -> RowChunk:
        item = await asyncio.wait_for(self._queue.get(), timeout)
        if isinstance(item, BaseException):
            raise item
        with self._lock:
            self._buffered -= item.rows.nbytes
        return item

    @property
    def buffered_bytes(self) -> int:
        with self._lock:
            return self._buffered


class RowChannel:
    """API side: bind the PULL socket, route chunks to open streams."""

    def __init__(self, endpoint: str) -> None:
        self.endpoint = endpoint
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.PULL)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.bind(endpoint)
        self._streams: dict[str, RowStream] = {}
        self._lock = threading.Lock()
        self.late_chunks = 0
        self.bytes_received = 0
        self._thread = threading.Thread(target=self._receive_loop, name="row-channel", daemon=True)
        self._thread.start()

    def open_stream(self, stream_id: str, max_buffered_bytes: int) -> RowStream:
        stream = RowStream(stream_id, max_buffered_bytes, asyncio.get_running_loop())
        with self._lock:
            if stream_id in self._streams:
                raise ValueError(f"row stream {stream_id} is already open")
            self._streams[stream_id] = stream
        return stream

    def close_stream(self, stream_id: str) -> None:
        with self._lock:
            self._streams.pop(stream_id, None)

    @property
    def open_streams(self) -> int:
        with self._lock:
            return len(self._streams)

    def close(self) -> None:
        # term() wakes the receiver thread, which owns the socket and closes it; closing the
        # socket from this thread while it is in recv would not be thread-safe.
        self._context.term()
        self._thread.join(timeout=5)

    def _receive_loop(self) -> None:
        while True:
            try:
                header_bytes, payload = self._socket.recv_multipart(copy=False)
            except (zmq.ContextTerminated, zmq.ZMQError):
                self._socket.close(linger=0)
                return
            header = RowChunkHeader(**msgpack.unpackb(header_bytes.bytes))
            with self._lock:
                stream = self._streams.get(header.stream_id)
            if stream is None:
                self.late_chunks += 1
                continue
            self.bytes_received += len(payload)
            rows = _rows_from_payload(header, payload)
            stream._push(RowChunk(start=header.start, rows=rows, final=header.final, total_rows=header.total_rows))


def _rows_from_payload(header: RowChunkHeader, payload: zmq.Frame) -> torch.Tensor:
    dtype = ALLOWED_DTYPES[header.dtype]
    if header.count == 0:
        return torch.empty((0, header.hidden), dtype=dtype)
    # The ZMQ frame's buffer is ours now; bytearray makes the tensor writable and owned.
    return torch.frombuffer(bytearray(payload.buffer), dtype=dtype).reshape(header.count, header.hidden)
