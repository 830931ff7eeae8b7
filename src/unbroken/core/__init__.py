"""The sans-IO core: every decision about a turn, with no sockets and no event loop.

Data flows through it in this order:

* `sse`        splits upstream bytes into events, keeping their exact raw bytes;
* `protocols`  classify each event by table (output, control, tool call, terminal, ...);
* `ledger`     decides what is released, what is held, and whether a replay is still safe;
* `turn`       the turn machine: attempts, waits, giving up, phases, stalls, early
               headers and keepalives, as events in and actions out;
* `policy`     the tables and arithmetic of retrying: statuses, failure classes, delays,
               Retry-After, rotation.

Nothing here imports aiohttp, asyncio or ssl (a test walks the imports).  Time and
randomness are passed in, so every decision is testable with plain values.
"""
