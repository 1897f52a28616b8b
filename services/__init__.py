"""What both services share at run time, and nothing about images.

The name is fixed by the project's layout (``services/`` next to ``ar_service/`` and ``dit_service/``);
the services themselves live in those two packages. Here:

- ``app``: the app factory both use (``/healthz``, ``/readyz``, ``/metrics``, error handlers, tracing).
- ``errors``, ``last_resort``, ``auth``, ``request_gate``: OpenAI-shaped error bodies (also for a
  failure nobody foresaw), the one bearer-token check, the public port's gate (key, body size, body
  deadline).
- ``app_metrics``, ``metrics``, ``tracing``, ``request_context``: what every response is counted and
  traced by, and the request id on every log line.
- ``fatal``, ``serve``, ``slow_readers``, ``heap``: a service that can no longer serve exits; uvicorn
  under it, with clients that stop reading cut off after a send timeout; the start-up heap frozen
  once ready, so full garbage collections do not stop the event loop for half a second.
- ``launcher``, ``lifetime``: ``make run``'s supervisor of the pair on one machine; processes that die
  with their parent.
- ``checkpoints``: the local checkpoints' names and where they live.

It imports neither service; both import it.
"""
