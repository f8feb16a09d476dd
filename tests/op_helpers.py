"""Helpers of the op parity tests (test_ops.py, test_cpu.py): run a torch function through a
torchax environment, eagerly or under jax.jit, and compare with torch."""

from __future__ import annotations

import jax
import numpy as np
import pytest
import torch
import torchax
from torchax.view import View

from hfjax.bridge import _ops

SEED = 0

jit_modes = pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])


def environment(backend: str | None) -> torchax.tensor.Environment:
    """A fresh torchax environment with hfjax's overrides for `backend` (None: the generic ones)."""
    made = torchax.tensor.Environment()
    _ops.install(made, backend=backend)
    return made


def to_jax(env, value):
    # value: a CPU tensor, or a pytree of them
    with env:
        return torch.utils._pytree.tree_map_only(torch.Tensor, lambda t: t.to("jax"), value)


def to_cpu(value):
    # value: torchax Tensors or Views (CPU tensors pass through), or a pytree of them
    def convert(t):
        return t if t.device.type == "cpu" else torch.from_numpy(np.array(t.jax()))

    return torch.utils._pytree.tree_map_only(torch.Tensor, convert, value)


def run(env, fn, *cpu_args, jit: bool):
    """Runs `fn` on torchax copies of `cpu_args` in `env`, eagerly or under jax.jit; returns CPU tensors."""
    args = to_jax(env, cpu_args)
    if not jit:
        with env:
            return to_cpu(fn(*args))
    arrays = torch.utils._pytree.tree_map_only(torchax.tensor.Tensor, lambda t: t.jax(), args)

    def traced(*arrays):
        with env:
            tensors = jax.tree_util.tree_map(lambda a: torchax.tensor.Tensor(a, env), arrays)
            out = fn(*tensors)
        return torch.utils._pytree.tree_map_only((torchax.tensor.Tensor, View), lambda t: t.jax(), out)

    out = jax.jit(traced)(*arrays)
    return to_cpu(jax.tree_util.tree_map(lambda a: torchax.tensor.Tensor(a, env), out))


def assert_close(actual, expected, tolerance):
    assert actual.shape == expected.shape, f"shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    torch.testing.assert_close(actual, expected, atol=tolerance.atol, rtol=tolerance.rtol, check_dtype=False)


def attention_case(case: str):
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
    if (
        case == "prompt_chunk_over_a_long_cache"
    ):  # 16 queries of 2 rows over 2048 columns, each row's keys up to its position
        positions = torch.tensor([300, 1500])[:, None] + torch.arange(16)[None, :]  # [2, 16]
        mask = (torch.arange(2048)[None, None, :] <= positions[:, :, None])[:, None]  # [2, 1, 16, 2048]
        mask[0, :, 0] = False  # a query that may attend to nothing
        return randn(2, 4, 16, 8), randn(2, 2, 2048, 8), randn(2, 2, 2048, 8), dict(attn_mask=mask, enable_gqa=True)
    raise ValueError(f"unknown case {case!r}")


ATTENTION_CASES = (
    "bool_mask_with_empty_rows", "float_mask", "causal", "grouped_query", "grouped_decode", "decode_odd_sizes",
    "mask_per_head", "prompt_chunk_over_a_long_cache",
)  # fmt: skip


def check_attention(env, case: str, jit: bool) -> None:
    """torch's scaled_dot_product_attention through `env` against torch itself."""
    from hfjax.tolerances import MATMUL

    q, k, v, kwargs = attention_case(case)
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, **kwargs)
    mask = kwargs.pop("attn_mask", None)

    def attention(q, k, v, mask):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, **kwargs)

    actual = run(env, attention, q, k, v, mask, jit=jit)
    assert_close(actual, expected, MATMUL)
    assert torch.isfinite(actual).all()
