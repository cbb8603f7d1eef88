"""lm-evaluation-harness: the `retrofit` model type scores a local JSONL task with the same log-likelihoods
as retrofit's own loss on the same text, for a patched checkpoint and for a patch applied on the fly."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F

import retrofit
from tests.tiny import tiny_model

lm_eval = pytest.importorskip("lm_eval", reason="lm-evaluation-harness is the optional extra retrofit[eval]")
harness = pytest.importorskip("retrofit.evaluate.harness")

TEXT = "the quick brown fox jumps over the lazy dog and keeps running far away. "
DOCS = [{"context": "the quick brown", "continuation": " fox jumps"},
        {"context": "over the lazy dog and", "continuation": " keeps running far"},
        {"context": "far", "continuation": " away. the quick"}]


def _char_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    vocab = {c: i for i, c in enumerate(sorted(set(TEXT) | {"#"}))}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="#"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="#", unk_token="#")


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory):
    """A harness task read from a local JSONL file (no download): loglikelihood of continuation | context."""
    root = tmp_path_factory.mktemp("task")
    (root / "docs.jsonl").write_text("".join(json.dumps(d) + "\n" for d in DOCS))
    (root / "local.yaml").write_text(
        "task: retrofit_local\n"
        "dataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {root / 'docs.jsonl'}\n"
        "test_split: test\n"
        "output_type: loglikelihood\n"
        'doc_to_text: "{{context}}"\n'
        'doc_to_target: "{{continuation}}"\n'
        "metric_list:\n  - metric: acc\n")
    return root


def _ours(model, tokenizer, context: str, continuation: str) -> float:
    """log p(continuation | context) by retrofit's own computation: the same token ids, one forward."""
    ctx, cont = tokenizer(context)["input_ids"], tokenizer(continuation)["input_ids"]
    ids = torch.tensor([ctx + cont])
    with torch.no_grad():
        logits = model(input_ids=ids[:, :-1], use_cache=False).logits.float()  # (1, T-1, V)
    targets = ids[0, len(ctx):]
    scores = F.log_softmax(logits[0, len(ctx) - 1:], -1)  # (len(cont), V)
    return float(scores.gather(1, targets[:, None]).sum())


def _harness(task_dir, model_args: str) -> list[float]:
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager
    # include_defaults=False: only the local task is indexed, not the harness's thousands of YAML files (~15 s a call)
    tasks = TaskManager(include_path=str(task_dir), include_defaults=False)
    out = simple_evaluate(model="retrofit", model_args=model_args, tasks=["retrofit_local"], task_manager=tasks,
                          log_samples=True, device="cpu", batch_size=1)
    samples = sorted(out["samples"]["retrofit_local"], key=lambda s: s["doc_id"])
    return [float(s["resps"][0][0][0]) for s in samples]


@pytest.mark.parametrize("norm, options", [("avnorm", {}), ("psoftmax", {"p": 2.0}), ("ssmax", {})])
def test_harness_loglikelihoods_equal_retrofits_own_on_a_patched_checkpoint(task_dir, tmp_path, norm, options):
    model = tiny_model("llama", vocab_size=len(_char_tokenizer()))
    retrofit.patch(model, norm, **options)
    model.save_pretrained(tmp_path / "ckpt")
    _char_tokenizer().save_pretrained(tmp_path / "ckpt")
    theirs = _harness(task_dir, f"pretrained={tmp_path / 'ckpt'},max_length=64")
    reloaded, tok = retrofit.from_pretrained(str(tmp_path / "ckpt")), _char_tokenizer()
    ours = [_ours(reloaded, tok, d["context"], d["continuation"]) for d in DOCS]
    assert all(math.isfinite(x) for x in theirs)
    assert theirs == pytest.approx(ours, abs=1e-4)


def test_norm_and_rope_model_args_patch_an_unpatched_model_on_the_fly(task_dir, tmp_path):
    model = tiny_model("llama", vocab_size=len(_char_tokenizer()))
    model.save_pretrained(tmp_path / "plain")
    _char_tokenizer().save_pretrained(tmp_path / "plain")
    plain = _harness(task_dir, f"pretrained={tmp_path / 'plain'},max_length=64")
    patched = _harness(task_dir, f"pretrained={tmp_path / 'plain'},norm=psoftmax,p=2,rope=linear:2,max_length=64")
    retrofit.patch(model, "psoftmax", p=2.0, rope="linear:2")
    tok = _char_tokenizer()
    assert patched == pytest.approx([_ours(model, tok, d["context"], d["continuation"]) for d in DOCS], abs=1e-4)
    assert max(abs(a - b) for a, b in zip(plain, patched)) > 1e-3  # the patch did change the scores


def test_max_length_is_always_set_by_retrofit(tmp_path):
    model = tiny_model("gpt2", vocab_size=len(_char_tokenizer()))  # learned positions: n_positions 64
    model.save_pretrained(tmp_path / "gpt2")
    _char_tokenizer().save_pretrained(tmp_path / "gpt2")
    lm = harness.RetrofitLM(pretrained=str(tmp_path / "gpt2"), device="cpu")
    assert lm.max_length == 64
    lm = harness.RetrofitLM(pretrained=str(tmp_path / "gpt2"), norm="avnorm", nope=True, max_length=4096,
                            device="cpu")
    assert lm.max_length == 4096


def test_a_patch_over_a_patched_model_is_a_one_line_error(tmp_path):
    model = tiny_model("llama", vocab_size=len(_char_tokenizer()))
    retrofit.patch(model, "avnorm")
    model.save_pretrained(tmp_path / "ckpt")
    _char_tokenizer().save_pretrained(tmp_path / "ckpt")
    with pytest.raises(retrofit.RetrofitError, match="already patched"):
        harness.RetrofitLM(pretrained=str(tmp_path / "ckpt"), norm="psoftmax", device="cpu")
