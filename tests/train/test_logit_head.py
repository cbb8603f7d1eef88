"""retrofit/logit_head.py: evaluation and distillation share one head, and a soft-cap kept in a nested text_config
(Gemma-style) caps both."""

from __future__ import annotations

import types

import pytest
import torch
import torch.nn.functional as F

import retrofit
from retrofit.evaluate import scoring
from retrofit.recovery.distill import chunked_kl_sum
from tests.tiny import random_ids, tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def _softcap_only_in_text_config():
    """A Gemma-style config: the soft-cap lives in a nested text_config, none at the top."""
    model = tiny_model("llama")
    assert getattr(model.config, "final_logit_softcapping", None) is None
    model.config.text_config = types.SimpleNamespace(final_logit_softcapping=0.5)
    return model


def test_a_softcap_in_text_config_caps_evaluation_and_distillation():
    model = _softcap_only_in_text_config()
    ids = random_ids(2, 10)
    with torch.no_grad():
        hidden = model.base_model(input_ids=ids, use_cache=False)[0]  # (B, T, d)
        raw = model.get_output_embeddings()(hidden).float()  # (B, T, V)
    capped = torch.tanh(raw / 0.5) * 0.5
    assert not torch.allclose(raw, capped)  # the cap changes these logits
    torch.testing.assert_close(scoring.head_logits(model, hidden), capped)  # evaluation
    labels = ids.roll(-1, 1)
    expected = F.cross_entropy(capped.flatten(0, 1), labels.flatten(), reduction="sum")
    with torch.no_grad():  # distillation: the lm term of the chunked head, over 3-token chunks
        got = chunked_kl_sum(model, hidden, None, labels, lm_weight=1.0, kl_weight=0.0, chunk_tokens=6)
    torch.testing.assert_close(got, expected)


def test_evaluation_and_distillation_share_one_head():
    from retrofit.recovery import distill
    assert scoring.head_logits is retrofit.logit_head.head_logits is distill.head_logits
    assert not hasattr(distill, "LOGIT_TRANSFORMS")
