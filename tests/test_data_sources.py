"""`fit` over the user's own data: torch DataLoaders and Datasets, Hugging Face-style datasets, plain
indexables, lists of batches, generator functions, memory-mapped arrays and .npy files, and a token
file for a language model. Each trains to the weights of the same batches given as arrays, and of
the PyTorch loop; indexable sources resume mid-epoch bit for bit, iterables at epoch boundaries;
malformed samples are DataErrors naming the sample."""
from __future__ import annotations

import subprocess
import sys
import warnings

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import anygrad
from anygrad import cli
from anygrad.data import DatasetSamples, TokenBlocks, TokenWindows, batch_source
from anygrad.data.structure import Layout, collate, split
from anygrad.errors import AnygradError, ConfigError, DataError
from anygrad.train.checkpoint import CheckpointError

N, D, C, BATCH = 22, 4, 3, 4  # 6 batches an epoch, the last one of 2 samples


def _data(seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.standard_normal((N, D)).astype(np.float32), rng.integers(0, C, N).astype(np.int64)


def _net(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(D, 8), torch.nn.Tanh(), torch.nn.Linear(8, C))


def _model(device: str = "cpu", lr: float = 0.1, seed: int = 0) -> anygrad.Model:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = anygrad.from_torch(_net(seed), torch.zeros(2, D), dynamo=False)
    return model.compile(loss="cross_entropy", optimizer=anygrad.optim.SGD(lr=lr), device=device)


def _weights(model: anygrad.Model) -> dict[str, np.ndarray]:
    return model.to_torch_state_dict(as_numpy=True)


def _same(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> None:
    assert set(a) == set(b)
    for k, v in a.items():
        assert v.tobytes() == b[k].tobytes(), k


def _fit(data, **settings) -> dict[str, np.ndarray]:
    model = _model()
    model.fit(data, **{"epochs": 2, "batch_size": BATCH, "log": None, **settings})
    return _weights(model)


class DictDataset(torch.utils.data.Dataset):
    """A torch Dataset of dict samples, as tokenised Hugging Face data looks."""

    def __init__(self, x, y):
        self.x, self.y = torch.from_numpy(x), torch.from_numpy(y)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"features": self.x[i], "labels": self.y[i]}


class Indexable:
    """Anything with __len__ and __getitem__: (x, y) tuples of numpy arrays and Python ints."""

    def __init__(self, x, y):
        self.x, self.y = x, y

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i], int(self.y[i])


class HFLike:
    """What a Hugging Face datasets.Dataset gives: dict rows of Python lists, and __getitems__; with
    a column that is no model input ('idx'), which is left out as HF's Trainer leaves it out."""

    def __init__(self, x, y):
        self.rows = [{"input": x[i].tolist(), "label": int(y[i]), "idx": i} for i in range(len(x))]
        self.calls = 0

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        raise AssertionError("__getitems__ is used when there is one")

    def __getitems__(self, keys):
        self.calls += 1
        return [self.rows[k] for k in keys]

    def __iter__(self):
        return iter(self.rows)


# -- the torch DataLoader of dict batches against the PyTorch loop ---------------------------------
def _torch_loop(x, y, lr: float = 0.1) -> dict[str, np.ndarray]:
    net = _net()
    opt = torch.optim.SGD(net.parameters(), lr=lr)
    for batch in torch.utils.data.DataLoader(DictDataset(x, y), batch_size=BATCH, shuffle=False):
        loss = torch.nn.functional.cross_entropy(net(batch["features"]), batch["labels"])
        opt.zero_grad()
        loss.backward()
        opt.step()
    return {k: v.detach().numpy() for k, v in net.state_dict().items()}


def test_fit_torch_dataloader_of_dicts_matches_the_pytorch_loop():
    x, y = _data()
    loader = torch.utils.data.DataLoader(DictDataset(x, y), batch_size=BATCH, shuffle=False)
    model = _model()
    result = model.fit(loader, epochs=1, shuffle=False, log=None)
    assert len(result.history) == 1
    ours, theirs = _weights(model), _torch_loop(x, y)
    for k, v in theirs.items():
        np.testing.assert_allclose(ours[k], v, atol=1e-6, rtol=0, err_msg=k)


@pytest.mark.wgpu
def test_fit_torch_dataloader_on_wgpu():
    from wgpu_util import wgpu_backend
    x, y = _data()
    loader = torch.utils.data.DataLoader(DictDataset(x, y), batch_size=BATCH, shuffle=False)
    model = _model(device=wgpu_backend())
    model.fit(loader, epochs=1, shuffle=False, log=None)
    ours, theirs = _weights(model), _torch_loop(x, y)
    for k, v in theirs.items():
        np.testing.assert_allclose(ours[k], v, atol=1e-5, rtol=0, err_msg=k)


