"""Datasets beyond MNIST (fashion-mnist, cifar-10, .npz, image folders), splits, batch transforms
and the prefetching loader. Downloads only ever go to a local HTTP server."""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import http.server
import io
import json
import pickle
import socket
import struct
import tarfile
import threading
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from anygrad.data import DataConfig, DataLoader, get_dataset, normalize_images, split, write_idx
from anygrad.data import datasets as ds_mod
from anygrad.data.cifar import CIFAR10, read_batch, read_cifar10
from anygrad.data.mnist import normalize as mnist_normalize
from anygrad.data.remote import RemoteSet
from anygrad.data.transforms import BatchTransform, augment
from anygrad.errors import AnygradError, ConfigError, DataError

SUBSET = Path(__file__).resolve().parents[1].parent / "shared/datasets/mnist-subset"
needs_subset = pytest.mark.skipif(not SUBSET.is_dir(), reason="shared MNIST subset not checked out next to the repo")


# -- a local mirror -------------------------------------------------------------------------------
@pytest.fixture
def mirror(tmp_path: Path):
    """An HTTP server over tmp_path/'www'; yields (folder, base URL)."""
    www = tmp_path / "www"
    www.mkdir()
    handler = functools.partial(_QuietHandler, directory=str(www))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield www, f"http://127.0.0.1:{server.server_address[1]}/"
    server.shutdown()
    server.server_close()


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):  # keep pytest output clean
        pass


def _closed_port_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}/"


def _md5(path: Path) -> str:
    return hashlib.md5(path.read_bytes()).hexdigest()


def _fake_fashion(www: Path, n_train: int = 30, n_test: int = 10) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(1)
    arrays = {"x_train": rng.integers(0, 256, (n_train, 28, 28), dtype=np.uint8),
              "y_train": rng.integers(0, 10, n_train).astype(np.uint8),
              "x_test": rng.integers(0, 256, (n_test, 28, 28), dtype=np.uint8),
              "y_test": rng.integers(0, 10, n_test).astype(np.uint8)}
    for role, file in ds_mod.FASHION_MNIST.files.items():
        write_idx(www / file.name, arrays[role])
    return arrays


def _with_md5s(spec: RemoteSet, www: Path) -> RemoteSet:
    """The same set with the md5s of our fake files (the official ones are kept in the real table)."""
    return dataclasses.replace(spec, files={r: dataclasses.replace(f, md5=_md5(www / f.name))
                                            for r, f in spec.files.items()})


def test_fashion_mnist_official_checksums_are_declared():
    assert {f.name: f.md5 for f in ds_mod.FASHION_MNIST.files.values()} == {
        "train-images-idx3-ubyte.gz": "8d4fb7e6c68d591d4c3dfef9ec88bf0d",
        "train-labels-idx1-ubyte.gz": "25c81989df183df01b3e8a0aad5dffbe",
        "t10k-images-idx3-ubyte.gz": "bef4ecab320f06d8554ea6380940ec79",
        "t10k-labels-idx1-ubyte.gz": "bb300cfdad3c16e7a12a480ee83cd310"}
    assert CIFAR10.files["archive"].md5 == "c58f30108f718f92721af3b95e74349a"


def test_fashion_mnist_downloads_into_the_cache(mirror, tmp_path, monkeypatch):
    www, url = mirror
    arrays = _fake_fashion(www)
    monkeypatch.setattr(ds_mod, "FASHION_MNIST", _with_md5s(ds_mod.FASHION_MNIST, www))
    cache = tmp_path / "cache"
    logs: list[str] = []
    d = get_dataset("fashion-mnist", cache_dir=cache, mirrors=[_closed_port_url(), url], log=logs.append)
    assert d.train[0].shape == (30, 1, 28, 28) and d.train[0].dtype == np.uint8
    np.testing.assert_array_equal(d.train[0][:, 0], arrays["x_train"])
    np.testing.assert_array_equal(d.valid[1], arrays["y_test"].astype(np.int64))
    assert d.classes[0] == "T-shirt/top" and d.mean == (0.2860,) and d.valid_from == "test split"
    assert sorted(p.name for p in cache.iterdir()) == sorted(f.name for f in ds_mod.FASHION_MNIST.files.values())
    assert len(logs) == 4
    # second time: from the cache, no server needed
    again = get_dataset("fashion_mnist", cache_dir=cache, download=False)
    np.testing.assert_array_equal(again.train[0], d.train[0])


