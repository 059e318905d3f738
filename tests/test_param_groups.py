"""Parameter groups (anygrad/optim/groups.py): torch.optim's per-group settings and rates, chosen by
glob, PyTorch name or (name, shape) predicate; per-group rates fed without recompiling; groups in
checkpoints, config.json, `anygrad train --no-decay/--param-group` and `anygrad info`."""
from __future__ import annotations

import copy
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from mnist_util import write_tiny_mnist
from test_cli import _mlp
from test_optim_from_torch import _data, _net, _split

import anygrad
from anygrad import AnygradError, cli
from anygrad.optim import SGD, Adam, AdamW, no_decay
from anygrad.train import LineReporter, TrainConfig, fit
from anygrad.train import checkpoint as ckpt


def _pair():
    """(anygrad Model, torch module) with the same weights (torch names = graph names here)."""
    net = _net()
    return anygrad.from_torch(net, torch.randn(4, 5), dynamo=False), copy.deepcopy(net)


def _losses(model, ref, opt, steps: int = 5, before_step=None):
    """The same loop in both; `before_step(i, model, opt)` may move the rates."""
    t, a = [], []
    for i, (x, y) in enumerate(_data(steps)):
        if before_step:
            before_step(i, model, opt)
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(ref(x), y)
        loss.backward()
        opt.step()
        t.append(loss.item())
        a.append(model.train_on_batch(x.numpy(), y.numpy()))
    mine = model.to_torch_state_dict(as_numpy=True)
    for n, p in ref.named_parameters():
        np.testing.assert_allclose(mine[n], p.detach().numpy(), rtol=1e-5, atol=1e-6, err_msg=n)
    np.testing.assert_allclose(a, t, rtol=1e-5)


# -- groups as the Python API writes them ----------------------------------------------------------
def test_no_decay_is_one_line_and_matches_torchs_two_groups():
    model, ref = _pair()
    mats, vecs = _split(ref)
    opt = torch.optim.AdamW([{"params": vecs, "weight_decay": 0.0}, {"params": mats}], lr=1e-2,
                            betas=(0.9, 0.95), weight_decay=0.5)
    model.compile(loss="mse", optimizer=AdamW(lr=1e-2, betas=(0.9, 0.95), weight_decay=0.5,
                                              param_groups=[no_decay()]), device="cpu")
    assert [(g.label, g.params) for g in model.param_groups] == [
        ("param_groups[0] (no_decay)", ["fc1.bias", "norm.weight", "norm.bias", "fc2.bias"]),
        ("default", ["fc1.weight", "fc2.weight"])]
    assert [g.optimizer.weight_decay for g in model.param_groups] == [0.0, 0.5]
    _losses(model, ref, opt)


def test_globs_lists_and_predicates_choose_parameters():
    model, _ = _pair()
    model.compile(loss="mse", optimizer=SGD(lr=0.1, param_groups=[
        {"params": "fc?.bias", "lr": 0.01},
        {"params": ["norm.*", "fc2.weight"], "momentum": 0.9},
        {"params": lambda name, shape: name == "fc1.weight" and shape == (8, 5), "weight_decay": 1e-3},
    ]), device="cpu")
    groups = model.param_groups
    assert [g.params for g in groups] == [["fc1.bias", "fc2.bias"], ["norm.weight", "norm.bias", "fc2.weight"],
                                          ["fc1.weight"]]  # nothing left: no default group
    assert model.base_lrs == [0.01, 0.1, 0.1] and model.group_lrs == [0.01, 0.1, 0.1]
    assert groups[1].optimizer.momentum == 0.9 and groups[0].optimizer.momentum == 0.0
    assert [g.lr_state for g in groups] == ["anygrad.lr", "anygrad.lr.1", "anygrad.lr.2"]
    assert model.optimizer.config()["param_groups"][2]["params"].startswith("<test_globs")


