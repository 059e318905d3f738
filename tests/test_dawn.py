"""The wgpu backend on either WebGPU implementation (backends/wgpu/device/implementation.py): device names,
`auto`'s choice, the missing `[dawn]` extra, adapter facts and the ALU fallback message, Tint's
errors, mappings under WebGPU's rules. Without a GPU (CI, lavapipe): Dawn refuses software adapters,
so adapters are faked here; the tests at the end run on Dawn where it has an adapter and skip
elsewhere with the reason."""
from __future__ import annotations

import sys

import numpy as np
import pytest
import wgpu_util

from anygrad.backends.wgpu.device import adapters, implementation
from anygrad.backends.wgpu.device.adapters import (
    AdapterFacts,
    AdapterInfo,
    MatrixConfig,
    auto_adapter,
    enabled_facts,
    matrix_configs_from,
    say_matrix_fallback,
    select_adapter,
)
from anygrad.backends.wgpu.device.implementation import Implementation, wait_mapped, wgsl_for
from anygrad.backends.wgpu.device.shader_module import ShaderRejectedError, first_error_line, shader_rejected
from anygrad.errors import AnygradError, ConfigError, DeviceError

# What Dawn reports on an H200 through Vulkan (the probe of 2026-12-01), as get_adapter_properties gives it
H200_CONFIGS = [
    {"component_type": "f16", "result_component_type": "f32", "m": 16, "n": 16, "k": 16,
     "min_subgroup_size": 32, "max_subgroup_size": 32},
    {"component_type": "f16", "result_component_type": "f32", "m": 16, "n": 8, "k": 16,
     "min_subgroup_size": 32, "max_subgroup_size": 32},
    {"component_type": "i8", "result_component_type": "i32", "m": 16, "n": 8, "k": 32,
     "min_subgroup_size": 32, "max_subgroup_size": 32},
]
DAWN_FACTS = AdapterFacts("dawn", (32, 32), matrix_configs_from(H200_CONFIGS), has_f16=True, has_subgroups=True)


def _fake(monkeypatch, dawn_facts: AdapterFacts | None = DAWN_FACTS, dawn_installed: bool = True,
          vendor: str = "nvidia") -> None:
    """wgpu-native: lavapipe (0) and a discrete GPU (1); Dawn: the same GPU (2) with `dawn_facts`."""
    native = [(AdapterInfo(0, "llvmpipe", "Vulkan", "cpu"), None),
              (AdapterInfo(1, "Fake H200", "Vulkan", "discrete", vendor=vendor), None)]
    dawn = [] if dawn_facts is None else [(AdapterInfo(2, "Fake H200", "Vulkan", "discrete", vendor=vendor,
                                                       facts=dawn_facts), None)]
    monkeypatch.setattr(adapters, "_ADAPTERS", {"native": native, "dawn": dawn})
    monkeypatch.setattr(implementation, "available", lambda key: key == "native" or dawn_installed)


def test_matrix_configs_from_dawns_dicts():
    got = matrix_configs_from(H200_CONFIGS)
    assert got[0] == MatrixConfig(16, 16, 16, "f16", "f32", 32, 32)
    assert [str(c) for c in got] == ["16x16x16 f16->f32", "16x8x16 f16->f32", "16x8x32 i8->i32"]
    assert DAWN_FACTS.configs_for("f16") == got[:2]   # largest M*N*K first
    assert DAWN_FACTS.configs_for("i8", "i32") == got[2:]
    assert DAWN_FACTS.matrix_units_for("f16") and not DAWN_FACTS.matrix_units_for("f32")
    assert not AdapterFacts("dawn", matrix_configs=got, has_f16=False).matrix_units_for("f16")


@pytest.mark.parametrize("spec, index", [("wgpu", 1), ("wgpu:native", 1), ("wgpu:dawn", 2), ("wgpu:2", 2),
                                         ("wgpu:0", 0), ("wgpu:dawn:vulkan", 2), ("wgpu:native:vulkan", 1),
                                         ("WGPU:Dawn", 2), ("wgpu:vulkan", 1)])
def test_device_names_choose_the_implementation(monkeypatch, spec, index):
    _fake(monkeypatch)
    info, _ = select_adapter(spec)
    assert info.index == index
    assert info.implementation == ("dawn" if index == 2 else "native")


