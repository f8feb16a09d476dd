"""The model families of `hfjax.testing`: tiny config sizes per transformers model_type.

Hand-tuned entries in `REGISTRY`; any other model_type with a text head is shrunk from its
config class's defaults by field name.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import functools
from collections.abc import Mapping
from typing import Any, Literal

import transformers

from .. import _tasks
from ._tokenizer import BOS_ID, EOS_ID, MAX_POSITIONS, PAD_ID, VOCAB_SIZE

Kind = Literal["causal", "encoder", "seq2seq"]

DEFAULT_TASK: dict[str, str] = {
    "causal": "text-generation",
    "encoder": "feature-extraction",
    "seq2seq": "text2text-generation",
}
KIND_TASKS: dict[str, tuple[str, ...]] = {
    "causal": ("text-generation", "text-classification", "feature-extraction"),
    # text-generation: where transformers has a causal LM class (BertLMHeadModel), built as a decoder
    "encoder": ("text-classification", "feature-extraction", "text-generation"),
    # text-generation: the decoder alone, where transformers has a causal LM class (BartForCausalLM)
    "seq2seq": ("text2text-generation", "text-generation", "text-classification", "feature-extraction"),
}

_HIDDEN, _HEADS, _KV_HEADS, _HEAD_DIM, _INTERMEDIATE, _LAYERS = 64, 4, 2, 16, 128, 2
_SLIDING_WINDOW = 64
_TOKEN_IDS = {"pad_token_id": PAD_ID, "bos_token_id": BOS_ID, "eos_token_id": EOS_ID}
_MHA = {
    "hidden_size": _HIDDEN,
    "intermediate_size": _INTERMEDIATE,
    "num_hidden_layers": _LAYERS,
    "num_attention_heads": _HEADS,
    "max_position_embeddings": MAX_POSITIONS,
}
_GQA = {**_MHA, "num_key_value_heads": _KV_HEADS}
_GQA_HEAD_DIM = {**_GQA, "head_dim": _HEAD_DIM}
# GPT-2 and GPT-J name the same sizes differently.
_GPT2_NAMES = {
    "n_embd": _HIDDEN,
    "n_inner": _INTERMEDIATE,
    "n_layer": _LAYERS,
    "n_head": _HEADS,
    "n_positions": MAX_POSITIONS,
}


@dataclasses.dataclass(frozen=True)
class Family:
    """How to make one family's transformers config tiny."""

    kind: Kind
    config: Mapping[str, Any]
    # GenerationConfig fields beyond the token ids (transformers 5 configs drop these).
    generation: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    # False for families built by the generic shrinker: they may use any task that
    # transformers has a model class for, whatever their kind.
    curated: bool = True


