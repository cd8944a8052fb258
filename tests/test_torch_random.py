"""Random numbers on the card from PyTorch (``torch_bridge.rng``, ``lowering.rng_ops``): the
card's numbers against their NumPy reference (bit-equal for integers and bits, to float32
rounding for the transforms), the generator's seeding and state, statistical tests of every
distribution, the compiled path, and sampling / beam search ``generate()`` on the device.

Statistical tests use a significance level of 1e-4 on fixed seeds: deterministic, and a
correct generator fails one of them with probability 1e-4 per seed tried."""

from __future__ import annotations

import warnings

import jax.extend.random as jax_random
import numpy as np
import pytest
import scipy.stats
import torch

import torch_bridge.device as dev
from lowering import fx_random, rng_ops
from torch_bridge import rng
from torch_bridge.errors import SpyreFallbackWarning

RANDOM = torch.ops.spyre_jax.random.default
ALPHA = 1e-4


def _state(seed: int, offset: int = 0) -> torch.Tensor:
    return rng._words(seed, offset)


CASES = [
    ("uniform", None, (4, 300), torch.float32, 0.0, 1.0, 0),
    ("uniform", None, (3, 70), torch.float16, -2.0, 1.0, 0),
    ("uniform", None, (3, 70), torch.bfloat16, 0.0, 1.0, 0),
    ("normal", None, (1000,), torch.float32, 1.0, 3.0, 0),
    ("log_normal", None, (64,), torch.float32, 0.0, 0.5, 0),
    ("exponential", None, (64,), torch.float32, 2.0, 0.0, 0),
    ("cauchy", None, (64,), torch.float32, 0.0, 1.0, 0),
    ("geometric", None, (64,), torch.float32, 0.2, 0.0, 0),
    ("randint", None, (7, 9), torch.int64, -3.0, 17.0, 0),
    ("bernoulli", None, (500,), torch.float32, 0.3, 0.0, 0),
    ("randperm", None, (), torch.int64, 0.0, 0.0, 40),
]


