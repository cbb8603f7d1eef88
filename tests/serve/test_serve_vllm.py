"""vLLM serves a patched checkpoint as retrofit runs it: greedy tokens equal, prompt logprobs within 1e-3 (fp32, CPU).

Runs only where vLLM imports (its own environment: `bash .ci/vllm`); skipped in the main one. A tiny Llama with head
size 64 (vLLM's CPU attention refuses 8) is patched in-process with non-trivial parameters (random gains, scales and
sinks: an identity-start patch would pass without the plugin), saved with save_pretrained, loaded back by
retrofit.from_pretrained (the reference) and by vLLM through the plugin (retrofit.serve.parity's functions).
One LLM per case: the first ~40 s here (imports), then ~7 s each.
"""

from __future__ import annotations

import json

import pytest
import torch

vllm = pytest.importorskip("vllm", reason="vLLM is not installed here (its own environment: bash .ci/vllm)")

import retrofit  # noqa: E402
from retrofit.cli import main  # noqa: E402
from retrofit.errors import RetrofitError  # noqa: E402
from retrofit.norms import get_norm, make_options  # noqa: E402
from retrofit.serve.parity import compare, prompt_logprobs, retrofit_run, vllm_run  # noqa: E402
from retrofit.serve.vllm_engine import load_llm  # noqa: E402
from tests.evaluate.test_ruler import BOOK, LENGTH  # noqa: E402
from tests.tiny import char_tokenizer, tiny_model  # noqa: E402

# initializer_range 0.2: sharp logits, so every case's patch moves the prompt logprobs by > 1 (measured 4-7), not
# the ~0.01 of the default 0.02 init, where dropping a patch would pass a 1e-3 tolerance by luck
HEAD_64 = dict(hidden_size=128, intermediate_size=256, num_attention_heads=2, num_key_value_heads=1,
               max_position_embeddings=256, initializer_range=0.2)
PROMPTS = [[5, 17, 33, 9, 61, 12, 40, 7, 88, 23, 51, 3, 70, 14, 29, 45, 66, 8, 91, 36],
           [44, 2, 19, 83, 57, 11, 30, 72, 6, 95, 25, 48]]
NEW_TOKENS = 8
TOLERANCE = 1e-3
ENGINE = dict(max_model_len=256, kv_cache_memory_bytes=64 << 20)  # over vllm_run's fp32, eager settings

# case -> (retrofit.patch arguments, the patch parameter to randomize or None). ref_len 8: the prompts run past L.
CASES = {
    "avnorm": (dict(norm="avnorm"), "gain"),
    "avnorm-layer-affine": (dict(norm="avnorm", kind="layer", affine=True), "gain"),
    "avnorm-beyond": (dict(norm="avnorm", mode="beyond", ref_len=8), "exponent"),
    "avnorm-heads-yarn": (dict(norm="avnorm", layers=[1], heads=[0], rope="yarn:2"), "gain"),
    "ssmax": (dict(norm="ssmax"), "s"),
    "ssmax-beyond-nope": (dict(norm="ssmax", scale="beyond", ref_len=8, nope=True), None),
    "ssmax-llama4-heads": (dict(norm="ssmax", scale="llama4", ref_len=4, beta=2.0, heads=[1]), None),
    "softmax1": (dict(norm="softmax1"), None),  # the classic +1: no weight, so plain vLLM would serve it silently
    "softmax1-learned": (dict(norm="softmax1", learnable=True), "sink"),
    "softmax-linear": (dict(norm="softmax", rope="linear:2"), None),
    "softmax-llama3": (dict(norm="softmax", rope="llama3:8,low_freq_factor=1,high_freq_factor=4,original=32"), None),
}
RANDOM = {"gain": lambda p: torch.rand_like(p) + 0.5, "s": lambda p: torch.rand_like(p) + 0.5,
          "sink": torch.randn_like, "exponent": lambda p: torch.rand_like(p) * 2 - 1}


def patched_folder(tmp_path, case: str):
    """(a saved patched tiny Llama whose patch parameters are far from identity (seeded), how far the patch moved
    the first prompt's logprobs from the unpatched model's)."""
    spec, name = CASES[case]
    model = tiny_model("llama", **HEAD_64)
    unpatched = prompt_logprobs(model, PROMPTS[0])
    spec = dict(spec)
    retrofit.patch(model, spec.pop("norm"), **spec)
    torch.manual_seed(1)
    with torch.no_grad():
        for key, param in model.named_parameters():
            if name and key.endswith(f"retrofit.{name}"):
                param.copy_(RANDOM[name](param))
    folder = tmp_path / case
    model.save_pretrained(folder)
    return folder, float((prompt_logprobs(model, PROMPTS[0]) - unpatched).abs().max())


@pytest.fixture(autouse=True)
def engine_in_process(monkeypatch):
    """The engine core in this process: no spawn per case, and a refusal reaches the test as itself."""
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


