"""anygrad.data: IDX parsing, MNIST from a folder / cache / local HTTP mirrors, the DataLoader."""
from __future__ import annotations

import functools
import gzip
import hashlib
import http.server
import socket
import threading
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import anygrad.data.mnist as mnist_mod
from anygrad.data import DataLoader, load_mnist, normalize, permutation, read_idx, write_idx
from anygrad.errors import DataError

SUBSET = Path(__file__).resolve().parents[1].parent / "shared/datasets/mnist-subset"


# -- IDX ---------------------------------------------------------------------------------------
@settings(max_examples=25, deadline=None)
@given(dtype=st.sampled_from(["uint8", "int8", "int16", "int32", "float32", "float64"]),
       shape=st.lists(st.integers(0, 5), min_size=1, max_size=4), gz=st.booleans())
def test_idx_roundtrip(tmp_path_factory, dtype, shape, gz):
    rng = np.random.default_rng(0)
    a = (rng.standard_normal(shape) * 50).astype(dtype)
    path = write_idx(tmp_path_factory.mktemp("idx") / ("a.idx.gz" if gz else "a.idx"), a)
    assert path.read_bytes()[:2] == (b"\x1f\x8b" if gz else b"\x00\x00")
    b = read_idx(path)
    assert b.dtype == a.dtype and b.shape == a.shape
    np.testing.assert_array_equal(a, b)


def test_idx_header_is_big_endian(tmp_path):
    path = write_idx(tmp_path / "x", np.array([1, 258], np.int32), compress=False)
    assert path.read_bytes() == bytes([0, 0, 0x0C, 1, 0, 0, 0, 2, 0, 0, 0, 1, 0, 0, 1, 2])


@pytest.mark.parametrize("content, words", [
    (b"", ["not an IDX file"]),
    (b"\x12\x34\x08\x01\x00\x00\x00\x01\x00", ["not an IDX file"]),
    (bytes([0, 0, 0x42, 1, 0, 0, 0, 1, 7]), ["unknown IDX element type"]),
    (bytes([0, 0, 8, 3, 0, 0, 0, 2]), ["header truncated"]),
    (bytes([0, 0, 8, 1, 0, 0, 0, 5, 1, 2, 3]), ["header says 5", "holds 3", "truncated"]),
    (bytes([0, 0, 8, 1, 0, 0, 0, 2, 1, 2, 3]), ["header says 2", "holds 3"]),
    (b"\x1f\x8b\x08garbage", ["not a valid gzip file"]),
])
def test_bad_idx_names_the_file(tmp_path, content, words):
    path = tmp_path / "broken-idx3-ubyte"
    path.write_bytes(content)
    with pytest.raises(DataError) as e:
        read_idx(path)
    assert str(path) in str(e.value)
    for w in words:
        assert w in str(e.value)


def test_truncated_gzip_names_the_file(tmp_path):
    path = write_idx(tmp_path / "t.gz", np.zeros((10, 28, 28), np.uint8))
    path.write_bytes(path.read_bytes()[:-20])
    with pytest.raises(DataError, match="t.gz"):
        read_idx(path)


def test_missing_file(tmp_path):
    with pytest.raises(DataError, match="nope"):
        read_idx(tmp_path / "nope")


# -- MNIST from a folder ----------------------------------------------------------------------
@pytest.mark.skipif(not SUBSET.is_dir(), reason="shared MNIST subset not checked out next to the repo")
def test_real_subset():
    d = load_mnist(SUBSET)
    assert d.x_train.shape == (6000, 28, 28) and d.x_train.dtype == np.uint8
    assert d.y_train.shape == (6000,) and d.y_train.dtype == np.int64
    assert d.x_test.shape == (10000, 28, 28) and d.y_test.shape == (10000,)
    assert set(np.unique(d.y_test)) == set(range(10))
    x, y = d.test()
    assert x.shape == (10000, 1, 28, 28) and x.dtype == np.float32 and y is d.y_test
    ref = (d.x_test.astype(np.float64) / 255 - 0.1307) / 0.3081
    np.testing.assert_allclose(x[:, 0], ref, rtol=1e-6, atol=1e-6)
    # the first training image of MNIST is a 5 (the subset keeps the file order)
    assert d.y_train[0] == 5


def _fake_mnist(n_train=12, n_test=7, seed=0):
    rng = np.random.default_rng(seed)
    return {"x_train": rng.integers(0, 256, (n_train, 28, 28), dtype=np.uint8),
            "y_train": rng.integers(0, 10, n_train).astype(np.uint8),
            "x_test": rng.integers(0, 256, (n_test, 28, 28), dtype=np.uint8),
            "y_test": rng.integers(0, 10, n_test).astype(np.uint8)}


