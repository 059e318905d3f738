"""Fuzz every file reader: mutated valid files only ever end in an AnygradError (issue 12).

Readers: .pt (zip archive, its data.pkl, legacy), safetensors, .npz (the archive and the .npy inside
it), ONNX, training checkpoints, config JSON, token files (.npy, .bin) and the wgpu plan cache (which
must ignore any altered file, never fail). Each is fuzzed in a subprocess under RLIMIT_AS
(2 GiB: a reader that tries to allocate far beyond its file fails, and the test with it) and a time
limit, so that a crash, a hang or a memory blow-up fails one test instead of killing the run.
Hypothesis runs derandomized (the same examples every run) with a bounded number of examples.

The seed files are written here (torch is needed for .pt files); the worker half of this file
(`python tests/test_fuzz_readers.py READER SEED_DIR`) imports anygrad only.
"""
from __future__ import annotations

import io
import json
import os
import sys
import zipfile
from pathlib import Path

import pytest

ADDRESS_SPACE = 2 << 30
TIME_LIMIT_S = 120  # per reader, far above what the examples take (a few seconds)
EXAMPLES = {"pt_zip": 60, "pt_pickle": 120, "pt_legacy": 100, "safetensors": 80, "npz": 60, "npy": 80,
            "onnx": 60, "checkpoint": 50, "config": 80, "tokens_npy": 80, "tokens_bin": 30, "plan_cache": 40}


# ---- mutations (used by the worker) --------------------------------------------------------------
def mutations():
    from hypothesis import strategies as st
    where = st.floats(0, 1, exclude_max=True)
    edit = st.one_of(
        st.tuples(st.just("truncate"), where),
        st.tuples(st.just("flip"), where, st.integers(0, 255)),
        st.tuples(st.just("int"), where, st.sampled_from([b"\xff\xff\xff\x7f", b"\x00\x00\x00\x00", b"\xff" * 8,
                                                          b"\x00\x00\x00\x80", b"\x01\x00\x00\x00"])),
        st.tuples(st.just("insert"), where, st.binary(min_size=1, max_size=16)),
        st.tuples(st.just("delete"), where, st.integers(1, 64)),
        st.tuples(st.just("repeat"), where, st.integers(1, 64), st.integers(2, 64)),
    )
    return st.lists(edit, min_size=1, max_size=4)


def mutate(data: bytes, edits) -> bytes:
    buf = bytearray(data)
    for kind, where, *arg in edits:
        at = int(where * len(buf)) if buf else 0
        if kind == "truncate":
            del buf[at:]
        elif kind == "flip" and buf:
            buf[at] = arg[0]
        elif kind == "int":
            buf[at:at + len(arg[0])] = arg[0]
        elif kind == "insert":
            buf[at:at] = arg[0]
        elif kind == "delete":
            del buf[at:at + arg[0]]
        elif kind == "repeat":
            buf[at:at] = bytes(buf[at:at + arg[0]]) * arg[1]
    return bytes(buf)


def rezip(src: bytes, replace: dict[str, bytes]) -> bytes:
    """The zip archive `src` with some members' bytes replaced (CRCs stay right), as stored."""
    out = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(src)) as zin, zipfile.ZipFile(out, "w") as zout:
        for info in zin.infolist():
            zout.writestr(info, replace.get(info.filename, zin.read(info)))
    return out.getvalue()


