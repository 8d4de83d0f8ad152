"""FlashAttention masks, sparse modes 0-8, tokens and prefix against the float64 reference.

The goldens do not use the library's mode resolution: each mode's excluded positions are built here from the
index rules of docs/cann-semantics.md ('Masks and sparse modes') as a dense boolean mask and given to the
plain reference.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

import attngrad
from attngrad import AclnnError
from attngrad.kernels.flash_attention import _INSIDE, _OUTSIDE, _tile_kind, _visible_tile
from attngrad.kernels.flash_attention_plan import (FLT_MAX, MASKED_LOGIT, UNBOUNDED_TOKENS, AttentionPlan,
                                                   sparse_rule, varlen_sparse_bands, visible_pairs)
from attngrad.kernels.flash_attention_reference import (flash_attention_backward_reference,
                                                        flash_attention_forward_reference)
from attngrad.ops.flash_attention import to_bnsd
from attngrad.precision import assert_close

from helpers import attention_inputs

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
LAYOUTS = ["BSH", "SBH", "BSND", "BNSD"]
B, N1, N2, D = 2, 2, 1, 16
SCALE = 0.25


def spec_excluded(mode, sq, skv, pre, nxt, prefix):
    """Bool [B, 1, Sq, Skv]: the documented index rule of ``mode`` (True = excluded), without the mask's content."""
    i = torch.arange(sq).view(1, 1, sq, 1)
    j = torch.arange(skv).view(1, 1, 1, skv)
    rules = {0: (j - i > nxt) | (i - j > pre), 1: torch.zeros(1, 1, sq, skv, dtype=torch.bool), 2: j > i,
             3: j > i + skv - sq, 4: (j - i > nxt + skv - sq) | (i - j > pre - (skv - sq))}
    if mode in rules:
        return rules[mode].expand(B, 1, sq, skv)
    if mode == 5:  # the mask alone decides; the prefix only says which keys the mask is expected to exclude
        return torch.zeros(B, 1, sq, skv, dtype=torch.bool)
    return (j > i + skv - sq) & (j >= torch.tensor(prefix).view(B, 1, 1, 1))


def run_and_check(layout, dtype, sq, skv, *, mode=0, mask=None, pre=UNBOUNDED_TOKENS, nxt=UNBOUNDED_TOKENS,
                  prefix=None, inner_precise=0, seed=0):
    """Forward + grad through attngrad's torch API, compared with the reference on the documented dense mask."""
    q, k, v, dy = attention_inputs(layout, B, N1, N2, sq, skv, D, D, dtype, seed)
    kw = dict(atten_mask=mask, sparse_mode=mode, pre_tokens=pre, next_tokens=nxt, prefix=prefix,
              inner_precise=inner_precise, scale_value=SCALE)
    out, smax, ssum = attngrad.flash_attention_score(q, k, v, N1, layout, **kw)
    dq, dk, dv, _ = attngrad.flash_attention_score_grad(q, k, v, dy, N1, layout, softmax_max=smax,
                                                        softmax_sum=ssum, attention_in=out, **kw)
    rule = spec_excluded(mode, sq, skv, pre, nxt, prefix)
    excluded = rule
    if mode in (0, 1, 5):
        excluded = rule | (mask.view(-1, mask.shape[-3] if mask.dim() == 4 else 1, sq, skv) != 0)
    invalid = inner_precise == 2 or bool(rule.all(-1).any())
    plan = AttentionPlan(scale=SCALE, atten_mask=excluded, invalid_rows=invalid)
    bq, bk, bv = to_bnsd(q, layout, N1), to_bnsd(k, layout, N2), to_bnsd(v, layout, N2)
    g_out, g_max, g_sum = flash_attention_forward_reference(bq, bk, bv, plan)
    assert_close(to_bnsd(out, layout, N1), g_out, dtype)
    assert_close(smax[..., 0], g_max, torch.float32)
    assert_close(ssum[..., 0], g_sum, torch.float32)
    golden = flash_attention_backward_reference(bq, bk, bv, to_bnsd(dy, layout, N1), to_bnsd(out, layout, N1),
                                                smax[..., 0], ssum[..., 0], plan)
    for got, want, n in zip((dq, dk, dv), golden, (N1, N2, N2)):
        assert not got.float().isnan().any()
        assert_close(to_bnsd(got, layout, n), want, dtype)
    return out, smax, ssum


