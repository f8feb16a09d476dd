"""hfjax.cpu, the CPU's fast paths behind the backend hook: its op lowerings against torch, its
kernels against float64 numpy, how the kernels are built, huge pages, and the decode loop's
cache layout. Skipped off the CPU backend, and where hfjax.cpu is not installed."""

from __future__ import annotations

import concurrent.futures
import copy
import ctypes
import errno
import json
import os
import pathlib
import platform
import re
import stat
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import torchax

import hfjax
import test_quantization  # hfjax.quantization's op: its parity tests are there
from hfjax import bridge
from hfjax.bridge import _compile, _ops
from hfjax.tolerances import EXACT, MATMUL, for_dot_products
from op_helpers import ATTENTION_CASES, SEED, attention_case, check_attention, environment, jit_modes, run, to_jax
from op_helpers import assert_close as _assert_close

cpu = pytest.importorskip("hfjax.cpu", reason="hfjax.cpu is not installed: the generic engine runs on the CPU")
from hfjax.cpu import _build, _kernels, _pages  # noqa: E402
from hfjax.cpu import _lowerings as cpu_ops  # noqa: E402

pytestmark = pytest.mark.skipif(jax.default_backend() != "cpu", reason="hfjax.cpu's paths run on XLA:CPU only")


@pytest.fixture(scope="module")
def env():
    return environment(backend="cpu")


@pytest.fixture(scope="module")
def kernels():
    """The kernels, built and loaded; skips, with the reason, where they do not run here."""
    if _build.build() is None:
        pytest.skip(f"hfjax's CPU kernels do not run here: {_build.reason()}")


def _kernels_loaded() -> bool:
    return _build.build() is not None


# -- building the kernels ------------------------------------------------------------


def test_kernels_are_built_where_the_machine_can_build_them():
    command, why_not = _build.compiler()
    digest = _build.build()
    if command is None:
        assert digest is None and _build.reason() == why_not
    else:
        assert digest is not None, _build.reason()
        assert _build.built() == digest


AVX512 = frozenset({"avx2", "fma", "f16c", "avx512f"})
AVX2 = frozenset({"avx2", "fma", "f16c"})


