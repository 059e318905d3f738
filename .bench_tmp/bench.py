import time, sys, numpy as np
import anygrad
from anygrad.examples import FOUNDING_MODEL
from anygrad.optim import SGD
dev = sys.argv[1] if len(sys.argv) > 1 else "wgpu"
batch = int(sys.argv[2]) if len(sys.argv) > 2 else 64
m = anygrad.load_onnx(str(FOUNDING_MODEL))
m.compile(loss="nll", optimizer=SGD(lr=0.01, momentum=0.9), device=dev, seed=1)
rng = np.random.default_rng(0)
x = rng.standard_normal((batch, 1, 28, 28)).astype(np.float32); y = rng.integers(0, 10, batch).astype(np.int64)
t = time.time(); m.train_on_batch(x, y); print("first (compile)", time.time() - t)
t = time.time(); n = 10
for _ in range(n): m.train_step(x, y)
m.read_metrics()
print(dev, batch, f"{(time.time()-t)/n*1000:.1f} ms/step", m.backend.description)
