"""Every HF output and cache type crosses jax.jit losslessly, by field name."""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import pkgutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from transformers.utils import ModelOutput

import background
import hfjax
from hfjax.bridge import _env, _pytrees


def _import_all_model_modules() -> list[type]:
    """Imports every transformers model module (and diffusers' models, where installed); returns
    the output base classes whose subclasses they define."""
    import transformers.models as models

    for info in pkgutil.iter_modules(models.__path__):
        try:
            importlib.import_module(f"transformers.models.{info.name}.modeling_{info.name}")
        except Exception:  # optional backends (vision, audio) missing here: those classes are not installed
            continue
    bases = [ModelOutput]
    if importlib.util.find_spec("diffusers") is not None:
        importlib.import_module("diffusers.models")  # defines diffusers' output classes
        from diffusers.utils import BaseOutput

        bases.append(BaseOutput)
    return bases


def _subclasses(base):
    found, stack = set(), [base]
    while stack:
        for sub in stack.pop().__subclasses__():
            if sub not in found:
                found.add(sub)
                stack.append(sub)
    return sorted(found, key=lambda c: (c.__module__, c.__qualname__))


def _output_classes():
    classes = [cls for base in _import_all_model_modules() for cls in _subclasses(base)]
    return [c for c in classes if dataclasses.is_dataclass(c)]


def _filled(cls):
    # Every other field an array, the rest None: the arrays must come back in place.
    values = {}
    for i, field in enumerate(dataclasses.fields(cls)):
        values[field.name] = jnp.full((2,), float(i)) if i % 2 == 0 else None
    return _pytrees._output_unflattener(cls)(tuple(values), list(values.values())), values


def test_every_installed_output_type_round_trips_through_jit():
    classes = _output_classes()
    assert len(classes) > 300, f"expected hundreds of output classes, found {len(classes)}"
    for cls in classes:
        hfjax.register_pytree(cls)
        assert cls in _pytrees.registered_classes(), f"{cls.__qualname__} is not registered"
    filled = [_filled(cls) for cls in classes]
    returned = jax.jit(lambda objects: objects)([obj for obj, _ in filled])  # all of them through one program
    for cls, (_, values), back in zip(classes, filled, returned):
        assert type(back) is cls
        for name, value in values.items():
            got = getattr(back, name)
            if value is None:
                assert got is None, f"{cls.__qualname__}.{name} should stay None"
            else:
                np.testing.assert_array_equal(np.asarray(got), np.asarray(value), err_msg=f"{cls.__qualname__}.{name}")


def test_none_loss_does_not_shift_logits():
    logits = jnp.arange(6.0).reshape(1, 2, 3)
    out = transformers.modeling_outputs.CausalLMOutputWithPast(logits=logits)
    hfjax.register_pytree(out)
    back = jax.jit(lambda o: o)(out)
    assert back.loss is None
    np.testing.assert_array_equal(back.logits, logits)
    assert list(back.keys()) == ["logits"]
    assert back[0] is back.logits


_DIFFUSERS_AFTER_HFJAX = """
import sys
import hfjax, jax, jax.numpy as jnp, torch
assert "diffusers" not in sys.modules
import diffusers.models.autoencoders.vae as vae

class Decoder(torch.nn.Module):
    def forward(self, x):
        return vae.DecoderOutput(sample=x * 2)

back = hfjax.jit(Decoder())(jnp.ones((1, 3, 2, 2)))
assert isinstance(back, vae.DecoderOutput) and back.commit_loss is None and float(back.sample.sum()) == 24
print("ok")
"""


_TRANSFORMERS_AFTER_A_TORCH_JIT = """
import sys
import hfjax, jax.numpy as jnp, numpy as np, torch
from hfjax import tolerances

linear = torch.nn.Linear(4, 3)
x = np.arange(8, dtype=np.float32).reshape(2, 4)
with torch.no_grad():
    want = linear(torch.from_numpy(x)).numpy()
np.testing.assert_allclose(np.asarray(hfjax.jit(linear)(jnp.asarray(x))), want, atol=tolerances.DEFAULT.atol)
assert "transformers" not in sys.modules, "the jit of a plain torch module imported transformers"
from transformers.modeling_outputs import BaseModelOutput

class Encoder(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = linear

    def forward(self, x):
        return BaseModelOutput(last_hidden_state=self.linear(x))

back = hfjax.jit(Encoder())(jnp.asarray(x))
assert isinstance(back, BaseModelOutput) and back.hidden_states is None and list(back.keys()) == ["last_hidden_state"]
np.testing.assert_allclose(np.asarray(back.last_hidden_state), want, atol=tolerances.DEFAULT.atol)
print("ok")
"""


def start_in_background() -> None:
    if importlib.util.find_spec("diffusers") is not None:
        background.start("diffusers-after-hfjax", background.python(_DIFFUSERS_AFTER_HFJAX), seconds=8)
    background.start("transformers-after-a-torch-jit", background.python(_TRANSFORMERS_AFTER_A_TORCH_JIT), seconds=8)


def test_diffusers_imported_after_hfjax_is_registered_when_first_met():
    pytest.importorskip("diffusers")
    # A fresh process: in this one another test may have imported diffusers first.
    job = background.finished("diffusers-after-hfjax", start_in_background)
    assert job.returncode == 0 and job.output.strip().splitlines()[-1] == "ok", job.output[-2000:]


