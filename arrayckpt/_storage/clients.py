"""Object-storage clients: storage options, TensorStore kvstore drivers, credentials, one context per configuration,
and the fsspec file systems (s3fs, gcsfs) that list with modification times.

Everything here depends only on a location's scheme, bucket and storage options (resolved by :func:`resolve_options`),
never on what is stored.

The GCS endpoint is the one setting TensorStore takes per process, not per spec: its ``gcs`` driver (0.1.x) has no
endpoint member and reads ``TENSORSTORE_GCS_HTTP_URL`` each time it opens a bucket. :func:`point_gcs_at` sets that
variable when the first ``gs://`` context is made and refuses a second, different endpoint in the same process (it
would silently send one location's requests to the other's server). Credentials likewise: TensorStore finds Google
credentials only in the environment (``GOOGLE_APPLICATION_CREDENTIALS``, gcloud's application-default login, the GCE
metadata server), once per process, so ``token`` takes only the values that agree with that.
"""

from __future__ import annotations

import functools
import os
import shutil
import threading
from collections.abc import Mapping, MutableMapping
from typing import TYPE_CHECKING, Any

from .._errors import LocationError
from .._format.jsontypes import JSON
from .._settings import settings

if TYPE_CHECKING:
    import tensorstore as ts

__all__ = ["GCS_ENDPOINT_VARIABLE", "GCS_PUBLIC_ENDPOINT", "OPTION_NAMES", "driver_spec", "fsspec_options",
           "listing_fs", "object_context", "point_gcs_at", "resolve_options"]

_S3_OPTIONS = frozenset({"endpoint_url", "region", "key", "secret", "token", "anon", "max_retries",
                         "request_concurrency", "profile"})
#: The storage_options each scheme understands: s3fs's names on S3, gcsfs's on GCS (``memory://``, TensorStore's
#: in-process store that stands in for S3 in tests, takes S3's and uses none).
OPTION_NAMES: Mapping[str, frozenset[str]] = {
    "s3": _S3_OPTIONS,
    "gs": frozenset({"endpoint_url", "token", "project", "max_retries", "request_concurrency"}),
    "memory": _S3_OPTIONS,
}

#: The environment variable TensorStore's ``gcs`` driver reads its endpoint from (when it opens a bucket).
GCS_ENDPOINT_VARIABLE = "TENSORSTORE_GCS_HTTP_URL"
GCS_PUBLIC_ENDPOINT = "https://storage.googleapis.com"
#: The emulator variable of google-cloud-storage and gcsfs (``host:port`` or a URL): the default ``endpoint_url``.
GCS_EMULATOR_VARIABLE = "STORAGE_EMULATOR_HOST"
#: gcsfs ``token`` values TensorStore agrees with: ``anon`` (an emulator, a public bucket: TensorStore sends no
#: credentials where the environment has none) and ``google_default`` (the environment's, as TensorStore does).
GCS_TOKENS = ("anon", "google_default")

# TensorStore's HTTP client has no timeout of its own: a server that stops answering mid-request would hang a
# save forever. A transfer slower than 1 byte/s for 60 s is abandoned (and retried like any failure) unless
# the user chose otherwise. curl reads these once per process, so this must run before the first request.
os.environ.setdefault("TENSORSTORE_CURL_LOW_SPEED_LIMIT_BYTES", "1")
os.environ.setdefault("TENSORSTORE_CURL_LOW_SPEED_TIME_SECONDS", "60")



def resolve_options(text: str, scheme: str, given: Mapping[str, Any] | None,
                    environ: Mapping[str, str] = os.environ) -> dict[str, Any]:
    """The storage options of ``text`` (an ``s3://``, ``gs://`` or ``memory://`` URL, for messages): ``given`` checked
    against :data:`OPTION_NAMES`, then the standard environment variables for what is not given
    (``AWS_ENDPOINT_URL_S3``/``AWS_ENDPOINT_URL``, ``AWS_REGION``/``AWS_DEFAULT_REGION``; ``STORAGE_EMULATOR_HOST``
    for GCS; credentials are left to the client's default chain), without the ``None`` ones."""
    options = dict(given or {})
    known = OPTION_NAMES[scheme]
    unknown = set(options) - known
    if unknown:
        raise LocationError(f"{text!r}: unknown storage option(s) {sorted(unknown)} for {scheme}://; known: "
                            f"{sorted(known)}")
    if scheme == "s3":
        options.setdefault("endpoint_url", environ.get("AWS_ENDPOINT_URL_S3") or environ.get("AWS_ENDPOINT_URL"))
        options.setdefault("region", environ.get("AWS_REGION") or environ.get("AWS_DEFAULT_REGION"))
    elif scheme == "gs":
        emulator = environ.get(GCS_EMULATOR_VARIABLE)
        if emulator and emulator != "default":  # (gcsfs's spelling of "none")
            options.setdefault("endpoint_url", emulator if "://" in emulator else f"http://{emulator}")
        _check_gcs_options(text, options)
    options = {k: v for k, v in options.items() if v is not None}
    if bool(options.get("key")) != bool(options.get("secret")):  # a usage error, before any request is made
        raise LocationError(f"{text!r}: storage options 'key' and 'secret' go together; give both or neither")
    return options


