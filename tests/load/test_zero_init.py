"""model.zero_init (issue 55): a model built from its config with its attention and MLP output projections at zero, as
the AVnorm post's model starts. Every layer then adds nothing to the residual stream, so the logits at step 0 are the
head applied to the normalized embeddings (a known answer), and the zeroed projections still train."""

from __future__ import annotations

import pytest
import torch

from retrofit.attention_modules import attention_modules
from retrofit.errors import RetrofitError
from retrofit.families import mlp_output_projections, output_projection
from retrofit.load import load_base
from retrofit.load.from_recipe import zero_projections
from retrofit.recipe import recipe_from_dict
from tests.tiny import TINY, random_ids, tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def _recipe(model_type: str, zero_init, **model):
    return recipe_from_dict({"model": {"config": {"model_type": model_type, **TINY[model_type]},
                                       "zero_init": zero_init, **model},
                             "data": {"task": "counting", "seq_len": 16}, "train": {"steps": 1}})


def _body_is_the_identity(model, ids) -> bool:
    """Logits equal the head on the final norm of the embeddings (plus learned positions for GPT-2)."""
    with torch.no_grad():
        if model.config.model_type == "gpt2":
            t = model.transformer
            hidden = t.ln_f(t.wte(ids) + t.wpe(torch.arange(ids.shape[1])))
        else:
            hidden = model.model.norm(model.model.embed_tokens(ids))
        return torch.allclose(model(ids).logits, model.lm_head(hidden), atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("model_type", ["llama", "gpt2"])
def test_both_projections_at_zero_make_every_layer_the_identity(model_type):
    model, _ = load_base(_recipe(model_type, ["attention_output", "mlp_output"]))
    projections = [output_projection(m) for _, m in attention_modules(model)] + mlp_output_projections(model)
    assert len(projections) == 2 * model.config.num_hidden_layers
    assert all(not p.weight.any() and (getattr(p, "bias", None) is None or not p.bias.any()) for p in projections)
    ids = random_ids(2, 10)
    assert _body_is_the_identity(model, ids)
    plain, _ = load_base(_recipe(model_type, []))
    assert not _body_is_the_identity(plain, ids)  # the known answer is not what an ordinary init gives


def test_only_the_named_part_is_zeroed_and_it_trains():
    model, _ = load_base(_recipe("llama", ["attention_output"]))
    layer = model.model.layers[0]
    assert not layer.self_attn.o_proj.weight.any() and layer.mlp.down_proj.weight.any()
    ids = random_ids(2, 10)
    model(input_ids=ids, labels=ids).loss.backward()
    assert layer.self_attn.o_proj.weight.grad.abs().sum() > 0  # its input is not zero: it learns at once


def test_the_same_seed_builds_the_same_model_but_for_the_zeroed_part():
    zeroed, _ = load_base(_recipe("llama", ["mlp_output"]))
    plain, _ = load_base(_recipe("llama", []))
    differ = {n for (n, a), (_, b) in zip(zeroed.named_parameters(), plain.named_parameters()) if not torch.equal(a, b)}
    assert differ == {f"model.layers.{i}.mlp.down_proj.weight" for i in range(2)}


@pytest.mark.parametrize("raw, message", [
    ({"model": {"config": {"model_type": "llama"}, "zero_init": ["attn_output"]}},
     "model.zero_init: unknown part 'attn_output' .*did you mean 'attention_output'"),
    ({"model": {"source": "gpt2", "zero_init": ["mlp_output"]}},
     "model.zero_init initializes a model built from model.config"),
])
def test_bad_zero_init_is_refused_in_one_line(raw, message):
    with pytest.raises(RetrofitError, match=message) as caught:
        recipe_from_dict({**raw, "data": {"task": "counting", "seq_len": 16}})
    assert "\n" not in str(caught.value)


def test_a_model_without_a_dense_mlp_projection_is_refused():
    with pytest.raises(RetrofitError, match="mlp_output: Qwen3MoeForCausalLM has a layer without an output projection"):
        zero_projections(tiny_model("qwen3_moe"), ["mlp_output"])