# ---- the worker: one reader, under limits --------------------------------------------------------
def _readers(seed_dir: Path):
    """reader -> (seed bytes, how to make the fuzzed file's bytes, the reads to try on it)."""
    from anygrad import torchfile
    from anygrad.backends.wgpu.device import pipeline_cache
    from anygrad.cli.config import _file_settings
    from anygrad.data.npz import read_npz
    from anygrad.data.tokens import read_tokens, token_split
    from anygrad.frontends import load_onnx, summarize
    from anygrad.train import checkpoint

    def seed(name: str) -> bytes:
        return (seed_dir / name).read_bytes()

    zipped = seed("zip.pt")
    pkl = next(n for n in zipfile.ZipFile(io.BytesIO(zipped)).namelist() if n.endswith("/data.pkl"))
    npz = seed("arrays.npz")
    ckpt_meta = json.loads(seed("ckpt-1.json"))

    def in_member(archive: bytes, member: str):
        return lambda edits: rezip(archive, {member: mutate(zipfile.ZipFile(io.BytesIO(archive)).read(member), edits)})

    def whole(data: bytes):
        return lambda edits: mutate(data, edits)

    def checkpoint_pair(edits, path: Path) -> None:
        """Mutate the arrays (recording their new sha256, so the .npz is parsed) or the record."""
        import hashlib
        if edits[0][0] in ("flip", "int"):
            arrays = mutate(seed("ckpt-1.npz"), edits)
            (path.parent / "ckpt-1.npz").write_bytes(arrays)
            path.write_text(json.dumps({**ckpt_meta, "sha256": hashlib.sha256(arrays).hexdigest()}))
        else:
            (path.parent / "ckpt-1.npz").write_bytes(seed("ckpt-1.npz"))
            path.write_bytes(mutate(seed("ckpt-1.json"), edits))

    def token_windows(path: Path) -> None:
        train, _, _ = token_split(path, block_size=4, valid_fraction=0.25)
        for _ in zip(range(2), train.bind(2, seed=0).batches(epoch=0)):
            pass

    plan_seed = seed("wgpu-plans/k.plan")

    def cached_plan(path: Path) -> None:
        """An altered plan file is a miss (None), never an error."""
        os.environ[pipeline_cache.CACHE_ENV] = str(path.parent.parent)
        os.environ[pipeline_cache.SWITCH_ENV] = "1"
        payload = pipeline_cache.load(path.stem, _plan_source())
        assert payload is None or path.read_bytes() == plan_seed

    pt_reads = [torchfile.load_raw, torchfile.load]
    return {
        "pt_zip": ("fuzzed.pt", whole(zipped), pt_reads),
        "pt_pickle": ("fuzzed.pt", in_member(zipped, pkl), pt_reads),
        "pt_legacy": ("fuzzed.pt", whole(seed("legacy.pt")), pt_reads),
        "safetensors": ("fuzzed.safetensors", whole(seed("w.safetensors")), [torchfile.load_safetensors]),
        "npz": ("fuzzed.npz", whole(npz), [torchfile.read_npz_arrays, read_npz]),
        "npy": ("fuzzed.npz", in_member(npz, "x.npy"), [torchfile.read_npz_arrays, read_npz]),
        "onnx": ("fuzzed.onnx", whole(seed("mlp.onnx")), [summarize, load_onnx]),
        "checkpoint": ("ckpt-1.json", checkpoint_pair, [checkpoint.read]),
        "config": ("config.json", whole(seed("config.json")), [_file_settings]),
        "tokens_npy": ("fuzzed.npy", whole(seed("tokens.npy")), [read_tokens, token_windows]),
        "tokens_bin": ("fuzzed.bin", whole(seed("tokens.bin")), [read_tokens, token_windows]),
        "plan_cache": ("wgpu-plans/k.plan", whole(plan_seed), [cached_plan]),
    }


def _plan_source():
    """The graph a seed plan was saved for (a payload of one graph and a plan-like object)."""
    import numpy as np

    from anygrad.ir.graph import Graph
    g = Graph()
    g.initializers["w"] = np.arange(6, dtype=np.float32)
    return g


def work(reader: str, seed_dir: Path, out_dir: Path) -> None:
    import warnings

    from hypothesis import Phase, given, settings

    from anygrad.errors import AnygradError
    name, make, reads = _readers(seed_dir)[reader]
    path = out_dir / name
    path.parent.mkdir(parents=True, exist_ok=True)
    warnings.simplefilter("ignore")  # (load_onnx warns about odd but loadable files)

    @settings(max_examples=EXAMPLES[reader], derandomize=True, deadline=None, database=None,
              phases=[Phase.explicit, Phase.generate])  # no shrinking: the limits stay predictable
    @given(edits=mutations())
    def fuzz(edits) -> None:
        if reader == "checkpoint":
            make(edits, path)
        else:
            path.write_bytes(make(edits))
        for read in reads:
            try:
                read(path)
            except AnygradError as e:
                # a reader that ran out of memory converts the MemoryError: bounded it was not
                assert "MemoryError" not in str(e), f"{read.__name__}: {e}"

    fuzz()


def _limit() -> None:
    import resource
    resource.setrlimit(resource.RLIMIT_AS, (ADDRESS_SPACE, ADDRESS_SPACE))


