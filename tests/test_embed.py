"""`Model.embed` of every kind of text model, against transformers' hidden states in PyTorch.

A causal LM pools its last token, as vLLM and sentence-transformers pool decoders (a
sentence-transformers config says otherwise when it is there); a sequence-to-sequence model
embeds through its encoder; a classifier through its base model. A model that embeds no text is
an `hfjax.LoadError` naming the fix.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers

import hfjax
from hfjax import tolerances

TEXTS = ["a cat sat on the mat", "dogs", "the quick brown fox jumps over the lazy dog"]


def _reference(path, pooling: str, *, encoder_decoder: bool = False) -> np.ndarray:
    """Each text alone through transformers (no padding): its final hidden states, pooled, L2-normalised."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    module = transformers.AutoModel.from_pretrained(path).eval()
    vectors = []
    for text in TEXTS:
        batch = tokenizer([text], return_tensors="pt")
        with torch.no_grad():
            if encoder_decoder:
                hidden = module.get_encoder()(**batch).last_hidden_state[0]  # [S, H]
            else:
                hidden = module(**batch, output_hidden_states=True).hidden_states[-1][0]  # [S, H]
        vectors.append(hidden[-1] if pooling == "last" else hidden.mean(0))
    return torch.nn.functional.normalize(torch.stack(vectors), dim=-1).numpy()


@pytest.mark.parametrize(
    ("family", "task", "pooling"),
    [
        ("llama", None, "last"),
        ("gpt2", None, "last"),  # its head shares the embedding: the base model's weights come through an alias
        ("qwen3", "text-classification", "last"),
        ("t5", None, "mean"),
        ("bert", "text-classification", "mean"),
    ],
)
def test_embed_pools_the_base_models_hidden_states_as_transformers_computes_them(checkpoint, family, task, pooling):
    path = checkpoint(family, task=task)
    model = hfjax.load(path)
    got = np.asarray(model.embed(TEXTS))  # batched: padded on the right to one bucket
    tolerance = tolerances.for_family(family)
    want = _reference(path, pooling, encoder_decoder=getattr(model.config, "is_encoder_decoder", False))
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, atol=tolerance.atol, err_msg=tolerance.why)
    np.testing.assert_allclose(np.linalg.norm(got, axis=-1), 1.0, atol=tolerances.UNIT_NORM.atol)


def test_a_sentence_transformers_config_chooses_a_decoders_pooling(checkpoint):
    path = checkpoint("qwen3", task="feature-extraction", sentence_transformers=True, pooling="lasttoken")
    got = np.asarray(hfjax.load(path).embed(TEXTS))
    tolerance = tolerances.for_family("qwen3")
    np.testing.assert_allclose(got, _reference(path, "last"), atol=tolerance.atol, err_msg=tolerance.why)


def test_embed_of_a_model_that_reads_no_text_names_the_fix(checkpoint):
    model = hfjax.load(checkpoint("vit"))
    with pytest.raises(hfjax.LoadError, match=r"task='image-classification'.*image-feature-extraction"):
        model.embed(TEXTS)
