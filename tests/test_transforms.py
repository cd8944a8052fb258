"""``spyre_jax.jit`` as a JAX transformation citizen (issue 32): ``grad``, ``vjp``, ``jvp``,
``linearize``, ``hessian``, ``vmap`` and friends of a spyre function, and a spyre function under
``jax.jit`` or another ``spyre_jax.jit``, against the same transformations of the plain function
on the CPU (``jax.jit``).

Tolerances: fp32 throughout; the card computes fp32 matmuls and elementwise functions in fp32
(its SFU functions to within a few ulps of XLA's, docs/ops.md), and derivative programs are
longer chains of them: 1e-5 relative, 1e-5 absolute.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import spyre_jax
from spyre_jax import transforms

RTOL = ATOL = 1e-5


def _close(got, want, rtol=RTOL, atol=ATOL):
    g, w = jax.tree.leaves(got), jax.tree.leaves(want)
    assert len(g) == len(w)
    for a, b in zip(g, w, strict=True):
        a, b = np.asarray(a), np.asarray(b)
        assert a.shape == b.shape, (a.shape, b.shape)
        np.testing.assert_allclose(a, b, rtol=rtol, atol=atol)


def _mlp(params, x):
    (w1, b1), (w2, b2) = params
    h = jax.nn.gelu(x @ w1 + b1)
    return jnp.mean((h @ w2 + b2) ** 2)


def _params(seed=0, d=16, h=32):
    r = np.random.default_rng(seed)
    f = lambda *s: (r.standard_normal(s) / np.sqrt(s[0])).astype(np.float32)  # noqa: E731
    return [(f(d, h), f(h) * 0.1), (f(h, d), f(d) * 0.1)]


X = np.random.default_rng(1).standard_normal((4, 16)).astype(np.float32)


def _loss(w, x):
    return jnp.sum(jnp.tanh(x @ w) ** 2)


W8 = np.random.default_rng(2).standard_normal((8, 4)).astype(np.float32)
X8 = np.random.default_rng(3).standard_normal((3, 8)).astype(np.float32)
SLOSS = spyre_jax.jit(_loss)


# ---------------------------------------------------------------------------------------------
# reverse mode


def test_grad_of_a_spyre_mlp_runs_forward_and_backward_on_the_card():
    sf = spyre_jax.jit(_mlp)
    p = _params()
    transforms.reset_stats()
    _close(jax.grad(sf)(p, X), jax.grad(_mlp)(p, X))
    s = transforms.stats()
    # the primal part (with its residuals) and the transposed tangent part: two card launches
    assert s["launches"] == 2 and s["compiles"] == 2, s


def test_a_second_grad_compiles_and_derives_nothing():
    sf = spyre_jax.jit(_mlp)
    p = _params(4)
    jax.grad(sf)(p, X)
    transforms.reset_stats()
    _close(jax.grad(sf)(p, X), jax.grad(_mlp)(p, X))
    s = transforms.stats()
    assert s["compiles"] == 0 and s["derived"] == 0 and s["launches"] == 2, s
    assert sf.trace_count == 1


@pytest.mark.parametrize(
    "name",
    ["value_and_grad", "vjp", "jvp", "linearize", "jacrev", "jacfwd", "hessian", "argnums"],
)
def test_transformations_match_the_cpu(name):
    w, x = W8, X8
    if name == "value_and_grad":
        got, want = (jax.value_and_grad(f)(w, x) for f in (SLOSS, _loss))
    elif name == "vjp":
        got, want = (jax.vjp(f, w, x)[1](np.float32(1.5)) for f in (SLOSS, _loss))
    elif name == "jvp":
        got, want = (jax.jvp(f, (w, x), (w * 0.5, x)) for f in (SLOSS, _loss))
    elif name == "linearize":
        got, want = (jax.linearize(f, w, x)[1](w, x * 2) for f in (SLOSS, _loss))
    elif name == "argnums":
        got, want = (jax.grad(f, argnums=(0, 1))(w, x) for f in (SLOSS, _loss))
    else:
        t = getattr(jax, name)
        got, want = t(SLOSS)(w, x), t(_loss)(w, x)
    _close(got, want, rtol=1e-4)


def test_has_aux_custom_rules_checkpoint_and_stop_gradient_inside():
    @jax.custom_jvp
    def cj(a):
        return jnp.sin(a)

    cj.defjvp(lambda p, t: (cj(p[0]), 2.0 * t[0]))

    @jax.custom_vjp
    def cv(a):
        return jnp.sin(a)

    cv.defvjp(lambda a: (jnp.sin(a), a), lambda r, g: (3.0 * g,))

    def f(w, x):
        y = jax.checkpoint(_loss, policy=jax.checkpoint_policies.dots_saveable)(w, x)
        z = jnp.sum(cj(x)) + jnp.sum(cv(w)) + jnp.sum(jax.lax.stop_gradient(w) * w)
        return y + z, z

    got = jax.grad(spyre_jax.jit(f), argnums=(0, 1), has_aux=True)(W8, X8)
    _close(got, jax.grad(f, argnums=(0, 1), has_aux=True)(W8, X8))


def test_gradients_of_loops_and_branches():
    def loop(w, x):
        return jax.lax.fori_loop(0, 3, lambda i, c: jnp.tanh(c @ w @ w.T), x).sum()

    def branch(w, x):
        return jax.lax.cond(x.sum() > 0, lambda: jnp.sin(x @ w).sum(), lambda: jnp.cos(x @ w).sum())

    for f in (loop, branch):
        _close(jax.grad(spyre_jax.jit(f))(W8, X8), jax.grad(f)(W8, X8))
        _close(jax.grad(spyre_jax.jit(f))(W8, -X8), jax.grad(f)(W8, -X8))


def test_grad_of_an_integer_output_keeps_jaxs_error():
    f = spyre_jax.jit(lambda x: jnp.argmax(x))
    with pytest.raises(TypeError, match="grad requires real-valued outputs"):
        jax.grad(f)(X8[0])


# ---------------------------------------------------------------------------------------------
# batching


def test_vmap_in_axes_out_axes_and_nested():
    f = spyre_jax.jit(lambda a, b: jnp.sin(a) * b + 1)
    xs = np.stack([X8, 2 * X8, -X8])
    _close(
        jax.vmap(f, in_axes=(0, None))(xs, X8),
        jax.vmap(lambda a, b: jnp.sin(a) * b + 1, (0, None))(xs, X8),
    )
    _close(jax.vmap(f, in_axes=1, out_axes=1)(X8, X8), jnp.sin(X8) * X8 + 1)
    _close(jax.vmap(jax.vmap(f))(xs, xs), jnp.sin(xs) * xs + 1)


def test_vmap_of_grad_and_of_a_branch():
    xs = np.stack([X8, -X8])
    _close(
        jax.vmap(jax.grad(SLOSS), (None, 0))(W8, xs), jax.vmap(jax.grad(_loss), (None, 0))(W8, xs)
    )

    def branch(w, x):
        return jax.lax.cond(x.sum() > 0, lambda: (x @ w).sum(), lambda: -(x @ w).sum())

    _close(jax.vmap(spyre_jax.jit(branch), (None, 0))(W8, xs), jax.vmap(branch, (None, 0))(W8, xs))


def test_an_output_that_does_not_depend_on_the_mapped_input_stays_unbatched():
    f = spyre_jax.jit(lambda a, b: (a * 2, b + a.sum()))
    got = jax.vmap(f, in_axes=(None, 0), out_axes=(None, 0))(X8[0], X8)
    _close(got, (X8[0] * 2, X8 + X8[0].sum()))


@settings(max_examples=8, deadline=None)
@given(
    batch=st.integers(1, 4),
    rows=st.integers(1, 6),
    cols=st.integers(1, 40),
    axis=st.integers(0, 2),
)
def test_vmap_property(batch, rows, cols, axis):
    r = np.random.default_rng(batch * 100 + rows * 10 + cols)
    shape = [rows, cols]
    shape.insert(axis, batch)
    x = r.standard_normal(shape).astype(np.float32)

    def f(a):
        return jax.nn.softmax(a, axis=-1) * jnp.tanh(a).sum()

    _close(jax.vmap(spyre_jax.jit(f), in_axes=axis)(x), jax.vmap(f, in_axes=axis)(x))


# ---------------------------------------------------------------------------------------------
# nesting and tracing


def test_inside_jax_jit_the_card_part_runs_on_the_card():
    transforms.reset_stats()
    out = jax.jit(lambda w, x: SLOSS(w, x) + 1)(W8, X8)
    _close(out, _loss(W8, X8) + 1)
    assert transforms.stats()["host_callbacks"] == 1
    _close(jax.jit(jax.grad(SLOSS))(W8, X8), jax.grad(_loss)(W8, X8))


def test_inside_another_spyre_jit_it_is_inlined():
    outer = spyre_jax.jit(lambda w, x: SLOSS(w, x) * 2)
    _close(outer(W8, X8), 2 * _loss(W8, X8))
    assert "spyre_call" not in outer.lower(W8, X8).as_text("graph")
    _close(spyre_jax.jit(jax.grad(SLOSS))(W8, X8), jax.grad(_loss)(W8, X8))


def test_eval_shape_make_jaxpr_and_disable_jit():
    assert jax.eval_shape(SLOSS, W8, X8) == jax.ShapeDtypeStruct((), np.float32)
    assert "spyre_call" in str(jax.make_jaxpr(SLOSS)(W8, X8))
    with jax.disable_jit():  # as jax.jit: the Python function runs op by op, on the CPU
        out = SLOSS(W8, X8)
    assert isinstance(out, jax.Array)
    _close(out, _loss(W8, X8))


def _noisy(k, x):
    return jax.random.split(k, 2), jax.random.normal(k, x.shape) * x + x


def test_typed_keys_through_vmap_grad_and_jax_jit():
    """Regression: a typed key argument or result under a transformation (the impl took every
    argument's NumPy value; a key has none) and across jax.jit's host callback."""
    sf, cf = spyre_jax.jit(_noisy), jax.jit(_noisy)
    keys, x = jax.random.split(jax.random.key(3), 3), jnp.ones((3, 4))
    got, want = jax.vmap(sf)(keys, x), jax.vmap(cf)(keys, x)
    _close([jax.random.key_data(got[0]), got[1]], [jax.random.key_data(want[0]), want[1]])
    k0 = keys[0]
    got = jax.jit(lambda k, x: sf(k, x))(k0, x[0])
    assert jax.random.key_impl(got[0]) == jax.random.key_impl(k0)
    _close(jax.random.key_data(got[0]), jax.random.key_data(cf(k0, x[0])[0]))
    grad = jax.grad(lambda x, f: f(k0, x)[1].sum())
    _close(grad(x, sf), grad(x, cf))


def test_residuals_stay_on_the_card_between_forward_and_backward(monkeypatch):
    """The forward's results handed to JAX keep their device copies: the backward reads the
    residuals in place (no copy in: before, each went card -> host -> JAX -> host -> card); a
    copy of another card (set_card) is not used."""
    from device_model import runtime as drt

    copies = []
    real = drt.copy_in
    monkeypatch.setattr(drt, "copy_in", lambda h, lay, **k: copies.append(lay) or real(h, lay, **k))
    w, x = jnp.asarray(W8), jnp.asarray(X8)
    g = jax.grad(SLOSS)
    want = jax.grad(_loss)(W8, X8)
    _close(g(w, x), want)
    copies.clear()
    _close(g(w, x), want)
    # w and x into the forward, x and the cotangent seed into the backward: no residual
    assert len(copies) == 4, [c.shape for c in copies]
    r = g(w, x)  # a JAX array with a device copy on this card ...
    spyre_jax.set_card(spyre_jax.CardSpec())
    try:  # ... taken on a new card: copied in again, not read from the old card
        _close(g(r, x), jax.grad(_loss)(np.asarray(r), X8))
    finally:
        spyre_jax.set_card(spyre_jax.CardSpec())


def test_mixing_a_device_array_with_a_tracer():
    w = spyre_jax.device_put(W8)
    _close(jax.grad(SLOSS, argnums=1)(w, X8), jax.grad(_loss, argnums=1)(W8, X8))


def test_a_profile_of_grad_shows_two_card_kernels_and_counts_the_cpu_glue():
    sf = spyre_jax.jit(_mlp)
    p = _params(5)
    jax.grad(sf)(p, X)
    with spyre_jax.profile(print_summary=False) as prof:
        jax.grad(sf)(p, X)
    runs = [r.name for r in prof.records if r.name.startswith("run")]
    assert len(runs) == 2, runs  # the forward (with residuals) and the backward
    # what JAX itself computes on the CPU: the cotangent seed 1.0 that jax.grad makes
    assert sum(prof.cpu_primitives.values()) <= 1, prof.cpu_primitives
    assert "JAX primitives on the CPU" in prof.format_summary()


# ---------------------------------------------------------------------------------------------
# training: 10 SGD steps of a 2-layer Llama-style model, three ways, against the CPU


def _rms(x, g):
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6) * g


def _layer(p, x):
    t, d = x.shape
    h = _rms(x, p["n1"])
    q, k, v = (h @ p[n] for n in ("wq", "wk", "wv"))
    q, k, v = (a.reshape(t, 2, d // 2).transpose(1, 0, 2) for a in (q, k, v))
    s = q @ k.transpose(0, 2, 1) / np.sqrt(d // 2)
    s = jnp.where(jnp.tril(jnp.ones((t, t), bool)), s, -1e9)
    a = (jax.nn.softmax(s, axis=-1) @ v).transpose(1, 0, 2).reshape(t, d)
    x = x + a @ p["wo"]
    h = _rms(x, p["n2"])
    return x + (jax.nn.silu(h @ p["wg"]) * (h @ p["wu"])) @ p["wd"]


def _llama_loss(params, ids, targets):
    x = params["emb"][ids]
    for lp in params["layers"]:
        x = _layer(lp, x)
    logits = _rms(x, params["nf"]) @ params["emb"].T
    logp = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.mean(jnp.sum(logp * jax.nn.one_hot(targets, logits.shape[-1]), axis=-1))


def _llama_params(seed=0, d=32, f=64, vocab=48, layers=2):
    r = np.random.default_rng(seed)
    w = lambda *s: (r.standard_normal(s) * 0.1).astype(np.float32)  # noqa: E731
    one = lambda n: np.ones(n, np.float32)  # noqa: E731
    lay = [
        {
            "n1": one(d), "n2": one(d), "wq": w(d, d), "wk": w(d, d), "wv": w(d, d),
            "wo": w(d, d), "wg": w(d, f), "wu": w(d, f), "wd": w(f, d),
        }
        for _ in range(layers)
    ]  # fmt: skip
    return {"emb": w(vocab, d), "nf": one(d), "layers": lay}


LR = 0.2


@pytest.mark.parametrize("way", ["grad_of_spyre", "spyre_of_value_and_grad"])
def test_ten_sgd_steps_of_a_llama_style_model_match_the_cpu(way):
    r = np.random.default_rng(7)
    ids = r.integers(0, 48, 12).astype(np.int32)
    targets = np.roll(ids, -1)
    if way == "grad_of_spyre":
        grad = jax.grad(spyre_jax.jit(_llama_loss))
    else:
        vg = spyre_jax.jit(jax.value_and_grad(_llama_loss))
        grad = lambda *a: vg(*a)[1]  # noqa: E731
    ref = jax.jit(jax.grad(_llama_loss))
    p = q = _llama_params()
    for _ in range(10):
        g = jax.tree.map(np.asarray, grad(p, ids, targets))
        p = jax.tree.map(lambda a, b: np.asarray(a) - LR * b, p, g)
        q = jax.tree.map(lambda a, b: a - LR * b, q, ref(q, ids, targets))
    # fp32 on both. A step's gradients agree to about 1e-6 (relative to each tensor's largest);
    # ten steps amplify that by the descent's own sensitivity, so the figure is the issue's
    # 1e-4, relative to each parameter tensor's norm (an element near zero has no relative
    # error to speak of)
    for a, b in zip(jax.tree.leaves(p), jax.tree.leaves(q), strict=True):
        b = np.asarray(b)
        assert np.linalg.norm(a - b) <= 1e-4 * np.linalg.norm(b)


def test_ten_sgd_steps_of_an_mlp_match_the_cpu():
    grad, ref = jax.grad(spyre_jax.jit(_mlp)), jax.jit(jax.grad(_mlp))
    p = q = _params(9)
    for _ in range(10):
        p = jax.tree.map(lambda a, b: np.asarray(a) - LR * np.asarray(b), p, grad(p, X))
        q = jax.tree.map(lambda a, b: a - LR * b, q, ref(q, X))
    for a, b in zip(jax.tree.leaves(p), jax.tree.leaves(q), strict=True):
        b = np.asarray(b)
        assert np.linalg.norm(a - b) <= 1e-4 * np.linalg.norm(b)


def test_checkpoint_with_a_policy_saves_fewer_activations_and_less_device_memory():
    def block(x, w):
        for _ in range(4):
            x = jnp.tanh(jnp.sin(x @ w) * 2 + 1)
        return x

    policies = {
        "none": block,
        "dots": jax.checkpoint(block, policy=jax.checkpoint_policies.dots_saveable),
        "nothing": jax.checkpoint(block, policy=jax.checkpoint_policies.nothing_saveable),
    }
    x = np.ones((128, 128), np.float32)
    w = (np.eye(128) * 0.5).astype(np.float32)
    saved, peak = {}, {}
    for name, b in policies.items():
        f = spyre_jax.jit(lambda x, w, b=b: jnp.sum(b(x, w)))
        jax.grad(f, argnums=1)(x, w)  # compiled
        transforms.reset_stats()
        mem = spyre_jax.runtime.runtime().memory
        mem.reset_peak()
        base = spyre_jax.memory_stats()["bytes_in_use"]
        g = jax.grad(f, argnums=1)(x, w)
        saved[name] = transforms.stats()["residual_bytes"]
        peak[name] = spyre_jax.memory_stats()["peak_bytes_in_use"] - base
        _close(g, jax.grad(lambda x, w: jnp.sum(block(x, w)), argnums=1)(x, w), rtol=1e-4)
    assert saved["nothing"] < saved["dots"] < saved["none"], saved
    assert peak["nothing"] < peak["none"], peak


def test_vmap_and_jvp_of_a_llama_layer():
    from spyre_jax.tools.train_layer import TINY, layer, layer_params

    d, f, heads, kvh, t = TINY
    p = layer_params(d, f, d // heads * kvh, np.float32, seed=3)
    xs = (np.random.default_rng(4).standard_normal((2, t, d)) * 0.5).astype(np.float32)

    def fn(p, x):
        return layer(p, x, heads, kvh)

    sfn = spyre_jax.jit(fn)
    _close(jax.vmap(sfn, (None, 0))(p, xs), jax.vmap(jax.jit(fn), (None, 0))(p, xs), rtol=1e-4)
    tp = jax.tree.map(lambda a: a * 0.1, p)
    got = jax.jvp(sfn, (p, xs[0]), (tp, xs[1]))
    _close(got, jax.jvp(jax.jit(fn), (p, xs[0]), (tp, xs[1])), rtol=1e-4)


def test_inside_a_shard_map_body_under_an_outer_spyre_jit(monkeypatch):
    from jax.sharding import Mesh
    from jax.sharding import PartitionSpec as P

    monkeypatch.setenv("SPYRE_NUM_CARDS", "2")
    mesh = Mesh(np.array(spyre_jax.devices()), ("tp",))
    inner = spyre_jax.jit(lambda x, w1, w2: jax.nn.gelu(x @ w1) @ w2)

    def body(x, w1, w2):
        return jax.lax.psum(inner(x, w1, w2), "tp")

    specs = (P(), P(None, "tp"), P("tp", None))
    f = spyre_jax.jit(jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=P()))
    r = np.random.default_rng(0)
    x, w1, w2 = (
        r.standard_normal(s).astype(np.float32) * 0.3 for s in ((8, 32), (32, 64), (64, 32))
    )
    _close(f(x, w1, w2), jax.nn.gelu(x @ w1) @ w2, rtol=1e-5)
