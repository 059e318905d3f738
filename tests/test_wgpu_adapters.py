"""How adapters are described (`anygrad devices`), without a GPU, and on the machine's adapters."""
from __future__ import annotations

from anygrad.backends.wgpu.adapters import AdapterInfo

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


def test_describe_without_limits_or_features():
    a = AdapterInfo(index=0, name="Old", backend="OpenGL", type="cpu", limits={"max-buffer-size": 1000})
    assert a.summary == "wgpu:0  Old (OpenGL, cpu, software)"
    assert "limits: buffer 1000 bytes" in a.describe()
    assert "features: none of shader-f16/subgroup/timestamp-query" in a.describe()