def _check_gcs_options(text: str, options: dict[str, Any]) -> None:
    """Refuse GCS options TensorStore could not honour (it does the IO; gcsfs only lists)."""
    endpoint = options.get("endpoint_url")
    if endpoint is not None:
        if not isinstance(endpoint, str) or not endpoint.startswith(("http://", "https://")):
            raise LocationError(f"{text!r}: storage option 'endpoint_url' must be an http:// or https:// URL (e.g. "
                                f"'http://127.0.0.1:4443' for fake-gcs-server), not {endpoint!r}")
        options["endpoint_url"] = endpoint.rstrip("/")
    token = options.get("token")
    if token is not None and token not in GCS_TOKENS:
        raise LocationError(
            f"{text!r}: storage option 'token' for gs:// takes {' or '.join(map(repr, GCS_TOKENS))}, not a "
            f"{type(token).__name__}: TensorStore, which reads and writes the data, takes Google credentials only from "
            "the environment; point GOOGLE_APPLICATION_CREDENTIALS at the key file and leave 'token' out (gcsfs reads "
            "that variable too)")


def point_gcs_at(endpoint: str | None, environ: MutableMapping[str, str] = os.environ) -> None:
    """Make TensorStore's ``gcs`` driver reach ``endpoint`` (``None``: Google's public endpoint) in this process, by
    ``TENSORSTORE_GCS_HTTP_URL``, which it reads when it opens a bucket. The first ``gs://`` configuration of a process
    sets the variable (spawned ranks inherit it); one with another endpoint is refused, since every bucket opened
    afterwards would go to the new one, the first configuration's included."""
    wanted = (endpoint or GCS_PUBLIC_ENDPOINT).rstrip("/")
    current = environ.get(GCS_ENDPOINT_VARIABLE)
    if current is None:
        environ[GCS_ENDPOINT_VARIABLE] = wanted
    elif current.rstrip("/") != wanted:
        raise LocationError(
            f"gs:// at {wanted}: this process's TensorStore already reaches GCS at {current} ({GCS_ENDPOINT_VARIABLE}; "
            "TensorStore has one GCS endpoint per process); give every gs:// location of the process the same "
            "storage option 'endpoint_url' (or set STORAGE_EMULATOR_HOST), or use the other endpoint in another "
            "process")


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
                point_gcs_at(options.get("endpoint_url"))
                spec = {"gcs_request_retries": retries, "gcs_request_concurrency": limit}
            import tensorstore as ts  # on first use (CLI start-up)
            context = _CONTEXTS[key] = ts.Context(spec)
        return context


def listing_fs(scheme: str, options: Mapping[str, Any], **more: Any) -> Any:
    """An fsspec file system for the listings TensorStore cannot make (modification times, one level at a time):
    s3fs on S3 and gcsfs on GCS where installed, else ``None``; ``more``: constructor arguments (e.g.
    ``skip_instance_cache``). On S3 the ``max_retries`` option bounds botocore's tries too (its default, 5 tries with
    back-off, took ~10 s to give up on an endpoint that refuses connections). On GCS gcsfs's plain JSON-API file system:
    the one recent gcsfs makes by default first asks each bucket's layout over gRPC, which emulators do not serve (up
    to a minute per call)."""
    if scheme == "s3":
        try:
            import s3fs
        except ImportError:
            return None
        if "max_retries" in options:
            more = {**more, "config_kwargs": {"retries": {"total_max_attempts": int(options["max_retries"]) + 1}}}
        return s3fs.S3FileSystem(**more, **fsspec_options(scheme, options))
    if scheme == "gs":
        try:
            from gcsfs.core import GCSFileSystem
        except ImportError:
            return None
        return GCSFileSystem(**more, **fsspec_options(scheme, options))
    return None


def fsspec_options(scheme: str, options: Mapping[str, Any]) -> dict[str, Any]:
    """The storage options for fsspec (s3fs, gcsfs): what zarr-python's ``storage_options`` takes."""
    names = ("endpoint_url", "token", "project") if scheme == "gs" else ("endpoint_url", "key", "secret", "token",
                                                                         "anon", "profile")
    out = {name: options[name] for name in names if options.get(name) is not None}
    if scheme != "gs" and options.get("region"):
        out["client_kwargs"] = {"region_name": options["region"]}
    return out
