"""Notes that other libraries print when hfjax calls them and that hfjax cannot avoid, silenced
around those calls only: the filters are undone when each call returns, so a user's own calls
still get every warning.

    torch_code()           around torch code that hfjax runs on JAX (`bridge.bound`)
    no_torchvision_note()  around loading a diffusers pipeline
    peft_wrapping()        around wrapping a model for LoRA with peft
"""

from __future__ import annotations

import contextlib
import logging
import warnings

# torchax runs JAX with 32-bit integers and floats by design: model code's casts to 64 bits give
# 32-bit arrays, and JAX notes each one, with advice to turn on x64 that would break torchax.
_X64_NOTE = r"Explicitly requested dtype (int|uint|float|complex)(64|128)"


@contextlib.contextmanager
def torch_code():
    """Silences JAX's note on each 64-bit cast in torch code that hfjax runs (see _X64_NOTE), and
    transformers' advice to install a CUDA kernel package (`_kernel_advice`)."""
    logger = logging.getLogger("transformers.integrations.hub_kernels")
    added = _kernel_advice not in logger.filters  # (torch code within torch code: the outer block removes it)
    if added:
        logger.addFilter(_kernel_advice)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=_X64_NOTE, category=UserWarning)
            yield
    finally:
        if added:
            logger.removeFilter(_kernel_advice)


def _kernel_advice(record: logging.LogRecord) -> bool:
    """False for transformers' note that a function "is falling back to its reference PyTorch
    implementation" and that installing mamba_ssm or causal_conv1d would be faster: those are CUDA
    kernels for PyTorch, which do not run under JAX, and what XLA compiles is the reference (the
    selective scan as one `lax.scan`: `bridge/_scans.py`). transformers logs each note once per
    process, so PyTorch run later in the same process does not give it either."""
    return "falling back to its reference PyTorch implementation" not in record.getMessage()


@contextlib.contextmanager
def peft_wrapping():
    """Silences transformers 5.24's FutureWarning that `is_gradient_checkpointing` is deprecated,
    which peft's `PeftModel` raises by reading it (peft 0.21; a property cannot be shadowed)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning)
        yield


def _torchvision_note(record: logging.LogRecord) -> bool:
    return "requires torchvision (not installed); falling back" not in record.getMessage()


@contextlib.contextmanager
def no_torchvision_note():
    """Silences transformers' note that an image processor falls back to its PIL version without
    torchvision. Diffusers' pipelines name transformers' CLIP image processors; the PIL versions
    are what a pipeline run needs, and torchvision is not one of hfjax's dependencies."""
    logger = logging.getLogger("transformers.utils.import_utils")
    logger.addFilter(_torchvision_note)
    try:
        yield
    finally:
        logger.removeFilter(_torchvision_note)
