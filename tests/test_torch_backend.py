"""``torch.compile(backend="spyre")``: core ATen ops and transformer models vs eager CPU."""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import torch_rand as _rand

from lowering.errors import UnsupportedPrimitiveError
from lowering.from_fx import RULES
from spyre_jax.tools.testing import assert_close, assert_tree_close
from torch_bridge import backend as tb
from torch_bridge import device as dev


def _compile(fn, **opts):
    # a fresh Dynamo cache: past its recompile limit Dynamo would silently run a frame eagerly
    torch._dynamo.reset()
    return torch.compile(fn, backend="spyre", options=opts or None, dynamic=False)


def _check(fn, *xs, k: int = 1, chain: int = 1, fallback_ok: bool = False):
    """``torch.compile(fn, backend="spyre")`` against eager CPU, with the oracle of
    ``spyre_jax.tools.testing`` (``k`` = reduction length, ``chain`` = ops eager rounds one by
    one that the card fuses)."""
    before = tb.compile_stats()["graphs"]
    fb = sum(tb.fallback_stats().values())
    with torch.no_grad():
        want = fn(*xs)
        got = _compile(fn)(*xs)
    assert tb.compile_stats()["graphs"] > before, "the backend never compiled: ran eagerly?"
    if not fallback_ok:
        assert sum(tb.fallback_stats().values()) == fb, f"CPU fallbacks: {tb.fallback_stats()}"
    for g in got if isinstance(got, tuple | list) else [got]:
        assert g.device.type == "cpu"
    assert_tree_close(got, want, k=k, chain=chain)
    return got


SHAPES = [(1, 1), (3, 63), (5, 65), (4, 100), (2, 150), (2, 3, 65)]
DTYPES = [torch.float32, torch.float16]


UNARY = {
    "neg": torch.neg,
    "abs": torch.abs,
    "exp": torch.exp,
    "tanh": torch.tanh,
    "sigmoid": torch.sigmoid,
    "erf": torch.erf,
    "sin": torch.sin,
    "cos": torch.cos,
    "tan_unit": lambda x: torch.tan(torch.tanh(x)),
    "asin_unit": lambda x: torch.asin(torch.tanh(x) * 0.95),
    "acos_unit": lambda x: torch.acos(torch.tanh(x) * 0.95),
    "atan": torch.atan,
    "sinh": torch.sinh,
    "cosh": torch.cosh,
    "asinh": torch.asinh,
    "acosh_ge1": lambda x: torch.acosh(x.abs() + 1),
    "atanh_unit": lambda x: torch.atanh(torch.tanh(x) * 0.95),
    "lgamma_pos": lambda x: torch.lgamma(x.abs() + 0.5),
    "digamma_pos": lambda x: torch.digamma(x.abs() + 0.5),
    "erfinv_unit": lambda x: torch.erfinv(torch.tanh(x) * 0.9),
    "i0e": torch.special.i0e,
    "i1e": torch.special.i1e,
    "relu": F.relu,
    "leaky_relu": lambda x: F.leaky_relu(x, 0.1),
    "gelu": F.gelu,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "silu": F.silu,
    "square": lambda x: x * x,
    "pow3": lambda x: x**3,
    "sqrt_abs": lambda x: torch.sqrt(x.abs() + 0.1),
    "rsqrt_abs": lambda x: torch.rsqrt(x.abs() + 0.1),
    "log_abs": lambda x: torch.log(x.abs() + 0.1),
    "clamp": lambda x: torch.clamp(x, -0.5, 0.7),
    "floor": torch.floor,
    "scalar_ops": lambda x: (x * 3 - 1) / 2 + 0.5,
}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(3, 63), (2, 150)], ids=str)
@pytest.mark.parametrize("name", sorted(UNARY))
@pytest.mark.slow
def test_unary(name, shape, dtype):
    _check(UNARY[name], _rand(shape, dtype))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("name", ["gelu", "exp", "scalar_ops"])
@pytest.mark.slow
def test_unary_odd_shapes(name, shape, dtype):
    _check(UNARY[name], _rand(shape, dtype))