# One entry per family: the keyword arguments, beyond token ids and vocab size, that make
# its transformers config tiny. Adding a family is adding a line here.
REGISTRY: dict[str, Family] = {
    "llama": Family("causal", _GQA_HEAD_DIM),
    "mistral": Family("causal", {**_GQA_HEAD_DIM, "sliding_window": _SLIDING_WINDOW}),
    "mixtral": Family(
        "causal", {**_GQA_HEAD_DIM, "intermediate_size": 64, "num_local_experts": 4, "num_experts_per_tok": 2}
    ),
    "qwen2": Family("causal", _GQA),
    "qwen3": Family("causal", _GQA_HEAD_DIM),
    "qwen3_moe": Family(
        "causal", {**_GQA_HEAD_DIM, "moe_intermediate_size": 64, "num_experts": 4, "num_experts_per_tok": 2}
    ),
    "gemma": Family("causal", _GQA_HEAD_DIM),
    # Gemma 2 alternates sliding and global layers; 2 layers give one of each.
    "gemma2": Family(
        "causal", {**_GQA_HEAD_DIM, "query_pre_attn_scalar": _HEAD_DIM, "sliding_window": _SLIDING_WINDOW}
    ),
    # Gemma 3's default pattern has 5 sliding layers per global one; 2 layers would have
    # no global layer, so alternate them.
    "gemma3_text": Family(
        "causal",
        {
            **_GQA_HEAD_DIM,
            "query_pre_attn_scalar": _HEAD_DIM,
            "sliding_window": _SLIDING_WINDOW,
            "sliding_window_pattern": 2,
        },
    ),
    "phi": Family("causal", _GQA),
    "phi3": Family("causal", {**_GQA, "original_max_position_embeddings": MAX_POSITIONS}),
    "gpt2": Family("causal", _GPT2_NAMES),
    "gpt_neox": Family("causal", _MHA),
    "gptj": Family("causal", {**_GPT2_NAMES, "rotary_dim": _HEAD_DIM // 2}),
    # Falcon-7B layout (multi-query attention, parallel attention and MLP), the default.
    "falcon": Family(
        "causal",
        {
            "hidden_size": _HIDDEN,
            "ffn_hidden_size": _INTERMEDIATE,
            "num_hidden_layers": _LAYERS,
            "num_attention_heads": _HEADS,
            "max_position_embeddings": MAX_POSITIONS,
        },
    ),
    "opt": Family(
        "causal",
        {
            "hidden_size": _HIDDEN,
            "ffn_dim": _INTERMEDIATE,
            "word_embed_proj_dim": _HIDDEN,
            "num_hidden_layers": _LAYERS,
            "num_attention_heads": _HEADS,
            "max_position_embeddings": MAX_POSITIONS,
        },
    ),
    "bloom": Family("causal", {"hidden_size": _HIDDEN, "n_layer": _LAYERS, "n_head": _HEADS}),
    "olmo": Family("causal", _GQA),
    # Multi-head latent attention (one key/value head per query head); layer 0 is dense
    # and layer 1 mixture-of-experts, with 4 routed experts in 2 groups and 1 shared.
    "deepseek_v3": Family(
        "causal",
        {
            **_GQA,
            "num_key_value_heads": _HEADS,
            "q_lora_rank": 32,
            "kv_lora_rank": 32,
            "qk_rope_head_dim": 8,
            "qk_nope_head_dim": 8,
            "v_head_dim": _HEAD_DIM,
            "moe_intermediate_size": 32,
            "n_routed_experts": 4,
            "n_shared_experts": 1,
            "num_experts_per_tok": 2,
            "n_group": 2,
            "topk_group": 1,
            "first_k_dense_replace": 1,
        },
    ),
    "mamba": Family("causal", {"hidden_size": _HIDDEN, "state_size": 16, "num_hidden_layers": _LAYERS, "expand": 2}),
    # One recurrent block and one local-attention block.
    "recurrent_gemma": Family(
        "causal",
        {
            "hidden_size": _HIDDEN,
            "intermediate_size": _INTERMEDIATE,
            "num_hidden_layers": _LAYERS,
            "num_attention_heads": _HEADS,
            "num_key_value_heads": _KV_HEADS,
            "lru_width": _HIDDEN,
            "attention_window_size": _SLIDING_WINDOW,
            "block_types": ["recurrent", "attention"],
        },
    ),
    "bert": Family("encoder", _MHA),
    # RoBERTa numbers positions from pad_token_id + 1, so it needs extra position rows
    # to take 256 tokens (as roberta-base has 514 for 512).
    "roberta": Family("encoder", {**_MHA, "max_position_embeddings": MAX_POSITIONS + 2}),
    # Layer 0 global attention, layer 1 local (sliding) attention.
    "modernbert": Family(
        "encoder", {**_MHA, "local_attention": _SLIDING_WINDOW, "cls_token_id": BOS_ID, "sep_token_id": EOS_ID}
    ),
    "t5": Family(
        "seq2seq",
        {
            "d_model": _HIDDEN,
            "d_kv": _HEAD_DIM,
            "d_ff": _INTERMEDIATE,
            "num_layers": _LAYERS,
            "num_decoder_layers": _LAYERS,
            "num_heads": _HEADS,
            "decoder_start_token_id": PAD_ID,
        },
    ),
    "bart": Family(
        "seq2seq",
        {
            "d_model": _HIDDEN,
            "encoder_layers": _LAYERS,
            "decoder_layers": _LAYERS,
            "encoder_attention_heads": _HEADS,
            "decoder_attention_heads": _HEADS,
            "encoder_ffn_dim": _INTERMEDIATE,
            "decoder_ffn_dim": _INTERMEDIATE,
            "max_position_embeddings": MAX_POSITIONS,
            "decoder_start_token_id": EOS_ID,
            "forced_eos_token_id": EOS_ID,
        },
        # As facebook/bart-large: decoding starts with eos, then bos is forced.
        generation={"forced_bos_token_id": BOS_ID},
    ),
}

FAMILIES: tuple[str, ...] = tuple(REGISTRY)
"""Model families with a hand-tuned tiny checkpoint, named by their transformers `model_type`.

Any other `model_type` with a causal-LM, seq2seq-LM or sequence-classification model class
also works: `tiny_config` then shrinks the config class's defaults by field name."""

GENERATION_FAMILIES: tuple[str, ...] = tuple(name for name, spec in REGISTRY.items() if spec.kind != "encoder")
"""The families that generate text: causal LMs and encoder-decoders."""


# Generic shrinking: a config field with one of these names, where the model_type's config
# class has it, gets this value. Names are those the config stores, not attribute aliases.
_GENERIC_SIZES: dict[str, int] = {
    **dict.fromkeys(("hidden_size", "d_model", "n_embd", "dim"), _HIDDEN),
    **dict.fromkeys(
        ("num_hidden_layers", "n_layer", "num_layers", "num_decoder_layers", "encoder_layers", "decoder_layers"),
        _LAYERS,
    ),
    **dict.fromkeys(
        ("num_attention_heads", "n_head", "num_heads", "encoder_attention_heads", "decoder_attention_heads"),
        _HEADS,
    ),
    **dict.fromkeys(("head_dim", "d_kv"), _HEAD_DIM),
    **dict.fromkeys(
        ("intermediate_size", "ffn_dim", "d_ff", "n_inner", "encoder_ffn_dim", "decoder_ffn_dim"), _INTERMEDIATE
    ),
    "vocab_size": VOCAB_SIZE,
    **dict.fromkeys(("max_position_embeddings", "n_positions"), MAX_POSITIONS),
    **dict.fromkeys(("num_experts", "num_local_experts", "n_routed_experts"), 4),
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 64,
    "encoder_hidden_size": _HIDDEN,  # cross-attention to an encoder shrunk as above (BLIP-2's Q-Former)
}

# Vision towers that initialise their weights with std 1e-10 (BLIP's, Pix2Struct's, a SAM-style one; trained
# checkpoints replace them): at that size a random tower's output does not depend on the image, and parity
# would not test it.
_VISIBLE_IMAGE = {"initializer_range": 0.02}
# BLIP-2 / InstructBLIP: a vision tower as above; the Q-Former's 32 query outputs take 32 positions of
# the language model's input (per video frame): 8.
_BLIP_QUERIES = {"vision_config": _VISIBLE_IMAGE, "num_query_tokens": 8}

# Cohere Compass's text model: rotary parameters are per layer type and default to none at all (the
# model reads one entry per type): a sliding-window layer with M-RoPE (the default sections
# [24, 20, 20] of 64 scaled to the tiny head's 8) and a global layer without positions (NoPE), as
# Cohere2's pattern.
_COHERE_COMPASS_TEXT = {
    "layer_types": ["sliding_attention", "full_attention"],
    "rope_parameters": {
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 2, 2]},
        "full_attention": None,
    },
}
# Qwen4-Exp's attention layers pick tokens with a QSA indexer whose sizes default to None (the default
# config cannot build one): 4 query heads and the 1 key head it requires, 16 wide (not under the
# rotary width), a budget of 2 blocks of 2 tokens.
_QSA_INDEXER = {
    "indexer_n_heads": _HEADS,
    "indexer_kv_heads": 1,
    "indexer_head_dim": _HEAD_DIM,
    "indexer_budget": 4,
    "indexer_compress_ratio": 2,
}

