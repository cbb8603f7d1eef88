"""What `retrofit patch` does, as one library function: load, patch, calibrate, measure, save, push.

    from retrofit.patch_job import PatchJob, run_patch_job
    from retrofit.patch_spec import PatchSpec

    job = PatchJob("gpt2", PatchSpec("avnorm"), calibration_text="book.txt", check_text="para.txt", out="gpt2-av")
    outcome = run_patch_job(job)      # says each step as it ends (say=print); say=None: silent
    outcome.model, outcome.report, outcome.loss_before, outcome.loss_after, outcome.next_step, outcome.saved_to

commands/patch.py parses its flags into a PatchJob (checking what needs no model: counts, --out, the text files,
the PatchSpec) and calls run_patch_job; it prints what `say` is given and, from the outcome, where the model went.
A refusal names the command's flags: the field check_text is --check-text, push_to_hub is --push-to-hub.

The steps: every check that needs no weights (check_job: the selection against the config, an unfinished run, a
damaged source, a Hub token), load, the loss on the check text, patch (a parameter-free patch the checkpoint
carries is replaced), calibrate, the loss again (with the recovery command when the patch costs over RISE_NATS,
the schedule's losses and the layer/head ranking), save (load.save_model, atomically), push.
"""

from __future__ import annotations

import dataclasses
import math
import os
import shlex
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from .errors import RetrofitError
from .patch_spec import PatchSpec

# A rise in loss past which the patched model is not usable as it is: 0.5 nats multiplies the perplexity by 1.65 (the
# calibrated AVNorm start on SmolLM2 costs +0.68 and needs training; a recovered arm is within 0.05 of softmax).
RISE_NATS = 0.5
RECOVERY_RECIPE = Path(__file__).resolve().parent / "recipes" / "llama-recovery.yaml"


@dataclass
class PatchJob:
    """One `retrofit patch` run; each field is the flag of the same name (see `retrofit patch --help`)."""

    source: str                             # Hub id, local folder, .gguf file
    spec: PatchSpec                         # the patch: norm, options, nope, rope, layers, heads, gate
    calibration_text: str | None = None     # text file to calibrate per-head gains on
    calibrate_tokens: int = 8192
    check_text: str | None = None           # the loss on this text before and after patching
    check_tokens: int = 512
    rank: bool = False                      # with check_text: rank the patched layers (and heads) by cost
    rank_k: int | None = None               # ... and suggest the K cheapest (None: half)
    schedule_values: list[float] | None = None  # with check_text: the loss at these recovery-schedule positions
    schedule_start: float | None = None
    schedule_end: float | None = None
    out: str | None = None                  # the folder to save to (new or empty)
    push_to_hub: str | None = None          # OWNER/NAME, pushed after saving
    command: str | None = None              # the command line the pushed model card names
    dtype: str = "auto"
    progress: bool = True                   # progress bars (calibration, the ranking's forwards)


@dataclass
class PatchOutcome:
    """What run_patch_job did: the patched model (and tokenizer), the PatchReport, the losses it measured."""

    model: Any
    tokenizer: Any
    report: Any                             # record.PatchReport, with the calibration when there was one
    replaced: str | None = None             # the parameter-free patch the source carried, replaced
    loss_before: float | None = None        # on check_text
    loss_after: float | None = None
    next_step: str | None = None            # the recovery command, when the patch cost over RISE_NATS
    schedule: list[tuple[float, float, float]] = field(default_factory=list)  # (position, knob, loss)
    saved_to: str | None = None
    pushed: str | None = None               # the Hub commit URL


