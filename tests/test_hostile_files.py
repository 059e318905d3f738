"""Hostile and special files given to every reader: a clean AnygradError, bounded time and memory,
never a crash (issue 12, "Files and input", items 1-5). Each case was a crash, a hang, a traceback or
gigabytes of memory before; the failures that would kill or hang the test process (a segfault, a
blocking FIFO) run in a subprocess with a time limit."""
from __future__ import annotations

import io
import os
import pickle
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch

from anygrad.errors import DataError, ModelError
from anygrad.torchfile import load, load_raw, read_npz_arrays

SRC = str(Path(__file__).resolve().parents[1] / "src")
LEGACY_MAGIC = 0x1950A86A20F9469CFC6C


def pt_zip(path: Path, pkl: bytes, storages: dict[str, bytes] | None = None) -> Path:
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("a/data.pkl", pkl)
        for key, data in (storages or {}).items():
            z.writestr(f"a/data/{key}", data)
    return path


def legacy_header(*, first: bytes | None = None) -> bytes:
    return ((first or pickle.dumps(LEGACY_MAGIC, 2)) + pickle.dumps(1001, 2)
            + pickle.dumps({"little_endian": True, "type_sizes": {}, "protocol_version": 1001}, 2))


def run_isolated(code: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": SRC}
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=timeout, env=env, check=False)


# ---- 1. nesting: hashing a tuple nested a million deep overflowed the C stack (exit 139) ----------
NESTED_KEY = b"\x80\x02})" + b"\x85" * 10**6 + b"K\x01s."  # {((((...),),),): 1}


def test_deeply_nested_dict_key_is_refused_not_a_segfault(tmp_path):
    pt_zip(tmp_path / "seg.pt", NESTED_KEY)
    (tmp_path / "legacy.pt").write_bytes(legacy_header() + NESTED_KEY)
    (tmp_path / "header.pt").write_bytes(legacy_header(first=NESTED_KEY))
    frozen = b"\x80\x04()" + b"\x85" * 10**5 + b"\x91."  # frozenset({deep tuple})
    pt_zip(tmp_path / "frozen.pt", frozen)
    done = run_isolated(f"""
        from anygrad.torchfile import load
        from anygrad.errors import ModelError
        for name in ("seg.pt", "legacy.pt", "header.pt", "frozen.pt"):
            try:
                load({str(tmp_path)!r} + "/" + name)
            except ModelError as e:
                print(e)
        """)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.splitlines()
    assert len(lines) == 4 and all("nested more than 200 levels" in line for line in lines), done.stdout
    assert lines[0].startswith(str(tmp_path / "seg.pt"))


def test_nesting_is_bounded_for_lists_and_dicts_too(tmp_path):
    deep_list = b"\x80\x02" + b"]" * 1000 + b"a" * 999 + b"."
    with pytest.raises(ModelError, match="nested more than 200"):
        load_raw(pt_zip(tmp_path / "l.pt", deep_list))
    # a real checkpoint nests far less than the bound
    nested: dict = {"w": torch.ones(2)}
    for _ in range(50):
        nested = {"n": nested, "t": (1, (2, (3,)))}
    torch.save(nested, tmp_path / "ok.pt")
    assert isinstance(load_raw(tmp_path / "ok.pt"), dict)


def test_shared_tuples_and_huge_ints_as_keys_exceed_the_hashing_budget(tmp_path):
    # t = (); 100 times t = (t, t) through the memo: 2**100 elements to hash, in 300 bytes
    dag = b"\x80\x02})" + b"q\x00h\x00\x86" * 100 + b"K\x01s."
    with pytest.raises(ModelError, match="take too long to hash"):
        load_raw(pt_zip(tmp_path / "dag.pt", dag))
    # one 1 MB int used as a key 100k times: ints do not cache their hash
    big = (1 << (8 << 20)) - 1
    body = pickle.dumps(big, 2)[2:-1]  # its LONG4 opcode
    ints = b"\x80\x02}(" + body + b"q\x00K\x00" + b"h\x00K\x00" * 100_000 + b"u."
    with pytest.raises(ModelError, match="take too long to hash"):
        load_raw(pt_zip(tmp_path / "int.pt", ints))


# ---- 5b. a dict of 50k colliding int keys took 62 s -------------------------------------------
def _int_dict_pickle(keys) -> bytes:
    items = b"".join(pickle.dumps(k, 2)[2:-1] + b"K\x00" for k in keys)
    return b"\x80\x02}(" + items + b"u."