def test_a_torch_modules_jit_leaves_transformers_unimported_and_its_outputs_register_once_imported():
    # A fresh process: in this one transformers is imported.
    job = background.finished("transformers-after-a-torch-jit", start_in_background)
    assert job.returncode == 0 and job.output.strip().splitlines()[-1] == "ok", job.output[-2000:]


def test_output_class_defined_after_import_is_registered_when_first_met():
    @dataclasses.dataclass
    class LateOutput(ModelOutput):
        loss: torch.Tensor | None = None
        scores: torch.Tensor | None = None

    class Scorer(torch.nn.Module):
        def forward(self, x):
            return LateOutput(scores=x * 2)

    assert LateOutput not in _pytrees.registered_classes()
    back = hfjax.jit(Scorer())(jnp.ones(3))
    assert isinstance(back, LateOutput) and back.loss is None
    np.testing.assert_array_equal(back.scores, np.full(3, 2.0))
    assert LateOutput in _pytrees.registered_classes()


def test_register_pytree_names_what_it_cannot_register():
    with pytest.raises(TypeError, match=r"register_pytree\(int\).*register_stateful"):
        hfjax.register_pytree(int)


def _leaves_equal(a, b):
    la, ta = jax.tree_util.tree_flatten(a)
    lb, tb = jax.tree_util.tree_flatten(b)
    assert ta == tb
    assert len(la) == len(lb) and len(la) > 0
    for x, y in zip(la, lb):
        np.testing.assert_array_equal(np.asarray(_env.to_jax(x)), np.asarray(_env.to_jax(y)))


CACHE_CASES = [
    # (family, config overrides, cache factory, expected layer class names)
    ("llama", {}, lambda cfg: transformers.DynamicCache(config=cfg), {"DynamicLayer"}),
    ("llama", {}, lambda cfg: transformers.StaticCache(config=cfg, max_cache_len=16), {"StaticLayer"}),
    (
        "mistral",
        {"sliding_window": 4},
        lambda cfg: transformers.DynamicCache(config=cfg),
        {"DynamicSlidingWindowLayer"},
    ),
    (
        "gemma2",
        {},
        lambda cfg: transformers.StaticCache(config=cfg, max_cache_len=16),
        {"StaticLayer", "StaticSlidingWindowLayer"},
    ),
    ("gemma2", {}, lambda cfg: transformers.DynamicCache(config=cfg), {"DynamicLayer", "DynamicSlidingWindowLayer"}),
]


@pytest.mark.parametrize(
    "family,overrides,make_cache,layer_names", CACHE_CASES, ids=lambda v: v if isinstance(v, str) else None
)
def test_cache_after_forward_round_trips(checkpoint, family, overrides, make_cache, layer_names):
    path = checkpoint(family, **overrides)
    model = hfjax.load(path)
    ids = np.array([[5, 6, 7, 8, 9]])
    cache = make_cache(model.config)
    model(ids, past_key_values=cache, use_cache=True)
    assert {type(layer).__name__ for layer in cache.layers} == layer_names
    leaves, treedef = jax.tree_util.tree_flatten(cache)
    rebuilt = jax.tree_util.tree_unflatten(treedef, leaves)
    assert type(rebuilt) is type(cache)
    _leaves_equal(cache, rebuilt)
    through_jit = jax.jit(lambda c: c)(_env.to_jax(cache))
    _leaves_equal(cache, through_jit)
    if hasattr(cache.layers[0], "cumulative_length"):
        assert int(np.asarray(_env.to_jax(through_jit.layers[0].cumulative_length))) == ids.shape[1]
    with _env.env():  # a cache holding torchax tensors computes inside the torchax environment
        assert _env.to_torch(through_jit).get_seq_length() == cache.get_seq_length() == ids.shape[1]


def test_encoder_decoder_cache_round_trips(checkpoint):
    path = checkpoint("bart")
    model = hfjax.load(path)
    ids = np.array([[5, 6, 7, 8]])
    out = model(ids, decoder_input_ids=np.array([[2, 5]]), use_cache=True)
    cache = out.past_key_values
    assert type(cache).__name__ == "EncoderDecoderCache"
    rebuilt = jax.jit(lambda c: c)(_env.to_jax(cache))
    assert type(rebuilt.self_attention_cache) is type(cache.self_attention_cache)
    _leaves_equal(cache, rebuilt)


def test_state_space_cache_round_trips_and_decodes(checkpoint):
    path = checkpoint("mamba")
    model = hfjax.load(path)
    prompt = np.array([[5, 6, 7, 8]])
    out = model(prompt, use_cache=True)
    cache = out.cache_params
    assert type(cache).__name__ == "DynamicCache"
    _leaves_equal(cache, jax.jit(lambda c: c)(_env.to_jax(cache)))
    token = np.asarray(out.logits[:, -1:].argmax(-1))
    step = model(token, cache_params=cache, use_cache=True)

    reference = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    with torch.no_grad():
        first = reference(torch.from_numpy(prompt), use_cache=True)
        want = reference(torch.from_numpy(token), cache_params=first.cache_params, use_cache=True).logits
    np.testing.assert_allclose(np.asarray(step.logits), want.numpy(), atol=_tolerance("mamba"))


def _tolerance(family):
    from hfjax import tolerances

    return tolerances.for_family(family).atol
