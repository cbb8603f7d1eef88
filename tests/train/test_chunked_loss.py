"""Issue 38 item 1: the loss without (B, T, V) logits (retrofit/logit_head.py head_loss_sum). The same sum and the
same gradients (hidden states, head weight, every parameter) as the full computation, in fp32 and bf16, with -100
labels, soft-capping and a tied head; through training's loss_sum, the loop's validation and the KL of recovery;
under torch.compile and LoRA; and no saved tensor ever holds more than one chunk of logits."""

from __future__ import annotations

import types

import pytest
import torch
import torch.nn.functional as F

from retrofit.logit_head import (
    final_hidden,
    head_logits,
    head_loss_sum,
    head_token_scores,
    kl_per_position,
    next_tokens,
)
from retrofit.recipe import recipe_from_dict
from retrofit.recovery.distill import chunked_kl_sum
from retrofit.train import model_setup, train
from retrofit.train.losses import items, loss_sum
from retrofit.train.validation import validation_metrics
from tests.tiny import VOCAB, random_ids, tiny_model
from tests.train.test_train import lm_recipe, write_corpus

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def _model(tied: bool, softcap: float | None, dtype=torch.float32):
    model = tiny_model("llama", seed=3, tie_word_embeddings=tied).to(dtype).train()
    if softcap is not None:
        model.config.final_logit_softcapping = softcap  # read by head_logits (LOGIT_TRANSFORMS), as gemma2's
    return model


def _labels(ids: torch.Tensor) -> torch.Tensor:
    labels = ids.clone()
    labels[0, :5] = -100  # a prompt that is not scored
    labels[1, 9] = -100
    return labels


def _full(model, hidden, labels, teacher=None, kl_weight=0.0, temperature=1.0):
    """The reference: every position's logits at once, as a plain (B, T, V) computation."""
    logits = head_logits(model, hidden)  # (B, T, V)
    total = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="sum")
    if kl_weight:
        with torch.no_grad():
            t = torch.log_softmax(head_logits(model, teacher) / temperature, -1)
        kl = kl_per_position(t, torch.log_softmax(logits / temperature, -1))
        total = total + kl_weight * temperature ** 2 * (kl * (labels != -100)).sum()
    return total


def _grads(model, loss_fn, dtype):
    """loss, d loss / d hidden and d loss / d head weight, the hidden states leaf-copied from one body forward."""
    ids = random_ids(2, 24).to(model.device)
    with torch.no_grad():
        hidden = model.base_model(input_ids=ids, use_cache=False)[0].to(dtype)  # (B, T, d)
    hidden.requires_grad_(True)
    model.zero_grad(set_to_none=True)
    loss = loss_fn(hidden, next_tokens(_labels(ids)))
    loss.backward()
    return loss.detach(), hidden.grad, model.get_output_embeddings().weight.grad


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("tied, softcap", [(False, None), (True, None), (False, 0.7), (True, 0.7)])
def test_chunked_loss_and_gradients_equal_the_full_logits(dtype, tol, tied, softcap):
    model = _model(tied, softcap, dtype)
    assert (model.get_output_embeddings().weight is model.get_input_embeddings().weight) == tied
    full = _grads(model, lambda h, y: _full(model, h, y), dtype)
    for chunk in (1, 7, 48, 4096):  # one position, ragged chunks, exactly B x T, one chunk
        chunked = _grads(model, lambda h, y, c=chunk: head_loss_sum(model, h, y, chunk_tokens=c), dtype)
        assert chunked[0].dtype == torch.float32
        for got, want in zip(chunked, full):
            torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol * want.abs().max().item())
    assert full[1][0, :4].abs().sum() == 0  # ignored labels: no gradient there (their logits never counted)


