"""Parity tests for hfjax's op overrides (src/hfjax/_ops.py).

Each override runs through torchax, eagerly and under `jax.jit`, and is compared with the
same op run by PyTorch on the CPU. Model-level tests run tiny Hugging Face models that hit
the override and compare their logits with the same model run by PyTorch.
"""

from __future__ import annotations

import concurrent.futures
import copy
import os
import platform
import shutil

import jax
import numpy as np
import pytest
import torch
import torchax
import transformers
from torchax.interop import jax_jit

import hfjax
from hfjax import _compile, _cpu_kernels, _ops

# fp32 GEMMs: XLA and ATen sum the same products in a different order.
MATMUL_ATOL = 1e-5
# Logits of a whole tiny fp32 model: reordered reductions compound over its layers.
LOGITS_ATOL = 1e-4
# Copies, index searches, boolean reductions and integer math must match bit for bit.
EXACT = 0.0
# A noise schedule computed in float32 by jax against float64 numpy in diffusers.
SCHEDULE_RTOL = 1e-5

SEED = 0


@pytest.fixture(scope="module")
def env():
    environment = torchax.default_env()
    _ops.install(environment)
    return environment


def _to_jax(env, value):
    # value: a CPU tensor, or a pytree of them
    with env:
        return torch.utils._pytree.tree_map_only(torch.Tensor, lambda t: t.to("jax"), value)


def _to_cpu(value):
    # value: torchax Tensors or Views (CPU tensors pass through), or a pytree of them
    def to_cpu(t):
        return t if t.device.type == "cpu" else torch.from_numpy(np.array(t.jax()))

    return torch.utils._pytree.tree_map_only(torch.Tensor, to_cpu, value)


def _run(env, fn, *cpu_args, jit: bool):
    """Runs `fn` on torchax copies of `cpu_args`, eagerly or under jax.jit; returns CPU tensors."""
    args = _to_jax(env, cpu_args)
    with env:
        out = jax_jit(fn)(*args) if jit else fn(*args)
    return _to_cpu(out)


def _assert_close(actual, expected, atol, rtol=0.0):
    assert actual.shape == expected.shape, f"shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    torch.testing.assert_close(actual, expected, atol=atol, rtol=rtol, check_dtype=False)


jit_modes = pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])


# -- aten::_grouped_mm ---------------------------------------------------------

# Offsets with an empty group, and with rows past the last offset that every layout ignores.
OFFS = [2, 2, 5]


def _grouped_mm_case(layout: str):
    """(mat_a, mat_b, offs, valid): valid indexes the part of the output torch defines."""
    generator = torch.Generator().manual_seed(SEED)
    randn = lambda *shape: torch.randn(*shape, generator=generator)  # noqa: E731
    offs = torch.tensor(OFFS, dtype=torch.int32)
    if layout == "2d_3d":  # [M, K] rows grouped @ [G, K, N] -> [M, N]
        return randn(7, 8), randn(3, 8, 4), offs, (slice(0, OFFS[-1]),)
    if layout == "3d_3d":  # [G, M, K] @ [G, K, N] -> [G, M, N]
        return randn(3, 4, 8), randn(3, 8, 4), None, (...,)
    if layout == "2d_2d":  # [M, K] @ [K, N], K grouped -> [G, M, N]
        return randn(4, 8), randn(8, 4), offs, (...,)
    if layout == "3d_2d":  # [G, M, K] @ [K, N] columns grouped -> [M, N]
        return randn(3, 4, 8), randn(8, 8), offs, (slice(None), slice(0, OFFS[-1]))
    raise ValueError(f"unknown layout {layout!r}")


@jit_modes
@pytest.mark.parametrize("layout", ["2d_3d", "3d_3d", "2d_2d", "3d_2d"])
def test_grouped_mm_matches_torch(env, layout, jit):
    mat_a, mat_b, offs, valid = _grouped_mm_case(layout)
    expected = torch._grouped_mm(mat_a, mat_b, offs=offs)
    actual = _run(env, lambda a, b, o: torch._grouped_mm(a, b, offs=o), mat_a, mat_b, offs, jit=jit)
    _assert_close(actual[valid], expected[valid], MATMUL_ATOL)


