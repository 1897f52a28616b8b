"""The AR engine's life in a running service: started and warmed in the background, then watched.

``run_engine`` is a task of the app's lifespan. It starts the engine in a worker thread (so
``/healthz`` answers at once), runs one tiny request through the whole capture path before traffic
does, marks readiness, then waits for the engine to die (``HiddenStateEngine.died``). An engine that
fails to start or dies is fatal: readiness turns 503 and the service exits, so its supervisor restarts
it (every request in flight learns of the death on its own, and answers 503 ``engine_unavailable``).
"""

from __future__ import annotations

import asyncio
import logging
import secrets

from ar_service.engine.hidden_state_engine import EngineRequest, HiddenStateEngine
from ar_service.metrics import ArMetrics
from ar_service.prompt_builder import PromptBuilder
from ar_service.readiness import ArReadiness
from services.fatal import Fatal
from services.heap import freeze_startup_heap

log = logging.getLogger("ardit.ar.engine_watch")


async def run_engine(
    engine: HiddenStateEngine, prompts: PromptBuilder, readiness: ArReadiness, metrics: ArMetrics, fatal: Fatal
) -> None:
    """Start and warm the engine, then watch it until cancelled: an engine that fails or dies is fatal."""
    try:
        await asyncio.to_thread(engine.start)
        metrics.vllm.capture()
        warm = EngineRequest(
            engine_request_id=f"warmup:{secrets.token_hex(4)}", prompt_token_ids=prompts.build("warm up").token_ids
        )
        async for _ in engine.run(warm):
            pass
    except Exception as exc:
        log.exception("AR engine failed to start")
        _failed(readiness, fatal, f"failed to start ({type(exc).__name__}: {exc})")
        return
    freeze_startup_heap()
    readiness.engine_ready = True
    log.info("AR engine ready (block size %d)", engine.block_size)
    await engine.died()
    _failed(readiness, fatal, "the engine died")


def _failed(readiness: ArReadiness, fatal: Fatal, reason: str) -> None:
    readiness.engine_error = reason
    fatal.trigger(f"AR engine: {reason}")
