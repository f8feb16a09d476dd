"""The package's layout, from every import statement in it (inside functions and `if TYPE_CHECKING:`
blocks too): no import cycle, no module reaching into another subpackage's private modules, `hfjax.cpu`
reached only from the backend hook, and every feature working without that package."""

from __future__ import annotations

import ast
import importlib
import pathlib

import pytest

import background
import hfjax

ROOT = pathlib.Path(hfjax.__file__).parent
SUBPACKAGES = tuple(sorted(p.name for p in ROOT.iterdir() if (p / "__init__.py").is_file()))


def _module_name(path: pathlib.Path) -> str:
    parts = ["hfjax", *path.relative_to(ROOT).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: pathlib.Path) -> set[str]:
    """Every hfjax module that `path` imports anywhere: `from . import _x` names the module hfjax._x,
    `from .bridge import to_jax` the package hfjax.bridge."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name.startswith("hfjax"))
        elif isinstance(node, ast.ImportFrom):
            base = (
                importlib.util.resolve_name("." * node.level + (node.module or ""), package)
                if node.level
                else node.module
            )
            if not base or not base.startswith("hfjax"):
                continue
            for alias in node.names:
                candidate = f"{base}.{alias.name}"
                found.add(candidate if _exists(candidate) else base)
    return {module for module in found if module != name}


def _exists(module: str) -> bool:
    relative = pathlib.Path(*module.split(".")[1:])
    return (ROOT / relative).with_suffix(".py").is_file() or (ROOT / relative / "__init__.py").is_file()


GRAPH = {_module_name(path): _imports(path) for path in ROOT.rglob("*.py")}


def _subpackage(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in SUBPACKAGES else None


def test_the_graph_sees_function_level_imports():
    # `hfjax.load` builds the CPU's hook through hfjax._backend, whose import of hfjax.cpu is inside a function.
    assert "hfjax.cpu" in GRAPH["hfjax._backend"]
    assert "hfjax.tasks" in GRAPH["hfjax.cli.check"]


def test_there_is_no_import_cycle():
    # Importing a module imports its packages first; that edge is Python's, not a cycle of ours.
    state, stack = {}, []

    def visit(module):
        state[module] = "open"
        stack.append(module)
        for target in sorted(GRAPH.get(module, ())):
            if state.get(target) == "open":
                cycle = stack[stack.index(target) :] + [target]
                if not all(later.startswith(earlier + ".") for earlier, later in zip(cycle, cycle[1:])):
                    pytest.fail(f"import cycle: {' -> '.join(cycle)}")
            elif target not in state:
                visit(target)
        stack.pop()
        state[module] = "done"

    for module in sorted(GRAPH):
        if module not in state:
            visit(module)


def test_no_module_imports_another_subpackages_private_module():
    # A subpackage's siblings use what its __init__ exports; hfjax's own top-level modules (_errors,
    # _dtypes, ...) are the package's shared helpers.
    reaching = []
    for module, targets in sorted(GRAPH.items()):
        for target in sorted(targets):
            parts = target.split(".")
            private = any(part.startswith("_") for part in parts[2:])
            if _subpackage(target) is not None and private and _subpackage(module) != _subpackage(target):
                reaching.append(f"{module} -> {target}")
    assert reaching == [], "imports of another subpackage's private module:\n" + "\n".join(reaching)


@pytest.mark.parametrize("backend", ["cpu", "gpu"])
def test_only_the_backend_hook_reaches_into_a_backend_package(backend):
    reaching = [
        module
        for module, targets in GRAPH.items()
        if _subpackage(module) != backend
        and module != "hfjax._backend"
        and any(_subpackage(t) == backend for t in targets)
    ]
    assert reaching == [], f"modules other than hfjax._backend import hfjax.{backend}: {reaching}"


@pytest.mark.parametrize("package", SUBPACKAGES)
def test_each_subpackage_says_what_it_holds_and_exports_it(package):
    module = importlib.import_module(f"hfjax.{package}")
    assert module.__doc__ and len(module.__doc__.strip().splitlines()) >= 3, f"hfjax.{package} has no docstring"
    for name in getattr(module, "__all__", ()):
        assert hasattr(module, name), f"hfjax.{package}.__all__ names {name!r}, which it does not define"


def test_public_names_are_exported():
    for name in hfjax.__all__:
        assert hasattr(hfjax, name), name
    assert issubclass(hfjax.ShardingError, hfjax.HfjaxError) and issubclass(hfjax.PipelineError, hfjax.HfjaxError)


_WITHOUT_CPU_PACKAGE = r"""
import importlib.abc, sys

class NoCpu(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == "hfjax.cpu" or name.startswith("hfjax.cpu."):
            raise ImportError("hfjax.cpu deleted for this test")

sys.meta_path.insert(0, NoCpu())
import numpy as np, torch, transformers, hfjax
from hfjax import _backend
assert _backend.active().name is None, _backend.active()
from hfjax import testing
path = testing.save_tiny_checkpoint("llama", sys.argv[1] + "/llama")
model = hfjax.load(path)
model.tokenizer.padding_side = "left"
batch = model.tokenizer(["Hello there, how are you?", "Hi"], padding=True, return_tensors="np")
got = np.asarray(model.generate(batch["input_ids"], batch["attention_mask"], max_new_tokens=8, do_sample=False))
reference = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
with torch.no_grad():
    want = reference.generate(torch.as_tensor(batch["input_ids"]).long(), attention_mask=torch.as_tensor(batch["attention_mask"]).long(),
                              max_new_tokens=8, do_sample=False).numpy()
np.testing.assert_array_equal(got, want)
report = hfjax.check(path)
assert report.passed, report.table()
print("ok")
"""


def start_in_background() -> None:
    background.start("without-cpu", background.python(_WITHOUT_CPU_PACKAGE), seconds=12)


def test_every_feature_works_without_the_cpu_package():
    job = background.finished("without-cpu", start_in_background)
    assert job.returncode == 0 and job.output.strip().endswith("ok"), job.output[-3000:]