def _probs(rows: int, v: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    p = torch.softmax(torch.randn(rows, v, generator=g), -1)
    p[:, 3] = 0.0  # a category that must never be drawn
    return p


MULTINOMIAL = [(1, False), (5, True), (5, False)]


# ---------------------------------------------------------------------------------------------
# the numbers: card == reference


def test_the_cipher_is_jaxs_threefry():
    key = np.array([0x12345678, 0x9ABCDEF0], np.uint32)
    count = np.arange(64, dtype=np.uint32)
    want = np.asarray(jax_random.threefry_2x32(key, count))
    # JAX's counts a flat array as pairs (first half, second half)
    x1, x2 = rng_ops.threefry2x32_np(key[0], key[1], count[:32], count[32:])
    assert np.array_equal(np.concatenate([x1, x2]), want)


def _close(got: torch.Tensor, want: torch.Tensor) -> bool:
    if not want.dtype.is_floating_point:
        return torch.equal(got, want)
    # the same formulas in float32 on both sides: equal to the SFU's rounding
    return torch.allclose(got.double(), want.double(), rtol=2e-6, atol=2e-6, equal_nan=True)


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-{c[3]}")
@pytest.mark.parametrize("path", ["eager", "compile"])
def test_card_draws_equal_the_reference(case, path):
    dist, x, size, dtype, a, b, n = case
    st = _state(1234, 7)
    want = fx_random.random_cpu(st, x, dist, size, dtype, a, b, n)
    if path == "eager":
        got = RANDOM(st.to("spyre"), x, dist, list(size), dtype, a, b, n).cpu()
    else:
        torch._dynamo.reset()
        with torch.no_grad():
            f = torch.compile(
                lambda s: RANDOM(s, x, dist, list(size), dtype, a, b, n),
                backend="spyre",
                options={"strict": True},
            )
            got = f(st)
    assert got.dtype == want.dtype and got.shape == want.shape
    assert _close(got, want), (got.flatten()[:8], want.flatten()[:8])


@pytest.mark.parametrize("n,replacement", MULTINOMIAL)
def test_card_multinomial_equals_the_reference(n, replacement):
    p = _probs(3, 50)
    st = _state(99, 1)
    want = fx_random.random_cpu(st, p, "multinomial", [], torch.int64, 0.0, float(replacement), n)
    got = RANDOM(
        st.to("spyre"), p.to("spyre"), "multinomial", [], torch.int64, 0.0, float(replacement), n
    ).cpu()
    assert torch.equal(got, want)
    assert not (got == 3).any()


# ---------------------------------------------------------------------------------------------
# the generator


def test_manual_seed_gives_the_same_numbers_and_draws_advance():
    torch.manual_seed(5)
    a, b = torch.rand(64, device="spyre").cpu(), torch.rand(64, device="spyre").cpu()
    torch.manual_seed(5)
    assert torch.equal(torch.rand(64, device="spyre").cpu(), a)
    assert not torch.equal(a, b)
    torch.spyre.manual_seed(5)  # the device module's own
    assert torch.equal(torch.rand(64, device="spyre").cpu(), a)
    assert torch.spyre.initial_seed() == 5


def test_rng_state_saves_and_restores():
    torch.manual_seed(11)
    torch.randn(3, device="spyre")
    s = torch.spyre.get_rng_state()
    assert s.dtype == torch.uint8 and s.shape == (16,)
    want = torch.randn(10, device="spyre").cpu()
    torch.spyre.set_rng_state(s)
    assert torch.equal(torch.randn(10, device="spyre").cpu(), want)
    with torch.random.fork_rng(device_type="spyre"):
        torch.randn(10, device="spyre")
    assert not torch.equal(torch.randn(10, device="spyre").cpu(), want)  # (drawn on after)
    with pytest.raises(TypeError):
        torch.spyre.set_rng_state(torch.zeros(16))
    with pytest.raises(ValueError):
        torch.spyre.set_rng_state(torch.zeros(3, dtype=torch.uint8))


def test_a_cpu_generator_reproduces_and_its_state_saves():
    g = torch.Generator().manual_seed(7)
    saved = g.get_state()
    a = torch.rand(5, device="spyre", generator=g).cpu()
    b = torch.rand(5, device="spyre", generator=g).cpu()
    assert not torch.equal(a, b)
    g.set_state(saved)
    assert torch.equal(torch.rand(5, device="spyre", generator=g).cpu(), a)
    p = torch.full((2, 10), 0.1, device="spyre")
    g.manual_seed(1)
    m = torch.multinomial(p, 3, generator=g).cpu()
    g.manual_seed(1)
    assert torch.equal(torch.multinomial(p, 3, generator=g).cpu(), m)


def test_the_eager_random_ops_run_on_the_card():
    dev.reset_stats()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback warning
        x = torch.ones(4, 8, device="spyre")
        torch.rand(3, 4, device="spyre")
        torch.randn(3, 4, device="spyre", dtype=torch.float16)
        torch.randint(0, 9, (5,), device="spyre")
        torch.rand_like(x)
        torch.bernoulli(torch.full((6,), 0.4, device="spyre"))
        torch.bernoulli(x, 0.5)
        torch.multinomial(torch.ones(2, 9, device="spyre"), 2)
        torch.nn.functional.dropout(x, 0.25, training=True)
        torch.randperm(12, device="spyre")
        for fill in ("uniform_", "normal_", "exponential_", "log_normal_", "cauchy_"):
            getattr(torch.empty(5, device="spyre"), fill)()
        torch.empty(5, device="spyre").geometric_(0.3)
        torch.empty(5, device="spyre").random_(0, 4)
    assert dev.fallback_stats() == {}
    assert dev.eager_stats()["cpu_fallbacks"] == 0


def test_bad_arguments_get_torchs_errors():
    p = torch.ones(2, 4, device="spyre")
    with pytest.raises(RuntimeError, match="without replacement"):
        torch.multinomial(p, 5)
    with pytest.raises(RuntimeError, match="1 or 2 dim"):
        torch.multinomial(torch.ones(2, 2, 2, device="spyre"), 1)
    with pytest.raises(RuntimeError, match="dropout probability"):
        torch.ops.aten.native_dropout(p, 1.5, True)
    assert dev.fallback_stats() == {}


# ---------------------------------------------------------------------------------------------
# statistics (each seed a fixed, deterministic test)


def _draw(fn) -> np.ndarray:  # noqa: ANN001
    torch.manual_seed(2024)
    return fn().cpu().double().numpy().ravel()


@pytest.mark.parametrize(
    "name,fn,cdf",
    [
        ("uniform", lambda: torch.rand(20000, device="spyre"), scipy.stats.uniform().cdf),
        (
            "uniform(-3, 2) fp16",
            lambda: torch.empty(20000, device="spyre", dtype=torch.float16).uniform_(-3, 2),
            scipy.stats.uniform(-3, 5).cdf,
        ),
        ("normal", lambda: torch.randn(20000, device="spyre"), scipy.stats.norm().cdf),
        (
            "normal(2, 0.5)",
            lambda: torch.empty(20000, device="spyre").normal_(2.0, 0.5),
            scipy.stats.norm(2.0, 0.5).cdf,
        ),
        (
            "exponential(3)",
            lambda: torch.empty(20000, device="spyre").exponential_(3.0),
            scipy.stats.expon(scale=1 / 3).cdf,
        ),
        (
            "cauchy",
            lambda: torch.empty(20000, device="spyre").cauchy_(),
            scipy.stats.cauchy().cdf,
        ),
        (
            "log_normal(0, 0.5)",
            lambda: torch.empty(20000, device="spyre").log_normal_(0.0, 0.5),
            scipy.stats.lognorm(0.5).cdf,
        ),
    ],
    ids=lambda v: v if isinstance(v, str) else "",
)
def test_continuous_distributions(name, fn, cdf):
    x = _draw(fn)
    # fp16's uniform is on a grid of 2^-10 of the range: compare at the grid's midpoints
    assert (
        scipy.stats.kstest(x, cdf).pvalue > ALPHA
        or "fp16" in name
        and (scipy.stats.kstest(x + 5 * 2**-11, cdf).pvalue > ALPHA)
    )


def test_discrete_distributions():
    x = _draw(lambda: torch.randint(-2, 5, (14000,), device="spyre")).astype(int)
    counts = np.bincount(x + 2, minlength=7)
    assert x.min() >= -2 and x.max() < 5
    assert scipy.stats.chisquare(counts).pvalue > ALPHA
    b = _draw(lambda: torch.bernoulli(torch.full((20000,), 0.3, device="spyre")))
    assert scipy.stats.binomtest(int(b.sum()), b.size, 0.3).pvalue > ALPHA
    gm = _draw(lambda: torch.empty(20000, device="spyre").geometric_(0.25)).astype(int)
    assert gm.min() >= 1
    ks = np.arange(1, 40)
    obs = np.array([(gm == k).sum() for k in ks] + [(gm >= 40).sum()])
    exp = np.append(scipy.stats.geom(0.25).pmf(ks), scipy.stats.geom(0.25).sf(39)) * gm.size
    assert scipy.stats.chisquare(obs, exp).pvalue > ALPHA


@pytest.mark.parametrize("replacement", [False, True])
def test_multinomial_frequencies(replacement):
    p = torch.tensor([0.5, 0.2, 0.0, 0.2, 0.1])
    torch.manual_seed(3)
    draws = torch.multinomial(p.expand(4000, 5).to("spyre"), 1, replacement).cpu().ravel()
    counts = np.bincount(draws.numpy(), minlength=5)
    assert counts[2] == 0
    live = p.numpy() > 0
    assert scipy.stats.chisquare(counts[live], p.numpy()[live] * 4000).pvalue > ALPHA
    if not replacement:  # two without replacement: never the same twice
        two = torch.multinomial(p.expand(2000, 5).to("spyre"), 2).cpu()
        assert (two[:, 0] != two[:, 1]).all()
        # the second draw, given the first, follows the remaining weights
        first0 = two[two[:, 0] == 0][:, 1].numpy()
        rest = np.array([0.0, 0.2, 0.0, 0.2, 0.1]) / 0.5
        c = np.bincount(first0, minlength=5)
        assert scipy.stats.chisquare(c[rest > 0], rest[rest > 0] * c.sum()).pvalue > ALPHA


def test_randperm_and_dropout():
    torch.manual_seed(8)
    perms = torch.stack([torch.randperm(6, device="spyre").cpu() for _ in range(600)])
    assert all(sorted(p.tolist()) == list(range(6)) for p in perms)
    counts = np.array([[(perms[:, i] == v).sum().item() for v in range(6)] for i in range(6)])
    assert scipy.stats.chisquare(counts.ravel()).pvalue > ALPHA  # each value equally at each place
    x = torch.ones(20000, device="spyre")
    y = torch.nn.functional.dropout(x, 0.3, training=True).cpu()
    kept = y != 0
    assert torch.allclose(y[kept], torch.full_like(y[kept], 1 / 0.7))
    assert scipy.stats.binomtest(int(kept.sum()), y.numel(), 0.7).pvalue > ALPHA
    assert torch.equal(torch.nn.functional.dropout(x, 0.3, training=False).cpu(), x.cpu())


# ---------------------------------------------------------------------------------------------
# compiled graphs


def test_compiled_random_ops_draw_from_the_cards_generator():
    def f(x):  # noqa: ANN001, ANN202
        noise = torch.randn(x.shape) * 0.1
        keep = torch.nn.functional.dropout(x, 0.5, training=True)
        idx = torch.multinomial(torch.softmax(x, -1), 1)
        return x + noise, keep, idx, torch.randint(0, 7, (3,))

    torch._dynamo.reset()
    x = torch.randn(4, 16)
    with torch.no_grad():
        cf = torch.compile(f, backend="spyre", options={"strict": True})
        torch.manual_seed(1)
        r1 = cf(x)
        torch.manual_seed(1)
        r2 = cf(x)
        r3 = cf(x)
    assert all(torch.equal(a, b) for a, b in zip(r1, r2, strict=True))
    assert not torch.equal(r1[0], r3[0])
    kept = r1[1] != 0
    assert torch.allclose(r1[1][kept], x[kept] * 2)
    assert r1[2].shape == (4, 1) and r1[2].dtype == torch.int64


# ---------------------------------------------------------------------------------------------
# sampling and beam search generate() on the device


@pytest.fixture(scope="module")
def gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=300, n_positions=64)
    cpu = GPT2LMHeadModel(cfg).eval()
    card = GPT2LMHeadModel(cfg).eval()
    card.load_state_dict(cpu.state_dict())
    return cpu, card.to("spyre")


