"""anygrad.torchfile: PyTorch checkpoints read without torch (and safely), safetensors I/O.

torch is the reference: files are written by torch.save and every array is compared to the tensor it
came from, bit for bit."""
from __future__ import annotations

import io
import os
import pickle
import subprocess
import sys
import zipfile
from collections import OrderedDict
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import anygrad
from anygrad.errors import AnygradError, ModelError
from anygrad.examples import FOUNDING_MODEL
from anygrad.torchfile import find_state_dict, load, load_raw, load_safetensors, save_safetensors

FORMATS = {"zip": True, "legacy": False}


def save(obj, path: Path, fmt: str) -> Path:
    torch.save(obj, path, _use_new_zipfile_serialization=FORMATS[fmt])
    return path


def as_numpy(t: torch.Tensor) -> np.ndarray:
    t = t.detach()
    return (t.float() if t.dtype == torch.bfloat16 else t).numpy()


def assert_same(got: np.ndarray, want: torch.Tensor) -> None:
    ref = as_numpy(want)
    assert got.dtype == ref.dtype, (got.dtype, ref.dtype)
    assert got.shape == ref.shape
    assert got.flags.c_contiguous
    np.testing.assert_array_equal(got, ref)


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(1, 4, 3)
        self.bn = torch.nn.BatchNorm2d(4)
        self.fc = torch.nn.Linear(4 * 4 * 4, 3)

    def forward(self, x):
        return self.fc(torch.relu(self.bn(self.conv(x))).flatten(1))


def trained_net(dtype: torch.dtype) -> tuple[Net, torch.optim.Optimizer]:
    torch.manual_seed(0)
    net = Net()
    opt = torch.optim.Adam(net.parameters())
    for _ in range(2):  # moves BatchNorm running stats and num_batches_tracked, fills Adam state
        opt.zero_grad()
        net(torch.randn(2, 1, 6, 6)).sum().backward()
        opt.step()
    return net.to(dtype), opt