@pytest.mark.parametrize("spec", ["wgpu:dawn:1", "wgpu:dawn:vulkan:0", "wgpu:naga", "wgpu:native:x"])
def test_malformed_implementation_names_are_config_errors(monkeypatch, spec):
    _fake(monkeypatch)
    with pytest.raises(ConfigError, match="wgpu:native or wgpu:dawn"):
        select_adapter(spec)


def test_dawn_without_an_adapter_says_why(monkeypatch):
    _fake(monkeypatch, dawn_facts=None)
    with pytest.raises(DeviceError, match=r"no Dawn adapter.*refuses software adapters \(lavapipe\)"):
        select_adapter("wgpu:dawn")
    with pytest.raises(DeviceError, match="no Dawn OpenGL adapter"):
        select_adapter("wgpu:dawn:gl")


def test_dawn_without_the_extra_names_the_pip_command(monkeypatch):
    _fake(monkeypatch, dawn_installed=False)
    with pytest.raises(DeviceError, match=r"pip install 'anygrad-train\[dawn\]'") as e:
        select_adapter("wgpu:dawn")
    assert isinstance(e.value, AnygradError) and "wgpu:native" in str(e.value)
    assert select_adapter("wgpu")[0].index == 1  # wgpu-native needs no extra


def test_dawn_toggles_add_to_anygrads_and_an_unknown_one_is_a_config_error(monkeypatch):
    """Robustness is off unless ANYGRAD_WGPU_CHECKS=1 (as naga's checks on wgpu-native);
    ANYGRAD_DAWN_TOGGLES adds toggles after anygrad's own (no repeats); a name Dawn does not
    know stops the load with the setting named, instead of every toggle being dropped."""
    pytest.importorskip("wgpudawn")
    assert implementation.dawn_toggles() == implementation.DAWN_TOGGLES + ("disable_robustness",)
    monkeypatch.setenv("ANYGRAD_WGPU_CHECKS", "1")
    assert implementation.dawn_toggles() == implementation.DAWN_TOGGLES
    monkeypatch.setenv("ANYGRAD_DAWN_TOGGLES", " disable_workgroup_init,allow_unsafe_apis ,disable_workgroup_init")
    assert implementation.dawn_toggles() == implementation.DAWN_TOGGLES + ("disable_workgroup_init",)
    monkeypatch.delenv("ANYGRAD_WGPU_CHECKS")
    monkeypatch.delitem(implementation._LOADED, "dawn", raising=False)
    monkeypatch.setenv("ANYGRAD_DAWN_TOGGLES", "disable_robustnes")
    with pytest.raises(ConfigError, match="ANYGRAD_DAWN_TOGGLES: Dawn has no toggle disable_robustnes"):
        implementation.load("dawn")


def test_dawn_loads_with_anygrads_toggles_and_exact_timestamps(monkeypatch):
    """The instance gets dawn_toggles() enabled and timestamp_quantization disabled (Dawn's
    default rounds timestamps to 2^16 ns: profiles and the autotuner's stamped timings read in
    65.5 us steps); every name is one Dawn knows."""
    pytest.importorskip("wgpudawn")
    from wgpudawn.backends.dawn import extras
    seen = {}
    monkeypatch.setattr(extras, "set_instance_extras", lambda **kw: seen.update(kw))
    monkeypatch.delitem(implementation._LOADED, "dawn", raising=False)
    implementation.load("dawn")
    monkeypatch.delitem(implementation._LOADED, "dawn", raising=False)
    assert seen["enable_toggles"] == list(implementation.dawn_toggles())
    assert seen["disable_toggles"] == ["timestamp_quantization"]
    known = extras.all_toggles()
    assert all(t in known for t in seen["enable_toggles"] + seen["disable_toggles"])


def test_loading_dawn_without_wgpudawn_is_the_same_error(monkeypatch):
    monkeypatch.delitem(implementation._LOADED, "dawn", raising=False)
    monkeypatch.setitem(sys.modules, "wgpudawn", None)  # import wgpudawn -> ImportError
    with pytest.raises(DeviceError, match=r"\[dawn\]"):
        implementation.load("dawn")