def check_job(job: PatchJob) -> None:
    """Every check that needs no weights, before anything loads; the first failure is a RetrofitError."""
    from .hub import check_repo, find_token
    from .load import check_finished, source_kind
    from .load.preflight import check_source
    from .norms import calibrated_norm_hints, get_norm

    _check_selection_range(job)
    if job.calibration_text and not get_norm(job.spec.norm).calibrates(job.spec.norm_options):
        raise RetrofitError(f"--calibration-text sets per-head gains; it needs a norm that has them: "
                            f"{calibrated_norm_hints()}")
    if job.schedule_values and not job.check_text:
        raise RetrofitError("--schedule-values measures a loss: give the text with --check-text FILE")
    if (job.rank or job.rank_k is not None) and not job.check_text:
        raise RetrofitError("--rank ranks by the loss on a text: give it with --check-text FILE")
    check_finished(job.source)  # an unfinished run, a missing or damaged local source: the first error
    if source_kind(job.source) != "hub":  # (a Hub id is looked up when it loads, after the token check)
        check_source(job.source)
    if not (job.out or job.push_to_hub or job.check_text):
        raise RetrofitError("nothing would be saved: give --out DIR (or --push-to-hub REPO); without them only "
                            "--check-text FILE measures the patch, saving nothing")
    if job.push_to_hub:  # a bad repo id or a missing token fails before any loading
        check_repo(job.push_to_hub)
        find_token()


def _check_selection_range(job: PatchJob) -> None:
    """--layers / --heads against the counts the config names, before loading (retrofit.patch checks the range again
    against the attention modules; the syntax and the rules between flags are the PatchSpec's)."""
    if job.spec.layers is None and job.spec.heads is None:
        return
    from .load import load_config
    from .load.preflight import check_selection_counts

    try:  # the range, from the config: before loading the weights (a text-only config names both counts)
        config = load_config(job.source)
    except (RetrofitError, OSError, ValueError):
        return  # load() reports what is wrong with the source
    check_selection_counts(config, [(job.spec.layers, "layers", "--layers"), (job.spec.heads, "heads", "--heads")])


def text_tokens(tokenizer, path: str, limit: int):
    """The first `limit` token ids of a text file (--calibration-text, --check-text), at least 2."""
    from .data.read import read_tokens

    if tokenizer is None:
        raise RetrofitError("this model ships no tokenizer, so text files cannot be used with it")
    ids = read_tokens(path, tokenizer, budget=limit, special=True)[:limit]  # reads as far as `limit` needs
    if ids.numel() < 2:
        raise RetrofitError(f"{path} has fewer than 2 tokens")
    return ids


def uncalibrated_cost(job: PatchJob) -> str | None:
    """What a norm's uncalibrated start costs a pretrained model (AVNorm's unit gains), measured; None when
    calibrated or harmless."""
    from .norms import get_norm

    return None if job.calibration_text else get_norm(job.spec.norm).uncalibrated_cost(job.spec.options)


def run_patch_job(job: PatchJob, *, say: Callable[[str], Any] | None = print,
                  warn: Callable[[str], Any] | None = None) -> PatchOutcome:
    """Check, load, patch, calibrate, measure, save, push (the module docstring). say: each step's line as it ends
    (the PatchReport, the losses, the ranking, where it was saved); warn: a warning (default: stderr)."""
    from .calibration import calibrate, text_rows
    from .costs import text_loss
    from .load import load, load_tokenizer, save_model
    from .patching import patch, unpatch_parameter_free

    say = say or (lambda line: None)
    warn = warn or (lambda line: print(f"retrofit: warning: {line}", file=sys.stderr))
    check_job(job)
    model = load(job.source, task_head=False, dtype=job.dtype)
    needs_tokens = job.calibration_text or job.check_text
    tokenizer = load_tokenizer(job.source) if (needs_tokens or job.out or job.push_to_hub) else None
    check = text_tokens(tokenizer, job.check_text, job.check_tokens) if job.check_text else None
    before = text_loss(model, check) if check is not None else None
    replaced = unpatch_parameter_free(model, job.source, job.spec.nope)
    outcome = PatchOutcome(model, tokenizer, patch(model, job.spec), replaced=replaced, loss_before=before)
    cost = uncalibrated_cost(job)
    if cost:
        warn(f"{cost}; add --calibration-text FILE")
    if job.calibration_text:
        ids = text_tokens(tokenizer, job.calibration_text, job.calibrate_tokens)
        outcome.report.calibration = calibrate(model, text_rows(model, ids), progress=job.progress)
    say(str(outcome.report))
    if replaced:
        say(replaced)
    if check is not None:
        _measure(job, outcome, check, say)
    if job.out:
        save_model(model, job.out, tokenizer=tokenizer, what="--out")
        outcome.saved_to = job.out
        say(f"saved to {job.out}  (load with retrofit.from_pretrained({job.out!r}))")
    if job.push_to_hub:
        outcome.pushed = _push(job, model, tokenizer)
    return outcome


