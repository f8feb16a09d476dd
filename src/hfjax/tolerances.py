"""The one table of numeric tolerances hfjax is held to against PyTorch.

Every parity check (tests, `hfjax check`, benchmarks) reads its bound from here.
Values compare float32 outputs of tiny random models whose logits are O(1).
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Tolerance:
    atol: float
    why: str


DEFAULT = Tolerance(
    1e-4,
    "float32 forward: XLA and torch order reductions (matmul, softmax, norms) differently; "
    "tiny models show ~1e-6, so 1e-4 flags real bugs and not round-off",
)

# Families whose arithmetic amplifies round-off beyond DEFAULT.
BY_FAMILY: dict[str, Tolerance] = {
    "mamba": Tolerance(5e-4, "the selective scan accumulates a recurrence over the sequence in a different order"),
    "recurrent_gemma": Tolerance(5e-4, "the RG-LRU recurrence and its sqrt/exp gates amplify round-off over steps"),
    "falcon_mamba": Tolerance(5e-4, "same selective scan as mamba"),
    "mamba2": Tolerance(5e-4, "chunked SSD scan sums in a different order"),
}

# Diffusion images are compared by PSNR, not elementwise.
IMAGE_PSNR_DB = Tolerance(40.0, "images in [0, 1] from 20 steps; round-off compounds over steps, 40 dB is visually identical")


def for_family(model_type: str | None) -> Tolerance:
    """The tolerance for a model_type (DEFAULT unless the table names it)."""
    return BY_FAMILY.get(model_type or "", DEFAULT)
