"""The ``spyre`` device (torch_bridge.device): tensors in the card's device memory, eager ops as
one-op graphs through the shared lowering and launch, against eager CPU."""

from __future__ import annotations

import gc
import importlib.metadata
import subprocess
import sys
import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import torch_rand as _rand

import spyre_jax
from device_model.runtime import runtime
from spyre_jax.tools.testing import assert_close
from torch_bridge import device as dev
from torch_bridge import operands, storage
from torch_bridge.backend import SpyreFallbackWarning


def _close(got: torch.Tensor, want: torch.Tensor, k: int = 1) -> None:
    """A result on the spyre device against eager CPU (the oracle of spyre_jax.tools.testing)."""
    assert got.device.type == "spyre"
    assert_close(got, want, k=k)


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


# ---------------------------------------------------------------------------------------------
# the device and its module


def test_torch_spyre_module():
    assert torch.spyre.is_available()
    assert torch.spyre.device_count() == 1
    assert torch.spyre.current_device() == 0
    x = torch.ones(3, device="spyre") + 1
    assert torch.spyre.synchronize() is None
    assert x.device == torch.device("spyre", 0) and x.is_spyre
    assert torch.spyre.memory_allocated() == spyre_jax.memory_stats()["bytes_in_use"]


@pytest.mark.slow
def test_entry_point_and_import_torch_alone():
    eps = importlib.metadata.entry_points(group="torch.backends")
    assert [e.value for e in eps if e.name == "spyre"] == ["torch_bridge.device:_autoload"]
    code = (
        "import sys, torch\n"
        "assert torch._C._get_privateuse1_backend_name() == 'spyre'\n"
        "assert 'jax' not in sys.modules, 'jax imported at import torch'\n"
        "x = torch.arange(4.0).to('spyre')\n"
        "print(x.device, x.cpu().tolist())\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "spyre:0 [0.0, 1.0, 2.0, 3.0]"


@pytest.mark.parametrize(
    "first",
    # the importer itself and a leaf module of the plugin (each a fresh process, about 5 s on
    # CI: the other modules between them import the same way)
    ["lowering.from_fx", "torch_bridge.strides"],
)
@pytest.mark.slow
def test_device_loads_when_our_fx_importer_imports_torch_first(first):
    # regression: the first ``import torch`` of a process happening inside lowering's FX importer
    # loaded the spyre plugin, which stands on that importer, half-way through it (a
    # RuntimeError "Failed to load the backend extension: spyre" out of ``import torch``)
    code = (
        f"import {first}\n"
        "import sys, torch\n"
        "assert torch._C._get_privateuse1_backend_name() == 'spyre'\n"
        "assert 'jax' not in sys.modules, 'jax imported at import torch'\n"
        "print((torch.arange(3.0).to('spyre') * 2).cpu().tolist())\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[0.0, 2.0, 4.0]"


# ---------------------------------------------------------------------------------------------
# memory: storages are regions of the card's device memory


def _region_of(ptr: int) -> tuple[int, int]:
    """The live device-memory region (base, size) holding address ``ptr``."""
    (hit,) = [(a, n) for a, n in runtime().memory.live().items() if a <= ptr < a + n]
    return hit


@pytest.mark.slow
def test_storage_is_device_memory_and_freed():
    gc.collect()
    before = spyre_jax.memory_stats()["bytes_in_use"]
    live = dict(runtime().memory.live())
    t = torch.empty(1000, 1000, device="spyre")
    base, size = _region_of(_storage(t))
    assert runtime().memory.tag_of(base) == "torch" and _storage(t) != 0
    assert _storage(t) + 4_000_000 <= base + size
    assert 4_000_000 <= size <= 4_000_000 + 256  # aligned (and off address 0)
    # blocks kept at addresses an earlier test's tensor on a previous card still holds (see
    # test_an_address_a_previous_cards_tensor_holds_is_kept_then_freed): not this storage's
    kept = sum(n for a, n in runtime().memory.live().items() if a not in live and a != base)
    grown = spyre_jax.memory_stats()["bytes_in_use"] - before
    assert grown == size + kept
    v = t[10:].t()  # a view keeps the storage alive
    del t
    gc.collect()
    assert spyre_jax.memory_stats()["bytes_in_use"] - before == grown
    del v
    gc.collect()
    assert spyre_jax.memory_stats()["bytes_in_use"] == before + kept


def test_an_address_a_previous_cards_tensor_holds_is_kept_then_freed():
    # regression: a block kept on the new card (its address still a previous card's live
    # storage) stayed allocated for good, and memory_stats grew by it (CI saw 8 MB for 4 MB).
    # Two fresh cards allocate alike, so the new tensor's first choice is the old one's address
    # (after any address an earlier test's tensor still holds, kept on both cards alike).
    gc.collect()
    spyre_jax.set_card(spyre_jax.CardSpec())
    old = torch.empty(1000, 1000, device="spyre")
    old_ptr = _storage(old)
    spyre_jax.set_card(spyre_jax.CardSpec())
    try:
        t = torch.empty(1000, 1000, device="spyre")
        assert _storage(t) != old_ptr
        (kept,) = [(a, n) for a, n in runtime().memory.live().items() if a <= old_ptr < a + n]
        in_use = spyre_jax.memory_stats()["bytes_in_use"]
        del old
        gc.collect()
        assert not [a for a, n in runtime().memory.live().items() if a <= old_ptr < a + n]
        assert spyre_jax.memory_stats()["bytes_in_use"] == in_use - kept[1]
        base, size = _region_of(_storage(t))
        del t
        gc.collect()
        assert spyre_jax.memory_stats()["bytes_in_use"] == in_use - kept[1] - size
    finally:
        spyre_jax.set_card(spyre_jax.CardSpec())


@pytest.mark.slow
def test_eager_results_do_not_leak():
    x = torch.randn(32, 64).to("spyre")
    y = x * 2 + 1  # warm
    del y
    gc.collect()
    before = spyre_jax.memory_stats()["bytes_in_use"]
    for _ in range(3):
        y = torch.softmax(x * 2 + 1, -1)
    del y
    gc.collect()
    assert spyre_jax.memory_stats()["bytes_in_use"] == before


# ---------------------------------------------------------------------------------------------
# factories and host round trips


def test_factories():
    e = torch.empty(2, 3, device="spyre")
    assert e.device.type == "spyre" and e.shape == (2, 3) and e.dtype == torch.float32
    assert torch.equal(torch.zeros(2, 3, device="spyre").cpu(), torch.zeros(2, 3))
    o = torch.ones(4, 70, device="spyre", dtype=torch.float16)
    assert o.dtype == torch.float16 and torch.equal(o.cpu(), torch.ones(4, 70, dtype=torch.float16))
    assert torch.equal(torch.full((3,), 2.5, device="spyre").cpu(), torch.full((3,), 2.5))
    assert torch.equal(torch.arange(5, device="spyre").cpu(), torch.arange(5))
    torch.manual_seed(1)
    r = torch.randn(8, 33, device="spyre")
    torch.manual_seed(1)
    assert torch.equal(r.cpu(), torch.randn(8, 33, device="spyre").cpu())  # the card's generator
    assert torch.equal(torch.zeros_like(r).cpu(), torch.zeros(8, 33))


ROUND_TRIP = [
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.int32,
    torch.int64,
    torch.int8,
    torch.uint8,
    torch.bool,
]


@pytest.mark.parametrize("dtype", ROUND_TRIP, ids=lambda d: str(d).removeprefix("torch."))
def test_round_trip_exact(dtype):
    if dtype.is_floating_point:
        x = torch.randn(5, 67).to(dtype)
        x[0, :4] = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0])
        x = x.view({4: torch.int32, 2: torch.int16}[x.element_size()])  # compare the bits
        assert torch.equal(x.view(dtype).to("spyre").cpu().view(x.dtype), x)
        assert torch.equal(x.view(dtype).t().to("spyre").cpu().view(x.dtype), x.t())
        return
    if dtype == torch.bool:
        x = torch.rand(5, 67) > 0.5
        assert torch.equal(x.to("spyre").cpu(), x)
    else:
        info = torch.iinfo(dtype)
        x = torch.randint(info.min, info.max, (5, 67), dtype=dtype)
        assert torch.equal(x.to("spyre").cpu(), x)
    assert torch.equal(x.t().to("spyre").cpu(), x.t())  # a non-contiguous CPU source


