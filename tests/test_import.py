"""`import hfjax` changes nothing in the user's process: a fresh process compares a snapshot of
the state a library could change before and after the import."""

from __future__ import annotations

import json
import subprocess
import sys

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


def test_import_hfjax_changes_nothing_in_the_process():
    result = subprocess.run([sys.executable, "-c", _SNAPSHOT], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    changed = json.loads(result.stdout.splitlines()[-1])
    assert changed == {}, f"import hfjax changed: {sorted(changed)}: {json.dumps(changed)[:3000]}"


def test_import_hfjax_does_not_start_jax_so_a_process_can_still_join_a_run():
    code = (
        "import hfjax\n"
        "from jax._src import xla_bridge\n"
        "assert not xla_bridge.backends_are_initialized()\n"
        "print(hfjax.distributed.is_initialized())\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip() == "False"
