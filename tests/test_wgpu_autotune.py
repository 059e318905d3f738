"""The GEMM autotuner (backends/wgpu/tuning/autotune.py): candidates timed on the device, the fastest pinned,
winners stored per adapter and looked up on the next compile, a hostile cache file ignored, and a
tuned step computing what numpy computes."""
from __future__ import annotations

import json

import numpy as np
import pytest
from test_wgpu_gemm_fold import _graph, rnd
from wgpu_util import assert_close, run_both, wgpu_backend

from anygrad.backends.wgpu.kernels.kernel import AdapterCaps
from anygrad.backends.wgpu.tuning import autotune
from anygrad.errors import ConfigError
from anygrad.ir import Node

pytestmark = pytest.mark.wgpu


@pytest.fixture
def tuning(monkeypatch, tmp_path):
    """Tuning on (lavapipe has it off by default), any GEMM worth tuning, a private cache folder."""
    monkeypatch.setenv(autotune.ENV, "1")
    monkeypatch.setenv("ANYGRAD_CACHE", str(tmp_path))
    monkeypatch.setattr(autotune, "MIN_FLOPS", 0)
    monkeypatch.setattr(autotune, "REPEATS", 2)
    monkeypatch.setattr(autotune, "ROUNDS", 1)
    for k in autotune.stats:
        monkeypatch.setitem(autotune.stats, k, 0)
    return tmp_path


def _mlp_graph():
    feeds = {"x": rnd(4, 6, 24, seed=1), "W": rnd(24, 40, seed=2), "b": rnd(40, seed=3)}
    nodes = [Node("MatMul", ["x", "W"], ["xw"], name="mm"), Node("Add", ["xw", "b"], ["pre"], name="add"),
             Node("Relu", ["pre"], ["y"], name="act")]
    return _graph(feeds, nodes, "y", grad=True), feeds


def _pins(exe) -> list[dict]:
    return [{a: n.attrs[a] for a in autotune.PIN_ATTRS if a in n.attrs}
            for n in exe.prepared.nodes if n.op in autotune.TUNABLE_OPS]


def test_a_tuned_training_graph_matches_numpy_and_is_stored(tuning):
    graph, feeds = _mlp_graph()
    want, got, exe = run_both(graph, feeds)
    assert_close(want, got, rtol=2e-4, atol=2e-5)
    # forward GEMM, input gradient, weight gradient: three shapes timed
    assert autotune.stats["timed"] == 3 and autotune.stats["candidates"] >= 6
    (stored,) = (tuning / "wgpu-autotune").glob("*.json")
    table = json.loads(stored.read_text())
    assert len(table) == 3 and all(pin in autotune.CANDIDATES for pin in table.values())
    assert all(p in autotune.CANDIDATES for p in _pins(exe))

    # a second compile (a new backend, as a new process would have) looks the winners up
    _, again, exe2 = run_both(graph, feeds, backend=wgpu_backend())
    assert autotune.stats["timed"] == 3
    assert _pins(exe2) == _pins(exe)
    assert_close(got, again, rtol=0, atol=0)  # the same plan: the same bits


def test_the_fastest_candidate_wins_and_ties_keep_the_rules(tuning):
    graph, _ = _mlp_graph()
    caps = AdapterCaps()
    fwd = next(n for n in graph.nodes if n.op == "MatMul")
    one = graph.copy()
    one.nodes = [fwd]
    want = {"_gemm_variant": "register", "_gemm_block": 8}

    from anygrad.backends.wgpu.kernels.kernel import LOWERINGS
    fastest = [k.wgsl for k in LOWERINGS["MatMul"](autotune._pinned(fwd, want), one, caps)]

    def timer(kernels, g):
        return 1.0 if [k.wgsl for k in kernels] == fastest else 2.0
    before = len(autotune.picks)
    tuned = autotune.tune(one, caps, ("fake adapter",), timer)
    assert {a: tuned.nodes[0].attrs[a] for a in autotune.PIN_ATTRS if a in tuned.nodes[0].attrs} == want
    # the pick is reported: the rules' kernels and time against the winner's
    (pick,) = autotune.picks[before:]
    rules = [k.name for k in LOWERINGS["MatMul"](fwd, one, caps)]
    assert (pick.op, pick.rule, pick.rule_ms, pick.best_ms) == ("MatMul", tuple(rules), 2.0, 1.0)
    assert pick.best == tuple(k.name for k in LOWERINGS["MatMul"](autotune._pinned(fwd, want), one, caps))
    assert pick.shapes == tuple(tuple(one.info[v].shape) for v in fwd.inputs)

    def noise(kernels, g):  # every candidate within 3% of the rules' own tiling: keep the rules
        return 1.0 + (len(kernels[0].wgsl) % 3) / 100
    tuned = autotune.tune(one, caps, ("another adapter",), noise)
    assert not any(a in tuned.nodes[0].attrs for a in autotune.PIN_ATTRS)


