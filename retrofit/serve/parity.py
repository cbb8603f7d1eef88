"""vLLM against retrofit on saved checkpoints: greedy tokens and prompt logprobs, fp32 on this machine.

    python -m retrofit.serve.parity runs/smollm2-avnorm runs/smollm2-ssmax --text persuasion.txt --out parity/

Run in vLLM's environment (docs/serving.md). For each folder: retrofit.from_pretrained's greedy `generate` and the
log-probabilities it gives every prompt token, then the same from vLLM (the plugin, temperature 0, prompt_logprobs);
writes parity.json and parity.md (folder -> norm, tokens equal, max |logprob difference|). The prompts are
windows of --text cut by the folder's own tokenizer. tests/serve/test_serve_vllm.py runs the same functions on tiny
models.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path

import torch

from ..errors import RetrofitError, read_utf8
from ..io.atomic import atomic_folder
from .vllm_engine import checkpoint_plan, load_llm

SCHEMA = "retrofit.serve.parity/1"


def prompt_logprobs(model, prompt: list[int]) -> torch.Tensor:
    """(T - 1,) log p(token t | tokens < t) of a transformers model, in float32."""
    ids = torch.tensor([prompt], device=model.device)
    with torch.no_grad():
        logits = model(ids).logits[0, :-1].float().log_softmax(-1)  # (T - 1, V)
    return logits.gather(-1, ids[0, 1:, None])[:, 0].cpu()


def retrofit_run(folder, prompts: list[list[int]], new_tokens: int):
    """(greedy continuations, prompt logprobs) of retrofit.from_pretrained(folder) in float32 (an unpatched folder:
    retrofit.load.load, the baseline of how close the two engines are without a patch)."""
    from ..load import from_pretrained, load

    patched = checkpoint_plan(folder) is not None
    model = (from_pretrained(folder, dtype=torch.float32) if patched else load(str(folder), dtype="float32")).eval()
    tokens, logprobs = [], []
    for prompt in prompts:
        with torch.no_grad():
            out = model.generate(torch.tensor([prompt]), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                 do_sample=False, pad_token_id=0)
        tokens.append(out[0, len(prompt):].tolist())
        logprobs.append(prompt_logprobs(model, prompt))
    return tokens, logprobs


def vllm_run(folder, prompts: list[list[int]], new_tokens: int, **engine):
    """(greedy continuations, prompt logprobs) of vLLM with the plugin: fp32, eager, engine arguments `engine`."""
    import vllm

    settings = dict(dtype="float32", enforce_eager=True, skip_tokenizer_init=True, seed=0, max_num_seqs=2,
                    kv_cache_memory_bytes=256 << 20)  # vLLM's CPU default reserves 92% of the memory
    llm = load_llm(folder, **{**settings, **engine})
    params = vllm.SamplingParams(temperature=0.0, max_tokens=new_tokens, min_tokens=new_tokens, prompt_logprobs=0,
                                 detokenize=False, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    tokens = [list(o.outputs[0].token_ids) for o in outputs]
    logprobs = [torch.tensor([step[token].logprob for step, token in zip(o.prompt_logprobs[1:], prompt[1:])])
                for o, prompt in zip(outputs, prompts)]
    del llm
    gc.collect()
    return tokens, logprobs


def compare(want, got) -> dict:
    """{tokens_equal, max_logprob_diff, first_token_difference} of two (tokens, logprobs) runs."""
    (want_tokens, want_logprobs), (got_tokens, got_logprobs) = want, got
    diff = max(float((g.double() - w.double()).abs().max()) for g, w in zip(got_logprobs, want_logprobs))
    first = next(([i, j] for i, (a, b) in enumerate(zip(want_tokens, got_tokens)) for j, (x, y) in enumerate(zip(a, b))
                  if x != y), None)
    return {"tokens_equal": want_tokens == got_tokens, "max_logprob_diff": diff, "first_token_difference": first}


def parity(folder, prompts: list[list[int]], new_tokens: int, **engine) -> dict:
    """One row of the table: the checkpoint's norm, the comparison and the seconds each engine took."""
    plan = checkpoint_plan(folder)
    start = time.perf_counter()
    want = retrofit_run(folder, prompts, new_tokens)
    middle = time.perf_counter()
    got = vllm_run(folder, prompts, new_tokens, **engine)
    return {"folder": str(folder), "norm": plan.norm if plan else "unpatched", "options": plan and plan.options,
            **compare(want, got), "prompts": len(prompts), "prompt_tokens": len(prompts[0]),
            "new_tokens": new_tokens, "seconds_retrofit": round(middle - start, 1),
            "seconds_vllm": round(time.perf_counter() - middle, 1)}


def text_prompts(folder, text_file, count: int, length: int) -> list[list[int]]:
    """`count` windows of `length` tokens of a text, by the checkpoint's own tokenizer."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder, trust_remote_code=False)
    ids = tokenizer(read_utf8(text_file, "--text", most=1 << 22)[: 64 * count * length])["input_ids"]
    if len(ids) < count * length:
        raise RetrofitError(f"--text {text_file} has {len(ids)} tokens; {count} prompts of {length} need more")
    return [ids[i * length:(i + 1) * length] for i in range(count)]


def table(rows: list[dict]) -> str:
    lines = ["| checkpoint | norm | greedy tokens equal | max prompt logprob diff | retrofit s | vLLM s |",
             "|---|---|---|---|---|---|"]
    return "\n".join(lines + [f"| {Path(r['folder']).name} | {r['norm']} | {'yes' if r['tokens_equal'] else 'no'} | "
                              f"{r['max_logprob_diff']:.2e} | {r['seconds_retrofit']} | {r['seconds_vllm']} |"
                              for r in rows]) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m retrofit.serve.parity", description=__doc__.split("\n")[0])
    parser.add_argument("folders", nargs="+", help="saved checkpoints (retrofit patch --out, save_pretrained)")
    parser.add_argument("--text", required=True, help="a UTF-8 text the prompts are cut from")
    parser.add_argument("--prompts", type=int, default=2, choices=range(1, 17), metavar="1..16")
    parser.add_argument("--prompt-tokens", type=int, default=256, choices=range(2, 4097), metavar="2..4096")
    parser.add_argument("--new-tokens", type=int, default=16, choices=range(1, 257), metavar="1..256")
    parser.add_argument("--out", required=True, help="a new or empty folder: parity.json, parity.md")
    args = parser.parse_args(argv)
    try:
        rows = []
        for folder in args.folders:
            prompts = text_prompts(folder, args.text, args.prompts, args.prompt_tokens)
            rows.append(parity(folder, prompts, args.new_tokens,
                               max_model_len=args.prompt_tokens + args.new_tokens))
            print(table(rows[-1:]).splitlines()[-1], flush=True)
        with atomic_folder(args.out, "--out") as tmp:
            (tmp / "parity.json").write_text(json.dumps({"schema": SCHEMA, "rows": rows}, indent=2) + "\n")
            (tmp / "parity.md").write_text(table(rows))
    except RetrofitError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(table(rows))
    return 0


if __name__ == "__main__":  # vLLM's engine may start processes that import __main__: keep this guard
    sys.exit(main())
