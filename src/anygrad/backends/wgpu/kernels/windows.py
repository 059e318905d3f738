"""What the windowed kernels share: a sliding window over (B, C, H, W) input (`Geo`, from the
node's resolved attributes), the input position under an output at a tap, and the shell of a
kernel that runs once per element (the depthwise conv and the pools).

Window geometry is `anygrad.ops.nn.Window.of` over the node's resolved attributes (explicit pads,
strides, dilations, ceil_mode: ir/passes.resolve_attributes), the layout the numpy reference uses.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from ....errors import UnsupportedOpError
from ....ir.graph import Node
from ....ops.nn import Window
from .gemm_spec import fold_grid, linear_id, u
from .kernel import AdapterCaps, Kernel


@dataclass(frozen=True)
class Geo:
    """A sliding window over (B, C, H, W) input, 1-D ops lifted to H = 1."""

    B: int
    C: int
    H: int
    W: int
    kh: int
    kw: int
    sh: int
    sw: int
    dh: int
    dw: int
    ph: int        # begin pads
    pw: int
    eh: int        # end pads (count_include_pad counts them)
    ew: int
    OH: int
    OW: int

    @property
    def P(self) -> int:
        return self.OH * self.OW

    @property
    def HW(self) -> int:
        return self.H * self.W

    @property
    def taps(self) -> int:
        return self.kh * self.kw

    @property
    def pointwise(self) -> bool:
        """1x1, stride 1, no padding: the conv is a plain matmul over pixels."""
        return (self.taps == 1 and self.sh == self.sw == 1 and not (self.ph or self.pw or self.eh or self.ew))


def geometry(node: Node, x_shape: tuple[int, ...]) -> Geo:
    """The layout of a windowed node (resolved attributes) over an input of `x_shape`."""
    nd = len(x_shape) - 2
    if nd not in (1, 2):
        raise UnsupportedOpError(f"{node.label}: the wgpu backend runs 1-D and 2-D {node.op} only "
                                 f"(input {tuple(x_shape)}); use the numpy backend for {nd}-D")
    w = Window.of(node, x_shape[2:])

    def two(t):
        return (1,) + tuple(t) if nd == 1 else tuple(t)

    (H, W), (kh, kw), (sh, sw), (dh, dw) = two(w.spatial), two(w.kernel), two(w.strides), two(w.dilations)
    (ph, pw), (eh, ew), (OH, OW) = (two(w.begin) if nd == 2 else (0,) + w.begin,
                                    two(w.end) if nd == 2 else (0,) + w.end, two(w.out))
    return Geo(x_shape[0], x_shape[1], H, W, kh, kw, sh, sw, dh, dw, ph, pw, eh, ew, OH, OW)


def gather_forward(g: Geo) -> tuple[str, str]:
    """(prelude, valid) giving input coordinates yy, xx of output (oy, ox) at tap (ky, kx)."""
    pre = (f"let yy = i32(oy * {u(g.sh)} + ky * {u(g.dh)}) - {g.ph}; "
           f"let xx = i32(ox * {u(g.sw)} + kx * {u(g.dw)}) - {g.pw};")
    valid = f"yy >= 0 && yy < {g.H} && xx >= 0 && xx < {g.W}"
    return pre, valid


# -- one-invocation-per-element kernels (depthwise conv, pools) -----------------------------------
def flat_kernel(name: str, reads: list[str], read_vars: list[str], write: str, write_var: str, total: int,
                body: str, caps: AdapterCaps, wg: int = 64, ty: str = "f32") -> Kernel:
    """A shader running `body` once per flat index i < total (grid folded within the adapter limit);
    every buffer holds elements of WGSL type `ty`."""
    grid = fold_grid(max(1, math.ceil(total / wg)), caps)
    decls = [f"@group(0) @binding({i}) var<storage, read> {v}: array<{ty}>;" for i, v in enumerate(read_vars)]
    decls.append(f"@group(0) @binding({len(reads)}) var<storage, read_write> {write_var}: array<{ty}>;")
    wgsl = "\n".join(decls + [
        f"@compute @workgroup_size({wg}, 1, 1)",
        "fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) li: u32) {",
        f"  let i = ({linear_id(grid)}) * {u(wg)} + li;",
        f"  if (i >= {u(total)}) {{ return; }}",
        body, "}"]) + "\n"
    return Kernel(name, wgsl, grid, tuple(reads), (write,))