def test_grouped_mm_zeroes_rows_past_last_offset(env):
    mat_a, mat_b, offs, _ = _grouped_mm_case("2d_3d")
    actual = _run(env, lambda a, b, o: torch._grouped_mm(a, b, offs=o), mat_a, mat_b, offs, jit=True)
    assert actual.shape == (mat_a.shape[0], mat_b.shape[-1])
    assert torch.count_nonzero(actual[OFFS[-1] :]) == 0


def test_grouped_mm_rejects_bias(env):
    mat_a, mat_b, offs, _ = _grouped_mm_case("2d_3d")
    bias = torch.zeros(3, 4)
    with pytest.raises(NotImplementedError, match="bias"):
        _run(env, lambda a, b, o, c: torch._grouped_mm(a, b, offs=o, bias=c), mat_a, mat_b, offs, bias, jit=False)


def _tiny_mixtral():
    torch.manual_seed(SEED)
    config = transformers.MixtralConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=64,
    )
    return transformers.MixtralForCausalLM(config).eval()


def test_mixtral_logits_match_torch_under_jit(env):
    model = _tiny_mixtral()
    assert model.config._experts_implementation == "grouped_mm", "the test must exercise grouped_mm"
    input_ids = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(SEED))  # [B, S]
    with torch.no_grad():
        expected = model(input_ids).logits  # [B, S, V]
        with env:
            model.to("jax")
        actual = _run(env, lambda ids: model(ids).logits, input_ids, jit=True)
    _assert_close(actual, expected, LOGITS_ATOL)


# -- aten::copy_ ---------------------------------------------------------------


def _copy_into_row_slice(dst, src):
    dst[1:3].copy_(src[:2, -4:])  # View <- View, the mamba conv-state update
    return dst


def _copy_into_select(dst, src):
    dst[2].copy_(src[0, :4])  # View of one row <- View
    return dst


def _copy_into_nested_view(dst, src):
    dst[1:][:, 0].copy_(src[0, :3])  # View of a View <- View
    return dst


def _copy_broadcast(dst, src):
    dst[:, 1:3].copy_(src[:1, :2])  # [4, 2] <- [1, 2] broadcast
    return dst


def _copy_cast(dst, src):
    dst[0].copy_((src[0, :4] * 10).to(torch.int32))  # int32 source cast to the float destination
    return dst


def _copy_whole_tensor_from_view(dst, src):
    dst.copy_(src[:, 2:6])  # Tensor <- View
    return dst


COPY_CASES = [
    _copy_into_row_slice,
    _copy_into_select,
    _copy_into_nested_view,
    _copy_broadcast,
    _copy_cast,
    _copy_whole_tensor_from_view,
]


@jit_modes
@pytest.mark.parametrize("copy", COPY_CASES, ids=lambda f: f.__name__.removeprefix("_copy_"))
def test_copy_matches_torch(env, copy, jit):
    generator = torch.Generator().manual_seed(SEED)
    dst = torch.randn(4, 4, generator=generator)
    src = torch.randn(4, 6, generator=generator)
    expected = copy(dst.clone(), src)
    actual = _run(env, copy, dst, src, jit=jit)
    _assert_close(actual, expected, EXACT)


def test_copy_from_cpu_tensor_and_to_cpu_tensor(env):
    host = torch.arange(8.0).reshape(2, 4)
    device = _to_jax(env, torch.zeros(4, 4))
    with env:
        device[1:3].copy_(host)  # View <- CPU tensor
        back = torch.zeros(2, 4)
        back.copy_(device[1:3])  # CPU tensor <- View
    expected = torch.zeros(4, 4)
    expected[1:3] = host
    _assert_close(_to_cpu(device), expected, EXACT)
    _assert_close(back, host, EXACT)


