"""GEMM-path choice per machine: the environment override, the calibration's rule and its on-disk cache."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from attngrad.kernels import gemm_paths
from attngrad.kernels.gemm_paths import (CONVERSIONS, FLOAT16_MULTIPLY, GRID, NATIVE, WIDENED, calibrate,
                                         calibration, float16_scaling, gemm_path)
from attngrad.kernels.numeric import HAS_AVX512_FP16
from attngrad.machine import GEMM_ISA_CAPS, isa_flags
from helpers import attention_inputs


@pytest.fixture(autouse=True)
def _fresh_cache(tmp_path, monkeypatch):
    """Each test: an empty cache folder, no override or ISA cap, no calibration remembered by this process."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    for name in (gemm_paths.ENV, gemm_paths.SCALING_ENV, *GEMM_ISA_CAPS):
        monkeypatch.delenv(name, raising=False)
    calibration.cache_clear()
    gemm_paths.scaling_calibration.cache_clear()
    yield
    calibration.cache_clear()
    gemm_paths.scaling_calibration.cache_clear()


@pytest.fixture
def fake_timings(monkeypatch):
    """Replace the measurement by fixed timings (widened faster for float16 only) and count the measurements."""
    calls = []

    def measure(dtype):
        calls.append(dtype)
        return {NATIVE: 100.0, WIDENED: 50.0 if dtype == torch.float16 else 95.0}

    monkeypatch.setattr(gemm_paths, "measure", measure)
    monkeypatch.setattr(gemm_paths, "measure_float16_scaling", lambda: {GRID: 30.0, CONVERSIONS: 20.0})
    return calls


@pytest.mark.parametrize("path", [NATIVE, WIDENED])
def test_environment_forces_the_path(path, monkeypatch, fake_timings):
    monkeypatch.setenv(gemm_paths.ENV, path.upper())
    assert gemm_path(torch.bfloat16) == gemm_path(torch.float16) == path
    assert gemm_path(torch.float32) == NATIVE
    assert fake_timings == []  # forcing measures nothing


def test_bad_environment_value_is_a_clear_error(monkeypatch):
    monkeypatch.setenv(gemm_paths.ENV, "fastest")
    with pytest.raises(ValueError, match="ATTNGRAD_GEMM_PATH must be one of native, widened_fp32 or auto"):
        gemm_path(torch.bfloat16)


def test_auto_takes_the_calibration_and_its_margin(monkeypatch, fake_timings):
    monkeypatch.setenv(gemm_paths.ENV, "auto")
    assert gemm_path(torch.float16) == WIDENED
    assert gemm_path(torch.bfloat16) == NATIVE  # 5% faster is inside the margin: stays native
    assert fake_timings == [torch.bfloat16, torch.float16]  # measured once for the process


def test_cache_round_trip(fake_timings):
    entry = calibration()
    saved = json.loads(gemm_paths.cache_path().read_text())
    assert list(saved["entries"].values()) == [entry]
    assert entry["key"]["isa"] == list(isa_flags()) and entry["key"]["torch"] == torch.__version__
    calibration.cache_clear()
    assert calibration() == entry and len(fake_timings) == 2  # read back, not measured again
    assert calibrate()["paths"] == entry["paths"] and len(fake_timings) == 4  # --calibrate measures again


