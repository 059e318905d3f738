"""How long Dawn takes to build compute pipelines, and whether threads help.

Question (issue 43): Dawn's compile time was 1.9-2.2x wgpu-native's for the same f16 model, almost
all of it pipeline creation, 0.3-0.5 s a pipeline on one thread. Does Dawn serialise pipeline
creation behind its device lock, or do several threads build at once? Answer (H200, 2026-12-02,
`results/2026-12-02-matrix-units-eve/pipeline_creation_dawn.json`): 24 pipelines took 13.8 s on
one thread, 7.5 s through create_compute_pipeline_async, 1.9 s on 16 threads of a device opened
with implicit-device-synchronization; so device/pipeline_cache.build_parallel builds on threads
wherever Implementation.threaded says the device allows it.

The shaders are anygrad's own: matrix-unit convolutions (forward, input and weight gradient) at
distinct channel counts, so no two are the same text and no cache can answer. Run with the
driver's disk cache off (`__GL_SHADER_DISK_CACHE=0` on NVIDIA), or a second run measures the cache.

    python benchmarks/probes/pipeline_creation.py --count 24 --json out.json
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

import anygrad.ops  # noqa: F401  (registers the op forwards)
from anygrad.backends.wgpu.device import implementation
from anygrad.backends.wgpu.device.pipeline_cache import build_parallel
from anygrad.backends.wgpu.kernels import kernels_conv  # noqa: F401  (registers the lowerings)
from anygrad.backends.wgpu.kernels.halfstore import stored_half
from anygrad.backends.wgpu.kernels.kernel import LOWERINGS, AdapterCaps
from anygrad.backends.wgpu.kernels.kernels_mma import FEATURES
from anygrad.backends.wgpu.kernels.matrix_units import MatrixConfig, MatrixUnits
from anygrad.ir import Graph, Node, TensorInfo, infer_node
from anygrad.ir.passes import resolve_attributes

F16 = np.dtype("float16")
CONV = {"dilations": [1, 1], "group": 1, "kernel_shape": [3, 3], "pads": [1, 1, 1, 1], "strides": [1, 1]}


def _open(impl, threaded: bool):
    """(device, caps) on the first adapter with f16 subgroup matrices; `threaded`: with
    implicit-device-synchronization (threads may share the device)."""
    wgpu = impl.module
    for adapter in wgpu.gpu.enumerate_adapters_sync():
        if not all(f in adapter.features for f in FEATURES):
            continue
        configs = tuple(MatrixConfig(int(c["m"]), int(c["n"]), int(c["k"]), str(c["component_type"]).lower(),
                                     str(c["result_component_type"]).lower()) for c in impl.matrix_configs(adapter))
        if not any(c.operand == "f16" and c.result == "f32" for c in configs):
            continue
        feats = list(FEATURES) + ([implementation.DAWN_THREAD_SAFETY] if threaded else [])
        lim = adapter.limits
        keys = ("max-compute-workgroup-storage-size", "max-compute-invocations-per-workgroup")
        from wgpudawn.backends.dawn import extras
        device = extras.request_device_sync(adapter, required_features=feats, required_limits={k: lim[k] for k in keys})
        caps = AdapterCaps(max_workgroup_storage=int(lim[keys[0]]), max_invocations_per_workgroup=int(lim[keys[1]]),
                           has_subgroups=True, has_f16=True, is_cpu=False,
                           adapter_facts=MatrixUnits(configs, max(impl.subgroup_sizes(adapter)) or 32, True, True))
        return device, caps
    raise SystemExit("no Dawn adapter with f16 subgroup matrices (chromium-experimental-subgroup-matrix)")


def shaders(count: int, caps: AdapterCaps, salt: int) -> list[str]:
    """`count` distinct matrix-unit conv shaders (their channel counts differ by `salt`)."""
    out: list[str] = []
    i = 0
    while len(out) < count:
        c = 32 * (1 + i % 8) + 8 * salt
        side = 14 + i // 8
        op, shapes, attrs = [
            ("Conv", [(8, c, side, side), (c, c, 3, 3)], {"pads": [1, 1, 1, 1]}),
            ("ConvGradInput", [(8, c, side, side), (c, c, 3, 3)], {**CONV, "input_shape": [8, c, side, side]}),
            ("ConvGradWeight", [(8, c, side, side), (8, c, side, side)], {**CONV, "weight_shape": [c, c, 3, 3]}),
        ][i % 3]
        i += 1
        g = Graph()
        names = [f"x{k}" for k in range(len(shapes))]
        for n, s in zip(names, shapes):
            g.info[n] = TensorInfo(F16, tuple(s))
        node = Node(op, names, ["y0"], {**attrs, "_gemm_variant": "mma"}, name="n")
        g.nodes = [node]
        infer_node(g, node)
        g.info["y0"] = TensorInfo(F16, g.info["y0"].shape)
        for k in stored_half(LOWERINGS[op](node, resolve_attributes(g), caps), g):
            if "[mma " in k.name and k.wgsl not in out:
                out.append(k.wgsl)
    return out[:count]


def _build(device, wgsl: str):
    module = device.create_shader_module(code=wgsl)
    return device.create_compute_pipeline(layout="auto", compute={"module": module, "entry_point": "main"})


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--count", type=int, default=24, help="distinct pipelines per mode")
    p.add_argument("--json", type=Path, help="write the timings here")
    args = p.parse_args()
    impl = implementation.load("dawn")
    results = {}
    # each mode builds its own shaders (another salt): nothing it builds was built before
    for salt, (mode, threaded) in enumerate((("one thread", False), ("threads", True))):
        device, caps = _open(impl, threaded)
        texts = shaders(args.count, caps, salt)
        t0 = time.perf_counter()
        if threaded:
            build_parallel(lambda w, device=device: _build(device, w), texts, threaded=True)
        else:
            for w in texts:
                _build(device, w)
        results[mode] = {"pipelines": len(texts), "seconds": round(time.perf_counter() - t0, 3)}
        print(f"{mode}: {len(texts)} pipelines in {results[mode]['seconds']} s", flush=True)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
