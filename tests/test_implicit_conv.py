"""Convolution as an implicit GEMM (``conv`` nodes, lowering/tile_conv.py): the input windows
in scratchpad with a zero halo, no patches in device memory; the card program against the NumPy
reference and ``jax.jit`` on the CPU; the explicit im2col where no window fits; the traffic
saved.

fp32 results are compared exactly where XLA's CPU convolution and the card's fp32 GEMM sum in
the same order, else within 1e-5 relative (fp32 accumulation of up to a few thousand products
in another order); fp16 within 2e-2 relative to the result's scale (one fp16 rounding of the
output on products accumulated in fp32, the CPU accumulating fp16 products its own way).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax import lax

import spyre_jax
from device_model.card import DEFAULT_CARD
from device_model.payload import to_device_layout
from device_model.program import build_runner
from device_model.reference import run_kernel_reference
from lowering.from_jaxpr import from_jaxpr
from lowering.pipeline import compile_graph

F32, F16 = np.float32, np.float16


def _conv(stride=(1, 1), pad=((1, 1), (1, 1)), rhs_dil=(1, 1), lhs_dil=(1, 1)):
    def f(x, w):
        return lax.conv_general_dilated(
            x, w, stride, pad, lhs_dilation=lhs_dil, rhs_dilation=rhs_dil
        )

    return f


def _data(n, c, h, w, o, kh, kw, dtype=F32, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, c, h, w)).astype(dtype)
    k = (rng.standard_normal((o, c, kh, kw)) / np.sqrt(c * kh * kw)).astype(dtype)
    return x, k


def _close(got, want, dtype):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    scale = max(1.0, float(np.abs(want).max()))
    tol = 2e-2 if dtype == F16 else 1e-5
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol * scale)


def _kernel(f, *xs, card=DEFAULT_CARD):
    closed = jax.make_jaxpr(f)(*xs)
    return compile_graph(from_jaxpr(closed, "conv"), card)


def _run_both(k, *xs):
    """The vectorized card program's and the NumPy reference's outputs (host layout)."""
    decls = {t.name: t for t in k.tensors}
    hosts = [np.asarray(x) for x in xs] + [a for _, a in k.consts]
    args = [
        np.asarray(to_device_layout(h, decls[n].layout))
        for n, h in zip(k.inputs, hosts, strict=True)
    ]
    vec = [np.asarray(o) for o in build_runner(k)(*args)]
    ref = run_kernel_reference(k, args)
    lays = [decls[o].layout for o in k.outputs]

    def host(a, lay):  # the device layout's stick padding cropped
        return np.asarray(a)[..., : lay.shape[-1]].reshape(lay.shape)

    return (
        [host(v, lay) for v, lay in zip(vec, lays, strict=True)],
        [host(r, lay) for r, lay in zip(ref, lays, strict=True)],
    )


def _conv_stages(k):
    return [s for s in k.stages if s.kind == "matmul" and s.step.window is not None]


# ---------------------------------------------------------------------------------------------
# the schedule: one windowed matmul, the halo in scratchpad


def test_a_3x3_convolution_is_one_windowed_matmul_with_no_patches_stored():
    x, w = _data(1, 64, 14, 14, 64, 3, 3, F16)
    k = _kernel(_conv(), x, w)
    (st_,) = _conv_stages(k)
    lhs = st_.inputs[0]
    assert lhs.pad_value == 0.0 and lhs.origin[1:3] == (-1, -1)  # the padding is the halo
    assert st_.step.window.kernel == (3, 3) and st_.flops == 2 * 14 * 14 * 64 * 64 * 9
    # no concatenation of taps, no strided slices, no pad stored: the input's and the kernel's
    # re-layouts, the convolution and the output's re-layout
    assert not [s for s in k.stages if s.kind == "concat"]
    assert len(k.stages) == 4
    assert "patches(lhs: windows 3x3" in str(st_.step)


def test_the_input_is_read_about_once_not_once_per_tap():
    x, w = _data(1, 64, 56, 56, 64, 3, 3, F16)
    cost = spyre_jax.jit(_conv()).lower(x, w).compile().cost_analysis()
    (conv,) = [s for s in cost["stages"] if s["kind"] == "matmul"]
    in_bytes = x.nbytes
    # the windows' halo rows are read twice, the kernel once per row block: far below the nine
    # copies of the input an explicit im2col writes and reads back
    assert conv["load_bytes"] < 3 * in_bytes
    assert cost["scratchpad_peak_bytes"] <= cost["scratchpad_usable_bytes"]


# ---------------------------------------------------------------------------------------------
# the card program against the NumPy reference and jax.jit

REF_CASES = {
    "pad1": (dict(), (1, 32, 7, 6, 24, 3, 3)),
    "stride2": (dict(stride=(2, 2)), (2, 20, 9, 8, 40, 3, 3)),
    "dilated_asym": (dict(pad=((2, 1), (0, 2)), rhs_dil=(2, 1)), (1, 16, 8, 9, 8, 3, 2)),
    "wide_pad": (dict(pad=((3, 0), (1, 4))), (1, 16, 5, 5, 16, 2, 3)),
    "transposed": (dict(lhs_dil=(2, 2), pad=((2, 2), (2, 2))), (1, 16, 4, 5, 16, 3, 3)),
    "strided_1x1": (dict(stride=(2, 2), pad=((0, 0), (0, 0))), (1, 48, 8, 8, 64, 1, 1)),
}


@pytest.mark.parametrize("name", sorted(REF_CASES))
def test_reference_agrees_with_the_card_program(name):
    kw, shape = REF_CASES[name]
    f = _conv(**kw)
    x, w = _data(*shape, F16, seed=len(name))
    k = _kernel(f, x, w)
    assert _conv_stages(k)
    (vec,), (ref,) = _run_both(k, x, w)
    np.testing.assert_array_equal(vec.view(np.uint16), ref.view(np.uint16))
    _close(vec, jax.jit(f)(x, w), F16)


def test_channels_split_across_k_steps_when_a_window_of_all_does_not_fit():
    # a small scratchpad: the window of 256 channels does not fit whole, the K loop runs over
    # stick blocks of channels (each step every tap of one block)
    card = DEFAULT_CARD.replace(scratchpad_bytes=256 * 1024)
    x, w = _data(1, 256, 10, 10, 64, 3, 3, F32, seed=3)
    k = _kernel(_conv(), x, w, card=card)
    (st_,) = _conv_stages(k)
    assert st_.grid[3] > 1 and st_.inputs[1].block[1] < 256
    (vec,), (ref,) = _run_both(k, x, w)
    _close(vec, ref, F32)  # fp32 sums of XLA's GEMM and NumPy's, in their own orders
    _close(vec, jax.jit(_conv())(x, w), F32)


def test_a_convolution_no_window_of_which_fits_is_an_explicit_im2col():
    card = DEFAULT_CARD.replace(scratchpad_bytes=24 * 1024)
    x, w = _data(1, 16, 6, 160, 16, 3, 3, F32, seed=4)
    k = _kernel(_conv(), x, w, card=card)
    assert not _conv_stages(k)
    assert [s for s in k.stages if s.kind == "matmul"]
    (vec,), _ = _run_both(k, x, w)
    _close(vec, jax.jit(_conv())(x, w), F32)


@settings(max_examples=10, deadline=None)
@given(
    n=st.integers(1, 2),
    c=st.sampled_from([16, 24, 64]),
    o=st.sampled_from([8, 40, 64]),
    hw=st.tuples(st.integers(3, 9), st.integers(3, 9)),
    kk=st.tuples(st.integers(1, 3), st.integers(1, 3)),
    s=st.tuples(st.integers(1, 2), st.integers(1, 2)),
    d=st.tuples(st.integers(1, 2), st.integers(1, 2)),
    p=st.tuples(st.integers(0, 2), st.integers(0, 2), st.integers(0, 2), st.integers(0, 2)),
)
def test_convolutions_match_jax_on_the_cpu(n, c, o, hw, kk, s, d, p):
    pad = ((p[0], p[1]), (p[2], p[3]))
    for size, k_, dd, (lo, hi) in zip(hw, kk, d, pad, strict=True):
        if size + lo + hi < (k_ - 1) * dd + 1:
            return  # the kernel is larger than the padded input: no output
    f = _conv(stride=s, pad=pad, rhs_dil=d)
    x, w = _data(n, c, *hw, o, *kk, F32, seed=sum(p))
    _close(spyre_jax.jit(f)(x, w), jax.jit(f)(x, w), F32)


def test_nhwc_input_and_hwio_kernel():
    x, w = _data(2, 32, 8, 8, 16, 3, 3, F32, seed=7)
    xh, wh = jnp.transpose(x, (0, 2, 3, 1)), jnp.transpose(w, (2, 3, 1, 0))

    def f(a, b):
        dn = ("NHWC", "HWIO", "NHWC")
        return lax.conv_general_dilated(a, b, (1, 1), "SAME", dimension_numbers=dn)

    _close(spyre_jax.jit(f)(xh, wh), jax.jit(f)(xh, wh), F32)


# ---------------------------------------------------------------------------------------------
# depthwise: a windowed multiply-add on the SFUs


def test_a_depthwise_convolution_is_one_windowed_multiply_add_not_matmuls():
    f = lambda a, b: lax.conv_general_dilated(  # noqa: E731
        a, b, (2, 1), ((1, 2), (0, 1)), rhs_dilation=(1, 2), feature_group_count=24
    )
    for dt in (F32, F16):
        x, w = _data(2, 24, 9, 11, 24, 3, 3, dt, seed=8)
        w = w[:, :1]  # [C, 1, KH, KW]
        k = _kernel(f, x, w)
        assert not [s for s in k.stages if s.kind == "matmul"]
        # fp32 sums of 9 products; fp16: the products summed in fp32, rounded once
        _close(spyre_jax.jit(f)(x, w), jax.jit(f)(x.astype(F32), w.astype(F32)), dt)


def test_a_depthwise_convolution_through_torch_compile():
    import torch

    torch.manual_seed(0)
    torch._dynamo.reset()
    m = torch.nn.Conv2d(32, 32, 3, stride=2, padding=1, groups=32).eval()
    x = torch.randn(1, 32, 15, 15)
    with torch.no_grad():
        got = torch.compile(m, backend="spyre", dynamic=False)(x)
        want = m(x)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------------------------
# an epilogue on the convolution's store


def test_bias_and_relu_ride_the_convolutions_store():
    # channels-last (NCHW would end in the result's re-layout, which the bias and the ReLU
    # ride instead: the same traffic)
    def f(x, w, b):
        dn = ("NHWC", "HWIO", "NHWC")
        y = lax.conv_general_dilated(x, w, (1, 1), ((1, 1), (1, 1)), dimension_numbers=dn)
        return jnp.maximum(y + b, 0.0)

    x, w = _data(1, 32, 8, 9, 40, 3, 3, F16, seed=10)
    x, w = np.transpose(x, (0, 2, 3, 1)), np.transpose(w, (2, 3, 1, 0))
    b = np.random.default_rng(11).standard_normal(40).astype(F16)
    k = _kernel(f, x, w, b)
    (st_,) = _conv_stages(k)
    assert st_.step.epilogue is not None and len(st_.inputs) == 3
    assert "epilogue" in str(st_.step)
    (vec,), (ref,) = _run_both(k, x, w, b)
    np.testing.assert_array_equal(vec.view(np.uint16), ref.view(np.uint16))
    _close(vec, jax.jit(f)(x, w, b), F16)


def test_a_batch_norm_and_relu_after_a_torch_convolution_fuse_into_it():
    import torch

    from torch_bridge import backend as tb

    torch.manual_seed(0)
    torch._dynamo.reset()
    tb.reset_fallback_stats()  # compiled_kernels(): this test's only
    bn = torch.nn.BatchNorm2d(24)
    bn.running_mean.uniform_(-1, 1)
    bn.running_var.uniform_(0.5, 2)
    conv2 = torch.nn.Conv2d(24, 8, 3, padding=1)
    m = torch.nn.Sequential(torch.nn.Conv2d(16, 24, 3, padding=1), bn, torch.nn.ReLU(), conv2)
    m = m.eval()
    x = torch.randn(1, 16, 10, 10)
    with torch.no_grad():
        got = torch.compile(m, backend="spyre", dynamic=False)(x)
        want = m(x)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    (cg,) = [c for c in tb.compiled_kernels() if any(s.kind == "matmul" for s in c.kernel.stages)]
    convs = [s for s in cg.kernel.stages if s.kind == "matmul"]
    # the first conv's bias and the batch norm's four vectors: five inputs past the input and
    # the kernel (the second's bias rides the result's re-layout to NCHW)
    assert len(convs) == 2 and convs[0].step.epilogue is not None
    assert len(convs[0].inputs) == 7


# ---------------------------------------------------------------------------------------------
# few input channels, overlapping windows (a CNN's stem): the column taps packed into channels

STEM_CASES = {
    "stem_7x7_s2": (dict(stride=(2, 2), pad=((3, 3), (3, 3))), (1, 3, 16, 18, 16, 7, 7)),
    "asym_dilated": (
        dict(stride=(1, 2), pad=((1, 0), (2, 3)), rhs_dil=(1, 2)),
        (2, 3, 9, 11, 8, 3, 4),
    ),
    "one_channel": (dict(pad=((0, 0), (1, 1))), (1, 1, 6, 7, 4, 2, 3)),
}


@pytest.mark.parametrize("name", sorted(STEM_CASES))
def test_a_stems_column_taps_are_packed_into_its_channels(name):
    kw, shape = STEM_CASES[name]
    f = _conv(**kw)
    x, w = _data(*shape, F32, seed=len(name))
    k = _kernel(f, x, w)
    (st_,) = _conv_stages(k)
    C, KW = shape[1], shape[6]
    # a kernel of one column over KW * C channels
    assert st_.step.window.kernel == (shape[5], 1) and st_.inputs[1].block[1] == KW * C
    _close(spyre_jax.jit(f)(x, w), jax.jit(f)(x, w), F32)


def test_a_1d_convolution_of_few_channels():
    f = lambda a, b: lax.conv_general_dilated(a, b, (2,), ((2, 1),))  # noqa: E731
    x, w = _data(2, 4, 1, 19, 6, 1, 5, F32, seed=12)
    x, w = x[:, :, 0], w[:, :, 0]
    _close(spyre_jax.jit(f)(x, w), jax.jit(f)(x, w), F32)


def test_a_channels_last_stem_is_not_packed():
    # NHWC: the 3 channels are on the sticks already; packing would read each stick once per
    # column tap (4.4x the simulated time measured), so the window is the whole kernel
    from spyre_jax.tools.bench_schedules import CASES

    fn, shapes, _ = CASES["conv-stem-224x3x64-7s2"]
    args = [jax.ShapeDtypeStruct(s, jnp.float16) for s in shapes]
    (st_,) = _conv_stages(spyre_jax.jit(fn).lower(*args).kernel)
    assert st_.step.window.kernel == (7, 7)