# Generic model types whose default config ties a field to the full model's sizes; set on top of
# the generic shrink, so that PyTorch can run the tiny model ("pytorch-fails" in docs/coverage.md).
_GENERIC_FIXES: dict[str, dict[str, Any]] = {
    "gpt_neo": {"attention_types": [[["global", "local"], 1]]},  # one (global, local) pair per 2 layers
    "codegen": {"rotary_dim": _HEAD_DIM},  # rotary over the whole 16-wide head, not 64
    "mamba2": {"num_heads": 8, "head_dim": 16, "n_groups": 1},  # heads * head_dim = expand (2) * hidden
    "nemotron": {"num_key_value_heads": _HEADS},  # its default None breaks its own attention
    # one entry per layer; two hybrid layers, as the shared transformer's tied weights need
    "zamba": {"layers_block_type": ["hybrid", "hybrid"], "attention_head_dim": 2 * _HIDDEN // _HEADS},
    # its mamba's defaults (128 heads, a 256-wide state, chunks of 256) made transformers 5.17's scan
    # allocate 24 GiB for three short prompts
    "falcon_h1": {
        "mamba_n_heads": 8,
        "mamba_d_head": 8,
        "mamba_d_ssm": 64,
        "mamba_d_state": 16,
        "mamba_chunk_size": 16,
    },
    "zamba2": {
        "layers_block_type": ["mamba", "hybrid"],
        "hybrid_layer_ids": [1],
        "attention_head_dim": 2 * _HIDDEN // _HEADS,
        "mamba_headdim": _HEAD_DIM,
    },
    # as the released checkpoint: clip_qkv set (its default None fails torch.clamp), rope_theta given
    "dbrx": {
        "n_heads": _HEADS,
        "n_layers": _LAYERS,
        "max_seq_len": 256,
        "attn_config": {"kv_n_heads": 2, "rope_theta": 10000.0, "clip_qkv": 8.0},
        "ffn_config": {"ffn_hidden_size": _INTERMEDIATE, "moe_num_experts": 4, "moe_top_k": 2, "hidden_size": _HIDDEN},
    },
    # Multimodal rotary sections that the model code defaults (not the config): scaled to the tiny head's
    # rotary half (8; glm4v_moe rotates half the head: 4).
    **{
        model_type: {
            "text_config": {"rope_parameters": {"rope_type": "default", "rope_theta": theta, "mrope_section": sections}}
        }
        for model_type, theta, sections in (
            ("qwen2_5_vl", 1000000.0, [2, 3, 3]),
            ("paddleocr_vl", 500000.0, [2, 3, 3]),
            ("glm4v", 10000.0, [2, 3, 3]),
            ("glm46v", 10000.0, [2, 3, 3]),
            ("glm_ocr", 10000.0, [2, 3, 3]),
            ("glmga", 10000.0, [2, 3, 3]),
        )
    },
    "glm4v_moe": {
        "text_config": {
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 10000.0,
                "partial_rotary_factor": 0.5,
                "mrope_section": [1, 2, 1],
            }
        }
    },
    # -- vision and speech (testing._media.save_generic_media_checkpoint) --
    # Blip2ForImageTextRetrieval runs the text through the Q-Former, whose text layers this adds. The
    # rest: see `_BLIP_QUERIES` (pixels block).
    "blip-2": {
        "qformer_config": {"use_qformer_text_input": True},
        **_BLIP_QUERIES,
        "image_token_index": VOCAB_SIZE - 1,
    },
    # The classifier reads hidden_sizes[-1], the stages' widths are stage_out_channels (not shrunk).
    "hgnet_v2": {"hidden_sizes": [256, 512, 1024, 2048]},
    # The layers of the image encoder whose features the decoder fuses: 2 layers, not 24.
    "depth_pro": {"intermediate_hook_ids": [1, 0]},
    # Perceiver's latents are sized apart from d_model (1280 wide, 256 of them).
    "perceiver": {"d_latents": 64, "num_latents": 16, "num_self_attends_per_block": 2, "num_cross_attention_heads": 1},
    # -- text models: sizes tied to the full model (MLA and MoE, per-layer lists) --
    # 2 groups of the 4 routed experts (the default 8 groups leave none per group), 1 group picked
    "axk1": {"n_group": 2, "topk_group": 1},
    "kimi_k25": {"text_config": {"n_group": 2, "topk_group": 1}},
    # MLP and expert widths under its own names; top 2 of the 4 routed and 2 zero (identity) experts,
    # not top 12 of 4 + 256. Each of its num_layers holds 2 attention layers: 1 of them.
    "longcat_flash": {
        "num_layers": 1,
        "ffn_hidden_size": _INTERMEDIATE,
        "expert_ffn_hidden_size": 64,
        "zero_expert_num": 2,
        "moe_topk": 2,
    },
    # Its MoE defaults are None (the released dots.llm1: 2 shared experts, layer 0 dense): 1 shared
    # expert, layer 0 dense and layer 1 MoE.
    "dots1": {"n_shared_experts": 1, "first_k_dense_replace": 1},
    # Sizes stored under its own names (num_experts_per_tok and max_position_embeddings are aliases):
    # top 8 of the 4 experts fails; the linear-attention heads are 32 of 128.
    "kimi_linear": {
        "num_experts_per_token": 2,
        "model_max_length": MAX_POSITIONS,
        "linear_num_heads": _HEADS,
        "linear_head_dim": _HEAD_DIM,
    },
    # layer_types has no default (the released LFM2-8B-A1B lists one per layer): a short convolution
    # layer and an attention layer; the second layer MoE, as num_dense_layers (2) would leave none.
    "lfm2_moe": {"layer_types": ["conv", "full_attention"], "num_dense_layers": 1},
    # The byte-level encoder and decoder project to and from the global transformer's width, which
    # they store as hidden_size_global; the hash n-gram embeddings are 6 tables of 500002 rows.
    "blt": {
        "encoder_config": {"hidden_size_global": _HIDDEN},
        "decoder_config": {"hidden_size_global": _HIDDEN},
        "encoder_hash_byte_group_vocab": VOCAB_SIZE,
    },
    # The vision tower's expert counts per layer (pyramid_num_routed) default to 42 layers' worth,
    # dense up to layer 25: layer 0 dense, layer 1 with the 4 experts. The vision and audio adapters
    # map the tower's width (their in dim) to the text width (out dim).
    "dots3_note": {
        "vision_config": {"pyramid_num_routed": [-1, 4], "adapter_in_dim": _HIDDEN, "adapter_out_dim": _HIDDEN},
        "audio_config": {"adapter_input_size": _HIDDEN, "adapter_out_dim": _HIDDEN, "downsample_hidden_size": 32},
    },
    # ZAYA validates top-1 routing only; its router MLP is 256 wide.
    "zaya": {"num_experts_per_tok": 1, "router_hidden_size": _HIDDEN},
    # Rotary parameters per layer type: see _COHERE_COMPASS_TEXT. The vision tower (27 blocks by default)
    # merges into the text width, its DeepStack features into the first text layers: 2 blocks, one
    # feature per text layer.
    "cohere_compass_text": _COHERE_COMPASS_TEXT,
    "cohere_compass": {
        "text_config": _COHERE_COMPASS_TEXT,
        "vision_config": {"depth": 2, "out_hidden_size": _HIDDEN, "deepstack_visual_indexes": [0, 1]},
    },
    # -- hybrid models: layer patterns --
    # Hybrid Mamba/attention LMs whose layer pattern gives 2 layers no attention layer (generate's cache
    # needs one; released models all have some): a Mamba layer, then an attention layer.
    "jamba": {"attn_layer_period": 2, "attn_layer_offset": 1},  # attention at layer 4 of every 8
    "bamba": {"attn_layer_indices": [1]},  # None by default; Bamba-9B sets [9, 18, 27]
    "granitemoehybrid": {"layer_types": ["linear_attention", "full_attention"]},  # all Mamba by default
    # The last num_kv_shared_layers (15 of 35) reuse the KV of earlier layers of their type: the second
    # reuses the first's. The per-layer input embeddings sized to the tiny vocabulary, not 262144 x 256.
    "gemma3n_text": {
        "num_kv_shared_layers": 1,
        "vocab_size_per_layer_input": VOCAB_SIZE,
        "hidden_size_per_layer_input": _HEAD_DIM,
    },
    # The QSA indexer of Qwen4-Exp's attention layers: see _QSA_INDEXER.
    "qwen4_exp": {"text_config": _QSA_INDEXER},
    "qwen4_exp_text": _QSA_INDEXER,
    # -- encoders: sizes under their own names --
    # Reformer: one attention type per layer; axial position embeddings whose widths sum to hidden_size
    # (64 + 192 = 256) on a grid covering max positions (64 x 64 = 4096; tiny: 16 x 16 = 256); heads and
    # MLP sized apart. Attention chunks stay 64 tokens.
    "reformer": {
        "attn_layers": ["local", "lsh"],
        "attention_head_size": _HEAD_DIM,
        "axial_pos_embds_dim": [16, 48],
        "axial_pos_shape": [16, 16],
        "feed_forward_size": _INTERMEDIATE,
    },
    "distilbert": {"n_heads": _HEADS, "n_layers": _LAYERS, "hidden_dim": _INTERMEDIATE},  # its own size names
    "squeezebert": {"embedding_size": _HIDDEN},  # must equal hidden_size (no projection in between)
    # The 6 layout embeddings (4 coordinates, height, width) of hidden_size // 6 are concatenated back to
    # hidden_size, so it must divide by 6: 48, in 3 heads of 16 (a quarter of each for the layout stream).
    "lilt": {"hidden_size": 48, "num_attention_heads": 3},
    "layoutlmv3": {"coordinate_size": 10, "shape_size": 12},  # 4 coordinates + 2 shapes concatenate to hidden_size
    "xmod": {"default_language": "en_XX"},
    # CPM-Ant initialises its weights with std init_std = 1.0 (not 0.02): its tiny logits were O(30), where the
    # tolerance table's bounds assume O(1) logits (float32 round-off grows with them).
    "cpmant": {"init_std": 0.02},  # the adapter used without lang_ids: the only language it has
    # -- vision-language models (text forward) --
    # The model reads its image tokens from the tokenizer's vocabulary, which real checkpoints store in
    # the config (default None): a tiny one, the VQ codebook's 32 codes as the vocabulary's last 32 ids.
    "chameleon": {
        "vq_config": {"num_embeddings": 32, "base_channels": 32, "channel_multiplier": [1, 2], "resolution": 64},
        "vocabulary_map": {
            "<image>": 479,
            **{f"IMGIMG{''.join(chr(ord('A') + int(d)) for d in str(code))}Z": 480 + code for code in range(32)},
        },
    },
    "emu3": {
        "vq_config": {"codebook_size": 32, "base_channels": 32, "channel_multiplier": [1, 2], "num_res_blocks": 1},
        "vocabulary_map": {
            "<image>": 478,
            "<|extra_200|>": 479,
            **{f"<|visual token {code:06d}|>": 480 + code for code in range(32)},
        },
    },
    # One dense layer, then MoE (the released model: first_k_dense_replace 1); the default None breaks.
    "deepseek_ocr2": {"text_config": {"mlp_layer_types": ["dense", "sparse"]}},
    # num_experts (default None: no MoE) is set by the shrinker, so the router needs its top-k too; the
    # full-attention layers' head dim (512 beside 256) scaled to twice the tiny head.
    "diffusion_gemma": {"text_config": {"top_k_experts": 2, "global_head_dim": 2 * _HEAD_DIM}},
    # Expert widths per modality (a list: text, vision), the expert count and top-k under their own names;
    # the rotary sections that the model code defaults ([22, 22, 20]) scaled to the 8-wide half head.
    "ernie4_5_vl_moe": {
        "text_config": {
            "moe_intermediate_size": [64, 32],
            "moe_num_experts": 4,
            "moe_k": 2,
            "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0, "mrope_section": [3, 3, 2]},
        }
    },
    # Deepstack (default None): which vision layers feed which of the 2 text layers (the 4 spatial groups
    # default to text layers 12-21); the Q-Former projector pools windows of 2x2 patches.
    "granite4_vision": {
        "vision_config": {"patch_size": 8},
        "downsample_rate": "1/2",
        "deepstack_layer_map": [[-1, 0]],
        "spatial_target_layers": [1, 1, 1, 1],
    },
    # Multimodal rotary sections, which the model needs but does not default: 4 axes over the 8-wide half head.
    "hunyuan_vl": {
        "text_config": {
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 2, 2, 2]}
        },
        "vision_config": {"out_hidden_size": _HIDDEN, "text_hidden_size": _HIDDEN},
    },
    # The vision connector projects to the text model's width.
    "granite_docling": {"vision_config": {"out_hidden_size": _HIDDEN}},
    "inkling2": {"vision_config": {"text_hidden_size": _HIDDEN}},
    # The adapter reads the 2 vision layers (the default reads layers 24 and 18).
    "molmo2": {"adapter_config": {"vision_feature_layer": [-1, -2]}},
    # The audio encoder's num_hidden_layers counts its 4 stages (one patch size, width and depth each), whose
    # widths end at the text width it writes onto; the vision adapter reads the vision width folded 2x2.
    "muse_spark": {
        "audio_config": {"num_hidden_layers": 4, "hidden_sizes": [8, 16, 32, 64], "out_hidden_size": _HIDDEN},
        "out_hidden_size": 4 * _HIDDEN,
        "projector_hidden_size": _HIDDEN,
    },
    # The vision tower's copy of the video patch size (set by default only when vision_config is None);
    # the projector reads features of the vision tower's width.
    "nemotron_h_omni": {
        "vision_config": {"video_temporal_patch_size": 2},
        "vision_hidden_size": _HIDDEN,
        "projector_hidden_size": _HIDDEN,
    },
    # The rotary position index reads vision_start_token_id from the thinker's config, which its config
    # class does not declare: released checkpoints store it there (151652). Qwen2.5-Omni's rotary sections,
    # which the model code defaults ([16, 24, 24]), scaled to the 8-wide half head.
    "qwen2_5_omni_thinker": {
        "vision_start_token_id": 151652,
        "text_config": {
            "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [2, 3, 3]}
        },
    },
    "qwen3_omni_moe_thinker": {"vision_start_token_id": 151652},
    # The text model always builds a sliding-window mask (window default None): one sliding and one full
    # layer as Step-3.7's mix, MoE in the second (the default puts it from layer 3 on); shared expert shrunk.
    "step3p7": {
        "text_config": {
            "sliding_window": _SLIDING_WINDOW,
            "layer_types": ["sliding_attention", "full_attention"],
            "mlp_layer_types": ["dense", "sparse"],
            "share_expert_dim": _INTERMEDIATE,
        }
    },
    # The classifier reads the last position's logits of the "Yes" and "No" tokens, ids of Gemma's 262k
    # vocabulary (10784, 3771) unless the config names them: two ids of the tiny vocabulary.
    "shieldgemma2": {"yes_token_index": 10, "no_token_index": 11},
    # -- speech models --
    # Dia's decoder cross-attends to the encoder (1024 wide, 16 heads of 128); its audio-code specials sit just
    # past the codes (eos, pad, bos = 1024..1026 of 1028): kept inside the tiny 512-code vocabulary.
    "dia": {
        "decoder_config": {
            "cross_hidden_size": _HIDDEN,
            "cross_head_dim": _HEAD_DIM,
            "cross_num_key_value_heads": _HEADS,
            "eos_token_id": VOCAB_SIZE - 4,
            "pad_token_id": VOCAB_SIZE - 3,
            "bos_token_id": VOCAB_SIZE - 2,
        }
    },
    # The adaptor's MLP is a quarter of the text width; one transcription and one timestamp encoder layer.
    "fun_asr_nano": {
        "adaptor_config": {"intermediate_size": _HIDDEN // 4, "projector_hidden_size": _INTERMEDIATE},
        "audio_config": {"num_timestamp_prediction_layers": 1},
    },
    # Kyutai's embedding holds the text vocabulary, then one block per codec codebook (its codes and a bos),
    # then the audio pad token (4001 + 32 * 2049 = 69569): 4 codebooks of 64 codes, the Mimi codec's count and
    # size; Mimi's upsampling conv has one group per channel (512: its hidden size).
    "kyutai_speech_to_text": {
        "num_codebooks": 4,
        "codebook_vocab_size": 65,
        "audio_bos_token_id": 64,
        "audio_pad_token_id": VOCAB_SIZE + 4 * 65,
        "bos_token_id": BOS_ID,
        "codec_config": {"codebook_size": 64, "num_quantizers": 4, "upsample_groups": _HIDDEN},
    },
    # Moonshine-streaming's decoder reads num_key_value_heads, which its config class lacks (the checkpoints' configs
    # set it); the encoder has one sliding window per layer (6).
    "moonshine_streaming": {
        "num_key_value_heads": _HEADS,
        "encoder_config": {"sliding_windows": [[16, 4], [16, 0]]},
    },
    # Nemotron 3.5 Transcribe: the diarization head reads the diarization encoder (512 wide; the encoder's shrink is
    # spelled out, as fixes merge one level deep); the word-timestamp head's CTC blank is its last class (23862 of 23863).
    "nemo_speechlm": {
        "audio_config": {
            "diarization_config": {
                "model_type": "nemotron3_diarization",
                "audio_config": {
                    "model_type": "nemotron3_diarization_audio",
                    "hidden_size": _HIDDEN,
                    "num_hidden_layers": _LAYERS,
                    "num_attention_heads": _HEADS,
                    "num_key_value_heads": _HEADS,
                    "intermediate_size": _INTERMEDIATE,
                    "max_position_embeddings": MAX_POSITIONS,
                },
                "head_config": {"hidden_size": _HIDDEN, "audio_hidden_size": _HIDDEN},
            }
        },
        "word_timestamp_config": {"blank_token_id": VOCAB_SIZE - 1},
        # the Nemotron-H text model's mixers, left at the class defaults (128 Mamba heads of 64): as mamba2 above
        "text_config": {
            "mamba_num_heads": 8,
            "mamba_head_dim": _HEAD_DIM,
            "n_groups": 2,
            "ssm_state_size": 16,
            "moe_shared_expert_intermediate_size": _INTERMEDIATE,
        },
    },
    # -- vision-language models that need their image (hfjax.tasks._check._image_text_inputs) --
    # Vision towers initialised with std 1e-10: see _VISIBLE_IMAGE.
    "blip": {"vision_config": _VISIBLE_IMAGE},
    "pix2struct": {"vision_config": _VISIBLE_IMAGE},
    # See _BLIP_QUERIES; the image (video) token, default None (released checkpoints add one past the
    # tokenizer's), marks where the query outputs go in the language model's input: the tiny vocabulary's last id.
    "instructblip": {**_BLIP_QUERIES, "image_token_index": VOCAB_SIZE - 1},
    "instructblipvideo": {**_BLIP_QUERIES, "video_token_index": VOCAB_SIZE - 1},
    # Kosmos-2's image takes latent_query_num (64) positions of the text: 16.
    "kosmos-2": {"latent_query_num": 16},
    # IDEFICS gates its image cross-attention by tanh(alpha), alpha initialised to 0 (trained ones are not):
    # closed gates hide the image from the output.
    "idefics": {"alpha_initializer": "ones"},
    # The default config's decoder (BERT) is a decoder with cross-attention to the image encoder; the shrinker
    # rebuilds it from BERT's own defaults, which have neither.
    "vision-encoder-decoder": {"decoder": {"is_decoder": True, "add_cross_attention": True}},
    # PaliGemma's projector maps the image features to projection_dim, which must be the text width;
    # its image token 256000 sits in the full 257152 vocabulary: the tiny vocabulary's last id.
    "pi0": {"vlm_config": {"projection_dim": _HIDDEN, "image_token_index": VOCAB_SIZE - 1}},
    # The projector's linear_2 maps to decoder_hidden_size, which must be the decoder's d_model; its first
    # conv reads the encoder neck's output_channels (post_conv_in_channels); a global attention layer
    # among the 2 (the full model's every third layer is one); the encoder's MLP width.
    "pp_formulanet": {
        "vision_config": {
            "decoder_hidden_size": _HIDDEN,
            "output_channels": _HIDDEN,
            "post_conv_in_channels": _HIDDEN,
            "post_conv_mid_channels": _HIDDEN,
            "post_conv_out_channels": _HIDDEN,
            "global_attn_indexes": [1],
            "mlp_dim": _INTERMEDIATE,
            **_VISIBLE_IMAGE,
        }
    },
}