def test_download_with_a_wrong_checksum_is_refused(mirror, tmp_path):
    www, url = mirror
    _fake_fashion(www)  # the real table's md5s do not match these fakes
    with pytest.raises(DataError, match="checksum mismatch") as e:
        get_dataset("fashion-mnist", cache_dir=tmp_path / "c", mirrors=[url])
    assert "train-images-idx3-ubyte.gz" in str(e.value)
    assert not any((tmp_path / "c").iterdir())  # no half or wrong file left behind


def test_offline_without_files_names_the_files_and_where_to_put_them(tmp_path):
    with pytest.raises(DataError) as e:
        get_dataset("fashion-mnist", cache_dir=tmp_path / "c", mirrors=[_closed_port_url()])
    msg = str(e.value)
    assert "offline?" in msg and str(tmp_path / "c") in msg and "--data-dir" in msg
    for f in ds_mod.FASHION_MNIST.files.values():
        assert f.name in msg
    with pytest.raises(DataError, match="downloading is off") as e:
        get_dataset("cifar-10", cache_dir=tmp_path / "c2", download=False)
    assert "cifar-10-python.tar.gz" in str(e.value)
    with pytest.raises(DataError, match="files missing"):
        get_dataset("fashion-mnist", data_dir=tmp_path)


def test_unknown_dataset():
    with pytest.raises(ConfigError, match="unknown dataset 'svhn'.*fashion-mnist"):
        get_dataset("svhn")


# -- CIFAR-10 without unpickling ------------------------------------------------------------------
class _Py2Pickler(pickle._Pickler):
    """Pickles bytes the way python 2 wrote str (BINSTRING), like the official CIFAR batches."""

    dispatch = pickle._Pickler.dispatch.copy()

    def _save_str2(self, obj: bytes) -> None:
        n = len(obj)
        self.write(pickle.SHORT_BINSTRING + bytes([n]) + obj if n < 256 else
                   pickle.BINSTRING + struct.pack("<i", n) + obj)
        self.memoize(obj)

    dispatch[bytes] = _save_str2


def _py2_batch(x: np.ndarray, y: np.ndarray) -> bytes:
    buf = io.BytesIO()
    _Py2Pickler(buf, protocol=2).dump({b"batch_label": b"training batch", b"labels": [int(v) for v in y],
                                       b"data": x.reshape(len(x), -1), b"filenames": [b"a.png"] * len(y)})
    return buf.getvalue()


