"""A small hostile S3 speaker on localhost: enough of the S3 API for pmakit's reader (HEAD bucket, ListObjectsV2,
HEAD object, ranged GET) with switchable misbehaviours, to test what a broken or malicious store can do to a merge.

Objects are declared, not stored: each has a size and a function giving its bytes ``[start, stop)``, so that a
"5 GiB" object costs nothing until someone asks for its bytes. Misbehaviours (attributes, set before or during a
run): ``endless_pages`` (every listing page says there is another), ``page_size`` (keys per page), ``extra_keys``
(a generator of further (key, size) listed after the declared objects), ``trickle`` (GET bodies sent one byte a
second), ``serve_cap`` (the most bytes one GET response sends before the connection is dropped), ``budget`` (the
most body bytes sent in all: past it every GET is broken off at once, so that a client fetching a declared 1.5 GiB
object costs the test machine at most that).

Bounded everywhere: it listens on 127.0.0.1 only, a trickle sends at most ``trickle_cap`` bytes, and the server
stops by itself after ``lifetime`` seconds (a test that forgets to stop it leaves nothing running).
"""

from __future__ import annotations

import http.server
import itertools
import socket
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from xml.sax.saxutils import escape

from s3server import StoreHandler


@dataclass
class Obj:
    size: int
    data: Callable[[int, int], bytes]
    etag: str = '"0123456789abcdef0123456789abcdef"'


def constant(payload: bytes) -> Obj:
    """An object holding ``payload``."""
    return Obj(len(payload), lambda a, b: payload[a:b])


def declared(size: int, head: bytes = b"") -> Obj:
    """An object of ``size`` bytes: ``head``, then zeros (never materialised beyond what a GET asks for)."""

    def data(a: int, b: int) -> bytes:
        part = head[a:b]
        return part + bytes(max(0, b - max(a, len(head)))) if b > len(head) else part

    return Obj(size, data)


