"""anygrad.optim.from_torch: torch.optim optimizers, with every group and setting, against the same
PyTorch loop (several steps, two groups with different settings), and the settings it refuses."""
from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

import anygrad
from anygrad import AnygradError
from anygrad.optim import SGD, Adadelta, Adagrad, Adam, AdamW, RMSprop, from_torch


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(5, 8)
        self.norm = torch.nn.LayerNorm(8)
        self.fc2 = torch.nn.Linear(8, 3)

    def forward(self, x):
        return self.fc2(torch.tanh(self.norm(self.fc1(x))))

    def configure_optimizers(self, weight_decay, learning_rate, betas):
        """nanoGPT's, as its training script calls it (fused chosen by what torch offers)."""
        import inspect
        params = {n: p for n, p in self.named_parameters() if p.requires_grad}
        decay = [p for p in params.values() if p.dim() >= 2]
        nodecay = [p for p in params.values() if p.dim() < 2]
        groups = [{"params": decay, "weight_decay": weight_decay}, {"params": nodecay, "weight_decay": 0.0}]
        fused = "fused" in inspect.signature(torch.optim.AdamW).parameters
        return torch.optim.AdamW(groups, lr=learning_rate, betas=betas, **({"fused": False} if fused else {}))


def _net(seed: int = 0) -> Net:
    torch.manual_seed(seed)
    net = Net()
    with torch.no_grad():  # a norm with weights of its own, so its group's settings matter
        net.norm.weight.uniform_(0.5, 1.5)
        net.norm.bias.uniform_(-0.2, 0.2)
    return net


def _split(net: torch.nn.Module) -> tuple[list, list]:
    """(matrices, vectors): the two groups every case uses."""
    ps = list(net.named_parameters())
    return [p for _, p in ps if p.dim() >= 2], [p for _, p in ps if p.dim() < 2]


def _data(steps: int):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(6, 5, generator=g), torch.randn(6, 3, generator=g)) for _ in range(steps)]


def _run(make, steps: int = 6, device: str = "cpu"):
    """The same loop in PyTorch and in anygrad from the same weights; (losses, weights) of each."""
    net = _net()
    model = anygrad.from_torch(net, torch.randn(4, 5), dynamo=False)
    ref = copy.deepcopy(net)
    opt = make(ref)
    model.compile(loss="mse", optimizer=from_torch(opt, ref), device=device)
    t_losses, a_losses = [], []
    for x, y in _data(steps):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(ref(x), y)
        loss.backward()
        opt.step()
        t_losses.append(loss.item())
        a_losses.append(model.train_on_batch(x.numpy(), y.numpy()))
    mine = model.to_torch_state_dict(as_numpy=True)
    theirs = {n: p.detach().numpy() for n, p in ref.named_parameters()}
    return model, (np.array(t_losses), theirs), (np.array(a_losses), mine)


def _check(make, kind: type, steps: int = 6, device: str = "cpu", rtol: float = 1e-5):
    model, (t_losses, theirs), (a_losses, mine) = _run(make, steps, device)
    assert type(model.optimizer) is kind
    assert len(model.param_groups) == 2 and [g.label for g in model.param_groups] == \
        ["param_groups[0]", "param_groups[1]"]
    np.testing.assert_allclose(a_losses, t_losses, rtol=rtol)
    for name, value in theirs.items():
        np.testing.assert_allclose(mine[name], value, rtol=rtol, atol=rtol * 1e-1, err_msg=name)
    start = {n: p.detach().numpy() for n, p in _net().named_parameters()}
    assert all(not np.array_equal(start[n], v) for n, v in theirs.items())  # every group trained
    return model


# -- one trajectory per class: two groups with different settings ----------------------------------
def test_sgd_groups_momentum_nesterov_dampening():
    def make(net):
        mats, vecs = _split(net)
        return torch.optim.SGD([{"params": mats, "weight_decay": 1e-2},
                                {"params": vecs, "lr": 0.02, "momentum": 0.5, "dampening": 0.1, "nesterov": False}],
                               lr=0.05, momentum=0.9, nesterov=True, foreach=False)
    model = _check(make, SGD)
    attrs = [g.optimizer.attrs() for g in model.param_groups]
    assert attrs[0]["nesterov"] and not attrs[1]["nesterov"] and attrs[1]["dampening"] == 0.1


def test_adam_groups_amsgrad_betas_eps_maximize():
    def make(net):
        mats, vecs = _split(net)
        return torch.optim.Adam([{"params": mats, "weight_decay": 1e-2, "amsgrad": True},
                                 {"params": vecs, "lr": 3e-3, "betas": (0.8, 0.99), "eps": 1e-6, "maximize": True}],
                                lr=1e-2)
    _check(make, Adam)


def test_adamw_groups_as_nanogpt_configures_them():
    _check(lambda net: net.configure_optimizers(0.1, 6e-3, (0.9, 0.95)), AdamW)


def test_adam_with_decoupled_weight_decay_is_adamw():
    def make(net):
        mats, vecs = _split(net)
        return torch.optim.Adam([{"params": mats, "weight_decay": 0.2}, {"params": vecs, "lr": 2e-2}],
                                lr=1e-2, weight_decay=0.05, decoupled_weight_decay=True)
    _check(make, AdamW)


