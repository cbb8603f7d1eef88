"""The L2 post's counting regime (issue #42): a NoPE backbone with the first-token table (data.counting.first_token),
the absolute running count with an L1 loss, and prefix scoring (experiment.eval_prefixes). Tiny models, seconds."""

from __future__ import annotations

import json

import pytest
import torch

import retrofit
from retrofit.data import counting_batch
from retrofit.errors import RetrofitError
from retrofit.evaluate import evaluate_counting
from retrofit.experiment.results import _counting_options
from retrofit.load import CountingModel, load
from retrofit.recipe import recipe_from_dict
from retrofit.train import model_setup, train
from retrofit.train.losses import items, loss_sum
from tests.tiny import TINY, tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def first_token_model(nope: bool = True, seed: int = 0, **config) -> CountingModel:
    lm = tiny_model("llama", seed=seed, **config)
    if nope:
        retrofit.patch(lm, "psoftmax", p=2.0, nope=True)
    torch.manual_seed(seed)
    return CountingModel(lm, first_token=True).eval()


def _shuffled_middle(ids: torch.Tensor, seed: int = 3) -> torch.Tensor:
    """The same sequences with tokens 1..T-2 in another order (the target stays first, the query token last)."""
    order = torch.randperm(ids.shape[1] - 2, generator=torch.Generator().manual_seed(seed)) + 1
    return torch.cat([ids[:, :1], ids[:, order], ids[:, -1:]], 1)


def test_first_token_model_cannot_tell_the_other_positions_apart():
    ids = counting_batch(2, 24, alphabet=8, seed=1)["input_ids"]
    model = first_token_model()
    with torch.no_grad():
        for m, nope in ((model, True), (first_token_model(nope=False), False)):  # NoPE, and RoPE: the control
            core = m.lm.model
            embeds = core.embed_tokens(ids) + m.first_token((torch.arange(24) > 0).long())  # row 0 first, then 1
            scrambled = torch.cat([torch.zeros(1, dtype=torch.long), torch.randperm(23) + 1]).expand(2, -1)
            # attention_mask given: transformers reads no document boundaries from the position ids (packing)
            straight, permuted = (core(inputs_embeds=embeds, position_ids=p, attention_mask=torch.ones(2, 24),
                                       use_cache=False)[0] for p in (torch.arange(24)[None], scrambled))
            assert torch.allclose(straight, permuted, atol=1e-5) is nope  # positions of the others: ignored iff NoPE
        # one layer: the last prediction is a function of the first token and the multiset of the others (with more
        # layers the causal mask still orders them: each earlier state saw only its own prefix)
        one_layer = first_token_model(num_hidden_layers=1)
        assert torch.allclose(one_layer(_shuffled_middle(ids))[:, -1], one_layer(ids)[:, -1], atol=1e-5)
        with_rope = first_token_model(nope=False, num_hidden_layers=1)  # the control: RoPE sees the order
        assert not torch.allclose(with_rope(_shuffled_middle(ids))[:, -1], with_rope(ids)[:, -1], atol=1e-5)
        before = model(ids)
        model.first_token.weight[0] += 1.0  # row 0 is read at the first token (and reaches every later one)
        assert not torch.allclose(model(ids), before, atol=1e-3)


def test_without_the_table_the_model_is_as_before():
    lm = tiny_model("llama")
    plain, flagged = CountingModel(lm).eval(), CountingModel(lm, first_token=True).eval()
    assert plain.first_token is None and "first_token" not in plain.task_state()
    ids = counting_batch(2, 16, alphabet=8, seed=0)["input_ids"]
    with torch.no_grad():
        flagged.first_token.weight.zero_()  # a zero table adds nothing: the same backbone, the same head
        flagged.head.load_state_dict(plain.head.state_dict())
        assert torch.allclose(flagged(ids), plain(ids), atol=1e-6)


def test_counting_target_is_the_absolute_running_count_and_the_loss_is_l1():
    batch = counting_batch(3, 40, alphabet=4, seed=2)
    ids, counts = batch["input_ids"], batch["counts"]
    manual = torch.stack([torch.tensor([float((ids[b, 1:t + 1] == ids[b, 0]).sum()) for t in range(40)])
                          for b in range(3)])
    assert torch.equal(counts, manual) and counts[:, -1].max() > 1  # a count, not a fraction of t
    model = first_token_model()
    with torch.no_grad():
        pred = model(ids)
        assert loss_sum(model, batch, "counting").item() == pytest.approx(
            (pred[:, 1:] - counts[:, 1:]).abs().sum().item(), rel=1e-6)
    assert items(batch, "counting") == 3 * 39


