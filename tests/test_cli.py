"""``attngrad verify --op`` and ``attngrad examples NAME``: selection by name, and a name that selects nothing
exits with status 2 and lists what there is (before anything runs)."""

from __future__ import annotations

from attngrad.cli import main
from attngrad.verification import select_cases


def test_verify_op_is_a_case_insensitive_substring():
    assert {case.op for case in select_cases(["flashattentionscore"])} == {"FlashAttentionScoreGrad"}
    assert {case.op for case in select_cases(["Softmax", "segsum"])} == {"ScaledMaskedSoftmax", "ExpSegsum"}
    assert {case.op for case in select_cases(None)} == {"ExpSegsum", "FlashAttentionScoreGrad", "ScaledMaskedSoftmax"}


def test_verify_unknown_op_exits_2_listing_the_operators(capsys):
    assert main(["verify", "--op", "ExpSegsum", "--op", "bogus"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "no operator matches 'bogus'" in captured.err
    assert "ExpSegsum, FlashAttentionScoreGrad, ScaledMaskedSoftmax" in captured.err


def test_examples_unknown_name_exits_2_listing_the_examples(capsys):
    assert main(["examples", "exp_segsum", "no_such_example"]) == 2
    captured = capsys.readouterr()
    assert "===" not in captured.out
    assert "no example 'no_such_example'" in captured.err
    assert "scaled_masked_softmax_backward" in captured.err