def test_module_to_and_back():
    m = torch.nn.Linear(5, 3)
    w = m.weight.detach().clone()
    m.to("spyre")
    assert m.weight.device.type == "spyre" and isinstance(m.weight, torch.nn.Parameter)
    m.cpu()
    assert torch.equal(m.weight, w)


def test_printing():
    x = torch.tensor([[1.5, -2.0, 3.25], [0.0, 7.0, 1e-3]])
    s = repr(x.to("spyre"))
    assert "device='spyre:0'" in s
    assert s.replace(", device='spyre:0'", "") == repr(x)
    assert "dtype=torch.float16" in repr(x.half().to("spyre"))
    assert "device='spyre:0'" in repr(torch.empty(0, device="spyre"))
    assert x.to("spyre")[1, 2].item() == pytest.approx(1e-3)
    assert x.to("spyre").tolist() == x.tolist()


# ---------------------------------------------------------------------------------------------
# views share storage


def test_views_share_storage_and_see_later_writes():
    x = _rand((6, 10))
    xs = x.to("spyre")
    views = {
        "view": (xs.view(3, 20), x.view(3, 20)),
        "reshape": (xs.reshape(60), x.reshape(60)),
        "permute": (xs.permute(1, 0), x.permute(1, 0)),
        "slice": (xs[1:4, 2:], x[1:4, 2:]),
        "transpose": (xs.transpose(0, 1), x.transpose(0, 1)),
        "t": (xs.t(), x.t()),
        "select": (xs[2], x[2]),
        "unsqueeze": (xs.unsqueeze(0), x.unsqueeze(0)),
        "expand": (xs[:1].expand(4, 10), x[:1].expand(4, 10)),
        "strided": (xs[::2, ::3], x[::2, ::3]),
    }
    for name, (v, ref) in views.items():
        assert _storage(v) == _storage(xs), name
        assert v.stride() == ref.stride() and v.storage_offset() == ref.storage_offset(), name
        assert torch.equal(v.cpu(), ref), name
    xs.mul_(2)  # in place on the base: every view sees it
    x.mul_(2)
    for name, (v, ref) in views.items():
        assert torch.equal(v.cpu(), ref), name
    sl = xs[1:4, 2:]  # in place through a view: the base sees it
    sl.add_(1)
    x[1:4, 2:].add_(1)
    assert torch.equal(xs.cpu(), x)


