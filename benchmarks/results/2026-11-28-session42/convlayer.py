"""One ResNet stage transition (Conv 3x3 stride 2 + BN + ReLU, then a 3x3 conv) at batch B, f32 vs f16:
per-kernel GPU time of the conv gradient kernels, with ANYGRAD env variations given on the command line."""
import sys

import numpy as np
import torch
import torch.nn as tnn

import anygrad
from anygrad.optim import SGD

B = int(sys.argv[1]) if len(sys.argv) > 1 else 512
torch.manual_seed(0)
net = tnn.Sequential(tnn.Conv2d(64, 64, 3, 1, 1, bias=False), tnn.BatchNorm2d(64), tnn.ReLU(),
                     tnn.Conv2d(64, 128, 3, 2, 1, bias=False), tnn.BatchNorm2d(128), tnn.ReLU(),
                     tnn.Conv2d(128, 128, 3, 1, 1, bias=False), tnn.BatchNorm2d(128), tnn.ReLU(),
                     tnn.AdaptiveAvgPool2d(1), tnn.Flatten(), tnn.Linear(128, 10))
x = np.random.default_rng(0).standard_normal((B, 64, 16, 16)).astype(np.float32)
y = np.random.default_rng(1).integers(0, 10, B).astype(np.int64)
for prec in sys.argv[2].split(","):
    model = anygrad.from_torch(net, torch.from_numpy(x[:2]), check=False)
    model.compile(loss="cross_entropy", optimizer=SGD(lr=0.01, momentum=0.9), device="wgpu", precision=prec)
    model.train_on_batch(x, y)
    inputs0, targets0 = model._batch(x, y)
    exe = model._train_program(inputs0, targets0, flush=False)
    prof = exe.step_profile({**inputs0, **targets0}, repeat=5)
    print(f"{prec}: step {prof.step_ns / 1e3:.1f} us")
    for name, ns in sorted(prof.kernels, key=lambda k: -k[1])[:12]:
        print(f"   {ns / 1e3:8.1f} us  {name}")
