"""`import hfjax` changes nothing in the user's process: a fresh process compares a snapshot of
the state a library could change before and after the import."""

from __future__ import annotations

import json

import background

_SNAPSHOT = r"""
import json, os, sys
import jax, torch, torchax, transformers
from transformers import cache_utils
from transformers.utils import ModelOutput
from transformers.modeling_outputs import CausalLMOutputWithPast
try:
    import diffusers
    from diffusers.utils import BaseOutput
except ImportError:
    diffusers = BaseOutput = None

def snapshot():
    from jax._src import xla_bridge
    classes = [torch.nn.Module, torch.Tensor, ModelOutput, cache_utils.Cache, cache_utils.CacheLayerMixin,
               transformers.PreTrainedModel] + ([BaseOutput] if BaseOutput else [])
    output = CausalLMOutputWithPast(logits=jax.numpy.ones(2))
    return {
        "os.environ": dict(os.environ),
        "jax.config": {name: repr(value) for name, value in jax.config.values.items()},
        "jax backends started": xla_bridge.backends_are_initialized(),
        "sys.meta_path": [repr(finder) for finder in sys.meta_path],
        "class attributes": {cls.__qualname__: sorted((k, repr(v)) for k, v in vars(cls).items()) for cls in classes},
        "torch functions": {name: repr(getattr(torch.nn.functional, name)) for name in ("linear", "scaled_dot_product_attention")},
        "torchax default environment ops": sorted(repr((op, entry.func)) for op, entry in torchax.default_env()._ops.items()),
        "ModelOutput is a JAX pytree": jax.tree_util.tree_leaves(output) != [output],
    }

before = snapshot()
import hfjax
after = snapshot()
print(json.dumps({key: [before[key], after[key]] for key in before if before[key] != after[key]}, default=repr))
"""


_BACKENDS_NOT_STARTED = """
import hfjax
from jax._src import xla_bridge
assert not xla_bridge.backends_are_initialized()
print(hfjax.distributed.is_initialized())
"""


def start_in_background() -> None:
    background.start("import-snapshot", background.python(_SNAPSHOT), seconds=8)
    background.start("import-backends", background.python(_BACKENDS_NOT_STARTED), seconds=5)


def test_import_hfjax_changes_nothing_in_the_process():
    job = background.finished("import-snapshot", start_in_background)
    assert job.returncode == 0, job.output[-3000:]
    changed = json.loads(job.output.strip().splitlines()[-1])
    assert changed == {}, f"import hfjax changed: {sorted(changed)}: {json.dumps(changed)[:3000]}"


def test_import_hfjax_does_not_start_jax_so_a_process_can_still_join_a_run():
    job = background.finished("import-backends", start_in_background)
    assert job.returncode == 0, job.output[-3000:]
    assert job.output.strip().splitlines()[-1] == "False"
