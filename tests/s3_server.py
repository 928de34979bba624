"""S3 test infrastructure: a moto S3 server in its own process, and a fault-injecting HTTP proxy.

``S3Server`` runs ``python -m moto.server`` on 127.0.0.1 in a subprocess (so it never competes with
the test process for the GIL, and spawned ranks can reach it too). ``FaultProxy`` is a threaded
HTTP/1.1 keep-alive proxy, in the test process, that forwards every request unchanged to an endpoint
and returns the upstream response, while counting and logging requests and, on demand, answering some
of them itself with real-looking S3 errors (503 ``SlowDown`` by default) instead of forwarding them,
answering them slowly, or dropping their connections (before forwarding, after forwarding, halfway
through the answer, or after a silent stall).

Fixtures (``tests/conftest.py`` imports them, so every test module can use them; ``tests/`` is not a
package, so the tests import this as a top-level module):

- ``s3_server`` (session): an ``S3Server``; also puts ``s3_test_env()`` (dummy credentials, region,
  ``NO_PROXY``) in ``os.environ`` for the session, so TensorStore, s3fs/botocore and spawned children all find them.
- ``s3_proxy`` (function): a fresh ``FaultProxy`` in front of ``s3_server``.
- ``s3_bucket`` (function): the name of a fresh, empty bucket on ``s3_server``.

(PYTEST_DONT_REWRITE: the module is imported before pytest loads it as a plugin; it has no asserts.)
"""

from __future__ import annotations

import collections
import contextlib
import http.client
import http.server
import os
import random
import socket
import socketserver
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import pytest

REGION = "us-east-1"

#: Dummy credentials for moto. TensorStore reads only the two keys (``environment`` provider or default
#: chain; it reads no region and no ``AWS_ENDPOINT_URL``: both belong in the spec). botocore/s3fs read the
#: keys and ``AWS_DEFAULT_REGION`` (botocore 1.43 ignores ``AWS_REGION``; it is here for other SDKs).
#: ``AWS_EC2_METADATA_DISABLED`` keeps botocore from probing 169.254.169.254 if the keys are ever missing.
#: (``NO_PROXY``, for a proxy in the environment, is added by ``s3_test_env()``.)
S3_TEST_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_REGION": REGION,
    "AWS_DEFAULT_REGION": REGION,
    "AWS_EC2_METADATA_DISABLED": "true",
}


def s3_test_env() -> dict[str, str]:
    """``S3_TEST_ENV`` plus ``NO_PROXY``/``no_proxy`` extended by loopback, so that an HTTP proxy set in
    the environment (curl in TensorStore and botocore both honour one) never sits between a client and
    moto or the ``FaultProxy``."""
    env = dict(S3_TEST_ENV)
    for name in ("NO_PROXY", "no_proxy"):
        have = [h for h in os.environ.get(name, "").split(",") if h.strip()]
        env[name] = ",".join(have + [h for h in ("127.0.0.1", "localhost") if h not in have])
    return env


# S3's status and message for the error codes the proxy can answer with.
S3_ERRORS: dict[str, tuple[int, str]] = {
    "SlowDown": (503, "Please reduce your request rate."),
    "ServiceUnavailable": (503, "Service is unable to handle request."),
    "InternalError": (500, "We encountered an internal error. Please try again."),
    "AccessDenied": (403, "Access Denied"),
}


#: TensorStore ``s3_request_retries`` that keep a test fast: 1 try + 3 retries, 10 ms..50 ms apart (the
#: defaults, 32 retries from 1 s up to 32 s, turn one injected 503 into a >= 1 s stall).
FAST_TS_RETRIES = {"max_retries": 3, "initial_delay": "10ms", "max_delay": "50ms"}


