"""The I/O shell: thin aiohttp transports that carry out what the turn machine decides.

* `server`     the client-facing aiohttp app: routing, body limits, /healthz, shutdown;
* `http`       one HTTP turn (SSE or a plain body) driven by `core.turn.TurnMachine`;
* `websocket`  the Responses API over WebSocket, and its HTTP fallback, driven by the
               same machine;
* `upstream`   the outbound aiohttp session, request and response headers, URLs;
* `errors`     the table that turns transport exceptions into typed failures.

If you are about to write a retry or stall decision here, it belongs in `core.turn`.
"""