def test_hash_collision_dict_is_refused(tmp_path):
    colliding = [i * (2**61 - 1) for i in range(1, 50_001)]  # hash(i * (2**61 - 1)) == 0 for all
    assert len({hash(k) for k in colliding[:100]}) == 1
    with pytest.raises(ModelError, match="keys with one hash value"):
        load_raw(pt_zip(tmp_path / "collide.pt", _int_dict_pickle(colliding)))
    # the same for a set, an OrderedDict and a text-protocol memo
    members = b"".join(pickle.dumps(k, 2)[2:-1] for k in colliding[:1000])
    with pytest.raises(ModelError, match="keys with one hash value"):
        load_raw(pt_zip(tmp_path / "set.pt", b"\x80\x04\x8f(" + members + b"\x90."))
    with pytest.raises(ModelError, match="keys with one hash value"):
        load_raw(pt_zip(tmp_path / "fs.pt", b"\x80\x04(" + members + b"\x91."))
    pairs = b"".join(pickle.dumps(k, 2)[2:-1] + b"K\x00\x86" for k in colliding[:1000])
    od = b"\x80\x02ccollections\nOrderedDict\n(" + pairs + b"l\x85R."
    with pytest.raises(ModelError, match="keys with one hash value"):
        load_raw(pt_zip(tmp_path / "od.pt", od))
    with pytest.raises(ModelError, match="memo index"):
        load_raw(pt_zip(tmp_path / "memo.pt", b"(N" + f"p{2**61 - 1}\n".encode() + b"l."))
    # 50k distinct int keys (an optimizer's per-parameter state) load
    got = load_raw(pt_zip(tmp_path / "ints.pt", _int_dict_pickle(range(50_000))))
    assert len(got) == 50_000 and got[49_999] == 0


# ---- 2. memory amplification ---------------------------------------------------------------------
def test_stride0_tensors_are_capped_by_the_files_storages(tmp_path):
    one = torch.zeros(1)
    sd = {f"t{i}": one.expand((1 << 24) + i) for i in range(12)}  # 12 x 64 MiB from one 4-byte storage
    torch.save(sd, tmp_path / "s0.pt")
    assert (tmp_path / "s0.pt").stat().st_size < 4096
    with pytest.raises(ModelError, match=r"s0\.pt: the tensors would take more than 64 MiB once copied"):
        load(tmp_path / "s0.pt")


def test_overlapping_views_share_their_storage_or_are_capped(tmp_path):
    base = torch.arange(1 << 20, dtype=torch.float32)  # 4 MiB
    contiguous = {f"v{i}": base[i * 100:i * 100 + (1 << 19)] for i in range(400)}
    torch.save(contiguous, tmp_path / "c.pt")
    got = load(tmp_path / "c.pt")
    assert all(np.shares_memory(got["v0"], got[k]) for k in got)  # 400 views, one 4 MiB buffer
    np.testing.assert_array_equal(got["v399"], contiguous["v399"].numpy())
    strided = {f"v{i}": base[i:].as_strided((1000, 1000), (1, 1000)) for i in range(400)}
    torch.save(strided, tmp_path / "s.pt")
    with pytest.raises(ModelError, match=r"s\.pt: the tensors would take more than 80 MiB"):
        load(tmp_path / "s.pt")
    few = {f"v{i}": strided[f"v{i}"] for i in range(3)}  # copies within the budget are made
    torch.save(few, tmp_path / "few.pt")
    got = load(tmp_path / "few.pt")
    np.testing.assert_array_equal(got["v2"], few["v2"].numpy())
    assert got["v2"].flags.c_contiguous and not np.shares_memory(got["v1"], got["v2"])


