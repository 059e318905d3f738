"""compile(scheduler=...): the schedule runs in every loop (train_on_batch, train_step, fit), per
optimizer update or per epoch, on every parameter group, as torch's LambdaLR/StepLR would; its
state is checkpointed and a resumed fit continues the same sequence. Also loss="output" finding
the model's loss output wherever it stands."""
from __future__ import annotations

import itertools
import json
import warnings
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

import anygrad
from anygrad import cli
from anygrad.errors import AnygradError
from anygrad.optim import AdamW, get_scheduler, no_decay

SIZES = (4, 6, 3)
LR, NODECAY_LR = 0.01, 0.05


def _onnx(path: Path, extra_outputs: tuple[str, ...] = ()) -> Path:
    """Gemm -> Relu -> Gemm over (N, 4); `extra_outputs`: ("loss",) makes the forward also take
    targets and return (logits, loss) with the loss second; ("loss", "aux") adds a second scalar."""
    rng = np.random.default_rng(0)
    inits, nodes = [], []
    x = "x"
    for i, (a, b) in enumerate(itertools.pairwise(SIZES)):
        w, bias = rng.standard_normal((b, a)) * 0.5, rng.standard_normal(b) * 0.1
        inits += [numpy_helper.from_array(w.astype(np.float32), f"l{i}.weight"),
                  numpy_helper.from_array(bias.astype(np.float32), f"l{i}.bias")]
        nodes.append(helper.make_node("Gemm", [x, f"l{i}.weight", f"l{i}.bias"], [f"h{i}"], transB=1))
        x = f"h{i}"
        if i == 0:
            nodes.append(helper.make_node("Relu", [x], ["r0"]))
            x = "r0"
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", SIZES[0]])]
    outputs = [helper.make_tensor_value_info(x, TensorProto.FLOAT, ["N", SIZES[-1]])]
    if extra_outputs:  # mse against a target input, computed in the graph
        inputs.append(helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", SIZES[-1]]))
        nodes += [helper.make_node("Sub", [x, "y"], ["d"]), helper.make_node("Mul", ["d", "d"], ["sq"]),
                  helper.make_node("ReduceMean", ["sq"], ["loss"], keepdims=0)]
        outputs.append(helper.make_tensor_value_info("loss", TensorProto.FLOAT, []))
    if "aux" in extra_outputs:
        nodes.append(helper.make_node("ReduceMean", [x], ["aux"], keepdims=0))
        outputs.append(helper.make_tensor_value_info("aux", TensorProto.FLOAT, []))
    graph = helper.make_graph(nodes, "mlp", inputs, outputs, inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, str(path))
    return path


def _torch_net(path: Path) -> torch.nn.Sequential:
    w = {t.name: torch.tensor(numpy_helper.to_array(t)) for t in onnx.load(str(path)).graph.initializer}
    layers = []
    for i, (a, b) in enumerate(itertools.pairwise(SIZES)):
        lin = torch.nn.Linear(a, b)
        with torch.no_grad():
            lin.weight.copy_(w[f"l{i}.weight"])
            lin.bias.copy_(w[f"l{i}.bias"])
        layers += [lin] + ([torch.nn.ReLU()] if i == 0 else [])
    return torch.nn.Sequential(*layers)


def _data(n=16, seed=1):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, SIZES[0])).astype(np.float32)
    return x, rng.integers(0, SIZES[-1], n).astype(np.int64)


def factor(step: int) -> float:
    """A warmup then exponential decay, written as training scripts write it."""
    return (step + 1) / 3 if step < 2 else 0.8 ** (step - 2)


def _optimizer():
    """Two groups: biases without decay at their own rate (first, as a param_groups entry), the
    matrices with decay (the default group)."""
    return AdamW(lr=LR, weight_decay=0.1, param_groups=[no_decay(lr=NODECAY_LR)])


def _torch_opt(net):
    biases = [p for n, p in net.named_parameters() if n.endswith("bias")]
    weights = [p for n, p in net.named_parameters() if n.endswith("weight")]
    return torch.optim.AdamW([{"params": biases, "lr": NODECAY_LR, "weight_decay": 0.0},
                              {"params": weights, "weight_decay": 0.1}], lr=LR)


def _torch_updates(path, x, y, batches, accumulate=1, sched_fn=None, epochs_of=None):
    """torch's rates and losses over `batches` (slices), one update every `accumulate` batches,
    the scheduler stepped after each update."""
    net = _torch_net(path)
    opt = _torch_opt(net)
    sched = (sched_fn or (lambda o: torch.optim.lr_scheduler.LambdaLR(o, factor)))(opt)
    rates, losses = [], []
    for i, part in enumerate(batches):
        if i % accumulate == 0:
            rates.append([g["lr"] for g in opt.param_groups])
        loss = torch.nn.functional.cross_entropy(net(torch.from_numpy(x[part])), torch.from_numpy(y[part]))
        losses.append(loss.item())
        (loss / accumulate).backward()
        if (i + 1) % accumulate == 0:
            opt.step()
            opt.zero_grad()
            sched.step()
    return rates, losses, net


