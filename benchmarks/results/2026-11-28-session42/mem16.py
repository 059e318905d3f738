"""16-bit against 32-bit storage access on this adapter: which access pattern costs f16 more?"""
import sys
import time

import wgpu

N = 1 << int(sys.argv[1]) if len(sys.argv) > 1 else 1 << 26  # elements
ROWS = 64

PATTERNS = {
    # name: (read index expr, write index expr, elements written per invocation)
    "copy_contig": ("i", "i"),
    "load_stride9_gather": ("(i * 9u) % n", "i"),        # im2col-like: neighbours 9 apart
    "load_stride256": ("(i * 256u) % n + (i * 256u) / n", "i"),  # column walk
    "store_stride2": ("i", "(2u * i) % n"),              # phase decomposition: every other element
    "store_stride256": ("i", "(i * 256u) % n + (i * 256u) / n"),
}


def shader(ty: str, rd: str, wr: str) -> str:
    return f"""enable f16;
@group(0) @binding(0) var<storage, read> a: array<{ty}>;
@group(0) @binding(1) var<storage, read_write> b: array<{ty}>;
@compute @workgroup_size(256)
fn main(@builtin(global_invocation_id) g: vec3<u32>) {{
  let n = {N}u;
  let i = g.y * {N // ROWS}u + g.x;
  b[{wr}] = a[{rd}] * {ty}(1.5);
}}
"""


def time_ms(dev, code, reps=20):
    pipe = dev.create_compute_pipeline(layout="auto", compute={"module": dev.create_shader_module(code=code), "entry_point": "main"})
    a = dev.create_buffer(size=N * 4, usage=wgpu.BufferUsage.STORAGE)
    b = dev.create_buffer(size=N * 4, usage=wgpu.BufferUsage.STORAGE | wgpu.BufferUsage.COPY_SRC)
    bg = dev.create_bind_group(layout=pipe.get_bind_group_layout(0), entries=[
        {"binding": 0, "resource": {"buffer": a}}, {"binding": 1, "resource": {"buffer": b}}])

    def run(n):
        enc = dev.create_command_encoder()
        cp = enc.begin_compute_pass()
        cp.set_pipeline(pipe)
        cp.set_bind_group(0, bg)
        for _ in range(n):
            cp.dispatch_workgroups(N // 256 // ROWS, ROWS, 1)
        cp.end()
        t = time.perf_counter()
        dev.queue.submit([enc.finish()])
        dev.queue.read_buffer(b, 0, 16)
        return time.perf_counter() - t
    run(2)
    return 1e3 * min(run(reps) for _ in range(3)) / reps


ad = wgpu.gpu.request_adapter_sync(power_preference="high-performance")
dev = ad.request_device_sync(required_features=["shader-f16"], required_limits={"max_storage_buffer_binding_size": N * 4, "max_buffer_size": N * 4})
print(ad.info["device"], "N", N)
for name, (rd, wr) in PATTERNS.items():
    t = {ty: time_ms(dev, shader(ty, rd, wr)) for ty in ("f32", "f16")}
    print(f"{name:22s} f32 {t['f32']:.3f} ms  f16 {t['f16']:.3f} ms  f16/f32 time {t['f16'] / t['f32']:.2f}", flush=True)
