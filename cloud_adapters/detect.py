"""Which cloud am I on? DMI files first (no network, instant), a short metadata probe second."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger(__name__)

DMI_DIR = Path("/sys/class/dmi/id")

# What each cloud writes into the DMI tables of its VMs (file name -> lower-case fragment).
_DMI_MARKERS: dict[str, tuple[tuple[str, str], ...]] = {
    "aws": (("sys_vendor", "amazon ec2"), ("bios_vendor", "amazon ec2"), ("product_version", "amazon")),
    "gcp": (("product_name", "google compute engine"), ("sys_vendor", "google"), ("bios_vendor", "google")),
    # Azure VMs carry Hyper-V's vendor and a fixed chassis asset tag that plain Hyper-V hosts lack.
    "azure": (("chassis_asset_tag", "7783-7084-3265-9085-8269-3286-77"),),
}


def _read(path: Path) -> str:
    try:
        return path.read_text(errors="replace").strip().lower()
    except OSError:
        return ""


def from_dmi(dmi_dir: Path = DMI_DIR) -> str | None:
    """The cloud named by the DMI files, or None when they say nothing conclusive."""
    for cloud, markers in _DMI_MARKERS.items():
        if any(fragment in _read(dmi_dir / name) for name, fragment in markers):
            return cloud
    return None


def _probes() -> dict[str, Callable[..., bool]]:
    from cloud_adapters.aws.metadata import probe as aws_probe
    from cloud_adapters.azure.metadata import probe as azure_probe
    from cloud_adapters.gcp.metadata import probe as gcp_probe

    return {"aws": aws_probe, "gcp": gcp_probe, "azure": azure_probe}


def detect_cloud(metadata_url: str | None = None, dmi_dir: Path = DMI_DIR, timeout_s: float = 0.3) -> str:
    """ "aws", "gcp", "azure" or "none" (no cloud found: signals only)."""
    cloud = from_dmi(dmi_dir)
    if cloud:
        log.info("cloud detected from DMI: %s", cloud)
        return cloud
    for name, probe in _probes().items():
        if probe(metadata_url, timeout_s=timeout_s):
            log.info("cloud detected by metadata probe: %s", name)
            return name
    log.info("no cloud detected (no DMI marker, no metadata service answered): watching signals only")
    return "none"