def _same_weights(model, net):
    got = model.state_dict()
    for i in range(len(SIZES) - 1):
        for kind in ("weight", "bias"):
            np.testing.assert_allclose(got[f"l{i}.{kind}"], getattr(net[2 * i], kind).detach().numpy(),
                                       rtol=1e-5, atol=1e-6, err_msg=f"l{i}.{kind}")


SLICES = [slice(i % 4 * 4, i % 4 * 4 + 4) for i in range(8)]


@pytest.mark.parametrize("how", ["function", "anygrad", "torch"])
def test_train_on_batch_follows_the_schedule_on_every_group(tmp_path, how):
    path = _onnx(tmp_path / "m.onnx")
    x, y = _data()
    want_rates, want_losses, net = _torch_updates(path, x, y, SLICES)
    model = anygrad.load_onnx(path)
    if how == "function":
        schedule = factor
    elif how == "anygrad":
        schedule = get_scheduler("lambda", LR, lr_lambda=factor)
    else:  # a torch LambdaLR converted (its own optimizer, the same groups)
        tnet = _torch_net(path)
        schedule = anygrad.optim.from_torch(torch.optim.lr_scheduler.LambdaLR(_torch_opt(tnet), factor), tnet)
    model.compile(optimizer=_optimizer(), scheduler=schedule)
    assert [g.base_lr for g in model.param_groups] == [NODECAY_LR, LR]
    rates, losses = [], []
    for part in SLICES:
        rates.append(model.group_lrs)
        losses.append(model.train_on_batch(x[part], y[part]))
    np.testing.assert_allclose(rates, want_rates, rtol=1e-12)
    np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
    _same_weights(model, net)


def test_train_step_with_accumulation_steps_per_update(tmp_path):
    path = _onnx(tmp_path / "m.onnx")
    x, y = _data()
    want_rates, _, net = _torch_updates(path, x, y, SLICES, accumulate=2)
    model = anygrad.load_onnx(path).compile(optimizer=_optimizer(), scheduler=factor, accumulate=2)
    rates = []
    for i, part in enumerate(SLICES):
        if i % 2 == 0:
            rates.append(model.group_lrs)
        else:  # mid-group: the rate has not moved
            assert model.group_lrs == rates[-1]
        model.train_step(x[part], y[part])
    np.testing.assert_allclose(rates, want_rates, rtol=1e-12)
    _same_weights(model, net)


def _step_lr(o):
    return torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.5)


@pytest.mark.parametrize("interval", ["step", "epoch"])
def test_fit_runs_the_compiled_schedule(tmp_path, interval):
    path = _onnx(tmp_path / "m.onnx")
    x, y = _data()
    halving = get_scheduler("step", LR, step_size=1, gamma=0.5)
    model = anygrad.load_onnx(path).compile(optimizer=_optimizer(), scheduler=halving,
                                            scheduler_interval=interval)
    result = model.fit((x, y), epochs=3, batch_size=4, shuffle=False, log=None)  # 4 updates an epoch
    updates = 12 if interval == "step" else 3
    want = [[NODECAY_LR * 0.5 ** k, LR * 0.5 ** k] for k in range(updates + 1)]
    assert model.group_lrs == pytest.approx(want[-1], rel=1e-12)
    # metrics.jsonl's lr: the first group's rate of each epoch's last update
    last = [want[4 * e + 3][0] for e in range(3)] if interval == "step" else [want[e][0] for e in range(3)]
    assert [m.lr for m in result.history] == pytest.approx(last, rel=1e-6)


def test_fit_resume_continues_the_schedule(tmp_path):
    path = _onnx(tmp_path / "m.onnx")
    x, y = _data()

    def run(folder, epochs, resume=False):
        model = anygrad.load_onnx(path).compile(optimizer=_optimizer(), scheduler=factor)
        model.fit((x, y), epochs=epochs, batch_size=4, artifacts_dir=folder, resume=resume, log=None)
        return model

    whole = run(tmp_path / "whole", 3)
    run(tmp_path / "cut", 1)
    record = json.loads(max((tmp_path / "cut" / "checkpoints").glob("ckpt-*.json")).read_text())
    assert record["scheduler"]["groups"][0]["steps"] == 4  # 4 updates into the schedule
    resumed = run(tmp_path / "cut", 3, resume=True)
    assert resumed.group_lrs == whole.group_lrs == pytest.approx([NODECAY_LR * factor(12), LR * factor(12)])
    assert resumed.scheduler.steps == 12
    for name, value in whole.state_dict().items():
        np.testing.assert_array_equal(resumed.state_dict()[name], value, err_msg=name)


def test_fit_scheduler_by_name_scales_every_group(tmp_path):
    path = _onnx(tmp_path / "m.onnx")
    x, y = _data()
    model = anygrad.load_onnx(path).compile(optimizer=_optimizer())
    model.fit((x, y), epochs=2, batch_size=4, scheduler="exponential", scheduler_options={"gamma": 0.5},
              log=None)
    assert model.group_lrs == pytest.approx([NODECAY_LR * 0.25, LR * 0.25], rel=1e-12)
    model.fit((x, y), epochs=1, batch_size=4, log=None)  # the earlier fit's schedule ended with it
    assert model.scheduler is None and model.group_lrs == pytest.approx([NODECAY_LR * 0.25, LR * 0.25])