@pytest.mark.parametrize(
    "flags, switch, builds, products",
    [
        (AVX512, None, True, True),
        (AVX2, None, True, False),  # the attention kernel alone: XLA's products ran faster there
        (AVX2, "avx2", True, True),
        (frozenset({"sse4_2", "avx"}), None, False, False),
    ],
    ids=["avx512", "avx2", "avx2_asked", "neither"],
)
def test_avx2_machines_build_the_kernels_and_run_their_products_only_when_asked(
    monkeypatch, flags, switch, builds, products
):
    monkeypatch.setattr(_build, "cpu_flags", lambda: flags)
    monkeypatch.setattr(_build.platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(_build.platform, "system", lambda: "Linux")
    monkeypatch.setenv("CXX", "/usr/bin/true")
    if switch is None:
        monkeypatch.delenv("HFJAX_CPU_KERNELS", raising=False)
    else:
        monkeypatch.setenv("HFJAX_CPU_KERNELS", switch)
    command, why_not = _build.compiler()
    assert (command is not None) == builds, why_not
    if not builds:
        assert "neither AVX-512 (avx512f) nor AVX2 with FMA and F16C" in why_not
    assert _build.products() == products


@pytest.fixture
def fresh_build(monkeypatch, tmp_path):
    """The build machinery with no result yet, its cache under tmp_path."""
    monkeypatch.setattr(_build, "_result", {})
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    return tmp_path


def _fake_compiler(tmp_path: pathlib.Path, body: str) -> str:
    script = tmp_path / "fake-cxx"
    script.write_text(f"#!{sys.executable}\nimport sys, time\nout = sys.argv[sys.argv.index('-o') + 1]\n{body}\n")
    script.chmod(0o755)
    return str(script)


def test_a_compiler_that_takes_too_long_is_one_warning_and_xla_is_used(fresh_build, monkeypatch):
    slow = _fake_compiler(fresh_build, "time.sleep(30)")
    monkeypatch.setattr(_build, "compiler", lambda: (slow, ""))
    with pytest.warns(UserWarning, match=r"did not build \(the compiler took longer than 1 s\)"):
        assert _build.build(timeout_s=1.0) is None
    assert "longer than" in _build.reason()
    assert _build.build() is None  # one attempt per process: no second wait


def test_a_failed_build_is_one_warning(fresh_build, monkeypatch):
    failing = _fake_compiler(fresh_build, "sys.stderr.write('error: no such intrinsic'); sys.exit(1)")
    monkeypatch.setattr(_build, "compiler", lambda: (failing, ""))
    with pytest.warns(UserWarning, match="no such intrinsic"):
        assert _build.build() is None


def test_the_kernels_are_never_built_inside_a_trace(env, monkeypatch):
    monkeypatch.setattr(_build, "_result", {})
    monkeypatch.setattr(_build, "_build", lambda timeout_s: pytest.fail("the compiler ran inside a trace"))
    weight = jax.numpy.ones((40, 48))

    def apply(x):
        with env:
            return torch.nn.functional.linear(torchax.tensor.Tensor(x, env), torchax.tensor.Tensor(weight, env)).jax()

    text = jax.jit(apply).lower(jax.numpy.ones((2, 48))).as_text()
    assert _kernels.PRODUCT not in text  # not loaded: XLA's product


def test_the_build_directory_is_private(fresh_build):
    directory = _build.private_directory()
    info = directory.stat()
    assert stat.S_IMODE(info.st_mode) == 0o700 and info.st_uid == os.getuid()
    directory.chmod(0o755)  # opened up by someone: closed again
    assert stat.S_IMODE(_build.private_directory().stat().st_mode) == 0o700


def test_a_build_directory_owned_by_someone_else_is_not_used(fresh_build, monkeypatch):
    shared = _build.private_directory()
    monkeypatch.setattr(os, "getuid", lambda: os.stat(shared).st_uid + 1)
    directory = _build.private_directory()
    assert directory != shared and stat.S_IMODE(directory.stat().st_mode) == 0o700


def test_a_library_that_differs_from_its_recorded_hash_is_not_loaded(tmp_path):
    library, record = tmp_path / "rows.so", tmp_path / "rows.json"
    library.write_bytes(b"\x7fELF built")
    record.write_text(json.dumps({"sha256": _build._content_digest(library)}))
    assert _build._verified(library, record)
    library.write_bytes(b"\x7fELF changed")
    assert not _build._verified(library, record)
    record.write_text("not json")
    assert not _build._verified(library, record)


# -- linear (a kernel, or operands swapped for a few rows) ------------------------

LINEAR_CASES = {  # input shape; `_linear` swaps the product for 2-64 rows where the kernel does not take them
    "one_row": (1, 1, 48),
    "two_rows": (2, 48),
    "eight_sequences_one_token": (8, 1, 48),
    "sixty_four_rows": (4, 16, 48),
    "sixty_five_rows": (65, 48),
}


@jit_modes
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no_bias"])
@pytest.mark.parametrize("case", LINEAR_CASES)
def test_linear_matches_torch(env, case, bias, jit):
    torch.manual_seed(SEED)
    layer = torch.nn.Linear(48, 40, bias=bias).eval()
    x = torch.randn(*LINEAR_CASES[case])
    params = {name: p.detach() for name, p in layer.named_parameters()}

    def apply(x, params):
        return torch.func.functional_call(layer, params, (x,))

    _assert_close(run(env, apply, x, params, jit=jit), layer(x).detach(), MATMUL)
    _assert_close(run(env, torch.ops.aten.linear, x, *params.values(), jit=jit), layer(x).detach(), MATMUL)


def test_linear_swaps_operands_only_for_a_few_rows(env):
    weight = jax.numpy.ones((40, 48))

    def program(rows):
        def apply(x):
            with env:
                return torch.nn.functional.linear(
                    torchax.tensor.Tensor(x, env), torchax.tensor.Tensor(weight, env)
                ).jax()

        return jax.jit(apply).lower(jax.numpy.ones((rows, 48))).as_text()

    kernel = _kernels_loaded() and _build.products()  # 1-8 rows go to hfjax's CPU kernel where it runs
    assert all((_kernels.PRODUCT in program(rows)) == kernel for rows in (1, 2, 8))
    assert all(("optimization_barrier" in program(rows)) != kernel for rows in (2, 8))
    assert "optimization_barrier" not in program(1)  # without the kernel, XLA's matrix-vector product
    assert all("optimization_barrier" in program(rows) for rows in (9, 64))
    assert "optimization_barrier" not in program(65) and _kernels.PRODUCT not in program(65)


def test_a_thin_weights_gradient_matches_torch_and_transposes_only_small_operands(env):
    # A LoRA B: weight [96, 8], 120 rows (past the swapped products). `_linear` computes its
    # weight's gradient as (input^T @ grad)^T, behind a barrier; the values are autograd's.
    torch.manual_seed(SEED)
    x, weight, cotangent = torch.randn(3, 40, 8), torch.randn(96, 8), torch.randn(3, 40, 96)
    array = lambda t: jax.numpy.asarray(t.detach().numpy())  # noqa: E731

    def loss(x, weight):
        with env:
            out = torch.nn.functional.linear(torchax.tensor.Tensor(x, env), torchax.tensor.Tensor(weight, env))
        return (out.jax() * array(cotangent)).sum()

    gradient = jax.jit(jax.grad(loss, argnums=(0, 1)))
    got = [torch.from_numpy(np.asarray(g)) for g in gradient(array(x), array(weight))]
    x.requires_grad_(True)
    weight.requires_grad_(True)
    (torch.nn.functional.linear(x, weight) * cotangent).sum().backward()
    _assert_close(got[0], x.grad, for_dot_products(96))
    _assert_close(got[1], weight.grad, for_dot_products(120))
    assert "optimization_barrier" in gradient.lower(array(x), array(weight)).as_text()
    square = jax.jit(jax.grad(loss, argnums=1)).lower(array(torch.randn(3, 40, 96)), array(torch.randn(96, 96)))
    assert "optimization_barrier" not in square.as_text()  # a square weight: autodiff's own product


# -- attention (a kernel, or the scores as key @ query.T) ----------------------------


@jit_modes
@pytest.mark.parametrize("case", ATTENTION_CASES)
def test_scaled_dot_product_attention_matches_torch(env, case, jit):
    check_attention(env, case, jit)


def _attention_program(env, heads: int, length: int, mask=None) -> str:
    q, k = jax.numpy.ones((1, heads, length, 8)), jax.numpy.ones((1, 2, 6, 8))

    def apply(q, k):
        with env:
            q, k = torchax.tensor.Tensor(q, env), torchax.tensor.Tensor(k, env)
            m = None if mask is None else torchax.tensor.Tensor(mask, env)
            return torch.nn.functional.scaled_dot_product_attention(q, k, k, attn_mask=m, enable_gqa=True).jax()

    return jax.jit(apply).lower(q, k).as_text()


# (query heads, query length) over 2 key/value heads: 1, 4 and 8 query rows per key/value head, then 9 and 10
FEW_ROWS, MANY_ROWS = ((2, 1), (8, 1), (4, 4)), ((2, 9), (4, 5))


def test_attention_of_a_few_rows_runs_in_the_kernel_where_it_runs(env):
    kernel = _kernels_loaded()
    assert all((_kernels.ATTENTION in _attention_program(env, *shape)) == kernel for shape in FEW_ROWS)
    assert all(("optimization_barrier" in _attention_program(env, *shape)) != kernel for shape in FEW_ROWS)
    assert not any(_kernels.ATTENTION in _attention_program(env, *shape) for shape in MANY_ROWS)
    per_head = jax.numpy.ones((1, 2, 1, 6), bool)  # a mask that differs between heads stays with XLA
    assert _kernels.ATTENTION not in _attention_program(env, 2, 1, per_head)


def test_a_prompt_chunk_over_a_long_cache_attends_in_key_blocks_only_as_far_as_its_rows_see(env):
    # 8 queries x 2 heads over 2048 columns run in blocks of 512 keys, in a loop that stops after the
    # last block any query may see (`_blocked_attention`; its values: the attention cases above);
    # over 512 columns, or without a mask, one pass.
    def program(columns: int, masked: bool = True) -> str:
        q, k = jax.numpy.ones((1, 4, 8, 8)), jax.numpy.ones((1, 2, columns, 8))
        mask = jax.numpy.ones((1, 1, 8, columns), bool)

        def apply(q, k, mask):
            with env:
                q, k, m = (torchax.tensor.Tensor(a, env) for a in (q, k, mask))
                m = m if masked else None
                return torch.nn.functional.scaled_dot_product_attention(q, k, k, attn_mask=m, enable_gqa=True).jax()

        return jax.jit(apply).lower(q, k, mask).as_text()

    assert "while" in program(2048)
    assert "while" not in program(512) and "while" not in program(2048, masked=False)


def test_attention_in_key_blocks_has_the_gradients_of_one_pass(env):
    # Fine-tuning on long sequences takes the blocked path: its gradients are those of the one-pass
    # attention (`hfjax.bridge.attention`) on the same arrays.
    from hfjax.bridge import attention

    q, k, v, kwargs = attention_case("prompt_chunk_over_a_long_cache")
    q, k, v, mask = (jax.numpy.asarray(a.numpy()) for a in (q, k, v, kwargs["attn_mask"]))
    cotangent = jax.random.normal(jax.random.key(SEED), (2, 4, 16, 8))

    def blocked(q, k, v):
        with env:
            q, k, v, m = (torchax.tensor.Tensor(a, env) for a in (q, k, v, mask))
            out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=m, enable_gqa=True).jax()
        return (out * cotangent).sum()

    one_pass = lambda q, k, v: (attention(q, k, v, mask) * cotangent).sum()  # noqa: E731
    got = jax.jit(jax.grad(blocked, argnums=(0, 1, 2)))(q, k, v)
    want = jax.jit(jax.grad(one_pass, argnums=(0, 1, 2)))(q, k, v)
    for g, w in zip(got, want):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=0, atol=MATMUL.atol)


