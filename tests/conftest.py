"""Shared fixtures: storage protocol servers (one per session) and a fresh bucket per test.

Every store is pointed at a server on 127.0.0.1 through the variables its SDK reads
(AWS_ENDPOINT_URL, STORAGE_EMULATOR_HOST, AZURE_STORAGE_CONNECTION_STRING), with fake
credentials, so nothing can reach a real cloud or an instance metadata service.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.servers import (
    ServerProcess,
    azurite_available,
    azurite_connection_string,
    start_azurite,
    start_gcs_emulator,
    start_moto,
)

CLOUD_STORE_KINDS = ("s3", "gcs", "azure")
STORE_KINDS = ("local", *CLOUD_STORE_KINDS)
SCHEMES = {"s3": "s3", "gcs": "gs", "azure": "az"}
AZURITE_MISSING = "azurite not installed: run .ci/install-storage-servers (needs npm)"


def start_server(kind: str) -> ServerProcess:
    """A fresh server of a store kind (tests that kill one start their own)."""
    if kind == "azure" and not azurite_available():
        pytest.skip(AZURITE_MISSING)
    return {"s3": start_moto, "gcs": start_gcs_emulator, "azure": start_azurite}[kind]()


@pytest.fixture(scope="session")
def storage_servers() -> Iterator[dict[str, ServerProcess]]:
    """Servers started on first use and stopped at the end of the session."""
    servers: dict[str, ServerProcess] = {}
    yield servers
    for server in servers.values():
        server.stop()


class Backend:
    """One store kind against one server, with its own empty bucket or directory."""

    def __init__(self, kind: str, server: ServerProcess | None, monkeypatch: pytest.MonkeyPatch, tmp: Path) -> None:
        self.kind = kind
        self.server = server
        self.monkeypatch = monkeypatch
        self.tmp = tmp
        self.bucket = f"t-{uuid.uuid4().hex[:12]}"
        if kind != "local":
            self.point_at(server.url)
            self._create_bucket()

    def point_at(self, endpoint: str) -> None:
        """Make the SDK of this kind talk to `endpoint`, with fake credentials."""
        env = self.monkeypatch.setenv
        if self.kind == "s3":
            for name, value in {
                "AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                "AWS_DEFAULT_REGION": "us-east-1", "AWS_EC2_METADATA_DISABLED": "true",
                "AWS_CONFIG_FILE": str(self.tmp / "no-aws-config"),
                "AWS_SHARED_CREDENTIALS_FILE": str(self.tmp / "no-aws-credentials"),
            }.items():  # fmt: skip
                env(name, value)
            self.monkeypatch.delenv("AWS_PROFILE", raising=False)
        elif self.kind == "gcs":
            env("STORAGE_EMULATOR_HOST", endpoint)
            env("GOOGLE_CLOUD_PROJECT", "spotguard-test")
        elif self.kind == "azure":
            env("AZURE_STORAGE_CONNECTION_STRING", azurite_connection_string(endpoint))

    def _create_bucket(self) -> None:
        if self.kind == "s3":
            import boto3

            boto3.client("s3").create_bucket(Bucket=self.bucket)
        elif self.kind == "gcs":
            from google.auth.credentials import AnonymousCredentials
            from google.cloud import storage

            storage.Client(project="spotguard-test", credentials=AnonymousCredentials()).create_bucket(self.bucket)
        else:
            from azure.storage.blob import BlobServiceClient

            conn = os.environ["AZURE_STORAGE_CONNECTION_STRING"]
            BlobServiceClient.from_connection_string(conn).create_container(self.bucket)

    @property
    def url(self) -> str:
        if self.kind == "local":
            return str(self.tmp / "store")
        return f"{SCHEMES[self.kind]}://{self.bucket}/run-7"

    def store(self, *, endpoint: str | None = None, **tuning):
        """A store of this kind on the bucket, talking to `endpoint` (default: the server)."""
        if self.kind == "local":
            from cloud_adapters.storage import LocalStore

            return LocalStore(self.url)
        self.point_at(endpoint or self.server.url)
        if self.kind == "s3":
            from cloud_adapters.aws.s3 import S3Store as cls
        elif self.kind == "gcs":
            from cloud_adapters.gcp.gcs import GCSStore as cls
        else:
            from cloud_adapters.azure.blob import BlobStore as cls
        return cls(self.url, **tuning)


def backend_for(kind: str, storage_servers: dict, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Backend:
    if kind != "local" and kind not in storage_servers:
        storage_servers[kind] = start_server(kind)
    return Backend(kind, storage_servers.get(kind), monkeypatch, tmp_path)


@pytest.fixture(params=STORE_KINDS)
def backend(request, storage_servers, monkeypatch, tmp_path) -> Backend:
    """Every store kind, each with a fresh bucket on the session's server."""
    return backend_for(request.param, storage_servers, monkeypatch, tmp_path)


@pytest.fixture(params=CLOUD_STORE_KINDS)
def cloud_backend(request, storage_servers, monkeypatch, tmp_path) -> Backend:
    """The object-store kinds only (fault injection needs an HTTP server to stand in front of)."""
    return backend_for(request.param, storage_servers, monkeypatch, tmp_path)