def test_a_slow_spell_during_the_rules_timing_does_not_crown_another_tiling(tuning):
    """The rules' tiling is timed first and, that once, during a slow spell of the device (5.0 instead
    of 1.0); another tiling really takes 1.5. The leaders and the rules are timed again, so the
    rules keep the node; a really faster tiling (0.5) still wins over both timings."""
    graph, _ = _mlp_graph()
    caps = AdapterCaps()
    fwd = next(n for n in graph.nodes if n.op == "MatMul")
    one = graph.copy()
    one.nodes = [fwd]
    from anygrad.backends.wgpu.kernels.kernel import LOWERINGS
    rules = [k.wgsl for k in LOWERINGS["MatMul"](fwd, one, caps)]
    other_pin = {"_gemm_variant": "register", "_gemm_block": 8}
    other = [k.wgsl for k in LOWERINGS["MatMul"](autotune._pinned(fwd, other_pin), one, caps)]
    assert rules != other

    def timer_with(other_ms: float):
        seen = []

        def timer(kernels, g):
            code = [k.wgsl for k in kernels]
            seen.append(code)
            if code == rules:
                return 5.0 if seen.count(rules) == 1 else 1.0
            return other_ms if code == other else 3.0
        return timer
    for other_ms, want in ((1.5, {}), (0.5, other_pin)):
        tuned = autotune.tune(one, caps, (f"adapter {other_ms}",), timer_with(other_ms))
        assert {a: tuned.nodes[0].attrs[a] for a in autotune.PIN_ATTRS if a in tuned.nodes[0].attrs} == want


def test_off_means_the_rule_based_plan(tuning, monkeypatch):
    monkeypatch.setenv(autotune.ENV, "0")
    graph, feeds = _mlp_graph()
    _, _, exe = run_both(graph, feeds)
    assert autotune.stats["timed"] == 0 and _pins(exe) == [{}] * len(_pins(exe))
    assert not (tuning / "wgpu-autotune").exists()
    assert autotune.enabled(AdapterCaps(is_cpu=True)) is False
    monkeypatch.delenv(autotune.ENV)
    assert autotune.enabled(AdapterCaps(is_cpu=True)) is False  # software adapters: off unless asked
    assert autotune.enabled(AdapterCaps(is_cpu=False)) is True


@pytest.mark.parametrize("content", [b"", b"\xff\xfe not json", b"[1, 2]", b'{"k": {"_gemm_variant": "evil"}}',
                                     b'{"k": "shared"}', b"{" * 100000, b'{"k": {"_gemm_kt": 1e400}}'])
def test_a_hostile_or_corrupt_cache_is_ignored(tuning, content):
    graph, _ = _mlp_graph()
    caps = AdapterCaps()
    path = autotune.cache_file(("ctx",))
    path.parent.mkdir(parents=True)
    path.write_bytes(content)
    assert autotune._load(path) == {}
    key = autotune.shape_key(next(n for n in graph.nodes if n.op == "MatMul"), graph)
    path.write_bytes(json.dumps({key: {"_gemm_variant": "evil"}}).encode())
    tuned = autotune.tune(graph, caps, ("ctx",), None)  # no timer: stored winners only, evil ignored
    assert all(not any(a in n.attrs for a in autotune.PIN_ATTRS) for n in tuned.nodes)


