"""Google Cloud Storage through google-cloud-storage, OLMo-core's client for GCS (application default
credentials; ``STORAGE_EMULATOR_HOST`` for an emulator). Imported on first use."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from pmakit.errors import PmakitError
from pmakit.storage.base import PART_BYTES, SHA256_KEY, Listed, Location, Store, T, check_listing, retried


class GCSStore(Store):
    """Google Cloud Storage through google-cloud-storage (application default credentials;
    ``STORAGE_EMULATOR_HOST`` for an emulator)."""

    def __init__(self) -> None:
        super().__init__()
        try:
            from google.cloud import storage
        except ImportError:
            raise PmakitError(
                "gs:// needs google-cloud-storage: pip install -e '.[s3]' in pmakit's checkout"
            ) from None
        try:
            self._client = storage.Client()
        except Exception as e:  # no default credentials or project
            raise PmakitError(f"gs: cannot create a client ({type(e).__name__}: {e})") from None

    def _call(self, fn: Callable[[], T], where: Location, what: str) -> T:
        from google.api_core import exceptions as gexc

        transient = (
            gexc.ServiceUnavailable,
            gexc.InternalServerError,
            gexc.TooManyRequests,
            ConnectionError,
            OSError,
        )
        try:
            return retried(fn, f"{where.url}: {what}", transient)
        except gexc.PreconditionFailed:
            raise PmakitError(
                f"{where.url}: {what} failed (changed in the store since pmakit listed it: its generation no "
                "longer matches; merge again)"
            ) from None
        except gexc.NotFound:
            raise PmakitError(f"{where.url}: {what} failed (no such bucket or object)") from None
        except (gexc.Forbidden, gexc.Unauthorized) as e:
            raise PmakitError(f"{where.url}: {what} failed (access denied: {e.message})") from None
        except gexc.GoogleAPIError as e:
            raise PmakitError(f"{where.url}: {what} failed ({e})") from None

    def _blob(self, where: Location) -> Any:
        return self._client.bucket(where.bucket).blob(where.key)

    def listing(self, where: Location) -> list[Listed]:
        prefix = f"{where.key}/" if where.key else ""

        def blobs() -> list[Listed]:
            out: list[Listed] = []
            for n, page in enumerate(self._client.list_blobs(where.bucket, prefix=prefix).pages, 1):
                self.count()
                out += [
                    Listed(b.name, int(b.size), str(b.generation) if b.generation else None) for b in page
                ]
                check_listing(where, n, len(out))
            return out

        return self._call(blobs, where, "listing")

    def read(self, where: Location, start: int, stop: int, pin: str | None = None) -> bytes:
        condition = {"if_generation_match": int(pin)} if pin else {}

        def get() -> bytes:
            self.count()
            data: bytes = self._blob(where).download_as_bytes(
                start=start, end=stop - 1, checksum=None, **condition
            )
            if len(data) != stop - start:
                raise ConnectionError(f"got {len(data)} of {stop - start} bytes")
            return data

        return self._call(get, where, f"reading bytes {start}-{stop}")

    def download(self, where: Location, path: Path) -> None:
        self.count()
        self._call(lambda: self._blob(where).download_to_filename(str(path)), where, "download")

    def upload(self, path: Path, where: Location, sha256: str) -> None:
        def put() -> None:
            self.count(max(1, -(-path.stat().st_size // PART_BYTES)))
            blob = self._blob(where)
            blob.chunk_size = PART_BYTES  # a resumable upload in parts
            blob.metadata = {SHA256_KEY: sha256}
            blob.upload_from_filename(str(path))

        self._call(put, where, "upload")

    def sha256(self, where: Location) -> str | None:
        self.count()
        blob = self._call(lambda: self._client.bucket(where.bucket).get_blob(where.key), where, "stat")
        return None if blob is None else str((blob.metadata or {}).get(SHA256_KEY, ""))

    def delete(self, where: Location) -> None:
        from google.api_core.exceptions import NotFound

        try:
            self._call(lambda: self._blob(where).delete(), where, "delete")
        except PmakitError:
            if self.sha256(where) is not None:
                raise
        except NotFound:
            pass

    def check_bucket(self, where: Location) -> None:
        self.count()
        self._call(
            lambda: self._client.get_bucket(where.bucket), Location(where.scheme, where.bucket, ""), "bucket"
        )