def test_ops_on_views():
    x = _rand((7, 65))
    xs = x.to("spyre")
    for got, want in [
        (xs.t() * 3, x.t() * 3),
        (xs[2:, 5:40] + xs[:5, :35], x[2:, 5:40] + x[:5, :35]),
        (xs[::2].exp(), x[::2].exp()),
        (xs.t() @ xs, x.t() @ x),
        (xs.t().contiguous(), x.t().contiguous()),
    ]:
        _close(got, want, k=7)
        assert got.stride() == want.stride()  # torch's own result layout (dense permutations)


def test_out_and_inplace_variants():
    x, y = _rand((4, 40), seed=1), _rand((4, 40), seed=2)
    xs, ys = x.to("spyre"), y.to("spyre")
    out = torch.empty(0, device="spyre")
    r = torch.add(xs, ys, alpha=2, out=out)
    assert r is out
    _close(out, torch.add(x, y, alpha=2))
    zs = xs.clone()
    zs.sub_(ys).relu_()
    _close(zs, (x - y).relu())
    with pytest.raises(RuntimeError, match="doesn't match the broadcast shape"):
        xs[:1].add_(ys)


def test_out_tensors_take_the_result_or_are_written():
    x, y = _rand((4, 40), seed=1), _rand((4, 40), seed=2)
    xs, ys = x.to("spyre"), y.to("spyre")
    out = torch.empty(0, device="spyre")  # no bytes: takes the result's storage, no copy
    assert torch.add(xs, ys, out=out) is out and out.shape == (4, 40)
    _close(out, x + y)
    ids, eos = torch.tensor([[3, 7, 2, 7]]), torch.tensor([7, 9])
    hits = torch.empty(0, device="spyre", dtype=torch.bool)
    torch.isin(ids.to("spyre"), eos.to("spyre"), out=hits)  # as generate()'s end check
    assert torch.equal(hits.cpu(), torch.isin(ids, eos))
    big = torch.zeros(2, 3, device="spyre")  # bytes of another shape: resized and written
    torch.mul(xs, ys, out=big)
    _close(big, x * y)
    base = torch.zeros(6, 40, device="spyre")  # a view: written in place, its base sees it
    torch.sub(xs, ys, out=base[1:5])
    _close(base[1:5], x - y)
    assert not base[0].cpu().any() and not base[5].cpu().any()
    # as on the CPU: a float result into an int out= is refused (it was converted silently)
    with pytest.raises(RuntimeError, match="can't be cast to the desired output type Int"):
        torch.add(xs, ys, out=torch.empty(0, device="spyre", dtype=torch.int32))
    xi = torch.arange(4, device="spyre")
    with pytest.raises(RuntimeError, match="can't be cast to the desired output type Long"):
        xi.add_(1.5)  # in place too, and the tensor is left as it was
    assert torch.equal(xi.cpu(), torch.arange(4))
    wide = torch.empty(0, device="spyre", dtype=torch.float16)  # a narrower float: converted
    torch.add(xs, ys, out=wide)
    assert wide.dtype == torch.float16
    _close(wide.float(), (x + y).half().float())