def test_prefix_scoring_scores_each_length_as_the_prefix_of_the_longest():
    model = first_token_model()
    rows = evaluate_counting(model, [8, 32, 64], sequences=3, alphabet=4, prefixes=True, batch_tokens=128)
    batch = counting_batch(3, 64, alphabet=4, seed=0)  # the longest length's sequences, scored at every prefix
    with torch.no_grad():
        for row, n in zip(rows, (8, 32, 64)):
            err = model(batch["input_ids"][:, :n])[:, 1:] - batch["counts"][:, 1:n]  # the prefix on its own
            assert row["length"] == n and row["prefix_of"] == 64 and row["sequences"] == 3
            assert row["l1"] == pytest.approx(err.abs().mean().item(), rel=1e-5)
            assert row["sequence_l1"] == pytest.approx(err.abs().mean(1).tolist(), rel=1e-5)
            assert row["mean_count"] == pytest.approx(batch["counts"][:, 1:n].mean().item())
            assert row["by_position"][-1]["end"] == n
    separate = evaluate_counting(model, [8, 64], sequences=3, alphabet=4)
    assert "prefix_of" not in separate[0] and separate[1]["l1"] == pytest.approx(rows[2]["l1"], rel=1e-6)
    assert separate[0]["l1"] != pytest.approx(rows[0]["l1"], rel=1e-6)  # other draws at 8: separate sequences


def _recipe(tmp_path, **counting) -> dict:
    return {"model": {"config": {"model_type": "llama", **TINY["llama"], "vocab_size": 32}},
            "patch": {"norm": "psoftmax", "p": 2.0, "nope": True},
            "data": {"task": "counting", "seq_len": 32, "counting": {"alphabet": 32, **counting}},
            "train": {"steps": 3, "batch_size": 4, "micro_batch_size": 4, "lr": 1e-2, "warmup_steps": 1,
                      "init_len": 16, "double_every": 2, "progress": False, "log_every": 1},
            "eval": {"lengths": [32], "batches": 1, "batch_size": 2}, "output": {"dir": str(tmp_path / "run")}}


def test_a_first_token_run_saves_the_table_and_reloads_with_it(tmp_path):
    recipe = recipe_from_dict(_recipe(tmp_path, first_token=True))
    assert recipe.data.counting.first_token
    result = train(recipe)
    trained = result.model.eval()
    assert trained.first_token is not None and trained.first_token.weight.requires_grad
    task = json.loads((tmp_path / "run" / "task.json").read_text())
    assert task["first_token"] is True
    back = load(tmp_path / "run")
    assert torch.equal(back.first_token.weight, trained.first_token.weight.detach().cpu())
    ids = counting_batch(2, 48, alphabet=32, seed=4)["input_ids"]
    with torch.no_grad():
        assert torch.allclose(back(ids), trained(ids), atol=1e-5)
        assert back.lm.config.retrofit["nope"]  # rebuilt without positions
    plain = train(recipe_from_dict(_recipe(tmp_path / "plain")))  # the default: no table, task.json says so
    assert plain.model.first_token is None
    assert json.loads((tmp_path / "plain" / "run" / "task.json").read_text())["first_token"] is False


def test_first_token_option_is_checked():
    with pytest.raises(RetrofitError, match="first-token table"):
        model_setup.wrap_task(CountingModel(tiny_model("llama")), "counting", first_token=True)
    with pytest.raises(RetrofitError, match="first_token"):
        recipe_from_dict({"model": {"config": {"model_type": "llama"}},
                          "data": {"task": "counting", "counting": {"first_tokn": True}}})


def test_experiment_passes_prefix_scoring_to_the_evaluation():
    raw = {"model": {"config": {"model_type": "llama"}}, "data": {"task": "counting"},
           "experiment": {"arms": [{"name": "p1", "patch": {"norm": "psoftmax", "p": 1.0}}]}}
    assert _counting_options(recipe_from_dict(raw).section("experiment")) is None  # the default: as before
    raw["experiment"] |= {"eval_prefixes": True, "eval_sequences": 4}
    assert _counting_options(recipe_from_dict(raw).section("experiment")) == {"sequences": 4, "prefixes": True}