def _tiny_mamba():
    torch.manual_seed(SEED)
    config = transformers.MambaConfig(
        vocab_size=128,
        hidden_size=32,
        state_size=8,
        num_hidden_layers=2,
        intermediate_size=64,
        conv_kernel=4,
        time_step_rank=4,
    )
    return transformers.MambaForCausalLM(config).eval()


@jit_modes
def test_mamba_cached_decode_logits_match_torch(env, jit):
    model = _tiny_mamba()
    generator = torch.Generator().manual_seed(SEED)
    prompt = torch.randint(0, 128, (2, 6), generator=generator)  # [B, S]
    next_token = torch.randint(0, 128, (2, 1), generator=generator)  # [B, 1]

    def prefill_then_decode(prompt, next_token):
        prefill = model(prompt, use_cache=True)
        decode = model(next_token, cache_params=prefill.cache_params, use_cache=True)
        return prefill.logits, decode.logits  # [B, S, V], [B, 1, V]

    with torch.no_grad():
        expected = prefill_then_decode(prompt, next_token)
        with env:
            model.to("jax")
        actual = _run(env, prefill_then_decode, prompt, next_token, jit=jit)
    for got, want in zip(actual, expected, strict=True):
        _assert_close(got, want, LOGITS_ATOL)


# -- aten::_is_all_true, aten::_is_any_true ------------------------------------

BOOL_CASES = {
    "all_true": torch.ones(3, 4, dtype=torch.bool),
    "one_false": torch.ones(3, 4, dtype=torch.bool).index_fill(1, torch.tensor([2]), False),
    "all_false": torch.zeros(5, dtype=torch.bool),
    "empty": torch.ones(0, dtype=torch.bool),
    "scalar_false": torch.tensor(False),
}


@jit_modes
@pytest.mark.parametrize("name", BOOL_CASES)
@pytest.mark.parametrize("op", ["_is_all_true", "_is_any_true"])
def test_is_all_true_and_is_any_true_match_torch(env, op, name, jit):
    x = BOOL_CASES[name]
    expected = getattr(x, op)()
    actual = _run(env, lambda t: getattr(t, op)(), x, jit=jit)
    assert actual.dtype == torch.bool
    _assert_close(actual, expected, EXACT)


def _check_tensor_all_raises(cond) -> bool:
    try:
        torch._check_tensor_all_with(ValueError, cond, lambda: "bad position ids")
    except ValueError:
        return True
    return False


@pytest.mark.parametrize("name", BOOL_CASES)
def test_check_tensor_all_raises_like_torch(env, name):
    # transformers' torch_compilable_check (prophetnet's cached decode) takes this path.
    x = BOOL_CASES[name]
    with env:
        raises_on_jax = _check_tensor_all_raises(x.to("jax"))
    assert raises_on_jax == _check_tensor_all_raises(x)


# -- aten::searchsorted.Tensor, aten::searchsorted.Scalar ----------------------

# Ties (2.0, 0.0) make left and right differ; values fall before, on, between and after them.
SORTED_1D = torch.tensor([-1.0, 0.0, 2.0, 2.0, 3.5, 7.0])
VALUES_1D = torch.tensor([[-5.0, 0.0, 2.0], [2.5, 7.0, 9.0]])
SORTED_2D = torch.tensor([[1.0, 2.0, 2.0, 3.0], [0.0, 0.0, 5.0, 6.0]])
VALUES_2D = torch.tensor([[2.0, 2.5, 0.0], [0.0, 7.0, 5.0]])
SIDES = [
    {},
    {"right": True},
    {"side": "left"},
    {"side": "right"},
    {"side": "right", "right": True},
]