@pytest.mark.parametrize(
    "args",
    [(5,), (3, 9, 2), (4.0,), (0, 1, 0.25), (-3, 3), (10, 0, -3)],
    ids=["n", "step", "float", "frac", "neg", "down"],
)
def test_arange_on_the_device(args):
    before = dev.eager_stats()["host_factories"]
    got = torch.arange(*args, device="spyre")
    want = torch.arange(*args)
    assert got.device.type == "spyre" and got.dtype == want.dtype
    assert torch.equal(got.cpu(), want)
    assert dev.eager_stats()["host_factories"] == before + 1  # made on the host, copied in
    h = torch.arange(*args, device="spyre", dtype=torch.float16)
    assert torch.equal(h.cpu(), torch.arange(*args, dtype=torch.float16))
    o = torch.zeros(len(want) + 2, device="spyre", dtype=want.dtype)
    torch.arange(*args, out=o[1:-1])  # into a view: its base sees it
    assert torch.equal(o.cpu()[1:-1], want) and o.cpu()[0] == 0 and o.cpu()[-1] == 0
    with pytest.raises(RuntimeError, match="step must be nonzero"):
        torch.arange(0, 5, 0, device="spyre")


# ---------------------------------------------------------------------------------------------
# eager ops against CPU

SHAPES = [(1, 1), (5, 65), (3, 100), (2, 3, 70)]

ELEMENTWISE = {
    "add": lambda a, b: a + b,
    "sub_scalar": lambda a, b: a - 1.5,
    "rsub": lambda a, b: 2.0 - a,
    "mul": lambda a, b: a * b,
    "div": lambda a, b: a / (b.abs() + 0.5),
    "neg": lambda a, b: -a,
    "exp": lambda a, b: torch.exp(a),
    "tanh": lambda a, b: torch.tanh(a),
    "sigmoid": lambda a, b: torch.sigmoid(a),
    "maximum": lambda a, b: torch.maximum(a, b),
    "where": lambda a, b: torch.where(a > b, a, b),
    "gt": lambda a, b: a > b,
    "pow2": lambda a, b: a**2,
    "gelu": lambda a, b: F.gelu(a),
    "silu": lambda a, b: F.silu(a),
    "relu": lambda a, b: F.relu(a),
    "bcast_row": lambda a, b: a + b[..., :1, :],
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["f32", "f16"])
@pytest.mark.parametrize("name", list(ELEMENTWISE))
@pytest.mark.slow
def test_elementwise(name, dtype):
    fn = ELEMENTWISE[name]
    for shape in [(5, 65), (2, 3, 70)]:
        a, b = _rand(shape, dtype, 1), _rand(shape, dtype, 2)
        with warnings.catch_warnings():
            warnings.simplefilter("error", SpyreFallbackWarning)  # all of these run on the card
            got = fn(a.to("spyre"), b.to("spyre"))
        _close(got, fn(a, b))


REDUCE_AND_NORM = {
    "sum": lambda a: a.sum(-1),
    "mean_keep": lambda a: a.mean(0, keepdim=True),
    "amax": lambda a: a.amax(-1),
    "argmax": lambda a: a.argmax(-1),
    "softmax": lambda a: torch.softmax(a, -1),
    "log_softmax": lambda a: torch.log_softmax(a, -1),
    "layer_norm": lambda a: F.layer_norm(a, a.shape[-1:]),
    "cat": lambda a: torch.cat([a, a * 2], -1),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["f32", "f16"])
