"""Model.fit's keywords: the loop's settings only (compile-time and CLI-only ones are refused),
config.json's precision, and the messages for a folder with no run and for empty data."""
import json

import numpy as np
import pytest

from anygrad.errors import ConfigError
from anygrad.train import fit
from anygrad.train.checkpoint import CheckpointError
from anygrad.train.config import CLI_SETTINGS, COMPILE_SETTINGS, FIT_SETTINGS, TrainConfig


def _data(n=16):
    rng = np.random.default_rng(0)
    return rng.standard_normal((n, 4)).astype(np.float32), rng.integers(0, 3, n)


def test_table_covers_every_field():
    names = {f for f in TrainConfig.__dataclass_fields__}
    assert names == set(FIT_SETTINGS) | set(COMPILE_SETTINGS) | set(CLI_SETTINGS)
    assert not (set(FIT_SETTINGS) & set(COMPILE_SETTINGS)) and not (set(FIT_SETTINGS) & set(CLI_SETTINGS))


@pytest.mark.parametrize("kw, words", [({"lr": 5.0}, "lr="), ({"optimizer": "adam"}, "compile"),
                                       ({"precision": "f16"}, "compile(precision"),
                                       ({"valid_fraction": 0.2}, "CLI"), ({"hflip": True}, "CLI"),
                                       ({"freeze": ["*"]}, "freeze")])
def test_fit_refuses_settings_it_ignores(kw, words):
    with pytest.raises(ConfigError, match=r"fit\(\) does not take") as e:
        fit(None, _data(), **kw)
    assert words in str(e.value)


def test_config_json_records_the_compiled_precision_and_resume_refuses_another(tmp_path):
    from test_learner import _onnx

    import anygrad
    from anygrad.optim import get_optimizer
    path = _onnx(tmp_path / "m.onnx", [6, 5])
    rng = np.random.default_rng(4)
    data = rng.standard_normal((16, 6)).astype(np.float32), rng.integers(0, 5, 16).astype(np.int64)

    def model(precision):
        return anygrad.load_onnx(str(path)).compile("cross_entropy", get_optimizer("sgd", lr=0.1), "cpu",
                                                   precision=precision)
    try:
        m16 = model("f16")
    except Exception as e:  # noqa: BLE001 - a device without f16
        pytest.skip(f"no f16 on cpu: {e}")
    out = tmp_path / "run"
    fit(m16, data, epochs=1, batch_size=8, artifacts_dir=str(out), log=None)
    assert json.loads((out / "config.json").read_text())["precision"] == m16.precision == "f16"
    with pytest.raises(CheckpointError, match="precision"):
        fit(model("f32"), data, epochs=2, batch_size=8, artifacts_dir=str(out), resume=True, log=None)


def test_resume_in_a_folder_without_a_run_says_so(tmp_path):
    from test_learner import _small
    model, data = _small(tmp_path)
    with pytest.raises(CheckpointError, match="holds no run to resume") as e:
        fit(model, data, batch_size=8, artifacts_dir=str(tmp_path / "new_dir"), resume=True, log=None)
    assert "stopped before" not in str(e.value)


def test_empty_data_is_called_empty(tmp_path):
    from test_learner import _small
    model, (x, y) = _small(tmp_path)
    with pytest.raises(ConfigError, match="empty") as e:
        fit(model, (x[:0], y[:0]), batch_size=8, log=None)
    assert "drop_last" not in str(e.value)