WRAPPERS = {
    "bare": lambda sd, opt: sd,
    "model": lambda sd, opt: {"model": sd, "optimizer": opt.state_dict(), "epoch": 3},
    "state_dict": lambda sd, opt: {"epoch": 1, "state_dict": sd},
    "model_state_dict": lambda sd, opt: {"model_state_dict": sd, "optimizer_state_dict": opt.state_dict()},
}


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("wrapper", WRAPPERS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_model_state_dict(tmp_path, fmt, wrapper, dtype):
    net, opt = trained_net(dtype)
    sd = net.state_dict()
    path = save(WRAPPERS[wrapper](sd, opt), tmp_path / "ckpt.pt", fmt)
    got = load(path)
    assert list(got) == list(sd)
    for name, t in sd.items():
        assert_same(got[name], t)
    assert got["bn.num_batches_tracked"].dtype == np.int64 and got["bn.num_batches_tracked"] == 2


@pytest.mark.parametrize("fmt", FORMATS)
def test_dtypes(tmp_path, fmt):
    torch.manual_seed(1)
    sd = {
        "f32": torch.randn(3, 2), "f16": torch.randn(5).half(), "bf16": torch.randn(2, 3).bfloat16(),
        "f64": torch.randn(4).double(), "i64": torch.randint(-2**40, 2**40, (3,)),
        "i32": torch.randint(-2**30, 2**30, (3,), dtype=torch.int32),
        "i16": torch.randint(-2**14, 2**14, (3,), dtype=torch.int16),
        "i8": torch.randint(-128, 127, (4,), dtype=torch.int8), "u8": torch.arange(250, 256, dtype=torch.uint8),
        "bool": torch.tensor([True, False, True]), "c64": torch.randn(2, dtype=torch.complex64),
        "scalar": torch.tensor(7.5), "empty": torch.zeros(0, 3),
    }
    got = load(save(sd, tmp_path / "d.pt", fmt))
    for name, t in sd.items():
        assert_same(got[name], t)


def test_dtypes_without_legacy_storage_class(tmp_path):
    # uint16 and float8 tensors pickle as _rebuild_tensor_v3 over an UntypedStorage (zip format only)
    bits = torch.arange(256, dtype=torch.uint8)
    sd = {"u16": torch.tensor([1, 65535], dtype=torch.uint16),
          "e4m3": bits.view(torch.float8_e4m3fn), "e5m2": bits.view(torch.float8_e5m2)}
    got = load(save(sd, tmp_path / "v3.pt", "zip"))
    np.testing.assert_array_equal(got["u16"], np.array([1, 65535], np.uint16))
    for name in ("e4m3", "e5m2"):
        np.testing.assert_array_equal(got[name], sd[name].float().numpy())  # NaN codes compare equal


@pytest.mark.parametrize("fmt", FORMATS)
def test_views_and_shared_storage(tmp_path, fmt):
    torch.manual_seed(2)
    a = torch.arange(10.0)
    base = torch.randn(4, 6)
    sd = {"a": a, "b": a[2:5], "t": torch.randn(3, 4).t(), "every2": a[1::2], "col": base[:, 3],
          "block": base[1:3, 2:5], "bcast": torch.randn(3, 1).expand(3, 4), "same": a, "tied": a.detach()}
    got = load(save(sd, tmp_path / "v.pt", fmt))
    for name, t in sd.items():
        assert_same(got[name], t)
    # one tensor under two names (tied weights: another tensor object, the same view) is one array
    assert got["tied"] is got["a"] and got["same"] is got["a"]
    # contiguous views share their storage's bytes, as torch's do (no copy); strided ones are copies
    assert np.shares_memory(got["b"], got["a"]) and got["a"].flags.writeable
    assert not np.shares_memory(got["every2"], got["a"])
    got["a"][3] = -1
    assert got["b"][1] == -1 and got["every2"][1] == 3.0


@pytest.mark.parametrize("fmt", FORMATS)
def test_parameters_and_tensor_attributes(tmp_path, fmt):
    p = torch.nn.Parameter(torch.randn(2, 3))
    tagged = torch.randn(4)
    tagged.note = "kept by torch, dropped here"  # pickles through _rebuild_from_type_v2
    got = load_raw(save({"p": p, "tagged": tagged, "size": torch.Size([2, 3]), "dev": torch.device("cpu")},
                        tmp_path / "p.pt", fmt))
    assert_same(got["p"], p)
    assert_same(got["tagged"], tagged)
    assert got["size"] == (2, 3) and got["dev"] == "cpu"


@pytest.mark.parametrize("fmt", FORMATS)
def test_load_raw_whole_checkpoint(tmp_path, fmt):
    net, opt = trained_net(torch.float32)
    ckpt = {"model": net.state_dict(), "optimizer": opt.state_dict(), "epoch": 7, "name": "net",
            "history": [0.5, 0.25], "best": np.float64(0.125), "np": np.arange(6, dtype=np.int32).reshape(2, 3),
            "flags": {1, 2}, "blob": b"\x00\xff", "pair": (1, None)}
    got = load_raw(save(ckpt, tmp_path / "c.pt", fmt))
    assert isinstance(got["model"], OrderedDict)
    assert (got["epoch"], got["name"], got["history"], got["flags"], got["blob"], got["pair"]) == \
        (7, "net", [0.5, 0.25], {1, 2}, b"\x00\xff", (1, None))
    assert got["best"] == 0.125 and got["best"].dtype == np.float64
    np.testing.assert_array_equal(got["np"], ckpt["np"])
    ref_state = opt.state_dict()
    assert got["optimizer"]["param_groups"][0]["betas"] == ref_state["param_groups"][0]["betas"]
    for i, state in ref_state["state"].items():
        for k, t in state.items():
            assert_same(got["optimizer"]["state"][i][k], t)


def test_numpy_arrays_in_pickle_protocol_5(tmp_path):
    """Protocol 5 pickles arrays as numpy._core.numeric._frombuffer(bytes, dtype, shape, order)."""
    arrays = {"f8": np.arange(6.0).reshape(2, 3), "fortran": np.asfortranarray(np.arange(6, dtype=np.int32).reshape(2, 3)),
              "big": np.arange(3, dtype=">f4"), "bool": np.array([True, False]), "empty": np.zeros((0, 3), np.float16)}
    path = tmp_path / "p5.pt"
    torch.save({"model": {"w": torch.ones(2)}, "arrays": arrays}, path, pickle_protocol=5)
    with zipfile.ZipFile(path) as z:
        assert b"_frombuffer" in z.read(data_pkl(path))  # the test exercises what it means to
    got = load_raw(path)["arrays"]
    for k, want in arrays.items():
        assert got[k].dtype == want.dtype.newbyteorder("=") and got[k].dtype.isnative
        np.testing.assert_array_equal(got[k], want)
    np.testing.assert_array_equal(load(path)["w"], np.ones(2, np.float32))
    # its arguments are checked: a shape that does not fit the bytes, an order numpy does not know
    pkl = data_pkl(path)
    with zipfile.ZipFile(path) as z:
        stream = z.read(pkl)
    for old, new, what in [(b"K\x02K\x03\x86", b"K\x02K\x04\x86", "does not match"),
                           (b"\x8c\x01C\x94", b"\x8c\x01X\x94", "order")]:
        assert stream.count(old) >= 1
        bad = rezip(path, tmp_path / "bad5.pt", {pkl: stream.replace(old, new, 1)})
        with pytest.raises(ModelError, match=rf"bad5\.pt: .*{what}"):
            load_raw(bad)


def test_find_state_dict_and_key(tmp_path):
    sd = {"w": torch.ones(2)}
    path = save({"ema": {"w": torch.zeros(2)}, "model": sd, "step": 3}, tmp_path / "k.pt", "zip")
    np.testing.assert_array_equal(load(path)["w"], np.ones(2, np.float32))  # 'model' preferred over 'ema'
    np.testing.assert_array_equal(load(path, key="ema")["w"], np.zeros(2, np.float32))
    with pytest.raises(ModelError, match="k.pt.*'nope'"):
        load(path, key="nope")
    nested = save({"encoder": {"w": torch.ones(1)}, "decoder": {"b": torch.zeros(1)}}, tmp_path / "n.pt", "zip")
    assert sorted(load(nested)) == ["decoder.b", "encoder.w"]
    assert find_state_dict({"a": {"b": {"state_dict": {"x": np.ones(1)}}, "step": 1}})["x"] == 1
    with pytest.raises(ModelError, match="no state_dict found"):
        load(save([1, 2], tmp_path / "l.pt", "legacy"))


def nested_shared(depth: int) -> dict:
    """{'a': d, 'b': d} nested `depth` deep over one {'w': tensor}: pickle memoizes the shared dicts,
    so the file is tiny while its flattened names would number 2**depth."""
    d = {"w": torch.ones(1)}
    for _ in range(depth):
        d = {"a": d, "b": d}
    return d


def self_referencing() -> dict:
    d = {"w": torch.ones(2)}
    d["model"] = d  # found first (a STATE_DICT_KEYS entry), and it contains itself
    return d


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("shape", ["self", "inner cycle", "shared dag"])
def test_cyclic_and_shared_containers_end_in_a_model_error(tmp_path, fmt, shape):
    obj = {"self": lambda: self_referencing(), "inner cycle": lambda: {"epoch": 1, "opt": self_referencing()},
           "shared dag": lambda: nested_shared(24)}[shape]()
    path = save(obj, tmp_path / "odd.pt", fmt)
    assert path.stat().st_size < 4000
    with pytest.raises(ModelError, match=r"odd\.pt: no state_dict found"):
        load(path)
    with pytest.raises(ModelError, match=r"odd\.pt"):  # the same search behind Model.load_state_dict
        anygrad.load_onnx(FOUNDING_MODEL).load_state_dict(path)
    with pytest.raises(ModelError, match="no state_dict"):  # and for a dict handed over in Python
        anygrad.load_onnx(FOUNDING_MODEL).load_state_dict(obj)


def test_shared_state_dict_under_two_keys_is_still_found(tmp_path):
    sd = {"w": torch.arange(3.0)}
    path = save({"epoch": 2, "ema": {"weights": sd}, "last": {"weights": sd}}, tmp_path / "two.pt", "zip")
    np.testing.assert_array_equal(load(path)["w"], np.arange(3.0, dtype=np.float32))


def test_too_many_tensors_is_a_model_error(tmp_path, monkeypatch):
    import anygrad.torchfile as tf
    path = save({"enc": {f"w{i}": torch.ones(1) for i in range(3)}, "dec": {"b": torch.ones(1)}},
                tmp_path / "many.pt", "zip")
    assert sorted(load(path)) == ["dec.b", "enc.w0", "enc.w1", "enc.w2"]
    monkeypatch.setattr(tf, "MAX_TENSORS", 3)
    with pytest.raises(ModelError, match=r"many\.pt: .*more than 3 tensors"):
        load(path)


class StorageMarker:
    def __init__(self, pid):
        self.pid = pid


def legacy_file(path: Path, obj, storages: dict[str, np.ndarray], little_endian: bool = True) -> Path:
    """A legacy-format file written by hand, for what modern torch.save no longer writes."""
    out = io.BytesIO()
    for header in (0x1950A86A20F9469CFC6C, 1001, {"protocol_version": 1001, "little_endian": little_endian}):
        pickle.dump(header, out, protocol=2)
    pickler = pickle.Pickler(out, protocol=2)
    pickler.persistent_id = lambda o: o.pid if isinstance(o, StorageMarker) else None
    pickler.dump(obj)
    pickle.dump(list(storages), out, protocol=2)
    order = "<" if little_endian else ">"
    for data in storages.values():
        out.write(np.array([data.size], dtype=order + "i8").tobytes())
        out.write(data.astype(data.dtype.newbyteorder(order)).tobytes())
    path.write_bytes(out.getvalue())
    return path


@pytest.mark.parametrize("little_endian", [True, False])
def test_legacy_storage_views_and_byteorder(tmp_path, little_endian):
    from torch._utils import _rebuild_tensor, _rebuild_tensor_v2
    root = np.arange(12, dtype=np.float32) * 1.5
    view = StorageMarker(("storage", torch.FloatStorage, "k", "cpu", 12, ("v", 2, 6)))  # root[2:8]
    whole = StorageMarker(("storage", torch.FloatStorage, "k", "cpu", 12, None))
    obj = {"sq": Reduces(_rebuild_tensor_v2, view, 1, (2, 2), (2, 1), False, OrderedDict()),
           "all": Reduces(_rebuild_tensor, whole, 0, (3, 4), (1, 3))}
    got = load(legacy_file(tmp_path / "views.pt", obj, {"k": root}, little_endian))
    np.testing.assert_array_equal(got["sq"], root[3:7].reshape(2, 2))
    np.testing.assert_array_equal(got["all"], root.reshape(4, 3).T)
    assert got["all"].flags.c_contiguous


BAD_VIEWS = {  # (storage id, offset, size, stride) -> expected message
    "past the end": ((("storage", torch.FloatStorage, "k", "cpu", 4), 2, (3,), (1,)), "reads element 4"),
    "negative stride": ((("storage", torch.FloatStorage, "k", "cpu", 4), 0, (2,), (-1,)), "negative"),
    "huge broadcast": ((("storage", torch.FloatStorage, "k", "cpu", 4), 0, (1 << 20, 1 << 20), (0, 0)),
                       "expands storage"),
    "float size": ((("storage", torch.FloatStorage, "k", "cpu", 4), 0, (2.0,), (1,)), "tuple of ints"),
    "bad storage id": ((("storage", "FloatStorage", "k", "cpu", 4), 0, (2,), (1,)), "malformed storage id"),
    "short storage id": ((("storage", torch.FloatStorage), 0, (2,), (1,)), "malformed storage id"),
    "unknown key": ((("storage", torch.FloatStorage, "zz", "cpu", 4), 0, (2,), (1,)), "no tensor uses"),
    "module id": ((("module", "Linear", "", ""), 0, (2,), (1,)), "whole pickled nn.Module"),
    "module class": ((("module", torch.nn.Linear, "", ""), 0, (2,), (1,)), "refused global 'torch.nn.modules"),
}


@pytest.mark.parametrize("case", BAD_VIEWS)
def test_bad_tensor_views_are_refused(tmp_path, case):
    from torch._utils import _rebuild_tensor
    (pid, offset, size, stride), message = BAD_VIEWS[case]
    obj = {"x": Reduces(_rebuild_tensor, StorageMarker(pid), offset, size, stride)}
    path = legacy_file(tmp_path / "bad.pt", obj, {"k": np.zeros(4, np.float32)})
    with pytest.raises(ModelError, match=f"bad.pt: .*{message}"):
        load(path)


# ---- safety --------------------------------------------------------------------------------------
class Reduces:
    """Pickles as a call of `func(*args)`: what a malicious checkpoint does."""

    def __init__(self, func, *args):
        self.func, self.args = func, args

    def __reduce__(self):
        return self.func, self.args


def payloads(marker: Path) -> dict[str, object]:
    cmd = f"touch {marker}"
    code = f"open({str(marker)!r}, 'w').close()"
    return {
        "os.system": Reduces(os.system, cmd),
        "eval": Reduces(eval, code),
        "exec": Reduces(exec, code),
        "subprocess": Reduces(subprocess.Popen, ["touch", str(marker)]),
        "getattr": Reduces(getattr, Reduces(__import__, "os"), "system"),
        "subprocess.call": Reduces(subprocess.call, ["touch", str(marker)]),
    }


BUILTINS = r"(builtins|__builtin__)"  # protocol 2 writes python-2 module names
REFUSED = {"os.system": r"'(posix|os)\.system'", "eval": rf"'{BUILTINS}\.eval'", "exec": rf"'{BUILTINS}\.exec'",
           "subprocess": r"'(commands|subprocess)\.Popen'", "getattr": rf"'{BUILTINS}\.(getattr|__import__)'",
           "subprocess.call": r"'(commands|subprocess)\.call'"}


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("attack", REFUSED)
def test_malicious_pickle_is_refused(tmp_path, fmt, attack):
    marker = tmp_path / "pwned"
    path = save({"w": torch.ones(2), "x": payloads(marker)[attack]}, tmp_path / "evil.pt", fmt)
    with pytest.raises(ModelError, match=rf"evil\.pt: refused global {REFUSED[attack]}"):
        load(path)
    with pytest.raises(ModelError):
        load_raw(path)
    assert not marker.exists()


def test_malicious_payload_is_live(tmp_path):
    # the test above has teeth: python's own pickle runs the very same bytes
    marker = tmp_path / "pwned"
    pickle.loads(pickle.dumps(payloads(marker)["os.system"], protocol=2))
    assert marker.exists()


def rezip(src: Path, dst: Path, replace: dict[str, bytes]) -> Path:
    """Copy a zip-format checkpoint, swapping the contents of some entries (CRCs stay valid)."""
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w", zipfile.ZIP_STORED) as zout:
        for info in zin.infolist():
            zout.writestr(info.filename, replace.get(info.filename, zin.read(info)))
    return dst


def valid_zip(tmp: Path) -> Path:
    torch.manual_seed(3)
    a = torch.arange(6.0)
    return save({"a": a, "b": a[1:4], "w": torch.randn(2, 3).t(), "n": torch.tensor(5)}, tmp / "ok.pt", "zip")


def handmade(marker: Path) -> dict[str, tuple[bytes, str]]:
    """Raw pickle streams that name a forbidden global in each way pickle allows."""
    cmd = f"touch {marker}".encode()
    return {
        "GLOBAL": (b"cos\nsystem\n(S'" + cmd + b"'\ntR.", "os.system"),
        "STACK_GLOBAL": (b"\x80\x04\x8c\x02os\x8c\x06system\x93\x8c" + bytes([len(cmd)]) + cmd + b"\x85R.",
                         "os.system"),
        "INST": (b"(S'" + cmd + b"'\nios\nsystem\n.", "os.system"),
        "OBJ": (b"(cos\nsystem\nS'" + cmd + b"'\no.", "os.system"),
        "NEWOBJ": (b"\x80\x02c__builtin__\nobject\n)\x81.", "__builtin__.object"),
        "reconstructor": (b"ccopy_reg\n_reconstructor\n(cos\nsystem\n.", "copy_reg._reconstructor"),
        "torch.load": (b"\x80\x02ctorch\nload\nX\x01\x00\x00\x00x\x85R.", "torch.load"),
    }


def data_pkl(path: Path) -> str:
    with zipfile.ZipFile(path) as z:
        return next(n for n in z.namelist() if n.endswith("/data.pkl"))


@pytest.mark.parametrize("case", ["GLOBAL", "STACK_GLOBAL", "INST", "OBJ", "NEWOBJ", "reconstructor", "torch.load"])
def test_handmade_malicious_pickles(tmp_path, case):
    marker = tmp_path / "pwned"
    stream, refused = handmade(marker)[case]
    good = valid_zip(tmp_path)
    evil = rezip(good, tmp_path / "evil.pt", {data_pkl(good): stream})
    with pytest.raises(ModelError, match=rf"evil\.pt: refused global '{refused}'"):
        load(evil)
    assert not marker.exists()
    if case in ("GLOBAL", "STACK_GLOBAL", "INST", "OBJ"):  # the streams are live: python's pickle runs them
        pickle.loads(stream)
        assert marker.exists()


def test_reduce_and_build_on_plain_values_are_refused(tmp_path):
    good = valid_zip(tmp_path)
    pkl = data_pkl(good)
    for stream, what in [(b"\x80\x02]X\x01\x00\x00\x00x\x85R.", "REDUCE"), (b"\x80\x02]}b.", "BUILD"),
                         (b"\x80\x02X\x03\x00\x00\x00abc\x8c\x01x\x85R.", "REDUCE"),
                         (b"\x80\x02ccollections\nOrderedDict\n)\x81.", "opcode"),  # NEWOBJ
                         (b"\x80\x02\x82\x01.", "opcode"),  # EXT1 (copyreg extension registry)
                         (b"\x80\x02ctorch._utils\n_rebuild_tensor_v2\n}b.", "BUILD"),
                         (b"\x80\x02X\x01\x00\x00\x00xQ.", "storage id")]:
        with pytest.raises(ModelError, match=what):
            load_raw(rezip(good, tmp_path / "x.pt", {pkl: stream}))


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_whole_module_and_torchscript_are_refused(tmp_path):
    net, _ = trained_net(torch.float32)
    with pytest.raises(ModelError, match=r"refused global '.*(Net|Conv2d|_load_from_bytes|_rebuild)"):
        load(save(net, tmp_path / "module.pt", "zip"))
    with pytest.raises(ModelError, match="refused global|nn.Module"):
        load(save(net, tmp_path / "module_legacy.pt", "legacy"))
    torch.jit.save(torch.jit.script(torch.nn.Linear(2, 2)), tmp_path / "ts.pt")
    with pytest.raises(ModelError, match="TorchScript"):
        load(tmp_path / "ts.pt")


def test_unreadable_files(tmp_path):
    with pytest.raises(ModelError, match="missing.pt: file not found"):
        load(tmp_path / "missing.pt")
    (tmp_path / "text.pt").write_text("hello world\n")
    with pytest.raises(ModelError, match="text.pt"):
        load(tmp_path / "text.pt")
    with pytest.raises(ModelError, match=r"text.pt: not a PyTorch checkpoint \(.pt/.pth written by torch.save\), "
                                         r"a .safetensors or an .npz file$"):
        load(tmp_path / "text.pt")
    (tmp_path / "model.bin").write_bytes(b"\x08\x07\x12\x07pytorch")  # how an ONNX ModelProto starts
    with pytest.raises(ModelError, match=r"model.bin: not a PyTorch checkpoint .* looks like an ONNX model"):
        load_raw(tmp_path / "model.bin")
    (tmp_path / "empty.pt").write_bytes(b"")
    with pytest.raises(ModelError, match="empty.pt"):
        load(tmp_path / "empty.pt")
    good = valid_zip(tmp_path)
    with zipfile.ZipFile(good) as z:
        names = z.namelist()
    storage = next(n for n in names if "/data/" in n)
    with zipfile.ZipFile(good) as zin, zipfile.ZipFile(tmp_path / "nostorage.pt", "w") as zout:
        for n in names:
            if n != storage:
                zout.writestr(n, zin.read(n))
    with pytest.raises(ModelError, match="nostorage.pt: storage file .* is missing"):
        load(tmp_path / "nostorage.pt")
    short = rezip(good, tmp_path / "short.pt", {storage: b"\x00" * 3})
    with pytest.raises(ModelError, match="short.pt: storage"):
        load(short)


def test_compressed_members_are_refused(tmp_path):
    """torch.save stores members uncompressed; a deflated storage can claim any size from a few
    bytes (here 64 MiB of zeros from ~65 KiB), so compressed members are refused before inflating."""
    n = 64 << 20
    pkl = (b"\x80\x02}X\x01\x00\x00\x00wctorch._utils\n_rebuild_tensor_v2\n((X\x07\x00\x00\x00storage"
           b"ctorch\nByteStorage\nX\x01\x00\x00\x000X\x03\x00\x00\x00cpuJ" + n.to_bytes(4, "little") +
           b"tQK\x00(K\x01t(K\x01t\x89ccollections\nOrderedDict\n)RtRs.")
    bomb = tmp_path / "bomb.pt"
    with zipfile.ZipFile(bomb, "w", zipfile.ZIP_STORED) as z:
        z.writestr("archive/data.pkl", pkl)
        z.writestr("archive/data/0", b"\0" * n, compress_type=zipfile.ZIP_DEFLATED)
    assert bomb.stat().st_size < n // 500
    with pytest.raises(ModelError, match=r"bomb\.pt: archive/data/0 is compressed.*torch\.save"):
        load(bomb)
    # the same archive stored is read (the refusal is about compression, not the content)
    stored = tmp_path / "stored.pt"
    with zipfile.ZipFile(stored, "w", zipfile.ZIP_STORED) as z:
        z.writestr("archive/data.pkl", pkl)
        z.writestr("archive/data/0", b"\1" * 4)
    with pytest.raises(ModelError, match="holds 4 bytes"):
        load(stored)
    # a re-zipped torch.save file (deflated data.pkl) is refused with the same advice
    good = valid_zip(tmp_path)
    with zipfile.ZipFile(good) as zin, zipfile.ZipFile(tmp_path / "rezipped.pt", "w", zipfile.ZIP_DEFLATED) as zout:
        for info in zin.infolist():
            zout.writestr(info.filename, zin.read(info))
    with pytest.raises(ModelError, match=r"rezipped\.pt: .* is compressed.*zip -0"):
        load(tmp_path / "rezipped.pt")


def test_big_endian_zip(tmp_path):
    good = valid_zip(tmp_path)
    want = load(good)
    replace = {}
    with zipfile.ZipFile(good) as z:
        top = z.namelist()[0].split("/")[0]
        replace[f"{top}/byteorder"] = b"big"
        # storages 0..: a (float32), w (float32), n (int64) in save order
        for n in z.namelist():
            if "/data/" in n and not n.endswith("serialization_id"):
                raw = z.read(n)
                item = 8 if len(raw) == 8 else 4
                replace[n] = np.frombuffer(raw, f"<u{item}").astype(f">u{item}").tobytes()
    got = load(rezip(good, tmp_path / "be.pt", replace))
    for k in want:
        np.testing.assert_array_equal(got[k], want[k])
        assert got[k].dtype.isnative


# ---- fuzz: corrupt files only ever give a ModelError ---------------------------------------------
@pytest.fixture(scope="module")
def fuzz_files(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fuzz")
    torch.manual_seed(4)
    a = torch.arange(8.0)
    sd = OrderedDict(w=torch.randn(3, 2), b=a[2:6], t=torch.randn(2, 3).t(), n=torch.tensor(3),
                     h=torch.randn(2).bfloat16(), m=torch.tensor([True, False]))
    out = {fmt: save({"model": sd, "epoch": 2, "opt": {"lr": 0.1, "betas": (0.9, 0.99)}},
                     tmp / f"{fmt}.pt", fmt).read_bytes() for fmt in FORMATS}
    with zipfile.ZipFile(io.BytesIO(out["zip"])) as z:
        pkl = next(n for n in z.namelist() if n.endswith("/data.pkl"))
        out["pickle"] = z.read(pkl)
    out["pkl_name"] = pkl
    out["zip_path"] = tmp / "zip.pt"
    out["dir"] = tmp
    return out


mutations = st.one_of(
    st.tuples(st.just("truncate"), st.floats(0, 1, exclude_max=True)),
    st.tuples(st.just("flip"), st.lists(st.tuples(st.floats(0, 1, exclude_max=True), st.integers(0, 255)),
                                        min_size=1, max_size=8)),
)


def mutate(data: bytes, mutation) -> bytes:
    kind, arg = mutation
    if kind == "truncate":
        return data[:int(arg * len(data))]
    buf = bytearray(data)
    for where, byte in arg:
        buf[int(where * len(buf))] = byte
    return bytes(buf)


def load_only_model_errors(path: Path) -> None:
    for read in (load_raw, load):  # load also searches the result for the state_dict
        try:
            read(path)
        except ModelError as e:
            assert path.name in str(e)


@pytest.mark.parametrize("target", ["zip", "legacy", "pickle"])
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(mutation=mutations)
def test_fuzz_corrupt_checkpoints(fuzz_files, target, mutation):
    path = fuzz_files["dir"] / f"fuzzed_{target}.pt"
    if target == "pickle":  # corrupt data.pkl inside an otherwise valid archive (zip CRCs stay right)
        rezip(fuzz_files["zip_path"], path, {fuzz_files["pkl_name"]: mutate(fuzz_files["pickle"], mutation)})
    else:
        path.write_bytes(mutate(fuzz_files[target], mutation))
    load_only_model_errors(path)


# ---- safetensors ---------------------------------------------------------------------------------
def test_safetensors_roundtrip(tmp_path):
    rng = np.random.default_rng(0)
    tensors = {"w": rng.standard_normal((3, 4)).astype(np.float32), "h": rng.standard_normal(5).astype(np.float16),
               "d": rng.standard_normal(2), "i": np.arange(-3, 3, dtype=np.int64), "m": np.array([True, False]),
               "u": np.arange(4, dtype=np.uint8), "strided": np.arange(12.0).reshape(3, 4).T}
    path = tmp_path / "w.safetensors"
    save_safetensors(tensors, path, metadata={"format": "np", "epoch": "3"})
    assert sorted(os.listdir(tmp_path)) == ["w.safetensors"]  # the temp file was renamed away
    (tmp_path / "renamed.pt").write_bytes(path.read_bytes())  # recognised by content too
    for got in (load_safetensors(path), load(path), load(tmp_path / "renamed.pt")):
        assert sorted(got) == sorted(tensors)
        for k, v in tensors.items():
            assert got[k].dtype == v.dtype
            np.testing.assert_array_equal(got[k], v)
    from safetensors import safe_open
    with safe_open(str(path), framework="numpy") as f:
        assert f.metadata() == {"format": "np", "epoch": "3"}
    # and torch reads what we wrote
    import safetensors.torch
    np.testing.assert_array_equal(safetensors.torch.load_file(str(path))["w"].numpy(), tensors["w"])


def test_safetensors_bfloat16_float8_from_torch(tmp_path):
    import safetensors.torch
    bits = torch.arange(256, dtype=torch.uint8)
    t = {"b": torch.randn(3, 2).bfloat16(), "f": torch.randn(2), "e4m3": bits.view(torch.float8_e4m3fn).clone(),
         "e5m2": bits.view(torch.float8_e5m2).reshape(16, 16)}
    safetensors.torch.save_file(t, str(tmp_path / "t.safetensors"))
    got = load_safetensors(tmp_path / "t.safetensors")
    assert_same(got["b"], t["b"])
    assert_same(got["f"], t["f"])
    for name in ("e4m3", "e5m2"):
        np.testing.assert_array_equal(got[name], t[name].float().numpy())


def test_safetensors_errors(tmp_path, monkeypatch):
    with pytest.raises(ModelError, match="missing.safetensors"):
        load_safetensors(tmp_path / "missing.safetensors")
    (tmp_path / "bad.safetensors").write_bytes(b"\xff" * 20)
    with pytest.raises(ModelError, match="bad.safetensors"):
        load_safetensors(tmp_path / "bad.safetensors")
    with pytest.raises(AnygradError, match="numpy arrays"):
        save_safetensors({"x": [1, 2]}, tmp_path / "x.safetensors")
    with pytest.raises(AnygradError, match="cannot write"):
        save_safetensors({"x": np.ones(2)}, tmp_path / "no_such_dir" / "x.safetensors")
    monkeypatch.setitem(sys.modules, "safetensors", None)
    monkeypatch.setitem(sys.modules, "safetensors.numpy", None)
    with pytest.raises(AnygradError, match="pip install safetensors"):
        load_safetensors(tmp_path / "x.safetensors")
    with pytest.raises(AnygradError, match="pip install safetensors"):
        save_safetensors({"x": np.ones(2)}, tmp_path / "x.safetensors")


def test_no_torch_import_in_torchfile():
    src = Path(__file__).resolve().parents[1] / "src/anygrad/torchfile"
    for f in src.glob("*.py"):
        text = f.read_text()
        assert "import torch" not in text and "from torch" not in text, f