def compressed(mode):
    rows = 3072 if mode == 6 else 2048
    triu = torch.triu(torch.ones(2048, 2048, dtype=torch.bool), diagonal=1)
    if mode == 6:
        tail = torch.cat([torch.zeros(1024, 1024, dtype=torch.bool), torch.ones(1024, 1024, dtype=torch.bool)], 1)
        triu = torch.cat([triu, tail], 0)
    assert triu.shape == (rows, 2048)
    return triu


def random_mask(shape, dtype=torch.bool, seed=1, p=0.2):
    g = torch.Generator().manual_seed(seed)
    m = torch.rand(shape, generator=g) < p
    return m if dtype == torch.bool else m.to(torch.uint8) * 7  # any nonzero byte excludes


MODE_CASES = [  # mode, (Sq, Skv), pre, next, prefix
    (0, (300, 520), 100, -20, None), (0, (530, 300), 40, 90, None),
    (1, (300, 520), 3, 3, None), (1, (530, 300), UNBOUNDED_TOKENS, UNBOUNDED_TOKENS, None),
    (2, (300, 520), 0, 0, None), (2, (530, 300), UNBOUNDED_TOKENS, 0, None),
    (3, (300, 520), UNBOUNDED_TOKENS, 0, None), (3, (530, 300), UNBOUNDED_TOKENS, 0, None),
    (4, (300, 520), 64, 32, None), (4, (530, 300), 64, 32, None), (4, (400, 400), 0, 0, None),
    (5, (300, 520), 0, 0, [250, 400]), (5, (530, 300), 0, 0, [0, 120]), (5, (300, 300), 0, 0, None),
    (6, (300, 520), 0, 0, [220, 520]), (6, (530, 300), 0, 0, [0, 300]),
]


@pytest.mark.parametrize("index,case", list(enumerate(MODE_CASES)))
def test_sparse_modes(index, case):
    """Every mode, Sq < Skv and Sq > Skv over several tiles, cycling layouts and dtypes."""
    mode, (sq, skv), pre, nxt, prefix = case
    layout, dtype = LAYOUTS[index % 4], DTYPES[index % 3]
    mask = compressed(mode) if mode in (2, 3, 4, 6) else random_mask((B, 1, sq, skv), seed=index)
    run_and_check(layout, dtype, sq, skv, mode=mode, mask=mask, pre=pre, nxt=nxt, prefix=prefix)


@pytest.mark.parametrize("shape", ["SS", "11SS", "B1SS", "BNSS"])
@pytest.mark.parametrize("mask_dtype", [torch.bool, torch.uint8])
def test_mask_shapes_and_dtypes(shape, mask_dtype):
    sq, skv = 270, 290
    dims = {"SS": (sq, skv), "11SS": (1, 1, sq, skv), "B1SS": (B, 1, sq, skv), "BNSS": (B, N1, sq, skv)}[shape]
    layout = LAYOUTS[len(shape) % 4]
    run_and_check(layout, torch.bfloat16, sq, skv, mode=1, mask=random_mask(dims, mask_dtype))


@pytest.mark.parametrize("pre,nxt", [(-30, 80), (80, -30), (0, 0), (UNBOUNDED_TOKENS, 0), (5, UNBOUNDED_TOKENS)])
def test_tokens_negative_and_positive(pre, nxt):
    sq, skv = 280, 300
    run_and_check("BSND", torch.float16, sq, skv, mode=0, mask=random_mask((sq, skv), p=0.05), pre=pre, nxt=nxt)


def test_mask_with_non_contiguous_view():
    sq, skv = 260, 270
    mask = random_mask((B, 1, skv, sq)).transpose(-1, -2)
    run_and_check("BNSD", torch.float32, sq, skv, mode=1, mask=mask)


def test_compressed_mask_is_not_read():
    """Modes 2/3/4/6 run from the index rule: the compressed tensor's content is never read."""
    q, k, v, _ = attention_inputs("BNSD", B, N1, N2, 300, 300, D, D, torch.float32)
    ones = torch.ones(2048, 2048, dtype=torch.bool)
    got = attngrad.flash_attention_score(q, k, v, N1, "BNSD", atten_mask=ones, sparse_mode=2)[0]
    want = attngrad.flash_attention_score(q, k, v, N1, "BNSD", atten_mask=compressed(2), sparse_mode=2)[0]
    assert torch.equal(got, want)


