"""Model shapes that more than one benchmark builds (random weights, `hfjax.testing`)."""

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