@pytest.mark.parametrize("temperature", [1.0, 2.0])
def test_recovery_kl_is_the_same_chunked_loss(temperature):
    model = _model(True, 0.7)
    with torch.no_grad():
        teacher = model.base_model(input_ids=random_ids(2, 24, seed=5), use_cache=False)[0]  # (B, T, d)

    def chunked(h, y):
        return chunked_kl_sum(model, h, teacher, y, lm_weight=0.5, kl_weight=2.0, temperature=temperature,
                              chunk_tokens=5)

    def full(h, y):
        return 0.5 * _full(model, h, y) + _full(model, h, y, teacher, 2.0, temperature) - _full(model, h, y)

    for got, want in zip(_grads(model, chunked, torch.float32), _grads(model, full, torch.float32)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


def _param_grads(model, loss):
    model.zero_grad(set_to_none=True)
    loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("model_type", ["llama", "gpt2"])
def test_training_loss_sum_equals_the_models_own_loss_with_every_gradient(model_type):
    model = tiny_model(model_type, seed=2).train()
    ids = random_ids(2, 20)
    batch = {"input_ids": ids, "labels": _labels(ids)}
    n = items(batch, "lm")
    own = model(input_ids=ids, labels=batch["labels"], use_cache=False).loss * n  # transformers' shifted mean
    want = _param_grads(model, own)
    for chunk in (0, 6):  # 0: the full-logits path the knob keeps
        got_loss = loss_sum(model, batch, "lm", chunk)
        torch.testing.assert_close(got_loss, own.detach(), rtol=1e-5, atol=1e-5)
        got = _param_grads(model, got_loss)
        assert got.keys() == want.keys()
        for name in want:
            torch.testing.assert_close(got[name], want[name], rtol=1e-4, atol=1e-6, msg=name)


def test_the_forward_receives_every_model_input_a_batch_carries():
    model = tiny_model("llama", seed=2)
    ids = random_ids(1, 16)
    position_ids = torch.cat([torch.arange(6), torch.arange(10)])[None]  # two packed documents
    mask = torch.ones_like(ids)
    batch = {"input_ids": ids, "labels": ids, "position_ids": position_ids, "attention_mask": mask, "counts": ids}
    with torch.no_grad():
        got = final_hidden(model, batch)
        want = model(input_ids=ids, position_ids=position_ids, attention_mask=mask, output_hidden_states=True)
        plain = final_hidden(model, {"input_ids": ids})
    torch.testing.assert_close(got, want.hidden_states[-1])
    assert not torch.allclose(got, plain)  # the restarted positions reached the model


def test_backward_keeps_no_vocabulary_wide_activation_outside_one_chunk():
    """Saved-tensor hooks see what autograd keeps between forward and backward outside checkpoints: the chunked loss
    keeps no logits at all (each chunk's are recomputed inside its checkpoint), the full loss keeps (B, T, V)."""
    model = tiny_model("llama", seed=2).train()
    ids = random_ids(2, 32)
    weights = {p.data_ptr() for p in model.parameters()}
    kept = []

    def pack(t):
        if t.dim() >= 2 and t.shape[-1] == VOCAB and t.data_ptr() not in weights:
            kept.append(t.numel() // VOCAB)  # positions of vocabulary-wide rows kept for backward
        return t

    for chunk in (8, 0):
        kept.clear()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = loss_sum(model, {"input_ids": ids, "labels": ids}, "lm", chunk_tokens=chunk)
        loss.backward()
        assert (max(kept) >= 64) if chunk == 0 else kept == [], (chunk, kept)


def test_loop_evaluation_scores_chunked_like_the_full_logits():
    model = tiny_model("llama", seed=2)
    ids = random_ids(4, 12)
    labels = ids.clone()
    labels[:, :8] = -100  # passkey-like: only the answer scored
    data = types.SimpleNamespace(eval_batches=lambda length, batches, size: [{"input_ids": ids, "labels": labels}])
    acc = types.SimpleNamespace(process_index=0, num_processes=1, device=torch.device("cpu"),
                                reduce=lambda t, op: t)
    got = validation_metrics(model, data, "passkey", [12], 1, 4, acc, chunk_tokens=5)
    with torch.no_grad():
        logits = model(input_ids=ids).logits.float()
    shifted = next_tokens(labels)
    loss = F.cross_entropy(logits.flatten(0, 1), shifted.flatten(), ignore_index=-100, reduction="sum")
    right = ((logits.argmax(-1) == shifted) | (shifted == -100)).all(1).float().mean()
    assert got["eval/loss@12"] == pytest.approx(float(loss) / int((shifted != -100).sum()), rel=1e-5)
    assert got["eval/accuracy@12"] == pytest.approx(float(right))
    losses, hit = head_token_scores(model, final_hidden(model, {"input_ids": ids}), shifted, 3)
    assert torch.equal(hit, logits.argmax(-1) == shifted) and losses[:, :7].abs().sum() == 0


def test_compiled_model_trains_with_the_chunked_loss_like_eager():
    model = tiny_model("llama", seed=2).train()
    batch = {"input_ids": random_ids(2, 16), "labels": random_ids(2, 16)}
    want = _param_grads(model, loss_sum(model, batch, "lm", 6))
    compiled = torch.compile(model, backend="aot_eager")
    got = _param_grads(model, loss_sum(compiled, batch, "lm", 6))
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-4, atol=1e-6, msg=name)
    torch._dynamo.reset()


def test_lora_gradients_through_the_chunked_loss_equal_the_full_logits():
    from peft import LoraConfig, get_peft_model
    model = get_peft_model(tiny_model("llama", seed=2), LoraConfig(r=4, target_modules=["q_proj", "v_proj"],
                                                                   init_lora_weights=False)).train()
    batch = {"input_ids": random_ids(2, 16), "labels": random_ids(2, 16)}
    want = _param_grads(model, loss_sum(model, batch, "lm", 0))
    got = _param_grads(model, loss_sum(model, batch, "lm", 5))
    assert want and all("lora_" in n for n in want)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-4, atol=1e-6, msg=name)


