"""A fault-injecting HTTP proxy on 127.0.0.1 in front of an S3 endpoint (moto's server), for tests.

Requests are forwarded one by one (keep-alive towards the client, one upstream connection per
request). A fault is armed for the next `times` GETs whose path contains `match` (HEADs too for "301" and "skew"):

- "503": answer 503 SlowDown (S3's throttling reply) without asking upstream;
- "cut": send the headers and half the body, then close the connection;
- "stall": send the headers and half the body, then nothing for `stall_s` seconds, then close;
- "flip": send the whole body with one byte inverted (a checksum must catch it);
- "hang": read the request and answer nothing, until the client gives up or the proxy stops;
- "301": answer S3's 301 PermanentRedirect for a bucket in another region (`region`, in its
  x-amz-bucket-region header and its Endpoint), without asking upstream;
- "skew": answer S3's 403 RequestTimeTooSkewed (the request's clock far from the server's), without asking
  upstream.

Everything is bounded: sockets time out, a stall ends, and the server stops with the fixture.
`requests` records (method, path, fault, headers) of every request.
"""
from __future__ import annotations

import http.client
import socket
import socketserver
import threading
from dataclasses import dataclass
from urllib.parse import urlsplit

SLOWDOWN = (b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SlowDown</Code><Message>Please reduce your '
            b'request rate.</Message></Error>')
REDIRECT = ('<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>PermanentRedirect</Code><Message>The bucket you are '
            'attempting to access must be addressed using the specified endpoint. Please send all future requests to '
            'this endpoint.</Message><Endpoint>{bucket}.s3.{region}.amazonaws.com</Endpoint><Bucket>{bucket}</Bucket>'
            '<RequestId>R1</RequestId></Error>')
SKEWED = (b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>RequestTimeTooSkewed</Code><Message>The difference '
          b'between the request time and the current time is too large.</Message><RequestTime>20200101T000000Z'
          b'</RequestTime><ServerTime>2020-01-01T00:20:00Z</ServerTime><MaxAllowedSkewMilliseconds>900000'
          b'</MaxAllowedSkewMilliseconds><RequestId>R2</RequestId></Error>')


@dataclass
class Fault:
    kind: str  # 503 | cut | stall | flip | hang | 301 | skew
    match: str  # substring of the request path
    times: int = 1
    stall_s: float = 30.0
    region: str = "eu-west-1"  # 301: the bucket's region


class FaultProxy:
    def __init__(self, upstream: str):
        u = urlsplit(upstream)
        self.upstream = (u.hostname, u.port)
        self.faults: list[Fault] = []
        self.requests: list[tuple[str, str, str | None, dict]] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        proxy = self

        class Handler(socketserver.BaseRequestHandler):
            def handle(self):
                self.request.settimeout(10)
                f = self.request.makefile("rb")
                for _ in range(10_000):  # requests on one kept-alive connection
                    if proxy._stop.is_set() or not proxy._serve_one(f, self.request):
                        return

        class Server(socketserver.ThreadingTCPServer):
            daemon_threads = True
            allow_reuse_address = True

        self._server = Server(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def start(self) -> "FaultProxy":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._server.shutdown()
        self._server.server_close()

    def arm(self, kind: str, match: str, times: int = 1, stall_s: float = 30.0, region: str = "eu-west-1") -> None:
        with self._lock:
            self.faults.append(Fault(kind, match, times, stall_s, region))

    def applied(self, kind: str) -> int:
        return sum(1 for r in self.requests if r[2] == kind)

    def _take(self, method: str, path: str) -> Fault | None:
        with self._lock:
            for fault in self.faults:
                asked = method == "GET" or (method == "HEAD" and fault.kind in ("301", "skew"))
                if asked and fault.match in path and fault.times > 0:
                    fault.times -= 1
                    return fault
        return None

    def _serve_one(self, f, sock) -> bool:
        try:
            line = f.readline(65536)
        except (socket.timeout, OSError):
            return False
        if not line.strip():
            return False
        method, path, _ = line.decode("latin-1").split(" ", 2)
        headers = {}
        for _ in range(200):
            h = f.readline(65536).decode("latin-1")
            if h in ("\r\n", "\n", ""):
                break
            k, _, v = h.partition(":")
            headers[k.strip()] = v.strip()
        body = f.read(int(headers.get("Content-Length", 0) or 0))
        fault = self._take(method, path)
        self.requests.append((method, path, fault.kind if fault else None, headers))
        if fault and fault.kind == "503":
            sock.sendall(b"HTTP/1.1 503 Slow Down\r\nContent-Type: application/xml\r\nContent-Length: "
                         + str(len(SLOWDOWN)).encode() + b"\r\n\r\n" + SLOWDOWN)
            return True
        if fault and fault.kind in ("301", "skew"):
            bucket = path.lstrip("/").split("/", 1)[0].split("?", 1)[0]
            body = REDIRECT.format(bucket=bucket, region=fault.region).encode() if fault.kind == "301" else SKEWED
            head = (f"HTTP/1.1 301 Moved Permanently\r\nx-amz-bucket-region: {fault.region}\r\n" if fault.kind == "301"
                    else "HTTP/1.1 403 Forbidden\r\n")
            sock.sendall(f"{head}Content-Type: application/xml\r\nContent-Length: {len(body)}\r\n\r\n".encode()
                         + (body if method == "GET" else b""))
            return True
        if fault and fault.kind == "hang":
            while not self._stop.is_set():  # silent until the client closes (recv gives b"") or the proxy stops
                try:
                    if not sock.recv(65536):
                        break
                except socket.timeout:
                    continue
                except OSError:
                    break
            return False
        conn = http.client.HTTPConnection(*self.upstream, timeout=30)
        try:
            conn.request(method, path, body=body or None,
                         headers={k: v for k, v in headers.items() if k.lower() != "connection"})
            resp = conn.getresponse()
            data = resp.read()
            status, reason, resp_headers = resp.status, resp.reason, resp.getheaders()
        finally:
            conn.close()
        if fault and fault.kind == "flip" and data:
            data = bytearray(data)
            data[len(data) // 2] ^= 0xFF
            data = bytes(data)
        head = [f"HTTP/1.1 {status} {reason}"]
        keep = ("transfer-encoding", "connection") if method == "HEAD" else ("content-length", "transfer-encoding",
                                                                            "connection")
        head += [f"{k}: {v}" for k, v in resp_headers if k.lower() not in keep]
        head += ([] if method == "HEAD" else [f"Content-Length: {len(data)}"]) + ["", ""]
        sock.sendall("\r\n".join(head).encode("latin-1"))
        if fault and fault.kind in ("cut", "stall"):
            sock.sendall(data[: len(data) // 2])
            if fault.kind == "stall":
                self._stop.wait(fault.stall_s)
            sock.shutdown(socket.SHUT_RDWR)
            return False
        sock.sendall(data if method != "HEAD" else b"")
        return True

