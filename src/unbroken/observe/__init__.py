"""Observers: everything that watches turns, through the one `hooks.Hooks` protocol.

* `hooks`    the observer protocol, the fan-out, and the retry log;
* `guard`    runs an observer so that its failures never break a turn;
* `outcomes` each upstream's recent outcomes and cool-offs, for /status and metrics;
* `journal`  the SQLite turn journal (batched writer thread);
* `metrics`  Prometheus metrics (GET /metrics);
* `status`   the live status (GET /status) and ``unbroken status``;
* `stats`    ``unbroken stats``: reports from the journal.
"""
