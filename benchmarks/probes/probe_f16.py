"""What float16 can buy on this adapter through wgpu: the FMA throughput of vec4<f16> against
vec4<f32>, and whether the adapter's matrix units (cooperative matrices: NVIDIA tensor cores,
Apple simdgroup matrices) can be reached.

    python benchmarks/probes/probe_f16.py                 # the first GPU adapter
    python benchmarks/probes/probe_f16.py --workgroups 64 --json probe.json   # a small run (lavapipe)

Mixed precision can only run faster than float32 by as much as its arithmetic does where a step is
bound by arithmetic (the GEMMs and convolutions of most models). Without matrix units that is the
ratio printed here: on an H100 through Vulkan (session 37), 55.2 against 45.1 TFLOP/s, 1.23x.
wgpu-native 29 (wgpu-py 0.32) lists `cooperative-matrix` on that H100 but refuses a device with it:
the feature is experimental in wgpu, and the C API has no way to turn experimental features on
(gfx-rs/wgpu-native#516). The probe prints which of these holds here.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ITERATIONS = 2048   # FMA steps per invocation, each on 8 independent vec4 accumulators
ACCUMULATORS = 8


def fma_shader(ty: str) -> str:
    """A chain of FMAs on ACCUMULATORS independent vec4<ty> values per invocation (no memory traffic
    but one store, which keeps the compiler from dropping the loop)."""
    names = [f"a{k}" for k in range(ACCUMULATORS)]
    init = "; ".join(f"var {n} = vec4<{ty}>({ty}(g.x & 7u) + {ty}({k}) * c)" for k, n in enumerate(names))
    steps = " ".join(f"{n} = fma({n}, m, c);" for n in names)
    return f"""enable f16;
@group(0) @binding(0) var<storage, read_write> o: array<vec4<{ty}>>;
@compute @workgroup_size(256)
fn main(@builtin(global_invocation_id) g: vec3<u32>) {{
  let m = vec4<{ty}>({ty}(0.999), {ty}(0.998), {ty}(0.997), {ty}(0.996));
  let c = vec4<{ty}>({ty}(0.001));
  {init};
  for (var i = 0u; i < {ITERATIONS}u; i++) {{ {steps} }}
  o[g.x & 1023u] = {' + '.join(names)};
}}
"""


def fma_tflops(device, ty: str, workgroups: int, repeats: int = 5) -> float:
    """Best of three timings of `repeats` dispatches (wall clock around a submit and a readback)."""
    import wgpu
    pipe = device.create_compute_pipeline(layout="auto", compute={
        "module": device.create_shader_module(code=fma_shader(ty)), "entry_point": "main"})
    out = device.create_buffer(size=1024 * 16, usage=wgpu.BufferUsage.STORAGE | wgpu.BufferUsage.COPY_SRC)
    group = device.create_bind_group(layout=pipe.get_bind_group_layout(0),
                                     entries=[{"binding": 0, "resource": {"buffer": out}}])

    def run(n: int) -> float:
        enc = device.create_command_encoder()
        cp = enc.begin_compute_pass()
        cp.set_pipeline(pipe)
        cp.set_bind_group(0, group)
        for _ in range(n):
            cp.dispatch_workgroups(workgroups, 1, 1)
        cp.end()
        t = time.perf_counter()
        device.queue.submit([enc.finish()])
        device.queue.read_buffer(out, 0, 16)
        return time.perf_counter() - t
    run(1)
    seconds = min(run(repeats) for _ in range(3)) / repeats
    flops = workgroups * 256 * ITERATIONS * ACCUMULATORS * 4 * 2
    return flops / seconds / 1e12


def matrix_units(adapter) -> str:
    """Whether a device with cooperative matrices can be made here, in words."""
    if "cooperative-matrix" not in adapter.features:
        return "not listed by this adapter"
    try:
        adapter.request_device_sync(required_features=["cooperative-matrix"])
    except Exception as e:  # noqa: BLE001 - the reason is the finding
        reason = str(e).strip().splitlines()[-1].strip()
        return f"listed, but a device with them is refused: {reason}"
    return "listed, and a device with them can be made"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--adapter", type=int, default=None, help="index in anygrad's adapter list (`anygrad devices`)")
    ap.add_argument("--workgroups", type=int, default=8192, help="of 256 invocations (8192 fills an H100)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    import wgpu
    adapters = wgpu.gpu.enumerate_adapters_sync()
    if not adapters:
        print("no wgpu adapter", file=sys.stderr)
        return 1
    adapter = adapters[args.adapter] if args.adapter is not None else \
        wgpu.gpu.request_adapter_sync(power_preference="high-performance")
    info = adapter.info
    result = {"adapter": f"{info['device']} ({info['backend_type']}, {info['description']})",
              "matrix_units": matrix_units(adapter)}
    if "shader-f16" in adapter.features:
        device = adapter.request_device_sync(required_features=["shader-f16"])
        f32, f16 = (fma_tflops(device, ty, args.workgroups) for ty in ("f32", "f16"))
        result |= {"fma_tflops_f32": round(f32, 2), "fma_tflops_f16": round(f16, 2), "f16_over_f32": round(f16 / f32, 2)}
    else:
        result["fma_tflops_f16"] = None  # no shader-f16: anygrad refuses --precision f16 here
    for key, value in result.items():
        print(f"{key}: {value}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
