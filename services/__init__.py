"""What both services share at run time.

The name is fixed by the project's layout (``services/`` next to ``ar_service/`` and ``dit_service/``);
the services themselves live in those two packages. Here:

- ``app``: the app factory both use (``/healthz``, ``/readyz``, ``/metrics``, error handlers, tracing).
- ``errors``, ``last_resort``, ``auth``, ``request_gate``: OpenAI-shaped error bodies (also for a
  failure nobody foresaw), the one bearer-token check, the public port's gate (key, body size, body
  deadline).
- ``connection_guard``, ``internal_port``: connections that send no request are cut off and capped; a
  second port for the cluster's own callers, with no API key.
- ``app_metrics``, ``metrics``, ``tracing``, ``request_context``: what every response is counted and
  traced by, and the request id on every log line.
- ``fatal``, ``serve``, ``slow_readers``, ``heap``, ``drain``: a service that can no longer serve exits;
  uvicorn under it, with clients that stop reading cut off after a send timeout; the start-up heap frozen
  once ready, so full garbage collections do not stop the event loop for half a second; a service asked
  to stop loses no admitted work.
- ``launcher``, ``lifetime``: ``make run``'s supervisor of the pair on one machine; processes that die
  with their parent.
- ``settings``, ``dtype``, ``version``: the value types both services' settings are made of; the dtype a
  service computes in when none is named; ardit's version.
- ``model_card``, ``checkpoints``: one card per diffusers family (what both services know of a model
  folder: its pipelines, features, row recipe and defaults; diffusers-free, so the AR reads it too); the
  local checkpoints' names and where they live.

It imports neither service; both import it.
"""