def tensorstore_kvstore_spec(bucket: str, endpoint: str, path: str = "", *, retries: dict | None = None,
                             concurrency: int | None = None) -> dict[str, Any]:
    """A TensorStore ``s3`` kvstore spec for moto (or a proxy) at ``endpoint``.

    ``aws_region`` spares a ``HEAD /bucket`` (region discovery) before the first request; the
    ``environment`` credentials read ``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY`` without the default
    chain's noise about a missing ``~/.aws/config``. TensorStore ignores ``AWS_ENDPOINT_URL``, so the
    endpoint must be in the spec. ``retries`` (e.g. ``FAST_TS_RETRIES``) and ``concurrency`` become the
    ``s3_request_retries`` / ``s3_request_concurrency`` context resources, inline.
    """
    spec: dict[str, Any] = {"driver": "s3", "bucket": bucket, "path": path, "endpoint": endpoint,
                            "aws_region": REGION, "aws_credentials": {"type": "environment"}}
    if retries is not None:
        spec["s3_request_retries"] = dict(retries)
    if concurrency is not None:
        spec["s3_request_concurrency"] = {"limit": concurrency}
    return spec


def s3fs_storage_options(endpoint: str, *, botocore_attempts: int | None = None) -> dict[str, Any]:
    """``s3fs.S3FileSystem(**these)`` / zarr's and fsspec's ``storage_options`` for moto at ``endpoint``.

    ``botocore_attempts`` caps botocore's tries per call (``retries.total_max_attempts``); by default
    botocore (legacy mode) tries a 5xx 5 times, and s3fs itself repeats a ``SlowDown`` call up to
    ``S3FileSystem.retries`` (5) times on top of that.
    """
    options: dict[str, Any] = {"endpoint_url": endpoint, "key": S3_TEST_ENV["AWS_ACCESS_KEY_ID"],
                               "secret": S3_TEST_ENV["AWS_SECRET_ACCESS_KEY"],
                               "client_kwargs": {"region_name": REGION}}
    if botocore_attempts is not None:
        options["config_kwargs"] = {"retries": {"total_max_attempts": botocore_attempts}}
    return options


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def patched_environ(values: dict[str, str]) -> Iterator[None]:
    """Set ``values`` in ``os.environ`` for the duration, restoring what was there before."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _http_answers(host: str, port: int, timeout: float = 1.0) -> bool:
    try:
        conn = http.client.HTTPConnection(host, port, timeout=timeout)
        try:
            conn.request("GET", "/moto-api/")
            conn.getresponse().read()
            return True
        finally:
            conn.close()
    except OSError:
        return False


class S3Server:
    """moto's S3 server in a subprocess on 127.0.0.1 (a free port unless ``port`` is given)."""

    host = "127.0.0.1"

    def __init__(self, port: int | None = None, start_timeout: float = 30.0):
        self._want_port = port
        self._start_timeout = start_timeout
        self._proc: subprocess.Popen | None = None
        self._logfile: Any = None
        self._boto: Any = None
        self.port = 0
        self.start()

    @property
    def endpoint(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def env(self) -> dict[str, str]:
        """Environment variables a client (or a spawned child) needs: dummy keys, region, ``NO_PROXY``."""
        return s3_test_env()

    def start(self) -> None:
        if self._proc is not None:
            return
        self._logfile = tempfile.NamedTemporaryFile(prefix="moto-", suffix=".log", delete=False)
        last = ""
        for _ in range(3):  # a free port can be taken between free_port() and the bind; try another
            self.port = self._want_port or free_port()
            env = {**os.environ, **S3_TEST_ENV}
            self._proc = subprocess.Popen(
                [sys.executable, "-m", "moto.server", "-H", self.host, "-p", str(self.port)],
                stdin=subprocess.DEVNULL, stdout=self._logfile, stderr=subprocess.STDOUT, env=env,
            )
            deadline = time.monotonic() + self._start_timeout
            while time.monotonic() < deadline and self._proc.poll() is None:
                if _http_answers(self.host, self.port):
                    return
                time.sleep(0.05)
            self._stop_proc()
            with open(self._logfile.name, errors="replace") as f:
                last = f.read()[-2000:]
        raise RuntimeError(f"moto server did not start on {self.host}; its log ends:\n{last}")

    def _stop_proc(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    @property
    def client(self) -> Any:
        """A botocore S3 client straight to the server (made once; botocore clients are thread-safe)."""
        if self._boto is None:
            import botocore.session

            self._boto = botocore.session.get_session().create_client(
                "s3", endpoint_url=self.endpoint, region_name=REGION,
                aws_access_key_id=S3_TEST_ENV["AWS_ACCESS_KEY_ID"],
                aws_secret_access_key=S3_TEST_ENV["AWS_SECRET_ACCESS_KEY"],
            )
        return self._boto

    def create_bucket(self, name: str | None = None) -> str:
        """Create a bucket (``name`` must be 3-63 chars of ``[a-z0-9.-]``); a unique one if not given."""
        name = name or f"test-{uuid.uuid4().hex[:16]}"
        self.client.create_bucket(Bucket=name)
        return name

    def list_keys(self, bucket: str, prefix: str = "") -> list[str]:
        """Every key under ``prefix`` in ``bucket``, read straight from the server (not via a proxy)."""
        keys: list[str] = []
        for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
            keys.extend(obj["Key"] for obj in page.get("Contents", []))
        return keys

    def reset(self) -> None:
        """Drop every bucket and object (moto's ``/moto-api/reset``)."""
        conn = http.client.HTTPConnection(self.host, self.port, timeout=10)
        try:
            conn.request("POST", "/moto-api/reset")
            conn.getresponse().read()
        finally:
            conn.close()

    def close(self) -> None:
        if self._boto is not None:
            self._boto.close()
            self._boto = None
        self._stop_proc()
        if self._logfile is not None:
            self._logfile.close()
            with contextlib.suppress(OSError):
                os.unlink(self._logfile.name)
            self._logfile = None

    def __enter__(self) -> S3Server:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# Hop-by-hop headers (RFC 9110 7.6.1) are the proxy's own business on each side; everything else,
# Host and the SigV4 Authorization included, goes upstream exactly as the client sent it.
_HOP_BY_HOP = frozenset(
    ["connection", "keep-alive", "proxy-connection", "proxy-authorization", "te", "trailer",
     "transfer-encoding", "upgrade", "expect"]
)


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive; Expect: 100-continue is answered by the base class
    disable_nagle_algorithm = True  # else Nagle + delayed ACK add ~45 ms to every sequential request
    server: _ProxyHTTPServer
    timeout = 120  # an idle keep-alive connection is dropped after this

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def _read_body(self) -> tuple[bytes, bool]:
        """The request body, de-chunked if it came ``Transfer-Encoding: chunked``; and whether it did."""
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            parts = []
            while True:
                size = int(self.rfile.readline().split(b";", 1)[0].strip(), 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):  # trailers: dropped
                        pass
                    return b"".join(parts), True
                parts.append(self.rfile.read(size))
                self.rfile.readline()
        length = int(self.headers.get("Content-Length") or 0)
        return (self.rfile.read(length) if length else b""), False

    def _handle(self) -> None:
        proxy = self.server.proxy
        body, chunked = self._read_body()  # always consumed, so the connection stays usable
        split = urlsplit(self.path)
        # origin-form as sent; an absolute-form target (a client told to use this as a forward proxy) is
        # reduced to its path and query
        self._target = self.path if self.path.startswith("/") else urlunsplit(("", "", split.path or "/",
                                                                               split.query, ""))
        error, drop, delay = proxy._record_and_decide(self.command, split.path, split.query, self.headers)
        try:
            if delay > 0:
                time.sleep(delay)
            if drop == "before":  # the request never reaches the store, and no answer comes
                self._hang_up()
                return
            if drop == "stall":  # the connection stays open and silent, then closes: a hung server
                proxy._closing.wait(proxy.stall_s)
                self._hang_up()
                return
            if error is not None:
                self._send_s3_error(error, split.path)
                return
            try:
                status, reason, headers, payload = self._forward(body, chunked)
            except OSError as e:
                msg = f"proxy: upstream failed: {e!r}".encode()
                self.send_response(502, "Bad Gateway")
                self.send_header("Content-Length", str(len(msg)))
                self.end_headers()
                self.wfile.write(msg)
                return
            if drop == "after":  # the store did what was asked; its answer is lost
                self._hang_up()
                return
            # HEAD, 204 and 304 carry no body: their Content-Length (if any) is upstream's, passed on as is
            bodyless = self.command == "HEAD" or status in (204, 304) or status < 200
            self.send_response_only(status, reason)
            for k, v in headers:
                if k.lower() not in _HOP_BY_HOP and (k.lower() != "content-length" or bodyless):
                    self.send_header(k, v)
            if not bodyless:
                self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            if drop == "half":  # the status line and headers, then half the body (none if it has none), then EOF
                if not bodyless and payload:
                    self.wfile.write(payload[: len(payload) // 2])
                self._hang_up()
                return
            if not bodyless and payload:
                self.wfile.write(payload)
        finally:
            proxy._done()

    def _hang_up(self) -> None:
        """Close the client's connection at once (FIN, after whatever was already written), without answering
        (further): what a crashed server, a load balancer timing out or a reset network path looks like."""
        self.close_connection = True
        with contextlib.suppress(OSError):
            self.wfile.flush()
            self.connection.shutdown(socket.SHUT_RDWR)

    do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = do_PATCH = do_OPTIONS = _handle

    def _upstream(self, fresh: bool = False) -> http.client.HTTPConnection:
        conn = getattr(self, "_conn", None)
        if conn is None or fresh:
            if conn is not None:
                conn.close()
            host, port = self.server.proxy._upstream_addr
            conn = self._conn = http.client.HTTPConnection(host, port, timeout=120)
        return conn

    def _forward(self, body: bytes, chunked: bool) -> tuple[int, str, list[tuple[str, str]], bytes]:
        for attempt in range(2):
            # A kept-alive upstream connection may have been closed by the server in the meantime: then
            # (and only for a connection that had already been used) retry once on a fresh one.
            reused = getattr(self, "_conn", None) is not None and attempt == 0
            conn = self._upstream(fresh=attempt > 0)
            try:
                conn.putrequest(self.command, self._target, skip_host=True, skip_accept_encoding=True)
                for k, v in self.headers.items():
                    if k.lower() not in _HOP_BY_HOP and not (chunked and k.lower() == "content-length"):
                        conn.putheader(k, v)
                if chunked:
                    conn.putheader("Transfer-Encoding", "chunked")
                    conn.endheaders()
                    if body:
                        conn.send(b"%x\r\n%s\r\n" % (len(body), body))
                    conn.send(b"0\r\n\r\n")
                else:
                    if body and "Content-Length" not in self.headers:
                        conn.putheader("Content-Length", str(len(body)))
                    conn.endheaders(body or None)
                resp = conn.getresponse()
                payload = resp.read()
                if resp.will_close:
                    conn.close()
                    self._conn = None
                return resp.status, resp.reason, resp.getheaders(), payload
            except (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError):
                self._conn = None
                conn.close()
                if not reused:
                    raise
        raise AssertionError("unreachable")

    def _send_s3_error(self, code: str, path: str) -> None:
        status, message = S3_ERRORS[code]
        request_id = uuid.uuid4().hex[:16].upper()
        body = (
            '<?xml version="1.0" encoding="UTF-8"?>\n'
            f"<Error><Code>{code}</Code><Message>{message}</Message><Resource>{path}</Resource>"
            f"<RequestId>{request_id}</RequestId><HostId>faultproxy</HostId></Error>"
        ).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/xml")
        self.send_header("x-amz-request-id", request_id)
        self.send_header("x-amz-id-2", "faultproxy")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def finish(self) -> None:
        with contextlib.suppress(OSError):
            super().finish()
        conn = getattr(self, "_conn", None)
        if conn is not None:
            conn.close()


class _ProxyHTTPServer(socketserver.ThreadingMixIn, http.server.HTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 128

    def __init__(self, addr: tuple[str, int], proxy: FaultProxy):
        self.proxy = proxy
        self._open: set[socket.socket] = set()
        self._open_lock = threading.Lock()
        super().__init__(addr, _Handler)

    def process_request(self, request: Any, client_address: Any) -> None:
        with self._open_lock:
            self._open.add(request)
        super().process_request(request, client_address)

    def shutdown_request(self, request: Any) -> None:
        with self._open_lock:
            self._open.discard(request)
        super().shutdown_request(request)

    def handle_error(self, request: Any, client_address: Any) -> None:
        if not isinstance(sys.exc_info()[1], OSError):  # a client that hung up is no news
            super().handle_error(request, client_address)

    def drop_connections(self) -> None:
        with self._open_lock:
            socks = list(self._open)
        for s in socks:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)


LogEntry = tuple[str, str, str, "str | None"]


class FaultProxy:
    """A threaded HTTP/1.1 proxy on 127.0.0.1 in front of ``upstream`` (an ``http://host:port`` URL).

    Every request is forwarded unchanged (method, path, query, headers including ``Host`` and the SigV4
    signature, body; a chunked body is forwarded chunked, ``Expect: 100-continue`` is answered here) and
    the upstream response is returned. Meanwhile:

    - ``counts`` (a ``Counter`` by HTTP method) and ``log`` (``(method, path, query, range_header)``
      in arrival order) record every request that arrived, failed-on-purpose ones included, and
      ``request_headers`` holds each one's headers (a dict, parallel to ``log``);
      ``injected`` counts, by method, the requests answered with an injected error. ``reset()`` clears
      them all.
    - ``fail_put_fraction`` / ``fail_get_fraction`` / ``fail_head_fraction`` / ``fail_delete_fraction``
      / ``fail_post_fraction`` / ``fail_list_fraction``: that share of the requests (drawn from
      ``random.Random(seed)``) is answered with ``transient_error`` (503 ``SlowDown``) and not forwarded.
      ``fail_get_fraction`` applies to object GETs, ``fail_list_fraction`` to ListObjects GETs (a GET on
      the bucket itself).
    - ``fail_next``: a ``Counter`` by method; ``fail_next["PUT"] = 2`` answers the next two PUTs with
      ``transient_error``, deterministically (checked before every other setting).
    - ``fail_puts_always``: every PUT is answered with ``permanent_error`` and not forwarded. That is 503
      ``SlowDown`` by default: the error a real store gives under pressure, which every client treats as
      retriable, but only a bounded number of times (TensorStore: 1 + ``s3_request_retries.max_retries``
      tries; botocore: 5 tries by default, times s3fs's own ``S3FileSystem.retries`` = 5 for SlowDown), so
      a write fails once those are used up (quickly, if the retry settings are small); set
      ``permanent_error = "AccessDenied"`` (403) for an error that no client retries at all.
    - ``latency_s``: a delay added before every answer (forwarded or injected), and ``in_flight`` /
      ``max_in_flight``: requests being handled now / at most at once since the last ``reset()``, to
      see a client's concurrency limit at work. ``slow_fraction`` / ``slow_s``: that share of the
      requests (any method) waits ``slow_s`` more before it is answered (a slow answer, not a failure).
    - Dropped connections: ``drop_fraction`` maps a kind of request (``"PUT"``, ``"GET"`` for object GETs,
      ``"LIST"`` for ListObjects GETs, ``"HEAD"``, ``"DELETE"``, ``"POST"``) to the share of them whose
      connection the proxy closes instead of answering normally; ``drop_next`` (a ``Counter`` by kind)
      drops the next so many deterministically, and ``drop_when(method, path, query) -> bool`` (``None``
      by default) drops every request it accepts. How is ``drop_mode``: ``"before"`` closes the connection
      without forwarding the request (it never took effect; no answer at all), ``"after"`` forwards it
      and then closes without answering (it took effect, but the client cannot know), ``"half"``
      forwards it and sends the status line, the headers (with the full ``Content-Length``) and half of
      the body, then closes (a truncated answer; an answer without a body, e.g. to a PUT, then goes out
      whole before the close, so it is no fault), ``"stall"`` neither forwards nor answers and keeps the
      connection open and silent for ``stall_s`` seconds (or until ``close()``) before closing it (a hung
      server: only a client-side timeout gets past it). ``dropped`` counts the dropped requests by method,
      ``slowed`` the slow ones. Dropping is checked before the injected errors: a dropped request is never
      answered with one.
    """

    def __init__(self, upstream: str, *, seed: int = 0, fail_put_fraction: float = 0.0,
                 fail_get_fraction: float = 0.0, fail_puts_always: bool = False):
        u = urlsplit(upstream)
        if u.scheme != "http" or not u.hostname:
            raise ValueError(f"FaultProxy needs an http://host:port upstream, not {upstream!r}")
        self.upstream = upstream
        self._upstream_addr = (u.hostname, u.port or 80)
        self.fail_put_fraction = fail_put_fraction
        self.fail_get_fraction = fail_get_fraction
        self.fail_head_fraction = 0.0
        self.fail_delete_fraction = 0.0
        self.fail_post_fraction = 0.0
        self.fail_list_fraction = 0.0
        self.fail_puts_always = fail_puts_always
        self.fail_next: collections.Counter[str] = collections.Counter()
        self.transient_error = "SlowDown"
        self.permanent_error = "SlowDown"
        self._lock = threading.Lock()
        self._rng = random.Random(seed)
        self.counts: collections.Counter[str] = collections.Counter()
        self.injected: collections.Counter[str] = collections.Counter()
        self.log: list[LogEntry] = []
        self.request_headers: list[dict[str, str]] = []
        self.latency_s = 0.0
        self.slow_fraction = 0.0
        self.slow_s = 0.0
        self.drop_fraction: dict[str, float] = {}
        self.drop_next: collections.Counter[str] = collections.Counter()
        self.drop_when: Callable[[str, str, str], bool] | None = None
        self.drop_mode = "before"
        self.stall_s = 30.0
        self.dropped: collections.Counter[str] = collections.Counter()
        self.slowed: collections.Counter[str] = collections.Counter()
        self._closing = threading.Event()
        self.in_flight = 0
        self.max_in_flight = 0
        self._server = _ProxyHTTPServer(("127.0.0.1", 0), self)
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.05},
                                        name=f"FaultProxy:{self.port}", daemon=True)
        self._thread.start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def reset(self) -> None:
        """Clear ``counts``, ``log``, ``request_headers``, ``injected``, ``dropped`` and ``slowed`` (the failure
        settings stay)."""
        with self._lock:
            self.counts.clear()
            self.injected.clear()
            self.dropped.clear()
            self.slowed.clear()
            self.log.clear()
            self.request_headers.clear()
            self.max_in_flight = self.in_flight

    def clear_faults(self) -> None:
        """Turn every injected failure off."""
        self.fail_put_fraction = self.fail_get_fraction = self.fail_head_fraction = 0.0
        self.fail_delete_fraction = self.fail_post_fraction = self.fail_list_fraction = 0.0
        self.fail_puts_always = False
        self.fail_next.clear()
        self.drop_fraction = {}
        self.drop_next.clear()
        self.drop_when = None
        self.slow_fraction = 0.0

    @staticmethod
    def is_list(method: str, path: str, query: str) -> bool:
        """Whether a request is a ListObjects(V2) call: a GET on the bucket itself (path-style URLs)."""
        segments = [s for s in path.split("/") if s]
        return method == "GET" and len(segments) == 1 and (not query or any(
            p in query for p in ("list-type=", "prefix=", "delimiter=", "marker=", "continuation-token=")))

    def count(self, method: str | None = None, *, path_contains: str = "", lists: bool | None = None) -> int:
        """Requests logged so far with that method (any if None) whose path contains ``path_contains``;
        ``lists=True``/``False`` keeps only/drops ListObjects GETs."""
        with self._lock:
            entries = list(self.log)
        return sum(
            1 for m, p, q, _ in entries
            if (method is None or m == method) and path_contains in p
            and (lists is None or self.is_list(m, p, q) == lists)
        )

    def _record_and_decide(self, method: str, path: str, query: str,
                           headers: Any) -> tuple[str | None, str | None, float]:
        """Log the request; return the S3 error code to answer it with (None: forward it), how to drop its
        connection (None: don't) and how long to wait before answering."""
        with self._lock:
            self.counts[method] += 1
            self.log.append((method, path, query, headers.get("Range")))
            self.request_headers.append(dict(headers.items()))
            delay = self.latency_s
            if self.slow_fraction > 0 and self._rng.random() < self.slow_fraction:
                delay += self.slow_s
                self.slowed[method] += 1
            kind = "LIST" if self.is_list(method, path, query) else method
            drop = self.drop_next.get(kind, 0) > 0
            if drop:
                self.drop_next[kind] -= 1
            elif self.drop_when is not None and self.drop_when(method, path, query):
                drop = True
            else:
                fraction = self.drop_fraction.get(kind, 0.0)
                drop = fraction > 0 and self._rng.random() < fraction
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
            if drop:
                self.dropped[method] += 1
                return None, self.drop_mode, delay
            if self.fail_next.get(method, 0) > 0:
                self.fail_next[method] -= 1
                error: str | None = self.transient_error
            elif method == "PUT" and self.fail_puts_always:
                error = self.permanent_error
            else:
                if method == "GET" and self.is_list(method, path, query):
                    fraction = self.fail_list_fraction
                else:
                    fraction = {"PUT": self.fail_put_fraction, "GET": self.fail_get_fraction,
                                "HEAD": self.fail_head_fraction, "DELETE": self.fail_delete_fraction,
                                "POST": self.fail_post_fraction}.get(method, 0.0)
                error = self.transient_error if fraction > 0 and self._rng.random() < fraction else None
            if error is not None:
                self.injected[method] += 1
            return error, None, delay

    def _done(self) -> None:
        with self._lock:
            self.in_flight -= 1

    def close(self) -> None:
        self._closing.set()  # stalled requests end now
        self._server.shutdown()
        self._server.server_close()
        self._server.drop_connections()
        self._thread.join(timeout=5)

    def __enter__(self) -> FaultProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@pytest.fixture(scope="session")
def s3_server() -> Iterator[S3Server]:
    """One moto S3 server (a subprocess) for the session; ``s3_test_env()`` is in ``os.environ`` meanwhile."""
    with patched_environ(s3_test_env()), S3Server() as server:
        yield server


@pytest.fixture
def s3_proxy(s3_server: S3Server) -> Iterator[FaultProxy]:
    """A fresh ``FaultProxy`` (no faults, empty counts) in front of the session's ``s3_server``."""
    with FaultProxy(s3_server.endpoint) as proxy:
        yield proxy


@pytest.fixture
def s3_bucket(s3_server: S3Server) -> str:
    """The name of a fresh, empty bucket on ``s3_server`` (``test-<16 hex digits>``)."""
    return s3_server.create_bucket()
