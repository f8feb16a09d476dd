"""JAX's persistent compilation cache, turned on only when the user asks for it.

`hfjax.set_cache_dir(path)` (or $HFJAX_CACHE_DIR, read the first time hfjax compiles a model)
keeps compiled XLA programs, and hfjax's traced generation programs, on disk so that a later
process neither traces nor compiles them again. The `hfjax` command line turns it on by default.
"""

from __future__ import annotations

import os
import pathlib

VARIABLE = "HFJAX_CACHE_DIR"
DEFAULT = pathlib.Path("~/.cache/hfjax/xla")
_OFF = ("", "0", "off", "none")


def set_cache_dir(path: str | os.PathLike | None) -> pathlib.Path | None:
    """Keeps compiled XLA programs on disk under `path`, so that a later process skips compiling.

    This changes JAX's configuration for the whole process: its persistent compilation cache
    goes to `path`, and every program is kept (hfjax sets JAX's minimum compile time and entry
    size for keeping one to 0: a 0.2 s compile repeated at each start is what it saves).

    Args:
      path: a directory (created if missing); None or "off" turns the cache off.

    Returns:
      The cache directory, or None when off.

    Example:
      >>> hfjax.set_cache_dir("~/.cache/hfjax/xla")
    """
    import jax

    if path is None or str(path).lower() in _OFF:
        jax.config.update("jax_enable_compilation_cache", False)
        return None
    directory = pathlib.Path(path).expanduser()
    directory.mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_enable_compilation_cache", True)
    jax.config.update("jax_compilation_cache_dir", str(directory))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return directory


def directory() -> pathlib.Path | None:
    """Where compiled programs are kept: JAX's compilation cache directory, or None while it is off."""
    import jax

    if not jax.config.jax_enable_compilation_cache or not jax.config.jax_compilation_cache_dir:
        return None
    return pathlib.Path(jax.config.jax_compilation_cache_dir)
