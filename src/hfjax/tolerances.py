"""The one table of numeric tolerances hfjax is held to, each with its reason.

Every parity check (tests, `hfjax check`, benchmarks) reads its bound from here. Values compare
float32 outputs of tiny random models whose logits are O(1) against the same computation run by
PyTorch (or numpy in float64).
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Tolerance:
    atol: float
    why: str
    rtol: float = 0.0


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

# Single ops against torch (or float64 numpy).
MATMUL = Tolerance(1e-5, "one float32 product of O(1) values: XLA and ATen sum the same terms in another order")
EXACT = Tolerance(0.0, "copies, index searches, boolean reductions and integer math have one right answer")
DIVISION = Tolerance(1e-6, "a float32 division of O(1) values: XLA rounds it up to 1 ulp (6e-8) from ATen")
SCHEDULE = Tolerance(
    0.0,
    "a diffusion noise schedule in float32 (JAX) against float64 (numpy, in diffusers): float32's rounding",
    rtol=1e-5,
)
BIASES = Tolerance(1e-6, "a few float32 additions of biases to O(1) scores, in another order than torch's")
UNIT_NORM = Tolerance(1e-5, "an L2-normalised float32 vector's norm is 1 up to float32 rounding")
PRINTED_4_DECIMALS = Tolerance(
    5.1e-5, "a probability printed with 4 decimals: half a unit of the last digit, and float32"
)
JSON_FLOATS = Tolerance(1e-6, "probabilities written to JSON and read back: float32 values through Python floats")

# hfjax.pipeline against transformers.pipeline (tiny models, float32).
PIPELINE_SCORES = Tolerance(
    1e-5,
    "probabilities (softmax / sigmoid of DEFAULT-close float32 logits of tiny models, ~1e-6 apart) that "
    "transformers' pipelines return as Python floats",
)
RESAMPLING = Tolerance(
    1e-4,
    "audio resampled by soxr's HQ filter against the exact signal at the new rate (tones below 0.8 of the "
    "lower rate's Nyquist frequency, 20 ms clear of the ends): the filter's passband ripple and its "
    "float32 output, up to 2e-5 measured",
)
LOSSY_AUDIO = Tolerance(
    0.2,
    "Vorbis and MP3 files decoded by libsndfile against the 16-bit PCM they encoded (tones summing to "
    "at most 0.8): the codecs' loss at libsndfile's default quality, up to 0.14 measured",
)

# Training: the same steps taken by torch.optim and by hfjax's trainer (3 steps of tiny models).
TRAINING_SGD = Tolerance(
    1e-4,
    "per-step losses, gradient norms and final logits after a few SGD steps: each step's gradient "
    "differs from torch's by float32 rounding (~1e-7) and the rate multiplies it into the weights",
    rtol=1e-4,
)
TRAINING_ADAMW = Tolerance(
    1e-3,
    "as TRAINING_SGD, with Adam: its update g / (sqrt(v) + eps) is ~lr in size whatever the gradient's, "
    "so rounding in near-zero gradient entries becomes full-size differences in the weights",
    rtol=1e-3,
)
TRAINING_BF16 = Tolerance(
    5e-2,
    "losses of a bfloat16 forward and backward (float32 weights) against float32 torch: bfloat16 keeps "
    "8 bits of mantissa, ~4e-3 relative per value, over a loss of ~6",
    rtol=0.0,
)

PACKING = Tolerance(
    1e-4,
    "an example's logits packed after another (position ids from 0, transformers' packed-sequence "
    "mask) against it alone: the same float32 sums over a longer, masked row; a leak between the "
    "examples moves them by ~0.1",
)

# LoRA adapters served beside the base (hfjax.lora).
LORA = Tolerance(
    1e-4,
    "an adapter's product added beside the base layer's (x W + s (x A) B) against peft's forward: the same "
    "float32 terms summed in another order, logits O(1), as DEFAULT",
)

# Quantized weights (hfjax.quantization).
QUANTIZED_PARITY = Tolerance(
    1e-4,
    "a quantized model against PyTorch running the float weights its quantized ones stand for: the same "
    "weights, but hfjax scales a per-channel product's output where PyTorch scales the weight first, and "
    "the CPU kernel sums each group of inputs apart; float32 rounding of O(1) logits, as DEFAULT",
)
FLOAT16_PRODUCT = Tolerance(
    0.0,
    "a product of exact float16 factors rounded to float16 once (compressed-tensors dequantizes AWQ's "
    "float16 scales in float16): at most half an ulp, 2^-11 of the value; bound 2^-10",
    rtol=2.0**-10,
)
# The logits of a tiny random Llama quantized, against the same model unquantized (relative L2 of the
# logits, in rtol). Each mode's rounding of a weight row of N(0, s) values has an RMS error of about a
# step / sqrt(12): int8's step is 2 max|w| / 255, ~0.7% of s; e4m3 keeps 3 mantissa bits, ~2.5%;
# int4's is (max - min) / 15 over a group, ~10%. The logits' relative error follows the weights' (the
# errors of a layer's inputs average out over its rows); the bounds are three times those sizes, so
# a layer whose scales or packing are wrong (an error near 1) fails.
QUANTIZED_LOGITS: dict[str, Tolerance] = {
    "int8": Tolerance(0.0, "int8 per output channel: weights rounded by ~0.7% (RMS), bound 3x", rtol=0.02),
    "fp8": Tolerance(0.0, "fp8 e4m3 per output channel: weights rounded by ~2.5% (RMS), bound 3x", rtol=0.07),
    "int4": Tolerance(0.0, "int4 groups, min to max in 15 steps: weights rounded by ~10% (RMS), bound 3x", rtol=0.3),
}

# Diffusion images are compared by PSNR, not elementwise.
IMAGE_PSNR_DB = Tolerance(
    40.0, "images in [0, 1] from 20 steps; round-off compounds over steps, 40 dB is visually identical"
)


def for_dot_products(length: int) -> Tolerance:
    """MATMUL for float32 dot products of `length` terms against float64: the rounding of a sum
    grows with the square root of its length."""
    return Tolerance(MATMUL.atol * length**0.5, f"{MATMUL.why}; {length} terms: MATMUL x sqrt({length})")


def for_family(model_type: str | None) -> Tolerance:
    """The tolerance for a model_type (DEFAULT unless the table names it)."""
    return BY_FAMILY.get(model_type or "", DEFAULT)
