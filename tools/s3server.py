"""A local S3 server for tests and the sync benchmark: moto's threaded server on 127.0.0.1, with an
optional delay per request to stand in for S3's per-request latency (loopback answers in
microseconds; S3 takes tens of milliseconds to the first byte)."""
from __future__ import annotations

import socket
import time


def delayed_server(delay: float = 0.0):
    """A started moto S3 server on a free loopback port whose requests each wait `server.delay` s."""
    from moto.moto_server.threaded_moto_server import ThreadedMotoServer
    from moto.moto_server.werkzeug_app import DomainDispatcherApplication, MotoRequestHandler, create_backend_app
    from werkzeug.serving import make_server

    class DelayedMotoServer(ThreadedMotoServer):
        def _server_entry(self):
            app = DomainDispatcherApplication(create_backend_app)

            def handler(environ, start_response):
                time.sleep(self.delay)
                return app(environ, start_response)

            self._server = make_server(self._ip_address, self._port, handler, True, request_handler=MotoRequestHandler)
            self._server_ready_event.set()
            self._server.serve_forever()

    server = DelayedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.delay = delay
    server.start()
    return server


def wait_listening(port: int, tries: int = 200) -> None:
    """Until a server started in another process accepts connections on 127.0.0.1:`port` (about 10 s at most)."""
    for _ in range(tries):
        try:
            socket.create_connection(("127.0.0.1", port), 0.2).close()
            return
        except OSError:
            time.sleep(0.05)


class LatencyProxy:
    """A TCP proxy on a free loopback port in front of 127.0.0.1:`upstream_port` that holds each request
    `delay` seconds before passing it on (HTTP/1.1 without pipelining: a client's next request waits for the
    answer, so every request, a GET of one small file as a ranged GET of a shard, pays the delay once), and
    passes answers through as they come. It stands in for S3's first-byte latency in front of a fast server
    (rclone's `serve s3`), where moto's own pace would hide it. Runs an asyncio loop on a thread of its own."""

    def __init__(self, upstream_port: int, delay: float):
        import asyncio
        import threading

        self.delay, self.upstream_port = delay, upstream_port
        self._loop = asyncio.new_event_loop()
        ready = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(ready,), daemon=True, name="latency-proxy")
        self._thread.start()
        ready.wait(10)

    def _run(self, ready) -> None:
        import asyncio

        asyncio.set_event_loop(self._loop)
        self._server = self._loop.run_until_complete(asyncio.start_server(self._serve, "127.0.0.1", 0))
        self.port = self._server.sockets[0].getsockname()[1]
        ready.set()
        self._loop.run_forever()

    async def _serve(self, reader, writer) -> None:
        import asyncio

        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.upstream_port)
        except OSError:
            writer.close()
            return

        async def requests():  # client -> server, each chunk (a request's head) held `delay` first
            try:
                while data := await reader.read(1 << 16):
                    if self.delay:
                        await asyncio.sleep(self.delay)
                    up_writer.write(data)
                    await up_writer.drain()
            finally:
                up_writer.close()

        async def answers():  # server -> client, as it comes
            try:
                while data := await up_reader.read(1 << 18):
                    writer.write(data)
                    await writer.drain()
            finally:
                writer.close()

        await asyncio.gather(requests(), answers(), return_exceptions=True)

    def stop(self) -> None:
        self._loop.call_soon_threadsafe(self._server.close)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
