"""The notice sources for a cloud: one source per kind of notice, as each cloud module defines them."""

from __future__ import annotations

from cloud_adapters.notice import NoticeSource

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
