"""serve's connections: at most `max_connections` open at once (each holds a
thread), a 503 past that, and one log line for a client that goes away.

The standard library's ThreadingHTTPServer starts a thread per connection
with no cap, and prints a traceback for every connection reset.
"""

import json
import select
import signal
import socket
import sys
import threading

import mlx.core as mx

from .log import log

REFUSE_READ_S = 1.0  # how long a refused client may take to finish sending


def _busy_reply(cap: int) -> bytes:
    body = json.dumps(
        {
            "error": {
                "message": f"the server has {cap} connections open, its limit "
                "(--max-connections); try again shortly",
                "type": "server_error",
                "param": None,
                "code": "too_many_connections",
            }
        }
    ).encode()
    head = (
        "HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nRetry-After: 1\r\nConnection: close\r\n\r\n"
    )
    return head.encode() + body


def client_gone(connection: socket.socket) -> bool:
    """Whether the client closed its end (readable, nothing to read) or the
    socket fails: a request still waiting for its reply stops there."""
    try:
        readable, _, _ = select.select([connection], [], [], 0)
        return bool(readable) and connection.recv(1, socket.MSG_PEEK) == b""
    except OSError:
        return True


class CappedServer:
    """A socketserver mixin (before ThreadingMixIn in the bases)."""

    max_connections = 128

    def __init__(self, *args, **kwargs):
        self.open_connections = 0
        self._open_lock = threading.Lock()
        super().__init__(*args, **kwargs)

    def process_request(self, request, client_address):
        with self._open_lock:
            full = self.open_connections >= self.max_connections
            if not full:
                self.open_connections += 1
        if full:  # its own short thread: the accept loop never waits on a client
            threading.Thread(target=self._refuse, args=(request,), daemon=True).start()
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._closed()
            raise

    def process_request_thread(self, request, client_address):
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._closed()

    def _closed(self):
        with self._open_lock:
            self.open_connections -= 1

    def _refuse(self, request):
        """503, then read what the client still sends (closing on unread data
        would reset the connection, and the client might never see the 503)."""
        try:
            request.settimeout(REFUSE_READ_S)
            request.sendall(_busy_reply(self.max_connections))
            request.shutdown(1)  # SHUT_WR: the reply is complete
            for _ in range(64):  # at most 64 x 64 KiB, within REFUSE_READ_S each
                if not request.recv(1 << 16):
                    break
        except OSError:
            pass
        finally:
            request.close()

    def handle_error(self, request, client_address):
        """A connection that failed outside a route's own handling: one line
        for a client that left, the traceback only for anything else."""
        error = sys.exc_info()[1]
        if isinstance(error, OSError):
            log(f"client {client_address[0]} left: {error}")
        else:
            import traceback

            log(f"internal error: {error}\n{traceback.format_exc()}", "ERROR")


def run_until_signal(server) -> None:
    """Serve until SIGINT (Ctrl-C) or SIGTERM, then stop cleanly: requests in
    flight get an error, the generation thread ends, the socket closes."""
    stopping = threading.Event()

    def stop(signum, frame):
        if not stopping.is_set():
            stopping.set()
            log(f"{signal.Signals(signum).name}: stopping")
            # shutdown() waits for serve_forever, which runs on this thread.
            threading.Thread(target=server.shutdown, daemon=True).start()

    previous = {s: signal.signal(s, stop) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        server.serve_forever(poll_interval=0.2)
    finally:
        server.service.worker.close()
        server.service.wait_idle(5.0)
        server.server_close()
        mx.clear_streams()  # this thread's too (mlx_lm's generation stream)
        for s, handler in previous.items():
            signal.signal(s, handler)
        log("stopped")