def test_pinned_nodes_and_small_gemms_are_left_alone(tuning, monkeypatch):
    graph, _ = _mlp_graph()
    calls = []

    def timer(kernels, g):
        calls.append(kernels[0].name)
        return 1.0
    pinned = graph.copy()
    for n in pinned.nodes:
        if n.op in autotune.TUNABLE_OPS:
            n.attrs["_gemm_variant"] = "shared"
    assert autotune.tune(pinned, AdapterCaps(), ("c",), timer) is pinned and not calls
    monkeypatch.setattr(autotune, "MIN_FLOPS", 10 ** 12)
    assert autotune.tune(graph, AdapterCaps(), ("c",), timer) is graph and not calls


def test_the_time_budget_leaves_the_rest_to_later_compiles(tuning, monkeypatch):
    graph, _ = _mlp_graph()
    monkeypatch.setattr(autotune, "BUDGET_S", 0.0)
    assert autotune.tune(graph, AdapterCaps(), ("c",), lambda k, g: 1.0) is graph
    assert autotune.stats["timed"] == 0 and not (tuning / "wgpu-autotune").exists()
    monkeypatch.setattr(autotune, "BUDGET_S", 60.0)
    autotune.tune(graph, AdapterCaps(), ("c",), lambda k, g: 1.0)
    assert autotune.stats["timed"] == 3


def test_the_shapes_with_the_most_work_are_tuned_first(tuning):
    """A budget that runs out mid-model leaves the rules on the cheapest shapes: the larger GEMM,
    later in the graph, has its candidates timed before the smaller one's."""
    feeds = {"x": rnd(8, 32, seed=1), "W1": rnd(32, 16, seed=2), "W2": rnd(32, 256, seed=3)}
    nodes = [Node("MatMul", ["x", "W1"], ["a"], name="small"), Node("MatMul", ["x", "W2"], ["b"], name="big"),
             Node("ReduceSum", ["a"], ["sa"], {"keepdims": 1, "axes": [1]}, name="ra"),
             Node("Add", ["b", "sa"], ["y"], name="y")]
    graph = _graph(feeds, nodes, "y", grad=False)
    timed = []

    def timer(kernels, g):
        timed.append(kernels[0].flops)
        return 1.0
    autotune.tune(graph, AdapterCaps(), ("order",), timer)
    firsts = list(dict.fromkeys(timed))   # the shapes in the order their first round ran
    assert firsts[:2] == [2 * 8 * 32 * 256, 2 * 8 * 32 * 16], firsts


def test_a_round_stops_building_candidates_when_the_budget_runs_out(tuning, monkeypatch):
    """A slow pipeline build (Dawn: 0.3-0.5 s each, on one thread) counts against the budget
    inside a round: past it, the candidates not timed yet are left out (the rules' first one
    always runs), the winner is the best of those timed, and the confirming round skips them."""
    graph, _ = _mlp_graph()
    clock = [0.0]
    monkeypatch.setattr(autotune.time, "perf_counter", lambda: clock[0])
    monkeypatch.setattr(autotune, "BUDGET_S", 2.5)
    timed = []
    node = next(n for n in graph.nodes if n.op in autotune.TUNABLE_OPS)
    names = [kernels[0].name for _, kernels in autotune._candidates(node, graph, AdapterCaps())]

    def slow(kernels, g):  # each candidate "builds" for one second; the rules' first is slowest
        timed.append(kernels[0].name)
        clock[0] += 1.0
        return 2.0 if kernels[0].name == names[0] else 1.0 + 0.1 * names.index(kernels[0].name)
    tuned = autotune.tune(graph, AdapterCaps(), ("slow",), slow)
    assert autotune.stats["timed"] == 1 and autotune.stats["left"] == 2  # one shape started, two left
    # the first round: the rules' candidate and those begun before 2.5 s; the confirming round
    # (past the deadline) times the rules' one again only
    assert timed == names[:3] + names[:1], timed
    pins = [n.attrs for n in tuned.nodes if any(a in n.attrs for a in autotune.PIN_ATTRS)]
    assert len(pins) == 1 and pins[0] == {**pins[0], **autotune._candidates(node, graph, AdapterCaps())[1][0]}


