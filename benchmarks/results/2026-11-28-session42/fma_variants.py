"""Which WGSL formulation gets f16 FMAs at the HFMA2 rate (2x f32 on Hopper)?"""
import sys
import time

import wgpu

ITER = 1024

def shader(ty, width, nacc, form, wg):
    vt = f"vec{width}<{ty}>" if width > 1 else ty
    names = [f"a{k}" for k in range(nacc)]
    comps = ", ".join(f"{ty}(0.99{k})" for k in range(width)) if width > 1 else f"{ty}(0.999)"
    init = "; ".join(f"var {n} = {vt}({ty}(g.x & 7u) * {ty}(0.01) + {ty}({k}) * {ty}(0.001))" for k, n in enumerate(names))
    if form == "fma":
        steps = " ".join(f"{n} = fma({n}, m, c);" for n in names)
    elif form == "muladd":
        steps = " ".join(f"{n} = {n} * m + c;" for n in names)
    elif form == "bcast":   # the GEMM's form: a scalar broadcast times a vector, accumulated
        steps = " ".join(f"{n} = fma({vt}(s[{k % width}]), m, {n});" for k, n in enumerate(names))
    elif form == "outer":   # 4 scalars x 1 vec into 4 accumulators (a TMxTN block)
        steps = " ".join(f"{n} = fma({vt}(s[{k % 4}]), mv, {n});" for k, n in enumerate(names))
    return f"""enable f16;
@group(0) @binding(0) var<storage, read_write> o: array<{vt}>;
@compute @workgroup_size({wg})
fn main(@builtin(global_invocation_id) g: vec3<u32>) {{
  let m = {vt}({comps});
  let c = {vt}({ty}(0.001));
  var s = vec4<{ty}>({ty}(0.5), {ty}(0.25), {ty}(0.125), {ty}(0.0625));
  var mv = m;
  {init};
  for (var i = 0u; i < {ITER}u; i++) {{ {steps} s = s * {ty}(0.999); mv = mv * {ty}(0.999); }}
  o[g.x & 1023u] = {' + '.join(names)};
}}
"""

def tflops(device, ty, width, nacc, form, wg, groups):
    pipe = device.create_compute_pipeline(layout="auto", compute={
        "module": device.create_shader_module(code=shader(ty, width, nacc, form, wg)), "entry_point": "main"})
    out = device.create_buffer(size=1024 * 16, usage=wgpu.BufferUsage.STORAGE | wgpu.BufferUsage.COPY_SRC)
    bg = device.create_bind_group(layout=pipe.get_bind_group_layout(0), entries=[{"binding": 0, "resource": {"buffer": out}}])
    def run(n):
        enc = device.create_command_encoder(); cp = enc.begin_compute_pass()
        cp.set_pipeline(pipe); cp.set_bind_group(0, bg)
        for _ in range(n): cp.dispatch_workgroups(groups, 1, 1)
        cp.end(); t = time.perf_counter(); device.queue.submit([enc.finish()]); device.queue.read_buffer(out, 0, 16)
        return time.perf_counter() - t
    run(2)
    sec = min(run(10) for _ in range(3)) / 10
    return groups * wg * ITER * nacc * width * 2 / sec / 1e12

ad = wgpu.gpu.request_adapter_sync(power_preference="high-performance")
dev = ad.request_device_sync(required_features=["shader-f16"])
print(ad.info["device"])
groups = int(sys.argv[1]) if len(sys.argv) > 1 else 16384
res = []
for form in ("fma", "muladd", "bcast", "outer"):
    for width in (4, 2):
        for nacc in (8, 16):
            for wg in (256, 128):
                r = {}
                for ty in ("f32", "f16"):
                    try:
                        r[ty] = tflops(dev, ty, width, nacc, form, wg, groups * (256 // wg))
                    except Exception as e:  # noqa: BLE001 - a variant that fails to build is a finding
                        r[ty] = float("nan"); print("ERR", form, width, nacc, ty, str(e)[:200])
                line = f"{form:7s} vec{width} acc{nacc:2d} wg{wg}: f32 {r['f32']:6.1f} f16 {r['f16']:6.1f} ratio {r['f16']/r['f32']:.2f}"
                print(line, flush=True); res.append(line)
