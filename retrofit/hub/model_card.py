"""The model card `retrofit push` writes as README.md: metadata, what was patched and why, how to load
it, how it was trained (recipe, loss curve) and how it extrapolates (the `retrofit eval` table).

Built from the `info` dict that retrofit.hub.publish.stage gathers; no network; the one file read is a .gguf base's
header, for its origin (hub/origin.py). Every text
it embeds passes one of three escapes (retrofit.io.escape): _text (markdown text: one line, HTML and markdown characters
escaped), _code (an inline code span fenced by more backticks than it holds) or _fence (a code block whose fence is
longer than any run of backticks inside): a recipe `name:` with newlines, backticks or HTML stays text.
"""

from __future__ import annotations

import html
import json
from urllib.parse import quote

from huggingface_hub import ModelCardData

from ..io.escape import md_code as _code
from ..io.escape import md_fence as _fence
from ..io.escape import md_text as _text
from ..norms import NORMS, get_norm
from ..record import GUARD  # config.json's attn_implementation in every saved patched model: plain transformers refuses
from ..version import INSTALL
from .origin import card_base_model

NOPE_WHY = ("Positional information was removed (NoPE): lengths beyond those seen in training carry no "
            "out-of-distribution position signal.")


def model_card(info: dict) -> str:
    record, repo, adapter = info["record"], info["repo"], info["kind"] == "adapter"
    norm = record["norm"]
    base = card_base_model(info["base_model"])  # a Hub id as given, or a .gguf base's own header's origin
    tags = (["retrofit", norm, "attention-normalization", "length-extrapolation"]
            + (["nope"] if record.get("nope") else []))
    tags += ["lora", "peft"] if adapter else []
    data = ModelCardData(library_name="peft" if adapter else "transformers", base_model=base, license=info["license"],
                         tags=tags, pipeline_tag="text-generation")
    options = _text(", ".join(f"{k}={v}" for k, v in shown_options(record).items()) or "none")
    formula = _code(get_norm(norm).formula)  # a bare | would split the table cell: _code escapes it
    calibration = record.get("calibration")
    what = ("a LoRA adapter (with the patch recorded)" if adapter
            else ("the merged model" if info["merged"] else "the model"))
    lines = [
        f"# {_text(repo.split('/')[-1])}", "",
        f"{_text(base or info.get('model_type') or 'A causal language model')} with its attention normalization "
        "replaced by "
        f"**{norm}**{' and its positional information removed (NoPE)' if record.get('nope') else ''}, made with "
        f"retrofit. This repository holds {what}.", "",
        "## What was patched, and why", "",
        "| | |", "|---|---|",
        f"| norm | {_code(norm)}: {_text(get_norm(norm).summary)} |",
        f"| formula | {formula} |",
        f"| options | {options} |",
        f"| positions | {'removed (NoPE)' if record.get('nope') else 'kept'} |",
        f"| attention kernel | wraps {_code(record.get('base_attn_implementation', 'sdpa'))} |",
        f"| parameters added | {info['params_added']:,} |",
        f"| calibration | {_text(json.dumps(calibration)) if calibration else 'none'} |",
        f"| retrofit version | {_text(record.get('retrofit_version'))} |", "",
        f"Why: {get_norm(norm).card or get_norm(norm).summary}" + (f" {NOPE_WHY}" if record.get("nope") else ""), "",
        "## How to load", "",
        "```python",
        f"import retrofit  # {INSTALL}  (PyPI's `retrofit` is another project)",
        f"model = retrofit.from_pretrained({json.dumps(repo)})  # also: revision=..., dtype=..., device_map=...",
        "```", "",
    ]
    if adapter:
        lines += [f"This loads the base {_code(info['base_model'])}, applies the patch recorded in `retrofit.json` "
                  "and then the adapter: a `PeftModel`. `model.merge_and_unload()` gives a "
                  "plain patched model.", ""]
    elif (info.get("task") or {}).get("task") == "counting":
        lines += ["This run trained a counting head (`task.json`, `task_head.safetensors`): "
                  f"{_code(f'retrofit.load.load(huggingface_hub.snapshot_download({json.dumps(repo)}))')} loads LM and "
                  "head.", ""]
    if info.get("standalone"):
        lines += ["Without retrofit: this repository ships `modeling_retrofit.py` (generated from retrofit's own code; "
                  "read it first), which plain transformers runs when asked to:", "",
                  "```python",
                  "from transformers import AutoModelForCausalLM",
                  f"model = AutoModelForCausalLM.from_pretrained({json.dumps(repo)}, trust_remote_code=True)",
                  "```", "",
                  "Without `trust_remote_code=True` transformers refuses it by name rather than silently run the "
                  "original attention.", ""]
    elif not adapter:
        lines += ["Plain `transformers.AutoModelForCausalLM.from_pretrained` refuses this checkpoint on purpose "
                  f"(config.json asks for attention implementation `{GUARD}`): without retrofit the model would "
                  "run its original attention and silently drop the patch's weights.", ""]
    lines += _training_section(info) + _eval_section(info)
    return f"---\n{data.to_yaml()}\n---\n\n" + "\n".join(lines).rstrip() + "\n"