def test_isa_caps_of_the_gemm_libraries_key_their_own_calibration(monkeypatch, fake_timings):
    uncapped = calibration()
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_FP16")
    monkeypatch.setenv("MKL_ENABLE_INSTRUCTIONS", "AVX512_E3")
    calibration.cache_clear()
    capped = calibration()  # the libraries may now multiply without AMX: measured again, kept beside the other
    caps = {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_FP16", "MKL_ENABLE_INSTRUCTIONS": "AVX512_E3"}
    assert capped["key"]["isa_caps"] == caps
    assert uncapped["key"]["isa_caps"] == {} and len(fake_timings) == 4
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA")
    monkeypatch.delenv("MKL_ENABLE_INSTRUCTIONS")
    calibration.cache_clear()
    assert calibration() == uncapped and len(fake_timings) == 4  # read back
    assert len(json.loads(gemm_paths.cache_path().read_text())["entries"]) == 2


@pytest.mark.parametrize("content", ["{not json", '{"format": 1, "entries": []}', "[]", "",
                                     '{"format": 1, "entries": {"KEY": {"paths": {"bfloat16": "fast"}}}}'])
def test_corrupted_cache_is_measured_again(content, fake_timings):
    path = gemm_paths.cache_path()
    path.parent.mkdir(parents=True)
    path.write_text(content.replace("KEY", gemm_paths._key_text(gemm_paths.machine_key()).replace('"', '\\"')))
    assert gemm_path(torch.float16) == WIDENED and len(fake_timings) == 2
    assert json.loads(path.read_text())["entries"]  # rewritten whole


def test_other_machines_entries_are_kept(fake_timings):
    path = gemm_paths.cache_path()
    path.parent.mkdir(parents=True)
    other = {"paths": {"bfloat16": WIDENED, "float16": WIDENED}}
    path.write_text(json.dumps({"format": 1, "entries": {"another cpu": other}}))
    calibration()
    assert json.loads(path.read_text())["entries"]["another cpu"] == other


def test_unwritable_cache_warns_and_still_answers(tmp_path, monkeypatch, fake_timings):
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocker))
    with pytest.warns(UserWarning, match="could not save"):
        assert gemm_path(torch.float16) == WIDENED


def test_float16_scaling_takes_the_faster_rounding_or_the_environment(monkeypatch, fake_timings):
    if HAS_AVX512_FP16:  # one float16 multiply: nothing to choose, nothing measured
        assert float16_scaling() == FLOAT16_MULTIPLY
        return
    assert float16_scaling() == CONVERSIONS  # 20 us against 30
    assert gemm_paths.scaling_calibration()["float16_scaling_microseconds"] == {GRID: 30.0, CONVERSIONS: 20.0}
    monkeypatch.setenv(gemm_paths.SCALING_ENV, " Grid ")
    assert float16_scaling() == GRID
    monkeypatch.setenv(gemm_paths.SCALING_ENV, "fastest")
    with pytest.raises(ValueError, match="ATTNGRAD_FLOAT16_SCALING must be one of grid, conversions or auto"):
        float16_scaling()


def test_float16_scaling_is_measured_on_first_use_into_the_entry(monkeypatch, fake_timings):
    scalings = []
    monkeypatch.setattr(gemm_paths, "measure_float16_scaling",
                        lambda: scalings.append(1) or {GRID: 3.0, CONVERSIONS: 2.0})
    entry = calibration()
    assert "float16_scaling" not in entry and scalings == []  # the GEMM paths alone: no float16 softmax compiled
    expected = FLOAT16_MULTIPLY if HAS_AVX512_FP16 else CONVERSIONS
    assert float16_scaling() == expected and len(scalings) == (0 if HAS_AVX512_FP16 else 1)
    calibration.cache_clear()
    gemm_paths.scaling_calibration.cache_clear()
    saved = gemm_paths.scaling_calibration()  # read back from the file: measured neither again
    assert saved["float16_scaling"] == expected and saved["paths"] == entry["paths"]
    assert len(scalings) == (0 if HAS_AVX512_FP16 else 1) and len(fake_timings) == 2


def test_entry_without_its_key_gets_the_scaling_saved_under_this_machine(fake_timings):
    path = gemm_paths.cache_path()
    path.parent.mkdir(parents=True)
    bare = {"paths": {"bfloat16": WIDENED, "float16": NATIVE}}  # hand-edited: no key, no scaling
    path.write_text(json.dumps({"format": 1, "entries": {gemm_paths._key_text(gemm_paths.machine_key()): bare}}))
    entry = gemm_paths.scaling_calibration()
    assert entry["paths"] == bare["paths"] and entry["key"] == gemm_paths.machine_key() and fake_timings == []
    saved = json.loads(path.read_text())["entries"][gemm_paths._key_text(gemm_paths.machine_key())]
    assert saved["float16_scaling"] == entry["float16_scaling"]