def test_the_cli_shows_the_missing_extra_as_one_line(monkeypatch, capsys):
    from anygrad import cli
    _fake(monkeypatch, dawn_installed=False)
    from pathlib import Path

    import anygrad
    model = Path(anygrad.__file__).parent / "examples" / "mnist.onnx"
    code = cli.main(["info", str(model), "--device", "wgpu:dawn", "--batch-size", "2"])
    err = capsys.readouterr().err
    assert code != 0 and "[dawn]" in err and "Traceback" not in err


def test_auto_keeps_native_where_dawns_matrix_units_are_untested_on_that_hardware(monkeypatch):
    # the same 16x16x16 f16 config on another vendor's GPU (AMD RDNA3 lists it): the generic code,
    # never run there, so auto stays on wgpu-native and `wgpu:dawn` still chooses Dawn
    _fake(monkeypatch, vendor="amd")
    assert auto_adapter("f16") == (select_adapter("wgpu:native"), "")
    assert select_adapter("wgpu:dawn")[0].index == 2
    assert ("nvidia", "16x16x16", "f16", "f32") in adapters.VERIFIED_MATRIX_UNITS


def test_auto_lists_dawns_adapters_only_where_they_could_win(monkeypatch):
    """f32 (no verified f32 config), or a GPU of no verified vendor: Dawn is not asked, so its
    warnings about the adapters it refuses (lavapipe) never reach a user who did not pick it."""
    _fake(monkeypatch)
    asked = []
    real = adapters._enumerate
    monkeypatch.setattr(adapters, "_enumerate", lambda impls=("native",): asked.append(tuple(impls)) or real(impls))
    auto_adapter("f32")
    _fake(monkeypatch, vendor="intel")
    auto_adapter("f16")
    assert ("dawn",) not in asked
    _fake(monkeypatch)
    auto_adapter("f16")
    assert ("dawn",) in asked


def test_auto_prefers_dawn_for_f16_matrix_units_and_says_so(monkeypatch):
    _fake(monkeypatch)
    pick, why = auto_adapter("f16")
    assert pick[0].index == 2
    assert why.count("\n") == 0 and "Dawn" in why and "16x16x16" in why and "wgpu:native" in why
    pick, why = auto_adapter("f32")  # no f32 configs: wgpu-native, silently
    assert pick[0].index == 1 and why == ""


def test_auto_keeps_native_without_dawn_matrix_units(monkeypatch):
    _fake(monkeypatch, dawn_facts=AdapterFacts("dawn", (32, 32), (), has_f16=True))
    assert auto_adapter("f16") == (select_adapter("wgpu:native"), "")
    _fake(monkeypatch, dawn_installed=False)
    assert auto_adapter("f16")[0][0].index == 1


def test_get_backend_auto_prints_its_one_line(monkeypatch, capsys):
    from anygrad import devices
    _fake(monkeypatch)
    opened = []
    monkeypatch.setattr(devices, "_auto_backend", lambda pick, *a: opened.append(pick[0].index) or "backend")
    assert devices.get_backend("auto", precision="f16") == "backend"
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln]
    assert opened == [2] and len(lines) == 1 and "auto chose wgpu:2" in lines[0]


def test_devices_line_shows_implementation_subgroups_and_configs():
    a = AdapterInfo(2, "Fake H200", "Vulkan", "discrete", facts=DAWN_FACTS)
    text = a.describe()
    assert a.summary == "wgpu:2  Fake H200 (Vulkan, discrete, Dawn)"
    last = text.splitlines()[-1].strip()
    assert last == ("implementation Dawn; subgroup size 32; matrix units: 16x16x16 f16->f32, 16x8x16 f16->f32, "
                    "16x8x32 i8->i32")
    plain = AdapterInfo(0, "llvmpipe", "Vulkan", "cpu").describe().splitlines()[-1].strip()
    assert plain == "implementation wgpu-native; subgroup size unknown; matrix units: none"


def test_kernels_see_only_what_the_device_enabled():
    assert enabled_facts(DAWN_FACTS, {"shader-f16", "subgroups", "chromium-experimental-subgroup-matrix"}) == DAWN_FACTS
    no_mats = enabled_facts(DAWN_FACTS, {"shader-f16", "subgroups"})
    assert no_mats.matrix_configs == () and no_mats.has_f16
    no_f16 = enabled_facts(DAWN_FACTS, {"chromium-experimental-subgroup-matrix"})
    assert [str(c) for c in no_f16.matrix_configs] == ["16x8x32 i8->i32"]
    assert not no_f16.has_f16 and not no_f16.has_subgroups


