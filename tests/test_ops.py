"""Parity tests for hfjax's generic op overrides (src/hfjax/_ops.py).

Each override runs through torchax, eagerly and under `jax.jit`, and is compared with the
same op run by PyTorch on the CPU. Model-level tests run tiny Hugging Face models that hit
the override and compare their logits with the same model run by PyTorch. The CPU's own
overrides (`hfjax.cpu`) are tested in test_cpu.py.
"""

from __future__ import annotations

import os

import jax
import numpy as np
import pytest
import torch
import transformers

import hfjax
import test_quantization  # hfjax.quantization's op: its parity tests are there
from hfjax.bridge import _ops
from hfjax.tolerances import DEFAULT, DIVISION, EXACT, MATMUL, SCHEDULE
from op_helpers import ATTENTION_CASES, SEED, check_attention, environment, jit_modes, run, to_cpu, to_jax
from op_helpers import assert_close as _assert_close

LOGITS = DEFAULT


@pytest.fixture(scope="module")
def env():
    return environment(backend=None)


def _run(env, fn, *cpu_args, jit: bool):
    return run(env, fn, *cpu_args, jit=jit)


def _to_cpu(value):
    return to_cpu(value)


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
    _assert_close(actual[valid], expected[valid], MATMUL)


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
    _assert_close(actual, expected, LOGITS)


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
    device = to_jax(env, torch.zeros(4, 4))
    with env:
        device[1:3].copy_(host)  # View <- CPU tensor
        back = torch.zeros(2, 4)
        back.copy_(device[1:3])  # CPU tensor <- View
    expected = torch.zeros(4, 4)
    expected[1:3] = host
    _assert_close(_to_cpu(device), expected, EXACT)
    _assert_close(back, host, EXACT)


# -- aten::abs_ ----------------------------------------------------------------


def _siglip2_resize_weights(source, center, support):
    # transformers 5.24's Siglip2 antialiased resize: in-place abs, div and clamp on a temporary
    return (1 - (source - center[..., None]).abs_().div_(support[..., None])).clamp_(min=0)


def _abs_of_a_view(x, center, support):
    x[1:3].abs_()  # View, written back into x
    return x


@jit_modes
@pytest.mark.parametrize(
    "case, tolerance", [(_siglip2_resize_weights, DIVISION), (_abs_of_a_view, EXACT)], ids=["siglip2_weights", "view"]
)
def test_in_place_abs_matches_torch(env, case, tolerance, jit):
    source, center, support = _data(4, 6), _data(4), _data(4).abs() + 1
    expected = case(source.clone(), center, support)
    _assert_close(_run(env, case, source, center, support, jit=jit), expected, tolerance)


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
        _assert_close(got, want, LOGITS)


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


def test_a_check_inside_a_jit_trace_is_taken_to_hold_without_touching_the_environment(env):
    # Inside a trace the checked value is not known: the check is taken to hold (as with
    # TRANSFORMERS_DISABLE_TORCH_CHECK=1), and no environment variable is set to get there.
    before = dict(os.environ)

    def checked(x):
        torch._check_tensor_all_with(ValueError, x > 0, lambda: "bad positions")
        return x * 2

    _assert_close(_run(env, checked, torch.ones(3), jit=True), torch.full((3,), 2.0), EXACT)
    assert dict(os.environ) == before


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
    _assert_close(_to_cpu(actual.sigmas), expected.sigmas, SCHEDULE)


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


@jit_modes
@pytest.mark.parametrize("whole", [True, False], ids=["index", "in_a_tuple"])
def test_getitem_with_a_cpu_index_tensor_matches_torch(env, whole, jit):
    # SAM-style relative positions: the index comes from torch.arange made without a device
    def relative(table):
        coords = torch.arange(4)[:, None] - torch.arange(4)[None, :] + 3
        return table[coords] if whole else table[1:, coords]

    table = _data(7, 3) if whole else _data(3, 7)
    _assert_close(_run(env, relative, table, jit=jit), relative(table), EXACT)


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


LINEAR_CALLS = {
    "positional": lambda x, w, b: torch.nn.functional.linear(x, w, b),
    "keywords_as_ibert_calls_it": lambda x, w, b: torch.nn.functional.linear(x, weight=w, bias=b),
    "no_bias": lambda x, w, b: torch.nn.functional.linear(input=x, weight=w),
}