# Vision and speech configs: 64x64 images, widths of hierarchical nets (lists, or a base
# embed_dim that later stages double) divided by 8, which keeps each stage's heads dividing it;
# a conv feature encoder of 32 channels per layer, strides and kernels kept.
_IMAGE_SIZE, _WIDTH_DIVISOR, _MAX_DEPTH, _CONV_CHANNELS = 64, 8, 2, 32
_VISION_KEYS = ("image_size", "num_channels", "patch_size")
_SPEECH_KEYS = ("conv_dim", "num_mel_bins", "feature_projection_input_dim", "input_feat_per_channel")
_WIDTHS = (
    "hidden_sizes",
    "embed_dim",
    "embed_dims",
    "neck_hidden_sizes",
    "hidden_dims",
    "stem_out_channels",
)
# EfficientNet-style scaling: the B7 defaults multiply depths by 3.1 (and widths by 2, which its
# hidden_dim is tied to, so widths stay).
_VISION_SCALES = {"depth_coefficient": 1.0}
_SPEECH_SIZES: dict[str, int] = {"num_conv_pos_embeddings": 16, "max_source_positions": 32, "conv_channels": 32}
# Field name suffixes sized like the plain names above (seamless_m4t's speech_encoder_layers, ...).
_SUFFIX_SIZES: dict[str, int] = {"_layers": _LAYERS, "_attention_heads": _HEADS, "_ffn_dim": _INTERMEDIATE}


