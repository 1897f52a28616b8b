"""On CPU the engine's worker keeps one packed matmul copy of the vocabulary matrix, the LM head's: the
input embedding's, which only looks rows up, is released as soon as the model is loaded; what serving frees
goes back to the system once the AR is idle."""

from __future__ import annotations

import pytest
from vllm.utils.import_utils import resolve_obj_by_qualname
from vllm.v1.worker.cpu_worker import CPUWorker

from ar_service.engine.cpu_worker import CpuWorker
from ar_service.engine.hidden_state_engine import CPU_WORKER_CLASS
from tests.ar_service.engine.engine_runs import run_engine, token_prompt
from tests.support.waiting import wait_for


def test_the_engine_is_told_the_path_of_ardits_cpu_worker_a_vllm_cpu_worker():
    assert resolve_obj_by_qualname(CPU_WORKER_CLASS) is CpuWorker
    assert issubclass(CpuWorker, CPUWorker)


@pytest.mark.slow
def test_the_engines_worker_released_the_input_embeddings_copy_the_size_of_the_vocabulary_matrix(stack):
    engine = stack.runtime.engine
    model = engine.vllm.vllm_config.model_config
    vocabulary = model.get_vocab_size() * model.get_hidden_size() * engine.dtype.itemsize
    # vLLM pads the vocabulary to a multiple of 64 rows for its matmuls.
    padded = -(-model.get_vocab_size() // 64) * 64 * model.get_hidden_size() * engine.dtype.itemsize
    assert stack.ar.call(engine.vllm.collective_rpc("unused_memory_released")) in ([vocabulary], [padded])


@pytest.mark.slow
def test_the_lm_head_still_computes_tokens(stack):
    run = stack.ar.call(run_engine(stack.runtime.engine, token_prompt(40, 5), max_new_tokens=8))
    assert len(run.finished.generated_token_ids) == 8


@pytest.mark.slow
def test_once_the_ar_is_idle_its_engine_core_gives_back_what_serving_freed(stack):
    engine = stack.runtime.engine
    releases = engine.idle_release.releases
    stack.ar.call(run_engine(engine, token_prompt(600, 6), max_new_tokens=4))
    wait_for(lambda: engine.idle_release.releases > releases, 10 * engine.idle_release.delay, "an idle release")
    assert stack.ar.call(engine.vllm.collective_rpc("return_free_pages"))[0] >= 0