def test_activation_offload_and_the_full_logits_knob_train_like_the_default(tmp_path):
    corpus = write_corpus(tmp_path)
    runs = {"default": {}, "offload": {"activation_offload": True, "gradient_checkpointing": True},
            "full-logits": {"loss_chunk_tokens": 0}, "chunk-8": {"loss_chunk_tokens": 8}}
    losses = {}
    for name, knobs in runs.items():
        recipe = lm_recipe(corpus, tmp_path / name, steps=3, **knobs) | {"eval": {"every": 3, "batches": 1,
                                                                                  "batch_size": 2}}
        result = train(recipe_from_dict(recipe))
        losses[name] = [result.losses[s] for s in sorted(result.losses)] + list(result.evals[3].values())
    assert isinstance(model_setup.activation_offload(True, "cpu"), torch.autograd.graph.save_on_cpu)
    assert losses["offload"] == pytest.approx(losses["default"], rel=1e-5)  # same math, saved elsewhere
    assert losses["full-logits"] == pytest.approx(losses["default"], rel=1e-5)
    assert losses["chunk-8"] == pytest.approx(losses["default"], rel=1e-5)
    assert losses["default"][-2] < losses["default"][0]  # it trained


@pytest.mark.skipif(not torch.cuda.is_available(), reason="Liger's fused kernel runs on CUDA only")
def test_liger_on_cuda_equals_the_full_logits():
    pytest.importorskip("liger_kernel")
    from retrofit.logit_head import _fused_cross_entropy
    model = _model(True, 0.7).cuda()
    hidden = torch.zeros(1, 1, model.config.hidden_size, device="cuda")
    assert _fused_cross_entropy(model, hidden, torch.zeros(1, 1, dtype=torch.long, device="cuda")) is not None
    fused = _grads(model, lambda h, y: head_loss_sum(model, h, y), torch.float32)
    full = _grads(model, lambda h, y: _full(model, h, y), torch.float32)
    for got, want in zip(fused, full):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * want.abs().max().item())


# ---- item 3: the planner against a measured peak -------------------------------------------------------------------

def _measured(loop: str, sizes: dict, seq_len: int, *, checkpointing: bool = False, chunk_tokens: int = 256) -> dict:
    """One run of retrofit bench train --memory's child in a fresh process: 2 steps, its peak and prediction."""
    from retrofit.bench import train_memory
    spec = {"loop": loop, "seq_len": seq_len, "model": None, "model_type": "llama", "sizes": sizes, "batch": 1,
            "steps": 2, "precision": "fp32", "cpu": True, "threads": 1, "gradient_checkpointing": checkpointing,
            "activation_offload": False, "loss_chunk_tokens": chunk_tokens, "norm": None}
    return train_memory._run_child(spec)


