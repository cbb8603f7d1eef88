"""vLLM serves a patched checkpoint as retrofit runs it: greedy tokens equal, prompt logprobs within 1e-3 (fp32, CPU).

Runs only where vLLM imports (its own environment: `bash .ci/vllm`); skipped in the main one. A tiny Llama with head
size 64 (vLLM's CPU attention refuses 8) is patched in-process with non-trivial parameters (random gains, scales and
sinks: an identity-start patch would pass without the plugin), saved with save_pretrained, loaded back by
retrofit.from_pretrained (the reference) and by vLLM through the plugin. One LLM per case: ~10-60 s each here.
"""

from __future__ import annotations

import gc

import pytest
import torch

vllm = pytest.importorskip("vllm", reason="vLLM is not installed here (its own environment: bash .ci/vllm)")

import retrofit  # noqa: E402
from retrofit.serve.plan import PSOFTMAX_REFUSED  # noqa: E402
from tests.tiny import tiny_model  # noqa: E402

# initializer_range 0.2: sharp logits, so every case's patch moves the prompt logprobs by > 1 (measured 4-7), not
# the ~0.01 of the default 0.02 init, where dropping a patch would pass a 1e-3 tolerance by luck
HEAD_64 = dict(hidden_size=128, intermediate_size=256, num_attention_heads=2, num_key_value_heads=1,
               max_position_embeddings=256, initializer_range=0.2)
PROMPTS = [[5, 17, 33, 9, 61, 12, 40, 7, 88, 23, 51, 3, 70, 14, 29, 45, 66, 8, 91, 36],
           [44, 2, 19, 83, 57, 11, 30, 72, 6, 95, 25, 48]]
NEW_TOKENS = 8
TOLERANCE = 1e-3
# fp32 as retrofit runs; no compile (seconds saved); a 64 MiB KV cache (vLLM's CPU default reserves 92% of RAM)
ENGINE = dict(dtype="float32", enforce_eager=True, skip_tokenizer_init=True, max_model_len=256, max_num_seqs=2,
              kv_cache_memory_bytes=64 << 20, seed=0)

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
}
RANDOM = {"gain": lambda p: torch.rand_like(p) + 0.5, "s": lambda p: torch.rand_like(p) + 0.5,
          "sink": torch.randn_like, "exponent": lambda p: torch.rand_like(p) * 2 - 1}


def prompt_logprobs(model, prompt: list[int]) -> torch.Tensor:
    """(T - 1,) log p(token t | tokens < t) of a transformers model."""
    ids = torch.tensor([prompt])
    with torch.no_grad():
        logits = model(ids).logits[0, :-1].float().log_softmax(-1)  # (T - 1, V)
    return logits.gather(-1, ids[0, 1:, None])[:, 0]


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


def reference(folder):
    """retrofit's greedy tokens and prompt logprobs for PROMPTS."""
    model = retrofit.from_pretrained(folder, dtype=torch.float32).eval()
    tokens, logprobs = [], []
    for prompt in PROMPTS:
        with torch.no_grad():
            out = model.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                                 do_sample=False, pad_token_id=0)
        tokens.append(out[0, len(prompt):].tolist())
        logprobs.append(prompt_logprobs(model, prompt))
    return tokens, logprobs


def served(folder):
    """vLLM's greedy tokens and prompt logprobs for PROMPTS (engine in this process, eager, fp32)."""
    llm = vllm.LLM(model=str(folder), **ENGINE)
    params = vllm.SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS, prompt_logprobs=0,
                                 detokenize=False, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    tokens = [list(o.outputs[0].token_ids) for o in outputs]
    logprobs = [torch.tensor([step[token].logprob for step, token in zip(o.prompt_logprobs[1:], prompt[1:])])
                for o, prompt in zip(outputs, PROMPTS)]
    del llm
    gc.collect()
    return tokens, logprobs


@pytest.fixture(autouse=True)
def engine_in_process(monkeypatch):
    """The engine core in this process: no spawn per case, and a refusal reaches the test as itself."""
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


@pytest.mark.parametrize("case", list(CASES))
def test_vllm_matches_retrofit(case, tmp_path):
    folder, effect = patched_folder(tmp_path, case)
    assert effect > 1.0  # the patch matters at this tolerance: serving the model unpatched would fail
    want_tokens, want_logprobs = reference(folder)
    got_tokens, got_logprobs = served(folder)
    diff = max(float((g - w).abs().max()) for g, w in zip(got_logprobs, want_logprobs))
    print(f"PARITY {case}: tokens equal {got_tokens == want_tokens}, max prompt logprob diff {diff:.2e} "
          f"(the patch moves them by {effect:.2f})")
    assert got_tokens == want_tokens
    assert diff <= TOLERANCE


def test_psoftmax_is_refused_at_load(tmp_path):
    model = tiny_model("llama", **HEAD_64)
    retrofit.patch(model, "psoftmax", p=2)
    model.save_pretrained(tmp_path)
    with pytest.raises(Exception, match="p-softmax is not served by vLLM") as caught:
        vllm.LLM(model=str(tmp_path), **ENGINE)
    assert PSOFTMAX_REFUSED in str(caught.value)
