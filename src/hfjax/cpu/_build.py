"""Building the CPU kernels (`_kernels.cc`) with the host's C++ compiler, outside any trace.

The library is compiled once per machine (g++ or $CXX, -march=native, the FFI headers that
jaxlib ships) into a private cache directory: ~/.cache/hfjax/kernels, mode 0700 and owned by
the user (else a fresh temporary directory of this process). Its name is a digest of what it is
built from (source, flags, compiler, jaxlib, the CPU's flags); beside it a record holds the
sha256 of its content, which is checked before the library is loaded. A build that fails, or
that takes longer than `timeout_s`, is one warning, and XLA's own operations are used.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import importlib.metadata
import json
import logging
import os
import pathlib
import platform
import shutil
import stat
import subprocess
import tempfile
import threading
import warnings

import jax

logger = logging.getLogger("hfjax")

SOURCE = pathlib.Path(__file__).with_name("_kernels.cc")
TARGETS = {
    "hfjax_rows_times_weight": "HfjaxRowsTimesWeight",
    "hfjax_decode_attention": "HfjaxDecodeAttention",
    "hfjax_rows_times_quantized": "HfjaxRowsTimesQuantized",
}
FLAGS = ("-O3", "-march=native", "-shared", "-fPIC", "-std=c++17", "-w")
TIMEOUT_S = 300.0

_lock = threading.Lock()
_result: dict = {}  # "digest": the loaded library's input digest, or "reason": why it is not loaded


@functools.cache
def cpu_flags() -> frozenset[str]:
    try:
        text = pathlib.Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    line = next((line for line in text.splitlines() if line.startswith("flags")), "")
    return frozenset(line.partition(":")[2].split())


def products() -> bool:
    """Whether the kernels' row products (float32 and quantized) run beside their attention: with
    AVX-512, or on an AVX2 machine where HFJAX_CPU_KERNELS=avx2 asks. On a Zen 3 the AVX2 products
    ran 150m decode at 0.88x (batch 1) and 0.76x (batch 8) XLA's alone, though they kept 93-95%
    beside a busy process where XLA kept 64-79% (benchmarks/README.md). The attention kernel runs on
    both: it lets a decode read its rows of the slot cache in place, over their real lengths."""
    return "avx512f" in cpu_flags() or os.environ.get("HFJAX_CPU_KERNELS") == "avx2"


def compiler() -> tuple[str | None, str]:
    """(the C++ compiler that builds the kernels, or None; why not, where None)."""
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        return None, f"the kernels are for Linux on x86-64, not {platform.system()} on {platform.machine()}"
    flags = cpu_flags()
    if "avx512f" not in flags and not {"avx2", "fma", "f16c"} <= flags:
        return None, "this CPU has neither AVX-512 (avx512f) nor AVX2 with FMA and F16C"
    found = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if not found:
        return None, "no C++ compiler was found (install g++ or set $CXX)"
    return found, ""


def private_directory() -> pathlib.Path:
    """~/.cache/hfjax/kernels (or under $XDG_CACHE_HOME), made 0700; a new temporary directory
    where that one is not the user's own and private."""
    root = pathlib.Path(os.environ.get("XDG_CACHE_HOME") or pathlib.Path.home() / ".cache")
    directory = root / "hfjax" / "kernels"
    try:
        directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        info = directory.lstat()
        if stat.S_ISDIR(info.st_mode) and info.st_uid == os.getuid():
            if stat.S_IMODE(info.st_mode) & 0o077:
                directory.chmod(0o700)
            return directory
        reason = "is not a directory owned by this user"
    except OSError as error:
        reason = f"cannot be used ({error})"
    fallback = pathlib.Path(tempfile.mkdtemp(prefix="hfjax-kernels-"))  # 0700 by construction
    logger.info("hfjax: %s %s; building the CPU kernels in %s for this process", directory, reason, fallback)
    return fallback


def input_digest(command: str) -> str:
    """sha256 of everything the library is built from."""
    digest = hashlib.sha256()
    for part in (
        SOURCE.read_bytes(),
        importlib.metadata.version("jaxlib").encode(),
        command.encode(),
        " ".join(FLAGS).encode(),
        " ".join(sorted(cpu_flags())).encode(),
    ):
        digest.update(part)
    return digest.hexdigest()


def _content_digest(path: pathlib.Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _compile(command: str, library: pathlib.Path, record: pathlib.Path, timeout_s: float) -> None:
    with tempfile.NamedTemporaryFile(dir=library.parent, suffix=".so.tmp", delete=False) as f:
        temporary = pathlib.Path(f.name)
    try:
        subprocess.run(
            [command, *FLAGS, f"-I{jax.ffi.include_dir()}", str(SOURCE), "-o", str(temporary)],
            check=True,
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )
        content = _content_digest(temporary)
        os.replace(temporary, library)  # atomic: another process loads all of it or builds its own
        with tempfile.NamedTemporaryFile("w", dir=library.parent, suffix=".json.tmp", delete=False) as f:
            json.dump({"sha256": content, "source": str(SOURCE), "command": command, "flags": FLAGS}, f)
        os.replace(f.name, record)
    finally:
        temporary.unlink(missing_ok=True)


def _verified(library: pathlib.Path, record: pathlib.Path) -> bool:
    try:
        expected = json.loads(record.read_text())["sha256"]
        return library.is_file() and _content_digest(library) == expected
    except (OSError, ValueError, KeyError, TypeError):
        return False


def build(timeout_s: float = TIMEOUT_S) -> str | None:
    """Builds (once per machine), checks and loads the kernels, and registers them with XLA.

    Never call it inside a trace: it may run the compiler. Later calls return at once.

    Returns:
      The library's input digest, or None where the kernels are not used (`reason()` says why).
    """
    with _lock:
        if not _result:
            _result.update(_build(timeout_s))
        return _result.get("digest")


def built() -> str | None:
    """The digest of the kernels loaded in this process, without building: None if not loaded."""
    return _result.get("digest")


def reason() -> str | None:
    """Why the kernels are not loaded (None once loaded, or before `build` ran)."""
    return _result.get("reason")


def _build(timeout_s: float) -> dict:
    command, why_not = compiler()
    if command is None:
        return {"reason": why_not}
    digest = input_digest(command)
    directory = private_directory()
    library, record = directory / f"rows-{digest[:20]}.so", directory / f"rows-{digest[:20]}.json"
    try:
        if not _verified(library, record):
            if library.exists():
                logger.warning("hfjax: %s does not match its recorded sha256; building it again", library)
            logger.info("hfjax: building the CPU kernels with %s (once per machine)", command)
            _compile(command, library, record, timeout_s)
            if not _verified(library, record):
                raise OSError(f"{library} changed while it was built")
        loaded = ctypes.cdll.LoadLibrary(str(library))
        for target, symbol in TARGETS.items():
            jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(loaded, symbol)), platform="cpu")
    except subprocess.TimeoutExpired:
        return _failed(f"the compiler took longer than {timeout_s:.0f} s")
    except subprocess.CalledProcessError as error:
        return _failed(f"the compiler failed: {(error.stderr or '').strip()[-2000:]}")
    except (OSError, AttributeError) as error:
        return _failed(str(error))
    return {"digest": digest}


def _failed(why: str) -> dict:
    warnings.warn(
        f"hfjax: the CPU kernels for decoding did not build ({why}); XLA's own products and attention are used instead",
        stacklevel=4,
    )
    return {"reason": why}
