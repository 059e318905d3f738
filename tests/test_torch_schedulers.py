"""torch.optim.lr_scheduler objects converted by anygrad.optim.from_torch: every group's rate at
every step equals torch's (float64), from a fresh scheduler and from one already stepped."""
import json
import math
import warnings

import pytest
import torch
from torch.optim import lr_scheduler as tls

import anygrad
from anygrad.errors import AnygradError
from anygrad.optim import GroupSchedule, get_scheduler

STEPS = 40
LRS = (0.1, 0.02, 0.5)  # three groups, each scaled from its own initial rate


class Three(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2), torch.nn.Linear(2, 1)


def _optimizer(module):
    layers = (module.a, module.b, module.c)
    return torch.optim.SGD([{"params": m.parameters(), "lr": lr} for m, lr in zip(layers, LRS)], lr=0.1,
                           momentum=0.9)


def _warmup_cosine(step, warmup=5, total=30):
    """nanoGPT's get_lr as a factor: linear warmup, cosine to a tenth."""
    if step < warmup:
        return (step + 1) / (warmup + 1)
    ratio = min(1.0, (step - warmup) / (total - warmup))
    return 0.1 + 0.5 * (1.0 + math.cos(math.pi * ratio)) * 0.9


def _hf(name):
    transformers = pytest.importorskip("transformers")
    return lambda o: getattr(transformers, name)(o, num_warmup_steps=6, num_training_steps=30)


CASES = {
    "LambdaLR": lambda o: tls.LambdaLR(o, _warmup_cosine),
    "LambdaLR-per-group": lambda o: tls.LambdaLR(o, [_warmup_cosine, lambda t: 0.9 ** t,
                                                     lambda t: 1.0 / (t + 1)]),
    "MultiplicativeLR": lambda o: tls.MultiplicativeLR(o, lambda t: 0.97 if t % 3 else 0.8),
    "StepLR": lambda o: tls.StepLR(o, step_size=7, gamma=0.5),
    "MultiStepLR": lambda o: tls.MultiStepLR(o, milestones=[3, 10, 10, 25], gamma=0.7),
    "ExponentialLR": lambda o: tls.ExponentialLR(o, gamma=0.93),
    "LinearLR": lambda o: tls.LinearLR(o, start_factor=0.1, end_factor=0.9, total_iters=12),
    "CosineAnnealingLR": lambda o: tls.CosineAnnealingLR(o, T_max=9, eta_min=1e-3),  # past T_max too
    "CosineAnnealingWarmRestarts": lambda o: tls.CosineAnnealingWarmRestarts(o, T_0=4, T_mult=2,
                                                                             eta_min=0.01),
    "OneCycleLR": lambda o: tls.OneCycleLR(o, max_lr=[0.3, 0.05, 1.0], total_steps=STEPS + 5,
                                           cycle_momentum=False),
    "OneCycleLR-three-phase": lambda o: tls.OneCycleLR(o, max_lr=0.4, total_steps=STEPS, pct_start=0.35,
                                                       anneal_strategy="linear", three_phase=True,
                                                       div_factor=7.0, final_div_factor=33.0,
                                                       cycle_momentum=False),
    "ReduceLROnPlateau": lambda o: tls.ReduceLROnPlateau(o, patience=1, factor=0.5, cooldown=1,
                                                         min_lr=[0.0, 0.004, 0.2]),
    "SequentialLR": lambda o: tls.SequentialLR(o, [tls.LinearLR(o, start_factor=0.05, total_iters=5),
                                                   tls.CosineAnnealingLR(o, T_max=20, eta_min=1e-4)],
                                               milestones=[5]),
    "SequentialLR-three": lambda o: tls.SequentialLR(o, [tls.LambdaLR(o, lambda t: (t + 1) / 4),
                                                         tls.MultiplicativeLR(o, lambda t: 0.9),
                                                         tls.StepLR(o, step_size=4, gamma=0.5)],
                                                     milestones=[3, 11]),
    "SequentialLR-restarts": lambda o: tls.SequentialLR(o, [tls.ExponentialLR(o, gamma=0.8),
                                                            tls.CosineAnnealingWarmRestarts(o, T_0=6)],
                                                        milestones=[4]),
    "ChainedScheduler": lambda o: tls.ChainedScheduler([tls.LinearLR(o, start_factor=0.2, total_iters=8),
                                                        tls.ExponentialLR(o, gamma=0.95)]),
    "ChainedScheduler-lambda": lambda o: tls.ChainedScheduler([tls.StepLR(o, step_size=5, gamma=0.3),
                                                               tls.MultiplicativeLR(o, lambda t: 0.99)]),
    "get_linear_schedule_with_warmup": _hf("get_linear_schedule_with_warmup"),
    "get_cosine_schedule_with_warmup": _hf("get_cosine_schedule_with_warmup"),
}