@pytest.mark.parametrize("groups, words", [
    ([{"params": "*.bias"}, {"params": "fc1.*"}], ["'fc1.bias'", "param_groups[0]", "param_groups[1]"]),
    ([{"params": "*.bais"}], ["param_groups[0]", "'*.bais' matches no parameter", "close names"]),
    ([{"params": "*.bias", "momentum": 0.9}], ["param_groups[0]", "adam has no setting 'momentum'"]),
    ([{"params": "*.bias", "lr": -1.0}], ["param_groups[0]", "lr must be >= 0"]),
    ([{"params": "*.bias", "betas": (0.9, 1.5)}], ["param_groups[0]", "betas[1]"]),
    ([{"weight_decay": 0.0}], ["param_groups[0]", "'params'"]),
    (["*.bias"], ["param_groups[0]", "a dict"]),
    ([{"params": 3}], ["param_groups[0]", "'params' must be"]),
    ([{"params": lambda n, s: s[5] > 1}], ["param_groups[0]", "predicate failed", "IndexError"]),
])
def test_bad_groups_are_errors_naming_the_group(groups, words):
    model, _ = _pair()
    with pytest.raises(AnygradError) as e:
        model.compile(loss="mse", optimizer=Adam(lr=0.01, param_groups=groups), device="cpu")
    for w in words:
        assert w in str(e.value), str(e.value)


def test_frozen_parameters_are_in_no_group_and_get_no_state():
    model, _ = _pair()
    model.freeze("fc1.*")
    model.compile(loss="mse", optimizer=Adam(lr=0.01, param_groups=[{"params": "*.bias", "lr": 0.1}]), device="cpu")
    assert [g.params for g in model.param_groups] == [["norm.bias", "fc2.bias"], ["norm.weight", "fc2.weight"]]
    x, y = _data(1)[0]
    before = model.state_dict()
    model.train_on_batch(x.numpy(), y.numpy())
    state = model.full_state()
    assert not any(k.startswith("optim.") and k.endswith(("fc1.weight", "fc1.bias")) for k in state)
    np.testing.assert_array_equal(model.state_dict()["fc1.weight"], before["fc1.weight"])
    model.unfreeze("fc1.*")  # back in their group, the rates kept
    assert model.param_groups[0].params == ["fc1.bias", "norm.bias", "fc2.bias"]


# -- rates per group, fed per step without recompiling -----------------------------------------------
def test_group_lrs_move_each_group_per_step_without_recompiling():
    model, ref = _pair()
    mats, vecs = _split(ref)
    opt = torch.optim.SGD([{"params": mats, "lr": 0.1, "momentum": 0.9}, {"params": vecs, "lr": 0.05}], lr=0.1)
    model.compile(loss="mse", optimizer=anygrad.optim.from_torch(opt, ref), device="cpu")
    programs = []

    def warm(i, model, opt):  # a per-group warmup, as a per-step schedule writes it
        rates = [0.1 * (i + 1) / 5, 0.05 * 0.5 ** i]
        for group, lr in zip(opt.param_groups, rates):
            group["lr"] = lr
        model.group_lrs = rates
        programs.append(len(model._programs))
    _losses(model, ref, opt, before_step=warm)
    assert programs[1:] == [1] * (len(programs) - 1)  # the one step program, compiled once
    assert model.base_lrs == [0.1, 0.05] and model.group_lrs == pytest.approx([0.1, 0.05 / 16])


def test_model_lr_with_several_groups_scales_each_from_its_base():
    model, _ = _pair()
    model.compile(loss="mse", optimizer=SGD(lr=0.1, param_groups=[{"params": "*.bias", "lr": 0.02}]), device="cpu")
    assert model.lr == 0.02
    model.lr = 0.01  # half the first group's base: every group halves
    assert model.group_lrs == pytest.approx([0.01, 0.05])
    for group, lr in zip(model.param_groups, [0.01, 0.05]):
        assert float(model.backend.get_state(group.lr_state)) == np.float32(lr)
    with pytest.raises(AnygradError, match="2 parameter groups"):
        model.group_lrs = [0.1]
    with pytest.raises(AnygradError, match="default must be a finite number"):
        model.group_lrs = [0.1, float("nan")]


