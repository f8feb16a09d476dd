"""Tensor parallelism: a PartitionSpec for every parameter, from one registry of rules per family.

Attention query/key/value and MLP up/gate projections are split by output features over
"model" (column), attention output and MLP down projections by input features (row),
embeddings and the LM head over the vocabulary; norms, biases of row layers and other
small vectors are replicated. Parameters are replicated over "data". XLA's SPMD
partitioner inserts the collectives (one all-reduce per attention block and per MLP).

A module may name tensors that split as another of its tensors does (`sharded_like`, e.g. a
quantized linear layer's scales and zero points follow its weight).

Rules come from one registry, `@rules(family, ...)`: a table of regexes on parameter names
to roles. Parameters no rule names (and families with no entry) are placed by a fallback
that reads the module structure; it logs what it could not place and never replicates a
large matrix without saying so.
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Callable, Mapping
from typing import Literal

import jax
from jax.sharding import PartitionSpec as P

from .. import _dtypes
from .._errors import ShardingError
from ._mesh import axis_sizes

logger = logging.getLogger("hfjax")

Role = Literal["column", "row", "vocab", "replicate", "q_heads", "kv_heads", "experts_column", "experts_row"]
ROLES: tuple[str, ...] = Role.__args__
_SMALL_BYTES = 1 << 20  # the fallback replicates matrices below this without a warning


# ---- the rules registry ----------------------------------------------------------

_RULES: dict[str, dict[str, Role]] = {}


def rules(*families: str) -> Callable:
    """Registers a family's table {regex on parameter name: role}; the decorated function returns it.

    The first regex that `re.search`es a name wins. Roles: "column" / "row" (a Linear's
    output / input features), "q_heads" / "kv_heads" (column, with the head-count checks;
    key/value projections are replicated when there are fewer KV heads than "model"
    devices), "vocab", "replicate", "experts_column" / "experts_row" (fused expert weights
    [experts, out, in]: split out / in). Unnamed parameters go to the structural fallback.
    """

    def register(function: Callable[[], dict[str, Role]]):
        table = function()
        bad = {k: v for k, v in table.items() if v not in ROLES}
        if bad:
            raise ValueError(f"@rules{families}: unknown roles {bad}; use one of {ROLES}")
        for family in families:
            if family in _RULES:
                logger.warning("hfjax: sharding rules for %r are registered twice; the later one wins", family)
            _RULES[family] = table
        return function

    return register


_ATTENTION_MLP = {
    r"\.(q_proj|query)\.(weight|bias)$": "q_heads",
    r"\.(k_proj|v_proj|key|value)\.(weight|bias)$": "kv_heads",
    r"\.(o_proj|out_proj)\.weight$": "row",
    r"\.(gate_proj|up_proj)\.(weight|bias)$": "column",
    r"\.down_proj\.weight$": "row",
    r"embed_tokens\.weight$": "vocab",
    r"^lm_head\.weight$": "vocab",
}


@rules("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text", "olmo")
def _llama_like():
    return dict(_ATTENTION_MLP)


@rules("phi3")
def _phi3():
    # Fused q|k|v and gate|up: a contiguous split mixes the parts, so XLA reshards after the
    # projection; still one all-reduce per block.
    return {**_ATTENTION_MLP, r"\.qkv_proj\.weight$": "q_heads", r"\.gate_up_proj\.weight$": "column"}


@rules("gpt2")
def _gpt2():
    # Conv1D weights are [in, out]; roles are resolved against that layout.
    return {
        r"\.attn\.c_attn\.(weight|bias)$": "q_heads",
        r"\.attn\.c_proj\.weight$": "row",
        r"\.mlp\.c_fc\.(weight|bias)$": "column",
        r"\.mlp\.c_proj\.weight$": "row",
        r"\.wte\.weight$": "vocab",
        r"\.wpe\.weight$": "replicate",
    }


@rules("mixtral", "qwen2_moe", "qwen3_moe")
def _moe():
    # Experts split by their intermediate features (tensor-parallel experts), which works
    # for any number of experts; the router is small and replicated.
    return {
        **_ATTENTION_MLP,
        r"\.experts\.gate_up_proj$": "experts_column",
        r"\.experts\.down_proj$": "experts_row",
        r"\.mlp\.gate\.weight$": "replicate",
    }


@rules("deepseek_v3")
def _deepseek_v3():
    # Multi-head latent attention: the low-rank down projections are small and replicated;
    # the up projections produce heads and are split by them.
    return {
        **_moe(),
        r"\.(q_a_proj|kv_a_proj_with_mqa)\.weight$": "replicate",
        r"\.(q_b_proj|kv_b_proj)\.weight$": "q_heads",
        r"\.(q_proj)\.weight$": "q_heads",
    }


# ---- the plan ------------------------------------------------------------------


class Plan(dict):
    """{parameter or buffer name: PartitionSpec}, with shapes and per-device bytes for printing."""

    def __init__(self, specs, *, shapes, dtypes, axis_sizes, notes):
        super().__init__(specs)
        self.shapes: dict[str, tuple[int, ...]] = shapes
        self.dtypes: dict[str, str] = dtypes
        self.axis_sizes: dict[str, int] = axis_sizes
        self.notes: list[str] = notes

    def bytes_per_device(self, name: str) -> int:
        return _nbytes(self.shapes[name], self.dtypes[name]) // _split_factor(self[name], self.axis_sizes)

    def total_bytes_per_device(self) -> int:
        return sum(self.bytes_per_device(n) for n in self)

    def table(self) -> str:
        """One line per parameter (spec, shape, dtype, bytes per device), then the total and notes."""
        mesh = " x ".join(f"{k}={v}" for k, v in self.axis_sizes.items())
        width = max((len(n) for n in self), default=4)
        lines = [
            f"mesh: {mesh}",
            f"{'parameter':<{width}}  {'spec':<24} {'shape':<18} {'dtype':<9} {'bytes/device':>14}",
        ]
        for name, spec in self.items():
            shape = "x".join(map(str, self.shapes[name])) or "scalar"
            lines.append(
                f"{name:<{width}}  {_spec_text(spec):<24} {shape:<18} {self.dtypes[name]:<9} {self.bytes_per_device(name):>14,}"
            )
        total = sum(_nbytes(self.shapes[n], self.dtypes[n]) for n in self)
        lines.append(f"total per device: {self.total_bytes_per_device():,} bytes (of {total:,} in the whole model)")
        lines.extend(f"note: {note}" for note in self.notes)
        return "\n".join(lines)

    def shardings(self, mesh: jax.sharding.Mesh) -> dict[str, jax.sharding.NamedSharding]:
        return {name: jax.sharding.NamedSharding(mesh, spec) for name, spec in self.items()}


def plan(model_or_config, mesh, *, task: str | None = None, dtype: str | None = None) -> Plan:
    """The PartitionSpec of every parameter and buffer of a model over `mesh`.

    Args:
      model_or_config: an `hfjax.Model`, a transformers module, or a transformers config
        (its module is built on the meta device; no weights are read).
      mesh: a `jax.sharding.Mesh` or `jax.sharding.AbstractMesh` with a "model" axis (and
        optionally "data"); only its axis sizes are used, so no devices are needed.
      task: with a config, the task to build the module for (default: inferred).
      dtype: with a config, the dtype the weights will have (default float32).

    Returns:
      A `Plan`: a dict {name: PartitionSpec}; `print(plan.table())` shows bytes per device.

    Raises:
      ShardingError: the attention heads (or key/value heads, where there are at least as
        many as "model" devices) do not divide by the "model" axis.

    Example:
      >>> mesh = jax.sharding.AbstractMesh((1, 8), ("data", "model"))
      >>> print(hfjax.parallel.plan(config, mesh).table())
    """
    module = _as_module(model_or_config, task, dtype)
    sizes = axis_sizes(mesh)
    config = module.config.get_text_config(decoder=True) if hasattr(module.config, "get_text_config") else module.config
    notes: list[str] = []
    replicate_kv = _check_heads(config, sizes, notes)
    table = (
        _RULES.get(getattr(module.config, "model_type", None)) or _RULES.get(getattr(config, "model_type", None)) or {}
    )
    if not table:
        notes.append(
            f"no sharding rules for model_type {getattr(module.config, 'model_type', None)!r}; the structural fallback placed every parameter"
        )

    specs, shapes, dtypes = {}, {}, {}
    followers: dict[str, str] = {}  # {name: the tensor it splits as}
    unplaced = []
    buffers = {n for n, _ in module.named_buffers()}
    for name, tensor in _named_tensors(module):
        shape = tuple(tensor.shape)
        shapes[name], dtypes[name] = shape, _dtype_name(tensor.dtype)
        if name in buffers or len(shape) == 0:
            specs[name] = P()
            continue
        owner = _owner(module, name)
        leader = getattr(owner, "sharded_like", {}).get(name.rsplit(".", 1)[-1])
        if leader is not None:  # a quantized layer's scales: split as its weight is
            followers[name] = f"{name.rsplit('.', 1)[0]}.{leader}"
            continue
        role = next((r for pattern, r in table.items() if re.search(pattern, name)), None)
        if role is None:
            role = _infer_role(name, shape, owner, _owner(module, name.rsplit(".", 1)[0]), config)
        if role == "kv_heads" and replicate_kv:
            role = "replicate"
        spec = _spec(role, name, shape, owner) if role else P()
        spec = _fit(spec, name, shape, sizes["model"], notes)
        if role is None and len(shape) >= 2:
            unplaced.append(name)
        specs[name] = spec
    for name, leader in followers.items():
        specs[name] = _follow(specs[leader], shapes[name], sizes)
    large = [n for n in unplaced if _nbytes(shapes[n], dtypes[n]) >= _SMALL_BYTES]
    if large:
        message = f"could not place {len(large)} large matrices, replicated on every device: {', '.join(large[:8])}" + (
            f" and {len(large) - 8} more" if len(large) > 8 else ""
        )
        logger.warning("hfjax: %s; add a @rules(%r) entry to split them", message, getattr(config, "model_type", None))
        notes.append(message)
    elif unplaced:
        notes.append(
            f"{len(unplaced)} small matrices with no rule replicated: {', '.join(unplaced[:4])}"
            + (" ..." if len(unplaced) > 4 else "")
        )
    return Plan(specs, shapes=shapes, dtypes=dtypes, axis_sizes=sizes, notes=notes)


def _check_heads(config, sizes: Mapping[str, int], notes: list[str]) -> bool:
    # Returns whether the key/value projections must be replicated (fewer KV heads than devices).
    n = sizes["model"]
    heads = getattr(config, "num_attention_heads", None)
    if n == 1 or not isinstance(heads, int):
        return False
    mesh = ", ".join(f"{k}={v}" for k, v in sizes.items())
    if heads % n:
        divisors = [d for d in range(1, heads + 1) if heads % d == 0]
        raise ShardingError(
            f"hfjax sharding: num_attention_heads={heads} does not divide by the mesh's 'model' axis of size {n} "
            f"(mesh {mesh}); use a 'model' size that divides {heads}: one of {divisors}, e.g. make_mesh(data=..., model={max(d for d in divisors if d <= n)})"
        )
    kv = getattr(config, "num_key_value_heads", None) or heads
    if kv < n:
        message = f"num_key_value_heads={kv} < 'model' size {n}: key/value projections and the KV cache are replicated over 'model'"
        logger.info("hfjax: %s", message)
        notes.append(message)
        return True
    if kv % n:
        raise ShardingError(
            f"hfjax sharding: num_key_value_heads={kv} (num_attention_heads={heads}) does not divide by the mesh's "
            f"'model' axis of size {n} (mesh {mesh}); use a 'model' size that divides {kv}, or one larger than {kv}"
        )
    return False


def _spec(role: Role, name: str, shape: tuple[int, ...], owner) -> P:
    # Roles are stated for torch Linear weights [out, in]; Conv1D (GPT-2) stores [in, out].
    transposed = type(owner).__name__ == "Conv1D"
    is_bias = name.endswith("bias") or len(shape) == 1
    if role == "replicate":
        return P()
    if role in ("column", "q_heads", "kv_heads", "vocab"):
        if is_bias:
            return P("model")
        return P(None, "model") if transposed else P("model", None)
    if role == "row":
        if is_bias:
            return P()
        return P("model", None) if transposed else P(None, "model")
    if role in ("experts_column", "experts_row") and len(shape) == 3:
        return P(None, "model", None) if role == "experts_column" else P(None, None, "model")
    return P()


def _follow(spec: P, shape: tuple[int, ...], sizes: Mapping[str, int]) -> P:
    # The spec of a tensor that splits as another one of its module does (a quantized weight's
    # scales [N / r, K / c] as the weight [N, K]): the same axes, on the dimensions it has more than
    # one entry along and that divide evenly; replicated along the others.
    axes = []
    for dim, size in enumerate(shape):
        axis = spec[dim] if dim < len(spec) else None
        split = _split_factor(P(axis), sizes) if axis is not None else 1
        axes.append(axis if axis is not None and size > 1 and size % split == 0 else None)
    return P(*axes)


def _fit(spec: P, name: str, shape: tuple[int, ...], n: int, notes: list[str]) -> P:
    # A split dimension that does not divide by the "model" size moves to another dimension
    # that does (a vocabulary of 50257 is split over hidden instead), else is replicated.
    if n == 1 or "model" not in spec:
        return spec
    dim = list(spec).index("model")
    if shape[dim] % n == 0:
        return spec
    for other in range(len(shape) - 1, -1, -1):
        if other != dim and shape[other] % n == 0:
            moved = [None] * len(shape)
            moved[other] = "model"
            notes.append(
                f"{name}: dimension {dim} ({shape[dim]}) does not divide by {n}; split dimension {other} instead"
            )
            return P(*moved)
    notes.append(f"{name}: no dimension of {shape} divides by {n}; replicated")
    logger.warning(
        "hfjax: %s has shape %s, no dimension of which divides by 'model' size %d; it is replicated", name, shape, n
    )
    return P()


# ---- the structural fallback ----------------------------------------------------

_ROW_NAMES = re.compile(r"(^|\.)(o_proj|out_proj|c_proj|down_proj|dense_4h_to_h|fc2|wo|w2|proj_out|fc_out)$")


def _infer_role(name: str, shape: tuple[int, ...], owner, parent, config) -> Role | None:
    # Which linear layers feed heads or an elementwise MLP (column: they read the hidden
    # state) and which consume them (row: they write the hidden state back).
    import torch

    hidden = getattr(config, "hidden_size", None)
    vocab = getattr(config, "vocab_size", None)
    layer = name.rsplit(".", 1)[0]
    is_bias = name.endswith("bias")
    if isinstance(owner, torch.nn.Embedding):
        if shape[0] == vocab:
            return "vocab"
        return "replicate" if _nbytes(shape, "float32") < _SMALL_BYTES else "row"
    features = _features(owner)
    if features is None:
        if len(shape) == 3 and hidden in shape[1:]:
            return "experts_column" if shape[2] == hidden else "experts_row"
        return "replicate" if len(shape) < 2 else None
    n_in, n_out = features
    if n_out == vocab:
        return "vocab"
    if n_in == hidden and n_out != hidden:
        return "column"
    if n_out == hidden and n_in != hidden:
        return "replicate" if is_bias else "row"
    if n_in == hidden and n_out == hidden:
        return ("replicate" if is_bias else "row") if _consumes(layer, parent) else "column"
    return "replicate" if len(shape) < 2 else None


def _consumes(layer: str, parent) -> bool:
    # A square [hidden, hidden] layer writes the hidden state back when its name says so
    # (o_proj, out_proj, BERT's output.dense) or when it is the last of several linear layers
    # of its block (GPT-NeoX's attention.dense after query_key_value).
    if _ROW_NAMES.search(layer) or layer.endswith("output.dense"):
        return True
    linears = [name for name, child in parent.named_children() if _features(child) is not None]
    return len(linears) > 1 and linears[-1] == layer.rsplit(".", 1)[-1]


def _features(owner) -> tuple[int, int] | None:
    import torch

    if isinstance(owner, torch.nn.Linear):
        return owner.in_features, owner.out_features
    if type(owner).__name__ == "Conv1D":
        return owner.weight.shape[0], owner.nf
    return None


# ---- modules, shapes, bytes ---------------------------------------------------


def _as_module(model_or_config, task, dtype):
    import torch

    if isinstance(model_or_config, torch.nn.Module):
        return model_or_config
    if hasattr(model_or_config, "module") and isinstance(model_or_config.module, torch.nn.Module):
        return model_or_config.module
    from .. import _tasks, bridge

    config = model_or_config
    return bridge.build_skeleton(config, task or _tasks.infer(config), dtype or "float32")


def _named_tensors(module):
    seen = set()
    for name, tensor in list(module.named_parameters()) + list(module.named_buffers()):
        if id(tensor) not in seen:
            seen.add(id(tensor))
            yield name, tensor


def _owner(module, name: str):
    return module.get_submodule(name.rsplit(".", 1)[0]) if "." in name else module


def _dtype_name(dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _nbytes(shape: tuple[int, ...], dtype: str) -> int:
    return math.prod(shape) * _dtypes.itemsize(dtype)


def _split_factor(spec: P, sizes: Mapping[str, int]) -> int:
    factor = 1
    for entry in spec:
        for axis in entry if isinstance(entry, tuple) else (entry,):
            if axis is not None:
                factor *= sizes[axis]
    return factor


def _spec_text(spec: P) -> str:
    return "P(" + ", ".join(repr(e) if e is not None else "None" for e in spec) + ")" if len(spec) else "replicated"