@pytest.mark.parametrize("facts, words", [
    (AdapterFacts("dawn", (32, 32), (), has_f16=True), "lists no subgroup-matrix configs"),
    (AdapterFacts("dawn", (32, 32), matrix_configs_from(H200_CONFIGS[2:]), has_f16=True), "takes f16 operands"),
    (AdapterFacts("dawn", (32, 32), matrix_configs_from(H200_CONFIGS), has_f16=False), "no shader-f16"),
])
def test_a_dawn_adapter_without_f16_matrices_falls_back_and_says_so_once(monkeypatch, capsys, facts, words):
    monkeypatch.setattr(adapters, "_SAID", set())
    info = AdapterInfo(2, "Fake GPU", "Vulkan", "discrete", facts=facts)
    for _ in range(3):
        assert words in say_matrix_fallback(info, facts, "f16")
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and "ALU kernels" in err[0] and words in err[0] and "wgpu:2" in err[0]


def test_no_fallback_message_where_matrix_units_serve_or_wgpu_native_runs(monkeypatch, capsys):
    monkeypatch.setattr(adapters, "_SAID", set())
    assert say_matrix_fallback(AdapterInfo(2, "G", "Vulkan", "discrete", facts=DAWN_FACTS), DAWN_FACTS, "f16") == ""
    native = AdapterFacts("native")
    assert say_matrix_fallback(AdapterInfo(0, "G", "Vulkan", "discrete"), native, "f16") == ""
    assert capsys.readouterr().err == ""


# -- shader compiler errors --------------------------------------------------------------------------
TINT_ERROR = ("Error while parsing WGSL: :7:20 error: 'subgroupMatrixLoad' offset must be uniform\n"
              "    let a = subgroupMatrixLoad<L>(&A, lid.x, false, 16u);\n"
              "                   ^^^^^^^^^^^^^^^^^^\n\n"
              " - While validating [ShaderModuleDescriptor \"gemm_mma\"]\n"
              " - While calling [Device].CreateShaderModule([ShaderModuleDescriptor \"gemm_mma\"]).")
DAWN = Implementation("dawn", "Dawn", None, (), thread_safety="implicit-device-synchronization", compiler="Tint")


class _Device:
    def __init__(self, *features: str) -> None:
        self.features = set(features)


def test_threads_build_pipelines_only_where_the_device_is_safe_to_share():
    native = Implementation("native", "wgpu-native", None, ())
    assert native.threaded(_Device()) and DAWN.threaded(_Device("implicit-device-synchronization"))
    assert not DAWN.threaded(_Device("shader-f16"))


def test_first_error_line_of_tint_and_naga():
    assert first_error_line(TINT_ERROR) == ("Error while parsing WGSL: :7:20 error: 'subgroupMatrixLoad' offset "
                                            "must be uniform")
    naga = ("Validation Error\n\nCaused by:\n  In wgpuDeviceCreateShaderModule\n\nShader '' parsing error: "
            "no definition in scope for identifier: `nope`\n  ┌─ wgsl:1:41\n")
    assert first_error_line(naga) == "Shader '' parsing error: no definition in scope for identifier: `nope`"
    assert first_error_line("\n  device lost\n") == "device lost"


def test_a_kernel_tint_rejects_is_an_anygrad_error(wb, monkeypatch):
    """The pipeline path itself, fed Tint's words: an AnygradError naming the kernel and the first error line."""
    from anygrad.backends.wgpu.runtime import backend as runtime

    def tint(device, wgsl, label):
        raise RuntimeError(TINT_ERROR)
    monkeypatch.setattr(runtime, "create_shader_module", tint)
    monkeypatch.setattr(implementation, "of", lambda obj: DAWN)
    wgsl = "@compute @workgroup_size(1) fn main() {}"
    with pytest.raises(ShaderRejectedError) as e:
        wb.pipeline(wgsl + " // tint", "main", (False,), "MatMul:gemm_mma_16x16x16")
    msg = str(e.value)
    assert isinstance(e.value, AnygradError) and msg.count("\n") == 0
    assert "'MatMul:gemm_mma_16x16x16'" in msg and "rejected by Tint" in msg
    assert "'subgroupMatrixLoad' offset must be uniform" in msg and "--device wgpu:native" in msg
    assert e.value.wgsl.startswith(wgsl) and e.value.details == TINT_ERROR


