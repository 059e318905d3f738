"""What a gradient bucket read back mid-step costs the GPU, and why: the split of the step into
several submissions, or the copy over the bus.

    python benchmarks/probes/probe_readback.py                       # the first GPU adapter
    python benchmarks/probes/probe_readback.py --elements 65536 --kernels 40 --repeats 3   # lavapipe

Data parallelism reads each bucket back as soon as the kernel that finishes it has run: the step is
submitted in parts, each ending with the bucket's copy into mapped memory, and the mapping is asked
for right after (WgpuExecutable.taps). On 2 H200s that made the GPT's backward pass end 3.5 ms later
(of 47 ms) for 17 MB in 11 buckets (BENCHMARKS.md, session 38), and copying each bucket into a
device buffer first, so that no kernel waited on the bus copy, did not help. This probe times a
chain of GPU-bound kernels writing one buffer (an "arena"), the same chain with the cuts, copies
and map requests that taps add, one at a time:

- one:         one submission;
- split:       `--taps` submissions, nothing else;
- split+map:   each part also copies 256 bytes into its own staging buffer, mapped after its submit;
- copy:        one submission with the `--taps` copies of `--mb` MB each from the arena;
- taps:        split, copy and map together (what a data-parallel step does);
- taps, other: the same, copying from a buffer that no kernel writes (no barrier on the arena).

Each is the median of `--repeats` runs, wall clock from the first submit to the last mapping (and
the whole chain) done; "over one" is the extra per tap.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

WORKGROUP = 256


def work_shader(iterations: int) -> str:
    """Each invocation runs `iterations` dependent FMAs on its element of the arena (GPU-bound,
    and a write to the arena, as a step's kernels write its gradients)."""
    return f"""
@group(0) @binding(0) var<storage, read_write> x: array<f32>;
@compute @workgroup_size({WORKGROUP})
fn main(@builtin(global_invocation_id) g: vec3<u32>, @builtin(num_workgroups) nw: vec3<u32>) {{
  let i = g.x + g.y * nw.x * {WORKGROUP}u;
  if (i >= arrayLength(&x)) {{ return; }}
  var v = x[i];
  for (var k = 0u; k < {iterations}u; k++) {{ v = fma(v, 0.9999, 0.0001); }}
  x[i] = v;
}}
"""


def probe(device_name: str, elements: int, kernels: int, iterations: int, taps: int, mb: float,
          repeats: int) -> dict:
    import wgpu

    from anygrad.backends.wgpu import WgpuBackend
    backend = WgpuBackend(device_name)  # anygrad's device: its poll thread does not block (poller.py)
    dev = backend.device
    U = wgpu.BufferUsage
    arena = dev.create_buffer(size=max(elements * 4, int(mb * taps * (1 << 20)) + 4096),
                              usage=U.STORAGE | U.COPY_SRC | U.COPY_DST)
    other = dev.create_buffer(size=arena.size, usage=U.STORAGE | U.COPY_SRC)
    pipe = dev.create_compute_pipeline(layout="auto", compute={
        "module": dev.create_shader_module(code=work_shader(iterations)), "entry_point": "main"})
    group = dev.create_bind_group(layout=pipe.get_bind_group_layout(0), entries=[
        {"binding": 0, "resource": {"buffer": arena, "offset": 0, "size": elements * 4}}])
    groups = -(-elements // WORKGROUP)
    grid = (min(groups, 65535), -(-groups // 65535), 1)
    nbytes = int(mb * (1 << 20)) // 4 * 4
    staging = [dev.create_buffer(size=max(nbytes, 256), usage=U.MAP_READ | U.COPY_DST) for _ in range(taps)]
    cuts = {round((t + 1) * kernels / taps) - 1 for t in range(taps)}

    def encode(split: bool, copy: int, source) -> list:
        """Command buffers of one run: the kernels, cut after each tap where `split`, with `copy`
        bytes from `source` into that tap's staging buffer (0: none)."""
        out, enc, cp, tap = [], dev.create_command_encoder(), None, 0
        for k in range(kernels):
            if cp is None:
                cp = enc.begin_compute_pass()
                cp.set_pipeline(pipe)
                cp.set_bind_group(0, group)
            cp.dispatch_workgroups(*grid)
            if k in cuts:
                cp.end()
                cp = None
                if copy:
                    enc.copy_buffer_to_buffer(source, tap * nbytes if copy == nbytes else 0, staging[tap], 0, copy)
                tap += 1
                if split:
                    out.append(enc.finish())
                    enc = dev.create_command_encoder()
        if cp is not None:
            cp.end()
        out.append(enc.finish())
        return out

    def run(split: bool, copy: int, source, maps: bool) -> float:
        parts = encode(split, copy, source)
        t = time.perf_counter()
        promises = []
        for k, part in enumerate(parts):
            dev.queue.submit([part])
            if maps and split and k < taps:
                promises.append(staging[k].map_async(wgpu.MapMode.READ))
        if maps and not split:
            promises = [s.map_async(wgpu.MapMode.READ) for s in staging]
        for p in promises:
            p.sync_wait()
        dev.queue.read_buffer(arena, 0, 4)  # the whole chain done
        seconds = time.perf_counter() - t
        for s in staging:
            if s.map_state == "mapped":
                s.unmap()
        return seconds

    cases = {"one": (False, 0, arena, False), "split": (True, 0, arena, False),
             "split+map": (True, 256, arena, True), "copy": (False, nbytes, arena, False),
             "taps": (True, nbytes, arena, True), "taps, other": (True, nbytes, other, True)}
    for args in cases.values():  # compile, allocate, warm up
        run(*args)
    times: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(repeats):  # interleaved, so that drifts of the host hit every case alike
        for name, args in cases.items():
            times[name].append(run(*args))
    ms = {name: 1000 * statistics.median(v) for name, v in times.items()}
    return {"adapter": backend.adapter.summary, "elements": elements, "kernels": kernels, "iterations": iterations,
            "taps": taps, "mb_per_tap": mb, "repeats": repeats, "ms": ms,
            "over_one_per_tap_ms": {name: (v - ms["one"]) / taps for name, v in ms.items() if name != "one"}}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="wgpu")
    p.add_argument("--elements", type=int, default=4 << 20, help="floats each kernel updates (the arena)")
    p.add_argument("--kernels", type=int, default=400)
    p.add_argument("--iterations", type=int, default=256, help="FMAs per element and kernel")
    p.add_argument("--taps", type=int, default=11)
    p.add_argument("--mb", type=float, default=1.5, help="MB copied at each tap")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--json")
    args = p.parse_args(argv)
    got = probe(args.device, args.elements, args.kernels, args.iterations, args.taps, args.mb, args.repeats)
    print(f"{got['adapter']}: {args.kernels} kernels, {args.taps} taps of {args.mb:g} MB")
    for name, ms in got["ms"].items():
        extra = got["over_one_per_tap_ms"].get(name)
        print(f"  {name:12s} {ms:8.2f} ms" + ("" if extra is None else f"  ({extra:+.3f} ms a tap)"))
    if args.json:
        Path(args.json).write_text(json.dumps(got, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
