"""Count every request a planted server (tests/openai_fake.py) answers, GET and POST alike, to show
that a refused run asked nothing."""
from __future__ import annotations

import threading
from http.server import ThreadingHTTPServer


class RequestCount:
    def __init__(self, server: ThreadingHTTPServer):
        self.n = 0
        lock = threading.Lock()
        handler = server.RequestHandlerClass
        count = self

        def counted(method):
            def wrapper(h):
                with lock:
                    count.n += 1
                method(h)
            return wrapper
        handler.do_GET = counted(handler.do_GET)
        handler.do_POST = counted(handler.do_POST)