# ---- the tests: seed files, then one worker per reader -------------------------------------------
def _write_seeds(d: Path) -> None:
    from collections import OrderedDict

    import numpy as np
    import onnx
    import torch
    from onnx import TensorProto as T
    from onnx import helper as h

    from anygrad.torchfile import save_safetensors
    from anygrad.train import checkpoint

    torch.manual_seed(0)
    a = torch.arange(8.0)
    sd = OrderedDict(w=torch.randn(3, 2), b=a[2:6], t=torch.randn(2, 3).t(), n=torch.tensor(3),
                     h=torch.randn(2).bfloat16(), m=torch.tensor([True, False]))
    obj = {"model": sd, "epoch": 2, "opt": {"state": {0: {"step": 1}}, "betas": (0.9, 0.99)}, "tags": {"a", "b"}}
    torch.save(obj, d / "zip.pt")
    torch.save(obj, d / "legacy.pt", _use_new_zipfile_serialization=False)
    save_safetensors({"w": np.arange(6, dtype=np.float32).reshape(2, 3), "i": np.arange(3)}, d / "w.safetensors")
    np.savez_compressed(d / "arrays.npz", x=np.arange(24, dtype=np.float32).reshape(6, 4), y=np.arange(6))
    w1 = h.make_tensor("w1", T.FLOAT, [4, 3], np.linspace(-1, 1, 12).tolist())
    b1 = h.make_tensor("b1", T.FLOAT, [3], [0.1, 0.2, 0.3])
    g = h.make_graph([h.make_node("Gemm", ["x", "w1", "b1"], ["hid"]), h.make_node("Relu", ["hid"], ["r"]),
                      h.make_node("Softmax", ["r"], ["y"], axis=1)], "mlp",
                     [h.make_tensor_value_info("x", T.FLOAT, ["batch", 4])],
                     [h.make_tensor_value_info("y", T.FLOAT, ["batch", 3])], [w1, b1])
    model = h.make_model(g, opset_imports=[h.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, d / "mlp.onnx")
    checkpoint.write(d, "ckpt-1", {"w1": np.ones((4, 3), np.float32), "anygrad.lr": np.array(0.1, np.float32)},
                     {"epoch": 1, "step": 3, "config": {"epochs": 2}})
    np.save(d / "tokens.npy", (np.arange(64) * 7 % 50).astype(np.int32))
    (np.arange(64) * 7 % 50).astype(np.uint16).tofile(d / "tokens.bin")
    _write_plan_seed(d)
    (d / "config.json").write_text(json.dumps({"epochs": 2, "batch_size": 8, "lr": 0.05, "optimizer": "adam",
                                               "dataset": "mnist", "seed": 1, "valid_fraction": 0.1}))


def _write_plan_seed(d: Path) -> None:
    from anygrad.backends.wgpu.device import pipeline_cache
    old = {k: os.environ.get(k) for k in (pipeline_cache.CACHE_ENV, pipeline_cache.SWITCH_ENV)}
    os.environ[pipeline_cache.CACHE_ENV], os.environ[pipeline_cache.SWITCH_ENV] = str(d), "1"
    try:
        source = _plan_source()
        pipeline_cache.save("k", source, (source, {"kernels": ["main"], "sizes": [6]}))
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    assert (d / "wgpu-plans" / "k.plan").is_file()


def _seed_dir(tmp_path_factory) -> Path:
    d = tmp_path_factory.getbasetemp() / "fuzz_seeds"
    if not d.exists():
        d.mkdir()
        _write_seeds(d)
    return d


def _run(reader: str, seed_dir: Path, out_dir: Path):
    import subprocess
    src = str(Path(__file__).resolve().parents[1] / "src")
    env = {**os.environ, "PYTHONPATH": src, "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1",
           "MKL_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, __file__, reader, str(seed_dir), str(out_dir)], capture_output=True,
                          text=True, timeout=TIME_LIMIT_S, env=env, preexec_fn=_limit, check=False)


@pytest.mark.skipif(sys.platform == "win32", reason="RLIMIT_AS is POSIX")
@pytest.mark.parametrize("reader", list(EXAMPLES))
def test_fuzzed_files_give_only_anygrad_errors(reader, tmp_path_factory, tmp_path):
    done = _run(reader, _seed_dir(tmp_path_factory), tmp_path)
    assert done.returncode == 0, f"{reader}: exit {done.returncode}\n{done.stdout[-3000:]}\n{done.stderr[-5000:]}"


def test_the_seed_files_are_read(tmp_path_factory):
    """Unmutated, every seed file reads: the fuzzing starts from files the readers accept."""
    from anygrad import torchfile
    from anygrad.cli.config import _file_settings
    from anygrad.frontends import summarize
    from anygrad.train import checkpoint
    d = _seed_dir(tmp_path_factory)
    for name in ("zip.pt", "legacy.pt"):
        assert sorted(torchfile.load(d / name)) == ["b", "h", "m", "n", "t", "w"]
    assert sorted(torchfile.load_safetensors(d / "w.safetensors")) == ["i", "w"]
    assert sorted(torchfile.read_npz_arrays(d / "arrays.npz")) == ["x", "y"]
    assert summarize(d / "mlp.onnx").op_histogram == {"Gemm": 1, "Relu": 1, "Softmax": 1}
    assert checkpoint.read(d / "ckpt-1.json").meta["epoch"] == 1
    assert _file_settings(d / "config.json")["epochs"] == 2
    import numpy as np

    from anygrad.data.tokens import read_tokens
    for name in ("tokens.npy", "tokens.bin"):
        assert read_tokens(d / name).tolist() == (np.arange(64) * 7 % 50).tolist()
    from anygrad.backends.wgpu.device import pipeline_cache
    os.environ[pipeline_cache.CACHE_ENV], os.environ[pipeline_cache.SWITCH_ENV] = str(d), "1"
    try:
        payload = pipeline_cache.load("k", _plan_source())
    finally:
        os.environ.pop(pipeline_cache.CACHE_ENV)
        os.environ[pipeline_cache.SWITCH_ENV] = "0"
    assert payload is not None and payload[1]["sizes"] == [6]


if __name__ == "__main__":
    work(sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3]))