def test_one_group_keeps_the_single_rate_buffer():
    model, _ = _pair()
    model.compile(loss="mse", optimizer=Adam(lr=0.01), device="cpu")
    x, y = _data(1)[0]
    model.lr = 0.003
    model.train_on_batch(x.numpy(), y.numpy())
    lrs = [k for k in model.full_state() if k.startswith("anygrad.lr")]
    assert lrs == ["anygrad.lr"] and model.optimizer.lr == 0.003 and model.param_groups[0].label == "default"


# -- on the torch backend and on wgpu ------------------------------------------------------------
def _two_group_steps(device: str, steps: int = 3):
    model, _ = _pair()
    model.compile(loss="mse", optimizer=SGD(lr=0.05, momentum=0.9, param_groups=[
        {"params": lambda n, s: len(s) < 2, "lr": 0.2, "momentum": 0.0, "weight_decay": 0.01}]), device=device)
    losses = [model.train_on_batch(x.numpy(), y.numpy()) for x, y in _data(steps)]
    model.group_lrs = [0.1, 0.01]
    losses += [model.train_on_batch(x.numpy(), y.numpy()) for x, y in _data(steps)]
    return np.array(losses), model.state_dict()


def test_torch_backend_runs_each_group_with_its_settings():
    pytest.importorskip("torch")
    ref_losses, ref_state = _two_group_steps("cpu")
    losses, state = _two_group_steps("torch:cpu")
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    for name, value in ref_state.items():
        np.testing.assert_allclose(state[name], value, rtol=1e-5, atol=1e-6, err_msg=name)


def test_data_parallel_devices_share_the_groups_and_their_rates():
    ref_losses, ref_state = _two_group_steps("cpu")
    losses, state = _two_group_steps("cpu,cpu")  # two replicas: each group's update and rate on both
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    for name, value in ref_state.items():
        np.testing.assert_allclose(state[name], value, rtol=1e-5, atol=1e-6, err_msg=name)


def test_wgpu_fused_updates_per_group_agree_with_numpy():
    from wgpu_util import has_adapter, no_adapter
    if not has_adapter():
        no_adapter()
    ref_losses, ref_state = _two_group_steps("cpu", steps=2)
    losses, state = _two_group_steps("wgpu", steps=2)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    for name, value in ref_state.items():
        np.testing.assert_allclose(state[name], value, rtol=1e-5, atol=1e-6, err_msg=name)


# -- checkpoints and resume ------------------------------------------------------------------------
def _fit_model(groups):
    model, _ = _pair()
    return model.compile(loss="mse", optimizer=AdamW(lr=0.01, param_groups=groups), device="cpu", seed=3)


