"""The channel that carries hidden rows out of vLLM's model process into the AR service.

vLLM runs the model outside the AR's process (in EngineCore at one device). The
``HiddenStateConnector`` beside the model pushes each step's rows over ZMQ PUSH/PULL on an ``ipc://``
socket (vLLM already depends on pyzmq); the AR service binds the PULL end before starting the
engine and demultiplexes chunks to one ``RowQueue`` per engine request, by its id.

Nothing is dropped silently: ZMQ PUSH/PULL over ipc is reliable and ordered, the receiver thread
drains the socket continuously, and a request whose consumer falls behind by more than its bound
is failed with ``RowQueueOverflow`` (its caller aborts it) rather than losing rows. Chunks that
arrive for a request nobody waits for any more (an aborted request's last step) are counted and freed.

A message is two ZMQ frames: a msgpack header (``RowChunkHeader``) and the rows' raw bytes
([count, hidden] C-contiguous in ``dtype``; empty for a bare ``final`` marker). The engine's own
final output says how many rows the request has; the channel only carries them.
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
    engine_request_id: str
    start: int
    count: int
    dtype: str
    hidden: int
    final: bool = False  # the request's last chunk


@dataclass(frozen=True)
class RowChunk:
    start: int
    rows: torch.Tensor  # [count, hidden]
    final: bool


class RowQueueOverflow(RuntimeError):
    """The consumer of a request's rows fell behind by more than its configured bound."""


class RowSender:
    """Model side: push rows. Used from inside vLLM's model process (the connector's worker role)."""

    def __init__(self, endpoint: str) -> None:
        self._socket: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.PUSH)
        # An unreachable peer must not keep the model's process alive at shutdown.
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.connect(endpoint)

    def send(self, engine_request_id: str, start: int, rows: torch.Tensor, final: bool = False) -> None:
        rows = rows.contiguous()
        header = RowChunkHeader(
            engine_request_id=engine_request_id,
            start=start,
            count=rows.shape[0],
            dtype=wire_dtype(rows.dtype),
            hidden=rows.shape[1],
            final=final,
        )
        payload = tensor_bytes(rows) if rows.numel() else b""
        # copy=False: ZMQ keeps a reference to the tensor's memory until it is sent.
        self._socket.send_multipart([msgpack.packb(asdict(header)), payload], copy=False)

    def close(self) -> None:
        self._socket.close(linger=0)


class RowQueue:
    """One engine request's rows, in arrival order (``next``)."""

    def __init__(self, engine_request_id: str, max_buffered_bytes: int, loop: asyncio.AbstractEventLoop) -> None:
        self.engine_request_id = engine_request_id
        self._max_buffered = max_buffered_bytes
        self._loop = loop
        self._queue: asyncio.Queue[RowChunk | BaseException] = asyncio.Queue()
        self._buffered = 0  # bytes handed to the loop and not yet taken by the consumer
        self._lock = threading.Lock()
        self.failed = False

    def push(self, chunk: RowChunk) -> None:
        """Called on the receiver thread."""
        with self._lock:
            if self.failed:
                return
            self._buffered += chunk.rows.nbytes
            if self._buffered > self._max_buffered:
                self.failed = True
                error: RowChunk | BaseException = RowQueueOverflow(
                    f"rows for {self.engine_request_id} buffered past {self._max_buffered} bytes: consumer too slow"
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
    """API side: bind the PULL socket, route chunks to the open row queues."""

    def __init__(self, endpoint: str) -> None:
        self.endpoint = endpoint
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.PULL)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.bind(endpoint)
        self._queues: dict[str, RowQueue] = {}
        self._lock = threading.Lock()
        self.late_chunks = 0
        self.bytes_received = 0
        self._thread = threading.Thread(target=self._receive_loop, name="row-channel", daemon=True)
        self._thread.start()

    def open_queue(self, engine_request_id: str, max_buffered_bytes: int) -> RowQueue:
        queue = RowQueue(engine_request_id, max_buffered_bytes, asyncio.get_running_loop())
        with self._lock:
            if engine_request_id in self._queues:
                raise ValueError(f"a row queue for {engine_request_id} is already open")
            self._queues[engine_request_id] = queue
        return queue

    def close_queue(self, engine_request_id: str) -> None:
        with self._lock:
            self._queues.pop(engine_request_id, None)

    @property
    def open_queues(self) -> int:
        with self._lock:
            return len(self._queues)

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
            try:
                self._route(header_bytes, payload)
            except Exception:
                # One bad message or a consumer whose event loop is gone must not stop the channel:
                # every other request's rows still flow (that consumer times out on its own).
                log.exception("row chunk dropped")

    def _route(self, header_bytes: zmq.Frame, payload: zmq.Frame) -> None:
        header = RowChunkHeader(**msgpack.unpackb(header_bytes.bytes))
        with self._lock:
            queue = self._queues.get(header.engine_request_id)
        if queue is None:
            self.late_chunks += 1
            return
        self.bytes_received += len(payload)
        queue.push(RowChunk(start=header.start, rows=_rows_from_payload(header, payload), final=header.final))


def _rows_from_payload(header: RowChunkHeader, payload: zmq.Frame) -> torch.Tensor:
    dtype = ALLOWED_DTYPES[header.dtype]
    if header.count == 0:
        return torch.empty((0, header.hidden), dtype=dtype)
    # The ZMQ frame's buffer is ours now; bytearray makes the tensor writable and owned.
    return torch.frombuffer(bytearray(payload.buffer), dtype=dtype).reshape(header.count, header.hidden)