class HostileS3:
    """The server; ``env`` is what a client needs to reach it (fake credentials, ``AWS_ENDPOINT_URL``)."""

    def __init__(self, bucket: str, objects: dict[str, Obj], lifetime: float = 1800) -> None:
        self.bucket = bucket
        self.objects = objects
        self.page_size = 1000
        self.endless_pages = False
        self.extra_keys: Callable[[], Iterator[tuple[str, int]]] | None = None
        self.trickle = False
        self.trickle_cap = 600
        self.serve_cap: int | None = None
        self.budget = 512 * 2**20
        self.requests: list[tuple[str, str, str]] = []
        """(method, path, Range header) of every request."""
        self.bytes_sent = 0
        self._lock = threading.Lock()
        server = self

        class Handler(StoreHandler):
            def do_HEAD(self) -> None:
                server._handle(self, head=True)

            def do_GET(self) -> None:
                server._handle(self, head=False)

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()
        self._timer = threading.Timer(lifetime, self.stop)
        self._timer.daemon = True
        self._timer.start()

    def env(self) -> dict[str, str]:
        from s3server import FAKE_CREDENTIALS

        return {**FAKE_CREDENTIALS, "AWS_ENDPOINT_URL": self.url}

    def stop(self) -> None:
        self._timer.cancel()
        self.httpd.shutdown()
        self.httpd.server_close()

    def ranges(self) -> list[tuple[str, int, int]]:
        """(key, start, stop) of every ranged GET received."""
        out = []
        for method, path, rng in self.requests:
            if method == "GET" and rng.startswith("bytes="):
                a, _, b = rng[6:].partition("-")
                out.append((path.split("/", 2)[-1], int(a), int(b) + 1))
        return out

    # -----------------------------------------------------------------------------------------------------------

    def _handle(self, h: http.server.BaseHTTPRequestHandler, head: bool) -> None:
        url = urllib.parse.urlsplit(h.path)
        query = dict(urllib.parse.parse_qsl(url.query, keep_blank_values=True))
        with self._lock:
            self.requests.append((h.command, h.path, h.headers.get("Range", "")))
        parts = urllib.parse.unquote(url.path).lstrip("/").split("/", 1)
        if parts[0] != self.bucket:
            return self._send(h, 404, b"<Error><Code>NoSuchBucket</Code></Error>", head)
        if len(parts) == 1 or parts[1] == "":
            if head:
                return self._send(h, 200, b"", head)
            return self._send(h, 200, self._listing(query), head)
        obj = self.objects.get(parts[1])
        if obj is None:
            return self._send(h, 404, b"<Error><Code>NoSuchKey</Code></Error>", head)
        if head:
            return self._send(h, 200, b"", head, length=obj.size, etag=obj.etag)
        a, b = 0, obj.size
        rng = h.headers.get("Range", "")
        if rng.startswith("bytes="):
            first, _, last = rng[6:].partition("-")
            a, b = int(first), min(obj.size, int(last) + 1)
        self._body(h, obj, a, b)

    def _listing(self, query: dict[str, str]) -> bytes:
        prefix = query.get("prefix", "")
        page = int(query.get("continuation-token") or 0)
        listed = [(k, o.size) for k, o in sorted(self.objects.items()) if k.startswith(prefix)]
        keys: Iterator[tuple[str, int]] = iter(listed)
        if self.extra_keys is not None:
            keys = itertools.chain(keys, self.extra_keys())
        chunk = list(itertools.islice(keys, page * self.page_size, (page + 1) * self.page_size))
        more = self.endless_pages or len(chunk) == self.page_size
        contents = "".join(
            f"<Contents><Key>{escape(k)}</Key><Size>{s}</Size><ETag>&quot;e&quot;</ETag></Contents>"
            for k, s in chunk
        )
        token = f"<NextContinuationToken>{page + 1}</NextContinuationToken>" if more else ""
        return (
            '<?xml version="1.0" encoding="UTF-8"?><ListBucketResult>'
            f"<Name>{self.bucket}</Name><Prefix>{escape(prefix)}</Prefix><KeyCount>{len(chunk)}</KeyCount>"
            f"<MaxKeys>{self.page_size}</MaxKeys><IsTruncated>{str(more).lower()}</IsTruncated>{token}"
            f"{contents}</ListBucketResult>"
        ).encode()

    def _send(
        self,
        h: http.server.BaseHTTPRequestHandler,
        status: int,
        payload: bytes,
        head: bool,
        length: int | None = None,
        etag: str | None = None,
    ) -> None:
        h.send_response(status)
        h.send_header("Content-Length", str(len(payload) if length is None else length))
        if etag:
            h.send_header("ETag", etag)
        h.end_headers()
        if not head:
            h.wfile.write(payload)

    def _body(self, h: http.server.BaseHTTPRequestHandler, obj: Obj, a: int, b: int) -> None:
        h.send_response(206 if (a, b) != (0, obj.size) else 200)
        h.send_header("Content-Length", str(b - a))
        h.send_header("Content-Range", f"bytes {a}-{b - 1}/{obj.size}")
        h.send_header("ETag", obj.etag)
        h.end_headers()
        cap = b - a if self.serve_cap is None else min(b - a, self.serve_cap)
        with self._lock:
            cap = max(0, min(cap, self.budget - self.bytes_sent))
        try:
            if self.trickle:
                for i in range(min(cap, self.trickle_cap)):
                    h.wfile.write(obj.data(a + i, a + i + 1))
                    h.wfile.flush()
                    time.sleep(1.0)
            else:
                for start in range(a, a + cap, 1 << 20):
                    piece = obj.data(start, min(a + cap, start + (1 << 20)))
                    h.wfile.write(piece)
                    with self._lock:
                        self.bytes_sent += len(piece)
            h.wfile.flush()
            if cap < b - a:  # a response broken off: drop the connection
                h.close_connection = True
                h.connection.shutdown(socket.SHUT_RDWR)
        except OSError:  # the client went away
            h.close_connection = True
