"""`import hfjax` changes nothing in the user's process: a fresh process compares a snapshot of
the state a library could change before the import, after it, and after every public name has
been read (which imports the modules behind them); and JAX's backends are still not started, so
the process can still join a multi-process run."""

from __future__ import annotations

import json

import pytest

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
try:  # the train extra's libraries, as a user who trains has them imported (absl, under optax, adds a finder)
    import optax, peft
except ImportError:
    pass

def snapshot():
    from jax._src import xla_bridge
    classes = [torch.nn.Module, torch.Tensor, ModelOutput, cache_utils.Cache, cache_utils.CacheLayerMixin,
               transformers.PreTrainedModel] + ([BaseOutput] if BaseOutput else [])
    output = CausalLMOutputWithPast(logits=1.0)  # no JAX array: that would start JAX's backends
    return {
        "os.environ": dict(os.environ),
        "jax.config": {name: repr(value) for name, value in jax.config.values.items()},
        "jax backends started": xla_bridge.backends_are_initialized(),
        "sys.meta_path": [repr(finder) for finder in sys.meta_path],
        "class attributes": {cls.__qualname__: sorted((k, repr(v)) for k, v in vars(cls).items()) for cls in classes},
        "torch functions": {name: repr(getattr(torch.nn.functional, name)) for name in ("linear", "scaled_dot_product_attention")},
        # None until something creates it (creating it would start JAX's backends)
        "torchax default environment ops": None if torchax._env is None
        else sorted(repr((op, entry.func)) for op, entry in torchax._env._ops.items()),
        "ModelOutput is a JAX pytree": jax.tree_util.tree_leaves(output) != [output],
    }

def changes(before, after):
    return {key: [before[key], after[key]] for key in before if before[key] != after[key]}

before = snapshot()
import hfjax
after_import = snapshot()
public = {name: getattr(hfjax, name) for name in hfjax.__all__}  # imports every module behind them
after_names = snapshot()
print(json.dumps({
    "import": changes(before, after_import),
    "names": changes(before, after_names),
    "distributed": hfjax.distributed.is_initialized(),
}, default=repr))
"""


def start_in_background() -> None:
    background.start("import-snapshot", background.python(_SNAPSHOT), seconds=8)


@pytest.fixture(scope="module")
def record():
    job = background.finished("import-snapshot", start_in_background)
    assert job.returncode == 0, job.output[-3000:]
    return json.loads(job.output.strip().splitlines()[-1])


@pytest.mark.parametrize("after", ["import", "names"])
def test_import_hfjax_changes_nothing_in_the_process(record, after):
    changed = record[after]
    assert changed == {}, f"import hfjax ({after}) changed: {sorted(changed)}: {json.dumps(changed)[:3000]}"


def test_import_hfjax_does_not_start_jax_so_a_process_can_still_join_a_run(record):
    # "jax backends started" is in the snapshot, False before: unchanged means still not started.
    assert record["distributed"] is False
