"""Draining on SIGTERM (services.drain, services.serve): a real uvicorn server on loopback, its signal
handler called as the signal would call it (signals reach only a process's main thread)."""

from __future__ import annotations

import asyncio
import signal
import threading
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest
from prometheus_client import CollectorRegistry

from services.app import create_app
from services.app_metrics import AppMetrics
from services.drain import Drain
from services.fatal import Fatal
from tests.support.bare_app import ready
from tests.support.live_server import LiveServer
from tests.support.waiting import wait_for


@dataclass
class Served:
    server: LiveServer
    drain: Drain
    release: threading.Event  # lets /slow answer
    held: dict[str, bool]

    def sigterm(self) -> None:
        self.server._server.handle_exit(signal.SIGTERM, None)

    def stopped(self, timeout: float) -> bool:
        self.server._thread.join(timeout)
        return not self.server._thread.is_alive()


def server_with_grace(grace: float) -> Served:
    held = {"place": False}
    drain = Drain(grace, holding=lambda: held["place"])
    app = create_app(
        "drain test",
        lifespan=None,
        readiness=ready,
        app_metrics=AppMetrics(CollectorRegistry(), "t"),
        fatal=Fatal(),
        drain=drain,
        admitted_while_draining=lambda scope: scope["path"] == "/admitted",
    )
    release = threading.Event()

    @app.get("/slow")
    async def slow() -> dict[str, str]:
        await asyncio.to_thread(release.wait, 30)
        return {"status": "finished"}

    @app.get("/bounded")
    async def bounded() -> dict[str, str]:
        async with drain.bounded():
            await asyncio.sleep(60)
        return {"status": "finished"}

    @app.get("/fast")
    @app.get("/admitted")
    async def fast() -> dict[str, str]:
        return {"status": "ok"}

    return Served(LiveServer(app).start(), drain, release, held)


@pytest.fixture
def service() -> Iterator[Served]:
    running = server_with_grace(grace=30.0)
    yield running
    running.release.set()
    running.server.stop()


def in_background(url: str) -> tuple[threading.Thread, list[httpx.Response]]:
    answers: list[httpx.Response] = []
    thread = threading.Thread(target=lambda: answers.append(httpx.get(url, timeout=60)))
    thread.start()
    return thread, answers


def wait_in_flight(drain: Drain, count: int) -> None:
    wait_for(lambda: drain.in_flight == count, what=f"{count} in flight", state=lambda: f"{drain.in_flight} are")


def test_a_draining_service_is_not_ready_and_refuses_new_work_with_503_and_retry_after(service):
    request, answers = in_background(f"{service.server.url}/slow")
    wait_in_flight(service.drain, 1)
    service.sigterm()
    readyz = httpx.get(f"{service.server.url}/readyz")
    refused = httpx.get(f"{service.server.url}/fast")
    assert readyz.status_code == 503 and readyz.json()["reason"].startswith("draining")
    assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
    assert refused.json()["error"]["code"] == "shutting_down"
    assert refused.json()["error"]["type"] == "service_unavailable_error"
    # Probes and what the service still admits while draining come in.
    assert httpx.get(f"{service.server.url}/healthz").status_code == 200
    assert httpx.get(f"{service.server.url}/admitted").status_code == 200
    service.release.set()
    request.join(timeout=30)
    assert answers[0].status_code == 200 and answers[0].json() == {"status": "finished"}


def test_the_server_stops_once_the_admitted_work_is_done_not_before(service):
    request, _ = in_background(f"{service.server.url}/slow")
    wait_in_flight(service.drain, 1)
    service.sigterm()
    assert not service.stopped(timeout=1.0)
    service.release.set()
    request.join(timeout=30)
    assert service.stopped(timeout=10.0)


def test_a_held_place_keeps_the_server_up_until_it_is_given_back(service):
    service.held["place"] = True
    service.sigterm()
    assert not service.stopped(timeout=1.0)
    service.held["place"] = False
    assert service.stopped(timeout=10.0)


def test_work_still_running_at_the_deadline_ends_with_an_openai_shaped_503_and_the_server_stops():
    running = server_with_grace(grace=0.5)
    try:
        request, answers = in_background(f"{running.server.url}/bounded")
        wait_in_flight(running.drain, 1)
        running.sigterm()
        request.join(timeout=30)
        assert answers[0].status_code == 503 and answers[0].json()["error"]["code"] == "shutting_down"
        assert running.stopped(timeout=10.0)
    finally:
        running.release.set()
        running.server.stop()


def test_a_second_sigterm_stops_at_once(service):
    request, _ = in_background(f"{service.server.url}/slow")
    wait_in_flight(service.drain, 1)
    service.sigterm()
    service.sigterm()
    service.release.set()
    request.join(timeout=30)
    assert service.stopped(timeout=15.0)


def test_a_timeout_of_the_works_own_is_not_taken_for_the_drain():
    async def scenario():
        drain = Drain(30.0)
        async with drain.bounded():
            async with asyncio.timeout(0.01):
                await asyncio.sleep(1)

    with pytest.raises(TimeoutError):
        asyncio.run(scenario())