def test_attention_swaps_the_score_product_only_for_a_few_rows_without_the_kernel(env, monkeypatch):
    monkeypatch.setattr(_kernels, "usable", lambda *arrays: False)
    assert all("optimization_barrier" in _attention_program(env, *shape) for shape in FEW_ROWS)
    assert not any("optimization_barrier" in _attention_program(env, *shape) for shape in MANY_ROWS)


# -- index_copy (transformers' static cache update) ----------------------------------

INDEX_COPY_CASES = {  # (shape, dim, index): the update is made without the size-1 axes
    "batch_one_cache": ((1, 3, 6, 4), 2, [4]),
    "batch_one_prefill": ((1, 3, 6, 4), -2, [0, 1, 2]),
    "batch_two_cache": ((2, 3, 6, 4), 2, [5, 1]),
    "size_one_axis_indexed": ((3, 1, 4), 1, [0]),
    "vector": ((7,), 0, [6, 0, 3]),
}


@jit_modes
@pytest.mark.parametrize("case", INDEX_COPY_CASES)
def test_index_copy_matches_torch(env, case, jit):
    shape, dim, index = INDEX_COPY_CASES[case]
    generator = torch.Generator().manual_seed(SEED)
    x = torch.randn(*shape, generator=generator)
    source_shape = list(shape)
    source_shape[dim] = len(index)
    source = torch.randn(*source_shape, generator=generator)
    index = torch.tensor(index)

    def in_place(x, index, source):
        x.index_copy_(dim, index, source)
        return x

    expected = x.clone().index_copy_(dim, index, source)
    _assert_close(run(env, in_place, x, index, source, jit=jit), expected, EXACT)
    functional = lambda x, index, source: torch.index_copy(x, dim, index, source)  # noqa: E731
    _assert_close(run(env, functional, x, index, source, jit=jit), expected, EXACT)


