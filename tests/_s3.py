"""The tests' S3-API server on loopback: moto's WSGI application served by werkzeug on a free port, behind a
layer that counts each object's GET requests and their response bytes, and injects faults."""

from __future__ import annotations

import pathlib
import threading
import uuid
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

_INTERNAL_ERROR = (b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>InternalError</Code>'
                   b"<Message>We encountered an internal error. Please try again.</Message>"
                   b"<RequestId>injected</RequestId></Error>")


class S3Server:
    """An S3-API server (moto's) on a free loopback port with one bucket of its own.

    Each object's GET requests and the bytes of their responses are counted (:meth:`gets`,
    :meth:`get_bytes`), and the next GET requests of an object can be answered 500 (InternalError) while a
    fault is armed for it (:meth:`fail`).

    Attributes:
        endpoint: The server's URL.
        bucket: The bucket's name.
        options: s3fs's options reaching this server; the client does not retry (croupier's `Retry` does).
        fs: An s3fs file system on this server.
        failed: GET requests answered with an injected error, by URL.
    """

    def __init__(self) -> None:
        import boto3
        import fsspec
        from moto.server import DomainDispatcherApplication, MotoRequestHandler, create_backend_app
        from werkzeug.serving import make_server

        class Quiet(MotoRequestHandler):
            def log_request(self, *args: Any, **kwargs: Any) -> None:
                pass

        self._app = DomainDispatcherApplication(create_backend_app)
        self._lock = threading.Lock()
        self._gets: dict[str, int] = {}
        self._bytes: dict[str, int] = {}
        self._faults: dict[str, int] = {}
        self.failed: dict[str, int] = {}
        self._server = make_server("127.0.0.1", 0, self._wsgi, threaded=True, request_handler=Quiet)
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()
        host, port = self._server.server_address[:2]
        self.endpoint = f"http://{host}:{port}"
        self.bucket = f"shards-{uuid.uuid4().hex[:12]}"
        self.options: dict[str, Any] = {
            "key": "testing", "secret": "testing",
            "client_kwargs": {"endpoint_url": self.endpoint, "region_name": "us-east-1"},
            "config_kwargs": {"retries": {"total_max_attempts": 1}}}
        boto3.client("s3", endpoint_url=self.endpoint, aws_access_key_id="testing", aws_secret_access_key="testing",
                     region_name="us-east-1").create_bucket(Bucket=self.bucket)
        self.fs = fsspec.filesystem("s3", **self.options, skip_instance_cache=True)

    def _wsgi(self, environ: dict[str, Any], start_response: Any) -> Any:
        url = "s3:/" + environ.get("PATH_INFO", "")
        if environ["REQUEST_METHOD"] != "GET":
            return self._app(environ, start_response)
        with self._lock:
            self._gets[url] = self._gets.get(url, 0) + 1
            fault = self._faults.get(url, 0) > 0
            if fault:
                self._faults[url] -= 1
                self.failed[url] = self.failed.get(url, 0) + 1
        if fault:
            start_response("500 Internal Server Error", [("Content-Type", "application/xml"),
                                                         ("Content-Length", str(len(_INTERNAL_ERROR)))])
            return [_INTERNAL_ERROR]
        return self._counted(url, self._app(environ, start_response))

    def _counted(self, url: str, body: Iterable[bytes]) -> Iterator[bytes]:
        try:
            for chunk in body:
                with self._lock:
                    self._bytes[url] = self._bytes.get(url, 0) + len(chunk)
                yield chunk
        finally:
            close = getattr(body, "close", None)
            if close is not None:
                close()

    def put(self, files: Sequence[pathlib.Path], prefix: str) -> list[str]:
        """Uploads `files` under `prefix` of the bucket; their URLs."""
        urls = []
        for f in files:
            self.fs.put_file(str(f), f"{self.bucket}/{prefix}/{f.name}")
            urls.append(f"s3://{self.bucket}/{prefix}/{f.name}")
        return urls

    def url(self, prefix: str) -> str:
        """The URL of the folder `prefix` of the bucket."""
        return f"s3://{self.bucket}/{prefix}/"

    def remove(self, url: str) -> None:
        """Deletes the object at `url`."""
        self.fs.rm(url.removeprefix("s3://"))

    def fail(self, url: str, times: int) -> None:
        """The next `times` GET requests of the object at `url` are answered 500 (InternalError)."""
        with self._lock:
            self._faults[url] = times

    def gets(self, url: str) -> int:
        """GET requests of the object at `url` so far."""
        with self._lock:
            return self._gets.get(url, 0)

    def get_bytes(self, url: str | None = None) -> int:
        """The response bytes of the GET requests of the object at `url` so far (of every object: None)."""
        with self._lock:
            return sum(self._bytes.values()) if url is None else self._bytes.get(url, 0)

    def stop(self) -> None:
        self._server.shutdown()
        self._thread.join(timeout=30)
        self._server.server_close()


def serve_s3() -> Iterator[S3Server]:
    """An S3-API server for a fixture to yield, stopped at the end."""
    server = S3Server()
    try:
        yield server
    finally:
        server.stop()
