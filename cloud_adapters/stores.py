"""`open_store(url)`: the store for a checkpoint location, and `check_location(url)` to refuse a bad one early.

Apart from storage.py because the bucket stores import storage.py: the factory that
imports them sits above both. Each bucket store is imported only when its scheme is
used (its SDK is an install of its own: azure is an extra).
"""

from __future__ import annotations

import importlib
import os
from pathlib import Path
from urllib.parse import urlsplit

from cloud_adapters.storage import LocalStore, ObjectStore, file_url_path, split_bucket_url

# scheme -> (module, class)
BUCKET_STORES = {
    "s3": ("cloud_adapters.aws.s3", "S3Store"),
    "gs": ("cloud_adapters.gcp.gcs", "GCSStore"),
    "az": ("cloud_adapters.azure.blob", "BlobStore"),
}


def local_path(url: str | Path) -> str | None:
    """The directory a plain path or `file://` URL names; None for a bucket (or any other) URL."""
    text = str(url)
    if "://" not in text:
        return text
    return file_url_path(text) if urlsplit(text).scheme == "file" else None


def canonical_location(url: str | Path) -> str:
    """The one spelling of the place `url` names, as its store spells it (its `url`), without opening it:
    a path absolute with its links resolved; a bucket URL without the slashes around its prefix, which
    the bucket stores drop (`s3://b//run/` is `s3://b/run`). A `//` inside the prefix stays: object
    names are literal, so `s3://b/a//run` holds other objects than `s3://b/a/run`."""
    path = local_path(url)
    if path is not None:
        return str(Path(path).expanduser().resolve())
    bucket, prefix = split_bucket_url(str(url))
    return f"{urlsplit(str(url)).scheme}://{bucket}" + (f"/{prefix}" if prefix else "")


def check_location(url: str | Path, *, argument: str = "checkpoint_dir") -> str:
    """`url` as a string when `open_store` can take it; else a one-line ValueError that starts with `argument`.

    Checks the form only (scheme, bucket, file:// path): no import of a store's SDK, no request.
    """
    if not isinstance(url, (str, os.PathLike)):
        raise ValueError(f"{argument}: expected a path or a URL, not {type(url).__name__}")
    text = str(url)
    try:
        if not text.strip():
            raise ValueError("empty location: use a path, file://, s3://, gs:// or az://")
        if local_path(text) is None:
            _bucket_store(text)
            split_bucket_url(text)
    except ValueError as exc:
        raise ValueError(f"{argument}: {exc}") from None
    return text


def open_store(url: str | Path) -> ObjectStore:
    """The store for a checkpoint location: s3://, gs://, az://, file:// or a plain path."""
    path = local_path(url)
    if path is not None:
        return LocalStore(path)
    module, name = _bucket_store(str(url))
    return getattr(importlib.import_module(module), name)(str(url))


def _bucket_store(url: str) -> tuple[str, str]:
    try:
        return BUCKET_STORES[urlsplit(url).scheme]
    except KeyError:
        raise ValueError(
            f"unsupported checkpoint location {url!r}: use a path, file://, s3://, gs:// or az://"
        ) from None
