"""Object-storage clients: TensorStore kvstore drivers, credentials, and one context per configuration.

Everything here depends only on a location's scheme, bucket and resolved storage options (see
``parse_object_url`` in ``_storage/object.py``), never on what is stored.
"""

from __future__ import annotations

import functools
import os
import shutil
import threading
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from .._format.jsontypes import JSON
from .._settings import settings

if TYPE_CHECKING:
    import tensorstore as ts

__all__ = ["driver_spec", "object_context"]

# TensorStore's HTTP client has no timeout of its own: a server that stops answering mid-request would hang a
# save forever. A transfer slower than 1 byte/s for 60 s is abandoned (and retried like any failure) unless
# the user chose otherwise. curl reads these once per process, so this must run before the first request.
os.environ.setdefault("TENSORSTORE_CURL_LOW_SPEED_LIMIT_BYTES", "1")
os.environ.setdefault("TENSORSTORE_CURL_LOW_SPEED_TIME_SECONDS", "60")



def driver_spec(scheme: str, bucket: str, options: Mapping[str, Any],
                environ: Mapping[str, str] = os.environ) -> JSON:
    """The TensorStore kvstore spec of a bucket, without its path (``memory``: the process's in-memory store);
    ``environ``: the environment variables that say where credentials come from."""
    if scheme == "memory":
        return {"driver": "memory"}
    if scheme == "gs":
        return {"driver": "gcs", "bucket": bucket}
    spec: JSON = {"driver": "s3", "bucket": bucket}
    if options.get("endpoint_url"):
        spec["endpoint"] = options["endpoint_url"]
    if options.get("region"):
        spec["aws_region"] = options["region"]
    credentials = _aws_credentials(options, environ)
    if credentials is not None:
        spec["aws_credentials"] = credentials
    return spec


def _aws_credentials(options: Mapping[str, Any], environ: Mapping[str, str]) -> dict[str, Any] | None:
    """TensorStore's ``aws_credentials`` for the given options (``None``: its default chain, which reads the
    standard AWS environment variables and files). TensorStore takes no literal keys, so explicit ``key`` and
    ``secret`` go through a private credentials file of this process.

    Keys in the environment (``AWS_ACCESS_KEY_ID`` and ``AWS_SECRET_ACCESS_KEY``, no ``AWS_PROFILE``) are what the
    default chain would use first, as botocore does; naming the ``environment`` provider says so directly. The
    default chain would also look for ``~/.aws/config`` and ``~/.aws/credentials`` and log an error line to stderr
    for each that is missing, on every run; with the keys in the environment those files are never wanted."""
    if options.get("anon"):
        return {"type": "anonymous"}
    if options.get("key") or options.get("secret"):
        if not (options.get("key") and options.get("secret")):
            raise ValueError("storage options 'key' and 'secret' go together; give both or neither")
        config, credentials = _credentials_files(options["key"], options["secret"], options.get("token"))
        return {"type": "profile", "profile": "arrayckpt", "credentials_file": credentials, "config_file": config}
    if options.get("profile"):
        return {"type": "profile", "profile": options["profile"]}
    if environ.get("AWS_ACCESS_KEY_ID") and environ.get("AWS_SECRET_ACCESS_KEY") and not environ.get("AWS_PROFILE"):
        return {"type": "environment"}  # (TensorStore's environment provider reads AWS_SESSION_TOKEN too)
    return None


@functools.cache
def _credentials_files(key: str, secret: str, token: str | None) -> tuple[str, str]:
    """An AWS config and credentials file (mode 0600, removed at exit) holding one profile with these keys."""
    import atexit
    import tempfile

    directory = tempfile.mkdtemp(prefix="arrayckpt-aws-")
    atexit.register(shutil.rmtree, directory, True)
    config, credentials = os.path.join(directory, "config"), os.path.join(directory, "credentials")
    lines = ["[arrayckpt]", f"aws_access_key_id = {key}", f"aws_secret_access_key = {secret}"]
    if token:
        lines.append(f"aws_session_token = {token}")
    for path, text in ((config, "[profile arrayckpt]\n"), (credentials, "\n".join(lines) + "\n")):
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as file:
            file.write(text)
    return config, credentials


_CONTEXTS: dict[Any, ts.Context] = {}
_CONTEXTS_LOCK = threading.Lock()


def object_context(scheme: str, options_key: tuple[tuple[str, Any], ...]) -> ts.Context:
    """One TensorStore context per storage configuration and process (``scheme`` and the resolved, sorted storage
    options): request concurrency and retries for S3/GCS; for ``memory://`` the process-wide store every save and
    read must share."""
    key = (scheme, options_key)
    with _CONTEXTS_LOCK:
        context = _CONTEXTS.get(key)
        if context is None:
            options = dict(options_key)
            retries = {"max_retries": int(options.get("max_retries", settings().object_retries)),
                       "initial_delay": "50ms", "max_delay": "5s"}
            limit = {"limit": int(options.get("request_concurrency", settings().object_concurrency))}
            spec: JSON = {}
            if scheme == "s3":
                spec = {"s3_request_retries": retries, "s3_request_concurrency": limit}
            elif scheme == "gs":
                spec = {"gcs_request_retries": retries, "gcs_request_concurrency": limit}
            import tensorstore as ts  # on first use (CLI start-up)
            context = _CONTEXTS[key] = ts.Context(spec)
        return context