@jit_modes
@pytest.mark.parametrize("sides", SIDES, ids=lambda kw: "-".join(f"{k}={v}" for k, v in kw.items()) or "default")
@pytest.mark.parametrize("case", ["1d", "2d", "1d_sorter", "2d_sorter"])
def test_searchsorted_tensor_matches_torch(env, case, sides, jit):
    sequence, values = (SORTED_1D, VALUES_1D) if case.startswith("1d") else (SORTED_2D, VALUES_2D)
    kwargs = dict(sides)
    args = (sequence, values)
    if case.endswith("sorter"):
        generator = torch.Generator().manual_seed(SEED)
        permutation = torch.randperm(sequence.shape[-1], generator=generator).expand_as(sequence)
        shuffled = torch.gather(sequence, -1, permutation)
        args = (shuffled, values, torch.argsort(shuffled, dim=-1, stable=True))

    def search(sequence, values, sorter=None):
        return torch.searchsorted(sequence, values, sorter=sorter, **kwargs)

    expected = search(*args)
    actual = _run(env, search, *args, jit=jit)
    _assert_close(actual, expected, EXACT)


@jit_modes
@pytest.mark.parametrize("sides", SIDES, ids=lambda kw: "-".join(f"{k}={v}" for k, v in kw.items()) or "default")
@pytest.mark.parametrize("value", [-5.0, 0.0, 2.0, 2.5, 9.0, float("-inf")])
def test_searchsorted_scalar_matches_torch(env, value, sides, jit):
    expected = torch.searchsorted(SORTED_1D, value, **sides)
    actual = _run(env, lambda sequence: torch.searchsorted(sequence, value, **sides), SORTED_1D, jit=jit)
    _assert_close(actual, expected, EXACT)


def test_searchsorted_out_int32(env):
    expected = torch.searchsorted(SORTED_1D, VALUES_1D, out_int32=True)
    actual = _run(env, lambda s, v: torch.searchsorted(s, v, out_int32=True), SORTED_1D, VALUES_1D, jit=True)
    assert actual.dtype == torch.int32
    _assert_close(actual, expected, EXACT)


def test_searchsorted_rejects_opposite_sides(env):
    with pytest.raises(ValueError, match="contradict"):
        _run(env, lambda s, v: torch.searchsorted(s, v, side="left", right=True), SORTED_1D, VALUES_1D, jit=False)


def test_dpm_solver_set_timesteps_matches_torch(env):
    diffusers = pytest.importorskip("diffusers")
    # lambda_min_clipped=-3 clips the schedule (searchsorted gives 32, not 0), so the search counts.
    settings = dict(beta_schedule="squaredcos_cap_v2", lambda_min_clipped=-3.0)
    expected = diffusers.DPMSolverMultistepScheduler(**settings)
    expected.set_timesteps(10)
    with env, torch.device("jax"):
        actual = diffusers.DPMSolverMultistepScheduler(**settings)
        assert actual.lambda_t.device.type == "jax", "the test must search a jax tensor"
        actual.set_timesteps(10)
    _assert_close(_to_cpu(actual.timesteps), expected.timesteps, EXACT)
    _assert_close(_to_cpu(actual.sigmas), expected.sigmas, EXACT, rtol=SCHEDULE_RTOL)


# -- Tensor.__getitem__ with tensor slice bounds -------------------------------


@pytest.mark.parametrize(
    "index",
    [
        lambda n: (slice(None), slice(None, n)),
        lambda n: slice(n, None),
        lambda n: (slice(1, None), slice(n, None, n)),
    ],
    ids=["stop", "start", "start_and_step"],
)
def test_getitem_with_tensor_slice_bound_matches_torch(env, index):
    x = torch.arange(30.0).reshape(5, 6)
    bound = torch.tensor(2)

    def slice_then_add(x, bound):
        return x[index(bound)] + 1

    expected = slice_then_add(x, bound)
    actual = _run(env, slice_then_add, x, bound, jit=False)  # the bound sets a shape: no jit
    _assert_close(actual, expected, EXACT)


# -- aten::pow on integers -----------------------------------------------------

POW_BASE = torch.tensor([2, -3, 0, 1, 5, 1000003, -1, -1, 7], dtype=torch.int32)
POW_EXPONENT = torch.tensor([3, 2, 0, -1, -2, 2, -3, -2, 11], dtype=torch.int32)


