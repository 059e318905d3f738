"""Learning-rate schedulers vs torch.optim.lr_scheduler: the same rate at every step (float64)."""
import json
import math
import warnings

import pytest
import torch
from torch.optim import lr_scheduler as tls

from anygrad.errors import ConfigError
from anygrad.optim import SCHEDULERS, Scheduler, get_scheduler

STEPS = 50
BASE_LR = 0.1


def torch_cosine(opt, T_max, eta_min=0.0, warmup_steps=0, warmup_start_factor=1.0 / 3):
    """The recipe anygrad's "cosine" with warmup_steps reproduces."""
    cosine = tls.CosineAnnealingLR(opt, T_max=T_max, eta_min=eta_min)
    if not warmup_steps:
        return cosine
    warm = tls.LinearLR(opt, start_factor=warmup_start_factor, end_factor=1.0, total_iters=warmup_steps)
    return tls.SequentialLR(opt, [warm, cosine], milestones=[warmup_steps])


def torch_onecycle(opt, **kw):
    return tls.OneCycleLR(opt, **{"max_lr": BASE_LR, **kw})


TORCH = {
    "step": tls.StepLR, "multistep": tls.MultiStepLR, "exponential": tls.ExponentialLR,
    "cosine": torch_cosine, "linear": tls.LinearLR, "onecycle": torch_onecycle,
    "plateau": tls.ReduceLROnPlateau,
}

CASES = [
    ("step", {"step_size": 1}),
    ("step", {"step_size": 7, "gamma": 0.5}),
    ("step", {"step_size": 3, "gamma": 0.9}),
    ("multistep", {"milestones": [5, 20, 35]}),
    ("multistep", {"milestones": [0, 10, 10, 30], "gamma": 0.7}),  # a repeated milestone: gamma**2
    ("exponential", {"gamma": 0.95}),
    ("exponential", {"gamma": 0.77}),
    ("cosine", {"T_max": 50}),
    ("cosine", {"T_max": 10}),  # past T_max: torch's recursion through the special case
    ("cosine", {"T_max": 7, "eta_min": 1e-3}),
    ("cosine", {"T_max": 13, "eta_min": 0.01}),
    ("cosine", {"T_max": 40, "warmup_steps": 5}),
    ("cosine", {"T_max": 20, "eta_min": 1e-4, "warmup_steps": 3, "warmup_start_factor": 0.01}),
    ("cosine", {"T_max": 9, "eta_min": 0.02, "warmup_steps": 1, "warmup_start_factor": 0.5}),
    ("linear", {}),
    ("linear", {"start_factor": 0.1, "total_iters": 10}),
    ("linear", {"start_factor": 1.0, "end_factor": 0.0, "total_iters": 40}),
    ("linear", {"start_factor": 0.25, "end_factor": 0.5, "total_iters": 60}),
    ("onecycle", {"total_steps": 50}),
    ("onecycle", {"total_steps": 50, "anneal_strategy": "linear", "pct_start": 0.25}),
    ("onecycle", {"total_steps": 60, "three_phase": True, "div_factor": 10.0, "final_div_factor": 100.0}),
    ("onecycle", {"total_steps": 55, "three_phase": True, "anneal_strategy": "linear", "max_lr": 0.3}),
    ("onecycle", {"epochs": 5, "steps_per_epoch": 11, "pct_start": 0.45}),
    ("onecycle", {"total_steps": 50, "pct_start": 0.0}),
    ("plateau", {"patience": 2}),
    ("plateau", {"patience": 0, "factor": 0.5}),
    ("plateau", {"mode": "max", "patience": 1, "factor": 0.3}),
    ("plateau", {"mode": "max", "threshold_mode": "abs", "threshold": 0.05, "patience": 2, "cooldown": 2}),
    ("plateau", {"threshold_mode": "abs", "threshold": 0.01, "patience": 1, "cooldown": 3, "min_lr": 2e-3}),
    ("plateau", {"patience": 0, "factor": 0.5, "min_lr": 0.099999995, "eps": 1e-8}),  # eps skips tiny cuts
]