def _cifar_tarball(path: Path, per_batch: int = 4) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(2)
    xs, ys = [], []
    with tarfile.open(path, "w:gz") as tar:
        for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
            x = rng.integers(0, 256, (per_batch, 3, 32, 32), dtype=np.uint8)
            y = rng.integers(0, 10, per_batch)
            data = _py2_batch(x, y)
            info = tarfile.TarInfo(f"cifar-10-batches-py/{name}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
            xs.append(x)
            ys.append(y)
    return np.concatenate(xs), np.concatenate(ys)


def test_cifar10_batches_read_like_pickle_would(tmp_path):
    x, y = _cifar_tarball(tmp_path / "cifar-10-python.tar.gz")
    (train_x, train_y), (test_x, test_y) = read_cifar10(tmp_path / "cifar-10-python.tar.gz")
    np.testing.assert_array_equal(train_x, x[:20])
    np.testing.assert_array_equal(test_y, y[20:])
    assert train_x.shape == (20, 3, 32, 32) and train_y.dtype == np.int64
    # the reference: python's own unpickler (trusted here, as we made the file)
    with tarfile.open(tmp_path / "cifar-10-python.tar.gz") as tar:
        ref = pickle.loads(tar.extractfile("cifar-10-batches-py/test_batch").read(), encoding="bytes")
    np.testing.assert_array_equal(test_x.reshape(len(test_x), -1), ref[b"data"])
    d = get_dataset("cifar10", data_dir=tmp_path)
    assert d.classes[0] == "airplane" and len(d.mean) == 3 and d.valid[0].shape == (4, 3, 32, 32)


def test_cifar_python3_pickles_also_read():
    x = np.arange(2 * 3072, dtype=np.int64).astype(np.uint8).reshape(2, 3, 32, 32)
    data = pickle.dumps({b"labels": [1, 2], b"data": x.reshape(2, -1)}, protocol=2)
    got_x, got_y = read_batch(data, "t")
    np.testing.assert_array_equal(got_x, x)
    assert got_y.tolist() == [1, 2]


class _Evil:
    def __reduce__(self):
        return (exec, ("raise SystemExit('pwned')",))


def test_cifar_batch_never_runs_code(tmp_path):
    with pytest.raises(DataError, match=r"refused global '(__builtin__|builtins)\.exec'"):
        read_batch(pickle.dumps({b"data": _Evil(), b"labels": []}, protocol=2), "evil")
    with pytest.raises(DataError, match="not a CIFAR-10 batch"):
        read_batch(b"\x80\x02}q\x00.", "empty")
    with pytest.raises(DataError, match="not a readable CIFAR-10 tarball"):
        (tmp_path / "bad.tar.gz").write_bytes(b"junk")
        read_cifar10(tmp_path / "bad.tar.gz")


# -- npz and image folders ------------------------------------------------------------------------
def test_npz_with_custom_keys_and_its_own_valid_split(tmp_path):
    rng = np.random.default_rng(3)
    x, y = rng.standard_normal((20, 5)).astype(np.float32), rng.integers(0, 3, 20)
    np.savez(tmp_path / "d.npz", feats=x, target=y, feats_valid=x[:4], target_valid=y[:4])
    d = get_dataset("npz", tmp_path / "d.npz", x_key="feats", y_key="target")
    np.testing.assert_array_equal(d.train[0], x)
    assert d.valid[0].shape == (4, 5) and d.mean is None and d.classes == ["0", "1", "2"]
    np.savez(tmp_path / "e.npz", x=x, y=y)
    e = get_dataset("npz", tmp_path / "e.npz", valid_fraction=0.25, seed=1)
    assert len(e.train[0]) == 15 and len(e.valid[0]) == 5
    with pytest.raises(DataError, match="no array 'images'.*holds x, y"):
        get_dataset("npz", tmp_path / "e.npz", x_key="images")
    np.savez(tmp_path / "p.npz", x=np.array([{"a": 1}], dtype=object), y=y[:1])
    with pytest.raises(DataError, match="not a readable .npz"):
        get_dataset("npz", tmp_path / "p.npz")


def test_image_folder(tmp_path):
    Image = pytest.importorskip("PIL.Image")
    rng = np.random.default_rng(4)
    for split_name, n in (("train", 3), ("valid", 2)):
        for cls in ("cat", "dog"):
            (tmp_path / split_name / cls).mkdir(parents=True)
            for i in range(n):
                Image.fromarray(rng.integers(0, 256, (8, 8, 3), dtype=np.uint8)).save(
                    tmp_path / split_name / cls / f"{i}.png")
    d = get_dataset("imagefolder", tmp_path)
    assert d.classes == ["cat", "dog"] and d.train[0].shape == (6, 3, 8, 8) and d.valid[0].shape == (4, 3, 8, 8)
    assert d.train[1].tolist() == [0, 0, 0, 1, 1, 1]
    first = np.asarray(Image.open(tmp_path / "train" / "cat" / "0.png")).transpose(2, 0, 1)
    np.testing.assert_array_equal(d.train[0][0], first)
    flat = get_dataset("imagefolder", tmp_path / "train")  # no valid/: 0.1 held out
    assert len(flat.train[0]) + len(flat.valid[0]) == 6 and flat.valid_from.startswith("0.1 of train")


# -- splits and transforms ------------------------------------------------------------------------
@settings(max_examples=20, deadline=None)
@given(n=st.integers(30, 200), fraction=st.floats(0.05, 0.5), seed=st.integers(0, 2**32 - 1))
def test_split_is_seeded_disjoint_and_complete(n, fraction, seed):
    x, y = np.arange(n), np.arange(n) * 10
    (tx, ty), (vx, _vy) = split((x, y), fraction, seed)
    assert len(vx) == round(n * fraction) and sorted(np.concatenate([tx, vx]).tolist()) == list(range(n))
    np.testing.assert_array_equal(ty, tx * 10)
    (_tx2, _), (vx2, _) = split((x, y), fraction, seed)
    np.testing.assert_array_equal(vx, vx2)


def test_normalisation_matches_mnist_and_per_channel_reference():
    rng = np.random.default_rng(5)
    grey = rng.integers(0, 256, (4, 28, 28), dtype=np.uint8)
    np.testing.assert_array_equal(normalize_images(grey[:, None], (0.1307,), (0.3081,)), mnist_normalize(grey))
    rgb = rng.integers(0, 256, (2, 3, 4, 4), dtype=np.uint8)
    mean, std = (0.5, 0.4, 0.3), (0.2, 0.25, 0.3)
    ref = (rgb / 255.0 - np.array(mean)[None, :, None, None]) / np.array(std)[None, :, None, None]
    np.testing.assert_allclose(normalize_images(rgb, mean, std), ref, rtol=1e-6, atol=1e-6)


def _reference_augment(img: np.ndarray, dy: int, dx: int, flip: bool, p: int) -> np.ndarray:
    padded = np.pad(img, ((0, 0), (p, p), (p, p)))
    out = padded[:, dy:dy + img.shape[1], dx:dx + img.shape[2]]
    return out[:, :, ::-1] if flip else out


def test_augment_is_a_crop_or_flip_decided_by_seed_epoch_and_index():
    rng = np.random.default_rng(6)
    x = rng.integers(1, 256, (16, 2, 6, 5), dtype=np.uint8)
    idx = np.arange(100, 116)
    a = augment(x, idx, epoch=3, seed=7, crop_padding=2, hflip=True)
    for i in range(len(x)):  # each output is one of the crops/flips of its input
        assert any(np.array_equal(a[i], _reference_augment(x[i], dy, dx, f, 2))
                   for dy in range(5) for dx in range(5) for f in (False, True))
    # the same sample index gets the same choice in any batch, in any position
    b = augment(x[[5, 2]], idx[[5, 2]], epoch=3, seed=7, crop_padding=2, hflip=True)
    np.testing.assert_array_equal(b, a[[5, 2]])
    assert not np.array_equal(augment(x, idx, 4, 7, 2, True), a)  # another epoch, other choices
    flips = augment(x, idx, 0, 1, 0, True)
    assert 0 < sum(np.array_equal(flips[i], x[i, :, :, ::-1]) for i in range(16)) < 16


@needs_subset
def test_data_config_round_trip_and_loader_transform():
    cfg = DataConfig(dataset="mnist", data_dir=str(SUBSET), crop_padding=2, hflip=False, prefetch=True)
    again = DataConfig.from_dict(json.loads(json.dumps(cfg.to_dict())))
    assert again == cfg
    with pytest.raises(ConfigError, match="unknown data setting"):
        DataConfig.from_dict({"dataset": "mnist", "bogus": 1})
    data = cfg.load(seed=0)
    loader = cfg.loader(data, 256, seed=3)
    x, _y = next(iter(loader))
    assert x.dtype == np.float32 and x.shape == (256, 1, 28, 28)
    valid = next(iter(cfg.loader(data, 8, train=False)))[0]
    np.testing.assert_array_equal(valid, mnist_normalize(data.valid[0][:8, 0]))  # no augmentation when validating


def test_prefetch_gives_the_same_batches_and_stops_cleanly():
    rng = np.random.default_rng(7)
    x, y = rng.integers(0, 256, (50, 1, 4, 4), dtype=np.uint8), np.arange(50)
    t = BatchTransform((0.5,), (0.25,), crop_padding=1, hflip=True, seed=9)
    plain = DataLoader(x, y, 8, seed=2, transform=t)
    pre = DataLoader(x, y, 8, seed=2, transform=t, prefetch=True)
    for _ in range(2):  # two epochs
        for (a, ay), (b, by) in zip(plain, pre, strict=True):
            np.testing.assert_array_equal(a, b)
            np.testing.assert_array_equal(ay, by)
    pre.epoch = 1  # resume at epoch 1: the same batches as a fresh loader's second epoch
    fresh = DataLoader(x, y, 8, seed=2, transform=t)
    list(fresh)  # epoch 0
    for (a, _), (b, _) in zip(pre, fresh, strict=True):
        np.testing.assert_array_equal(a, b)
    for _ in pre:  # break out early: the thread stops
        break

    def bad(xb, idx, epoch):
        raise DataError("broken transform")
    with pytest.raises(DataError, match="broken transform"):
        list(DataLoader(x, y, 8, transform=bad, prefetch=True))


@needs_subset
def test_get_dataset_mnist_matches_load_mnist():
    d = get_dataset("mnist", SUBSET)
    assert d.train[0].shape == (6000, 1, 28, 28) and d.valid[0].shape == (10000, 1, 28, 28)
    with pytest.raises(AnygradError):
        get_dataset("mnist", SUBSET, valid_fraction=1.5)
    held = get_dataset("mnist", SUBSET, valid_fraction=0.1, seed=4)
    assert len(held.train[0]) == 5400 and len(held.valid[0]) == 600


# -- normalisation inside the graph ---------------------------------------------------------------
def _conv_model(path: Path) -> Path:
    import onnx
    from onnx import TensorProto, helper, numpy_helper
    rng = np.random.default_rng(8)
    inits = [numpy_helper.from_array((rng.standard_normal((4, 3, 3, 3)) * 0.2).astype(np.float32), "w"),
             numpy_helper.from_array(np.zeros(4, np.float32), "b"),
             numpy_helper.from_array(np.array([-1, 4 * 6 * 6], np.int64), "shape"),
             numpy_helper.from_array((rng.standard_normal((10, 144)) * 0.1).astype(np.float32), "fc")]
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["c"]), helper.make_node("Relu", ["c"], ["r"]),
             helper.make_node("Reshape", ["r", "shape"], ["f"]),
             helper.make_node("Gemm", ["f", "fc"], ["y"], transB=1)]
    graph = helper.make_graph(nodes, "conv", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3, 8, 8])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 10])], inits)
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8), path)
    return path


