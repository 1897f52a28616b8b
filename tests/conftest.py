"""Session-wide fixtures: the real pair (AR on vLLM, DiT on diffusers) on loopback ports.

The vLLM engine starts once per test run (about a minute on CPU): every test that needs the AR
side uses ``stack``. Checkpoints come from ``make checkpoints`` (the cache under ARDIT_CACHE_DIR).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from ar_service.app import ArRuntime, create_ar_app
from ar_service.engine.hidden_state_engine import HiddenStateEngine
from ar_service.settings import ArSettings
from dit_service.app import create_dit_app
from dit_service.settings import DitSettings
from services.checkpoints import PLUMBING_DIT_MODEL, default_model_dir
from tests.support import leftovers
from tests.support.background_loop import BackgroundLoop
from tests.support.live_server import LiveServer
from tests.support.ports import free_port

# Bitwise image comparisons need a fixed intra-op thread count.
torch.set_num_threads(1)

HANDOFF_TOKEN = "test-handoff-token"
API_KEY = "sk-test-ardit"
OTHER_API_KEY = "sk-test-another-tenant"
ADMIN_TOKEN = "test-admin-token"

# The pair's plumbing tests (streams, admission, edits, metrics, bitwise equality with plain diffusers) run on
# the random tiny Qwen-Image, chosen here explicitly: `make checkpoints` builds it from code in seconds, its VAE
# has the real one's topology (residual blocks, channel multipliers, 16 latent channels) where the demo VAE is
# pared down, and it has no model card, so those tests see the settings' own defaults. The DiT's default, the
# trained demo model, is served where pictures must mean something (tests/e2e/test_prompt_following.py).
PLUMBING_DIT_MODEL_DIR = default_model_dir(PLUMBING_DIT_MODEL)


def pytest_configure(config: pytest.Config) -> None:
    leftovers.mark_this_run()


@pytest.hookimpl(trylast=True)  # after the session fixtures' teardown
def pytest_sessionfinish(session: pytest.Session) -> None:
    """Nothing outlives the run: a process it started and left running fails it, by name."""
    left = leftovers.reap(grace_seconds=10)
    if left:
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None:
            reporter.write_line("processes this test run started were still running (now killed):", red=True)
            for line in left:
                reporter.write_line(f"  {line}", red=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


@dataclass
class Stack:
    ar: LiveServer
    dit: LiveServer
    settings: ArSettings

    @property
    def runtime(self) -> ArRuntime:
        return self.ar.app.state.runtime

    @property
    def api_base(self) -> str:
        return f"{self.ar.url}/v1"


def require_checkpoint(path: Path) -> Path:
    """``path``, a built checkpoint. Missing, it fails the test — or, in ``make test-fast`` (which builds
    nothing), skips it with the reason: the few fast tests that read a checkpoint's tokenizer."""
    if not (path / ".complete").exists() and not (path / "model_index.json").exists():
        message = f"checkpoint {path} is missing: run `make checkpoints` (make test does)"
        if os.environ.get("ARDIT_TEST_FAST"):
            pytest.skip(message)
        pytest.fail(message)
    return path


def dit_settings(**overrides) -> DitSettings:
    """The DiT as `make run` starts it (defaults) on the plumbing model, plus the shared token and one torch thread."""
    base: dict[str, Any] = dict(
        model_dir=require_checkpoint(PLUMBING_DIT_MODEL_DIR), handoff_token=HANDOFF_TOKEN, torch_threads=1
    )
    return DitSettings(**(base | overrides))


@dataclass
class OwnEngine:
    """An AR engine a test owns, on its own event loop."""

    loop: BackgroundLoop
    engine: HiddenStateEngine

    def call(self, coro):
        return self.loop.call(coro)


@pytest.fixture(scope="session")
def fp32_engine() -> Iterator[OwnEngine]:
    """The AR's engine at its defaults but in fp32, for what only fp32 promises (rows equal to transformers',
    a prefix-cache hit bitwise a miss, a request's rows whatever runs beside it); the stack runs the machine's
    default dtype, bf16 on a CPU that multiplies it natively."""
    loop = BackgroundLoop()
    engine = HiddenStateEngine(ArSettings(model_dir=require_checkpoint(ArSettings().model_dir), dtype="float32"))
    engine.start()
    yield OwnEngine(loop, engine)
    engine.shutdown()
    loop.stop()


@pytest.fixture(scope="session")
def stack() -> Iterator[Stack]:
    dit = LiveServer(create_dit_app(dit_settings())).start().wait_ready()
    # The AR at its defaults (admission, queue, timeouts as `make run` has them), plus what the
    # tests exercise: API keys (two tenants), the admin endpoint, and a max_new_tokens limit a test can pass.
    settings = ArSettings(
        model_dir=require_checkpoint(ArSettings().model_dir),
        dit_url=dit.url,
        handoff_token=HANDOFF_TOKEN,
        api_keys=[API_KEY, OTHER_API_KEY],
        admin_token=ADMIN_TOKEN,
        max_new_tokens_limit=64,
        port=free_port(),  # the address it listens on is the one its url images name
    )
    ar = LiveServer(create_ar_app(settings), port=settings.port).start().wait_ready()
    yield Stack(ar=ar, dit=dit, settings=settings)
    ar.stop()
    dit.stop()
