"""serve's connections: at most `max_connections` open at once (each holds a
thread), `max_per_client` from one address, a 503 past either; a deadline
for each request's headers and body as a whole (RequestReader), so a client
trickling a byte at a time is closed; one log line for a client that leaves.

The standard library's ThreadingHTTPServer starts a thread per connection
with no cap, its timeout applies per read (a byte every few seconds holds a
connection for ever), and it prints a traceback for every connection reset.
"""

import io
import json
import select
import signal
import socket
import sys
import threading
import time
from typing import Optional

import mlx.core as mx

from .guard import framing_error
from .log import log

REFUSE_READ_S = 1.0  # how long a refused client may take to finish sending
REQUEST_S = 10.0  # a request's headers and body, in all (--request-timeout)


def _busy_reply(message: str) -> bytes:
    body = json.dumps(
        {
            "error": {
                "message": message + "; try again shortly",
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


class RequestReader(io.RawIOBase):
    """A connection's reads (the handler's rfile, buffered over this), with
    `idle` seconds at most per read and `limit` seconds for a whole request:
    from its first byte (start()) until its body is read, or a TimeoutError."""

    def __init__(self, sock: socket.socket, idle: float, limit: float):
        self.sock, self.idle, self.limit = sock, idle, limit
        self.deadline: Optional[float] = None
        self.waiting = True  # for a request's first byte: the clock starts there

    def readable(self) -> bool:
        return True

    def start(self) -> None:
        """The next byte read begins a request."""
        self.deadline, self.waiting = None, True

    def readinto(self, buffer) -> int:
        timeout = self.idle
        if self.deadline is not None:
            timeout = min(timeout, self.deadline - time.monotonic())
            if timeout <= 0:
                raise TimeoutError(f"a request took over {self.limit:g} s to arrive")
        self.sock.settimeout(timeout)
        try:
            n = self.sock.recv_into(buffer)
        finally:
            self.sock.settimeout(self.idle)  # writes: the idle timeout
        if self.waiting and n:
            self.deadline, self.waiting = time.monotonic() + self.limit, False
        return n


class ReadsRequests:
    """A BaseHTTPRequestHandler mixin (first in the bases): each request read
    within its deadline (RequestReader), and framed one way only, or a 400
    and a close: a request line of three words, one Host, one Content-Length
    (guard.framing_error), so no request is read as two or two as one."""

    # A request line the standard library cannot read still gets a status
    # line with its 400 (HTTP/0.9's default would send the body bare).
    default_request_version = "HTTP/1.1"

    def setup(self):
        super().setup()
        self.rfile.close()  # the socket's own file: reads go through the deadline
        self.reader = RequestReader(
            self.connection, self.timeout, self.server.request_timeout
        )
        self.rfile = io.BufferedReader(self.reader)

    def handle_one_request(self):
        self.reader.start()
        super().handle_one_request()

    def parse_request(self) -> bool:
        """The standard library's, then one request's framing only (guard.py):
        a request line of three words, one Host, one Content-Length."""
        self.headers = None  # the last request's: no CORS grant from them
        words = len(self.raw_requestline.split())
        if words not in (
            0,
            3,
        ):  # 0: a blank line, closed as the standard library does; 2: HTTP/0.9
            self.command, self.request_version = None, "HTTP/1.1"
            self.requestline = str(self.raw_requestline, "iso-8859-1").rstrip()
            self.send_error(400, f"bad request line {self.requestline[:80]!r}")
            return False
        if not super().parse_request():
            return False
        error = framing_error(self.headers)
        if error:
            self.send_error(400, error)  # which closes the connection
            return False
        return True


class CappedServer:
    """A socketserver mixin (before ThreadingMixIn in the bases)."""

    max_connections = 128
    max_per_client = 32

    def __init__(self, *args, **kwargs):
        self.open_connections = 0
        self.per_client = {}  # address -> its connections open
        self._open_lock = threading.Lock()
        super().__init__(*args, **kwargs)

    def process_request(self, request, client_address):
        address = client_address[0]
        with self._open_lock:
            mine = self.per_client.get(address, 0)
            if self.open_connections >= self.max_connections:
                full = f"the server has {self.max_connections} connections open, "
                full += "its limit (--max-connections)"
            elif mine >= self.max_per_client:
                full = f"{address} has {mine} connections open, the limit for "
                full += "one address (--max-connections-per-client)"
            else:
                full = None
                self.open_connections += 1
                self.per_client[address] = mine + 1
        if full:  # its own short thread: the accept loop never waits on a client
            threading.Thread(
                target=self._refuse, args=(request, full), daemon=True
            ).start()
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._closed(address)
            raise

    def process_request_thread(self, request, client_address):
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._closed(client_address[0])

    def _closed(self, address):
        with self._open_lock:
            self.open_connections -= 1
            self.per_client[address] -= 1
            if not self.per_client[address]:
                del self.per_client[address]

    def _refuse(self, request, message: str):
        """503, then read what the client still sends (closing on unread data
        would reset the connection, and the client might never see the 503)."""
        try:
            request.settimeout(REFUSE_READ_S)
            request.sendall(_busy_reply(message))
            request.shutdown(1)  # SHUT_WR: the reply is complete
            end = time.monotonic() + REFUSE_READ_S  # in all: a trickle ends too
            for _ in range(64):  # at most 64 x 64 KiB
                left = end - time.monotonic()
                if left <= 0:
                    break
                request.settimeout(left)
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