def test_the_budget_can_be_set_in_the_environment(tuning, monkeypatch):
    graph, _ = _mlp_graph()
    monkeypatch.setenv(autotune.BUDGET_ENV, "0")
    assert autotune.tune(graph, AdapterCaps(), ("c",), lambda k, g: 1.0) is graph
    assert autotune.stats["timed"] == 0 and autotune.stats["left"] == 3
    for junk in ("soon", "-1", "nan"):  # not a budget: an error naming the variable
        monkeypatch.setenv(autotune.BUDGET_ENV, junk)
        with pytest.raises(ConfigError, match=f"{autotune.BUDGET_ENV}={junk!r}: give a number >= 0"):
            autotune._budget()
    monkeypatch.delenv(autotune.BUDGET_ENV)
    assert autotune._budget() == autotune.BUDGET_S
    monkeypatch.setenv(autotune.BUDGET_ENV, "600")
    autotune.tune(graph, AdapterCaps(), ("c",), lambda k, g: 1.0)
    assert autotune.stats["timed"] == 3


def test_a_plan_made_before_tuning_finished_is_not_kept(tuning, monkeypatch):
    """A compile whose tuning ran out of time does not store its plan: the next compile (a new
    process) tunes the shapes left over and plans again instead of loading the rules' plan, and
    only that plan is stored and loaded afterwards."""
    monkeypatch.setenv("ANYGRAD_PIPELINE_CACHE", "1")  # tests run without the disk cache otherwise
    graph, feeds = _mlp_graph()
    plans = tuning / "wgpu-plans"
    monkeypatch.setattr(autotune, "BUDGET_S", 0.0)
    want, rules, _ = run_both(graph, feeds, backend=wgpu_backend())
    assert autotune.stats["timed"] == 0 and autotune.stats["left"] == 3
    assert_close(want, rules, rtol=2e-4, atol=2e-5)
    assert not plans.exists() or not any(plans.iterdir())
    monkeypatch.setattr(autotune, "BUDGET_S", 60.0)
    _, tuned, exe = run_both(graph, feeds, backend=wgpu_backend())
    assert autotune.stats["timed"] == 3 and any(plans.iterdir())
    assert all(p in autotune.CANDIDATES for p in _pins(exe))
    _, again, exe2 = run_both(graph, feeds, backend=wgpu_backend())
    assert autotune.stats["timed"] == 3 and _pins(exe2) == _pins(exe)
    assert_close(want, tuned, rtol=2e-4, atol=2e-5)
    assert_close(tuned, again, rtol=0, atol=0)


def test_gemm_kernels_carry_their_flops():
    graph, _ = _mlp_graph()
    from anygrad.backends.wgpu.kernels.kernel import LOWERINGS
    fwd = next(n for n in graph.nodes if n.op == "MatMul" and n.inputs[:2] == ["x", "W"])
    kernels = LOWERINGS["MatMul"](fwd, graph, AdapterCaps())
    assert sum(k.flops for k in kernels) == 2 * 24 * 24 * 40 == int(np.prod([2, 24, 24, 40]))


def _long_k_graph():
    """x (2, 8, 512) @ W (512, 16): the forward GEMM has K = 512, enough for K splits."""
    feeds = {"x": rnd(2, 8, 512, seed=4), "W": rnd(512, 16, seed=5)}
    return _graph(feeds, [Node("MatMul", ["x", "W"], ["y"], name="mm")], "y", grad=False), feeds