# ---- 3. .npz: deflate bombs and every corrupt archive -------------------------------------------
def npz_bomb(path: Path, nbytes: int = 384 << 20) -> Path:
    """An .npz whose float32 array 'x' is `nbytes` of zeros, deflated to about nbytes / 1000."""
    header = io.BytesIO()
    np.lib.format.write_array_header_1_0(header, {"descr": "<f4", "fortran_order": False,
                                                  "shape": (nbytes // 4,)})
    chunk = bytes(16 << 20)
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
        z.writestr("y.npy", _npy(np.zeros(2, np.int64)))
        with z.open("x.npy", "w") as member:
            member.write(header.getvalue())
            for _ in range(nbytes // len(chunk)):
                member.write(chunk)
    return path


def _npy(a: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, a)
    return buf.getvalue()


def npz_readers(path: Path):
    """Every way an .npz reaches anygrad: a dataset, load_state_dict / --weights, eval / predict."""
    from anygrad.data.npz import read_npz
    from anygrad.frontends.torch_weights import read_state_dict
    from anygrad.inference import resolve_model
    return [("dataset", DataError, lambda: read_npz(path)), ("weights", ModelError, lambda: read_state_dict(path)),
            ("predict", ModelError, lambda: resolve_model(path))]


def test_npz_deflate_bomb_is_refused_before_inflating(tmp_path):
    bomb = npz_bomb(tmp_path / "bomb.npz")
    assert bomb.stat().st_size < 1 << 20
    for what, error, read in npz_readers(bomb):
        with pytest.raises(error, match=r"bomb\.npz: its arrays would take more than 256 MiB once decompressed"):
            read()
    # a genuine compressed file (far below the bound) reads; so does a large limit asked for
    x = np.arange(1000, dtype=np.float32).reshape(10, 100)
    np.savez_compressed(tmp_path / "ok.npz", x=x, y=np.arange(10))
    np.testing.assert_array_equal(read_npz_arrays(tmp_path / "ok.npz")["x"], x)
    assert read_npz_arrays(tmp_path / "ok.npz")["x"].flags.writeable


def _corrupt_npz_files(tmp_path: Path) -> dict[str, Path]:
    good = tmp_path / "good.npz"
    np.savez_compressed(good, x=np.arange(1000, dtype=np.float32), y=np.arange(1000))
    data = good.read_bytes()
    files: dict[str, bytes] = {"empty": b"", "text": b"hello", "truncated": data[: len(data) // 2]}
    with zipfile.ZipFile(good) as z:
        info = z.getinfo("x.npy")
        start = info.header_offset + 30 + len(info.filename)
    flipped = bytearray(data)
    flipped[start + 20:start + 40] = b"\xff" * 20  # inside the deflate stream: zlib.error or a CRC error
    files["zlib"] = bytes(flipped)
    stored = io.BytesIO()
    with zipfile.ZipFile(stored, "w") as z:
        bad_header = _npy(np.zeros(4, np.float32)).replace(b"(4,)", b"(9,)")  # claims more than it holds
        z.writestr("x.npy", bad_header)
        z.writestr("y.npy", _npy(np.zeros(4)))
    files["short_array"] = stored.getvalue()
    huge = io.BytesIO()
    with zipfile.ZipFile(huge, "w") as z:
        z.writestr("x.npy", _npy(np.zeros(1, np.float32)).replace(b"(1,)", b"(1000000000000,)"))
    files["huge_shape"] = huge.getvalue()  # was a MemoryError
    obj = io.BytesIO()
    np.savez(obj, x=np.array([{"a": 1}], dtype=object), y=np.zeros(1))
    files["objects"] = obj.getvalue()
    out = {}
    for name, content in files.items():
        (tmp_path / f"{name}.npz").write_bytes(content)
        out[name] = tmp_path / f"{name}.npz"
    return out


def test_corrupt_npz_is_an_anygrad_error_naming_the_file(tmp_path):
    for name, path in _corrupt_npz_files(tmp_path).items():
        for what, error, read in npz_readers(path):
            with pytest.raises(error) as e:
                read()
            assert str(path) in str(e.value), (name, what, str(e.value))


# ---- 5a. special files never block and never read forever ----------------------------------------
@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs on this OS")
def test_fifo_and_devices_are_refused_without_blocking(tmp_path):
    fifo = tmp_path / "model.pt"
    os.mkfifo(fifo)
    for suffix in (".npz", ".onnx", ".safetensors", ".json"):
        os.mkfifo(tmp_path / f"pipe{suffix}")
    done = run_isolated(f"""
        from pathlib import Path
        from anygrad import torchfile
        from anygrad.data.npz import read_npz
        from anygrad.errors import AnygradError
        from anygrad.frontends.onnx_import import load_onnx
        from anygrad.frontends.torch_weights import read_state_dict
        from anygrad.inference import resolve_model
        d = Path({str(tmp_path)!r})
        cases = [(torchfile.load, d / "model.pt"), (torchfile.load_raw, d / "model.pt"),
                 (torchfile.load, "/dev/zero"), (torchfile.load_raw, "/dev/zero"),
                 (torchfile.load_safetensors, d / "pipe.safetensors"), (torchfile.load, d / "pipe.safetensors"),
                 (torchfile.read_npz_arrays, d / "pipe.npz"), (torchfile.read_npz_arrays, "/dev/zero"),
                 (read_npz, d / "pipe.npz"), (read_state_dict, d / "pipe.npz"), (read_state_dict, "/dev/zero"),
                 (load_onnx, d / "pipe.onnx"), (load_onnx, "/dev/zero"), (resolve_model, d / "pipe.json"),
                 (resolve_model, d / "pipe.npz")]
        for read, path in cases:
            try:
                read(path)
            except AnygradError as e:
                print(e)
        """, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.splitlines()
    assert len(lines) == 15, done.stdout
    assert sum("is a FIFO (named pipe), not a regular file" in line for line in lines) == 10, done.stdout
    assert sum("/dev/zero is a character device, not a regular file" in line for line in lines) == 5, done.stdout
