"""Forwards that read no values of their data, for transformers modules whose own forwards do.

Some mixture-of-experts layers loop over the experts their tokens were routed to, so their traces
need those values (`_specialize`), and a program compiled once (the slot core, `hfjax serve`)
cannot hold them:
- DBRX's `DbrxExperts` asks `nonzero()` which experts any token chose and `torch.where` which
  tokens chose each;
- JetMoE's router (`JetMoeTopKGating`, in its MoE and its mixture-of-attention layers) counts the
  tokens of each expert with `.tolist()`, and its `JetMoeParallelExperts` splits the tokens, grouped
  by expert, at those counts. Its two stand-ins go together: the router hands the experts each
  grouped token's expert in place of the counts.
- LongCat-Flash's `LongcatFlashExperts` asks `nonzero()` which of its experts (routed ones, then
  zero-compute ones that hand a token back as it is) any token chose, as DBRX's does;
- X-MOD's `XmodOutput.lang_adapter` picks each row's language adapter by a boolean mask of its
  rows (`hidden_states[lang_ids == i]`), a shape that depends on the values.
transformers' own MoE layers that take `experts_implementation` run "grouped_mm" by default, which
needs no values; these modules do not take it.

`data_free(module)` gives every such submodule of `module` a method of the same arithmetic that
reads no values (`forward`, or the one `METHODS` names), for the length of the block (`bound`
enters it around all torch code it runs, so the module itself is left as it was): each expert (or
adapter) runs over every token, and each token's output is the sum of its chosen experts' outputs,
each times its routing weight, as transformers sums them (its own adapter's). Running every expert
costs num_experts / top_k times the FLOPs of the routed ones, which a decode step's few tokens do
not notice; a long prefill does.
"""

from __future__ import annotations

import contextlib
import types
import weakref

import torch


def _dbrx_experts(self, hidden_states, top_k_index, top_k_weights):
    """`DbrxExperts.forward`: hidden_states [B, q, H], top_k_index and top_k_weights [B * q, k]."""
    tokens = hidden_states.reshape(-1, self.hidden_size)  # [T, H]
    shape = (self.num_experts, self.ffn_hidden_size, self.hidden_size)
    w1, v1, w2 = (weight.view(shape) for weight in (self.mlp.w1, self.mlp.v1, self.mlp.w2))  # [E, F, H] each
    gate = self.mlp.activation_fn(torch.einsum("th,efh->etf", tokens, w1))
    up = torch.einsum("th,efh->etf", tokens, v1)
    out = torch.einsum("etf,efh->eth", gate * up, w2)  # every expert's output for every token
    # Each token's routing weight per expert: its top-k weights where it chose the expert, else 0.
    chosen = torch.nn.functional.one_hot(top_k_index, self.num_experts).to(top_k_weights.dtype)  # [T, k, E]
    weights = torch.einsum("tk,tke->te", top_k_weights, chosen).to(out.dtype)
    return torch.einsum("eth,te->th", out, weights).view(hidden_states.shape)


def _jetmoe_router(self, hidden_states):
    """`JetMoeTopKGating.forward`, with each grouped token's expert where the forward returns the
    experts' token counts: `_jetmoe_experts` takes those in place of the counts. The tokens are
    grouped by expert as transformers groups them."""
    logits = self.layer(hidden_states).float()  # [T, E]
    top_k_logits, top_k_indices = logits.topk(self.top_k, dim=1)  # [T, k]
    top_k_gates = torch.softmax(top_k_logits, dim=1).type_as(hidden_states)
    grouped_experts, index_sorted_experts = top_k_indices.flatten().sort(0)  # [T * k] each
    batch_index = index_sorted_experts.div(self.top_k, rounding_mode="trunc")
    batch_gates = top_k_gates.flatten()[index_sorted_experts]
    return index_sorted_experts, batch_index, batch_gates, grouped_experts, logits


