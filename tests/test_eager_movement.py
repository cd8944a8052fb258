"""How eager operands and results move on the card: a Linear's transposed weight read in place
by the matmul, views of results and of host bytes gathered by one slice, and ``cat`` of sizes
that keep changing (a KV cache) as one data movement per size bucket, with no kernel compiled
per size. Every case against torch on the CPU."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_eager_buckets import _compiles, _fresh  # noqa: F401  (_fresh: autouse fixture)

import spyre_jax
from spyre_jax.tools.testing import assert_close
from torch_bridge import card_cat, eager, operands, storage


def _same(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.shape == want.shape and got.dtype == want.dtype
    assert torch.equal(got.cpu(), want)


@pytest.mark.parametrize("which", ["linear", "mm", "addmm", "bmm"])
def test_an_operand_given_transposed_is_read_in_place(which):
    """``x @ w.t()`` (a Linear) passes ``w``'s own bytes and the matmul reads them transposed
    (``rhs_t``): no gather of the weight on every call."""
    g = torch.Generator().manual_seed(0)
    x, w, b = torch.randn(5, 96, generator=g), torch.randn(40, 96, generator=g), torch.randn(40)
    sx, sw, sb = x.to("spyre"), w.to("spyre"), b.to("spyre")
    if which == "linear":
        got, want = torch.nn.functional.linear(sx, sw, sb), torch.nn.functional.linear(x, w, b)
    elif which == "mm":
        got, want = sx @ sw.t(), x @ w.t()
    elif which == "addmm":
        got, want = torch.addmm(sb, sx, sw.t()), torch.addmm(b, x, w.t())
    else:
        q, k = torch.randn(3, 7, 32, generator=g), torch.randn(3, 9, 32, generator=g)
        got = torch.bmm(q.to("spyre"), k.to("spyre").transpose(1, 2))
        want = torch.bmm(q, k.transpose(1, 2))
    assert_close(got.cpu(), want)
    # plans that read their right-hand operand in place (another test's may read a left-hand
    # one given transposed, ``x.t() @ x``, which the kernel transposes back: no rhs_t)
    rhs = {torch.ops.aten.mm.default: 1, torch.ops.aten.bmm.default: 1}
    rhs[torch.ops.aten.addmm.default] = 2
    nt = [
        p
        for k, p in eager._plans.items()
        if p.compiled is not None and any(i[4] and i[0] == rhs.get(k[0][0]) for i in p.inputs)
    ]
    assert nt, "no plan read its operand in place"
    stages = [s for p in nt for s in p.compiled.kernel.stages if s.kind == "matmul"]
    assert stages and all(s.step.rhs_t for s in stages)
    with spyre_jax.profile() as prof:  # the weight is not re-laid out on the second call
        (sx @ sw.t()).cpu()
    assert not [r for r in prof.records if r.name.startswith("relayout")]


VIEWS = {
    "rows": lambda t: t[1:4],
    "middle": lambda t: t[:, 2:4],
    "last dim": lambda t: t[..., 3:20],
    "one row": lambda t: t[2],
    "box": lambda t: t[2:3, 1:2, 5:9],
    "regrouped": lambda t: t.reshape(t.shape[0] * t.shape[1], -1)[7:11],
    "element": lambda t: t[5, 3],
    "flattened": lambda t: t[1:3].reshape(-1),
    "transposed": lambda t: t.transpose(0, 2),
    "heads": lambda t: t.reshape(6, -1, 4, t.shape[-1] // 4).transpose(1, 2)[:, :, 1:],
    "rows run on": lambda t: t.as_strided((1, 2, t.shape[-1]), t.stride(), 20),  # not a box
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.int64, torch.bool])
@pytest.mark.parametrize("source", ["host", "pending"])
@pytest.mark.parametrize("shape", [(6, 5, 40), (6, 4, 64)])  # rows padded to sticks, or not
@pytest.mark.slow
def test_views_of_results_and_of_host_bytes_reach_kernels_as_torch_sees_them(dtype, source, shape):
    g = torch.Generator().manual_seed(1)
    base = torch.randn(*shape, generator=g) * 10
    base = base > 0 if dtype == torch.bool else base.to(dtype)
    s = base.to("spyre")

    def op(t: torch.Tensor) -> torch.Tensor:
        return t | t if dtype == torch.bool else t * 1

    for view in VIEWS.values():
        for _ in range(2):  # a geometry's first use is a host copy, its second the card's gather
            src = s
            if source == "pending":  # a fresh result each time (a host copy reads it back)
                src = op(s)
                assert storage.region(src).pending is not None
            _same(op(view(src)), op(view(base)))


@pytest.mark.slow
def test_cat_along_a_growing_dim_compiles_nothing_per_size():
    """A KV cache grown by one position each step and an attention mask grown by one column:
    one data movement per bucket (no kernel per length), the result fed to the next kernels."""
    g = torch.Generator().manual_seed(2)
    k = torch.randn(1, 2, 5, 32, generator=g)
    mask = torch.ones(1, 5, dtype=torch.int64)
    sk, smask = k.to("spyre"), mask.to("spyre")
    q = torch.randn(1, 2, 1, 32, generator=g)
    sq = q.to("spyre")
    cats = card_cat.stats()["card_cats"]
    before = None
    for step in range(70):  # 5 -> 75 positions: buckets 64 and 128
        new = torch.randn(1, 2, 1, 32, generator=g)
        k, sk = torch.cat([k, new], -2), torch.cat([sk, new.to("spyre")], dim=-2)
        one = torch.ones(1, 1, dtype=torch.int64)
        mask, smask = torch.cat([mask, one], -1), torch.cat([smask, one.to("spyre")], -1)
        scores = (sq @ sk.transpose(-1, -2)).cpu()
        assert_close(scores, q @ k.transpose(-1, -2))
        if step == 3:
            before = _compiles()
    _same(sk, k)
    _same(smask, mask)
    assert _compiles() - before <= 2  # the consumers on bucket 128; no cat kernel per length
    assert card_cat.stats()["card_cats"] - cats >= 2 * 65


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    sizes=st.lists(st.integers(1, 70), min_size=2, max_size=4),
    dim=st.integers(0, 2),
    dtype=st.sampled_from([torch.float32, torch.float16, torch.int64, torch.bool]),
    sliced=st.booleans(),
)
@pytest.mark.slow
def test_cat_on_a_bucket_equals_torch(sizes, dim, dtype, sliced):
    """Any number of inputs of any sizes along any dim, as views or whole, of every dtype: the
    bucket's data movement gives torch's result (two calls first make the family dynamic)."""
    g = torch.Generator().manual_seed(sum(sizes) + dim)

    def make(n: int) -> torch.Tensor:
        shape = [3, 4, 5]
        shape[dim] = n + (2 if sliced else 0)
        x = torch.randn(*shape, generator=g) * 4
        x = x > 0 if dtype == torch.bool else x.to(dtype)
        return x.narrow(dim, 1, n) if sliced else x

    for extra in (3, 0):  # another size first: cat's family varies
        xs = [make(n + extra) for n in sizes]
        got = torch.cat([x.to("spyre") for x in xs], dim)
        _same(got, torch.cat(xs, dim))


def test_cat_of_mixed_dtypes_or_an_empty_input_takes_the_ordinary_path():
    for n in (3, 5, 7):
        a, b = torch.randn(2, n), torch.randn(2, 3, dtype=torch.float16)
        torch.testing.assert_close(
            torch.cat([a.to("spyre"), b.to("spyre")], 1).cpu(), torch.cat([a, b], 1)
        )
        e = torch.randn(2, 0)
        _same(torch.cat([a.to("spyre"), e.to("spyre")], 1), torch.cat([a, e], 1))
    with pytest.raises(RuntimeError):
        torch.cat([torch.randn(2, 3).to("spyre"), torch.randn(3, 3).to("spyre")], 1)


def test_cat_with_an_empty_1d_input_runs_on_the_card_without_it():
    """torch skips a 1-D input of no elements (an empty cache a first ``cat`` fills): the call
    runs on the card without it, not on the host for having no elements (regression: each
    layer's first key and value ``cat`` of ``generate()`` ran on the host)."""
    k = torch.randn(1, 2, 8, 32)
    sk = k.to("spyre") + 0  # a whole pending result: moved on the card, no kernel compiled
    host, compiles = eager.stats()["host_factories"], _compiles()
    got = torch.cat([torch.empty(0).to("spyre"), sk], dim=-2)
    assert eager.stats()["host_factories"] == host and _compiles() == compiles
    _same(got, torch.cat([torch.empty(0), k], dim=-2))
    # two inputs left: the cat runs on the card without the empty one
    got = torch.cat([sk, torch.empty(0).to("spyre"), sk], dim=-2)
    assert eager.stats()["host_factories"] == host
    _same(got, torch.cat([k, torch.empty(0), k], dim=-2))
    # an empty input of another dtype takes part in the result's dtype: the ordinary path
    e = torch.empty(0, dtype=torch.float16)
    _same(torch.cat([e.to("spyre"), k.to("spyre")], -2), torch.cat([e, k], -2))


@pytest.mark.slow
def test_isin_over_growing_elements_runs_on_a_bucket():
    """``isin`` (generate's end-of-sequence check) pads the elements, never the values looked
    up: after the first sizes, nothing compiles per length."""
    g = torch.Generator().manual_seed(4)
    eos = torch.tensor([3, 7])
    before = None
    for n in range(5, 40, 2):
        ids = torch.randint(0, 10, (1, n), generator=g)
        _same(torch.isin(ids.to("spyre"), eos.to("spyre")), torch.isin(ids, eos))
        if n == 7:
            before = _compiles()
        if n == 31:  # the int32 rows' first bucket is one stick, 32 elements; then 64
            assert _compiles() == before
    assert _compiles() == before + 1
    for m in (2, 3, 4):  # the values looked up varying: exact, still right
        vals = torch.arange(m)
        _same(torch.isin(ids.to("spyre"), vals.to("spyre")), torch.isin(ids, vals))


def test_a_result_laid_out_by_strides_is_read_whole_without_a_gather():
    """torch keeps a permuted input's strides in a pointwise result; the next kernel reading all
    of it takes the card array as it is (only its padding masked)."""
    x = torch.randn(6, 5, 40)
    s = x.to("spyre")
    for _ in range(2):
        r = s.transpose(0, 2) * 2  # strides (1, 40, 200), pending
        assert r.stride() == (x.transpose(0, 2) * 2).stride()
        key, _ = operands._view_key(storage.region(r), r, storage.region(r).pending.layout, 0)
        assert key[0][0] == "masked"
        pend = storage.region(r).pending
        if pend.shape == pend.layout.shape:  # not at a bucket (a plan cached by another test)
            buf, geometry = operands.card_operand(r, pend.layout)
            buf.delete()
            assert geometry is None  # read as it is: no gather folded into the kernel
        _same((r + 1).cpu(), x.transpose(0, 2) * 2 + 1)