def test_a_kernel_naga_rejects_is_the_same_error(wb):
    # naga here; Tint where the test device is Dawn (ANYGRAD_TEST_DEVICE=wgpu:dawn)
    compiler = implementation.of(wb.device).compiler
    with pytest.raises(ShaderRejectedError, match=rf"'bad kernel' was rejected by {compiler}.*\bnope\b"):
        wb.pipeline("@compute @workgroup_size(1) fn main() { nope(); }", "main", (False,), "bad kernel")


def test_shader_rejected_without_a_device():
    e = shader_rejected("k", RuntimeError(TINT_ERROR), "wgsl", DAWN)
    assert isinstance(e, DeviceError) and e.kernel == "k"


def test_tint_gets_enable_subgroups_where_builtins_are_used():
    body = "@compute @workgroup_size(32) fn main(@builtin(subgroup_size) s: u32) { let x = subgroupAdd(1.0); }"
    assert wgsl_for("dawn", body).startswith("enable subgroups;\n")
    assert wgsl_for("native", body) == body
    assert wgsl_for("dawn", "enable subgroups;\n" + body).count("enable subgroups;") == 1
    plain = "// no subgroup builtins here\n@compute @workgroup_size(1) fn main() {}"
    assert wgsl_for("dawn", plain) == plain


def test_tint_gets_nonfinite_bits_through_a_function():
    """Tint refuses a constant expression that is not finite, `bitcast<f32>(0xff800000u)`."""
    body = ("@compute @workgroup_size(1) fn main() { var m = bitcast<f32>(0xff800000u); "
            "let n = bitcast<f32>(0x7fc00000u); let z = bitcast<f32>(0x80000000u); }")
    out = wgsl_for("dawn", body)
    assert "bitcast<f32>(anygrad_bits(0xff800000u))" in out and "bitcast<f32>(anygrad_bits(0x7fc00000u))" in out
    assert "bitcast<f32>(0x80000000u)" in out  # -0.0 is finite: left as it is
    assert out.count("fn anygrad_bits(") == 1 and wgsl_for("native", body) == body


def test_merge_bindings_reads_and_writes_through_one():
    wgsl = ("@group(0) @binding(0) var<storage, read_write> x: array<f32>;\n"
            "@group(0) @binding(1) var<storage, read> g: array<f32>;\n"
            "@group(0) @binding(2) var<storage, read_write> y: array<f32>;\n"
            "@compute @workgroup_size(1) fn main() { let v = vec2<f32>(1.0); y[0] = x[0] - g[0] + v.x; }")
    out, done = implementation.merge_bindings(wgsl, {0: 2})
    assert done == {0: 2}
    assert "@binding(0)" not in out and "@binding(1)" in out and "y[0] = y[0] - g[0] + v.x" in out
    both, done = implementation.merge_bindings(wgsl, {0: 2, 1: 2})
    assert done == {0: 2, 1: 2} and "y[0] = y[0] - y[0] + v.x" in both and "@binding(1)" not in both
    mixed = wgsl.replace("y: array<f32>", "y: array<vec4<f32>>")
    assert implementation.merge_bindings(mixed, {0: 2}) == (mixed, {})


