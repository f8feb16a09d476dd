"""Model shapes that more than one benchmark builds (random weights, `hfjax.testing`)."""

# Llama shapes with random weights, untied embeddings (Llama's default): ~23M and ~153M parameters.
LLAMA_20M = dict(
    hidden_size=256,
    intermediate_size=768,
    num_hidden_layers=8,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=32,
    vocab_size=32000,
)
LLAMA_150M = dict(
    hidden_size=768,
    intermediate_size=3072,
    num_hidden_layers=12,
    num_attention_heads=12,
    num_key_value_heads=4,
    head_dim=64,
    vocab_size=32000,
)

# Llama-3.2-1B's shape: 1.24B parameters, tied embeddings, rope theta 500000.
LLAMA_1B = dict(
    hidden_size=2048,
    intermediate_size=8192,
    num_hidden_layers=16,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=64,
    vocab_size=128256,
    tie_word_embeddings=True,
    rope_theta=500000.0,
)

# A few hundred thousand parameters: for dry runs that check a benchmark's plumbing (not for figures).
LLAMA_TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    vocab_size=1024,
)

# ab.py --family shapes (random weights, the tiny tokenizers' ids inside larger vocabularies):
# BART, ~61M parameters: bart-base's layout narrowed to d_model 512, 6 + 6 layers, a 32000-token vocabulary.
BART_60M = dict(
    d_model=512,
    encoder_layers=6,
    decoder_layers=6,
    encoder_attention_heads=8,
    decoder_attention_heads=8,
    encoder_ffn_dim=2048,
    decoder_ffn_dim=2048,
    vocab_size=32000,
    max_position_embeddings=1024,
)
# Whisper, ~38M parameters: whisper-tiny's shape (d_model 384, 4 + 4 layers, 80 mel bins, a 30 s window of 1500 encoder
# positions, 448 decoder positions, 51865 tokens).
WHISPER_TINY = dict(
    d_model=384,
    encoder_layers=4,
    decoder_layers=4,
    encoder_attention_heads=6,
    decoder_attention_heads=6,
    encoder_ffn_dim=1536,
    decoder_ffn_dim=1536,
    num_mel_bins=80,
    max_source_positions=1500,
    max_target_positions=448,
    vocab_size=51865,
)
# LLaVA, ~23M parameters: the 20m Llama shape as its language model (2048 positions), the tiny CLIP vision tower
# (hidden 64, 2 layers, 32x32 images in 8x8 patches: 16 image tokens).
LLAVA_20M = dict(text_config={**LLAMA_20M, "max_position_embeddings": 2048})