def _jetmoe_experts(self, inputs, grouped_experts):
    """`JetMoeParallelExperts.forward`: inputs [N, in] grouped by expert, grouped_experts [N] each
    row's expert (from `_jetmoe_router`). Every expert runs over every row; each row keeps its own."""
    every = torch.einsum("ni,eoi->neo", inputs, self.weight)  # [N, E, out]
    own = torch.nn.functional.one_hot(grouped_experts, self.num_experts).to(every.dtype)  # [N, E]
    return torch.einsum("neo,ne->no", every, own)


def _longcat_experts(self, hidden_states, top_k_index, top_k_weights):
    """`LongcatFlashExperts.forward`: hidden_states [T, H], top_k_index and top_k_weights [T, k]. The
    experts past the routed ones compute nothing: each gives its tokens back as they are."""
    routed = self.num_routed_experts if self.gate_up_proj is not None else 0
    every = [hidden_states.unsqueeze(0).expand(self.total_experts - routed, -1, -1)]  # [Z, T, H]
    if routed:
        gate, up = torch.einsum("th,efh->etf", hidden_states, self.gate_up_proj[:routed]).chunk(2, dim=-1)
        every.insert(0, torch.einsum("etf,ehf->eth", self.act_fn(gate) * up, self.down_proj))  # [E, T, H]
    chosen = torch.nn.functional.one_hot(top_k_index, self.total_experts).to(top_k_weights.dtype)  # [T, k, E]
    weights = torch.einsum("tk,tke->te", top_k_weights, chosen)
    return torch.einsum("eth,te->th", torch.cat(every), weights.to(hidden_states.dtype))


def _xmod_lang_adapter(self, lang_ids, hidden_states):
    """`XmodOutput.lang_adapter`: lang_ids [B] (or [B, q]), each row's (token's) adapter; hidden_states
    [B, q, H]. Every adapter runs over every row; each row keeps its own language's output."""
    if not self.ln_before_adapter:
        residual = hidden_states
    if self.adapter_layer_norm is not None:
        hidden_states = self.adapter_layer_norm(hidden_states)
    elif self.adapter_reuse_layer_norm:
        hidden_states = self.LayerNorm(hidden_states)
    if self.ln_before_adapter:
        residual = hidden_states
    own = lang_ids.reshape(*lang_ids.shape, *(1,) * (hidden_states.dim() - lang_ids.dim()))  # [B, 1, 1]
    adapted = torch.zeros_like(hidden_states)
    for index, adapter in enumerate(self.adapter_modules.values()):
        adapted = torch.where(own == index, adapter(hidden_states), adapted)
    return self.dropout(adapted) + residual


# By class name: the method that stands in for the module's own (its forward, unless METHODS names another).
FORWARDS = {
    "DbrxExperts": _dbrx_experts,
    "JetMoeTopKGating": _jetmoe_router,
    "JetMoeParallelExperts": _jetmoe_experts,
    "LongcatFlashExperts": _longcat_experts,
    "XmodOutput": _xmod_lang_adapter,
}
METHODS = {"XmodOutput": "lang_adapter"}

_FOUND: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # module -> its submodules of FORWARDS


@contextlib.contextmanager
def data_free(module: torch.nn.Module):
    """Within the block, `module`'s submodules of a `FORWARDS` class run that forward (see the docstring)."""
    found = _FOUND.get(module)
    if found is None:
        found = _FOUND[module] = [m for m in module.modules() if type(m).__name__ in FORWARDS]
    mine = [(m, METHODS.get(type(m).__name__, "forward")) for m in found]
    mine = [(m, name) for m, name in mine if name not in vars(m)]  # (an enclosing block's stay as they are)
    for submodule, name in mine:  # an instance attribute over the class's method, for this block
        setattr(submodule, name, types.MethodType(FORWARDS[type(submodule).__name__], submodule))
    try:
        yield
    finally:
        for submodule, name in mine:
            delattr(submodule, name)