def _metric(i):
    """A validation loss with plateaus, for ReduceLROnPlateau."""
    return [1.0, 0.9, 0.9, 0.9, 0.85, 0.85, 0.85, 0.85, 0.7, 0.7][i % 10] - 0.01 * (i // 10)


def _torch_run(factory, before=0):
    """(the torch scheduler after `before` steps, the rates of every group at every later step)."""
    module = Three()
    opt = _optimizer(module)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        sched = factory(opt)
        plateau = isinstance(sched, tls.ReduceLROnPlateau)
        for i in range(before):
            opt.step()
            sched.step(_metric(i)) if plateau else sched.step()
        converted = anygrad.optim.from_torch(sched, module)
        rates = [[g["lr"] for g in opt.param_groups]]
        for i in range(before, STEPS):
            opt.step()
            sched.step(_metric(i)) if plateau else sched.step()
            rates.append([g["lr"] for g in opt.param_groups])
    return converted, rates, plateau


def _ours(schedule, start, plateau):
    return [schedule.lrs] + [schedule.step(_metric(i) if plateau else None) for i in range(start, STEPS)]


def _close(ours, ref):
    assert len(ours) == len(ref)
    for i, (a_row, b_row) in enumerate(zip(ours, ref)):
        for g, (a, b) in enumerate(zip(a_row, b_row)):
            assert abs(a - b) <= 1e-12 * max(abs(a), abs(b)), \
                f"step {i} group {g}: anygrad {a!r}, torch {b!r}"


@pytest.mark.parametrize("case", list(CASES))
def test_trajectory_matches_torch(case):
    converted, ref, plateau = _torch_run(CASES[case])
    assert isinstance(converted, GroupSchedule) and len(converted.lanes) == 3
    assert converted.interval == ("epoch" if plateau else "step")  # plateau steps on the epoch's metric
    _close(_ours(converted, 0, plateau), ref)
    assert len({tuple(r) for r in ref}) > 1, "the schedule should move"


@pytest.mark.parametrize("case", list(CASES))
def test_converts_a_stepped_scheduler_at_its_position(case):
    before = 13
    converted, ref, plateau = _torch_run(CASES[case], before)
    assert converted.steps == before
    _close(_ours(converted, before, plateau), ref)


@pytest.mark.parametrize("case", ["LambdaLR-per-group", "SequentialLR", "ReduceLROnPlateau", "OneCycleLR"])
def test_state_round_trip(case):
    """state_dict through strict JSON, loaded into a fresh conversion: the same sequence on."""
    converted, ref, plateau = _torch_run(CASES[case])
    for i in range(9):
        converted.step(_metric(i) if plateau else None)
    state = json.loads(json.dumps(converted.state_dict(), allow_nan=False))
    fresh, _, _ = _torch_run(CASES[case])
    fresh.load_state_dict(state)
    _close(_ours(fresh, 9, plateau), ref[9:])


def test_anygrad_scheduler_spreads_over_groups_as_torch():
    """An anygrad Scheduler (by name) on several groups: each lane from its group's initial rate."""
    module = Three()
    opt = _optimizer(module)
    sched = tls.CosineAnnealingLR(opt, T_max=15, eta_min=0.001)
    ref = [[g["lr"] for g in opt.param_groups]]
    for _ in range(STEPS):
        opt.step()
        sched.step()
        ref.append([g["lr"] for g in opt.param_groups])
    ours = GroupSchedule.build(get_scheduler("cosine", LRS[0], T_max=15, eta_min=0.001), list(LRS))
    _close(_ours(ours, 0, False), ref)
    plain = GroupSchedule.build(_warmup_cosine, list(LRS))  # a plain function: a LambdaLR per group
    assert plain.lrs == [lr * _warmup_cosine(0) for lr in LRS]
    assert plain.step() == [lr * _warmup_cosine(1) for lr in LRS]


UNSUPPORTED = [
    (lambda o: tls.ConstantLR(o, factor=0.5), "ConstantLR is not one anygrad converts"),
    (lambda o: tls.OneCycleLR(o, max_lr=0.1, total_steps=10), "cycle_momentum"),
    (lambda o: tls.CyclicLR(o, base_lr=0.01, max_lr=0.1, cycle_momentum=False), "CyclicLR is not one"),
]


@pytest.mark.parametrize("factory,message", UNSUPPORTED, ids=["ConstantLR", "cycle_momentum", "CyclicLR"])
def test_unsupported_settings_are_named(factory, message):
    module = Three()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        sched = factory(_optimizer(module))
    with pytest.raises(AnygradError, match=message):
        anygrad.optim.from_torch(sched, module)


def test_bad_schedule_values_name_the_option():
    with pytest.raises(AnygradError, match="scheduler_interval must be one of epoch, step"):
        GroupSchedule.build(_warmup_cosine, [0.1], interval="batch")
    with pytest.raises(AnygradError, match="scheduler must be an anygrad Scheduler"):
        GroupSchedule.build(42, [0.1])
    with pytest.raises(AnygradError, match="3 lr_lambda functions for 2 parameter groups"):
        GroupSchedule.build(get_scheduler("lambda", 0.1, lr_lambda=[abs, abs, abs]), [0.1, 0.2])
    with pytest.raises(AnygradError, match="lr_lambda must be a function"):
        get_scheduler("lambda", 0.1)
    with pytest.raises(AnygradError, match=r"lr_lambda\(0\) returned 'x', not a number"):
        get_scheduler("lambda", 0.1, lr_lambda=lambda t: "x")
    with pytest.raises(AnygradError, match="milestones must list one step fewer"):
        get_scheduler("sequential", 0.1, schedulers=[get_scheduler("exp", 0.1, gamma=0.5)], milestones=[3])
    with pytest.raises(AnygradError, match="steps on a metric"):
        get_scheduler("chained", 0.1, schedulers=[get_scheduler("plateau", 0.1)])
    with pytest.raises(AnygradError, match="T_0 must be >= 1"):
        get_scheduler("cosine_restarts", 0.1, T_0=0)
    with pytest.raises(AnygradError, match="scheduler_interval must be 'epoch'"):
        GroupSchedule.build(get_scheduler("plateau", 0.1), [0.1], interval="step")
    converted, _, _ = _torch_run(CASES["StepLR"])
    with pytest.raises(AnygradError, match="schedules 3 parameter groups, the model's optimizer has 1"):
        GroupSchedule.build(converted, [0.1])
    with pytest.raises(AnygradError, match="group 1 starts at lr 0.03 in the optimizer but 0.02 in the"):
        GroupSchedule.build(converted, [0.1, 0.03, 0.5])