def test_input_normalisation_in_the_graph_matches_host_normalisation(tmp_path):
    import onnxruntime as ort

    from anygrad import load_onnx
    from anygrad.data.graph_input import add_input_normalisation
    from anygrad.optim import get_optimizer
    path = _conv_model(tmp_path / "c.onnx")
    mean, std = (0.49, 0.48, 0.45), (0.25, 0.24, 0.26)
    x = np.random.default_rng(9).integers(0, 256, (6, 3, 8, 8), dtype=np.uint8)
    y = np.arange(6)
    host = normalize_images(x, mean, std)
    ref = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {"x": host})[0]
    model = add_input_normalisation(load_onnx(path), mean, std)
    assert model.graph.info[model.input_name].dtype == np.uint8
    model.compile(loss="cross_entropy", optimizer=get_optimizer("sgd", lr=0.1), device="cpu")
    np.testing.assert_allclose(model.predict(x), ref, rtol=1e-4, atol=1e-5)
    plain = load_onnx(path).compile(loss="cross_entropy", optimizer=get_optimizer("sgd", lr=0.1), device="cpu")
    assert model.train_on_batch(x, y) == pytest.approx(plain.train_on_batch(host, y), rel=1e-5)
    for name, value in plain.state_dict().items():  # the same update: the prologue has no parameters
        np.testing.assert_allclose(model.state_dict()[name], value, rtol=1e-4, atol=1e-6)
    with pytest.raises(ConfigError, match="before model.compile"):
        add_input_normalisation(model, mean, std)
    with pytest.raises(ConfigError, match="one mean/std per channel"):
        add_input_normalisation(load_onnx(path), (0.5, 0.5), (0.2, 0.2))