# -- every source trains to the weights of the same batches as arrays --------------------------------
def test_every_source_gives_the_weights_of_arrays(tmp_path):
    x, y = _data()
    want = _fit((x, y), shuffle=False)
    batches = [(x[i:i + BATCH], y[i:i + BATCH]) for i in range(0, N, BATCH)]

    def generator():
        for bx, by in batches:
            yield {"inputs": torch.from_numpy(bx), "y": torch.from_numpy(by)}
    np.save(tmp_path / "x.npy", x)
    np.save(tmp_path / "y.npy", y)
    mx = np.memmap(tmp_path / "x.f32", np.float32, "w+", shape=x.shape)
    mx[:] = x
    mx.flush()
    hf = HFLike(x, y)
    sources = {"torch Dataset": DictDataset(x, y), "indexable": Indexable(x, y), "hf-like": hf,
               "list of batches": batches, "generator function": generator,
               "torch DataLoader of tuples": torch.utils.data.DataLoader(
                   torch.utils.data.TensorDataset(torch.from_numpy(x), torch.from_numpy(y)), batch_size=BATCH),
               "memmap": (np.memmap(tmp_path / "x.f32", np.float32, "r", shape=x.shape), y),
               ".npy files": (tmp_path / "x.npy", str(tmp_path / "y.npy")),
               "tensors": (torch.from_numpy(x), torch.from_numpy(y)),
               "a list of samples, wrapped": DatasetSamples([(x[i], y[i]) for i in range(N)])}
    for name, data in sources.items():
        _same(_fit(data, shuffle=False), want), name
    for data in (generator, batches, Indexable(x, y)):  # the background prefetch serves every source
        _same(_fit(data, shuffle=False, prefetch=True), want)
    assert hf.calls == 2 * 6  # a batch's rows in one __getitems__ call
    lines: list[str] = []
    _model().fit(HFLike(x, y), epochs=2, batch_size=BATCH, log=lines.append)
    assert sum("idx name no input of the model" in line for line in lines) == 1
    # shuffled: an indexable dataset gets the very permutation arrays get, from (seed, epoch)
    shuffled = _fit((x, y), shuffle=True, seed=5)
    assert shuffled["0.weight"].tobytes() != want["0.weight"].tobytes()
    for data in (Indexable(x, y), (tmp_path / "x.npy", tmp_path / "y.npy")):
        _same(_fit(data, shuffle=True, seed=5), shuffled)


def test_validation_data_of_any_source_and_prefetch():
    x, y = _data()
    xv, yv = _data(1)
    arrays = _model().fit((x, y), (xv, yv), epochs=1, batch_size=BATCH, log=None).last
    model = _model()
    result = model.fit(Indexable(x, y), [(xv[:10], yv[:10]), (xv[10:], yv[10:])], epochs=1, batch_size=BATCH,
                       prefetch=True, log=None).last
    assert result.train_loss == pytest.approx(arrays.train_loss, abs=1e-6)
    assert result.valid_loss == pytest.approx(arrays.valid_loss, abs=1e-6)
    assert result.valid_accuracy == pytest.approx(arrays.valid_accuracy)


def test_a_mapped_file_is_read_batch_by_batch(tmp_path):
    """A memmap is indexed, never loaded whole: batches come out as plain arrays of their rows."""
    rows = 2**20  # 16 MiB of float32 rows, sparse on disk (zeros) except the first N
    mx = np.memmap(tmp_path / "big.f32", np.float32, "w+", shape=(rows, D))
    x, _ = _data()
    mx[:N] = x
    mx.flush()
    del mx
    big = np.memmap(tmp_path / "big.f32", np.float32, "r", shape=(rows, D))
    labels = np.memmap(tmp_path / "labels.i64", np.int64, "w+", shape=(rows,))
    source = batch_source((big, labels), batch_size=BATCH, shuffle=True, seed=1)
    bx, by = next(iter(source))
    assert bx.shape == (BATCH, D) and type(bx) is np.ndarray and type(by) is np.ndarray
    order = anygrad.data.permutation(rows, 1, 0)[:BATCH]
    np.testing.assert_array_equal(bx, np.asarray(big[order]))
    plain = batch_source((big, labels), batch_size=BATCH, shuffle=False)
    np.testing.assert_array_equal(next(iter(plain))[0], x[:BATCH])
    _model().train_step(bx, by)