def _measure(job: PatchJob, outcome: PatchOutcome, check, say) -> None:
    """check_text: the loss before and after, the recovery command, the schedule positions' losses, the ranking."""
    from .costs import rank_and_suggest, text_loss
    from .recovery.probe import describe_spread, head_spread, schedule_losses

    model, before, positions = outcome.model, outcome.loss_before, job.schedule_values
    started = time.perf_counter()
    after = outcome.loss_after = text_loss(model, check)
    forward_s = time.perf_counter() - started
    say(f"loss on {job.check_text} ({check.numel()} tokens): original {before:.4f}, "
        f"patched {after:.4f} (ppl {math.exp(min(after, 50)):.2f})")
    if after - before > RISE_NATS:
        outcome.next_step = next_step(job.source, job.spec, after - before, calibrated=bool(job.calibration_text))
        say(outcome.next_step)
    if positions:
        outcome.schedule = schedule_losses(model, check[None], positions, start=job.schedule_start,
                                           end=job.schedule_end)
        for t, value, loss in outcome.schedule:
            say(f"  schedule position {t:g} ({job.spec.norm} knob {value:g}): loss {loss:.4f} ({loss - before:+.4f})")
        even = [i / (len(positions) - 1) for i in range(len(positions))] if len(positions) > 1 else None
        if even and all(abs(a - b) < 1e-9 for a, b in zip(positions, even)):  # evenly spaced 0..1: usable
            say(f"  recovery.schedule.costs for shape: loss: [{', '.join(f'{c:.4f}' for _, _, c in outcome.schedule)}]")
        say(describe_spread(head_spread(model, check[None])))
    if job.rank or job.rank_k is not None:
        rank_and_suggest(model, check[None], job.rank_k, progress=job.progress, forward_s=forward_s, say=say)


def next_step(source: str, spec: PatchSpec, rise: float, calibrated: bool) -> str:
    """One line after check_text shows a rise over RISE_NATS (p-softmax p=2 on SmolLM2: +9.3 nats, issue 62): the
    recovery-training command, its overrides made from this patch so that the recipe loads as printed, starting at
    the norm's identity (recovery.schedule: p-softmax p 1, SSMax blend 0) where the norm has a scheduled option."""
    from .norms import get_norm
    from .recipe import PatchSection, load_yaml

    cls = get_norm(spec.norm)
    section_keys = {f.name for f in dataclasses.fields(PatchSection)}
    recipe_patch = load_yaml(RECOVERY_RECIPE.read_text(), str(RECOVERY_RECIPE)).get("patch") or {}
    ours = {o.name for o in cls.option_schema()}
    overrides = [f"model.source={source}", f"patch.norm={spec.norm}",
                 *(f"patch.{k}={v}" for k, v in spec.options.items()),
                 *(f"patch.{k}=null" for k in recipe_patch if k not in ours and k not in section_keys)]
    if not cls.calibrated_by_default:
        overrides.append("patch.calibrate_tokens=0")
    start = ""
    if cls.scheduled_option is not None and cls.schedule_identity is not None:
        overrides.append("recovery.schedule.steps=20")
        start = f", from the original model ({cls.scheduled_option} {cls.schedule_identity:g}) to the patch"
    first = "" if calibrated or not cls.calibrated_by_default else "add --calibration-text FILE, then "
    recipe = os.path.relpath(RECOVERY_RECIPE) if RECOVERY_RECIPE.is_relative_to(Path.cwd()) else RECOVERY_RECIPE
    return (f"next step: the patch costs {rise:+.2f} nats here (over {RISE_NATS}); {first}recover it by training"
            f"{start}: retrofit train {shlex.join([str(recipe), *overrides])}")


def _push(job: PatchJob, model, tokenizer) -> str:
    """Push the saved folder (or, without out, a temporary one) with the card naming job.command; the commit URL."""
    from .hub import push
    from .load import save_model

    with tempfile.TemporaryDirectory(prefix="retrofit-patch-") as tmp:
        folder = job.out or os.path.join(tmp, "model")
        if not job.out:
            save_model(model, folder, tokenizer=tokenizer, what="--out")
        # a local base: its card's license
        return push(folder, job.push_to_hub, base_model=job.source, command=job.command)