@pytest.mark.parametrize("inner_precise", [0, 2])
def test_fully_masked_rows(inner_precise):
    """A user mask with empty rows: uniform rows (normal) or O = 0, max = -FLT_MAX, sum = +FLT_MAX (mode 2)."""
    sq, skv = 300, 280
    mask = torch.zeros(sq, skv, dtype=torch.bool)
    mask[7] = True
    mask[290:] = True
    out, smax, ssum = run_and_check("BSH", torch.bfloat16, sq, skv, mode=1, mask=mask,
                                    inner_precise=inner_precise)
    assert (smax[:, :, 7] == MASKED_LOGIT).all()
    assert (ssum[:, :, 7] == (FLT_MAX if inner_precise == 2 else skv)).all()
    if inner_precise == 2:
        assert (out[:, 290:] == 0).all()


@pytest.mark.parametrize("mode,sq,skv,pre,nxt,prefix", [
    (3, 400, 300, UNBOUNDED_TOKENS, 0, None),   # right-down causal with Sq > Skv
    (4, 300, 300, -10, 50, None),               # band whose first rows are empty
    (0, 300, 300, 20, -5, None),
    (6, 530, 300, 0, 0, [0, 100]),              # prefix 0 with Sq > Skv
])
def test_invalid_rows_auto_enabled(mode, sq, skv, pre, nxt, prefix):
    """When the rule itself leaves rows without keys, the invalid-row mode is on by itself."""
    mask = compressed(mode) if mode in (3, 4, 6) else torch.zeros(sq, skv, dtype=torch.bool)
    out, smax, ssum = run_and_check("BNSD", torch.float32, sq, skv, mode=mode, mask=mask, pre=pre, nxt=nxt,
                                    prefix=prefix)
    empty = spec_excluded(mode, sq, skv, pre, nxt, prefix).all(-1)   # [B, 1, Sq]
    assert empty.any()
    rows = empty.expand(B, N1, sq)
    assert (ssum[..., 0][rows] == FLT_MAX).all() and (smax[..., 0][rows] == MASKED_LOGIT).all()
    assert (out.float().permute(0, 1, 2, 3)[rows] == 0).all()


# ----------------------------------------------------------------------------------------- rule level
def random_tiles(seed, count=400):
    """``count`` random tiles with band rules: ``(i0, rows, j0, cols, pre, nxt, pfx)`` and the brute-force
    visibility ``[rows, cols]`` of their keys (band ``i - pre <= j <= i + nxt``, or ``j < pfx``)."""
    g = np.random.default_rng(seed)
    for _ in range(count):
        i0, j0 = (int(x) for x in g.integers(0, 600, 2))
        rows, cols = (int(x) for x in g.integers(1, 300, 2))
        pre, nxt = (int(x) for x in g.integers(-300, 300, 2))
        pfx = int(g.integers(0, 700)) if g.random() < 0.5 else 0
        i = np.arange(i0, i0 + rows)[:, None]
        j = np.arange(j0, j0 + cols)[None, :]
        yield (i0, rows, j0, cols, pre, nxt, pfx), ((j >= i - pre) & (j <= i + nxt)) | (j < pfx)


def test_tile_kind_matches_brute_force():
    for (i0, rows, j0, cols, pre, nxt, pfx), visible in random_tiles(0):
        kind = _tile_kind(i0, rows, j0, cols, pre, nxt, pfx)
        if kind == _OUTSIDE:
            assert not visible.any()
        elif kind == _INSIDE:
            assert visible.all()
        if not visible.any() and pfx <= j0 and pre + nxt >= 0:
            assert kind == _OUTSIDE  # an invisible tile of a non-empty band is always skipped


def test_visible_tile_drops_only_leading_columns_no_row_sees():
    """The tile cut at a band's left edge: the dropped leading columns (an even count) hold no visible key of any
    row, and where the first row sees a key of the tile, the columns before it go (but the one that keeps the count
    even)."""
    cut = 0
    for (i0, rows, j0, cols, pre, nxt, pfx), visible in random_tiles(1):
        tile, kind, lead = _visible_tile(0, 0, i0, rows, j0, cols, pre, nxt, pfx)
        assert lead % 2 == 0 and 0 <= lead <= cols and tuple(tile) == (0, 0, i0, rows, j0 + lead, cols - lead)
        assert not visible[:, :lead].any()
        assert kind == _tile_kind(i0, rows, j0 + lead, cols - lead, pre, nxt, pfx)
        first_seen = np.flatnonzero(visible[0])  # the first row's keys start the band in the tile
        if pfx <= j0 and first_seen.size:
            assert lead >= first_seen[0] - 1  # at most the one column that keeps the count even
        cut += lead > 0
    assert cut > 50