@jit_modes
@pytest.mark.parametrize("call", LINEAR_CALLS)
def test_linear_matches_torch(env, call, jit):
    x, weight, bias = _data(2, 3, 8), _data(5, 8), _data(5)
    expected = LINEAR_CALLS[call](x, weight, bias)
    _assert_close(_run(env, LINEAR_CALLS[call], x, weight, bias, jit=jit), expected, MATMUL)


@jit_modes
@pytest.mark.parametrize("size", [(5, 7), (16, 24), (9, 6)], ids=["shrink", "grow", "both"])
def test_antialiased_bilinear_resize_matches_torch(env, size, jit):
    def resize(x):
        return torch.nn.functional.interpolate(x, size=size, mode="bilinear", antialias=True, align_corners=False)

    x = _data(2, 3, 11, 12)
    _assert_close(_run(env, resize, x, jit=jit), resize(x), DEFAULT)


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
    _assert_close(actual, expected, LOGITS)


# -- the registry --------------------------------------------------------------

# -- scaled_dot_product_attention ----------------------------------------------------


@jit_modes
@pytest.mark.parametrize("case", ATTENTION_CASES)
def test_scaled_dot_product_attention_matches_torch(env, case, jit):
    check_attention(env, case, jit)


# -- values of the data: nonzero, boolean masks, masked_select, unique_consecutive, .item() ----
# A plain jax.jit cannot run these (their sizes, or Python values, depend on the data): the jit
# mode goes through hfjax.jit, which specialises the program on them (hfjax._specialize).


class _Function(torch.nn.Module):
    def __init__(self, function):
        super().__init__()
        self.function = function

    def forward(self, *args):
        return self.function(*args)


def _run_data_dependent(env, function, *args, jit: bool):
    if not jit:
        return _run(env, function, *args, jit=False)
    out = hfjax.jit(_Function(function))(*args)
    return torch.utils._pytree.tree_map(lambda a: torch.from_numpy(np.array(a)), out)


def _data(*shape):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(SEED))


NONZERO_CASES = {
    "nonzero": lambda x: torch.nonzero(x > 0),
    "where_one_argument": lambda x: torch.where(x > 0),
    "scalar": lambda x: torch.nonzero(x.sum() > -100),
    "none_true": lambda x: torch.nonzero(x > 100),
}


@jit_modes
@pytest.mark.parametrize("case", NONZERO_CASES)
def test_nonzero_matches_torch(env, case, jit):
    x = _data(3, 5)
    expected = NONZERO_CASES[case](x)
    actual = _run_data_dependent(env, NONZERO_CASES[case], x, jit=jit)
    torch.utils._pytree.tree_map(lambda a, e: _assert_close(a, e, EXACT), actual, expected)


MASK_INDEX_CASES = {
    "whole_mask": lambda x: x[x > 0],
    "rows": lambda x: x[x[:, 0, 0] > 0],
    "rows_then_slice": lambda x: x[x[:, 0, 0] > 0, 1:],
    "columns": lambda x: x[:, x[0] > 0],
    "pooling_as_t5_classifiers_do": lambda x: x[x[..., 0] > 0, :].reshape(-1, x.shape[-1])[-1],
    "ellipsis_and_none": lambda x: x[..., None, x[0, 0] > 0],
}


@jit_modes
@pytest.mark.parametrize("case", MASK_INDEX_CASES)
def test_boolean_mask_index_matches_torch(env, case, jit):
    x = _data(2, 4, 6)
    expected = MASK_INDEX_CASES[case](x)
    actual = _run_data_dependent(env, MASK_INDEX_CASES[case], x, jit=jit)
    _assert_close(actual, expected, EXACT)


@jit_modes
def test_boolean_mask_index_op_matches_torch(env, jit):
    # aten.index.Tensor itself, as decompositions and torch.ops callers reach it
    def index(x):
        return torch.ops.aten.index.Tensor(x, [None, x[0, :, 0] > 0])

    x = _data(2, 4, 6)
    _assert_close(_run_data_dependent(env, index, x, jit=jit), index(x), EXACT)