def test_dawns_rendering_computes_what_naga_does(monkeypatch):
    """Dawn's text of the kernels (merged in-place bindings, non-finite bits through a function),
    compiled by naga on this machine's adapter: a founding-CNN training step with SGD momentum
    (in-place state updates) and a max pool and max reduction (-inf initial values) match numpy."""
    wb = wgpu_util.wgpu_backend()
    native = implementation.of(wb.device)
    as_dawn = Implementation("dawn", "Dawn", native.module, native.features, native_api=None,
                             thread_safety="implicit-device-synchronization", compiler="Tint")
    monkeypatch.setattr(implementation, "of", lambda obj: as_dawn)
    # naga refuses `enable subgroups;` (Tint needs it): that one difference stays out of this test
    import re
    monkeypatch.setattr(implementation, "_SUBGROUP_USE", re.compile(r"(?!x)x"))
    rendered = []
    real = implementation.merge_bindings
    monkeypatch.setattr(implementation, "merge_bindings",
                        lambda wgsl, pairs: rendered.append(real(wgsl, pairs)[1]) or real(wgsl, pairs))
    from test_wgpu_step import _train

    from anygrad.backends import NumpyBackend
    from anygrad.optim import SGD
    mw, lw = _train(wb, SGD(lr=0.05, momentum=0.9), 2)
    mn, ln = _train(NumpyBackend(), SGD(lr=0.05, momentum=0.9), 2)
    np.testing.assert_allclose(lw, ln, rtol=1e-4, atol=1e-4)
    for name, value in mn.state_dict().items():
        np.testing.assert_allclose(mw.state_dict()[name], value, rtol=1e-4, atol=1e-4, err_msg=name)
    assert any(rendered), "no in-place binding was merged: the test no longer covers the merge"
    x = np.random.default_rng(1).standard_normal((2, 3, 9, 9)).astype(np.float32) - 5.0
    wgpu_util.check_wgpu("MaxPool", [x], {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1]})
    wgpu_util.check_wgpu("ReduceMax", [x], {"axes": [1, 3], "keepdims": 0})


# -- mappings ----------------------------------------------------------------------------------------
class _RacyPromise:
    """A map whose future completed while its callback still runs elsewhere: the first sync_wait
    returns with the buffer not yet mapped (what Dawn's wgpuInstanceWaitAny can do)."""

    def __init__(self, buf, then: str = "mapped", after: int = 2):
        self.buf, self.then, self.after, self.waits = buf, then, after, 0

    def sync_wait(self):
        self.waits += 1
        if self.waits >= self.after:
            self.buf.map_state = self.then


class _Buf:
    map_state = "pending"
    label = "staging"


def test_wait_mapped_waits_until_the_buffer_is_mapped():
    buf = _Buf()
    promise = _RacyPromise(buf, after=3)
    wait_mapped(buf, promise)
    assert buf.map_state == "mapped" and promise.waits == 3


def test_wait_mapped_refuses_a_buffer_that_never_mapped():
    buf = _Buf()
    with pytest.raises(RuntimeError, match="unmapped after its map resolved"):
        wait_mapped(buf, _RacyPromise(buf, then="unmapped"))


@pytest.fixture(scope="module")
def wb():
    return wgpu_util.wgpu_backend()


def test_wgpu_native_objects_are_native_and_read_back(wb):
    impl = implementation.of(wb.device)
    assert impl.key == "native" if wgpu_util.device_under_test() != "wgpu:dawn" else impl.key == "dawn"
    x = np.arange(37, dtype=np.float32)
    wb.set_state("dawn.x", x)
    np.testing.assert_array_equal(wb.get_state("dawn.x"), x)


# -- on Dawn (a machine with a GPU; skipped here) ------------------------------------------------------
@pytest.fixture(scope="module")
def dawn():
    return wgpu_util.dawn_backend()


def test_dawn_adapter_reports_its_facts(dawn):
    facts = dawn.adapter.facts
    assert facts.implementation == "dawn" and dawn.adapter.implementation == "dawn"
    assert implementation.of(dawn.device).key == "dawn" and not dawn.ctx.polls_freely
    assert "Dawn" in dawn.description and "implementation Dawn" in dawn.adapter.describe()
    assert dawn.caps.adapter_facts.implementation == "dawn"
    if "chromium-experimental-subgroup-matrix" in dawn.device.features:
        assert dawn.caps.adapter_facts.matrix_configs == dawn.adapter.facts.matrix_configs


def test_dawn_builds_pipelines_on_threads_where_its_device_is_synchronised(dawn):
    """The device is opened with implicit-device-synchronization where the adapter lists it, and
    a compile's pipelines are then built on threads, each one usable."""
    impl = implementation.of(dawn.device)
    listed = implementation.DAWN_THREAD_SAFETY in dawn.adapter.features
    assert (implementation.DAWN_THREAD_SAFETY in dawn.device.features) == listed
    assert impl.threaded(dawn.device) == listed
    def shader(i: int) -> str:
        return ("@group(0) @binding(0) var<storage, read_write> y: array<f32>;\n@compute @workgroup_size(64)\n"
                "fn main(@builtin(global_invocation_id) g: vec3<u32>) { if (g.x < arrayLength(&y)) { "
                f"y[g.x] = f32(g.x) * {i}.0; }} }}\n")
    specs = [(shader(i), "main", (False,), f"probe{i}") for i in range(6)]
    assert len(dawn.pipelines(specs)) == 6