def _write_fake(folder: Path, arrays, gz=True) -> dict[str, str]:
    """Write the four files; return role -> md5 of what was written."""
    folder.mkdir(parents=True, exist_ok=True)
    md5 = {}
    for role, a in arrays.items():
        name = mnist_mod.MNIST_FILES[role].name + (".gz" if gz else "")
        path = write_idx(folder / name, a, compress=gz)
        md5[role] = hashlib.md5(path.read_bytes()).hexdigest()
    return md5


@pytest.mark.parametrize("gz", [True, False])
def test_data_dir_reads_raw_and_gz(tmp_path, gz):
    arrays = _fake_mnist()
    _write_fake(tmp_path, arrays, gz=gz)
    d = load_mnist(tmp_path)
    np.testing.assert_array_equal(d.x_train, arrays["x_train"])
    np.testing.assert_array_equal(d.y_test, arrays["y_test"].astype(np.int64))


def test_data_dir_missing_files_lists_them(tmp_path):
    _write_fake(tmp_path, {"x_train": _fake_mnist()["x_train"]})
    with pytest.raises(DataError) as e:
        load_mnist(tmp_path)
    msg = str(e.value)
    assert str(tmp_path) in msg and "--data-dir" in msg
    for name in ("train-labels-idx1-ubyte", "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"):
        assert name in msg
    assert "train-images-idx3-ubyte" not in msg


def test_data_dir_mismatched_counts(tmp_path):
    arrays = _fake_mnist()
    arrays["y_train"] = arrays["y_train"][:-1]
    _write_fake(tmp_path, arrays)
    with pytest.raises(DataError, match="train-labels"):
        load_mnist(tmp_path)


def test_normalize_shape_and_values():
    x = np.array([[[0, 255]]], np.uint8)
    out = normalize(x)
    assert out.shape == (1, 1, 1, 2) and out.dtype == np.float32
    np.testing.assert_allclose(out.ravel(), [-0.1307 / 0.3081, (1 - 0.1307) / 0.3081], rtol=1e-6)


# -- downloading from local mirrors -----------------------------------------------------------
class _Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


@pytest.fixture
def serve():
    """serve(folder) -> base URL of an HTTP server on 127.0.0.1 serving that folder."""
    servers = []

    def start(folder: Path) -> str:
        handler = functools.partial(_Quiet, directory=str(folder))
        server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
        servers.append(server)
        return f"http://127.0.0.1:{server.server_address[1]}/"

    yield start
    for s in servers:
        s.shutdown()
        s.server_close()


def _closed_port_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}/"


@pytest.fixture
def fake_files(tmp_path, monkeypatch):
    """Four fake .gz files in a mirror folder, with MNIST_FILES' md5s pointed at them."""
    arrays = _fake_mnist()
    md5 = _write_fake(tmp_path / "good", arrays)
    table = {role: mnist_mod.MnistFile(f.name, md5[role]) for role, f in mnist_mod.MNIST_FILES.items()}
    monkeypatch.setattr(mnist_mod, "MNIST_FILES", table)
    return arrays


def test_download_into_cache_then_reuse(tmp_path, serve, fake_files):
    cache = tmp_path / "cache"
    d = load_mnist(cache_dir=cache, mirrors=[_closed_port_url(), serve(tmp_path / "good")])
    np.testing.assert_array_equal(d.x_train, fake_files["x_train"])
    np.testing.assert_array_equal(d.y_test, fake_files["y_test"])
    assert sorted(p.name for p in cache.iterdir()) == sorted(
        f"{f.name}.gz" for f in mnist_mod.MNIST_FILES.values())
    # second time: straight from the cache, no mirror reachable
    d2 = load_mnist(cache_dir=cache, mirrors=[_closed_port_url()])
    np.testing.assert_array_equal(d2.x_test, fake_files["x_test"])


def test_checksum_mismatch_falls_back_to_next_mirror(tmp_path, serve, fake_files):
    _write_fake(tmp_path / "bad", _fake_mnist(seed=1))  # same names, other content
    cache = tmp_path / "cache"
    d = load_mnist(cache_dir=cache, mirrors=[serve(tmp_path / "bad"), serve(tmp_path / "good")])
    np.testing.assert_array_equal(d.x_train, fake_files["x_train"])


