"""A fault-injecting TCP proxy on 127.0.0.1 in front of a real S3 server (moto): requests that
`hang(request_line)` selects are accepted and never answered; the others are passed through, one
request per connection (the proxy asks both sides to close), so each request is seen."""
from __future__ import annotations

import re
import socket
import threading


class HangingProxy:
    def __init__(self, upstream: tuple[str, int], hang):
        self.upstream, self.hang = upstream, hang
        self.hung = 0  # requests held unanswered so far
        self._sock = socket.create_server(("127.0.0.1", 0), backlog=512)
        self.port = self._sock.getsockname()[1]
        self._open: list[socket.socket] = []
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            with self._lock:
                self._open.append(conn)
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            data = b""
            while b"\r\n\r\n" not in data:
                chunk = conn.recv(65536)
                if not chunk:
                    return
                data += chunk
            head, _, body = data.partition(b"\r\n\r\n")
            length = re.search(rb"(?im)^content-length:\s*(\d+)", head)
            while length and len(body) < int(length.group(1)):
                body += conn.recv(65536)
            if self.hang(head.split(b"\r\n", 1)[0].decode("latin-1")):
                with self._lock:
                    self.hung += 1
                while conn.recv(65536):  # silent until the client gives up
                    pass
                return
            head = re.sub(rb"(?im)^connection:[^\r\n]*\r\n?", b"", head).rstrip(b"\r\n") + b"\r\nConnection: close"
            with socket.create_connection(self.upstream) as up:
                up.sendall(head + b"\r\n\r\n" + body)
                while True:
                    chunk = up.recv(65536)
                    if not chunk:
                        break
                    conn.sendall(chunk)
        except OSError:
            pass
        finally:
            conn.close()

    def close(self) -> None:
        self._sock.close()
        with self._lock:
            for c in self._open:
                try:
                    c.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                c.close()