# -- resume ------------------------------------------------------------------------------------------
class Crash(BaseException):
    """A kill in the middle of a run (BaseException: nothing in the trainer catches it)."""


class CrashingIndexable(Indexable):
    def __init__(self, x, y, after: int):
        super().__init__(x, y)
        self.left = after

    def __getitem__(self, i):
        self.left -= 1
        if self.left < 0:
            raise Crash
        return super().__getitem__(i)


def test_indexable_source_resumes_mid_epoch_bit_for_bit(tmp_path):
    x, y = _data()
    settings = {"epochs": 2, "batch_size": BATCH, "seed": 3, "checkpoint_every": 4, "log": None}
    whole = _model()
    whole.fit(Indexable(x, y), artifacts_dir=str(tmp_path / "whole"), **settings)
    with pytest.raises(Crash):  # dies in epoch 2, after the checkpoint at global step 8 (epoch 2, step 2)
        _model().fit(CrashingIndexable(x, y, N + 2 * BATCH * 2 + 1), artifacts_dir=str(tmp_path / "crash"), **settings)
    resumed = _model()
    lines = []
    resumed.fit(Indexable(x, y), artifacts_dir=str(tmp_path / "crash"), resume=True, **{**settings, "log": lines.append})
    _same(_weights(resumed), _weights(whole))
    assert not any("iterable" in line for line in lines)


def test_iterable_resumes_at_the_epoch_boundary_and_says_so(tmp_path):
    x, y = _data()
    batches = [(x[i:i + BATCH], y[i:i + BATCH]) for i in range(0, N, BATCH)]
    settings = {"epochs": 2, "batch_size": BATCH, "checkpoint_every": 2}
    whole = _model()
    whole.fit(batches, artifacts_dir=str(tmp_path / "whole"), log=None, **settings)
    calls = {"n": 0}

    def crashing():
        calls["n"] += 1
        for i, b in enumerate(batches):
            if calls["n"] == 3 and i == 3:  # epoch 2 (call 1 counts the batches), after 3 of its batches
                raise Crash
            yield b
    lines: list[str] = []
    with pytest.raises(Crash):
        _model().fit(crashing, artifacts_dir=str(tmp_path / "crash"), log=lines.append, **settings)
    said = [line for line in lines if "cannot be positioned mid-epoch" in line]
    assert len(said) == 1 and "epoch ends only" in said[0]
    ckpts = sorted((tmp_path / "crash" / "checkpoints").glob("ckpt-*.json"))
    assert [p.name for p in ckpts] == ["ckpt-00000006.json"]  # epoch 1's end; none mid-epoch
    resumed, lines = _model(), []
    resumed.fit(crashing, artifacts_dir=str(tmp_path / "crash"), resume=True, log=lines.append, **settings)
    assert sum("cannot be positioned mid-epoch" in line for line in lines) == 1
    _same(_weights(resumed), _weights(whole))  # epoch 2 again from epoch 1's weights: nothing repeated
    # a checkpoint written mid-epoch (by an indexable run of the same model) is refused for an iterable
    _model().fit(Indexable(x, y), artifacts_dir=str(tmp_path / "mid"), log=None, **settings)
    mid = tmp_path / "mid" / "checkpoints" / "ckpt-00000010.json"
    with pytest.raises(CheckpointError, match="mid-epoch"):
        _model().fit(batches, artifacts_dir=str(tmp_path / "mid"), resume=mid, log=None, **settings)


# -- GPT-2 on a token file ---------------------------------------------------------------------------
VOCAB, T = 64, 8


class GPT2Logits(torch.nn.Module):
    def __init__(self):
        super().__init__()
        import transformers
        cfg = transformers.GPT2Config(vocab_size=VOCAB, n_positions=16, n_embd=32, n_layer=2, n_head=4,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0,
                                      eos_token_id=0)
        self.m = transformers.GPT2LMHeadModel(cfg)

    def forward(self, ids):  # (B, T, V) logits: anygrad's cross_entropy takes them with (B, T) targets
        return self.m(ids, return_dict=False)[0]