@jit_modes
@pytest.mark.parametrize(
    "power",
    [
        lambda x, y: x**y,  # wraps (1000003**2, 7**11) and negative exponents
        lambda x, y: x**3,
        lambda x, y: 3 ** y.abs(),
        lambda x, y: x.float() ** y,  # float bases still go to torchax's own lowering
    ],
    ids=["tensor_tensor", "tensor_scalar", "scalar_tensor", "float_base"],
)
def test_integer_pow_matches_torch(env, power, jit):
    expected = power(POW_BASE, POW_EXPONENT)
    actual = _run(env, power, POW_BASE, POW_EXPONENT, jit=jit)
    _assert_close(actual, expected, EXACT)


def test_blt_logits_match_torch_with_x64(env):
    # BLT hashes bytes with int64 rolling polynomials (integer pow, wrapping) and slices its
    # patches with a tensor bound; int64 needs jax x64. Its patching is data-dependent: no jit.
    torch.manual_seed(SEED)
    local = dict(hidden_size=32, num_attention_heads=2, num_hidden_layers=1, intermediate_size=64, vocab_size=260)
    config = transformers.BltConfig(
        vocab_size=260,
        encoder_hash_byte_group_vocab=97,
        encoder_hash_byte_group_size=[3, 4],
        patch_size=4,
        patcher_config=local,
        encoder_config=dict(local, hidden_size_global=64),
        decoder_config=dict(local, hidden_size_global=64),
        global_config=dict(hidden_size=64, num_attention_heads=2, num_hidden_layers=1, intermediate_size=64),
        local_attention_window_len=16,
        max_position_embeddings=64,
    )
    model = transformers.BltForCausalLM(config).eval()
    input_ids = torch.randint(4, 260, (2, 8), generator=torch.Generator().manual_seed(SEED))  # [B, S]
    with torch.no_grad():
        expected = model(input_ids, use_cache=False).logits  # [B, S, V]
        with jax.enable_x64(True):
            with env:
                model.to("jax")
            actual = _run(env, lambda ids: model(ids, use_cache=False).logits, input_ids, jit=False)
    _assert_close(actual, expected, LOGITS_ATOL)


# -- the registry --------------------------------------------------------------

# -- scaled_dot_product_attention ----------------------------------------------------


def _attention_case(case: str):
    """(query, key, value, kwargs) for torch's scaled_dot_product_attention."""
    generator = torch.Generator().manual_seed(SEED)
    randn = lambda *shape: torch.randn(*shape, generator=generator)  # noqa: E731
    q, k, v = randn(2, 4, 5, 8), randn(2, 4, 6, 8), randn(2, 4, 6, 8)
    padding = torch.ones(2, 1, 5, 6, dtype=torch.bool)
    padding[0, :, :, :3] = False  # row 0: three padded keys ...
    padding[0, :, 0] = False  # ... and a query that may attend to nothing (torch gives zeros)
    if case == "bool_mask_with_empty_rows":
        return q, k, v, dict(attn_mask=padding)
    if case == "float_mask":
        return q, k, v, dict(attn_mask=torch.zeros(2, 1, 5, 6).masked_fill(~padding, float("-inf")))
    if case == "causal":
        return q, k[:, :, :5], v[:, :, :5], dict(is_causal=True)
    if case == "grouped_query":  # 4 query heads over 2 key/value heads: 10 rows per key/value head
        return q, k[:, :2], v[:, :2], dict(attn_mask=padding, enable_gqa=True, scale=0.3)
    if case == "grouped_decode":  # one new token per row: 2 rows per key/value head, an empty one in row 0
        return q[:, :, :1], k[:, :2], v[:, :2], dict(attn_mask=padding[:, :, :1], enable_gqa=True)
    if case == "decode_odd_sizes":  # batch 1, 8 rows over one key/value head, 37 slots, head sizes 40 and 24
        mask = torch.rand(1, 1, 1, 37, generator=generator) > 0.3
        return randn(1, 8, 1, 40), randn(1, 1, 37, 40), randn(1, 1, 37, 24), dict(attn_mask=mask, enable_gqa=True)
    if case == "mask_per_head":  # a different mask for each query head
        mask = torch.rand(2, 4, 1, 6, generator=generator) > 0.4
        return q[:, :, :1], k, v, dict(attn_mask=mask)
    raise ValueError(f"unknown case {case!r}")