def test_adagrad_groups():
    def make(net):
        mats, vecs = _split(net)
        return torch.optim.Adagrad([{"params": mats, "lr_decay": 0.05, "initial_accumulator_value": 0.1},
                                    {"params": vecs, "lr": 0.05, "weight_decay": 1e-2, "eps": 1e-8}], lr=0.1)
    _check(make, Adagrad)


def test_rmsprop_groups():
    def make(net):
        mats, vecs = _split(net)
        return torch.optim.RMSprop([{"params": mats, "momentum": 0.9, "centered": True},
                                    {"params": vecs, "alpha": 0.9, "weight_decay": 1e-2}], lr=1e-2)
    _check(make, RMSprop)


def test_adadelta_groups():
    def make(net):
        mats, vecs = _split(net)
        return torch.optim.Adadelta([{"params": mats, "rho": 0.95},
                                     {"params": vecs, "lr": 0.5, "weight_decay": 1e-2, "eps": 1e-5}], lr=1.0)
    _check(make, Adadelta)


# -- what the conversion carries, skips and refuses ------------------------------------------------
def test_groups_name_the_modules_parameters_and_skip_frozen_ones():
    net = _net()
    net.norm.weight.requires_grad_(False)  # torch skips it (no gradient), and so does the conversion
    mats, vecs = _split(net)
    opt = from_torch(torch.optim.SGD([{"params": vecs, "lr": 0.1}, {"params": mats}], lr=0.01), net)
    assert opt.lr == 0.01 and [g["params"] for g in opt.param_groups] == [
        ["fc1.bias", "norm.bias", "fc2.bias"], ["fc1.weight", "fc2.weight"]]
    assert opt.param_groups[0]["lr"] == 0.1 and opt.param_groups[1]["lr"] == 0.01
    assert opt.config()["param_groups"][0]["params"] == ["fc1.bias", "norm.bias", "fc2.bias"]


def test_a_scheduler_built_first_leaves_the_groups_base_rate():
    net = _net()
    opt = torch.optim.AdamW(net.parameters(), lr=0.01)
    torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.1)  # sets lr to 0.001, initial_lr 0.01
    assert from_torch(opt, net).param_groups[0]["lr"] == pytest.approx(0.01)


def _refused(opt, module, *words: str) -> None:
    with pytest.raises(AnygradError) as e:
        from_torch(opt, module)
    for w in words:
        assert w in str(e.value), str(e.value)


@pytest.mark.parametrize("cls, setting", [
    (torch.optim.Adam, {"capturable": True}),
    (torch.optim.SGD, {"differentiable": True}),
    (torch.optim.RMSprop, {"capturable": True}),
    (torch.optim.Adadelta, {"differentiable": True}),
])
def test_settings_anygrad_lacks_are_refused_by_name(cls, setting):
    net = _net()
    _refused(cls(net.parameters(), lr=0.01, **setting), net, next(iter(setting)))


def test_foreach_and_fused_are_ignored():
    net = _net()
    opt = from_torch(torch.optim.AdamW(net.parameters(), lr=0.01, foreach=True), net)
    assert isinstance(opt, AdamW)
    opt = from_torch(torch.optim.SGD(net.parameters(), lr=0.01, fused=True), net)
    assert isinstance(opt, SGD)


def test_tensor_lr_unknown_classes_and_subclasses_are_refused():
    net = _net()
    _refused(torch.optim.Adam(net.parameters(), lr=torch.tensor(0.01)), net, "lr", "tensor")
    _refused(torch.optim.Adamax(net.parameters()), net, "Adamax", "SGD, Adam")

    class Mine(torch.optim.SGD):
        pass
    _refused(Mine(net.parameters(), lr=0.1), net, "Mine", "subclass")
    _refused(object(), net, "object")
    _refused(torch.optim.SGD(net.parameters(), lr=0.1), object(), "nn.Module")


def test_mixed_decoupling_between_groups_is_refused():
    net = _net()
    mats, vecs = _split(net)
    opt = torch.optim.Adam([{"params": mats}, {"params": vecs, "decoupled_weight_decay": True}], lr=0.01)
    _refused(opt, net, "decoupled_weight_decay", "param_groups[1]")


def test_parameters_outside_the_module_or_the_optimizer():
    net, other = _net(), _net(1)
    _refused(torch.optim.SGD(other.parameters(), lr=0.1), net, "not a parameter of the given Net")
    mats, _ = _split(net)
    _refused(torch.optim.SGD(mats, lr=0.1), net, "does not update", "fc1.bias", "requires_grad_(False)")


def test_an_optimizer_that_has_stepped_is_refused():
    net = _net()
    opt = torch.optim.Adam(net.parameters(), lr=0.01)
    net(torch.randn(2, 5)).sum().backward()
    opt.step()
    _refused(opt, net, "already taken steps")


def test_schedulers_go_to_the_scheduler_table():
    from anygrad.optim.torch_schedulers import scheduler_from_torch
    net = _net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    converted = from_torch(sched, net)
    assert converted == scheduler_from_torch(sched, net) and converted is not None