def test_checksum_mismatch_everywhere_is_an_error(tmp_path, serve, fake_files):
    _write_fake(tmp_path / "bad", _fake_mnist(seed=1))
    cache = tmp_path / "cache"
    with pytest.raises(DataError) as e:
        load_mnist(cache_dir=cache, mirrors=[serve(tmp_path / "bad")])
    assert "checksum mismatch" in str(e.value)
    assert list(cache.iterdir()) == []  # nothing half-written or unverified left behind


def test_download_only_what_is_missing(tmp_path, serve, fake_files):
    cache = tmp_path / "cache"
    # a user-placed file in the cache is used as is (no checksum: anygrad did not download it)
    own = _fake_mnist(n_train=3, seed=5)["x_train"]
    _write_fake(cache, {"x_train": own, "y_train": np.zeros(3, np.uint8)})
    d = load_mnist(cache_dir=cache, mirrors=[serve(tmp_path / "good")])
    np.testing.assert_array_equal(d.x_train, own)
    np.testing.assert_array_equal(d.x_test, fake_files["x_test"])


def test_offline_error_says_what_to_put_where(tmp_path):
    cache = tmp_path / "cache"
    with pytest.raises(DataError) as e:
        load_mnist(cache_dir=cache, mirrors=[_closed_port_url()])
    msg = str(e.value)
    assert "could not download" in msg and str(cache) in msg and "--data-dir" in msg
    for f in mnist_mod.MNIST_FILES.values():
        assert f"{f.name}.gz" in msg


def test_no_download_when_disabled(tmp_path):
    with pytest.raises(DataError, match="downloading is off"):
        load_mnist(cache_dir=tmp_path, download=False)


def test_cache_dir_from_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("ANYGRAD_CACHE", str(tmp_path))
    assert mnist_mod.default_cache_dir() == tmp_path / "mnist"
    monkeypatch.setenv("ANYGRAD_MNIST_MIRRORS", "http://a/ , http://b/")
    assert mnist_mod.default_mirrors() == ["http://a/", "http://b/"]


def test_gzip_stream_of_served_file_is_valid(tmp_path):
    # the fake files are real gzip IDX files (guards the helpers the download tests rely on)
    _write_fake(tmp_path, _fake_mnist())
    raw = gzip.decompress((tmp_path / "t10k-labels-idx1-ubyte.gz").read_bytes())
    assert raw[:4] == bytes([0, 0, 8, 1])


# -- DataLoader ---------------------------------------------------------------------------------
@settings(max_examples=30, deadline=None)
@given(n=st.integers(1, 50), batch=st.integers(1, 20), drop_last=st.booleans(), seed=st.integers(0, 2**32 - 1))
def test_loader_covers_each_sample_once(n, batch, drop_last, seed):
    x = np.arange(n) * 10
    y = np.arange(n)
    loader = DataLoader(x, y, batch, seed=seed, drop_last=drop_last)
    batches = list(loader)
    assert len(batches) == len(loader)
    sizes = [len(b[1]) for b in batches]
    assert all(s == batch for s in sizes[:-1])
    seen = np.concatenate([b[1] for b in batches]) if batches else np.array([], int)
    for bx, by in batches:
        np.testing.assert_array_equal(bx, by * 10)  # x and y stay paired
    if drop_last:
        assert len(seen) == (n // batch) * batch and (not sizes or sizes[-1] == batch)
    else:
        assert sorted(seen) == list(range(n))
    assert len(set(seen.tolist())) == len(seen)


def test_loader_shuffle_is_seeded_per_epoch():
    x = np.arange(100)
    a, b = DataLoader(x, x, 100, seed=3), DataLoader(x, x, 100, seed=3)
    e0a, e1a = next(iter(a))[0], next(iter(a))[0]
    e0b = next(iter(b))[0]
    np.testing.assert_array_equal(e0a, e0b)
    assert not np.array_equal(e0a, e1a)
    assert not np.array_equal(e0a, next(iter(DataLoader(x, x, 100, seed=4)))[0])
    np.testing.assert_array_equal(permutation(100, 3, 1), e1a)
    assert a.epoch == 2


def test_loader_without_shuffle_keeps_order():
    x = np.arange(7)
    assert [b[0].tolist() for b in DataLoader(x, x, 3, shuffle=False)] == [[0, 1, 2], [3, 4, 5], [6]]


def test_loader_rejects_bad_arguments():
    with pytest.raises(DataError):
        DataLoader(np.zeros(3), np.zeros(4), 2)
    with pytest.raises(DataError):
        DataLoader(np.zeros(3), np.zeros(3), 0)