@pytest.mark.parametrize("mode", range(7))
@pytest.mark.parametrize("sq,skv", [(37, 53), (53, 37)])
def test_sparse_rule_and_visible_pairs(mode, sq, skv):
    pre, nxt, prefix = 9, 4, ([3, 37] if sq > skv else [20, 53])
    r_pre, r_nxt, r_prefix = sparse_rule(mode, pre, nxt, sq, skv, prefix)
    plan = AttentionPlan(scale=1.0, pre_tokens=r_pre, next_tokens=r_nxt,
                         prefix=None if r_prefix is None else tuple(r_prefix))
    i = torch.arange(sq).view(sq, 1)
    j = torch.arange(skv).view(1, skv)
    visible = ((j >= i - r_pre) & (j <= i + r_nxt)).expand(B, sq, skv)
    if r_prefix is not None:
        visible = visible | (j < torch.tensor(r_prefix).view(B, 1, 1))
    # mode 5's index rule is mode 6's (it decides which rows are invalid); its results follow the mask alone
    assert torch.equal(~visible, spec_excluded(6 if mode == 5 else mode, sq, skv, pre, nxt, prefix)[:, 0])
    assert visible_pairs(plan, B, N1, sq, skv) == N1 * int(visible.sum())
    mask = random_mask((B, 1, sq, skv))
    masked = AttentionPlan(scale=1.0, atten_mask=mask, pre_tokens=r_pre, next_tokens=r_nxt, prefix=plan.prefix)
    assert visible_pairs(masked, B, N1, sq, skv) == N1 * int((visible & ~mask[:, 0]).sum())


def _rule_mask(pre, nxt, sq, skv):
    i = torch.arange(sq).view(sq, 1)
    j = torch.arange(skv).view(1, skv)
    return (j - i > nxt) | (i - j > pre)


def test_varlen_split_modes_rule():
    """Modes 7/8 (CANN's documented examples): the band batch and the causal batches."""
    pre, nxt = 6, -2
    sq_lens, skv_lens = [3, 5, 0], [3, 9, 0]
    bands = varlen_sparse_bands(7, pre, nxt, sq_lens, skv_lens)
    for b, ((p, n), sq, skv) in enumerate(zip(bands, sq_lens, skv_lens)):
        want = ((_rule_mask(pre - (skv - sq), nxt + skv - sq, sq, skv)) if b == 1     # last batch with Sq != 0
                else (torch.arange(skv).view(1, skv) > torch.arange(sq).view(sq, 1) + skv - sq))
        assert torch.equal(_rule_mask(p, n, sq, skv), want)
    pre, nxt = 4, 1
    sq_lens, skv_lens = [0, 3, 5, 4], [0, 4, 5, 4]
    bands = varlen_sparse_bands(8, pre, nxt, sq_lens, skv_lens)
    for b, ((p, n), sq, skv) in enumerate(zip(bands, sq_lens, skv_lens)):
        want = ((_rule_mask(pre - (skv - sq), nxt + skv - sq, sq, skv)) if b == 1     # first batch with Sq != 0
                else (torch.arange(skv).view(1, skv) > torch.arange(sq).view(sq, 1)))
        assert torch.equal(_rule_mask(p, n, sq, skv), want)
    with pytest.raises(ValueError):
        varlen_sparse_bands(3, 0, 0, [1], [1])


# ----------------------------------------------------------------------------------------- validation
def _forward(sq=20, skv=24, **kw):
    q, k, v, _ = attention_inputs("BNSD", B, N1, N2, sq, skv, D, D, torch.float32)
    return attngrad.flash_attention_score(q, k, v, N1, "BNSD", **kw)