def test_dawn_runs_a_training_step_like_numpy(dawn):
    """A matmul + bias + relu step's outputs and gradients on Dawn against the numpy backend."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((19, 33)).astype(np.float32)
    w = rng.standard_normal((33, 21)).astype(np.float32)
    graph, feeds = wgpu_util.op_graph("MatMul", [x, w])
    from anygrad.backends import NumpyBackend
    want = NumpyBackend().compile(graph).run(feeds)
    got = dawn.compile(graph).run(feeds)
    wgpu_util.assert_close(want, got, what="MatMul on Dawn")


# -- Tint without a GPU (Dawn's Null backend) ----------------------------------------------------------
def _training_graph(kind: str, precision: str):
    """The train program's graph of a small model compiled on this test device (lavapipe in CI)."""
    from pathlib import Path

    import torch

    import anygrad
    torch.manual_seed(0)
    rng = np.random.default_rng(0)
    if kind == "gpt":
        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
        from models import _gpt_module
        module = _gpt_module(64, 16, 32, 2, 2).train()
        x, y = rng.integers(0, 64, (2, 16)), rng.integers(0, 64, (32,))
        example = torch.from_numpy(x)
    else:
        module = torch.nn.Sequential(
            torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.BatchNorm2d(8), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
            torch.nn.Conv2d(8, 16, 3, padding=1, stride=2), torch.nn.ReLU(), torch.nn.AdaptiveAvgPool2d(1),
            torch.nn.Flatten(), torch.nn.Linear(16, 10)).train()
        x, y = rng.standard_normal((4, 3, 12, 12)).astype(np.float32), rng.integers(0, 10, 4)
        example = torch.from_numpy(x)
    model = anygrad.Model(anygrad.from_torch(module, example, check=False).graph).compile(
        "cross_entropy", anygrad.optim.SGD(lr=0.01, momentum=0.9), device=wgpu_util.device_under_test(),
        precision=precision)
    model.train_on_batch(x, y)
    return next(e for k, e in model._programs.items() if k[0] == "train")


@pytest.mark.wgpu
@pytest.mark.parametrize("kind,precision", [("cnn", "f32"), ("cnn", "f16"), ("gpt", "f16")])
def test_every_kernel_of_a_training_step_compiles_under_tint(kind, precision):
    """Every kernel of a whole training step (a CNN with BatchNorm and pools, a small GPT; f32 and
    mixed f16), as planned for this test device and lowered again for a GPU with subgroups, f16
    and 32 KiB of workgroup storage, through Tint (Dawn's Null backend) as Dawn would get it."""
    from dataclasses import replace

    from anygrad.backends.wgpu.fusion.passes import prepare
    from anygrad.backends.wgpu.kernels.kernel import ops_where
    from anygrad.backends.wgpu.planning.planner import lower_all
    wgpu_util.tint_device()
    if not wgpu_util.has_adapter():
        wgpu_util.no_adapter()
    exe = _training_graph(kind, precision)
    kernels = {st.kernel.name + st.kernel.wgsl: st.kernel for st in exe.plan.steps}
    gpu = replace(exe.backend.caps, has_subgroups=True, has_f16=True, is_cpu=False, max_workgroup_storage=32768)
    lowered, _, _ = lower_all(prepare(exe.graph, gpu, ops_where("epilogue"), fuse=True), gpu)
    kernels |= {k.name + k.wgsl: k for _, k in lowered}
    assert len(kernels) > 20 and (precision == "f32" or any("enable f16;" in k.wgsl for k in kernels.values()))
    assert any("subgroup" in k.wgsl for k in kernels.values())   # the GPU lowering's subgroup kernels
    rejected = [(k.name, why) for k in kernels.values() if (why := wgpu_util.tint_rejects(k.wgsl))]
    assert not rejected, rejected[:5]
