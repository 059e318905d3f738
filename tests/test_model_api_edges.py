"""Model API edges a QA pass found: compile's optimizer names, evaluate/predict's data forms and
batch_size, out-of-range Gather indices, and cross_entropy's messages on wrong targets."""
import numpy as np
import pytest

from anygrad import nn
from anygrad.errors import ConfigError, DataError, ShapeError


def _model(**compile_kwargs):
    rng = np.random.default_rng(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
    m = net.to_model(input_shape=(None, 4))
    if compile_kwargs is not None:
        m.compile(device="cpu", **compile_kwargs)
    x = rng.standard_normal((50, 4)).astype(np.float32)
    y = rng.integers(0, 3, 50)
    return m, x, y


def test_optimizer_given_by_name():
    m, x, y = _model(loss="cross_entropy", optimizer="adam")
    assert type(m.optimizer).__name__.lower() == "adam"
    m.train_on_batch(x, y)


def test_unknown_optimizer_name_lists_the_names():
    with pytest.raises(ConfigError, match="adam"):
        _model(loss="cross_entropy", optimizer="bogus")


def test_non_optimizer_names_its_type():
    with pytest.raises(ConfigError, match="int"):
        _model(loss="cross_entropy", optimizer=3)


def test_evaluate_takes_an_xy_tuple():
    m, x, y = _model(loss="cross_entropy")
    assert m.evaluate((x, y)) == pytest.approx(m.evaluate(x, y))


def test_evaluate_and_predict_take_a_data_loader_as_keras_takes_a_dataset():
    """anygrad's DataLoader (its epoch not advanced), torch's DataLoader and a generator of
    batches: the same mean loss and metrics as the arrays (uneven last batch included), and
    predict's outputs in order, with a batch's targets ignored."""
    import torch

    from anygrad.data import DataLoader
    m, x, y = _model(loss="cross_entropy")
    want, want_out = m.evaluate(x, y), m.predict(x)
    ours = DataLoader(x, y, batch_size=16, shuffle=False)
    theirs = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.from_numpy(x), torch.from_numpy(y)),
                                         batch_size=16)
    for source in (ours, theirs, ((x[i:i + 7], y[i:i + 7]) for i in range(0, 50, 7))):
        got = m.evaluate(source)
        assert got.keys() == want.keys()
        for k in want:
            assert got[k] == pytest.approx(want[k], rel=1e-5), k
    assert ours.epoch == 0
    np.testing.assert_allclose(m.predict(ours), want_out, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(m.predict(theirs), want_out, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(m.predict(iter([x[:20], x[20:]])), want_out, rtol=1e-5, atol=1e-6)


def test_evaluate_and_predict_read_every_source_fit_reads():
    """An indexable dataset of samples (anygrad batches it, unshuffled), a list of dict batches
    with a `labels` key and a one-shot generator object (read once here, unlike fit's epochs)."""
    import torch
    m, x, y = _model(loss="cross_entropy")
    want, want_out = m.evaluate(x, y), m.predict(x)
    samples = torch.utils.data.TensorDataset(torch.from_numpy(x), torch.from_numpy(y))
    dicts = [{"input": x[i:i + 10], "labels": y[i:i + 10]} for i in range(0, 50, 10)]
    for source in (samples, dicts, ((x[i:i + 9], y[i:i + 9]) for i in range(0, 50, 9))):
        got = m.evaluate(source)
        assert got["loss"] == pytest.approx(want["loss"], rel=1e-5) and got["count"] == 50
    np.testing.assert_allclose(m.predict(samples, batch_size=8), want_out, rtol=1e-5, atol=1e-6)


def test_data_sources_that_cannot_be_read_say_why():
    m, x, y = _model(loss="cross_entropy")
    with pytest.raises(ConfigError, match="its own targets"):
        m.evaluate(iter([(x, y)]), y)
    with pytest.raises(ConfigError, match="no batches"):
        m.evaluate(iter([]))
    with pytest.raises(DataError, match="targets"):
        m.evaluate(iter([x]))


def test_batch_size_below_one_is_a_config_error():
    m, x, y = _model(loss="cross_entropy")
    with pytest.raises(ConfigError, match="batch_size"):
        m.evaluate(x, y, batch_size=0)
    with pytest.raises(ConfigError, match="batch_size"):
        m.predict(x, batch_size=0)


def test_predict_in_batches_concatenates():
    m, x, _ = _model(loss="cross_entropy")
    whole = m.predict(x)
    parts = m.predict(x, batch_size=16)
    assert parts.shape == whole.shape
    np.testing.assert_allclose(parts, whole, rtol=1e-5, atol=1e-6)


def _embedding():
    return nn.Sequential(nn.Embedding(10, 4)).to_model(input_shape=(None, 5), dtype="int64")


def test_embedding_index_out_of_range_is_a_data_error():
    with pytest.raises(DataError, match=r"12.*\[-10, 10\)"):
        _embedding().predict(np.full((2, 5), 12, np.int64))


def test_embedding_negative_indices_in_range_are_kept():
    m = _embedding()
    np.testing.assert_allclose(m.predict(np.full((2, 5), -1, np.int64)), m.predict(np.full((2, 5), 9, np.int64)))
    with pytest.raises(DataError, match="-11"):
        m.predict(np.full((2, 5), -11, np.int64))


def test_one_hot_targets_say_class_indices_are_needed():
    m, x, y = _model(loss="cross_entropy")
    with pytest.raises(ShapeError, match=r"class-index targets of shape \(50,\)") as e:
        m.train_on_batch(x, np.eye(3, dtype=np.float32)[y])
    assert "do not fit" not in str(e.value)


@pytest.mark.parametrize("device", ["cpu", "torch:cpu"])
def test_a_target_class_out_of_range_names_the_loss_not_a_step_node(device):
    pytest.importorskip("torch")
    from anygrad.optim import SGD
    m = nn.Sequential(nn.Linear(4, 3)).to_model(input_shape=(None, 4))
    m.compile(loss="cross_entropy", optimizer=SGD(lr=0.1), device=device)
    x = np.ones((2, 4), np.float32)
    with pytest.raises(DataError, match=r"CrossEntropy loss: target class index 7 is outside \[0, 3\)") as e:
        m.train_on_batch(x, np.array([0, 7]))
    assert "step." not in str(e.value)
