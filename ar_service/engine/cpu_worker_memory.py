"""What vLLM's CPU worker keeps that serving never uses, freed once the model is loaded.

When a model loads on CPU, vLLM 0.32 readies every vocabulary-sized layer for a matmul
(``dispatch_cpu_unquantized_gemm``): oneDNN packs a copy of its weight, kept by the layer's
``cpu_linear``. The LM head multiplies with it. The input embedding only looks rows up (``F.embedding``
on the weight itself) and never multiplies, yet gets a packed copy of its own: with tied embeddings, as
SmolLM2 has, a third copy of the vocabulary matrix, 108 MiB of the engine core at the demo model
(``benchmarks/results/memory_table.json``). ``CpuWorkerMemory`` is mixed into vLLM's worker
(``worker_extension_cls``), and the AR calls it through ``collective_rpc`` once the engine is up. On
a GPU no layer has a ``cpu_linear`` and nothing is freed. Then the pages loading freed go back to the
system (``services.heap``), as the AR and DiT processes give theirs back once ready.
"""

from __future__ import annotations

from typing import Any, cast

import torch
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding

from services.heap import return_free_pages

RELEASE_METHOD = "release_unused_memory"


class CpuWorkerMemory:
    model_runner: Any  # the worker's, which this class is mixed into

    def release_unused_memory(self) -> int:
        """Drops the packed matmul copy of every input embedding that is not also the LM head, then gives
        the free pages back; the bytes of packed copies freed (the weight's size: oneDNN's copy is as large)."""
        model = self.model_runner.model
        lm_head = getattr(model, "lm_head", None)
        freed = 0
        for module in model.modules():
            if not isinstance(module, VocabParallelEmbedding) or isinstance(module, ParallelLMHead):
                continue
            if module is not lm_head and hasattr(module, "cpu_linear"):
                del module.cpu_linear
                freed += cast(torch.Tensor, module.weight).nbytes
        return_free_pages()
        return freed