# -- uint8 batches to the device, normalised there --------------------------------------------------
def _identity_model(sample_shape: tuple):
    """x (float32, N x sample_shape) -> Identity -> y: the model's input is its output."""
    from anygrad.ir import Graph, Node, TensorInfo
    from anygrad.model import Model
    g = Graph(inputs=["x"], outputs=["y"])
    g.info["x"] = TensorInfo(np.dtype(np.float32), ("N", *sample_shape))
    g.nodes = [Node("Identity", ["x"], ["y"])]
    return Model(g, "identity")


def _device(name: str):
    if name == "cpu":
        return "cpu"
    from wgpu_util import wgpu_backend
    return wgpu_backend()


@needs_subset
@pytest.mark.parametrize("device", ["cpu", pytest.param("wgpu", marks=pytest.mark.wgpu)])
def test_mnist_uint8_batches_are_normalised_on_the_device_like_the_float_path(device):
    """What the model's first op sees from a uint8 MNIST batch equals the host float32 path
    (DataConfig's own transform and load_mnist's normalize), on both backends."""
    from anygrad.data.graph_input import add_input_normalisation
    data = get_dataset("mnist", SUBSET)
    config = DataConfig("mnist")
    mean, std = config.stats(data)
    on_device = config.transform(data, on_device=True)
    x_uint8 = on_device(data.valid[0][:12], np.arange(12), 0)
    assert x_uint8.dtype == np.uint8  # uploaded as stored
    host = config.transform(data)(data.valid[0][:12], np.arange(12), 0)
    assert host.dtype == np.float32
    np.testing.assert_allclose(host.reshape(12, -1), mnist_normalize(data.valid[0][:12, 0]).reshape(12, -1), atol=1e-6)
    model = add_input_normalisation(_identity_model((1, 28, 28)), mean, std)
    assert model.graph.info[model.input_name].dtype == np.uint8
    model.compile(loss="mse", device=_device(device))
    np.testing.assert_allclose(model.predict(x_uint8), host, rtol=1e-6, atol=2e-6)


