"""What a route answers through: the request's service, its body and the
ways to answer it (docs/design.md section 5e). http.Handler makes one per
request and hands it to the route, which sees nothing of the handler: the
calls run down the modules, as the imports do."""

from queue import Empty
from typing import Callable

from .connections import client_gone
from .schema import Request, RequestError


class ClientGone(Exception):
    """The request's client left (a Stop in the page, a closed socket)."""


class Reply:
    """One request's answer: `read_json()` its body (a 4xx where it is not a
    JSON object), `send_json(status, obj, headers=None)`, `send_bytes(status,
    content_type, data)`, or `start_events()` then `event(text)` for a stream."""

    def __init__(
        self,
        service,
        wfile,
        connection,
        read_json: Callable[[], dict],
        send_json: Callable[..., None],
        send_bytes: Callable[[int, str, bytes], None],
        start_events: Callable[[], None],
    ):
        self.service, self.wfile, self.connection = service, wfile, connection
        self.read_json, self.send_json = read_json, send_json
        self.send_bytes, self.start_events = send_bytes, start_events

    def gone(self) -> bool:
        """Whether the client has left (connections.client_gone)."""
        return client_gone(self.connection)

    def event(self, text: str) -> None:
        """One server-sent event's text, sent now."""
        self.wfile.write(text.encode())
        self.wfile.flush()

    def next_event(self, request: Request):
        """The request's next event; notices a dead worker or a client that left."""
        while True:
            try:
                return request.events.get(timeout=0.5)
            except Empty:
                if not self.service.worker.thread.is_alive():
                    return (
                        "error",
                        RequestError(
                            "the server is shutting down",
                            status=503,
                            kind="server_error",
                        ),
                    )
                if self.gone():
                    raise ClientGone()
