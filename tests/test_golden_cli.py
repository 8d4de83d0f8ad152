"""``attngrad golden`` and ``attngrad compare`` on small cases written by the tests: pass, fail, nan, shape
mismatch and unusable files (a clear message and exit status 2)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

import attngrad
from attngrad.cli import main

SHAPE = (1, 2, 40, 16)


@pytest.fixture(scope="module")
def golden_file(tmp_path_factory):
    """A BNSD float32 case with dy, and its golden outputs (with the float64 reference)."""
    root = tmp_path_factory.mktemp("golden")
    g = torch.Generator().manual_seed(0)
    case = {name: torch.randn(SHAPE, generator=g) for name in ("query", "key", "value", "dy")}
    case["attributes"] = {"head_num": 2, "input_layout": "BNSD", "scale_value": 0.25}
    torch.save(case, root / "case.pt")
    assert main(["golden", str(root / "case.pt"), "--out", str(root / "golden.pt"), "--float64"]) == 0
    return root / "golden.pt"


def _compare(capsys, golden, actual, *extra):
    rc = main(["compare", str(golden), str(actual), "--json", *extra])
    return rc, capsys.readouterr()


def test_golden_writes_every_output_close_to_float64(golden_file):
    out = torch.load(golden_file, weights_only=True)
    assert set(out) == {"attention_out", "softmax_max", "softmax_sum", "dq", "dk", "dv", "attention_out_float64",
                        "dq_float64", "dk_float64", "dv_float64"}
    for name in ("attention_out", "dq", "dk", "dv"):
        torch.testing.assert_close(out[name].double(), out[f"{name}_float64"], rtol=1e-5, atol=1e-6)


def test_compare_pass_and_fail(golden_file, tmp_path, capsys):
    out = torch.load(golden_file, weights_only=True)
    actual = {n: out[n] for n in ("attention_out", "dq", "dk", "dv")}
    torch.save(actual, tmp_path / "same.pt")
    rc, captured = _compare(capsys, golden_file, tmp_path / "same.pt")
    report = json.loads(captured.out)
    assert rc == 0 and report["passed"] and {r["output"] for r in report["outputs"]} == set(actual)
    actual["dq"] = actual["dq"].clone()
    actual["dq"][0, 1, 3, :4] += 1.0  # 4 of 1280 elements off: 0.31% bad, still passes
    actual["dk"] = actual["dk"] * 1.02  # every element 2% off
    torch.save(actual, tmp_path / "off.pt")
    rc, captured = _compare(capsys, golden_file, tmp_path / "off.pt")
    outputs = {r["output"]: r for r in json.loads(captured.out)["outputs"]}
    assert rc == 1 and outputs["dq"]["passed"] and outputs["dq"]["bad"] == 4 and not outputs["dk"]["passed"]
    assert outputs["dq"]["worst"][0]["index"][:3] == [0, 1, 3]
    rc, _ = _compare(capsys, golden_file, tmp_path / "off.pt", "--rule", "fa")  # forward outputs only
    assert rc == 0
    assert main(["compare", str(golden_file), str(tmp_path / "off.pt")]) == 1  # the table
    assert "FAIL" in capsys.readouterr().out


def test_compare_nan_mismatch_fails(golden_file, tmp_path, capsys):
    out = torch.load(golden_file, weights_only=True)
    dv = out["dv"].clone()
    dv[0, 0, 0, 0] = float("nan")
    np.savez(tmp_path / "nan.npz", dv=dv.numpy())
    rc, captured = _compare(capsys, golden_file, tmp_path / "nan.npz", "--rule", "mere")
    (report,) = json.loads(captured.out)["outputs"]
    assert rc == 1 and report["nan_inf_mismatch"] == 1 and not report["passed"]


@pytest.mark.parametrize("problem,words", [("shape", "shape mismatch"), ("missing", "missing dq"),
                                           ("truncated", "cannot read"), ("not a dict", "dict of named tensors")])
def test_compare_unusable_input_exits_2(golden_file, tmp_path, capsys, problem, words):
    out = torch.load(golden_file, weights_only=True)
    path = tmp_path / "actual.pt"
    if problem == "shape":
        torch.save({"dq": out["dq"][..., :8]}, path)
    elif problem == "missing":
        torch.save({"dq": out["dq"]}, path)
        golden_file = tmp_path / "golden_fwd.pt"
        torch.save({"attention_out": out["attention_out"]}, golden_file)
    elif problem == "truncated":
        torch.save(out, path)
        path.write_bytes(path.read_bytes()[:200])
    else:
        torch.save([out["dq"]], path)
    assert main(["compare", str(golden_file), str(path)]) == 2
    assert words in capsys.readouterr().err


def test_golden_case_errors(tmp_path, capsys):
    np.savez(tmp_path / "case.npz", query=np.zeros(SHAPE, np.float32), key=np.zeros(SHAPE, np.float32))
    assert main(["golden", str(tmp_path / "case.npz")]) == 2
    assert "missing value, head_num, input_layout" in capsys.readouterr().err
    np.savez(tmp_path / "case.npz", **{n: np.ones(SHAPE, np.float32) for n in ("query", "key", "value")})
    (tmp_path / "case.json").write_text(json.dumps({"head_num": 3, "input_layout": "BNSD", "dtype": "bfloat16"}))
    assert main(["golden", str(tmp_path / "case.npz")]) == 2
    assert "161002" in capsys.readouterr().err


def test_golden_case_unknown_entry_is_an_error(tmp_path, capsys):
    case = {name: torch.ones(SHAPE) for name in ("query", "key", "value")}
    case.update(attn_mask=torch.zeros(SHAPE[2], SHAPE[2], dtype=torch.bool),
                attributes={"head_num": 2, "input_layout": "BNSD"})
    torch.save(case, tmp_path / "case.pt")
    assert main(["golden", str(tmp_path / "case.pt")]) == 2
    assert "unknown entry 'attn_mask'" in capsys.readouterr().err


def test_golden_case_with_rope_parts_and_sink(tmp_path, capsys):
    """query_rope / key_rope / sink reach the operator: the golden file holds the golden-mode outputs of the call
    with them, their gradients included; --float64 refuses them."""
    g = torch.Generator().manual_seed(1)
    case = {name: torch.randn(SHAPE, generator=g) for name in ("query", "key", "value", "dy")}
    case.update(query_rope=torch.randn(*SHAPE[:3], 8, generator=g),
                key_rope=torch.randn(1, 1, SHAPE[2], 8, generator=g), sink=torch.tensor([0.5, 2.0]),
                attributes={"head_num": 2, "input_layout": "BNSD", "scale_value": 0.25})
    torch.save(case, tmp_path / "case.pt")
    assert main(["golden", str(tmp_path / "case.pt"), "--out", str(tmp_path / "golden.pt")]) == 0
    golden = torch.load(tmp_path / "golden.pt", weights_only=True)
    extras = {name: case[name] for name in ("query_rope", "key_rope", "sink")}
    inputs = [case[name] for name in ("query", "key", "value")]
    with attngrad.precision_mode("golden"):
        out, smax, ssum = attngrad.flash_attention_score(*inputs, 2, "BNSD", scale_value=0.25, **extras)
        grads = attngrad.flash_attention_score_grad(*inputs, case["dy"], 2, "BNSD", scale_value=0.25,
                                                    softmax_max=smax, softmax_sum=ssum, attention_in=out, **extras)
    expected = dict(attention_out=out, softmax_max=smax, softmax_sum=ssum, dq=grads[0], dk=grads[1], dv=grads[2],
                    dq_rope=grads[4], dk_rope=grads[5], dsink=grads[6])
    assert sorted(golden) == sorted(expected)
    for name, tensor in expected.items():
        assert torch.equal(golden[name], tensor), name
    assert main(["golden", str(tmp_path / "case.pt"), "--float64"]) == 2
    assert "--float64 does not support query_rope, key_rope, sink" in capsys.readouterr().err