def _generate(model, ids, **kw):  # noqa: ANN001, ANN003, ANN202
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        warnings.simplefilter("error", SpyreFallbackWarning)
        return model.generate(ids, max_new_tokens=8, min_new_tokens=8, pad_token_id=0, **kw)


def test_sampling_generate_on_the_device_has_no_fallback(gpt2):
    _, card = gpt2
    ids = torch.tensor([[5, 17, 42, 7]])
    dev.reset_stats()
    kw = dict(do_sample=True, top_k=20, top_p=0.9, temperature=0.8)
    torch.manual_seed(4)
    a = _generate(card, ids.to("spyre"), **kw).cpu()
    torch.manual_seed(4)
    b = _generate(card, ids.to("spyre"), **kw).cpu()
    assert dev.fallback_stats() == {}
    assert torch.equal(a, b) and a.shape == (1, 12)


@pytest.mark.slow
def test_beam_search_on_the_device_equals_the_cpu(gpt2):
    cpu, card = gpt2
    ids = torch.tensor([[5, 17, 42, 7]])
    dev.reset_stats()
    want = _generate(cpu, ids, num_beams=3, do_sample=False)
    got = _generate(card, ids.to("spyre"), num_beams=3, do_sample=False).cpu()
    assert dev.fallback_stats() == {}
    assert torch.equal(got, want)


def test_normal_with_tensor_mean_and_std_on_both_paths():
    mean = torch.linspace(-50, 50, 4000)
    std = torch.full((4000,), 0.5)

    def f(m, s):  # noqa: ANN001, ANN202
        return torch.normal(m, s), torch.normal(m, 2.0), torch.normal(1.0, s)

    torch.manual_seed(0)
    eager = [t.cpu() for t in f(mean.to("spyre"), std.to("spyre"))]
    torch._dynamo.reset()
    with torch.no_grad():
        compiled = torch.compile(f, backend="spyre", options={"strict": True})(mean, std)
    for got in (eager, compiled):
        z = [(got[0] - mean) / 0.5, (got[1] - mean) / 2.0, (got[2] - 1.0) / 0.5]
        for v in z:
            assert scipy.stats.kstest(v.double().numpy(), scipy.stats.norm().cdf).pvalue > ALPHA
    assert dev.fallback_stats() == {}
