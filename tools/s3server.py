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