BINARY = {
    "add": torch.add,
    "sub": torch.sub,
    "mul": torch.mul,
    "div": lambda a, b: a / (b.abs() + 0.5),
    "maximum": torch.maximum,
    "minimum": torch.minimum,
    "add_alpha": lambda a, b: torch.add(a, b, alpha=2.0),
    "rsub": lambda a, b: 1.0 - a + b,
    "where": lambda a, b: torch.where(a > b, a, b * 2),
    "lt_float": lambda a, b: (a < b).float() + (a >= b).float() * 2,
    "eq_int": lambda a, b: (a.round() == b.round()).to(torch.int32),
    "logical": lambda a, b: torch.logical_and(a > 0, b > 0) | (a < -1),
}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", sorted(BINARY))
@pytest.mark.slow
def test_binary(name, dtype):
    a, b = _rand((5, 65), dtype, 1), _rand((5, 65), dtype, 2)
    _check(BINARY[name], a, b)


@pytest.mark.parametrize(
    "sa, sb", [((4, 100), (100,)), ((3, 1, 65), (1, 5, 65)), ((2, 3, 63), (3, 1))], ids=str
)
def test_broadcasting(sa, sb):
    _check(lambda a, b: a * b + a, _rand(sa, torch.float32, 3), _rand(sb, torch.float32, 4))


REDUCE = {
    "sum_last": lambda x: x.sum(-1),
    "sum_first_keep": lambda x: x.sum(0, keepdim=True),
    "mean": lambda x: x.mean(-1),
    "amax": lambda x: x.amax(-1),
    "max_dim": lambda x: x.max(dim=-1),
    "argmax": lambda x: x.argmax(-1),
    "var": lambda x: x.var(-1),
    "softmax": lambda x: torch.softmax(x, -1),
    "log_softmax": lambda x: torch.log_softmax(x, -1),
    "softmax_dim0": lambda x: torch.softmax(x, 0),
    "cumsum": lambda x: x.cumsum(-1),
    "cumprod": lambda x: (1 + x / 20).cumprod(-1),
    "logcumsumexp": lambda x: torch.logcumsumexp(x, -1),
    "cummax_ties": lambda x: torch.cummax((x * 2).round(), -1),  # ties: torch's index
    "cummin_dim0": lambda x: torch.cummin((x * 2).round(), 0),
    "any": lambda x: (x > 1.5).any(-1),
}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(3, 63), (4, 100), (2, 3, 65)], ids=str)
@pytest.mark.parametrize("name", sorted(REDUCE))
@pytest.mark.slow
def test_reductions(name, shape, dtype):
    if name in ("argmax", "max_dim"):
        x = torch.randperm(math.prod(shape), generator=torch.Generator().manual_seed(5))
        x = (x.reshape(shape).to(torch.float32) / 7).to(dtype)  # no ties
    else:
        x = _rand(shape, dtype, 6)
    _check(REDUCE[name], x)


LAYOUT = {
    "view": lambda x: x.reshape(-1, 5).sum(-1),
    "permute": lambda x: x.permute(1, 0) * 2,
    "transpose_mm": lambda x: x.t() @ x,
    "slice": lambda x: x[1:, 3:60:2] + 1,
    "select": lambda x: x[2] * 3,
    "cat": lambda x: torch.cat([x, x * 2], dim=-1),
    "cat0": lambda x: torch.cat([x, x[:2]], dim=0),
    "split": lambda x: torch.split(x, [20, 45], dim=1)[1] * 2,
    "unsqueeze_expand": lambda x: x.unsqueeze(0).expand(3, -1, -1) + 1,
    "gather": lambda x: torch.gather(x, 1, torch.tensor([[0, 3], [64, 1], [2, 2], [5, 5], [0, 0]])),
    "index_select": lambda x: torch.index_select(x, 0, torch.tensor([4, 0, 2])),
    "full": lambda x: x + torch.full((5, 65), 0.25),
    "arange": lambda x: x + torch.arange(65),
    "tril": lambda x: torch.tril(x, diagonal=3),
    "triu": lambda x: torch.triu(x, diagonal=-1) * 2,
}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", sorted(LAYOUT))
@pytest.mark.slow
def test_layout(name, dtype):
    _check(LAYOUT[name], _rand((5, 65), dtype, 7))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("mkn", [(64, 128, 96), (5, 65, 100), (1, 150, 3)], ids=str)