def test_the_dry_run_prediction_is_within_15_percent_of_the_measured_peak():
    """A fresh process per run (retrofit bench train --memory's child): predicted = retrofit.memory.plan_training
    from the config before the model loads, measured = the process's VmHWM after 2 steps. Logits are most of what
    training adds here (vocabulary 8,192, 2,048 tokens), whole or chunked."""
    sizes = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "vocab_size": 8192}
    for loop in ("retrofit", "retrofit-full-logits"):
        row = _measured(loop, sizes, 2048)
        assert row["predicted_mb"] == pytest.approx(row["peak_mb"], rel=0.15), row
        assert row["predicted_parts"]["logits"] > 0.2 * (row["peak_mb"] - row["predicted_parts"]["process"]) or \
            loop == "retrofit"


def test_the_prediction_holds_under_gradient_checkpointing():
    """Gradient checkpointing, 8 layers of width 256, 2,048 tokens: the step's peak is the backward's first layer
    recomputed beside every gradient (plan_training's "layers" moment). Each layer's inner tensors (2-8 MiB) are
    made and freed twice a step; without the loop's return_freed_memory glibc kept them resident (905 MiB measured
    vs 690 with it: predicted / peak 0.86 instead of 1.12)."""
    sizes = {"hidden_size": 256, "intermediate_size": 1024, "num_hidden_layers": 8, "num_attention_heads": 4,
             "num_key_value_heads": 2, "vocab_size": 2048}
    row = _measured("retrofit", sizes, 2048, checkpointing=True, chunk_tokens=1024)
    parts = row["predicted_parts"]
    assert parts["gradients"] + parts["recompute"] > parts["activations"] + parts["head_gradient"] + parts["logits"]
    assert row["predicted_mb"] == pytest.approx(row["peak_mb"], rel=0.15), row


# SmolLM2-135M's architecture (its GGUF header), as the H100 run built it with random weights
SMOLLM2 = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
               num_key_value_heads=3, head_dim=64, vocab_size=49152, tie_word_embeddings=True)


def test_the_bf16_plan_meets_the_peaks_an_h100_measured():
    """bf16 (fp32 master weights), gradient checkpointing, the chunked loss, one sequence of 8K and of 32K tokens:
    the unpatched peaks of docs/results/gpu-h100/run2's `long` part (CUDA's allocator, the same recipe). Planning
    the residual stream in bf16, as the planner did, predicted 0.89 and 0.68 of them."""
    import json
    from pathlib import Path

    from transformers import AutoConfig

    from retrofit.memory import count_parameters, plan_training
    report = Path(__file__).resolve().parents[2] / "docs/results/gpu-h100/run2/report.json"
    runs = json.loads(report.read_text())["parts"]["long"]["runs"]
    measured = {r["seq_len"]: r["peak_memory_mb"] for r in runs if r["norm"] == "unpatched"}
    config = AutoConfig.for_model("llama", **SMOLLM2)
    params = count_parameters(config)
    assert sorted(measured) == [8192, 32768]
    for tokens, peak_mb in measured.items():
        plan = plan_training(config, params, tokens=tokens, precision="bf16", checkpointing=True, chunk_tokens=1024,
                             process_bytes=0)
        assert plan["total"] / 2 ** 20 == pytest.approx(peak_mb, rel=0.10), (tokens, plan)


