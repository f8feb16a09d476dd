"""hfjax's CPU kernels for decoding, built on first use with the host's C++ compiler.

Decoding multiplies a few rows of activations (one per sequence) by every Linear weight, and
attends with one new token per sequence over the cache. XLA:CPU gives the small products to
a general matrix-multiply library (YNNPACK) that packs a weight into tiles first, and runs
attention as two such products with seven fusions between them. `_cpu_kernels.cc` reads a
weight once, straight through (at 8 rows, 12 768x3072 weights in 2.3-2.5 ms where XLA took
3.0-3.1 ms), and attends in one pass over the cache. Its own helper threads stay awake
between the ~85 products of a decoding step, so each product starts on every core at once,
where XLA's pool wakes a sleeping thread for each (benchmarks/README.md).

The kernels are XLA FFI custom calls (`jax.ffi`). `library()` compiles them once per machine
into ~/.cache/hfjax/kernels (g++ or $CXX, -march=native, the FFI headers that jaxlib ships),
loads them and registers them with XLA. Without Linux on x86-64 with AVX-512, without a
compiler, or with HFJAX_CPU_KERNELS=0, it returns None and XLA's own operations are used; so
they are under a mesh of several devices, where a custom call could not be partitioned.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import importlib.metadata
import os
import pathlib
import platform
import shutil
import subprocess
import tempfile
import warnings

import jax
import jax.numpy as jnp
import numpy as np

PRODUCT = "hfjax_rows_times_weight"  # XLA custom-call targets
ATTENTION = "hfjax_decode_attention"
TARGETS = {PRODUCT: "HfjaxRowsTimesWeight", ATTENTION: "HfjaxDecodeAttention"}  # -> handlers in the library
ROWS = range(1, 9)  # activation rows the product takes (batch x new tokens)
QUERY_ROWS = range(1, 9)  # query rows per key/value head that attention takes (heads per group x tokens)
_SOURCE = pathlib.Path(__file__).with_name("_cpu_kernels.cc")
_FLAGS = ("-O3", "-march=native", "-shared", "-fPIC", "-std=c++17", "-w")


def _cpu_flags() -> set[str]:
    try:
        text = pathlib.Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    line = next((line for line in text.splitlines() if line.startswith("flags")), "")
    return set(line.partition(":")[2].split())


def _kernel_dir() -> pathlib.Path:
    cache = os.environ.get("XDG_CACHE_HOME") or pathlib.Path.home() / ".cache"
    return pathlib.Path(cache) / "hfjax" / "kernels"


def compiler() -> str | None:
    """The C++ compiler that builds the kernel, where this machine can run it (Linux on x86-64
    with AVX-512, not turned off by HFJAX_CPU_KERNELS=0); None elsewhere."""
    if os.environ.get("HFJAX_CPU_KERNELS", "1") == "0":
        return None
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        return None
    if "avx512f" not in _cpu_flags():
        return None
    return os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")


def _build(command: str, path: pathlib.Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=path.parent, suffix=".so.tmp", delete=False) as f:
        temporary = pathlib.Path(f.name)
    try:
        subprocess.run([command, *_FLAGS, f"-I{jax.ffi.include_dir()}", str(_SOURCE), "-o", str(temporary)],
                       check=True, capture_output=True, text=True)
        os.replace(temporary, path)  # atomic: another process loads all of it or builds its own
    finally:
        temporary.unlink(missing_ok=True)


@functools.cache
def library() -> str | None:
    """Digest of the kernel registered with XLA in this process, or None where it is not used."""
    command = compiler()
    if command is None:
        return None
    digest = hashlib.sha256()
    for part in (_SOURCE.read_bytes(), importlib.metadata.version("jaxlib").encode(), command.encode(),
                 " ".join(_FLAGS).encode(), " ".join(sorted(_cpu_flags())).encode()):
        digest.update(part)
    name = f"rows-{digest.hexdigest()[:20]}.so"
    path = _kernel_dir() / name
    try:
        if not path.is_file():
            try:
                _build(command, path)
            except OSError:  # an unwritable cache: build for this process only
                path = pathlib.Path(tempfile.mkdtemp(prefix="hfjax-kernels-")) / name
                _build(command, path)
        built = ctypes.cdll.LoadLibrary(str(path))
        for target, symbol in TARGETS.items():
            jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(built, symbol)), platform="cpu")
    except (OSError, AttributeError, subprocess.CalledProcessError) as error:
        detail = getattr(error, "stderr", None) or error
        warnings.warn(f"hfjax: the CPU kernels for decoding did not build ({detail}); "
                      "XLA's own products and attention are used instead", stacklevel=2)
        return None
    return digest.hexdigest()


def usable(*arrays: jax.Array) -> bool:
    """Whether the kernel takes float32 `arrays` here: on a single CPU device, once built."""
    return (
        all(a.dtype == jnp.float32 for a in arrays)
        and jax.default_backend() == "cpu"
        and jax.device_count() == 1
        and library() is not None
    )


def rows_times_weight(rows: jax.Array, weight: jax.Array) -> jax.Array:
    """rows [R, K] @ weight [N, K].T -> [R, N] for R <= 8, float32, through the kernel."""
    result = jax.ShapeDtypeStruct((rows.shape[0], weight.shape[0]), jnp.float32)
    return jax.ffi.ffi_call(PRODUCT, result, vmap_method="sequential")(rows, weight)


def decode_attention(query, key, value, bias, scale: float) -> jax.Array:
    """Attention of a few query rows per key/value head, float32, through the kernel.

    query [B, H, R, D] (R in QUERY_ROWS); key and value [B, H, S, D] and [B, H, S, Dv] in any
    shape with those elements (the decode loop carries a batch of 1 without its size-1 axes,
    and reshaping it back would make XLA copy the cache); bias [B, L, S], added to the scores
    of query row r from its row r % L (-inf where a row may not look) -> [B, H, R, Dv].
    """
    batch, heads, rows, _ = query.shape
    value_depth = value.size // (batch * heads * bias.shape[-1])
    result = jax.ShapeDtypeStruct((batch, heads, rows, value_depth), jnp.float32)
    return jax.ffi.ffi_call(ATTENTION, result, vmap_method="sequential")(query, key, value, bias, scale=np.float32(scale))
