"""A real S3 API server on localhost for the object-storage tests (moto's server mode, as s3fs's suite uses), and a
fault-injecting HTTP proxy in front of it: the tests point pmakit and the frameworks at an endpoint URL, as a user
points them at MinIO or R2."""

from __future__ import annotations

import http.client
import http.server
import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

FAKE_CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_SESSION_TOKEN": "",
    "AWS_CONFIG_FILE": os.devnull,
    "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class MotoServer:
    """``python -m moto.server`` in a subprocess on a free port; ``env`` is what a client needs to reach it."""

    def __init__(self, extra_env: dict[str, str] | None = None, cpus: set[int] | None = None) -> None:
        """``cpus``: the cores the server may run on (``os.sched_setaffinity``); all of this process's by default."""
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            env={**os.environ, **(extra_env or {})},
            preexec_fn=(lambda: os.sched_setaffinity(0, cpus)) if cpus else None,
        )
        deadline = time.monotonic() + 120  # a hang guard: the server imports in a few seconds when idle
        while True:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=1):
                    break
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("moto server did not start") from None
                time.sleep(0.2)

    def env(self, endpoint: str | None = None) -> dict[str, str]:
        return {**FAKE_CREDENTIALS, "AWS_ENDPOINT_URL": endpoint or self.url}

    def client(self) -> Any:
        import boto3

        creds = FAKE_CREDENTIALS
        return boto3.client(
            "s3",
            endpoint_url=self.url,
            aws_access_key_id=creds["AWS_ACCESS_KEY_ID"],
            aws_secret_access_key=creds["AWS_SECRET_ACCESS_KEY"],
            region_name=creds["AWS_DEFAULT_REGION"],
        )

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=30)


def upload_tree(client: Any, local: Path, bucket: str, prefix: str) -> None:
    for path in sorted(local.rglob("*")):
        if path.is_file():
            client.upload_file(str(path), bucket, f"{prefix}/{path.relative_to(local).as_posix()}")


def download_tree(client: Any, bucket: str, prefix: str, local: Path) -> list[str]:
    keys = []
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix + "/"):
        for obj in page.get("Contents", []):
            rel = obj["Key"][len(prefix) + 1 :]
            target = local / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            client.download_file(bucket, obj["Key"], str(target))
            keys.append(rel)
    return sorted(keys)


class StoreHandler(http.server.BaseHTTPRequestHandler):
    """The request handler of the test stores written here (HTTP/1.1 keep-alive, no request log). Nagle off: the
    handler writes a response's headers and its body in two writes, and each response then waited ~40 ms for the
    client's delayed ACK (44.7 ms a listing page, 0.8 ms without), where a real store answers in well under that."""

    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True

    def log_message(self, *args: Any) -> None:
        pass


class FaultProxy:
    """An HTTP proxy to ``upstream`` that can break requests: ``fault(request) -> None | "truncate" | "503" |
    "down"``. ``truncate`` sends half the response body and drops the connection (a GET broken off mid-body);
    ``503`` answers SlowDown; ``down`` closes the connection unanswered (the server is gone); ``412`` answers a
    failed precondition the way GCS does (an object rewritten since its generation was listed)."""

    def __init__(self, upstream_port: int) -> None:
        self.fault: Callable[[str, str, dict[str, str]], str | None] = lambda method, path, headers: None
        self.requests: list[tuple[str, str]] = []
        proxy = self

        class Handler(StoreHandler):
            def _forward(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else None
                headers = {k: v for k, v in self.headers.items()}
                proxy.requests.append((self.command, self.path))
                fault = proxy.fault(self.command, self.path, headers)
                if fault == "down":
                    self.close_connection = True
                    self.connection.shutdown(socket.SHUT_RDWR)
                    return
                if fault == "412":
                    payload = json.dumps(
                        {"error": {"code": 412, "message": "Precondition Failed", "errors": []}}
                    ).encode()
                    self.send_response(412)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(payload)))
                    self.end_headers()
                    self.wfile.write(payload)
                    return
                if fault == "503":
                    payload = b"<Error><Code>SlowDown</Code><Message>Please reduce your request rate.</Message></Error>"
                    self.send_response(503)
                    self.send_header("Content-Length", str(len(payload)))
                    self.end_headers()
                    self.wfile.write(payload)
                    return
                conn = http.client.HTTPConnection("127.0.0.1", upstream_port, timeout=60)
                conn.request(self.command, self.path, body=body, headers=headers)
                response = conn.getresponse()
                data = response.read()
                self.send_response(response.status)
                for k, v in response.getheaders():
                    if k.lower() not in ("transfer-encoding", "connection"):
                        self.send_header(k, v)
                self.end_headers()
                if fault == "truncate":
                    self.wfile.write(data[: len(data) // 2])
                    self.wfile.flush()
                    self.close_connection = True
                    self.connection.shutdown(socket.SHUT_RDWR)
                    return
                self.wfile.write(data)
                conn.close()

            do_GET = do_PUT = do_POST = do_HEAD = do_DELETE = _forward

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class GCSEmulator:
    """``gcp-storage-emulator`` (in memory) in a subprocess on a free port; ``env`` points google-cloud-storage at
    it (STORAGE_EMULATOR_HOST, as its own tests do)."""

    def __init__(self) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "gcp_storage_emulator",
                "start",
                *("--host", "127.0.0.1"),
                *("--port", str(self.port)),
                "--in-memory",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 120  # a hang guard
        while True:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=1):
                    break
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("GCS emulator did not start") from None
                time.sleep(0.2)

    def env(self) -> dict[str, str]:
        return {"STORAGE_EMULATOR_HOST": self.url, "GOOGLE_CLOUD_PROJECT": "test"}

    def client(self) -> Any:
        from google.auth.credentials import AnonymousCredentials
        from google.cloud import storage

        return storage.Client(
            project="test", credentials=AnonymousCredentials(), client_options={"api_endpoint": self.url}
        )

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=30)