@jit_modes
@pytest.mark.parametrize("mask_shape", [(2, 4, 6), (6,)], ids=["same_shape", "broadcast"])
def test_masked_select_matches_torch(env, mask_shape, jit):
    def select(x):
        mask = x > x.mean() if mask_shape == x.shape else x[0, 0] > 0
        return torch.masked_select(x, mask)

    x = _data(2, 4, 6)
    _assert_close(_run_data_dependent(env, select, x, jit=jit), select(x), EXACT)


UNIQUE_CASES = {
    "flat": dict(),
    "inverse_and_counts": dict(return_inverse=True, return_counts=True),
    "dim0": dict(dim=0, return_inverse=True, return_counts=True),
    "dim1": dict(dim=1, return_counts=True),
}


@jit_modes
@pytest.mark.parametrize("case", UNIQUE_CASES)
def test_unique_consecutive_matches_torch(env, case, jit):
    x = torch.tensor([[1, 1, 2, 2, 2, 3], [1, 1, 2, 2, 2, 3], [4, 4, 4, 4, 5, 5], [4, 4, 4, 4, 5, 5]])

    def unique(x):
        return torch.unique_consecutive(x, **UNIQUE_CASES[case])

    expected = unique(x)
    actual = _run_data_dependent(env, unique, x, jit=jit)
    torch.utils._pytree.tree_map(lambda a, e: _assert_close(a, e, EXACT), actual, expected)


TOLIST_CASES = {
    # a slice: torchax hands it over as a View, which torch's own .tolist() refuses
    "view": lambda x: (x > 0).sum(dim=1)[1:],
    # jetmoe's router: a whole tensor, whose .tolist() is torchax's own method
    "tensor": lambda x: (x > 0).sum(dim=1),
}


@jit_modes
@pytest.mark.parametrize("case", TOLIST_CASES)
def test_tolist_matches_torch(env, case, jit):
    def sizes(x):
        return [x.new_zeros(int(n)) for n in TOLIST_CASES[case](x).tolist()]

    x = _data(3, 5)
    actual = _run_data_dependent(env, sizes, x, jit=jit)
    assert [a.shape for a in actual] == [e.shape for e in sizes(x)]


@jit_modes
def test_boolean_mask_write_into_a_view(env, jit):
    # longformer: `extended[:, :, :, 1:][attention_mask == 2] = value`, a mask write into a slice
    def write(x):
        out = x.clone()
        window = out[:, 1:]
        window[x[:, 1:] > 0] = -7.0
        window[:, :1] = x[:, :1] * 2  # a write with plain indices still goes to torchax's own
        return out

    x = _data(3, 5)
    _assert_close(_run_data_dependent(env, write, x, jit=jit), write(x), EXACT)


@jit_modes
def test_type_as_a_view_matches_torch(env, jit):
    # Gemma 3n: `normed.type_as(hidden_states[i])`, a View; `x` itself must keep its dtype
    def cast(x):
        halves = x.to(torch.float16)
        y = x.type_as(halves[0])
        return y, x * 2

    y, doubled = _run(env, cast, _data(3, 5), jit=jit)
    expected_y, expected_doubled = cast(_data(3, 5))
    assert y.dtype == torch.float16 and doubled.dtype == torch.float32
    _assert_close(y.float(), expected_y.float(), EXACT)
    _assert_close(doubled, expected_doubled, EXACT)


@jit_modes
def test_item_and_truth_values_match_torch(env, jit):
    def branch(x):
        if (x > 2).any():  # false for these data: the other branch runs
            return x + 1
        return x * x.abs().max().item()

    x = _data(3, 5)
    _assert_close(_run_data_dependent(env, branch, x, jit=jit), branch(x), EXACT)