@pytest.mark.slow
def test_matmul_family(mkn, dtype):
    m, k, n = mkn
    a, b, bias = _rand((m, k), dtype, 8), _rand((k, n), dtype, 9), _rand((n,), dtype, 10)
    _check(lambda a, b: a @ b, a, b)
    _check(lambda a, b, c: F.linear(a, b.t(), c), a, b, bias)
    _check(lambda a, b: torch.bmm(a[None].expand(2, -1, -1), b[None].expand(2, -1, -1)), a, b)


def test_embedding_and_layernorm():
    emb = torch.nn.Embedding(100, 65)
    ln = torch.nn.LayerNorm(65)
    idx = torch.tensor([[0, 5, 99], [3, 3, 1]])
    _check(lambda i: ln(emb(i)), idx)


def test_int64_inputs_and_outputs():
    x = torch.arange(12).reshape(3, 4)
    _check(lambda x: x * 2 + 1, x)


# ---------------------------------------------------------------------------------------------
# real models (Hugging Face transformers, from configs with random weights)


def _models():
    import transformers

    transformers.logging.set_verbosity_error()
    from transformers import (
        BertConfig,
        BertModel,
        GPT2Config,
        GPT2LMHeadModel,
        LlamaConfig,
        LlamaForCausalLM,
    )

    return {
        "gpt2": lambda: GPT2LMHeadModel(
            GPT2Config(
                n_layer=2,
                n_embd=64,
                n_head=4,
                vocab_size=128,
                n_positions=64,
                bos_token_id=0,
                eos_token_id=0,
            )
        ),
        "llama": lambda: LlamaForCausalLM(
            LlamaConfig(
                num_hidden_layers=2,
                hidden_size=64,
                num_attention_heads=4,
                num_key_value_heads=2,
                intermediate_size=128,
                vocab_size=128,
                max_position_embeddings=64,
                bos_token_id=0,
                eos_token_id=0,
            )
        ),
        "bert": lambda: BertModel(
            BertConfig(
                num_hidden_layers=2,
                hidden_size=64,
                num_attention_heads=4,
                intermediate_size=128,
                vocab_size=128,
                max_position_embeddings=64,
            )
        ),
    }


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("name", ["gpt2", "llama", "bert"])
@pytest.mark.slow
def test_transformer_models(name, dtype):
    torch.manual_seed(0)
    model = _models()[name]().eval().to(dtype)
    ids = torch.randint(0, 128, (1, 19), generator=torch.Generator().manual_seed(1))
    tb.reset_fallback_stats()
    with torch.no_grad():
        want = model(ids)[0]
        got = _compile(model)(ids)[0]
    assert tb.fallback_stats() == {}, tb.fallback_stats()
    assert tb.compile_stats()["graphs"] >= 1
    assert_close(got, want)


# ---------------------------------------------------------------------------------------------
# fallback, strict, training graphs


def _bessel_rows(x):
    s = torch.special.i1(x)  # a Bessel function of order one: no card kernel for it
    return torch.tanh(s) * 2


def test_unsupported_op_falls_back_with_warning_and_counter():
    assert torch.ops.aten.special_i1.default not in RULES
    tb.reset_fallback_stats()
    x = _rand((4, 65), torch.float32, 11)
    with pytest.warns(tb.SpyreFallbackWarning, match="special_i1"):
        _check(_bessel_rows, x, fallback_ok=True)
    stats = tb.fallback_stats()
    assert any("special_i1" in k for k in stats) and sum(stats.values()) == 1
    assert tb.compile_stats()["kernels"] >= 1  # the tanh * 2 still runs on the card


def test_strict_raises_naming_op_and_line():
    x = _rand((4, 65), torch.float32, 12)
    with torch.no_grad():
        with pytest.raises(Exception) as ei:
            _compile(_bessel_rows, strict=True)(x)
    # Dynamo wraps a backend's error in BackendCompilerFailed; ours is its inner exception
    err = getattr(ei.value, "inner_exception", ei.value)
    assert isinstance(err, UnsupportedPrimitiveError), repr(ei.value)
    assert "special_i1" in str(err) and "test_torch_backend.py" in str(err)


def test_unknown_option_rejected():
    with pytest.raises(Exception, match="unknown options"):
        with torch.no_grad():
            _compile(lambda x: torch.tanh(x) + 1, fast=True)(torch.ones(3))


