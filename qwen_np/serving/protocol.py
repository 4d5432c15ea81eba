"""The HTTP connection under the app: uvicorn's HTTP/1.1 protocol (h11) with a deadline for each request's
headers, and how long a connection may stay open between requests.

Imports nothing of serving/ (it is the bottom of the folder, with access.py).
"""

from __future__ import annotations

import asyncio

# Between requests, uvicorn closes a kept-alive connection that stays idle for KEEP_ALIVE_SECONDS; and a
# connection gets HEADER_SECONDS for each request's headers, from its opening or its last response
# (header_deadline_protocol), so none is held half-open. (A body has app.BODY_SECONDS.)
KEEP_ALIVE_SECONDS, HEADER_SECONDS = 5, 10.0


def header_deadline_protocol() -> type:
    """uvicorn's HTTP/1.1 protocol (h11), with a deadline for each request's headers: uvicorn times out a
    kept-alive connection only while it is idle, so one that sends nothing, or half a header, would hold
    its socket forever. Hand-written because uvicorn has no such setting (its `timeout_keep_alive` timer
    is cancelled by any byte received); this arms one timer of our own while headers are awaited."""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class HeaderDeadline(H11Protocol):
        deadline: asyncio.TimerHandle | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:     # type: ignore[override]
            super().connection_made(transport)
            self._await_headers()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._await_headers()

        def handle_events(self) -> None:
            super().handle_events()
            if self.conn.their_state is not h11.IDLE and self.deadline is not None:     # the headers are in
                self.deadline.cancel()
                self.deadline = None

        def connection_lost(self, exc: Exception | None) -> None:
            if self.deadline is not None:
                self.deadline.cancel()
            super().connection_lost(exc)

        def _await_headers(self) -> None:
            if self.deadline is not None:
                self.deadline.cancel()
            waiting = self.conn.their_state is h11.IDLE       # not when a pipelined request's headers are in
            self.deadline = self.loop.call_later(HEADER_SECONDS, self._headers_late) if waiting else None

        def _headers_late(self) -> None:
            self.deadline = None
            if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
                self.transport.close()

    return HeaderDeadline
