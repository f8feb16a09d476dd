"""Shared fixtures and markers: tiny checkpoints are written once per session and reused.

Markers:
  backend(name)  the test asserts something only true on one JAX backend (e.g. XLA:CPU's program
                 text); skipped on the others
  cpu_hook       the test asserts what the CPU's hook (hfjax.cpu) does; skipped where the generic
                 engine runs (another backend, HFJAX_CPU_KERNELS=0, or no hfjax.cpu)
"""

from __future__ import annotations

import os

# torch's OpenMP threads spin while they wait; beside JAX's CPU runtime in one process on a
# 2-core machine that slows torch down ~30x. This is the tests' process, not hfjax's doing.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Two test processes (pytest-xdist) and their jobs share one accelerator: none takes 75% of its memory.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
# The tests check what programs compute, not how fast, and compiling is most of their time. Where
# they run on the CPU alone (XLA_FLAGS that a backend does not use, or an XLA does not know, abort
# the process, so these are set only there; each exists in every jax the metadata admits):
# - LLVM's lowest optimisation level compiles XLA:CPU programs ~15% sooner (XLA's own HLO passes,
#   whose results some tests read, still run);
# - LLVM's expensive passes off: 7% less CPU for test_generate's greedy tests.
# The suite's processes (background jobs, servers) inherit them.
_FAST_CPU_COMPILE = ("--xla_backend_optimization_level=0", "--xla_llvm_disable_expensive_passes=true")


def _cpu_only() -> bool:
    """Whether JAX can only run on the CPU here: told so, or no GPU or TPU plugin is installed."""
    import importlib.util
    import pkgutil

    platforms = os.environ.get("JAX_PLATFORMS", "")
    if platforms:
        return platforms.split(",")[0] == "cpu"
    try:
        import jax_plugins  # the namespace of jax's CUDA and ROCm plugins
    except ImportError:
        plugins = []
    else:
        plugins = list(pkgutil.iter_modules(jax_plugins.__path__))
    return not plugins and importlib.util.find_spec("libtpu") is None


if _cpu_only():
    for _flag in _FAST_CPU_COMPILE:
        if _flag.split("=")[0] not in os.environ.get("XLA_FLAGS", ""):
            os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_flag}".strip()
# No compilation cache or program store (the CLI's default is ~/.cache/hfjax): keeping every
# program costs more than the few the suite's processes share (test_generate's greedy tests took
# 8% less CPU without it). The tests of the store give their processes a directory of their own.
os.environ.setdefault("HFJAX_CACHE_DIR", "off")

import jax  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

import background  # noqa: E402
from hfjax import _backend, testing  # noqa: E402

torch.set_num_threads(2)


def pytest_configure(config):
    config.addinivalue_line("markers", "backend(name): runs only on that JAX backend (jax.default_backend())")
    config.addinivalue_line("markers", "cpu_hook: runs only where the CPU's hook (hfjax.cpu) is active")


# The order pytest-xdist hands modules to its workers (pyproject.toml: --no-loadscope-reorder):
# early, the modules that wait on a process of their own (README's examples, the 8-device and
# training jobs, the servers), so that those processes run beside everything else rather than
# after it; then the longest. Ordered by test count, as xdist does by default, the README's job
# started last and one core idled for its last ~2 minutes. A worker waits idle while its module's
# job runs (a job starts when its module's first test needs it, in that worker), so two such
# modules are never next to each other: with the README's, the 8-device and the training jobs
# first, both workers waited at the start (552 s and 365 s) with the jobs using ~1.5 of the 2
# cores. Between them, test_generate keeps the other worker busy. Modules not named keep their order.
_FIRST = ("test_readme", "test_generate", "test_sharding", "test_serve", "test_ops", "test_training_runs",
          "test_serve_fuzz", "test_cpu", "test_diffusion", "test_testing", "test_sampling", "test_training",
          "test_parity")  # fmt: skip


def pytest_collection_modifyitems(session, config, items):
    def rank(item):
        name = item.path.stem
        return _FIRST.index(name) if name in _FIRST else len(_FIRST)

    items.sort(key=rank)  # stable: each module's tests keep their order


def pytest_collection_finish(session):
    """Starts the jobs that test modules run in processes of their own beside the rest of the
    suite (their `start_in_background()`, tests/background.py), once per module with tests.

    Under pytest-xdist (pyproject.toml runs 2 workers) a worker does not know yet which modules it
    will run, so each job starts when a test first needs it, in that test's worker."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        return
    started = set()
    for item in session.items:
        module = getattr(item, "module", None)
        if module is not None and hasattr(module, "start_in_background") and module not in started:
            started.add(module)
            module.start_in_background()


def pytest_sessionfinish(session, exitstatus):
    background.clean_up()


def pytest_runtest_setup(item):
    for marker in item.iter_markers("backend"):
        if jax.default_backend() != marker.args[0]:
            pytest.skip(f"asserts what only the {marker.args[0]} backend does; this is {jax.default_backend()}")
    if item.get_closest_marker("cpu_hook") is not None and _backend.active().name != "cpu":
        pytest.skip(f"asserts what the CPU's hook does; the active hook is {_backend.active()!r}")


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory):
    """checkpoint(family, task=None, **overrides) -> path of a tiny saved checkpoint (cached)."""
    made = {}

    def make(family: str, task: str | None = None, **kwargs):
        key = (family, task, repr(sorted(kwargs.items())))  # values may be dicts (id2label)
        if key not in made:
            path = tmp_path_factory.mktemp(f"{family}-{task or 'default'}")
            made[key] = testing.save_tiny_checkpoint(family, path, task=task, **kwargs)
        return made[key]

    return make