def test_graph_that_needs_gradients_compiles_for_training():
    lin = torch.nn.Linear(8, 8)
    x = torch.randn(2, 8)
    _compile(lin)(x).sum().backward()
    assert lin.weight.grad is not None
    with torch.inference_mode():
        _check(lin, x)


def test_fallback_results_are_correct_in_the_middle_of_a_graph():
    def f(x):
        h = torch.relu(x @ x.t())
        s, _ = torch.sort(h, dim=-1)
        return torch.softmax(s, -1)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", tb.SpyreFallbackWarning)
        _check(f, _rand((6, 65), torch.float32, 13), fallback_ok=True)


def test_numpy_round_trip_bf16():
    x = _rand((3, 65), torch.bfloat16, 14)
    got = tb.from_host(tb.to_host(x), x)
    assert got.dtype == torch.bfloat16 and torch.equal(got, x)
    assert np.asarray(tb.to_host(torch.arange(3))).dtype == np.int32


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("name", ["gpt2", "llama", "bert"])
@pytest.mark.slow
def test_transformer_models_on_the_spyre_device(name, dtype):
    import torch_bridge.device as dev

    torch.manual_seed(0)
    model = _models()[name]().eval().to(dtype)
    ids = torch.randint(0, 128, (1, 19), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = model(ids)[0]
        dev.reset_stats()
        model.to("spyre")
        got = model(ids.to("spyre"))[0]
    assert got.device.type == "spyre"
    assert dev.fallback_stats() == {}, dev.fallback_stats()
    assert dev.eager_stats()["cpu_fallbacks"] == 0
    assert_close(got, want)


# regressions found by `spyre-jax coverage torch` (OpInfo)
@pytest.mark.parametrize(
    "name, fn",
    [
        ("remainder", lambda a, b: torch.remainder(a * 5, b)),
        ("mod_pos", lambda a, b: a * 5 % 1.5),
        ("mod_neg", lambda a, b: a * 5 % -1.5),
        ("sum_all", lambda a, b: a.sum()),  # aten.sum.dim_IntList(x, []) reduces everything
        ("mean_all", lambda a, b: (a * b).mean()),
        ("rank0_out", lambda a, b: (a - b).abs().amax()),
        ("bitwise_int", lambda a, b: (~(a * 9).int() & (b * 9).int()) | 3),
        ("shifts", lambda a, b: ((a * 99).int() << 3) + ((b * 999).int() >> (a.abs() * 9).int())),
        # a 0-d tensor's index_select (the rule indexed its missing dim 0: IndexError)
        ("index_select_0d", lambda a, b: torch.index_select(a[1, 2], 0, torch.zeros(1).long())),
    ],
)
def test_opinfo_regressions(name, fn):
    _check(fn, _rand((5, 65), torch.float32, 20), _rand((5, 65), torch.float32, 21) + 0.1)


# rules that coverage torch found missing on the backend path (lowering/fx_misc.py)
MISC = {
    "log1p_expm1_exp2": (lambda a, b: torch.log1p(a.abs()) + torch.expm1(b) + torch.exp2(a), 1, 3),
    "reciprocal": (lambda a, b: torch.reciprocal(b + 3.0), 1, 1),
    "isnan_isinf": (lambda a, b: torch.isnan(a / b) | torch.isinf(a / (b - b)), 1, 1),
    "fmod": (lambda a, b: torch.fmod(a * 5, b) + torch.fmod(a, -0.7), 1, 2),
    "clamp_tensor": (lambda a, b: torch.clamp(a, min=b, max=b + 1), 1, 1),
    "hardtanh_elu": (lambda a, b: F.hardtanh(a, -0.5, 0.5) + F.elu(b, 0.7), 1, 3),
    "round_decimals": (
        lambda a, b: torch.round(a * 100, decimals=-1) + torch.round(b, decimals=2),
        1,
        2,
    ),
    "repeat": (lambda a, b: a[:2, :7].repeat(3, 1, 2), 1, 1),
    "diagonal": (
        lambda a, b: torch.diagonal(a.reshape(5, 5, 13), 2, 0, 2) + torch.diag(a[:, :5], -1).sum(),
        4,
        1,
    ),
    "vector_norm": (
        lambda a, b: torch.stack(
            [
                torch.linalg.vector_norm(a, o, dim=1)
                for o in (2, 1, 0, 3.5, float("inf"), -float("inf"))
            ]
        ),
        65,
        2,
    ),
}


@pytest.mark.parametrize("name", sorted(MISC))
def test_misc_rules(name):
    fn, k, chain = MISC[name]
    a, b = _rand((5, 65), torch.float32, 30), _rand((5, 65), torch.float32, 31)
    _check(fn, a, b, k=k, chain=chain)
    dev.reset_stats()
    got = fn(a.to("spyre"), b.to("spyre"))
    assert dev.fallback_stats() == {}
    assert_tree_close(got.cpu(), fn(a, b), k=k, chain=chain)


def _rounded_divisions(a, b):  # noqa: ANN001, ANN202
    return (
        torch.floor_divide(a, b),
        torch.div(a, b, rounding_mode="floor"),
        torch.div(a, b, rounding_mode="trunc"),
        a // 3,
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.int32, torch.int64])
@pytest.mark.parametrize("path", ["backend", "device"])
def test_floor_divide_and_rounding_modes(dtype, path):
    """floor_divide (beam search's ``next_tokens // vocab``) and div's rounding modes, as torch
    rounds: for floats ``(a - fmod(a, b)) / b`` corrected (not ``floor(a / b)``), a signed zero,
    division by zero as ``a / b``; for integers toward minus infinity."""
    g = torch.Generator().manual_seed(3)
    a = (torch.randn(4, 40, generator=g) * 20).to(dtype)
    b = (torch.randn(4, 40, generator=g) * 4).to(dtype)
    if dtype.is_floating_point:
        a[0, :5] = torch.tensor([7.0, -7.0, 0.0, -0.0, 1.0])
        b[0, :5] = torch.tensor([0.0, 2.0, -2.0, 3.0, 0.1])
    else:
        b[b == 0] = 3
    want = _rounded_divisions(a, b)
    if path == "backend":
        torch._dynamo.reset()
        with torch.no_grad():
            got = torch.compile(_rounded_divisions, backend="spyre", options={"strict": True})(a, b)
    else:
        got = [t.cpu() for t in _rounded_divisions(a.to("spyre"), b.to("spyre"))]
    for w, x in zip(want, got, strict=True):
        assert x.dtype == w.dtype
        assert torch.equal(x, w) or torch.allclose(x.double(), w.double(), equal_nan=True)
        assert torch.equal(torch.signbit(x[w == 0]), torch.signbit(w[w == 0]))