# -- the kernels against float64 numpy -------------------------------------------------

# rows x K x N: K not a multiple of 16 (the masked tail), N not a multiple of the weight rows
# taken at once (single rows at the end of a thread's chunk), N too small to split between
# threads, and the 150M benchmark model's shapes.
KERNEL_SHAPES = [(rows, 48, 40) for rows in range(1, 9)] + [
    (3, 771, 7),
    (8, 13, 1),
    (5, 64, 301),
    (1, 100, 1001),
    (2, 33, 263),
    (8, 768, 3072),
    (2, 3072, 768),
    (1, 768, 3072),
]


@pytest.mark.parametrize("shape", KERNEL_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_product_kernel_matches_a_float64_product(kernels, shape):
    rows, k, n = shape
    rng = np.random.default_rng(rows * 7 + k + n)
    x, weight = rng.standard_normal((rows, k), np.float32), rng.standard_normal((n, k), np.float32)
    expected = x.astype(np.float64) @ weight.astype(np.float64).T
    got = np.asarray(jax.jit(_kernels.rows_times_weight)(x, weight))
    assert got.shape == (rows, n)
    np.testing.assert_allclose(got, expected, rtol=0, atol=for_dot_products(k).atol)


def test_gradients_through_the_kernels_are_those_of_the_same_operations_in_jnp(kernels):
    # A training step on a few rows runs the kernels forward; their gradients come from jnp.
    import jax.numpy as jnp

    rng = np.random.default_rng(5)
    x, weight = rng.standard_normal((3, 40), np.float32), rng.standard_normal((72, 40), np.float32)
    got = jax.grad(lambda x, w: jnp.sum(jnp.sin(_kernels.rows_times_weight(x, w))), (0, 1))(x, weight)
    expected = jax.grad(lambda x, w: jnp.sum(jnp.sin(x @ w.T)), (0, 1))(x, weight)
    for g, e in zip(got, expected):
        np.testing.assert_allclose(g, e, rtol=0, atol=for_dot_products(72).atol)
    q = rng.standard_normal((2, 2, 4, 16), np.float32)
    k, v = rng.standard_normal((2, 2, 10, 16), np.float32), rng.standard_normal((2, 2, 10, 16), np.float32)
    bias = np.where(rng.uniform(size=(2, 2, 10)) < 0.2, -np.inf, 0.0).astype(np.float32)
    bias[:, :, 0] = 0.0

    def loss(attend):
        return lambda *a: jnp.sum(jnp.sin(attend(*a, 0.25)))

    got = jax.grad(loss(jax.jit(_kernels.decode_attention, static_argnums=4)), (0, 1, 2))(q, k, v, bias)
    expected = jax.grad(loss(lambda *arrays: _kernels._attention_in_jnp(*arrays, None)), (0, 1, 2))(q, k, v, bias)
    for g, e in zip(got, expected):
        np.testing.assert_allclose(g, e, rtol=0, atol=for_dot_products(16).atol)


def test_products_from_several_threads_at_once_get_their_own_results(kernels):
    # Callers share the kernel's helper threads: a caller whose helper is busy with another
    # product finishes its own alone, and no caller may see another's chunks.
    rng = np.random.default_rng(11)
    cases = [
        (rng.standard_normal((rows, 96), np.float32), rng.standard_normal((4001, 96), np.float32))
        for rows in (1, 3, 8, 1)
    ]
    expected = [x.astype(np.float64) @ weight.astype(np.float64).T for x, weight in cases]
    product = jax.jit(_kernels.rows_times_weight)

    def run(case):
        return [np.asarray(product(*case)) for _ in range(40)]

    with concurrent.futures.ThreadPoolExecutor(len(cases)) as pool:
        results = list(pool.map(run, cases))
    for got, want in zip(results, expected):
        for one in got:
            np.testing.assert_allclose(one, want, rtol=0, atol=for_dot_products(96).atol)


# batch x key/value heads x query rows x slots x head size x value head size, query length:
# head sizes not a multiple of 16 (masked tails), slots not a multiple of 16, one slot, 1-8
# rows, and the 150M benchmark model at batch 8 (split between threads).
ATTENTION_SHAPES = [(1, 2, rows, 37, 40, 24, 1) for rows in range(1, 9)] + [
    (2, 3, 4, 1, 16, 16, 1),
    (3, 2, 6, 50, 64, 64, 2),
    (8, 4, 3, 192, 64, 64, 1),
    (1, 1, 8, 300, 128, 80, 4),
]


@pytest.mark.parametrize("shape", ATTENTION_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_attention_kernel_matches_float64_attention(kernels, shape):
    batch, heads, rows, slots, depth, value_depth, length = shape
    rng = np.random.default_rng(sum(shape))
    q = rng.standard_normal((batch, heads, rows, depth), np.float32)
    k = rng.standard_normal((batch, heads, slots, depth), np.float32)
    v = rng.standard_normal((batch, heads, slots, value_depth), np.float32)
    bias = np.where(rng.random((batch, length, slots)) < 0.25, -np.inf, 0.0).astype(np.float32)
    bias[:, :, 0] = rng.standard_normal((batch, length))  # a float mask value in every row
    if batch > 1:
        bias[1] = -np.inf  # a sequence whose queries may attend to nothing: zeros, as torch gives
    scale = 0.7 / np.sqrt(depth)
    scores = np.einsum("bhrd,bhsd->bhrs", q.astype(np.float64), k.astype(np.float64)) * scale
    scores = scores + bias[:, None, np.arange(rows) % length]  # query row r reads bias row r % L
    top = scores.max(-1, keepdims=True)
    weights = np.exp(scores - np.where(np.isfinite(top), top, 0.0))
    total = weights.sum(-1, keepdims=True)
    expected = np.einsum("bhrs,bhsd->bhrd", weights / np.where(total > 0, total, 1.0), v.astype(np.float64))
    got = np.asarray(jax.jit(_kernels.decode_attention, static_argnums=4)(q, k, v, bias, scale))
    assert got.shape == expected.shape
    np.testing.assert_allclose(got, expected, rtol=0, atol=MATMUL.atol)
    if batch > 1:
        assert not got[1].any()


def test_attention_kernel_reads_no_column_past_the_last_one_a_sequence_may_see(kernels):
    # Slot caches are wider than most rows' lengths: the kernel stops at each sequence's last column
    # that some query row may see, so keys and values past it (NaN here) are never read, and the
    # result is the same to the bit as over finite values there.
    batch, heads, rows, slots, depth, length = 4, 2, 4, 300, 32, 2
    rng = np.random.default_rng(7)
    q = rng.standard_normal((batch, heads, rows, depth), np.float32)
    k = rng.standard_normal((batch, heads, slots, depth), np.float32)
    v = rng.standard_normal((batch, heads, slots, depth), np.float32)
    seen = np.array([1, 17, 150, slots])  # each sequence's visible columns
    bias = np.where(np.arange(slots)[None, None, :] < seen[:, None, None], 0.0, -np.inf).astype(np.float32)
    bias = np.broadcast_to(bias, (batch, length, slots)).copy()
    bias[2, 1, 149] = -np.inf  # (one row sees a column fewer: the sequence reads as far as its rows reach)
    past = np.arange(slots)[None, None, :, None] >= seen[:, None, None, None]
    attend = jax.jit(_kernels.decode_attention, static_argnums=4)
    finite = np.asarray(attend(q, k, v, bias, 0.5))
    unread = np.asarray(attend(q, np.where(past, np.nan, k), np.where(past, np.nan, v), bias, 0.5))
    np.testing.assert_array_equal(unread, finite)
    scores = np.einsum("bhrd,bhsd->bhrs", q.astype(np.float64), k.astype(np.float64)) * 0.5
    weights = np.exp(scores + bias[:, None, np.arange(rows) % length])
    expected = np.einsum("bhrs,bhsd->bhrd", weights / weights.sum(-1, keepdims=True), v.astype(np.float64))
    np.testing.assert_allclose(finite, expected, rtol=0, atol=MATMUL.atol)


def test_attention_kernel_reads_its_sequences_rows_and_columns_of_a_larger_cache_where_they_lie(kernels):
    # A slot decode in place: 3 query sequences over the leading rows and 40 leading columns of a cache
    # of 5 rows x 64 columns. Rows and columns past those (NaN) are never read, and the result is the
    # same to the bit as over those rows and columns sliced out.
    batch, heads, rows, depth, columns, cache_rows, cache_columns = 3, 2, 2, 16, 40, 5, 64
    rng = np.random.default_rng(11)
    q = rng.standard_normal((batch, heads, rows, depth), np.float32)
    k = rng.standard_normal((cache_rows, heads, cache_columns, depth), np.float32)
    v = rng.standard_normal((cache_rows, heads, cache_columns, depth), np.float32)
    bias = np.where(np.arange(columns)[None, None, :] < np.array([5, 40, 23])[:, None, None], 0.0, -np.inf)
    bias = np.broadcast_to(bias.astype(np.float32), (batch, 1, columns))
    outside = (np.arange(cache_rows)[:, None, None, None] >= batch) | (
        np.arange(cache_columns)[None, None, :, None] >= columns
    )
    sliced = jax.jit(_kernels.decode_attention, static_argnums=4)(
        q, k[:batch, :, :columns], v[:batch, :, :columns], bias, 0.25
    )
    whole = jax.jit(_kernels.decode_attention, static_argnums=(4, 5))(
        q, np.where(outside, np.nan, k), np.where(outside, np.nan, v), bias, 0.25, cache_columns
    )
    np.testing.assert_array_equal(np.asarray(whole), np.asarray(sliced))


def test_attention_kernel_reads_no_column_past_each_sequences_used_ones(kernels):
    # Sequences of 5, 40 and 23 columns of 64, their keys and values NaN past those: the kernel reads
    # each one's columns up to `used` (given, as the slot decode gives each row's position + 1, or
    # found from the bias), never past it, and gives each sequence's attention over its own columns.
    batch, heads, rows, depth, columns = 3, 2, 2, 16, 64
    lengths = np.array([5, 40, 23], np.int32)
    rng = np.random.default_rng(5)
    q = rng.standard_normal((batch, heads, rows, depth), np.float32)
    k = rng.standard_normal((batch, heads, columns, depth), np.float32)
    v = rng.standard_normal((batch, heads, columns, depth), np.float32)
    past = np.arange(columns)[None, None, :, None] >= lengths[:, None, None, None]
    bias = np.where(past[:, :, :, 0], -np.inf, 0.0).astype(np.float32)  # [B, 1, S]
    attend = jax.jit(_kernels.decode_attention, static_argnums=(4, 5))
    given = attend(q, np.where(past, np.nan, k), np.where(past, np.nan, v), bias, 0.25, None, jnp.asarray(lengths))
    found = attend(q, np.where(past, np.nan, k), np.where(past, np.nan, v), bias, 0.25)
    np.testing.assert_array_equal(np.asarray(_kernels.used_columns(bias)), lengths)
    for b, n in enumerate(lengths):
        alone = attend(q[b : b + 1], k[b : b + 1, :, :n], v[b : b + 1, :, :n], bias[b : b + 1, :, :n], 0.25)
        np.testing.assert_array_equal(np.asarray(given[b]), np.asarray(alone[0]))
        np.testing.assert_array_equal(np.asarray(found[b]), np.asarray(alone[0]))


def test_attention_reads_a_slot_caches_leading_rows_and_columns_inside_its_context(kernels):
    # torch's attention over queries of 2 rows and a mask of 40 columns, given keys of 5 rows x 64
    # columns: inside `reading_in_place` (the slot decode's step) it attends over the keys' leading
    # rows and columns, as torch's over them sliced out.
    rng = np.random.default_rng(3)
    q = torch.from_numpy(rng.standard_normal((2, 4, 1, 8), np.float32))
    k = torch.from_numpy(rng.standard_normal((5, 2, 64, 8), np.float32))
    v = torch.from_numpy(rng.standard_normal((5, 2, 64, 8), np.float32))
    mask = torch.arange(40)[None, None, None, :] <= torch.tensor([7, 39])[:, None, None, None]
    want = torch.nn.functional.scaled_dot_product_attention(
        q, k[:2, :, :40], v[:2, :, :40], attn_mask=mask, enable_gqa=True
    )

    def attend(q, k, v, mask):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)

    env = environment("cpu")
    with cpu_ops.reading_in_place():
        got = run(env, attend, q, k, v, mask, jit=True)
    torch.testing.assert_close(got, want, rtol=0, atol=MATMUL.atol)
    # Told each row's columns (the slot decode gives its positions + 1), the kernel reads those and no
    # more: told 4 for row 0 (its mask allows 8), it attends over row 0's first 4 keys alone.
    with cpu_ops.reading_in_place(jnp.asarray([4, 40], jnp.int32)):
        got = run(env, attend, q, k, v, mask, jit=True)
    first = torch.nn.functional.scaled_dot_product_attention(q[:1], k[:1, :, :4], v[:1, :, :4], enable_gqa=True)
    torch.testing.assert_close(got[:1], first, rtol=0, atol=MATMUL.atol)
    torch.testing.assert_close(got[1:], want[1:], rtol=0, atol=MATMUL.atol)


# -- convolution (channels-last) ----------------------------------------------------

CONV_CASES = {
    "2d": (torch.nn.Conv2d, dict(in_channels=6, out_channels=8, kernel_size=3, padding=1), (2, 6, 9, 7)),
    "2d_strided_dilated_grouped": (
        torch.nn.Conv2d,
        dict(in_channels=6, out_channels=4, kernel_size=3, stride=2, dilation=2, padding=2, groups=2),
        (2, 6, 11, 10),
    ),
    "2d_no_bias_unbatched": (
        torch.nn.Conv2d,
        dict(in_channels=3, out_channels=5, kernel_size=(1, 3), bias=False),
        (3, 8, 8),
    ),
    "1d_depthwise": (
        torch.nn.Conv1d,
        dict(in_channels=4, out_channels=4, kernel_size=4, padding=3, groups=4),
        (2, 4, 10),
    ),
    "3d": (torch.nn.Conv3d, dict(in_channels=2, out_channels=3, kernel_size=2, stride=(1, 2, 1)), (1, 2, 5, 6, 4)),
    "2d_transposed": (
        torch.nn.ConvTranspose2d,
        dict(in_channels=4, out_channels=3, kernel_size=3, stride=2),
        (2, 4, 5, 5),
    ),
}


@jit_modes
@pytest.mark.parametrize("case", CONV_CASES)
def test_convolution_matches_torch(env, case, jit):
    layer, kwargs, shape = CONV_CASES[case]
    torch.manual_seed(SEED)
    conv = layer(**kwargs).eval()
    x = torch.randn(*shape)
    weight, bias = conv.weight.detach(), None if conv.bias is None else conv.bias.detach()
    expected = conv(x).detach()

    def apply(x, weight, bias):
        return torch.func.functional_call(
            conv, {"weight": weight, "bias": bias} if bias is not None else {"weight": weight}, (x,)
        )

    actual = run(env, apply, x, weight, bias, jit=jit)
    _assert_close(actual, expected, MATMUL)


def test_convolution_in_a_loop_runs_channels_last(env):
    # XLA:CPU keeps a channels-first convolution channels-first inside a while loop (and runs
    # its generic, ~80x slower convolution); the override hands it channels-last.
    torch.manual_seed(SEED)
    conv = torch.nn.Conv2d(4, 4, 3, padding=1).eval()
    weight, bias = to_jax(env, (conv.weight.detach(), conv.bias.detach()))

    def body(_, x):
        with env:
            out = torch.nn.functional.conv2d(torchax.tensor.Tensor(x, env), weight, bias, padding=1)
        return out.jax()

    x = jax.numpy.ones((1, 4, 8, 8))
    text = jax.jit(lambda x: jax.lax.fori_loop(0, 3, body, x)).lower(x).compile().as_text()
    labels = [line.split("dim_labels=")[1].split(",")[0] for line in text.splitlines() if "dim_labels=" in line]
    assert labels and all(label.startswith("b01f") for label in labels), labels


def _stored_copy(conv: torch.nn.Module) -> torch.nn.Module:
    stored = copy.deepcopy(conv)
    cpu_ops.store_convolutions_channels_last(stored)
    return stored


@pytest.mark.parametrize("case", CONV_CASES)
def test_convolution_weights_held_channels_last_match_torch(case):
    layer, kwargs, shape = CONV_CASES[case]
    torch.manual_seed(SEED)
    conv = layer(**kwargs).eval()
    x = torch.randn(*shape)
    stored = _stored_copy(conv)
    params, _ = _compile.module_state(stored)
    if conv.transposed:
        assert set(params) == set(dict(conv.named_parameters())), "transposed convolutions keep torch's layout"
    else:
        kernel = tuple(conv.weight.shape[2:])
        assert params["parametrizations.weight.original"].shape == (*kernel, *conv.weight.shape[1::-1])
    actual = hfjax.jit(stored)(x)
    _assert_close(torch.from_numpy(np.array(actual)), conv(x).detach(), MATMUL)


def test_convolution_weights_held_channels_last_are_not_copied_per_call():
    # The trace un-permutes the held weight and the lowering permutes it back: XLA folds the
    # pair, so the compiled program transposes only the activations.
    torch.manual_seed(SEED)
    conv = torch.nn.Conv2d(8, 16, 3, padding=1).eval()
    x = torch.randn(2, 8, 6, 6)

    def transposes(module):
        text = hfjax.jit(module).lower("forward", x).compile().as_text()
        return sum(" transpose(" in line for line in text.splitlines())

    assert transposes(_stored_copy(conv)) < transposes(conv)
    assert cpu_ops.store_convolutions_channels_last(_stored_copy(conv)) == 0, "a held weight is not held twice"


PARITY_TESTS = {
    torch.ops.aten.convolution: test_convolution_matches_torch,
    torch.nn.functional.linear: test_linear_matches_torch,
    torch.ops.aten.linear: test_linear_matches_torch,
    torch.nn.functional.scaled_dot_product_attention: test_scaled_dot_product_attention_matches_torch,
    torch.ops.aten.scaled_dot_product_attention: test_scaled_dot_product_attention_matches_torch,
    torch.ops.aten.index_copy: test_index_copy_matches_torch,
    torch.ops.aten.index_copy_: test_index_copy_matches_torch,
    torch.ops.hfjax.quantized_linear: test_quantization.test_cpu_kernel_matches_the_dequantized_product,
}


def test_every_cpu_override_has_a_reason_and_a_parity_test():
    registered = {entry.op: entry for entry in _ops.registered() if entry.backend == "cpu"}
    assert set(registered) == set(PARITY_TESTS), (
        f"overrides without a parity test: {set(registered) - set(PARITY_TESTS)}; "
        f"tests of overrides that no longer exist: {set(PARITY_TESTS) - set(registered)}"
    )
    assert all(entry.why.strip() for entry in registered.values())


def test_the_cpu_overrides_take_precedence_where_the_hook_is_active(env):
    for op, entry in _ops.overrides("cpu").items():
        assert env._ops[op].func is entry.impl, f"{op} is not installed"
    assert _ops.overrides("cpu")[torch.ops.aten.index_copy].backend == "cpu"
    assert torch.ops.aten.index_copy not in _ops.overrides(None)


# -- huge pages ----------------------------------------------------------------------


def _huge_bytes_around(address: int) -> int:
    """AnonHugePages of the mapping of this process that holds `address`, in bytes."""
    found, huge = False, 0
    for line in pathlib.Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            low, high = (int(part, 16) for part in head.split("-"))
            found = low <= address < high
        elif found and head == "AnonHugePages:":
            huge = int(line.split()[1]) * 1024
    return huge


def _linux_collapses_pages() -> bool:
    """Whether this machine lets a process ask for 2 MB pages (Linux 6.1+, THP not off)."""
    if platform.system() != "Linux":
        return False
    release = tuple(int(part) for part in re.findall(r"\d+", platform.release())[:2])
    try:
        setting = pathlib.Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return False
    return release >= (6, 1) and "[never]" not in setting


def test_weights_move_to_huge_pages_with_their_values(monkeypatch):
    weight = jax.random.normal(jax.random.key(0), (4096, 2048))  # 32 MB that XLA allocated
    before = np.asarray(weight).copy()
    monkeypatch.delenv("HFJAX_HUGE_PAGES", raising=False)
    assert _pages.huge_pages([weight]) == 0  # opt-in
    monkeypatch.setenv("HFJAX_HUGE_PAGES", "0")
    assert _pages.huge_pages([weight]) == 0
    monkeypatch.setenv("HFJAX_HUGE_PAGES", "1")
    moved = _pages.huge_pages([weight])
    np.testing.assert_array_equal(np.asarray(weight), before)
    if not _linux_collapses_pages():
        assert moved == 0
        pytest.skip("this machine does not let a process ask for 2 MB pages (Linux 6.1+, THP on)")
    for _ in range(3):  # Linux may have no free 2 MB page at the moment (memory fragmented by other work)
        if moved or ctypes.get_errno() not in (errno.EAGAIN, errno.ENOMEM):
            break
        time.sleep(1.0)
        moved = _pages.huge_pages([weight])
    if moved == 0 and ctypes.get_errno() in (errno.EAGAIN, errno.ENOMEM):
        pytest.skip(f"Linux found no free 2 MB pages to collapse into ({errno.errorcode[ctypes.get_errno()]}, 4 tries)")
    assert weight.nbytes - 2 * (2 << 20) <= moved <= weight.nbytes  # every whole 2 MB page inside it
    assert _huge_bytes_around(weight.unsafe_buffer_pointer() + weight.nbytes // 2) >= moved


# -- the decode loop's cache layout ----------------------------------------------------


def test_the_loop_carries_the_cache_without_size_one_axes_and_gives_it_back():
    cache = {"keys": jax.numpy.ones((1, 2, 8, 4)), "step": jax.numpy.zeros((1,), jax.numpy.int32)}
    carried, restore = cpu.Cpu().loop_carry(cache)
    assert carried["keys"].shape == (2, 8, 4) and carried["step"].shape == ()
    back = restore(carried)
    assert back["keys"].shape == (1, 2, 8, 4) and back["step"].shape == (1,)
    generic, identity = bridge.Backend().loop_carry(cache)
    assert generic is cache and identity(cache) is cache