SS = torch.zeros(20, 24, dtype=torch.bool)
C2 = torch.zeros(2048, 2048, dtype=torch.bool)
ERRORS = [  # kwargs, status, param, words
    (dict(atten_mask=SS, pre_tokens=-24, next_tokens=30), 161002, "preTokens/nextTokens", "selects no key"),
    (dict(atten_mask=SS, pre_tokens=30, next_tokens=-20), 161002, "preTokens/nextTokens", "selects no key"),
    (dict(atten_mask=SS, pre_tokens=-5, next_tokens=4), 161002, "preTokens/nextTokens", "selects no key"),
    (dict(atten_mask=C2, sparse_mode=4, pre_tokens=-10, next_tokens=-10), 161002, "preTokens/nextTokens",
     "right-down"),
    (dict(atten_mask=SS, sparse_mode=5, prefix=[4, 24]), 161002, "attenMask", "per-batch"),
    (dict(atten_mask=SS.expand(B, 1, 20, 24), sparse_mode=5, prefix=[4]), 161002, "prefix", "B = 2"),
    (dict(atten_mask=torch.zeros(3072, 2048, dtype=torch.bool), sparse_mode=6, prefix=[3, 24]), 161002, "prefix",
     "[4"),
    (dict(atten_mask=torch.zeros(3072, 2048, dtype=torch.bool), sparse_mode=6), 161001, "prefix", "null"),
    (dict(atten_mask=C2, sparse_mode=6, prefix=[4, 4]), 161002, "attenMask", "[3072, 2048]"),
    (dict(atten_mask=torch.zeros(1024, 1024, dtype=torch.bool), sparse_mode=3), 161002, "attenMask", "2048"),
    (dict(atten_mask=C2, sparse_mode=8), 161002, "sparseMode", "TND"),
    (dict(atten_mask=SS.view(1, 20, 24)), 161002, "attenMask", "2-D"),
    (dict(atten_mask=SS.expand(1, 2, 20, 24)), 161002, "attenMask", "dims 0-1"),
]


@pytest.mark.parametrize("kw,status,param,words", ERRORS)
def test_invalid_masks_modes_tokens_prefix(kw, status, param, words):
    with pytest.raises(AclnnError) as exc:
        _forward(**kw)
    assert exc.value.status == status and exc.value.param == param
    assert words in str(exc.value)


def test_mode0_tokens_valid_edges_and_ignored_without_mask():
    _forward(atten_mask=SS, pre_tokens=-23, next_tokens=30)    # row 0 still sees key 23
    _forward(pre_tokens=-100, next_tokens=-100)                 # no mask: tokens ignored (CANN)
    _forward(atten_mask=SS, sparse_mode=1, pre_tokens=-100, next_tokens=-100)   # mode 1 ignores tokens


@pytest.mark.parametrize("prefix,warns", [([100], True), ([600], False)])
def test_mode5_prefix_outside_documented_range_warns_and_follows_the_mask(prefix, warns):
    """Mode 5, Sq 256 < Skv 512: the documented range is [256, 512]; a prefix of 100 (a CANN test case) warns and
    computes from the mask, a prefix > Skv means full computation (documented, no warning)."""
    sq, skv = 256, 512
    q, k, v, dy = attention_inputs("BNSD", 1, 1, 1, sq, skv, D, D, torch.float32)
    i, j = torch.arange(sq).view(sq, 1), torch.arange(skv).view(1, skv)
    mask = ((j > i + skv - sq) & (j >= 100)).view(1, 1, sq, skv)
    kw = dict(atten_mask=mask, sparse_mode=5, prefix=prefix, scale_value=SCALE)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out, smax, ssum = attngrad.flash_attention_score(q, k, v, 1, "BNSD", **kw)
        dq, dk, dv, _ = attngrad.flash_attention_score_grad(q, k, v, dy, 1, "BNSD", softmax_max=smax,
                                                            softmax_sum=ssum, attention_in=out, **kw)
    messages = [str(w.message) for w in caught]
    assert any("documented range [256, 512]" in m for m in messages) == warns, messages
    plan = AttentionPlan(scale=SCALE, atten_mask=mask)
    g_out, g_max, g_sum = flash_attention_forward_reference(q, k, v, plan)
    assert_close(out, g_out)
    for got, want in zip((dq, dk, dv), flash_attention_backward_reference(q, k, v, dy, out, smax[..., 0],
                                                                         ssum[..., 0], plan)):
        assert_close(got, want)