def test_filled_tensors_are_one_broadcast_scalar_not_a_constant_tensor():
    # torch.full / zeros_like / ones_like (attention masks) used to become constant tensors of
    # their full size, copied into device memory and read back by every kernel
    def f(x):
        m = torch.full((x.shape[0], x.shape[1]), float("-inf"))
        return torch.maximum(x, m) + torch.zeros_like(x) * 3 + torch.ones_like(x)

    x = _rand((64, 300), torch.float32)
    tb.reset_fallback_stats()
    _check(f, x)
    (k,) = tb.compiled_kernels()
    assert all(arr.size == 1 for _, arr in k.graph.consts), [a.shape for _, a in k.graph.consts]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("pos", [[4, 5, 6], [0, 15, -2], [9]])
@pytest.mark.slow
def test_index_put_along_one_dim_is_a_kv_cache_update(dtype, pos):
    # a static KV cache's update (transformers' StaticCache: index_copy_ at cache_position)
    # became aten.index_put and ran on the CPU
    cache = _rand((1, 2, 16, 64), dtype)
    v = _rand((1, 2, len(pos), 64), dtype)
    idx = torch.tensor(pos)

    def put(c, i, x):
        return torch.ops.aten.index_put.default(c, [None, None, i], x) * 1

    got = _check(put, cache, idx, v)
    assert_close(got, put(cache, idx, v), atol=0, rtol=0)  # moved, not computed
    if min(pos) >= 0:

        def copy(c, i, x):
            c = c.clone()
            c.index_copy_(2, i, x)
            return c

        _check(copy, cache, idx, v)


def test_index_put_that_accumulates_runs_on_the_card():
    # (it ran on the CPU before the scatter rules: a regression test of both results)
    def f(c, i, x):
        return torch.ops.aten.index_put.default(c, [i], x, True)

    _check(f, torch.zeros(8, 64), torch.tensor([1, 1, 3]), torch.ones(3, 64))


_I = torch.tensor([[0, 2], [-1, 1]])  # negative indices count from the end
_J = torch.tensor([3, -2, 0])