def shown_options(record: dict) -> dict:
    """The recorded options as the card shows them: the option a calibration set (AVNorm's gain) says so, "calibrated
    on N tokens", never its start value (the card said gain=1.0 of calibrated gains, issue 62); the options that only
    start a parameter are left out, as PatchReport and the experiment's report leave them out."""
    options = dict(record.get("options") or {})
    if record.get("norm") not in NORMS:
        return options
    hidden, calibrated = NORMS[record["norm"]].report_options(options)
    shown = {k: v for k, v in options.items() if k not in hidden or k == calibrated}
    calibration = record.get("calibration")
    if calibrated and isinstance(calibration, dict):
        shown[calibrated] = f"calibrated on {calibration.get('tokens')} tokens"
    elif calibrated:
        shown[calibrated] = f"{options.get(calibrated, 1.0)} (not calibrated)"
    return shown


def _training_section(info: dict) -> list[str]:
    lines = ["## How it was trained", ""]
    summary, recipe = info["summary"], info.get("recipe_text")
    if not summary and not info["curve"]:
        made = _code(info["command"] if info.get("command") else "retrofit patch")
        return lines + [f"Not finetuned: the patch was applied to the pretrained weights with {made}"
                        + (", with calibrated gains." if (info["record"].get("calibration")) else "."), ""]
    if summary:
        loss = summary.get("final_loss")
        lines += [f"{_text(summary.get('steps'))} optimizer steps on {_text(summary.get('processes', 1))} process(es)"
                  + (f", final training loss {loss:.4g}" if isinstance(loss, (int, float)) else "")
                  + (". Merged from the LoRA adapter." if info["merged"] else "."), ""]
    if info["curve"]:
        lines += [f"![training loss]({quote(str(info['curve']))})", ""]
    if not recipe:
        return lines
    local = info.get("rerun_keys") or []
    values = {k: "[PATH, ...]" if k.endswith("files") else "PATH" for k in local}
    rerun = "retrofit train recipe.yaml" + "".join(f" {k}={v}" for k, v in values.items())
    how = (f"its paths on the machine that trained it went up as file names: rerun it with your own, `{rerun}`"
           if local else f"rerun with `{rerun}`")
    return lines + [f"The recipe it ran (`recipe.yaml`; {how}):", "", *_fence(recipe, "yaml"), ""]


def _eval_section(info: dict) -> list[str]:
    if not info["eval_md"]:
        return []
    return ["## Evaluation", "", "Length extrapolation by `retrofit eval` (full report: `eval/results.md`).", "",
            html.escape(info["eval_md"], quote=False), ""]  # a model's name may hold a tag: shown as text