def test_fit_scheduler_replaces_the_compiled_one_and_says_so(tmp_path):
    path = _onnx(tmp_path / "m.onnx")
    x, y = _data()
    said = []
    model = anygrad.load_onnx(path).compile(optimizer=_optimizer(), scheduler=factor)
    model.fit((x, y), epochs=1, batch_size=4, scheduler="exponential", scheduler_options={"gamma": 0.5},
              log=said.append)
    assert any("--scheduler exponential replaces the schedule compile() set" in line for line in said)
    assert model.group_lrs == pytest.approx([NODECAY_LR * 0.5, LR * 0.5], rel=1e-12)


def test_bad_schedule_options(tmp_path):
    model = anygrad.load_onnx(_onnx(tmp_path / "m.onnx"))
    with pytest.raises(AnygradError, match="scheduler_interval must be one of epoch, step, got 'batch'"):
        model.compile(scheduler=factor, scheduler_interval="batch")
    with pytest.raises(AnygradError, match="scheduler_interval='step' without a scheduler"):
        model.compile(scheduler_interval="step")
    with pytest.raises(AnygradError, match="scheduler must be an anygrad Scheduler"):
        model.compile(scheduler="cosine")
    model.compile()
    with pytest.raises(AnygradError, match="step_scheduler: this model has no schedule"):
        model.step_scheduler()


# -- loss="output": the model's own loss, wherever it stands ------------------------------------------
def test_loss_output_takes_the_only_scalar_output_wherever_it_stands(tmp_path):
    path = _onnx(tmp_path / "m.onnx", ("loss",))
    assert anygrad.load_onnx(path).output_names[1] == "loss"
    x, y = _data()
    target = np.eye(SIZES[-1], dtype=np.float32)[y]
    model = anygrad.load_onnx(path).compile(loss="output", optimizer=anygrad.optim.SGD(lr=0.1))
    assert model.heads[0].output == "loss"
    net = _torch_net(path)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    for part in SLICES[:3]:
        ours = model.train_on_batch({"x": x[part], "y": target[part]})
        loss = torch.mean((net(torch.from_numpy(x[part])) - torch.from_numpy(target[part])) ** 2)
        opt.zero_grad()
        loss.backward()
        opt.step()
        assert ours == pytest.approx(loss.item(), rel=1e-6)


def test_several_scalar_outputs_must_be_chosen(tmp_path):
    path = _onnx(tmp_path / "m.onnx", ("loss", "aux"))
    x, y = _data()
    batch = {"x": x[:4], "y": np.eye(SIZES[-1], dtype=np.float32)[y[:4]]}
    with pytest.raises(AnygradError) as e:
        anygrad.load_onnx(path).compile(loss="output")
    assert "several scalar float outputs (loss, aux)" in str(e.value)
    assert "loss='output:loss'" in str(e.value) and "loss_output='loss'" in str(e.value)
    for how in ({"loss": "output:aux"}, {"loss": "output", "loss_output": "aux"}):
        model = anygrad.load_onnx(path).compile(optimizer=anygrad.optim.SGD(lr=0.1), **how)
        assert model.heads[0].output == "aux"
        model.train_on_batch(batch)
        assert "loss" in model.metric_names  # the other scalar, reported as today
    m = anygrad.load_onnx(path).compile(loss="output:loss")
    m.train_on_batch(batch)
    metrics = m.read_metrics()
    assert set(metrics) >= {"loss", "aux"}
    with pytest.raises(AnygradError, match=r"no output named 'nope'; its outputs are \['h1', 'loss', 'aux'"):
        anygrad.load_onnx(path).compile(loss="output:nope")
    with pytest.raises(AnygradError, match="name different outputs"):
        anygrad.load_onnx(path).compile(loss="output:loss", loss_output="aux")
    with pytest.raises(AnygradError, match="loss_output='aux' chooses the output of loss='output'"):
        anygrad.load_onnx(path).compile(loss="mse", loss_output="aux")
    with pytest.raises(AnygradError, match="non-empty string"):
        anygrad.load_onnx(path).compile(loss="output:")


def test_cli_loss_output_name(tmp_path, capsys):
    path = _onnx(tmp_path / "m.onnx", ("loss", "aux"))
    x, y = _data()
    np.savez(tmp_path / "d.npz", x=x, y=np.eye(SIZES[-1], dtype=np.float32)[y])
    base = ["train", str(path), "--dataset", "npz", "--data-dir", str(tmp_path / "d.npz"), "--device", "cpu",
            "--epochs", "1", "--batch-size", "4", "--quiet"]
    for loss, message in (("output:", "non-empty string"), ("output:nope", "no output named 'nope'"),
                          ("output", "several scalar float outputs (loss, aux)")):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            code = cli.main(base + ["--loss", loss, "--artifacts", str(tmp_path / loss.replace(":", "_"))])
        err = capsys.readouterr().err
        assert code != 0 and message in err and "Traceback" not in err, err