def test_input_normalisation_of_a_flat_input_and_its_removal():
    """A single mean/std also serves a flat (N, 784) input; without_input_normalisation and
    plain_model give back the float model for exports."""
    from anygrad.data.graph_input import (
        add_input_normalisation,
        can_normalise_in_graph,
        find_input_normalisation,
        input_statistics,
        without_input_normalisation,
    )
    from anygrad.train.export_model import plain_model
    model = _identity_model((784,))
    assert can_normalise_in_graph(model, (0.5,)) and not can_normalise_in_graph(model, (0.5, 0.5, 0.5))
    add_input_normalisation(model, (0.1307,), (0.3081,))
    x = np.random.default_rng(3).integers(0, 256, (5, 784), dtype=np.uint8)
    got = model.compile(loss="mse", device="cpu").predict(x)
    np.testing.assert_allclose(got, normalize_images(x, (0.1307,), (0.3081,)), atol=2e-6)
    assert input_statistics(model.graph) == ([0.1307], [0.3081])
    stripped = without_input_normalisation(model.graph)
    assert stripped.inputs == ["x"] and find_input_normalisation(stripped) is None
    assert [n.op for n in stripped.nodes] == ["Identity"] and find_input_normalisation(model.graph) is not None
    plain = plain_model(model)
    assert plain.input_name == "x" and plain.graph.info["x"].dtype == np.float32
    assert plain_model(plain) is plain
    with pytest.raises(ConfigError, match="per channel"):
        add_input_normalisation(_identity_model((3, 4, 4)), (0.5, 0.5), (0.2, 0.2))


@needs_subset
def test_data_config_stats_and_checks():
    data = get_dataset("mnist", SUBSET)
    assert DataConfig("mnist").stats(data) == ((0.1307,), (0.3081,))
    assert DataConfig("mnist", mean=[0.5], std=[0.25]).stats(data) == ((0.5,), (0.25,))
    assert DataConfig("mnist", normalize=False).stats(data) == (None, None)
    for bad in ({"mean": [0.5]}, {"mean": [0.5], "std": [0.2, 0.2]}, {"mean": [0.5], "std": [0.0]}):
        with pytest.raises(ConfigError):
            DataConfig("mnist", **bad).check()
    # on_device keeps the stored dtype but still augments training batches
    x = data.train[0][:4]
    t = DataConfig("mnist", crop_padding=2, hflip=True).transform(data, seed=1, on_device=True)
    out = t(x, np.arange(4), 0)
    assert out.dtype == np.uint8
    np.testing.assert_array_equal(out, augment(x, np.arange(4), 0, 1, 2, True))


def test_augmenting_data_that_are_not_images_is_an_error(tmp_path):
    np.savez(tmp_path / "f.npz", x=np.zeros((10, 4), np.float32), y=np.zeros(10, np.int64))
    data = get_dataset("npz", tmp_path / "f.npz")
    with pytest.raises(ConfigError, match=r"images \(C, H, W\); npz samples have shape \(4,\)"):
        DataConfig("npz", hflip=True).transform(data)
    assert DataConfig("npz").transform(data)(data.train[0], np.arange(9), 0).dtype == np.float32