def test_float16_scaling_measurement_times_both_roundings():
    timings = gemm_paths.measure_float16_scaling()
    assert set(timings) == {GRID, CONVERSIONS} and all(t > 0 for t in timings.values())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_measurement_runs_both_paths(dtype):
    timings = gemm_paths.measure(dtype)
    assert set(timings) == {NATIVE, WIDENED} and all(t > 0 for t in timings.values())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_both_paths_compute_the_same_product(dtype):
    """Widening is exact and both accumulate in fp32: the two paths give the same product (to fp32 rounding)."""
    a, b = (torch.randn(s).to(dtype) for s in ((64, 32), (32, 48)))
    bits = gemm_paths._KERNEL_BITS[dtype]
    av, bv = (t.view(torch.int16).numpy().view(bits) for t in (a, b))
    results = []
    for product, on_brgemm in ((gemm_paths._native_product, dtype in gemm_paths.BRGEMM_DTYPES),
                               (gemm_paths._widened_product, torch.float32 in gemm_paths.BRGEMM_DTYPES)):
        c = torch.empty(64, 48)
        product(av, bv, torch.empty(16, 48, dtype=torch.int32).numpy().view("uint32"), torch.empty(64, 32).numpy(),
                torch.empty(32, 48).numpy(), c.numpy(), on_brgemm)
        results.append(c)
    expected = a.double() @ b.double()
    for c in results:
        torch.testing.assert_close(c.double(), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_flash_attention_takes_the_forced_path(dtype, monkeypatch):
    """Both paths round P and dS to the input dtype and accumulate in fp32: same results up to the
    accumulation order, and each path is deterministic."""
    import attngrad

    q, k, v, dy = attention_inputs("BNSD", 1, 2, 1, 40, 72, 16, 16, dtype, seed=3)
    kw = dict(atten_mask=torch.ones(2048, 2048, dtype=torch.bool).triu(1), sparse_mode=2, scale_value=0.25)
    results = {}
    for path in (NATIVE, WIDENED, WIDENED):
        monkeypatch.setenv(gemm_paths.ENV, path)
        out, smax, ssum = attngrad.flash_attention_score(q, k, v, 2, "BNSD", **kw)
        grads = attngrad.flash_attention_score_grad(q, k, v, dy, 2, "BNSD", softmax_max=smax, softmax_sum=ssum,
                                                    attention_in=out, **kw)[:3]
        if path in results:
            assert all(torch.equal(a, b) for a, b in zip(results[path], (out, *grads)))
        results[path] = (out, *grads)
    for native, widened in zip(results[NATIVE], results[WIDENED]):
        torch.testing.assert_close(widened.float(), native.float(), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tile_roofline_multiplies_on_the_kernels_path(dtype):
    """The tile roofline's products are a @ b (fp32 accumulation of exact products) on the path the kernels
    take, and its rate is a positive number for two threads."""
    a, b, c = gemm_paths._tile_operands(dtype, 64, 32, 16)
    gemm_paths._repeated_products(a, b, c, 2, dtype in gemm_paths.BRGEMM_DTYPES)
    packed = dtype != torch.float32 and dtype in gemm_paths.BRGEMM_DTYPES
    expected = _values(a, dtype) @ _values(_unpack_pairs(b) if packed else b, dtype)
    torch.testing.assert_close(torch.from_numpy(c).double(), expected, rtol=1e-5, atol=1e-4)
    rate = gemm_paths.tile_tflops(dtype, 2, seconds=0.01)
    assert 0 < rate < float("inf")


def _values(bits: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    """float64 values of a kernel operand: float32 as it is, 16-bit types from their bits."""
    if dtype == torch.float32:
        return torch.from_numpy(bits).double()
    return torch.from_numpy(bits.view(np.int16)).view(dtype).double()


def _unpack_pairs(pairs: np.ndarray) -> np.ndarray:
    """VNNI pairs ``[k // 2, n]`` uint32 -> the rows ``[k, n]`` uint16 they interleave."""
    low, high = (pairs & 0xFFFF).astype(np.uint16), (pairs >> 16).astype(np.uint16)
    return np.stack([low, high], 1).reshape(-1, pairs.shape[1])
