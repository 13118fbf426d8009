"""S3 and S3-compatible stores (MinIO, R2, moto) through boto3, as OLMo-core does; not s3fs, which needs
aiobotocore, and aiobotocore pins botocore to a narrow range (1.43.x for s3fs 2026.9) that would downgrade the
boto3 OLMo-core uses. boto3 reads the standard configuration itself: the credentials chain (environment,
``~/.aws``, SSO, instance roles), ``AWS_PROFILE``, ``AWS_ENDPOINT_URL`` / ``AWS_ENDPOINT_URL_S3`` for an
S3-compatible endpoint, ``AWS_MAX_ATTEMPTS`` and ``AWS_RETRY_MODE``. Imported on first use."""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pmakit.errors import PmakitError
from pmakit.storage.base import (
    IN_FLIGHT,
    PART_BYTES,
    SHA256_KEY,
    Listed,
    Location,
    Store,
    StoreUnreachable,
    T,
    check_listing,
    get_seconds,
    read_within,
    retried,
)


class S3Store(Store):
    """S3 and S3-compatible stores through boto3 (see the module docstring for the configuration it reads)."""

    def __init__(self) -> None:
        super().__init__()
        try:
            import boto3
            from botocore.config import Config
        except ImportError:
            raise PmakitError("s3:// needs boto3: pip install -e '.[s3]' in pmakit's checkout") from None

        config = Config(
            max_pool_connections=IN_FLIGHT,
            retries={"mode": os.environ.get("AWS_RETRY_MODE", "standard")},  # max_attempts: AWS_MAX_ATTEMPTS
        )
        try:
            self._client = boto3.session.Session().client("s3", config=config)
        except Exception as e:  # a bad profile or region in the configuration
            raise PmakitError(f"s3: cannot create a client ({type(e).__name__}: {e})") from None
        from boto3.s3.transfer import TransferConfig

        self._transfer = TransferConfig(
            multipart_threshold=PART_BYTES, multipart_chunksize=PART_BYTES, max_concurrency=8
        )

    @functools.cached_property
    def _transient(self) -> tuple[type[BaseException], ...]:
        from botocore.exceptions import ConnectionError, HTTPClientError, ResponseStreamingError
        from urllib3.exceptions import HTTPError

        return (ConnectionError, HTTPClientError, ResponseStreamingError, HTTPError, OSError)

    def _call(self, fn: Callable[[], T], where: Location, what: str) -> T:
        from botocore.exceptions import BotoCoreError, ClientError, NoCredentialsError

        try:
            return retried(fn, f"{where.url}: {what}", self._transient)
        except NoCredentialsError:
            raise PmakitError(
                f"{where.url}: no AWS credentials found (AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, AWS_PROFILE or "
                "~/.aws/credentials)"
            ) from None
        except ClientError as e:
            status = e.response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0
            if status >= 500:  # still failing after botocore's own retries (503 SlowDown, 500 InternalError)
                raise StoreUnreachable(f"{where.url}: {what} failed ({_client_error(e)})") from None
            raise PmakitError(f"{where.url}: {what} failed ({_client_error(e)})") from None
        except BotoCoreError as e:
            raise PmakitError(f"{where.url}: {what} failed ({e})") from None

    def listing(self, where: Location) -> list[Listed]:
        prefix = f"{where.key}/" if where.key else ""

        def pages() -> list[Listed]:
            out: list[Listed] = []
            paginator = self._client.get_paginator("list_objects_v2")
            for n, page in enumerate(paginator.paginate(Bucket=where.bucket, Prefix=prefix), 1):
                self.count()
                out += [
                    Listed(str(o["Key"]), int(o["Size"]), o.get("ETag") or None)
                    for o in page.get("Contents", [])
                ]
                check_listing(where, n, len(out))
            return out

        return self._call(pages, where, "listing")

    def read(self, where: Location, start: int, stop: int, pin: str | None = None) -> bytes:
        seconds = get_seconds()
        condition = {"IfMatch": pin} if pin else {}

        def get() -> bytes:
            self.count()
            response = self._client.get_object(
                Bucket=where.bucket, Key=where.key, Range=f"bytes={start}-{stop - 1}", **condition
            )
            data = read_within(response["Body"], seconds)
            if len(data) != stop - start:
                raise ConnectionError(f"got {len(data)} of {stop - start} bytes")
            return data

        return self._call(get, where, f"reading bytes {start}-{stop}")

    def download(self, where: Location, path: Path) -> None:
        def get() -> None:
            self.count()
            self._client.download_file(where.bucket, where.key, str(path))

        self._call(get, where, "download")

    def upload(self, path: Path, where: Location, sha256: str) -> None:
        def put() -> None:
            self.count(max(1, -(-path.stat().st_size // PART_BYTES)))
            self._client.upload_file(
                str(path),
                where.bucket,
                where.key,
                ExtraArgs={"Metadata": {SHA256_KEY: sha256}},
                Config=self._transfer,
            )

        self._call(put, where, "upload")

    def sha256(self, where: Location) -> str | None:
        from botocore.exceptions import ClientError

        try:
            self.count()
            head = self._client.head_object(Bucket=where.bucket, Key=where.key)
        except ClientError as e:
            if e.response.get("Error", {}).get("Code") in ("404", "NoSuchKey", "NotFound"):
                return None
            raise PmakitError(f"{where.url}: {_client_error(e)}") from None
        return str(head.get("Metadata", {}).get(SHA256_KEY, ""))

    def delete(self, where: Location) -> None:
        self._call(lambda: self._client.delete_object(Bucket=where.bucket, Key=where.key), where, "delete")

    def check_bucket(self, where: Location) -> None:
        def head() -> None:
            self.count()
            self._client.head_bucket(Bucket=where.bucket)

        self._call(head, Location(where.scheme, where.bucket, ""), "checking the bucket")


def _client_error(e: Any) -> str:
    """One line for a botocore ``ClientError``: what the code means for the user."""
    error = e.response.get("Error", {})
    code = str(error.get("Code", ""))
    status = e.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
    if code in ("NoSuchBucket",) or (code == "404" and e.operation_name == "HeadBucket"):
        return "no such bucket"
    if code in ("NoSuchKey", "404"):
        return "no such object"
    if code in ("PreconditionFailed", "412"):
        return "changed in the store since pmakit listed it: its ETag no longer matches; merge again"
    if code in ("InvalidAccessKeyId", "SignatureDoesNotMatch", "AccessDenied", "403", "ExpiredToken"):
        return f"access denied: {code} (check the credentials and the bucket's policy)"
    return f"{code or status}: {error.get('Message', '')}".strip()