def test_gpt2_on_a_token_memmap_matches_pytorch(tmp_path):
    pytest.importorskip("transformers")
    tokens = np.random.default_rng(0).integers(0, VOCAB, 30).astype(np.uint16)
    tokens.tofile(tmp_path / "train.bin")
    torch.manual_seed(0)
    net = GPT2Logits()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = anygrad.from_torch(net, torch.zeros(2, T, dtype=torch.int64), dynamo=False)
    model.compile(loss="cross_entropy", optimizer=anygrad.optim.SGD(lr=0.5), device="cpu")
    windows = TokenWindows(tmp_path / "train.bin", T)
    result = model.fit(windows, epochs=5, batch_size=2, seed=7, log=None)  # an epoch: (30-1)//8 = 3 windows, 1 batch
    assert len(windows) == 1
    got = [m.train_loss for m in result.history]
    # token-level: one batch an epoch, no ignored tokens, so the perplexity is exp of the loss
    np.testing.assert_allclose([m.train_perplexity for m in result.history], np.exp(got), rtol=1e-5)

    opt = torch.optim.SGD(net.parameters(), lr=0.5)
    expected = []
    for epoch in range(5):
        starts = windows.offsets(epoch, 0)
        w = torch.from_numpy(np.stack([tokens[s:s + T + 1] for s in starts]).astype(np.int64))
        loss = torch.nn.functional.cross_entropy(net(w[:, :-1]).reshape(-1, VOCAB), w[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        expected.append(loss.item())
    np.testing.assert_allclose(got, expected, atol=1e-5, rtol=0)
    assert len(set(map(tuple, (windows.offsets(e, 0).tolist() for e in range(5))))) == 5  # fresh windows


def test_token_windows_and_blocks(tmp_path):
    tokens = np.arange(1000, dtype=np.int32)
    np.save(tmp_path / "t.npy", tokens)
    w = TokenWindows(tmp_path / "t.npy", 10, batch_size=4, seed=1)
    assert len(w) == (999 // 10) // 4 == 24
    batches = list(w.epoch_batches(0))
    assert len(batches) == 24
    x, y = batches[5]
    assert x.dtype == y.dtype == np.int64 and x.shape == y.shape == (4, 10)
    np.testing.assert_array_equal(y, x + 1)  # y is x shifted by one token
    assert x.min() >= 0 and y.max() <= 999
    assert next(w.epoch_batches(0, 5))[0].tolist() == x.tolist()  # resumable at any step
    assert not np.array_equal(next(iter(w.epoch_batches(1)))[0], batches[0][0])  # each epoch its own windows
    blocks = TokenBlocks(tokens, 10)
    assert len(blocks) == 99
    bx, by = blocks.take(np.array([0, 98]))
    np.testing.assert_array_equal(bx[1], np.arange(980, 990))
    np.testing.assert_array_equal(by[1], np.arange(981, 991))
    for path, data, words in [("t.txt", b"1 2 3", "is .bin"), ("f.npy", np.zeros(100, np.float32), "integer"),
                              ("m.npy", np.zeros((10, 10), np.int64), "flat"), ("odd.bin", b"\x00" * 21, "uint16")]:
        if isinstance(data, bytes):
            (tmp_path / path).write_bytes(data)
        else:
            np.save(tmp_path / path, data)
        with pytest.raises(DataError, match=words):
            TokenWindows(tmp_path / path, 4)
    with pytest.raises(DataError, match="block-size"):
        TokenWindows(tokens[:5], 8)


def test_cli_tokens_dataset(tmp_path, capsys):
    pytest.importorskip("transformers")
    np.random.default_rng(1).integers(0, VOCAB, 200).astype(np.uint16).tofile(tmp_path / "corpus.bin")
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        anygrad.from_torch(GPT2Logits(), torch.zeros(2, T, dtype=torch.int64), dynamo=False,
                           path=tmp_path / "gpt2.onnx")
    run = tmp_path / "run"
    code = cli.main(["train", str(tmp_path / "gpt2.onnx"), "--dataset", "tokens", "--data-dir",
                     str(tmp_path / "corpus.bin"), "--block-size", str(T), "--batch-size", "2", "--epochs", "1",
                     "--device", "cpu", "--optimizer", "sgd", "--lr", "0.1", "--artifacts", str(run), "--quiet"])
    out = capsys.readouterr().out
    assert code == 0, out
    import json
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert np.isfinite(rows[0]["train_loss"]) and np.isfinite(rows[0]["valid_loss"])
    assert json.loads((run / "config.json").read_text())["block_size"] == T
    assert cli.main(["train", str(tmp_path / "gpt2.onnx"), "--dataset", "tokens", "--data-dir",
                     str(tmp_path / "corpus.bin"), "--device", "cpu", "--artifacts", str(tmp_path / "r2")]) == 2
    assert "--block-size" in capsys.readouterr().err


# -- errors ------------------------------------------------------------------------------------------
class Items:
    def __init__(self, items):
        self.items = items

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return self.items[i]


@pytest.mark.parametrize("items, words", [
    ([(np.zeros(D, np.float32), 0)] * 3 + [{"x": np.zeros(D, np.float32), "labels": 0}], "item 3 is"),
    ([(np.zeros(D, np.float32), 0, 1)] * 4, "item 0: a tuple of 3 elements"),
    ([(np.zeros(D, np.float32), 0)] + [(np.zeros(D + 1, np.float32), 0)] * 3, "item 1 is"),
    ([{"x": np.zeros(D, np.float32), "labels": 0, "text": "hello"}] * 4, "item 0 key 'text': holds str"),
    ([{"x": np.zeros(D, np.float32)}] * 4, "has no targets"),
    ([(np.zeros(D, np.float32), None)] * 4, "item 0 targets"),
    ([([1, 2], [3]), 0] * 2, "item 1: has no targets"),
])
def test_malformed_items_name_the_item(items, words):
    with pytest.raises(DataError, match=words):
        _model().fit(Items(items), epochs=1, batch_size=4, shuffle=False, log=None)


def test_other_data_errors(tmp_path):
    x, y = _data()
    gen = (b for b in [(x, y)])
    with pytest.raises(DataError, match="one-shot iterator"):
        _model().fit(gen, epochs=1, log=None)
    with pytest.raises(DataError, match="disagree on the batch size"):
        _model().fit([(x, y[:3])], epochs=1, log=None)
    with pytest.raises(DataError, match="no such file"):
        _model().fit((tmp_path / "none.npy", y), epochs=1, log=None)
    with pytest.raises(DataError, match="IterableDataset"):
        class Stream(torch.utils.data.IterableDataset):
            def __iter__(self):
                return iter([])
        _model().fit(Stream(), epochs=1, log=None)
    with pytest.raises(DataError, match="cannot read"):
        _model().fit(object(), epochs=1, log=None)
    with pytest.raises(DataError, match="every key"):
        _model().fit([{"labels": y}], epochs=1, log=None, target_keys=["labels"])
    with pytest.raises(ConfigError, match="transforms"):
        batch_source([(x, y)], batch_size=4, transform=lambda a, i, e: a)


def test_target_keys_choose_the_targets():
    x, y = _data()
    want = _fit((x, y), shuffle=False)
    rows = Items([{"pixels": x[i], "cls": int(y[i])} for i in range(N)])
    _same(_fit(rows, shuffle=False, target_keys=["cls"]), want)
    with pytest.raises(DataError, match="target_keys"):
        _fit(rows, shuffle=False)


def test_no_torch_import_for_numpy_data(tmp_path):
    code = """
import sys, numpy as np, anygrad
from anygrad import nn
from anygrad.data import batch_source
x = np.zeros((8, 4), np.float32); y = np.zeros(8, np.int64)
for data in ((x, y), [(x, y)], lambda: iter([(x, y)]), [{"x": x, "label": y}]):
    for b in batch_source(data, batch_size=4):
        pass
assert "torch" not in sys.modules and "datasets" not in sys.modules, sorted(m for m in sys.modules if "torch" in m)
"""
    subprocess.run([sys.executable, "-c", code], check=True)


# -- fuzz the structure parser: AnygradError or a batch, nothing else ---------------------------------
leaf = st.one_of(st.none(), st.text(max_size=2), st.integers(-3, 3), st.floats(allow_nan=True),
                 st.lists(st.integers(0, 3), max_size=3), st.lists(st.lists(st.integers(0, 3), max_size=2), max_size=2),
                 st.builds(lambda s: np.zeros(s, np.float32), st.lists(st.integers(0, 2), max_size=2)),
                 st.builds(lambda s: np.array(["a"] * s), st.integers(0, 2)),
                 st.builds(lambda s: torch.zeros(s), st.lists(st.integers(0, 2), max_size=2)))
trees = st.recursive(leaf, lambda inner: st.one_of(
    st.lists(inner, max_size=3), st.lists(inner, max_size=3).map(tuple),
    st.dictionaries(st.one_of(st.sampled_from(["x", "labels", "y", "mask"]), st.integers(0, 2)), inner, max_size=3)),
    max_leaves=8)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(trees, min_size=1, max_size=4), st.booleans())
def test_fuzz_collate_raises_only_anygrad_errors(items, needs_targets):
    layout = Layout(needs_targets=needs_targets)
    try:
        collate(items, list(range(len(items))), layout)
    except AnygradError:
        pass
    try:
        split(items[0], "batch 0", layout)
    except AnygradError:
        pass
    try:
        for _ in batch_source(Items(items), batch_size=2, layout=layout).epoch_batches(0):
            pass
    except AnygradError:
        pass
    try:
        for _ in batch_source(list(items), batch_size=2, layout=layout).epoch_batches(0):
            pass
    except AnygradError:
        pass