@jit_modes
@pytest.mark.parametrize(
    "case", ["bool_mask_with_empty_rows", "float_mask", "causal", "grouped_query", "grouped_decode", "decode_odd_sizes",
             "mask_per_head"]
)
def test_scaled_dot_product_attention_matches_torch(env, case, jit):
    q, k, v, kwargs = _attention_case(case)
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, **kwargs)
    mask = kwargs.pop("attn_mask", None)
    attention = lambda q, k, v, mask: torch.nn.functional.scaled_dot_product_attention(  # noqa: E731
        q, k, v, attn_mask=mask, **kwargs
    )
    actual = _run(env, attention, q, k, v, mask, jit=jit)
    _assert_close(actual, expected, MATMUL_ATOL)
    assert torch.isfinite(actual).all()


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


def test_attention_of_a_few_rows_runs_in_the_cpu_kernel_where_it_is_built(env):
    kernel = _cpu_kernels.library() is not None
    assert all((_cpu_kernels.ATTENTION in _attention_program(env, *shape)) == kernel for shape in FEW_ROWS)
    assert all(("optimization_barrier" in _attention_program(env, *shape)) != kernel for shape in FEW_ROWS)
    assert not any(_cpu_kernels.ATTENTION in _attention_program(env, *shape) for shape in MANY_ROWS)
    per_head = jax.numpy.ones((1, 2, 1, 6), bool)  # a mask that differs between heads stays with XLA
    assert _cpu_kernels.ATTENTION not in _attention_program(env, 2, 1, per_head)


def test_attention_swaps_the_score_product_only_for_a_few_rows_without_the_kernel(env, monkeypatch):
    monkeypatch.setattr(_cpu_kernels, "usable", lambda *arrays: False)
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
    _assert_close(_run(env, in_place, x, index, source, jit=jit), expected, EXACT)
    functional = lambda x, index, source: torch.index_copy(x, dim, index, source)  # noqa: E731
    _assert_close(_run(env, functional, x, index, source, jit=jit), expected, EXACT)


# -- linear (operands swapped for a few rows) -----------------------------------------