def test_train_dry_run_prints_the_plan_and_trains_nothing(tmp_path, capsys):
    import yaml

    from retrofit.cli import main
    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump(lm_recipe(write_corpus(tmp_path), tmp_path / "run")))
    assert main(["train", str(recipe), "--dry-run", "--plan-for", "cpu:24"]) == 0
    out = capsys.readouterr().out
    assert "predicted: fits" in out and "logits" in out and "longest data.seq_len that fits" in out
    assert not (tmp_path / "run").exists()
    assert main(["train", str(recipe), "data.seq_len=4096", "--dry-run", "--plan-for", "cuda:0.01"]) == 0
    assert "does NOT fit" in capsys.readouterr().out
    assert main(["train", str(recipe), "--dry-run", "--plan-for", "tpu:8"]) == 2
    err = capsys.readouterr().err
    assert "--plan-for must be" in err and "Traceback" not in err


def test_train_dry_run_plans_any_source(tmp_path, run_cli, capsys):
    """--dry-run on a patched folder, an adapter on it, or a plain folder (issue 53: the planner built the model from
    a config carrying the save guard, a 30-line traceback): the plan of the base it trains, one line each."""
    import yaml

    import retrofit
    from retrofit.load.adapters import save_adapter
    plain, patched = tiny_model("llama"), tiny_model("llama")
    plain.save_pretrained(tmp_path / "plain")
    retrofit.patch(patched, "avnorm")
    patched.save_pretrained(tmp_path / "patched")
    from peft import LoraConfig, get_peft_model
    base = retrofit.from_pretrained(str(tmp_path / "patched"))
    save_adapter(get_peft_model(base, LoraConfig(r=2, target_modules=["q_proj"], task_type="CAUSAL_LM")),
                 tmp_path / "adapter")
    recipe = lm_recipe(write_corpus(tmp_path), tmp_path / "run")
    capsys.readouterr()  # the saves' progress bars
    for source in ("plain", "patched", "adapter"):
        recipe["model"] = {"source": str(tmp_path / source), "tokenizer": recipe["model"]["tokenizer"]}
        (tmp_path / "r.yaml").write_text(yaml.safe_dump(recipe))
        code, err, out = run_cli(["train", tmp_path / "r.yaml", "--dry-run", "--plan-for", "cpu:24"])
        assert code == 0 and not err, (source, err)
        params = sum(p.numel() for p in plain.parameters())
        assert f"plan: {params / 1e6:,.1f}M parameters" in out and "predicted: fits" in out, (source, out)
    assert not (tmp_path / "run").exists()


def test_plan_grows_with_one_chunk_of_logits_not_with_length_times_vocabulary():
    from transformers import AutoConfig

    from retrofit.memory import plan_training
    config = AutoConfig.for_model("llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                  num_attention_heads=4, vocab_size=50257)
    short, long = (plan_training(config, 10 ** 6, tokens=n, chunk_tokens=1024, process_bytes=0) for n in (1024, 8192))
    full = plan_training(config, 10 ** 6, tokens=8192, chunk_tokens=0, process_bytes=0)
    assert long["logits"] == short["logits"] < full["logits"] / 7
    assert long["activations"] == 8 * short["activations"]


@pytest.mark.parametrize("options, message", [(["--loops", "nope"], "--loops: unknown"),
                                              (["--lengths", "8k"], "--lengths must be"),
                                              (["--lengths", "1"], "--lengths must be")])
def test_bench_train_memory_refuses_bad_options_in_one_line(options, message, tmp_path, capsys):
    from retrofit.cli import main
    assert main(["bench", "train", "--memory", *options, "--out", str(tmp_path / "m.json")]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and not (tmp_path / "m.json").exists()


def test_memory_table_compares_with_the_trainer_both_as_shipped_and_under_the_same_allocator():
    """`hf-trainer-freed` is the Trainer with retrofit's CPU allocator setting: the table gives each loop's peak over
    both Trainer rows of its length, so the allocator's share of the gap is visible."""
    from retrofit.bench.train_memory import _table
    rows = [{"loop": loop, "seq_len": 8192, "peak_mb": peak, "tokens_per_s": 60.0, "batch": 1, "vocab_size": 100}
            for loop, peak in (("retrofit", 3000.0), ("hf-trainer", 10000.0), ("hf-trainer-freed", 6000.0))]
    line = next(x for x in _table(rows).splitlines() if x.startswith("| retrofit |"))
    assert line.rstrip(" |").endswith("| 0.30 | 0.50")
