import sys, numpy as np
import anygrad
from anygrad.examples import FOUNDING_MODEL
from anygrad.optim import SGD
dev = sys.argv[1] if len(sys.argv) > 1 else "wgpu"
batch = int(sys.argv[2]) if len(sys.argv) > 2 else 64
m = anygrad.load_onnx(str(FOUNDING_MODEL))
m.compile(loss="nll", optimizer=SGD(lr=0.01, momentum=0.9), device=dev, seed=1)
rng = np.random.default_rng(0)
x = rng.standard_normal((batch, 1, 28, 28)).astype(np.float32); y = rng.integers(0, 10, batch).astype(np.int64)
m.train_on_batch(x, y)
exe = list(m._programs.values())[0]
prof = exe.profile({exe.graph.inputs[0]: x, "anygrad.target": y}, repeat=2)
tot = sum(ms for _, ms in prof)
for name, ms in sorted(prof, key=lambda p: -p[1])[:15]:
    print(f"{ms:8.2f} ms  {name}")
print(f"total {tot:.1f} ms over {len(prof)} kernels")