def test_groups_are_checkpointed_and_resumed_bit_for_bit(tmp_path):
    g = torch.Generator().manual_seed(5)
    x, y = torch.randn(24, 5, generator=g).numpy(), torch.randn(24, 3, generator=g).numpy()
    groups = [no_decay("*.bias"), {"params": "fc2.weight", "lr": 0.003}]
    config = TrainConfig(epochs=2, batch_size=8, seed=3, artifacts_dir=str(tmp_path / "run"), log_every=1)

    def changing_rates(model):  # rates that differ per group and move: a checkpoint must keep them
        class Reporter(LineReporter):
            def step(self, info):  # from the step alone, as a schedule computes it (resumable)
                model.group_lrs = [b * 0.9 ** info.global_step for b in model.base_lrs]
        return Reporter(None)

    straight = _fit_model(groups)
    fit(straight, (x, y), None, TrainConfig(**{**config.__dict__, "artifacts_dir": str(tmp_path / "straight")}),
        reporter=changing_rates(straight))
    first = _fit_model(groups)
    fit(first, (x, y), None, TrainConfig(**{**config.__dict__, "epochs": 1}), reporter=changing_rates(first))
    meta = ckpt.read(ckpt.latest(tmp_path / "run" / "checkpoints")).meta
    assert [grp["group"] for grp in meta["param_groups"]] == [
        "param_groups[0] (no_decay)", "param_groups[1]", "default"]
    saved = ckpt.read(ckpt.latest(tmp_path / "run" / "checkpoints")).state
    assert {"anygrad.lr", "anygrad.lr.1", "anygrad.lr.2"} <= set(saved)

    resumed = _fit_model(groups)
    fit(resumed, (x, y), None, config, reporter=changing_rates(resumed), resume=True)
    assert resumed.group_lrs == pytest.approx(straight.group_lrs)
    for name, value in straight.full_state().items():
        np.testing.assert_array_equal(resumed.full_state()[name], value, err_msg=name)

    other = _fit_model([no_decay("*.bias")])
    with pytest.raises(ckpt.CheckpointError, match="other parameter groups"):
        fit(other, (x, y), None, config, reporter=LineReporter(None), resume=True)


def test_fit_refuses_groups_the_compiled_optimizer_lacks():
    model = _fit_model([])
    with pytest.raises(AnygradError, match="param_groups and no_decay are the optimizer's"):
        fit(model, (np.zeros((4, 5), np.float32), np.zeros((4, 3), np.float32)), None, no_decay=["*.bias"],
            log=None)


# -- the command line and config.json ---------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> tuple[Path, Path]:
    folder = tmp_path_factory.mktemp("groups")
    (folder / "mnist").mkdir()
    return _mlp(folder / "mlp.onnx"), write_tiny_mnist(folder / "mnist", 32, 16)


def test_cli_no_decay_and_param_group_train_and_land_in_config_json(tiny, tmp_path):
    model, data = tiny
    run = tmp_path / "run"
    assert cli.main(["train", str(model), "--data-dir", str(data), "--device", "cpu", "--epochs", "1",
                     "--batch-size", "16", "--optimizer", "adamw", "--lr", "0.01", "--no-decay", "*.bias",
                     "--param-group", "fc2.weight:lr=0.001,betas=0.8;0.9", "--artifacts", str(run), "--quiet"]) == 0
    record = json.loads((run / "config.json").read_text())
    assert record["no_decay"] == ["*.bias"]
    assert record["param_groups"] == [{"params": ["fc2.weight"], "name": "--param-group fc2.weight:lr=0.001,"
                                       "betas=0.8;0.9", "lr": 0.001, "betas": [0.8, 0.9]}]
    groups = record["resolved"]["optimizer"]["param_groups"]
    assert [g["params"] for g in groups] == [["fc2.weight"], ["*.bias"]]
    assert groups[1]["weight_decay"] == 0.0 and groups[0]["betas"] == [0.8, 0.9]
    # the config file reruns it, and a resume keeps the groups
    assert cli.main(["train", "--resume", str(run), "--epochs", "2", "--quiet"]) == 0
    meta = ckpt.read(ckpt.latest(run / "checkpoints")).meta
    assert [len(g["params"]) for g in meta["param_groups"]] == [1, 2, 1]


@pytest.mark.parametrize("flags, words", [
    (["--param-group", "fc2.weight"], ["param-group", "PATTERN:KEY=VALUE"]),
    (["--param-group", "fc2.weight:lr=fast"], ["param-group", "lr=fast is not a number"]),
    (["--param-group", "fc2.weight:lr=inf"], ["param-group", "lr must be a finite number"]),
    (["--param-group", "fc2.weight:momentum=0.9"], ["--param-group fc2.weight:momentum=0.9", "no setting 'momentum'"]),
    (["--no-decay", "*.bais"], ["--no-decay", "'*.bais' matches no parameter"]),
    (["--no-decay", "fc2.*", "--param-group", "fc2.bias:lr=0.1"], ["'fc2.bias'", "--no-decay", "--param-group"]),
])
def test_cli_bad_groups_are_one_line_errors_naming_the_option(tiny, tmp_path, capsys, flags, words):
    model, data = tiny
    code = cli.main(["train", str(model), "--data-dir", str(data), "--device", "cpu", "--epochs", "1",
                     "--batch-size", "16", "--optimizer", "adam", "--artifacts", str(tmp_path / "r"), "--quiet",
                     *flags])
    err = capsys.readouterr().err
    assert code != 0 and "Traceback" not in err and err.startswith("anygrad: error:")
    for w in words:
        assert w in err, err