@pytest.mark.parametrize("splits", [1, 3, 4])
@pytest.mark.parametrize("variant", ["shared", "dot"])
def test_a_pinned_split_count_computes_what_numpy_computes(splits, variant):
    """`_gemm_splits` (benchmarks' `+splits=N`, the autotuner's split counts) splits K that many
    ways, evenly or not (3 of 512), in the tiled and the dot-product variants."""
    graph, feeds = _long_k_graph()
    pin = {"_gemm_variant": "shared", "_gemm_block": 4, "_gemm_kt": 16} if variant == "shared" else {"_gemm_variant": "dot"}
    for n in graph.nodes:
        if n.op == "MatMul":
            n.attrs |= pin | {"_gemm_splits": splits}
    want, got, exe = run_both(graph, feeds)
    assert_close(want, got, rtol=2e-4, atol=2e-5)
    names = [step.kernel.name for step in exe.plan.steps]
    assert any(f"splitK {splits}]" in s for s in names) == (splits > 1), names


def test_the_winning_tiling_is_timed_at_other_k_splits_and_the_fastest_count_is_stored(tuning, monkeypatch):
    """The rules split this K = 512 GEMM s ways; the first round's leading tiling is also timed
    unsplit and at s/2, 3s/4, 4s/3 and 2s splits in the confirming round (the other leaders
    unsplit), the count the timer finds fastest is pinned and
    stored with it, a count within noise keeps the rules' own, and ANYGRAD_AUTOTUNE_SPLITS=0 (its
    own cache file) tunes tilings only."""
    from anygrad.backends.wgpu.kernels.gemm_splitk import split_count
    from anygrad.backends.wgpu.kernels.kernel import LOWERINGS
    graph, _ = _long_k_graph()
    caps = AdapterCaps()
    node = graph.nodes[0]
    s = split_count(LOWERINGS["MatMul"](node, graph, caps))
    assert s > 1
    assert autotune.split_pins({}, LOWERINGS["MatMul"](node, graph, caps)) == [
        {"_gemm_splits": v} for v in sorted({1, s // 2, s * 3 // 4, s * 4 // 3, 2 * s} - {s})]
    assert autotune.split_pins({}, LOWERINGS["MatMul"](node, graph, caps), leading=False) == [{"_gemm_splits": 1}]
    timed = []

    def timer(kernels, g):
        timed.append(split_count(kernels))
        return {2 * s: 0.5}.get(timed[-1], 1.0)
    tuned = autotune.tune(graph, caps, ("ctx",), timer)
    assert tuned.nodes[0].attrs.get("_gemm_splits") == 2 * s and {s // 2, 2 * s} <= set(timed)
    assert split_count(LOWERINGS["MatMul"](tuned.nodes[0], tuned, caps)) == 2 * s
    again = autotune.tune(graph, caps, ("ctx",), None)  # the stored winner, split count included
    assert again.nodes[0].attrs.get("_gemm_splits") == 2 * s

    rule = LOWERINGS["MatMul"](node, graph, caps)[0].name   # the rules' tiling, unsplit, wins
    unsplit = rule.replace(f" splitK {s}]", "]")
    won = autotune.tune(graph, caps, ("unsplit",), lambda k, g: 0.5 if [x.name for x in k] == [unsplit] else 1.0)
    assert won.nodes[0].attrs.get("_gemm_splits") == 1 and unsplit != rule
    assert [k.name for k in LOWERINGS["MatMul"](won.nodes[0], won, caps)] == [unsplit]

    within_noise = autotune.tune(graph, caps, ("other",), lambda k, g: {2 * s: 0.98}.get(split_count(k), 1.0))
    assert "_gemm_splits" not in within_noise.nodes[0].attrs

    rounds = []  # a timer that times lists together (device_timer's `all`): the splits ride in round 2

    def together(lists, g, deadline=None):
        rounds.append(sorted(split_count(k) for k in lists))
        return [{2 * s: 0.5}.get(split_count(k), 1.0) for k in lists]

    def grouped(kernels, g):
        return together([kernels], g)[0]
    grouped.all = together
    assert autotune.tune(graph, caps, ("together",), grouped).nodes[0].attrs.get("_gemm_splits") == 2 * s
    assert len(rounds) == 2 and 2 * s not in rounds[0] and {s // 2, 2 * s} <= set(rounds[1])

    monkeypatch.setenv(autotune.SPLITS_ENV, "0")
    timed.clear()
    off = autotune.tune(graph, caps, ("ctx",), timer)
    assert "_gemm_splits" not in off.nodes[0].attrs and 2 * s not in timed


def test_every_shape_is_timed_once_before_any_confirming_round_and_its_splits_build_meanwhile(tuning):
    """Two long-K shapes: both first rounds, then both confirming rounds; each shape's split
    variants are handed to the timer's prebuild (background pipeline builds) right after its first
    round, so the second shape's first round runs while they build."""
    feeds = {"x": rnd(2, 8, 512, seed=4), "W": rnd(512, 16, seed=5), "V": rnd(512, 24, seed=6)}
    graph = _graph(feeds, [Node("MatMul", ["x", "W"], ["y"], name="mm"), Node("MatMul", ["x", "V"], ["z"], name="mm2"),
                           Node("Concat", ["y", "z"], ["out"], name="cat", attrs={"axis": -1})], "out", grad=False)
    events = []

    def together(lists, g, deadline=None):
        events.append(("time", len(lists)))
        return [1.0 + 0.01 * i for i in range(len(lists))]

    def timer(kernels, g):
        return together([kernels], g)[0]
    timer.all = together
    timer.prebuild = lambda kernels: events.append(("build", len(kernels)))
    autotune.tune(graph, AdapterCaps(), ("order",), timer)
    kinds = [e[0] for e in events]
    # every candidate's build, two first rounds (each followed by its split variants' build), then
    # two confirming rounds: the leaders and the rules' own, the leader's split counts, the
    # other leaders unsplit
    assert kinds == ["build", "time", "build", "time", "build", "time", "time"], events
    most = autotune.CONFIRM + 1 + len(autotune.SPLIT_FACTORS) + 1 + autotune.CONFIRM - 1
    assert events[5][1] <= most and events[6][1] <= most


@pytest.mark.parametrize("pin", [{"_gemm_splits": 0}, {"_gemm_splits": 5000}, {"_gemm_splits": "4"},
                                 {"_gemm_splits": 2.0}, {"_gemm_variant": "evil", "_gemm_splits": 2}])
def test_a_stored_split_count_out_of_range_is_ignored(tuning, pin):
    path = autotune.cache_file(("ctx",))
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"k": pin, "ok": {"_gemm_splits": 2}}))
    assert autotune._load(path) == {"ok": {"_gemm_splits": 2}}


def _square_matmul(n: int):
    feeds = {"a": rnd(n, n, seed=6), "b": rnd(n, n, seed=7)}
    graph = _graph(feeds, [Node("MatMul", ["a", "b"], ["c"], name="mm")], "c", grad=False)
    node = graph.nodes[0]
    from anygrad.backends.wgpu.kernels.kernel import LOWERINGS
    return graph, LOWERINGS["MatMul"](node, graph, AdapterCaps())


def test_candidates_timed_together_rank_as_their_work(tuning, monkeypatch):
    """device_timer.all times a node's candidates in one submission a round (timestamps where the
    device has them): a candidate that is the same GEMM run 6 times takes about 6 times as long
    as the GEMM once, and each keeps its place in the list."""
    monkeypatch.setattr(autotune, "REPEATS", 1)
    graph, kernels = _square_matmul(128)
    timer = autotune.device_timer(wgpu_backend())
    # the best of three rounds each: one round on a loaded host (lavapipe shares its cores) can
    # stretch any one timing
    rounds = [timer.all([kernels, kernels * 6, kernels], graph) for _ in range(3)]
    once, six, again = (min(r[i] for r in rounds) for i in range(3))
    assert once > 0 and again > 0
    assert 3 * max(once, again) < six < 12 * min(once, again), (once, six, again)
    assert timer(kernels, graph) > 0


def test_pipelines_built_in_the_background_are_the_ones_used(tuning):
    """pipelines(wait=False) starts the builds and returns; pipeline() then hands out the built
    one, and a shader that cannot compile still fails on the asking thread, naming the kernel."""
    from anygrad.backends.wgpu.runtime.backend import WgpuBackend
    backend = wgpu_backend()
    assert isinstance(backend, WgpuBackend)
    _, kernels = _square_matmul(16)
    k = kernels[0]
    ro = (True,) * len(k.reads) + (False,) * len(k.writes)
    fresh = k.wgsl.replace("fn main(", "fn main_bg(")  # a shader this process has not built yet
    assert backend.pipelines([(fresh, "main_bg", ro, "bg")], wait=False) == []
    pipe = backend.pipeline(fresh, "main_bg", ro, "bg")
    assert backend.pipelines([(fresh, "main_bg", ro, "bg")]) == [pipe]
    broken = fresh.replace("fn main_bg(", "fn main_broken(").replace("let ", "lett ", 1)
    backend.pipelines([(broken, "main_broken", ro, "Broken[1]")], wait=False)
    with pytest.raises(Exception, match="Broken"):
        backend.pipeline(broken, "main_broken", ro, "Broken[1]")


def test_compile_times_say_where_a_compile_went(tuning):
    """WgpuExecutable.compile_times: the first compile tunes the three GEMM shapes and builds the
    step's pipelines; a second one (a new backend, as a new process) looks the winners up, times
    nothing, finds the pipelines the first one built in this process, and says whether its plan
    came from the disk cache."""
    from anygrad.backends.wgpu.device import pipeline_cache
    # shapes no other test of this process compiles, so its pipelines are new
    feeds = {"x": rnd(3, 5, 20, seed=8), "W": rnd(20, 36, seed=9), "b": rnd(36, seed=10)}
    graph = _graph(feeds, [Node("MatMul", ["x", "W"], ["xw"], name="mm"), Node("Add", ["xw", "b"], ["y"], name="add")],
                   "y", grad=True)
    _, _, exe = run_both(graph, feeds)
    t = exe.compile_times
    assert (t.tuned_shapes, t.from_plan_cache) == (3, False)
    assert t.tune_candidates == autotune.stats["candidates"] >= 6
    assert t.tune_s > 0 and t.plan_s > 0 and t.pipelines_built > 0
    hits = pipeline_cache.stats["hits"]
    _, _, exe2 = run_both(graph, feeds, backend=wgpu_backend())
    t2 = exe2.compile_times
    assert (t2.tuned_shapes, t2.tune_candidates, t2.pipelines_built) == (0, 0, 0)
    assert t2.from_plan_cache == (pipeline_cache.stats["hits"] > hits)


def test_float16_gemms_are_timed_as_the_step_runs_them(tuning):
    """Under mixed precision the candidates timed are the kernels the step runs: their float16
    operands and result bound as f16 storage (halfstore.stored_half), not the float32 shaders
    over f16-sized buffers (which read half of every operand past its end, clamped: the
    autotuner then picked tilings that were fast only there; ResNet-18 f16 lost 12% to f32)."""
    import re

    from anygrad.backends.wgpu.kernels.halfstore import stored_half
    from anygrad.backends.wgpu.kernels.kernel import LOWERINGS
    from anygrad.ir import Graph, TensorInfo
    g = Graph(name="half", inputs=["x", "W"], outputs=["y"])
    g.info.update({"x": TensorInfo(np.dtype(np.float16), (64, 32)), "W": TensorInfo(np.dtype(np.float16), (32, 48)),
                   "y": TensorInfo(np.dtype(np.float16), (64, 48))})
    g.nodes = [Node("MatMul", ["x", "W"], ["y"], name="mm")]
    caps = AdapterCaps(has_f16=True)
    timed: list[list[str]] = []

    def timer(kernels, graph):
        timed.append([k.wgsl for k in kernels])
        return 1.0 + len(timed) % 3
    autotune.tune(g, caps, ("f16 adapter",), timer)
    assert len(timed) >= 2
    declared = re.compile(r"var<storage,\s*\w+>\s*(\w+)\s*:\s*array<([\w<>]+)>")
    for shaders in timed:
        for wgsl in shaders:
            types = {t for _, t in declared.findall(wgsl)}
            assert types and all("f16" in t for t in types), types
    rules = [k.wgsl for k in stored_half(LOWERINGS["MatMul"](g.nodes[0], g, caps), g)]
    assert rules in timed
