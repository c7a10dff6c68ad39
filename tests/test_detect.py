"""Cloud detection: DMI files first, then a short metadata probe against real emulators."""

import socket
import time

import pytest

from cloud_adapters.aws.emulator import AWSMetadataEmulator
from cloud_adapters.azure.emulator import AzureMetadataEmulator
from cloud_adapters.detect import detect_cloud, from_dmi
from cloud_adapters.gcp.emulator import GCPMetadataEmulator


@pytest.mark.parametrize(
    "files,cloud",
    [
        ({"sys_vendor": "Amazon EC2\n", "product_name": "g5.xlarge"}, "aws"),
        ({"sys_vendor": "Google\n", "product_name": "Google Compute Engine\n"}, "gcp"),
        ({"sys_vendor": "Microsoft Corporation\n", "chassis_asset_tag": "7783-7084-3265-9085-8269-3286-77\n"}, "azure"),
        ({"sys_vendor": "Microsoft Corporation\n", "chassis_asset_tag": "None\n"}, None),  # plain Hyper-V
        ({"sys_vendor": "QEMU\n"}, None),
    ],
)
def test_dmi(tmp_path, files, cloud):
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    assert from_dmi(tmp_path) == cloud


@pytest.mark.parametrize(
    "emulator_cls,cloud", [(AWSMetadataEmulator, "aws"), (GCPMetadataEmulator, "gcp"), (AzureMetadataEmulator, "azure")]
)
def test_probe_when_dmi_says_nothing(tmp_path, emulator_cls, cloud):
    with emulator_cls() as emu:
        assert detect_cloud(emu.url, dmi_dir=tmp_path) == cloud


def test_dmi_wins_without_any_network(tmp_path):
    (tmp_path / "sys_vendor").write_text("Amazon EC2")
    with GCPMetadataEmulator() as emu:
        assert detect_cloud(emu.url, dmi_dir=tmp_path) == "aws"
        assert emu.requests_seen == 0


def test_nothing_answers_means_none_quickly(tmp_path):
    """Off any cloud, 169.254.169.254 takes the connection nowhere and nothing answers: each of the three
    probes must give up after its 0.3 s timeout. A listener that is never accepted from stands in for it
    (the kernel completes the handshake; the request is never read nor answered). The bound is three
    probes' connect and read timeouts, 1.8 s, plus room for a loaded machine: far below one probe
    waiting on the client's default timeout."""
    with socket.socket() as blackhole:
        blackhole.bind(("127.0.0.1", 0))
        blackhole.listen(8)
        started = time.monotonic()
        assert detect_cloud(f"http://127.0.0.1:{blackhole.getsockname()[1]}", dmi_dir=tmp_path) == "none"
        assert time.monotonic() - started < 3.0
