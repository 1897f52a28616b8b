"""vLLM's CPU worker, less what serving never uses, freed as soon as the model is loaded.

When a model loads on CPU, vLLM 0.32 readies every vocabulary-sized layer for a matmul
(``dispatch_cpu_unquantized_gemm``): oneDNN packs a copy of its weight, kept by the layer's
``cpu_linear``. The LM head multiplies with it. The input embedding only looks rows up (``F.embedding``
on the weight itself) and never multiplies, yet gets a packed copy of its own: with tied embeddings, as
SmolLM2 has, a third copy of the vocabulary matrix (benchmarks/results/memory_table.md). Then
the pages loading freed (checkpoint reads, weights replaced by packed copies) go back to the system
(``services.heap``).

Both happen inside ``load_model``, before the KV cache is allocated: done once the engine was up, they
came after the engine core's start-up peak, which was the peak of the whole service
(``benchmarks/results/memory_table.md``). The AR names this class as the engine's ``worker_cls`` on
CPU only, by its path (``hidden_state_engine.CPU_WORKER_CLASS``), so that only the engine core imports it.
"""

from __future__ import annotations

import logging
from typing import cast

import torch
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from vllm.v1.worker.cpu_worker import CPUWorker

from services.heap import collect_free_pages, return_free_pages

log = logging.getLogger("ardit.ar.cpu_worker")


class CpuWorker(CPUWorker):
    released_bytes = 0

    def load_model(self, *, load_dummy_weights: bool = False) -> None:
        super().load_model(load_dummy_weights=load_dummy_weights)
        self.released_bytes = release_embedding_copies(self.model_runner.model)
        collect_free_pages()
        log.info("released %.0f MiB of packed embedding copies serving never uses", self.released_bytes / 2**20)

    def unused_memory_released(self) -> int:
        """The bytes of packed copies ``load_model`` freed (called by ``collective_rpc``)."""
        return self.released_bytes

    def return_free_pages(self) -> int:
        """What the steps since the last call freed, back to the system; the bytes (called by
        ``collective_rpc`` once the AR has been idle: ``services.heap.IdleRelease``)."""
        return return_free_pages()


def release_embedding_copies(model: torch.nn.Module) -> int:
    """Drops the packed matmul copy of every input embedding that is not also the LM head; the bytes
    freed (the weight's size: oneDNN's copy is as large)."""
    lm_head = getattr(model, "lm_head", None)
    freed = 0
    for module in model.modules():
        if not isinstance(module, VocabParallelEmbedding) or isinstance(module, ParallelLMHead):
            continue
        if module is not lm_head and hasattr(module, "cpu_linear"):
            del module.cpu_linear
            freed += cast(torch.Tensor, module.weight).nbytes
    return freed
