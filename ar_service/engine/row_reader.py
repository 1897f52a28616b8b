"""The worker role of ardit's KV connector (``connector``), in the process that runs the model: after each
step's draft write, gather the rows the scheduler role named from the hidden-state cache, apply the model's
final norm if configured, and push them to the AR service (``RowSender``). On CUDA the device→host copy runs
on a side stream and a sender thread waits for it, so the engine step does not block on the copy."""

from __future__ import annotations

import queue
import threading
from typing import TYPE_CHECKING

import torch

from ar_service.engine.final_norm import FinalNorm
from ar_service.engine.row_channel import RowSender
from ar_service.engine.row_reads import RowRead

if TYPE_CHECKING:
    from vllm.config import VllmConfig


class RowReader:
    def __init__(self, vllm_config: VllmConfig, endpoint: str, final_norm: bool, block_size: int) -> None:
        self._vllm_config = vllm_config
        self._endpoint = endpoint
        self._apply_final_norm = final_norm
        self._block_size = block_size
        self._kv: torch.Tensor | None = None
        self._norm: FinalNorm | None = None
        self._sender: RowSender | None = None
        self._async_copy: _DeviceToHostSender | None = None

    def register(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from vllm.config import get_layers_from_vllm_config
        from vllm.model_executor.models.extract_hidden_states import CacheOnlyAttentionLayer

        layers = list(get_layers_from_vllm_config(self._vllm_config, CacheOnlyAttentionLayer, list(kv_caches)))
        if len(layers) != 1:
            raise RuntimeError(f"expected one cache-only hidden-state layer, found {layers}")
        # [num_blocks, num_captured_layers, block_size, hidden]: a token's row is its layers side by side.
        self._kv = kv_caches[layers[0]]
        if self._kv.shape[2] != self._block_size:
            raise RuntimeError(
                f"hidden-state cache blocks hold {self._kv.shape[2]} tokens, its KV cache group says {self._block_size}"
            )
        if self._apply_final_norm:
            model = self._vllm_config.model_config
            norm = FinalNorm.from_checkpoint(model.model, eps=model.hf_text_config.rms_norm_eps)
            self._norm = norm.to(self._kv.device)
        self._sender = RowSender(self._endpoint)
        if self._kv.is_cuda:
            self._async_copy = _DeviceToHostSender(self._sender)

    def push(self, read: RowRead) -> None:
        if self._kv is None or self._sender is None:
            raise RuntimeError("rows to read before register_kv_caches")
        if read.slots:
            slots = torch.tensor(read.slots, dtype=torch.long, device=self._kv.device)
            blocks, offsets = slots // self._block_size, slots % self._block_size
            rows = self._kv[blocks, :, offsets]  # a gathered copy, [n, layers, hidden]
            if self._norm is not None:
                rows = self._norm(rows)  # each layer's part on its own, as the model would norm that layer's output
            rows = rows.reshape(rows.shape[0], -1)
        else:
            rows = self._kv.new_empty((0, self._kv.shape[1] * self._kv.shape[-1]))
        if self._async_copy is not None:
            self._async_copy.submit(read, rows)
        else:
            self._sender.send(read.row_queue, read.start, rows, read.final)

    def close(self) -> None:
        if self._async_copy is not None:
            self._async_copy.close()
        if self._sender is not None:
            self._sender.close()


class _DeviceToHostSender:
    """CUDA only: copy rows to pinned host memory on a side stream; a thread sends when ready."""

    def __init__(self, sender: RowSender) -> None:
        self._sender = sender
        self._stream = torch.cuda.Stream()
        self._queue: queue.Queue[tuple[RowRead, torch.Tensor, torch.cuda.Event] | None] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="ardit-rows-d2h", daemon=True)
        self._thread.start()

    def submit(self, read: RowRead, rows: torch.Tensor) -> None:
        self._stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self._stream):
            host = torch.empty(rows.shape, dtype=rows.dtype, pin_memory=True)
            host.copy_(rows, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self._stream)
        rows.record_stream(self._stream)  # keep the device gather alive until the copy is done
        self._queue.put((read, host, event))

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            read, host, event = item
            event.synchronize()
            self._sender.send(read.row_queue, read.start, host, read.final)

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=5)
