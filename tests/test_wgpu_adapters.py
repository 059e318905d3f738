"""How adapters are described (`anygrad devices`), without a GPU, and on the machine's adapters."""
from __future__ import annotations

import subprocess
import sys

import pytest
import wgpu_util

from anygrad.backends.wgpu.device.adapters import AdapterInfo

LIMITS = {"max-storage-buffer-binding-size": 128 << 20, "max-buffer-size": (1 << 31) - 1,
          "max-storage-buffers-per-shader-stage": 8, "max-compute-workgroup-storage-size": 16384,
          "max-compute-invocations-per-workgroup": 256, "max-compute-workgroups-per-dimension": 65535}


def test_describe_shows_key_limits_and_features():
    a = AdapterInfo(index=2, name="Fake GPU", backend="Vulkan", type="integrated", limits=LIMITS,
                    features=("depth-clip-control", "subgroup", "timestamp-query"))
    lines = a.describe().splitlines()
    assert lines[0] == a.summary == "wgpu:2  Fake GPU (Vulkan, integrated)"
    assert lines[1].strip() == ("limits: storage binding 128 MiB, buffer 2 GiB - 1 byte, 8 storage buffers/stage, "
                                "workgroup storage 16 KiB, 256 invocations/workgroup, 65535 workgroups/dim")
    assert lines[2].strip() == "features: subgroup, timestamp-query (+1 more)"
    assert lines[1].startswith(" " * len("wgpu:2  "))  # indented under the adapter's name
    assert str(a) == a.describe()


@pytest.mark.parametrize("n, text", [(128 << 20, "128 MiB"), ((1 << 31) - 4, "2 GiB - 4 bytes"),
                                     ((1 << 31) + 1, "2 GiB + 1 byte"), (4094 << 20, "4094 MiB"),
                                     (48 << 10, "48 KiB"), (1000, "1000 bytes")])
def test_byte_limits_read_like_the_numbers_drivers_mean(n, text):
    a = AdapterInfo(index=0, name="X", backend="Vulkan", type="discrete", limits={"max-buffer-size": n})
    assert f"limits: buffer {text}" in a.describe()


def test_describe_without_limits_or_features():
    a = AdapterInfo(index=0, name="Old", backend="OpenGL", type="cpu", limits={"max-buffer-size": 1000})
    assert a.summary == "wgpu:0  Old (OpenGL, cpu, software)"
    assert "limits: buffer 1000 bytes" in a.describe()
    assert "features: none of shader-f16/subgroup/timestamp-query" in a.describe()


# -- a real adapter: required in CI (ANYGRAD_REQUIRE_WGPU=1, set by .ci/run) --------------------------
def test_missing_adapter_skips_or_fails_as_required(monkeypatch):
    import anygrad.devices
    monkeypatch.setattr(anygrad.devices, "list_adapters", list)
    monkeypatch.delenv(wgpu_util.REQUIRE_ENV, raising=False)
    with pytest.raises(pytest.skip.Exception):
        wgpu_util.wgpu_backend()
    assert wgpu_util.has_adapter() is False
    monkeypatch.setenv(wgpu_util.REQUIRE_ENV, "1")
    with pytest.raises(pytest.fail.Exception, match="ANYGRAD_REQUIRE_WGPU=1 requires one"):
        wgpu_util.has_adapter()
    with pytest.raises(pytest.fail.Exception):
        wgpu_util.wgpu_backend()


@pytest.mark.wgpu
def test_devices_lists_a_vulkan_adapter():
    """`anygrad devices` (as a user runs it) lists a Vulkan adapter with its limits; on a Linux
    machine whose only Vulkan adapters are software, that is Mesa's lavapipe (llvmpipe)."""
    if not wgpu_util.has_adapter():
        pytest.skip("no WebGPU adapter on this machine")
    r = subprocess.run([sys.executable, "-m", "anygrad.cli", "devices"], capture_output=True, text=True,
                       timeout=300, check=False)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0] == "cpu (numpy)"
    adapters = [line for line in lines if line.startswith("wgpu:")]
    assert adapters and len([line for line in lines if "limits: storage binding" in line]) == len(adapters)
    if not sys.platform.startswith("linux"):
        return  # Metal / D3D12 machines need not have Vulkan
    vulkan = [line for line in adapters if "(Vulkan," in line]
    assert vulkan, r.stdout
    if all(", software)" in line for line in vulkan):
        assert any("llvmpipe" in line for line in vulkan), r.stdout