def test_info_lists_the_groups(tiny, capsys):
    model, _ = tiny
    assert cli.main(["info", str(model), "--optimizer", "adamw", "--no-decay", "*.bias",
                     "--param-group", "fc2.weight:lr=0.5"]) == 0
    out = capsys.readouterr().out
    assert "parameter groups (adamw; settings besides its own lr=0.001" in out
    assert f"  param_groups[0] (--param-group fc2.weight:lr=0.5): 1 tensors, {10 * 32:,} parameters; lr=0.5" in out
    assert "  param_groups[1] (--no-decay): 2 tensors, 42 parameters; weight_decay=0" in out
    assert f"  default: 1 tensors, {784 * 32:,} parameters" in out


# -- a torch optimizer or scheduler handed to compile: told how to convert it, no tensor dump ----------------
def test_a_torch_optimizer_or_scheduler_given_to_compile_names_from_torch():
    from anygrad.errors import ConfigError
    model, net = _pair()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    with pytest.raises(ConfigError) as e:
        model.compile(loss="mse", optimizer=opt, device="cpu")
    said = str(e.value)
    assert said.startswith("optimizer= is a torch.optim.SGD; convert it with anygrad.optim.from_torch(optimizer, "
                           "module)"), said
    assert "tensor(" not in said and "Parameter" not in said
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1)
    with pytest.raises(ConfigError, match=r"scheduler= is a torch\.optim\.lr_scheduler\.StepLR; convert "
                                                  r"it with anygrad\.optim\.from_torch\(scheduler, module\)"):
        model.compile(loss="mse", optimizer=SGD(lr=0.1), scheduler=sched, device="cpu")

    class Mine(torch.optim.Adam):  # a subclass: still torch's, named by the torch class it extends
        pass
    with pytest.raises(ConfigError, match=r"optimizer= is a torch\.optim\.Adam;"):
        model.compile(loss="mse", optimizer=Mine(net.parameters()), device="cpu")
    model.compile(loss="mse", optimizer=anygrad.optim.from_torch(opt, net), device="cpu")  # converted: fine


def test_duck_typed_without_importing_torch():
    from anygrad.model.configure import torch_class
    fake = type("SGD", (), {"__module__": "torch.optim.sgd"})
    assert torch_class(fake()) == "torch.optim.SGD"
    assert torch_class(SGD(lr=0.1)) is None and torch_class(None) is None
    assert torch_class(type("X", (), {"__module__": "torch.optimizers"})()) is None


def test_a_group_error_shows_a_large_value_by_type_and_length():
    from anygrad.errors import ConfigError
    model, net = _pair()
    with pytest.raises(ConfigError) as e:
        model.compile(loss="mse", optimizer=SGD(lr=0.1, param_groups=[{"params": list(net.parameters())}]),
                      device="cpu")
    said = str(e.value)
    assert "'params' must be a glob" in said and f"got a list of {len(list(net.parameters()))} (Parameter)" in said, said
    assert "tensor(" not in said and len(said) < 300
    with pytest.raises(ConfigError, match=r"got \['\*\.bias', 3\]"):  # a short value: as it is
        model.compile(loss="mse", optimizer=SGD(lr=0.1, param_groups=[{"params": ["*.bias", 3]}]), device="cpu")
