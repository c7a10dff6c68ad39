"""Per-cloud dispatch: a cloud's notice sources (one per kind of notice) and its metadata emulator."""

from __future__ import annotations

from typing import TYPE_CHECKING

from cloud_adapters.notice import NoticeSource

if TYPE_CHECKING:  # the emulators need aiohttp: imported only by the code that runs one
    from cloud_adapters.emulation import MetadataEmulator

CLOUDS = ("aws", "gcp", "azure")


def cloud_sources(cloud: str, metadata_url: str | None = None) -> list[NoticeSource]:
    """Every metadata-based source of `cloud` ("none" has none: signals only)."""
    if cloud == "none":
        return []
    if cloud == "aws":
        from cloud_adapters.aws.metadata import notice_sources
    elif cloud == "gcp":
        from cloud_adapters.gcp.metadata import notice_sources
    elif cloud == "azure":
        from cloud_adapters.azure.metadata import notice_sources
    else:
        raise ValueError(f"unknown cloud {cloud!r}; expected one of {CLOUDS + ('none', 'auto')}")
    return notice_sources(metadata_url)


def metadata_emulator(cloud: str, host: str = "127.0.0.1", port: int = 0) -> MetadataEmulator:
    """The localhost emulator of `cloud`'s metadata service (not started)."""
    if cloud == "aws":
        from cloud_adapters.aws.emulator import AWSMetadataEmulator as emulator
    elif cloud == "gcp":
        from cloud_adapters.gcp.emulator import GCPMetadataEmulator as emulator
    elif cloud == "azure":
        from cloud_adapters.azure.emulator import AzureMetadataEmulator as emulator
    else:
        raise ValueError(f"no emulator for cloud {cloud!r}; expected one of {CLOUDS}")
    return emulator(host=host, port=port)
