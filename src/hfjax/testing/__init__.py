"""Tiny random Hugging Face checkpoints and pipelines for tests, demos and bug reports.

Every factory writes exactly what a hub checkpoint holds, so code under test loads it through
the same path a real model takes:

    path = save_tiny_checkpoint("llama", tmp_path / "llama")
    model = transformers.AutoModelForCausalLM.from_pretrained(path)

A checkpoint directory holds config.json (with `architectures`), model.safetensors (or shards
plus model.safetensors.index.json), generation_config.json for generative models, and tokenizer
files (tokenizer.json, tokenizer_config.json, chat_template.jinja). The tokenizer is a
byte-level BPE trained in-process on a short embedded English text, so no network access is
needed. Models have 85k to 235k parameters: hidden size 64, 2 layers, 4 attention heads of
size 16 (2 key/value heads where the family has GQA).

Parts: `_families.py` (tiny config sizes per model_type), `_tokenizer.py`, `_checkpoints.py`,
`_diffusion.py` (diffusers pipelines). They depend on torch, transformers, tokenizers and
diffusers, not on the rest of hfjax.

Vision-language checkpoints (image-text-to-text: LLaVA, Qwen2-VL, Gemma 3, Idefics3,
PaliGemma) with their processors are in `_vision_language.py`:
`save_tiny_checkpoint(family, path, task="image-text-to-text")`.

Public names: `FAMILIES`, `GENERATION_FAMILIES`, `tiny_config`, `tiny_tokenizer`,
`save_tiny_checkpoint`, `MEDIA_FAMILIES` (vision and speech families for `save_tiny_checkpoint`,
processors included: `_media.py`), `PIPELINE_KINDS`, `SCHEDULERS`, `save_tiny_pipeline`,
`VISION_LANGUAGE_FAMILIES`, `tiny_processor`, `save_tiny_adapter` (a peft LoRA adapter of a tiny
checkpoint: `_adapters.py`).
"""

from ._adapters import save_tiny_adapter
from ._checkpoints import save_tiny_checkpoint, tiny_tokenizer
from ._diffusion import PIPELINE_KINDS, SCHEDULERS, save_tiny_pipeline
from ._families import FAMILIES, GENERATION_FAMILIES, tiny_config
from ._media import MEDIA_FAMILIES
from ._vision_language import VISION_LANGUAGE_FAMILIES, tiny_processor

__all__ = [
    "FAMILIES",
    "GENERATION_FAMILIES",
    "MEDIA_FAMILIES",
    "PIPELINE_KINDS",
    "SCHEDULERS",
    "VISION_LANGUAGE_FAMILIES",
    "save_tiny_adapter",
    "save_tiny_checkpoint",
    "save_tiny_pipeline",
    "tiny_config",
    "tiny_processor",
    "tiny_tokenizer",
]