@pytest.mark.parametrize("name", list(REDUCE_AND_NORM))
@pytest.mark.slow
def test_reductions_and_norms(name, dtype):
    fn = REDUCE_AND_NORM[name]
    for shape in SHAPES:
        a = _rand(shape, dtype, 3)
        _close(fn(a.to("spyre")), fn(a), k=shape[-1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["f32", "f16"])
def test_matmuls(dtype):
    a, b = _rand((5, 65), dtype, 1), _rand((65, 33), dtype, 2)
    _close(a.to("spyre") @ b.to("spyre"), a @ b, k=65)
    p, q = _rand((3, 7, 65), dtype, 3), _rand((3, 65, 20), dtype, 4)
    _close(torch.bmm(p.to("spyre"), q.to("spyre")), torch.bmm(p, q), k=65)
    _close(p.to("spyre") @ b.to("spyre"), p @ b, k=65)  # matmul: view + mm


def test_embedding_and_int64():
    emb = torch.nn.Embedding(50, 24)
    idx = torch.tensor([[1, 2, 49], [0, 0, 7]])
    want = emb(idx)
    emb.to("spyre")
    _close(emb(idx.to("spyre")), want)
    xs = _rand((4, 70)).to("spyre")
    i = xs.argmax(-1)
    assert i.dtype == torch.int64 and torch.equal(i.cpu(), xs.cpu().argmax(-1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["f32", "f16"])
def test_sequential_model(dtype):
    torch.manual_seed(0)
    m = torch.nn.Sequential(
        torch.nn.Linear(48, 96), torch.nn.GELU(), torch.nn.LayerNorm(96), torch.nn.Linear(96, 40)
    ).to(dtype)
    x = _rand((2, 7, 48), dtype, 5)
    with torch.no_grad():
        want = m(x)
        m.to("spyre")
        with warnings.catch_warnings():
            warnings.simplefilter("error", SpyreFallbackWarning)
            got = m(x.to("spyre"))
    _close(got, want, k=96)


def test_backward_runs_on_spyre():
    a = _rand((3, 5)).to("spyre").requires_grad_()
    (a @ a.t() + a.sum()).sum().backward()
    ac = a.detach().cpu().requires_grad_()
    (ac @ ac.t() + ac.sum()).sum().backward()
    assert a.grad.device.type == "spyre"
    _close(a.grad, ac.grad, k=5)


# ---------------------------------------------------------------------------------------------
# compile caching


def test_same_op_same_shapes_compiles_once():
    a, b = _rand((9, 77)).to("spyre"), _rand((9, 77), seed=1).to("spyre")
    n0 = dev.compile_count()
    a * b + 1.0
    n1 = dev.compile_count()
    assert n1 - n0 == 2  # mul, add
    for _ in range(3):
        a * b + 1.0
    a.t().contiguous().t() * b  # other strides, same shapes: gathered, not recompiled
    a * b + 2.5  # numbers in tensor positions are inputs, not constants
    assert dev.compile_count() == n1
    a[:3] * b[:3]  # another shape: one more
    assert dev.compile_count() == n1 + 1
    (a * b).half()  # dtype conversion is a copy, not a compile
    a.half() * b.half()  # another dtype: one more
    assert dev.compile_count() == n1 + 2
    assert torch.spyre.compile_count() == dev.compile_count()


# ---------------------------------------------------------------------------------------------
# devices and fallbacks


def test_mixed_devices_raise():
    xs, x = torch.ones(3, 4).to("spyre"), torch.ones(3, 4)
    msg = "Expected all tensors to be on the same device, but found at least two devices"
    for f in (lambda: xs + x, lambda: x + xs, lambda: xs @ x.t(), lambda: torch.cat([xs, x])):
        with pytest.raises(RuntimeError, match=msg) as e:
            f()
        assert "spyre:0" in str(e.value) and "cpu" in str(e.value)
    # 0-dim CPU tensors are scalars and may join
    _close(xs * torch.tensor(3.0), x * 3.0)


def test_running_reductions_run_on_the_device():
    dev.reset_stats()
    x = torch.tensor([[1.0, 3.0, 3.0, 2.0, 5.0, float("nan"), 4.0]])
    for f in (torch.cummax, torch.cummin):
        got, want = f(x.to("spyre"), 1), f(x, 1)
        assert torch.equal(got.indices.cpu(), want.indices)  # ties and NaN as torch picks
        torch.testing.assert_close(got.values.cpu(), want.values, equal_nan=True)
    y = _rand((4, 10))
    _close(torch.cumprod(1 + y.to("spyre") / 10, 1), torch.cumprod(1 + y / 10, 1))
    _close(torch.logcumsumexp(y.to("spyre"), 0), torch.logcumsumexp(y, 0))
    assert dev.eager_stats()["cpu_fallbacks"] == 0


def test_unsupported_op_falls_back_with_warning():
    dev.reset_stats()
    x = _rand((4, 10))
    # (a Bessel function of order one: no card kernel for it)
    with pytest.warns(SpyreFallbackWarning, match="special_i1"):
        got = torch.special.i1(x.to("spyre"))
    _close(got, torch.special.i1(x))
    assert dev.fallback_stats() == {"aten.special_i1.default": 1}
    with pytest.warns(SpyreFallbackWarning, match="float64"):
        d = torch.ones(3, dtype=torch.float64).to("spyre") * 2
    assert d.device.type == "spyre" and torch.equal(d.cpu(), torch.full((3,), 2.0).double())
    assert dev.eager_stats()["cpu_fallbacks"] == 2


# ---------------------------------------------------------------------------------------------
# the compile backend's doors


def test_card_array_round_trip():
    x = _rand((5, 70))
    xs = x.to("spyre")
    # the device buffer both frontends wrap: a spyre tensor's card buffer as a spyre_jax.Array
    a = spyre_jax.Array(operands.as_card_buffer(xs.t()))  # a strided view: gathered into sticks
    assert isinstance(a, spyre_jax.Array) and a.shape == (70, 5) and a.layout.device_shape[-1] == 32
    assert np.array_equal(np.asarray(a), x.t().numpy())
    back = storage.from_card_buffer(a.buffer)
    assert back.device.type == "spyre" and torch.equal(back.cpu(), x.t())
    ia = spyre_jax.device_put(np.arange(6, dtype=np.int32).reshape(2, 3))
    t = storage.from_card_buffer(ia.buffer, torch.empty(2, 3, dtype=torch.int64, device="meta"))
    assert t.dtype == torch.int64 and torch.equal(t.cpu(), torch.arange(6).reshape(2, 3))


def test_torch_compile_on_spyre_inputs():
    torch._dynamo.reset()
    m = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.LayerNorm(32))
    x = _rand((4, 16))
    with torch.no_grad():
        want = m(x)
        m.to("spyre")
        got = torch.compile(m, backend="spyre", dynamic=False)(x.to("spyre"))
    assert got.device.type == "spyre"  # stayed on the card: no host round trip
    assert_close(got, want)


def test_complex_on_spyre_is_a_type_error_not_a_crash():
    # regression (found by `spyre-jax coverage torch`): fft.hfft on a spyre tensor made a
    # complex PrivateUse1 storage, which crashed the process
    x = torch.randn(8).to("spyre")
    with pytest.raises(TypeError, match="complex64"):
        torch.fft.hfft(x)
    with pytest.raises(TypeError, match="not supported on the card"):
        torch.randn(4, dtype=torch.complex64).to("spyre")
    assert (x * 2).cpu().shape == (8,)  # the device is still usable


@pytest.mark.slow
def test_plain_torch_compile_on_spyre_tensors_runs_on_the_card():
    # torch-spyre's users write torch.compile(model) with no backend=: Inductor (the default)
    # has no code generator for the card; graphs of spyre tensors go to our backend instead
    from torch_bridge import backend as tb

    torch._dynamo.reset()
    tb.reset_fallback_stats()
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU(), torch.nn.Linear(64, 8))
    m = m.eval()
    x = torch.randn(4, 64)
    with torch.no_grad():
        want = m(x)
        got = torch.compile(m.to("spyre"))(x.to("spyre"))
    assert got.device.type == "spyre"
    assert tb.compile_stats()["graphs"] == 1 and tb.fallback_stats() == {}
    assert_close(got, want)
    # graphs of CPU tensors still go to Inductor
    cpu = torch.compile(lambda a: a * 2 + 1)(torch.ones(3))
    torch.testing.assert_close(cpu, torch.full((3,), 3.0))
    assert tb.compile_stats()["graphs"] == 1
