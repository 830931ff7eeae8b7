"""The client's WebSocket, closed with a lingering close after an oversized message.

aiohttp answers a message over ``max_msg_size`` with a 1009 close frame and then
closes the TCP connection at once.  With the rest of the message still arriving,
the kernel answers that input with a reset, and a reset throws away what the
client had not read yet: the close frame.  The client sees 1006 (abnormal
closure) instead of 1009 (message too big), and cannot tell a limit from a crash.

`ClientSocket` leaves the connection open instead, and `ClientSocket.linger`
keeps it open while aiohttp reads and drops whatever still arrives, until the
client closes or `LINGER_S` has passed; only then is the connection closed.
Nothing read in the meantime is buffered.  (Not a half-close: a FIN makes many
clients, aiohttp's among them, close their side before they can answer the close
frame, and they report 1006 again.)
"""

from __future__ import annotations

import asyncio

from aiohttp import WebSocketError, WSCloseCode, web

__all__ = ["LINGER_S", "ClientSocket"]

#: the longest a socket closed for an oversized message waits for the client to close
LINGER_S = 2.0
#: how often the lingering socket looks whether the client has closed
_POLL_S = 0.02


class ClientSocket(web.WebSocketResponse):
    """A ``WebSocketResponse`` whose close after an oversized message lingers."""

    lingering = False

    def _close_transport(self) -> None:
        exc = self.exception()
        req = self._req
        transport = req.transport if req is not None else None
        if (
            isinstance(exc, WebSocketError)
            and exc.code == WSCloseCode.MESSAGE_TOO_BIG
            and transport is not None
            and not transport.is_closing()
        ):
            self.lingering = True  # the close frame is on its way; `linger` closes
            return
        super()._close_transport()

    async def linger(self) -> None:
        """Wait (up to `LINGER_S`) for the client to close, then close the connection."""
        if not self.lingering:
            return
        req = self._req
        transport = req.transport if req is not None else None
        loop = asyncio.get_running_loop()
        deadline = loop.time() + LINGER_S
        try:
            while transport is not None and not transport.is_closing():
                if loop.time() >= deadline:
                    break
                await asyncio.sleep(_POLL_S)  # the client's close is what ends this
        finally:
            self.lingering = False
            if transport is not None:
                transport.close()