LINEAR_CASES = {  # input shape; `_linear` swaps the product for 2-64 rows on the CPU
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

    _assert_close(_run(env, apply, x, params, jit=jit), layer(x).detach(), MATMUL_ATOL)
    _assert_close(_run(env, torch.ops.aten.linear, x, *params.values(), jit=jit), layer(x).detach(), MATMUL_ATOL)


def test_linear_swaps_operands_only_for_a_few_rows_on_cpu(env):
    weight = jax.numpy.ones((40, 48))

    def program(rows):
        def apply(x):
            with env:
                return torch.nn.functional.linear(torchax.tensor.Tensor(x, env), torchax.tensor.Tensor(weight, env)).jax()

        return jax.jit(apply).lower(jax.numpy.ones((rows, 48))).as_text()

    kernel = _cpu_kernels.library() is not None  # 1-8 rows go to hfjax's CPU kernel where it is built
    assert all((_cpu_kernels.PRODUCT in program(rows)) == kernel for rows in (1, 2, 8))
    assert all(("optimization_barrier" in program(rows)) != kernel for rows in (2, 8))
    assert "optimization_barrier" not in program(1)  # without the kernel, XLA's matrix-vector product
    assert all("optimization_barrier" in program(rows) for rows in (9, 64))
    assert "optimization_barrier" not in program(65) and _cpu_kernels.PRODUCT not in program(65)


# -- hfjax's CPU kernel for a few rows times a weight (_cpu_kernels.cc) ---------------


def test_cpu_kernel_is_built_where_the_machine_can_build_it():
    can_run = platform.system() == "Linux" and platform.machine() == "x86_64" and "avx512f" in _cpu_kernels._cpu_flags()
    has_compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if can_run and has_compiler and os.environ.get("HFJAX_CPU_KERNELS", "1") != "0":
        assert _cpu_kernels.compiler() is not None
    assert (_cpu_kernels.library() is not None) == (_cpu_kernels.compiler() is not None)


def _cpu_kernel_built() -> bool:
    """Whether the kernels run here; where they do not, the build test above says why, and
    there is nothing to compare."""
    if _cpu_kernels.library() is None:
        assert _cpu_kernels.compiler() is None
        return False
    return True


# rows x K x N: K not a multiple of 16 (the masked tail), N not a multiple of the weight rows
# taken at once (single rows at the end of a thread's chunk), N too small to split between
# threads, and the 150M benchmark model's shapes.
KERNEL_SHAPES = [(rows, 48, 40) for rows in range(1, 9)] + [
    (3, 771, 7), (8, 13, 1), (5, 64, 301), (1, 100, 1001), (2, 33, 263), (8, 768, 3072), (2, 3072, 768), (1, 768, 3072)]


@pytest.mark.parametrize("shape", KERNEL_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_cpu_kernel_matches_a_float64_product(shape):
    if not _cpu_kernel_built():
        return
    rows, k, n = shape
    rng = np.random.default_rng(rows * 7 + k + n)
    x, weight = rng.standard_normal((rows, k), np.float32), rng.standard_normal((n, k), np.float32)
    expected = x.astype(np.float64) @ weight.astype(np.float64).T
    got = np.asarray(jax.jit(_cpu_kernels.rows_times_weight)(x, weight))
    assert got.shape == (rows, n)
    np.testing.assert_allclose(got, expected, rtol=0, atol=MATMUL_ATOL * np.sqrt(k))


def test_cpu_kernel_products_from_several_threads_at_once_get_their_own_results():
    # Callers share the kernel's helper threads: a caller whose helper is busy with another
    # product finishes its own alone, and no caller may see another's chunks.
    if not _cpu_kernel_built():
        return
    rng = np.random.default_rng(11)
    cases = [(rng.standard_normal((rows, 96), np.float32), rng.standard_normal((4001, 96), np.float32)) for rows in (1, 3, 8, 1)]
    expected = [x.astype(np.float64) @ weight.astype(np.float64).T for x, weight in cases]
    product = jax.jit(_cpu_kernels.rows_times_weight)

    def run(case):
        return [np.asarray(product(*case)) for _ in range(40)]

    with concurrent.futures.ThreadPoolExecutor(len(cases)) as pool:
        results = list(pool.map(run, cases))
    for got, want in zip(results, expected):
        for one in got:
            np.testing.assert_allclose(one, want, rtol=0, atol=MATMUL_ATOL * np.sqrt(96))


# batch x key/value heads x query rows x slots x head size x value head size, query length:
# head sizes not a multiple of 16 (masked tails), slots not a multiple of 16, one slot, 1-8
# rows, and the 150M benchmark model at batch 8 (split between threads).
ATTENTION_SHAPES = [(1, 2, rows, 37, 40, 24, 1) for rows in range(1, 9)] + [
    (2, 3, 4, 1, 16, 16, 1), (3, 2, 6, 50, 64, 64, 2), (8, 4, 3, 192, 64, 64, 1), (1, 1, 8, 300, 128, 80, 4)]


@pytest.mark.parametrize("shape", ATTENTION_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_cpu_attention_kernel_matches_float64_attention(shape):
    if not _cpu_kernel_built():
        return
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
    got = np.asarray(jax.jit(_cpu_kernels.decode_attention, static_argnums=4)(q, k, v, bias, scale))
    assert got.shape == expected.shape
    np.testing.assert_allclose(got, expected, rtol=0, atol=MATMUL_ATOL)
    if batch > 1:
        assert not got[1].any()


# -- convolution (channels-last) ----------------------------------------------------

CONV_CASES = {
    "2d": (torch.nn.Conv2d, dict(in_channels=6, out_channels=8, kernel_size=3, padding=1), (2, 6, 9, 7)),
    "2d_strided_dilated_grouped": (
        torch.nn.Conv2d, dict(in_channels=6, out_channels=4, kernel_size=3, stride=2, dilation=2, padding=2, groups=2),
        (2, 6, 11, 10),
    ),
    "2d_no_bias_unbatched": (torch.nn.Conv2d, dict(in_channels=3, out_channels=5, kernel_size=(1, 3), bias=False), (3, 8, 8)),
    "1d_depthwise": (torch.nn.Conv1d, dict(in_channels=4, out_channels=4, kernel_size=4, padding=3, groups=4), (2, 4, 10)),
    "3d": (torch.nn.Conv3d, dict(in_channels=2, out_channels=3, kernel_size=2, stride=(1, 2, 1)), (1, 2, 5, 6, 4)),
    "2d_transposed": (torch.nn.ConvTranspose2d, dict(in_channels=4, out_channels=3, kernel_size=3, stride=2), (2, 4, 5, 5)),
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
        return torch.func.functional_call(conv, {"weight": weight, "bias": bias} if bias is not None else {"weight": weight}, (x,))

    actual = _run(env, apply, x, weight, bias, jit=jit)
    _assert_close(actual, expected, MATMUL_ATOL)


def test_convolution_in_a_loop_runs_channels_last(env):
    # XLA:CPU keeps a channels-first convolution channels-first inside a while loop (and runs
    # its generic, ~80x slower convolution); the override hands it channels-last.
    torch.manual_seed(SEED)
    conv = torch.nn.Conv2d(4, 4, 3, padding=1).eval()
    weight, bias = _to_jax(env, (conv.weight.detach(), conv.bias.detach()))

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
    _ops.store_convolutions_channels_last(stored)
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
    _assert_close(torch.from_numpy(np.array(actual)), conv(x).detach(), MATMUL_ATOL)


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
    assert _ops.store_convolutions_channels_last(_stored_copy(conv)) == 0, "a held weight is not held twice"


PARITY_TESTS = {
    torch.ops.aten._grouped_mm.default: test_grouped_mm_matches_torch,
    torch.ops.aten.copy_: test_copy_matches_torch,
    torch.ops.aten._is_all_true.default: test_is_all_true_and_is_any_true_match_torch,
    torch.ops.aten._is_any_true.default: test_is_all_true_and_is_any_true_match_torch,
    torch.ops.aten.searchsorted.Tensor: test_searchsorted_tensor_matches_torch,
    torch.ops.aten.searchsorted.Scalar: test_searchsorted_scalar_matches_torch,
    torch.Tensor.__getitem__: test_getitem_with_tensor_slice_bound_matches_torch,
    torch.ops.aten.pow: test_integer_pow_matches_torch,
    torch.nn.functional.scaled_dot_product_attention: test_scaled_dot_product_attention_matches_torch,
    torch.ops.aten.scaled_dot_product_attention: test_scaled_dot_product_attention_matches_torch,
    torch.ops.aten.convolution: test_convolution_matches_torch,
    torch.nn.functional.linear: test_linear_matches_torch,
    torch.ops.aten.linear: test_linear_matches_torch,
    torch.ops.aten.index_copy: test_index_copy_matches_torch,
    torch.ops.aten.index_copy_: test_index_copy_matches_torch,
}


def test_every_override_has_a_reason_and_a_parity_test():
    registered = _ops.overrides()
    assert set(registered) == set(PARITY_TESTS), (
        f"overrides without a parity test: {set(registered) - set(PARITY_TESTS)}; "
        f"tests of overrides that no longer exist: {set(PARITY_TESTS) - set(registered)}"
    )
    assert all(entry.why for entry in registered.values())


def test_install_puts_every_override_into_the_environment(env):
    for op, entry in _ops.overrides().items():
        assert env._ops[op].func is entry.impl, f"{op} is not installed"
