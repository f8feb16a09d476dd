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
