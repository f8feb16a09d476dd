"""Shared fixtures: tiny checkpoints are written once per session and reused."""

from __future__ import annotations

import os
import tempfile

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # see hfjax/__init__.py

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Compiled programs go to a cache of this session, not the user's ~/.cache/hfjax.
os.environ.setdefault("HFJAX_CACHE_DIR", tempfile.mkdtemp(prefix="hfjax-test-xla-"))

import pytest
import torch

from hfjax import testing

torch.set_num_threads(2)


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory):
    """checkpoint(family, task=None, **overrides) -> path of a tiny saved checkpoint (cached)."""
    made = {}

    def make(family: str, task: str | None = None, **kwargs):
        key = (family, task, tuple(sorted(kwargs.items())))
        if key not in made:
            path = tmp_path_factory.mktemp(f"{family}-{task or 'default'}")
            made[key] = testing.save_tiny_checkpoint(family, path, task=task, **kwargs)
        return made[key]

    return make