ARANGE_CASES = {
    # led counts positions from its cache's length, a tensor: torch.arange(past, past + n)
    "tensor_bounds": lambda x: torch.arange((x > 0).sum(), (x > 0).sum() + 3, device=x.device),
    "tensor_end_only": lambda x: torch.arange((x > 0).sum(), device=x.device),
    "tensor_step_and_dtype": lambda x: torch.arange(1, 12, (x > 0).sum() // 2, dtype=torch.float32, device=x.device),
    "float_tensor_end": lambda x: torch.arange(0, x.abs().max(), 0.25, device=x.device),
    "empty": lambda x: torch.arange((x > 0).sum(), (x > 0).sum(), device=x.device),
    "python_bounds": lambda x: torch.arange(2, 9, 3, device=x.device) + x.shape[0],
}


@jit_modes
@pytest.mark.parametrize("case", ARANGE_CASES)
def test_arange_matches_torch(env, case, jit):
    x = _data(3, 5)
    expected = ARANGE_CASES[case](x)
    actual = _run_data_dependent(env, ARANGE_CASES[case], x, jit=jit)
    assert actual.dtype == expected.dtype or {actual.dtype, expected.dtype} == {torch.int32, torch.int64}
    _assert_close(actual, expected, EXACT)


PARITY_TESTS = {
    torch.arange: test_arange_matches_torch,
    torch.nn.functional.linear: test_linear_matches_torch,
    torch.ops.aten._upsample_bilinear2d_aa: test_antialiased_bilinear_resize_matches_torch,
    torch.Tensor.tolist: test_tolist_matches_torch,
    torch.ops.aten._grouped_mm.default: test_grouped_mm_matches_torch,
    torch.ops.aten.copy_: test_copy_matches_torch,
    torch.ops.aten.abs_: test_in_place_abs_matches_torch,
    torch.ops.aten._is_all_true.default: test_is_all_true_and_is_any_true_match_torch,
    torch.ops.aten._is_any_true.default: test_is_all_true_and_is_any_true_match_torch,
    torch.ops.aten.searchsorted.Tensor: test_searchsorted_tensor_matches_torch,
    torch.ops.aten.searchsorted.Scalar: test_searchsorted_scalar_matches_torch,
    torch.Tensor.__getitem__: test_getitem_with_tensor_slice_bound_matches_torch,
    torch.ops.aten.pow: test_integer_pow_matches_torch,
    torch.nn.functional.scaled_dot_product_attention: test_scaled_dot_product_attention_matches_torch,
    torch.ops.aten.scaled_dot_product_attention: test_scaled_dot_product_attention_matches_torch,
    torch.ops.aten._local_scalar_dense: test_item_and_truth_values_match_torch,
    torch.ops.aten.nonzero: test_nonzero_matches_torch,
    torch.ops.aten.index.Tensor: test_boolean_mask_index_op_matches_torch,
    torch.ops.aten.masked_select: test_masked_select_matches_torch,
    torch.ops.aten.unique_consecutive: test_unique_consecutive_matches_torch,
    torch.ops.hfjax.quantized_linear: test_quantization.test_quantized_linear_matches_the_dequantized_product,
}


def test_every_generic_override_has_a_reason_and_a_parity_test():
    registered = {entry.op: entry for entry in _ops.registered() if entry.backend is None}
    assert set(registered) == set(PARITY_TESTS), (
        f"overrides without a parity test: {set(registered) - set(PARITY_TESTS)}; "
        f"tests of overrides that no longer exist: {set(PARITY_TESTS) - set(registered)}"
    )
    assert all(entry.why.strip() for entry in registered.values())


def test_install_puts_every_generic_override_into_the_environment(env):
    for op, entry in _ops.overrides(None).items():
        assert env._ops[op].func is entry.impl, f"{op} is not installed"


def test_hfjax_uses_an_environment_of_its_own():
    import torchax

    from hfjax.bridge import _env

    assert _env.env() is not torchax.default_env()
    default_ops = torchax.default_env()._ops
    assert all(
        default_ops.get(op) is None or default_ops[op].func is not entry.impl
        for op, entry in _ops.overrides(None).items()
    )


def test_an_override_registered_later_reaches_hfjax_environment(monkeypatch):
    from hfjax.bridge import _env

    op = torch.ops.aten.erfinv.default

    @hfjax.override_op(op, why="a test: registered after the environment was made")
    def erfinv(x):
        return jax.scipy.special.erfinv(x)

    try:
        assert _env.env()._ops[op].func is erfinv
    finally:
        _ops._OVERRIDES.pop((op, None))


def test_an_override_without_a_reason_is_refused():
    with pytest.raises(ValueError, match="why="):
        hfjax.override_op(torch.ops.aten.erfinv.default, why=" ")