def metrics(mode: str) -> list[float]:
    """A metric with improvements, exact plateaus and small relative/absolute changes, oriented so
    that "better" means lower for mode "min" and higher for mode "max"."""
    loss = [1.0, 0.8, 0.8, 0.8, 0.79995, 0.7, 0.71, 0.72, 0.69, 0.69, 0.69, 0.69, 0.5, 0.49, 0.48, 0.48]
    seq = (loss * 4)[:STEPS]
    seq = [v - 0.001 * (i // len(loss)) for i, v in enumerate(seq)]
    return seq if mode == "min" else [-v for v in seq]


def torch_sequence(name: str, options: dict) -> list[float]:
    param = torch.zeros(1, requires_grad=True)
    opt = torch.optim.SGD([param], lr=BASE_LR, momentum=0.9)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        sched = TORCH[name](opt, **options)
        feed = metrics(options.get("mode", "min"))
        out = [opt.param_groups[0]["lr"]]
        for i in range(STEPS):
            opt.step()
            sched.step(feed[i]) if name == "plateau" else sched.step()
            out.append(opt.param_groups[0]["lr"])
    return out


def anygrad_sequence(sched: Scheduler, start: int = 0) -> list[float]:
    feed = metrics(getattr(sched, "mode", "min"))
    return [sched.lr] + [sched.step(feed[i]) for i in range(start, STEPS)]


def assert_close(ours: list[float], ref: list[float]) -> None:
    assert len(ours) == len(ref)
    for i, (a, b) in enumerate(zip(ours, ref)):
        assert abs(a - b) <= 1e-12 * max(abs(a), abs(b)), f"step {i}: anygrad {a!r}, torch {b!r}"


@pytest.mark.parametrize("name,options", CASES, ids=[f"{n}-{i}" for i, (n, _) in enumerate(CASES)])
def test_matches_torch(name, options):
    ref = torch_sequence(name, options)
    ours = anygrad_sequence(get_scheduler(name, BASE_LR, **options))
    assert_close(ours, ref)
    if name == "plateau":
        assert len(set(ref)) > 1 or options.get("min_lr"), "the metric sequence should trigger a reduction"
    else:
        # lr_at replays the same recursion without touching the scheduler
        sched = get_scheduler(name, BASE_LR, **options)
        assert_close([sched.lr_at(i) for i in range(STEPS + 1)], ref)
        assert sched.steps == 0 and sched.lr == ref[0]


@pytest.mark.parametrize("name,options", CASES, ids=[f"{n}-{i}" for i, (n, _) in enumerate(CASES)])
def test_resume_from_state_dict(name, options):
    ref = anygrad_sequence(get_scheduler(name, BASE_LR, **options))
    for cut in (1, 17, 33):
        first = get_scheduler(name, BASE_LR, **options)
        feed = metrics(options.get("mode", "min"))
        for i in range(cut):
            first.step(feed[i])
        state = json.loads(json.dumps(first.state_dict(), allow_nan=False))  # strict JSON round trip
        resumed = get_scheduler(**json.loads(json.dumps(first.config())))
        resumed.load_state_dict(state)
        assert resumed.steps == cut
        assert_close(anygrad_sequence(resumed, start=cut), ref[cut:])


def test_interval_defaults_and_override():
    options = {**dict(CASES), "cosine_restarts": {"T_0": 5}, "lambda": {"lr_lambda": abs},
               "multiplicative": {"lr_lambda": abs},
               "sequential": {"schedulers": [get_scheduler("step", BASE_LR, step_size=2)]},
               "chained": {"schedulers": [get_scheduler("step", BASE_LR, step_size=2)]}}
    assert {n: c(BASE_LR, **options[n]).interval for n, c in SCHEDULERS.items()} == {
        "step": "epoch", "multistep": "epoch", "exponential": "epoch", "cosine": "epoch",
        "linear": "epoch", "onecycle": "step", "plateau": "epoch", "cosine_restarts": "epoch",
        "lambda": "step", "multiplicative": "epoch", "sequential": "epoch", "chained": "epoch"}
    assert get_scheduler("cosine", 0.1, T_max=100, interval="step").interval == "step"


def test_aliases_and_option_coercion():
    assert get_scheduler("One-Cycle", 0.1, total_steps="20").config()["total_steps"] == 20
    assert get_scheduler("reduce_on_plateau", 0.1).name == "plateau"
    assert get_scheduler("CosineAnnealingLR", 0.1, T_max=5.0).T_max == 5
    assert get_scheduler("warmup", 0.1).name == "linear"
    assert get_scheduler("exp", 0.1, gamma="0.5").lr_at(2) == 0.1 * 0.5 * 0.5
    ms = get_scheduler("multistep", 0.1, milestones="30, 10")
    assert ms.milestones == [10, 30] and ms.lr_at(10) == pytest.approx(0.01) and ms.lr_at(30) == pytest.approx(1e-3)
    oc = get_scheduler("onecycle", 0.2, epochs="3", steps_per_epoch=4, three_phase="true")
    assert oc.total_steps == 12 and oc.three_phase is True and oc.max_lr == 0.2
    assert oc.lr == pytest.approx(0.2 / 25)


def test_reset_and_lr_at_do_not_interfere():
    s = get_scheduler("cosine", BASE_LR, T_max=10)
    seq = [s.lr] + [s.step() for _ in range(5)]
    assert s.lr_at(2) == seq[2] and s.steps == 5 and s.lr == seq[5]
    s.reset()
    assert s.steps == 0 and s.lr == BASE_LR


BAD = [
    (("nope", {}), "unknown learning-rate scheduler 'nope'"),
    (("step", {"step_size": 0}), "step_size must be >= 1"),
    (("step", {}), "needs step_size"),
    (("exponential", {}), "needs gamma"),
    (("cosine", {}), "needs T_max"),
    (("step", {"stepsize": 3}), "does not take option(s) stepsize"),
    (("step", {"step_size": 2, "gamma": "fast"}), "gamma must be a number"),
    (("multistep", {}), "milestones must list at least one epoch"),
    (("multistep", {"milestones": [3, -1]}), "milestones must be epochs >= 0"),
    (("multistep", {"milestones": [2.5]}), "milestones must be a list of integers"),
    (("exponential", {"gamma": -0.5}), "gamma must be > 0"),
    (("cosine", {"T_max": 0}), "T_max must be >= 1"),
    (("cosine", {"T_max": 10, "warmup_start_factor": 0}), "warmup_start_factor must be in (0, 1]"),
    (("linear", {"start_factor": 0}), "start_factor must be in (0, 1]"),
    (("linear", {"end_factor": 1.5}), "end_factor must be in [0, 1]"),
    (("onecycle", {}), "give total_steps, or epochs and steps_per_epoch"),
    (("onecycle", {"total_steps": 10, "pct_start": 1.5}), "pct_start must be in [0, 1]"),
    (("onecycle", {"total_steps": 10, "anneal_strategy": "cosine"}), "anneal_strategy must be one of cos, linear"),
    (("onecycle", {"total_steps": 10, "pct_start": 0.1}), "zero length"),
    (("plateau", {"mode": "lowest"}), "mode must be 'min' or 'max'"),
    (("plateau", {"threshold_mode": "pct"}), "threshold_mode must be 'rel' or 'abs'"),
    (("plateau", {"factor": 1.0}), "factor must be in (0, 1)"),
    (("plateau", {"interval": "batch"}), "interval must be one of epoch, step"),
]


@pytest.mark.parametrize("args,message", BAD, ids=[m[:30] for _, m in BAD])
def test_bad_configs(args, message):
    name, options = args
    with pytest.raises(ConfigError) as e:
        get_scheduler(name, BASE_LR, **options)
    assert message in str(e.value)


def test_bad_usage():
    oc = get_scheduler("onecycle", 0.1, total_steps=3)
    for _ in range(3):
        oc.step()
    with pytest.raises(ConfigError, match="total_steps is 3"):
        oc.step()
    with pytest.raises(ConfigError, match="total_steps is 3"):
        oc.lr_at(4)
    plateau = get_scheduler("plateau", 0.1)
    with pytest.raises(ConfigError, match="needs the monitored metric"):
        plateau.step()
    with pytest.raises(ConfigError, match="depends on the metrics"):
        plateau.lr_at(3)
    with pytest.raises(ConfigError, match="step must be an integer >= 0"):
        get_scheduler("step", 0.1, step_size=2).lr_at(-1)
    with pytest.raises(ConfigError, match="state is for 'step', not 'cosine'"):
        get_scheduler("cosine", 0.1, T_max=5).load_state_dict(
            get_scheduler("step", 0.1, step_size=2).state_dict())
    with pytest.raises(ConfigError, match="corrupt state"):
        get_scheduler("plateau", 0.1).load_state_dict({"name": "plateau", "steps": 2, "lr": 0.1})


def test_plateau_state_is_strict_json():
    s = get_scheduler("plateau", 0.1, mode="MAX")
    assert s.state_dict()["best"] is None  # -inf has no JSON spelling
    s.step(0.5)
    assert s.state_dict()["best"] == 0.5
    assert math.isinf(get_scheduler("plateau", 0.1).best)