@pytest.mark.parametrize("case", list(CASES))
def test_vllm_matches_retrofit(case, tmp_path):
    folder, effect = patched_folder(tmp_path, case)
    assert effect > 1.0  # the patch matters at this tolerance: serving the model unpatched would fail
    result = compare(retrofit_run(folder, PROMPTS, NEW_TOKENS), vllm_run(folder, PROMPTS, NEW_TOKENS, **ENGINE))
    print(f"PARITY {case}: tokens equal {result['tokens_equal']}, max prompt logprob diff "
          f"{result['max_logprob_diff']:.2e} (the patch moves them by {effect:.2f})")
    assert result["tokens_equal"], result["first_token_difference"]
    assert result["max_logprob_diff"] <= TOLERANCE


def test_psoftmax_is_refused_at_load(tmp_path):
    model = tiny_model("llama", **HEAD_64)
    retrofit.patch(model, "psoftmax", p=2)
    model.save_pretrained(tmp_path)
    with pytest.raises(Exception, match="p-softmax is not served by vLLM") as caught:  # by the model vLLM builds
        vllm.LLM(model=str(tmp_path), dtype="float32", enforce_eager=True, skip_tokenizer_init=True, **ENGINE)
    assert get_norm("psoftmax").serve_refusal(make_options("psoftmax", p=2), None) in str(caught.value)
    with pytest.raises(RetrofitError, match="p-softmax is not served by vLLM"):  # before any engine starts
        load_llm(tmp_path, **ENGINE)


def test_an_environment_without_the_plugin_is_refused(tmp_path, monkeypatch):
    model = tiny_model("llama", **HEAD_64)
    retrofit.patch(model, "softmax1")
    model.save_pretrained(tmp_path)
    monkeypatch.setenv("VLLM_PLUGINS", "lora_filesystem_resolver")
    with pytest.raises(RetrofitError, match="leaves out 'retrofit': vLLM would serve a patched model as the original"):
        load_llm(tmp_path, **ENGINE)


def test_eval_engine_vllm_answers_as_transformers(tmp_path, capsys):
    """`retrofit eval --engine vllm` on generation tasks: the same predictions and scores as the transformers path."""
    model = tiny_model("llama", **{**HEAD_64, "max_position_embeddings": 2048})  # RULER's 1024 characters + answers
    retrofit.patch(model, "ssmax")
    torch.manual_seed(1)
    with torch.no_grad():
        for key, param in model.named_parameters():
            if key.endswith("retrofit.s"):
                param.copy_(RANDOM["s"](param))
    model.save_pretrained(tmp_path / "model")
    char_tokenizer().save_pretrained(tmp_path / "model")
    (tmp_path / "book.txt").write_text(BOOK)
    args = ["eval", str(tmp_path / "model"), "--tasks", "niah,vt", "--lengths", str(LENGTH), "--samples", "1",
            "--depths", "0,1", "--data", str(tmp_path / "book.txt"), "--dtype", "float32", "--no-progress"]
    assert main([*args, "--out", str(tmp_path / "hf")]) == 0
    assert main([*args, "--engine", "vllm", "--out", str(tmp_path / "vllm")]) == 0
    want, got = (json.loads((tmp_path / out / "results.json").read_text()) for out in ("hf", "vllm"))
    assert got["models"][0]["engine"] == "vllm" and got["settings"]["engine"] == "vllm"
    rows = got["models"][0]["ruler"]
    assert [(r["task"], r["depth"]) for r in rows] == [("niah", 0.0), ("niah", 1.0), ("vt", None)]
    assert [r["predictions"] for r in rows] == [r["predictions"] for r in want["models"][0]["ruler"]]
    assert [r["scores"] for r in rows] == [r["scores"] for r in want["models"][0]["ruler"]]
    assert all(r["predictions"][0] for r in rows)  # something was generated (not an empty answer on both sides)


def test_other_families_are_refused_when_patched_and_served_when_plain(tmp_path):
    """The guards: a patched Qwen2 is refused in one line (plain vLLM would serve it as the original); a plain
    Qwen2 is vLLM's model as it is (its greedy tokens equal transformers')."""
    model = tiny_model("qwen2", **HEAD_64)
    model.save_pretrained(tmp_path / "plain")
    want = [model.generate(torch.tensor([p]), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False,
                           pad_token_id=0)[0, len(p):].tolist() for p in PROMPTS]
    assert vllm_run(tmp_path / "plain", PROMPTS, NEW_TOKENS, **ENGINE)[0] == want
    retrofit.patch(model, "softmax1")
    model.save_pretrained(tmp_path / "patched")
    with pytest.raises(RetrofitError, match="serves LlamaForCausalLM checkpoints, not Qwen2ForCausalLM"):
        vllm.LLM(model=str(tmp_path / "patched"), dtype="float32", enforce_eager=True, skip_tokenizer_init=True,
                 **ENGINE)
