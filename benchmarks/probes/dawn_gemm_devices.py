"""Why GPT-2 small's MLP weight gradient (a Gemm, transA, 768x3072x2048, f16) runs 0.33 ms in the
tuned step while the same GEMM in benchmarks/gemm_mma.py runs 0.094 ms: one process, both
devices (gemm_mma's own Dawn device, and anygrad's WgpuBackend on Dawn), the MatMul form and the
Gemm form, unsplit and split in 4, each timed after a spin (profiling.SPIN_MS).

    python benchmarks/probes/dawn_gemm_devices.py --json out.json
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from gemm_mma import Bench


def backend_kernels(backend, op: str, attrs: dict):
    from anygrad.backends.wgpu.kernels.halfstore import stored_half
    from anygrad.backends.wgpu.kernels.kernel import LOWERINGS
    from anygrad.ir import Graph, Node, TensorInfo
    g = Graph()
    g.info["a"] = TensorInfo(np.dtype(np.float16), (2048, 768))
    g.info["b"] = TensorInfo(np.dtype(np.float16), (2048, 3072))
    g.info["y"] = TensorInfo(np.dtype(np.float16), (768, 3072))
    node = Node(op, ["a", "b"], ["y"], dict(attrs), name="gemm")
    g.nodes = [node]
    return stored_half(LOWERINGS[op](node, g, backend.caps), g), g


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    from anygrad.backends.wgpu import WgpuBackend
    from anygrad.backends.wgpu.tuning import autotune
    out = []

    def log(**entry) -> None:
        print(json.dumps(entry), flush=True)
        out.append(entry)

    bench = Bench((768, 3072, 2048, 1), "tn")
    for splits in (1, 4):
        kernels, ds = bench.build({"_gemm_variant": "mma", "_gemm_splits": splits})
        bench.run(ds, 2)
        log(device="gemm_mma", form="MatMul tn", splits=splits, kernels=[k.name for k in kernels],
            ms=bench.seconds(ds, 100, 3) * 1e3)
    backend = WgpuBackend("wgpu:dawn")
    log(precision=backend.check_precision("f16"))  # the self-tests, as a f16 compile runs them
    timer = autotune.device_timer(backend)
    log(caps=repr(backend.caps)[:600])
    forms = {"MatMul tn": ("MatMul", {"_permA": [1, 0]}), "Gemm transA": ("Gemm", {"transA": 1})}
    for name, (op, attrs) in forms.items():
        for splits in (1, 4):
            kernels, g = backend_kernels(backend, op, attrs | {"_gemm_variant": "mma", "_gemm_splits": splits})
            ms = min(timer.all([kernels], g)[0] for _ in range(3))
            log(device="WgpuBackend", form=name, splits=splits, kernels=[k.name for k in kernels], ms=ms)
    # the gemm_mma device's kernels on the backend: the same WGSL?
    kb, _ = bench.build({"_gemm_variant": "mma", "_gemm_splits": 1})
    ka, _ = backend_kernels(backend, "MatMul", {"_permA": [1, 0], "_gemm_variant": "mma", "_gemm_splits": 1})
    import difflib
    log(same_wgsl=[a.wgsl == b.wgsl for a, b in zip(ka, kb)],
        diff=list(difflib.unified_diff(kb[0].wgsl.splitlines(), ka[0].wgsl.splitlines(), lineterm="", n=0))[:60])
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