INDEXING = {
    "rows": lambda x: x[_I],
    "two dims broadcast": lambda x: x[_I[:, :1], _J[None, :2]],
    "middle dims": lambda x: x[:, _J[:2], _I[:, 1:]],
    "last dim": lambda x: x[..., _J],
    "int32 indices": lambda x: x[_J.to(torch.int32)],
    "transformers' mask index": lambda x: x[
        torch.arange(2).view(2, 1, 1, 1), torch.arange(5).view(1, 1, 5, 1) % 4
    ],
}


@pytest.mark.parametrize("name", sorted(INDEXING))
@pytest.mark.slow
def test_advanced_indexing_runs_on_the_card(name):
    # regression: aten.index.Tensor had no rule; transformers' causal-mask functions index the
    # cache positions this way whenever use_cache=False, so Llama and GPT-2 fell back to the CPU
    x = _rand((4, 5, 6), torch.float32)
    _check(INDEXING[name], x)
    _check(INDEXING[name], (torch.arange(120).reshape(4, 5, 6) - 60).to(torch.int64))


def test_indexing_the_card_has_no_rule_for_runs_on_the_cpu():
    # a boolean mask (data-dependent size) and index tensors on dims apart keep the CPU
    x = _rand((4, 5, 6), torch.float32)
    before = tb.fallback_stats().get("aten.index.Tensor", 0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _check(lambda x: x[_I[0], :, _J[:2]], x, fallback_ok=True)
    assert tb.fallback_stats().get("aten.index.Tensor", 0) > before
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = _compile(lambda x: x[x > 0])(x)  # Dynamo may split the graph at the mask
    torch.testing.assert_close(got, x[x > 0])


@pytest.mark.slow
def test_a_model_without_its_cache_has_no_cpu_fallback():
    import transformers

    transformers.logging.set_verbosity_error()
    cfg = transformers.LlamaConfig(
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=300,
        use_cache=False,
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    ids = torch.randint(0, 300, (1, 16), generator=torch.Generator().manual_seed(0))
    _check(lambda ids: model(ids).logits, ids)


def test_a_region_compiled_once_is_one_kernel_with_every_call_inlined(monkeypatch):
    # torch.compiler.nested_compile_region: Dynamo and AOTAutograd trace the layer once and
    # call it as an invoke_subgraph region; the importer inlines each call (its own weights),
    # the card runs one kernel, nothing falls back to the CPU
    import lowering.from_fx as ff
    import torch_bridge.backend as tb

    class Layer(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(64, 64)

        @torch.compiler.nested_compile_region
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.relu(self.lin(x)) + x

    class Model(torch.nn.Module):
        def __init__(self, n: int) -> None:
            super().__init__()
            self.layers = torch.nn.ModuleList([Layer() for _ in range(n)])

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for layer in self.layers:
                x = layer(x)
            return x

    calls = []
    orig = ff._import

    def spy(b, gm, ops, inputs):
        calls.append(ops is not None)
        return orig(b, gm, ops, inputs)

    monkeypatch.setattr(ff, "_import", spy)
    torch.manual_seed(0)
    model = Model(3).eval()
    x = torch.randn(4, 64)
    before = dict(tb.fallback_stats())
    with torch.no_grad():
        got = torch.compile(model, backend="spyre")(x)
        want = model(x)
    assert_close(got, want)
    assert sum(calls) == 3  # the region, imported at each of its three calls
    assert tb.fallback_stats() == before


def test_the_core_decomposition_table_is_made_once_and_again_when_ops_are_registered():
    # torch builds core_aten_decompositions() anew on every call (about 70 ms on first use: a
    # tenth of a small graph's compile); the bridge keeps one, made again once ops were added
    from torch._decomp import core_aten_decompositions

    from torch_bridge.graph_passes import core_decompositions

    table = core_decompositions()
    assert core_decompositions() is table
    assert set(table) == set(core_aten_decompositions())
    lib = torch.library.Library("spyre_test_decomp", "DEF")
    lib.define("twice(Tensor x) -> Tensor")
    lib.impl("twice", lambda x: x * 2, "CompositeImplicitAutograd")
    fresh = core_decompositions()
    assert fresh is not table and core_decompositions() is fresh
    assert set(fresh) == set(core_aten_decompositions())