def _narrower(width: Any, heads: Any) -> Any:
    # One divisor for a whole list of stage widths, the largest that keeps each stage's width a
    # multiple of its attention heads (`heads`: one count, or one per stage).
    widths = width if isinstance(width, list) else [width]
    if not widths or not all(isinstance(w, int) and not isinstance(w, bool) for w in widths):
        return width
    if isinstance(heads, list) and heads and all(isinstance(h, int) for h in heads):
        multiples = heads if len(heads) == len(widths) else [heads[0]] * len(widths)
    else:
        multiples = [heads if isinstance(heads, int) and heads > 0 else 1] * len(widths)
    divisor = next(
        d
        for d in (_WIDTH_DIVISOR, 4, 2, 1)
        if d == 1 or all(w % d == 0 and w // d >= 2 and (w // d) % m == 0 for w, m in zip(widths, multiples))
    )
    return [w // divisor for w in widths] if isinstance(width, list) else width // divisor


def _media_overrides(defaults: Mapping[str, Any]) -> dict[str, Any]:
    overrides: dict[str, Any] = {}
    for key, value in defaults.items():
        if not isinstance(value, int) or isinstance(value, bool) or value <= 2:
            continue
        for suffix, size in _SUFFIX_SIZES.items():
            # num_feat_extract_layers is len(conv_dim), not a depth to shrink
            if key.endswith(suffix) and key not in _GENERIC_SIZES and "feat_extract" not in key:
                overrides[key] = min(value, size)
    if any(key in defaults for key in _VISION_KEYS):
        size = defaults.get("image_size")
        if isinstance(size, int):
            overrides["image_size"] = _IMAGE_SIZE
        elif isinstance(size, list | tuple):
            overrides["image_size"] = [_IMAGE_SIZE] * len(size)
        patch = defaults.get("patch_size")
        if isinstance(patch, int) and _IMAGE_SIZE % patch:
            overrides["patch_size"] = 8
        heads = next((defaults[k] for k in ("num_heads", "num_attention_heads") if k in defaults), 1)
        heads = overrides.get("num_attention_heads", heads) if isinstance(heads, int) else heads
        for key in _WIDTHS:
            if key in defaults:
                overrides[key] = _narrower(defaults[key], heads)
        if isinstance(defaults.get("window_size"), int) and "depths" in defaults:
            # Swin's last stage, 2x2 patches of a 64x64 image, must hold a whole window.
            overrides["window_size"] = 2
        if isinstance(defaults.get("num_groups"), int):  # GroupNorm groups must divide the narrowed widths
            overrides["num_groups"] = min(defaults["num_groups"], 8)
        for key in ("depths", "num_block_repeats"):
            if isinstance(defaults.get(key), list):
                overrides[key] = [min(depth, _MAX_DEPTH) for depth in defaults[key]]
        overrides.update({key: value for key, value in _VISION_SCALES.items() if key in defaults})
    if any(key in defaults for key in _SPEECH_KEYS):
        overrides.update({key: value for key, value in _SPEECH_SIZES.items() if key in defaults})
        if isinstance(defaults.get("conv_dim"), list | tuple):
            overrides["conv_dim"] = [_CONV_CHANNELS] * len(defaults["conv_dim"])
    return overrides


# Layer types without a key/value cache, that hybrid language models mix with attention layers.
_LINEAR_LAYERS = ("linear_attention", "mamba", "conv")


def _hybrid_layer_types(defaults: Mapping[str, Any]) -> dict[str, Any]:
    # A hybrid LM's pattern (Qwen3-Next: attention every 4th layer) leaves 2 layers without attention,
    # unlike any released model, and transformers' cache then cannot count cached tokens: one of each kind.
    types = defaults.get("layer_types")
    if "vocab_size" not in defaults or not isinstance(types, list):
        return {}
    linear = [t for t in types if t in _LINEAR_LAYERS]
    attention = [t for t in types if isinstance(t, str) and t.endswith("attention") and t not in _LINEAR_LAYERS]
    if not linear or not attention or any(t in attention for t in types[:_LAYERS]):
        return {}
    return {"layer_types": [linear[0], attention[0]]}


def _generic_overrides(defaults: Mapping[str, Any]) -> dict[str, Any]:
    # `defaults` is a config's to_dict(); nested configs (text_config, vision_config, ...)
    # are shrunk the same way and passed back as dicts carrying their model_type.
    media = any(key in defaults for key in _VISION_KEYS + _SPEECH_KEYS)
    # Hierarchical vision nets keep their per-stage lists (swin's num_heads): _media_overrides sizes them.
    overrides: dict[str, Any] = {
        key: value
        for key, value in _GENERIC_SIZES.items()
        if key in defaults and not (media and isinstance(defaults[key], list))
    }
    if media:
        overrides.update(_media_overrides(defaults))
    backbone = defaults.get("backbone_config")
    if isinstance(backbone, dict) and backbone.get("model_type") == "timm_backbone":
        # DETR's timm resnet50 as transformers' ResNet: the timm package is an optional extra.
        resnet = default_config("resnet").to_dict()
        stages = [f"stage{i}" for i in backbone.get("out_indices") or (1, 2, 3, 4)]
        overrides["backbone_config"] = {"model_type": "resnet", **_generic_overrides(resnet), "out_features": stages}
        overrides.update({k: False for k in ("use_timm_backbone", "use_pretrained_backbone") if k in defaults})
        overrides.update({"backbone": None} if "backbone" in defaults else {})
    heads, kv_heads = defaults.get("num_attention_heads"), defaults.get("num_key_value_heads")
    if kv_heads is not None:
        # Keep multi-head attention where the default is MHA; otherwise 2 groups of 2.
        overrides["num_key_value_heads"] = _HEADS if kv_heads == heads else _KV_HEADS
    if overrides.get("num_hidden_layers") == _LAYERS:
        overrides.update(_hybrid_layer_types(defaults))
    overrides.update(_mla_overrides(defaults))
    for key, value in defaults.items():
        if isinstance(value, dict) and "model_type" in value and key not in overrides:
            overrides[key] = {"model_type": value["model_type"], **_generic_overrides(value)}
    if "text_config" in overrides:
        overrides["text_config"].update(_TOKEN_IDS)
    start = defaults.get("decoder_start_token_id")
    if isinstance(start, int) and start >= VOCAB_SIZE:  # Marian starts from its pad token, 58100: the tiny one's
        overrides["decoder_start_token_id"] = PAD_ID
    for key in ("rope_parameters", "rope_scaling"):
        rope = defaults.get(key)
        if isinstance(rope, dict) and isinstance(rope.get("mrope_section"), list) and key not in overrides:
            # Multimodal rotary sections (Qwen2.5-VL's [16, 24, 24]) split half the head: scaled to 16-wide heads.
            overrides[key] = {**rope, "mrope_section": _scaled_sections(rope["mrope_section"], _HEAD_DIM // 2)}
    return overrides


def _mla_overrides(defaults: Mapping[str, Any]) -> dict[str, Any]:
    # Multi-head latent attention (DeepSeek-V2 style): query/key heads of a rotary part and a
    # non-rotary part, values and low-rank projections sized apart from head_dim. Sized as the
    # deepseek_v3 family: 8 + 8 wide query/key heads, values 16, ranks 32. A config whose default
    # head_dim is the rotary part (the rotary embedding reads head_dim), or the whole query/key
    # head, keeps that tie; a missing or zero size (no rotary part, no query LoRA) stays.
    rope, nope = defaults.get("qk_rope_head_dim"), defaults.get("qk_nope_head_dim")
    if not (isinstance(rope, int) and isinstance(nope, int)):
        return {}
    sizes = {
        "qk_rope_head_dim": 8,
        "qk_nope_head_dim": 8,
        "v_head_dim": _HEAD_DIM,
        "kv_lora_rank": 32,
        "q_lora_rank": 32,
    }
    overrides = {key: size for key, size in sizes.items() if isinstance(defaults.get(key), int) and defaults[key] > 0}
    head_dim = defaults.get("head_dim")
    if rope > 0 and head_dim == rope:
        overrides["head_dim"] = overrides["qk_rope_head_dim"]
    elif rope > 0 and head_dim == rope + nope:
        overrides["head_dim"] = overrides["qk_rope_head_dim"] + overrides.get("qk_nope_head_dim", 0)
    return overrides


def _scaled_sections(sections: list[int], total: int) -> list[int]:
    # `sections` scaled to sum to `total`, each at least 1; the last takes what rounding leaves.
    scale = total / sum(sections)
    scaled = [max(1, round(section * scale)) for section in sections[:-1]]
    return [*scaled, total - sum(scaled)]


def _text_model_types() -> dict[str, Kind]:
    # model_type -> kind, for model types with a text head; seq2seq wins over causal
    # (bart has both), causal over classification-only encoders.
    from transformers.models.auto import modeling_auto

    kinds: dict[str, Kind] = dict.fromkeys(modeling_auto.MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES, "encoder")
    kinds.update(dict.fromkeys(modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, "causal"))
    kinds.update(dict.fromkeys(modeling_auto.MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES, "seq2seq"))
    return kinds


# transformers 5.17's composite configs take no defaults (5.23 and later give these): (model_type, fields) per part
_COMPOSITE_DEFAULTS = {
    "encoder-decoder": {
        "encoder": ("bert", {}),
        "decoder": ("bert", {"is_decoder": True, "add_cross_attention": True}),
    },
    "vision-encoder-decoder": {
        "encoder": ("vit", {}),
        "decoder": ("bert", {"is_decoder": True, "add_cross_attention": True}),
    },
    "speech-encoder-decoder": {
        "encoder": ("wav2vec2", {}),
        "decoder": ("bert", {"is_decoder": True, "add_cross_attention": True}),
    },
}


def default_config(model_type: str) -> transformers.PretrainedConfig:
    """transformers' config of `model_type` with its defaults (a composite one: its parts' defaults)."""
    if model_type not in _COMPOSITE_DEFAULTS:
        return transformers.CONFIG_MAPPING[model_type]()
    parts = {
        name: transformers.AutoConfig.for_model(part, **fields).to_dict()
        for name, (part, fields) in _COMPOSITE_DEFAULTS[model_type].items()
    }
    return transformers.CONFIG_MAPPING[model_type](**parts)


@functools.cache
def _generic_family(model_type: str) -> Family | None:
    kind = _text_model_types().get(model_type)
    if kind is None or model_type not in transformers.CONFIG_MAPPING:
        return None
    defaults = default_config(model_type).to_dict()
    return Family(kind, _with_fixes(model_type, _generic_overrides(defaults)), curated=False)


def _with_fixes(model_type: str, overrides: dict[str, Any]) -> dict[str, Any]:
    # `overrides` with the model type's _GENERIC_FIXES on top; a nested config's fields are merged.
    fixed = dict(overrides)
    for key, value in copy.deepcopy(_GENERIC_FIXES.get(model_type, {})).items():  # config classes may change them
        fixed[key] = {**fixed[key], **value} if isinstance(fixed.get(key), dict) and isinstance(value, dict) else value
    return fixed


def family_spec(family: str) -> Family:
    """The hand-tuned or generic `Family` of a model_type; ValueError with the close names if none."""
    if family in REGISTRY:
        return REGISTRY[family]
    generic = _generic_family(family) if isinstance(family, str) else None
    if generic is not None:
        return generic
    if isinstance(family, str) and family in transformers.CONFIG_MAPPING:
        raise ValueError(
            f"Unknown model family {family!r}: it is a transformers model_type, but has no text-generation, "
            "text2text-generation or text-classification model class, so it has no tiny text checkpoint."
        )
    close = difflib.get_close_matches(str(family), FAMILIES, n=1)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    raise ValueError(
        f"Unknown model family {family!r}.{hint} Use a transformers model_type; hand-tuned families: "
        f"{', '.join(FAMILIES)}."
    )


def auto_class_name(auto_class: type, config: transformers.PretrainedConfig) -> str | None:
    # The first class where the table holds several (DeiT's classifier and its distilled twin).
    mapping = auto_class._model_mapping
    if type(config) not in mapping:
        return None
    classes = mapping[type(config)]
    return (classes[0] if isinstance(classes, list | tuple) else classes).__name__


def tiny_config(family: str, **overrides: Any) -> transformers.PretrainedConfig:
    """Builds a tiny transformers config for a model family.

    Sizes: hidden 64, 2 layers, 4 attention heads of dimension 16, 2 key/value heads where
    the family has grouped-query attention, MLP width 128, 256 positions, and the tiny
    tokenizer's 512-token vocabulary with pad=0, bos=1, eos=2. Word-embedding tying and
    everything else keep the family's defaults. `architectures` names the class for the
    family's default task (causal LM, encoder model, or seq2seq LM).

    Args:
        family: a transformers `model_type`. Names in `FAMILIES` use hand-tuned sizes;
            any other model_type with a text head starts from its config class's defaults
            with the usual size fields (hidden size, layers, heads, MLP width, experts,
            vocabulary, positions, and those of nested configs) set to the sizes above.
        **overrides: config fields to set instead of the tiny defaults, for example
            `num_hidden_layers=4` or `tie_word_embeddings=False`.

    Returns:
        The config, of the family's config class.

    Raises:
        ValueError: if `family` is not a transformers model_type with a causal-LM,
            seq2seq-LM or sequence-classification model class.

    Example:
        >>> config = tiny_config("llama", num_hidden_layers=3)
        >>> config.hidden_size, config.num_hidden_layers, config.architectures
        (64, 3, ['LlamaForCausalLM'])
    """
    spec = family_spec(family)
    # A deep copy, as config classes may change nested dicts and lists they are given.
    kwargs = {"vocab_size": VOCAB_SIZE, **_TOKEN_IDS, **copy.deepcopy(dict(spec.config)), **overrides}
    config = transformers.AutoConfig.for_model(family, **kwargs)
    if "architectures" not in overrides:
        name = auto_class_name(_tasks.auto_class(DEFAULT_TASK[spec.kind]), config)
        config.architectures = [name]
    return config
