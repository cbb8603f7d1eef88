"""The training loop: one function, `train(recipe)`, from a recipe to a saved run folder.

    result = train(load_recipe("recipes/train-tiny-counting.yaml"))
    result = train(recipe, model=my_model, resume=True, callbacks=[on_event])

_train reads as the recipe of a run, one named step per line: split the batch across processes, stop if a
resumed run already finished, build the Run (state.py: model, optimizer, data, log window, divergence flag),
resume from the newest good checkpoint, set the schedule's knob, open the run folder, then the steps (update.py:
one optimizer update; after it what is due: a log line, an evaluation, a checkpoint) and the final save.
Evaluation and saving run unsharded. The learning rate is a pure function of the step, so a resumed run needs
only model, optimizer, RNG and data position to continue identically (plus the open log window's loss sum, so a
window spanning the resume logs the same mean).

Reliability: the run folder is locked (RUN/.lock holds the pid) for the life of the run; a device-side
flag records the first step whose loss or gradient norm was not finite, checked at log steps and before
every save, so no checkpoint is written from a diverged step; the final model is written into
RUN/.tmp-final and renamed into place, result.json last.

callbacks: callables `fn(event, step, info)` with event "step" (info: metrics), "eval" (info: metrics, model),
"checkpoint" (info: path) and "end" (info: model, before it is saved). The experiment driver evaluates on a finetune
schedule with `eval.at_steps: [0, 10, 20, 50]` and an "eval" callback that runs its own evaluation on info["model"].
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from ..data import build_data
from ..errors import RetrofitError
from ..io.atomic import atomic_write_text, check_output, output_folder, output_path
from ..io.readers import read_json
from ..load import apply_patch, language_model, load_base, recipe_tokenizer, save_model
from ..memory import return_freed_memory
from ..recipe import Recipe, dotted_settings, load_recipe, save_recipe
from ..recovery import apply_schedule, is_patch_parameter, record_schedule, scheduled_values
from . import accelerator_setup, engine, fsdp, model_setup, optimizer_setup, recipe_fits, resume_state, run_checks, zero
from .alst import preparing
from .engine import Engine
from .progress import step_bar
from .runlog import ENGINE_KEY, check_trackers
from .sequence_parallel import plan_sequence_layout
from .state import Divergence, LogWindow, Run, Split, StepStats, TrainResult
from .update import train_step
from .validation import validation_metrics


def run_dir_of(recipe: Recipe) -> Path:
    return output_path(recipe.output.dir or f"runs/{recipe.name or 'run'}")


def _check_run_dir(run_dir: Path, resume: bool) -> None:
    check_output(run_dir, "output.dir")  # new, empty or made by retrofit: never a folder of the user's files
    held = [n for n in ("result.json", "log.jsonl", "config.json", resume_state.FOLDER) if (run_dir / n).exists()]
    if resume and not run_dir.is_dir():
        raise RetrofitError(f"nothing to resume: {run_dir} does not exist")
    if held and not resume:
        raise RetrofitError(f"{run_dir} already holds a run ({held[0]}); pass --resume {run_dir} to continue it "
                            "or choose another output.dir")


def _eval_due(step: int, recipe: Recipe) -> bool:
    every = recipe.eval.every
    return step in recipe.eval.at_steps or bool(every and step % every == 0) or step == recipe.train.steps


def setup(recipe: Recipe, accelerator, *, model=None, tokenizer=None, data=None):
    """Model (loaded, patched, checked, task head, calibrated, LoRA) and data, before anything trains."""
    from accelerate.utils import set_seed
    set_seed(recipe.train.seed)
    if model is None:
        model, tokenizer = load_base(recipe)
    elif tokenizer is None and data is None:  # data passed in code brings its own tokens
        tokenizer = recipe_tokenizer(recipe)
    report = apply_patch(model, recipe.patch)
    run_checks.check_lengths(model, recipe)
    run_checks.check_packing(model, recipe)
    run_checks.check_vocabulary(model, tokenizer if recipe.data.task != "counting" else None)
    model = model_setup.wrap_task(model, recipe.data.task, first_token=recipe.data.counting.first_token)
    if data is None:
        data = build_data(recipe.data, tokenizer, seed=recipe.train.seed, eval_lengths=recipe.loop_eval_lengths())
    calibration = model_setup.calibrate_patch(model, data, recipe) if report is not None else None
    model = model_setup.apply_peft(model, recipe.train.peft)
    run_checks.check_recovery(model, recipe)
    recovery = recipe.section("recovery")
    if recovery is not None and recovery.freeze_base:
        optimizer_setup.freeze_base(model)
    if recipe.train.gradient_checkpointing:
        model_setup.enable_gradient_checkpointing(model)
    if report is not None:
        accelerator.print(str(report) + (f"\ncalibration       {calibration}" if calibration else ""))
    return model, tokenizer, data


def train(recipe: Recipe, *, model: nn.Module | None = None, tokenizer=None, data=None, resume: bool = False,
          callbacks=()) -> TrainResult:
    """Train as `recipe` says and save the run; see the module docstring. The loop itself is _train, run
    while this process holds the run folder's lock."""
    run_dir = run_dir_of(recipe)
    _check_run_dir(run_dir, resume)
    recipe_fits.check_recipe_fits(recipe, model=model, data=data)  # data, source, memory: before anything is allocated
    acc = accelerator_setup.make_accelerator(recipe.train, run_dir, check_trackers(recipe.output.trackers))
    if acc.device.type == "cpu" and recipe.train.cpu_release_memory:  # freed activations go back to the OS
        return_freed_memory()  # instead of raising the peak (memory.py); it costs small models speed
    # made, marked and locked (one writer per run folder; released on any exit); a run refused before it wrote
    # anything (a length beyond GPT-2's positions, say) leaves no folder behind
    with output_folder(run_dir, "output.dir", enabled=acc.is_main_process):
        return _train(recipe, acc, run_dir, model=model, tokenizer=tokenizer, data=data, resume=resume,
                      callbacks=callbacks)


def _train(recipe: Recipe, acc, run_dir: Path, *, model, tokenizer, data, resume: bool, callbacks) -> TrainResult:
    """train()'s body, run while the run folder is locked: the recipe's steps in order, each a function below."""
    acc.wait_for_everyone()  # every process has checked the run folder before the main one writes to it
    split = _split(recipe, acc)
    if resume and _finished(recipe, acc, run_dir):
        return TrainResult(run_dir, recipe.train.steps)
    run = _build(recipe, acc, run_dir, split, model=model, tokenizer=tokenizer, data=data, callbacks=callbacks)
    saved_value = _resume(run) if resume else None
    _start_schedule(run, saved_value)
    _open_run(run)
    if run.result.steps == 0 and 0 in recipe.eval.at_steps:
        _evaluate(run, 0)
    _steps(run)
    return _finish(run)


# ---- before the first step -----------------------------------------------------------------------------------------

def _split(recipe: Recipe, acc) -> Split:
    deepspeed = acc.distributed_type.name == "DEEPSPEED"  # then DeepSpeed's ALST moves the heads
    layout = plan_sequence_layout(recipe, alst=deepspeed)  # train.sequence_parallel: N processes per row (None: 1)
    fsdp.check_fsdp_recipe(recipe, acc.distributed_type.name)
    zero.check_deepspeed_recipe(recipe, zero.stage_of(acc))
    rank, world = (layout.data_rank, layout.data_size) if layout else (acc.process_index, acc.num_processes)
    return Split(layout, rank, world, accelerator_setup.accumulation(recipe.train, world))


def _finished(recipe: Recipe, acc, run_dir: Path) -> bool:
    """Resuming, before anything loads: the same recipe (or a raised train.steps, which extends the run from its
    newest checkpoint) or a clear error; True when the run already finished."""
    if (run_dir / "recipe.yaml").is_file():
        saved = dotted_settings(load_recipe(run_dir / "recipe.yaml"))
        resume_state.check_same_recipe(saved, dotted_settings(recipe), run_dir)
        if resume_state.extends(saved, dotted_settings(recipe)):
            _say_extension(acc, run_dir, saved[resume_state.EXTENDABLE], recipe.train.steps)
    done = run_dir / "result.json"
    if done.is_file() and read_json(done).get("steps") == recipe.train.steps:
        acc.print(f"{run_dir} already finished {recipe.train.steps} steps; nothing to do")
        return True
    return False


def _say_extension(acc, run_dir: Path, old: int, new: int) -> None:
    """train.steps raised on resume: from the newest checkpoint, never from step 0 (that is a new run)."""
    found = resume_state.complete_checkpoints(run_dir)
    if not found:
        raise RetrofitError(f"{run_dir} has no checkpoint to extend it from (checkpoints need output.save_every > 0); "
                            f"start a new run from its model instead: model.source={run_dir}")
    acc.print(f"extending: train.steps {old} -> {new}, from the checkpoint at step {found[-1][0]} (the newest; "
              f"from there the learning rate follows the {new}-step schedule)")


def _build(recipe: Recipe, acc, run_dir: Path, split: Split, *, model, tokenizer, data, callbacks) -> Run:
    """setup(), the recovery schedule, the optimizer and accelerate's wrapping, gathered into one Run."""
    from_recipe = model is None
    with zero.whole_model(acc):  # under ZeRO-3 too: DeepSpeed partitions it in prepare() below
        model, tokenizer, data = setup(recipe, acc, model=model, tokenizer=tokenizer, data=data)
    model.train()
    rec = recipe.section("recovery")  # retrofit.recovery: schedules, distillation, patch learning rate
    schedule = model_setup.probe_schedule(model, data, recipe, rec.schedule if rec is not None else None)
    if rec is not None and schedule is not rec.schedule:
        acc.print(f"recovery.schedule.costs measured (zero-shot, first training block): "
                  f"{schedule.costs}")  # every digit: pinned in a recipe, they give this schedule exactly
    if recipe.train.fsdp:  # FSDP2 over every process, then the optimizer on the shards
        model, optimizer = fsdp.prepare(model, lambda m: optimizer_setup.make_optimizer(m, recipe.train, rec), acc)
    else:
        with preparing(model, split.layout):  # DeepSpeed's ALST registers in prepare()
            model, optimizer = acc.prepare(model, optimizer_setup.make_optimizer(model, recipe.train, rec))
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    return Run(recipe=recipe, acc=acc, run_dir=run_dir, split=split, model=model, optimizer=optimizer, data=data,
               tokenizer=tokenizer, recovery=rec, schedule=schedule, callbacks=tuple(callbacks),
               from_recipe=from_recipe, flat=dotted_settings(recipe), trainable=[p for _, p in trainable],
               base=[p for n, p in trainable if not is_patch_parameter(n)], result=TrainResult(run_dir, 0),
               window=LogWindow(torch.zeros((), dtype=torch.float64, device=acc.device)),
               divergence=Divergence(torch.zeros((), dtype=torch.long, device=acc.device)),
               engine=engine.what_ran(acc, recipe.train, zero.stage_of(acc)))


def _resume(run: Run) -> list[float] | None:
    """Continue from the newest checkpoint that verifies: model, optimizer and RNG (accelerate), the data
    position and the open log window (so a window spanning the resume logs the same mean). Returns the schedule
    knob it saved (None: none)."""
    run.result.resumed_from = 0
    found = resume_state.resume_checkpoint(run.acc, run.run_dir, run.flat, _sharded(run))
    if not found:
        run.acc.print(f"no complete checkpoint in {run.run_dir}: starting at step 0")
        return None
    path, meta = found
    run.data.load_state_dict(meta["data"])
    run.result.steps = run.result.resumed_from = meta["step"]
    if meta.get("window"):  # its loss sum so far, counted once (on the main process)
        run.window.loss.fill_(meta["window"]["loss"] if run.acc.is_main_process else 0.0)
        run.window.items = meta["window"]["items"]
    run.acc.print(f"resumed from {path} (step {meta['step']})")
    return meta.get("knob")


def _start_schedule(run: Run, saved_value: list[float] | None) -> None:
    """The knob is a function of the step alone: set it for the first step; a resumed run must find the one
    its checkpoint saved."""
    if run.schedule is None:
        return
    start = run.result.steps
    knob = apply_schedule(run.model, run.schedule, start)
    if saved_value is not None and knob != saved_value:
        raise RetrofitError(f"the checkpoint's schedule knob {saved_value} differs from step {start}'s; resume "
                            "with the recipe it was trained with")


def _open_run(run: Run) -> None:
    """The recipe into the run folder, the trackers started, one line saying what runs where."""
    recipe, acc, t = run.recipe, run.acc, run.recipe.train
    if acc.is_main_process:
        run.run_dir.mkdir(parents=True, exist_ok=True)
        save_recipe(recipe, run.run_dir / "recipe.yaml")
    config = {k: ("null" if v is None else v) for k, v in run.flat.items()}
    # the engine as JSON text: TensorBoard's hparams take scalars only (log.jsonl reads it back as a mapping)
    acc.init_trackers(recipe.output.project, config={ENGINE_KEY: json.dumps(run.engine.as_dict()), **config})
    acc.print(run.engine.line())
    acc.print(f"{optimizer_setup.describe(run.model)} | {acc.num_processes} process(es) on {acc.device}, precision "
              f"{acc.mixed_precision} | {t.batch_size * recipe.data.seq_len} tokens/step, accumulation "
              f"{run.split.accum} | steps {run.result.steps}->{t.steps} | run {run.run_dir}")


# ---- the steps -----------------------------------------------------------------------------------------------------

def _steps(run: Run) -> None:
    """Every step from the start (0 or the checkpoint's) to train.steps, each followed by what is due after it:
    a log line, an evaluation, a checkpoint; the bar's s/step and the log's tokens/s leave the last two out."""
    recipe, t = run.recipe, run.recipe.train
    bar = step_bar(run.clock, total=t.steps, initial=run.result.steps, unit="step", dynamic_ncols=True,
                   disable=not (run.acc.is_main_process and t.progress))
    run.window.opened = run.clock()
    for step in range(run.result.steps, t.steps):
        stats, done = train_step(run, step), step + 1
        if done % t.log_every == 0 or done == t.steps:
            metrics = _log(run, done, stats)
            bar.set_postfix(loss=f"{metrics['loss']:.4g}", tok_s=f"{metrics['tokens_per_s']:.3g}", len=stats.length,
                            refresh=False)
        bar.update(1)
        run.result.steps = done
        if _eval_due(done, recipe):
            with run.clock.paused(run.acc.device):  # the final evaluation too (progress.py)
                _evaluate(run, done)
        if recipe.output.save_every and (done % recipe.output.save_every == 0 or done == t.steps):
            with run.clock.paused(run.acc.device):
                _save_checkpoint(run, done)  # the last step's too: raising train.steps extends the run from there
    bar.close()


# ---- after a step: divergence, log, evaluation, checkpoint ---------------------------------------------------------

def _check_finite(run: Run, step: int, weights: bool = False) -> None:
    """Raise if any process flagged a non-finite step; weights: check the trained parameters first (an update
    from a finite loss can still overflow them)."""
    if weights:
        finite = [torch.isfinite(_local(p)).all() for p in run.trainable]  # this process's shard
        run.divergence.note(step, torch.stack(finite).all())
    run.divergence.check(run.acc)


def _log(run: Run, done: int, stats: StepStats) -> dict:
    """The window's mean loss (over every process), learning rate, length, tokens and throughput: logged,
    kept in the result, sent to the callbacks; the window starts again."""
    _check_finite(run, done)
    acc, window = run.acc, run.window
    mean = float(acc.reduce(window.loss, "sum")) / window.items
    metrics = {"loss": mean, "lr": stats.lr, "seq_len": stats.length,
               "tokens": done * run.recipe.train.batch_size * run.recipe.data.seq_len,
               "tokens_per_s": window.tokens / max(run.clock() - window.opened, 1e-9)}
    if stats.grad_norm is not None:
        metrics["grad_norm"] = float(stats.grad_norm)
    acc.log(metrics, step=done)
    run.result.losses[done] = mean
    run.notify("step", done, metrics=metrics)
    window.reset(run.clock())
    return metrics


def _evaluate(run: Run, step: int) -> None:
    """The validation metrics after `step`: what is evaluated said first, a bar of its own, the result printed."""
    from tqdm.auto import tqdm
    recipe, acc = run.recipe, run.acc
    lengths, e = recipe.loop_eval_lengths(), recipe.eval
    tokens = sum(lengths) * e.batches * e.batch_size
    say = tqdm.write if acc.is_main_process else (lambda _: None)  # tqdm.write: above the training bar
    say(f"eval after step {step}: lengths {', '.join(map(str, lengths))} x {e.batches} "
        f"batch{'es' if e.batches > 1 else ''} x {e.batch_size} rows = {tokens:,} tokens")
    progress = f"eval step {step}" if acc.is_main_process and recipe.train.progress else None
    metrics = validation_metrics(run.model, run.data, recipe.data.task, lengths, e.batches, e.batch_size, acc,
                                 recipe.train.loss_chunk_tokens, progress=progress)
    if metrics:
        acc.log(metrics, step=step)
        run.result.evals[step] = metrics
        say(f"eval after step {step}: " + ", ".join(f"{k.removeprefix('eval/')} {v:.4f}" for k, v in metrics.items()))
    run.notify("eval", step, metrics=metrics, model=acc.unwrap_model(run.model))


def _save_checkpoint(run: Run, done: int) -> None:
    """A resumable checkpoint after update `done`, never from a diverged step; it carries the open log window
    and the schedule's knob."""
    _check_finite(run, done, weights=True)
    acc = run.acc
    window = {"loss": float(acc.reduce(run.window.loss.clone(), "sum")), "items": run.window.items}
    knob = scheduled_values(run.model) if run.schedule is not None else None
    path = resume_state.save_checkpoint(acc, run.run_dir, done, run.data.state_dict(), run.flat, run.recipe.output.keep,
                                      window=window, knob=knob, sharded=_sharded(run))
    run.notify("checkpoint", done, path=path)


def _local(p: torch.Tensor) -> torch.Tensor:
    """This process's values of a parameter: its FSDP2 shard, its ZeRO-3 partition, or the parameter."""
    return zero.local(p) if zero.partitioned(p) else fsdp.local(p.detach())


def _sharded(run: Run):
    """(model, optimizer) under train.fsdp or DeepSpeed, whose checkpoints each process writes its own part of; else
    None (accelerate's save_state)."""
    return (run.model, run.optimizer) if run.recipe.train.fsdp or zero.is_engine(run.model) else None


def _finish(run: Run) -> TrainResult:
    """A last finite check, the schedule's final knob into config.retrofit (a reload is what was trained), the
    "end" callbacks, then the final model and result.json."""
    acc, result = run.acc, run.result
    _check_finite(run, result.steps, weights=True)
    if run.schedule is not None:
        record_schedule(run.model)
    run.notify("end", result.steps, model=acc.unwrap_model(run.model))
    result.model = save_final(acc, run.model, run.run_dir, run.tokenizer, run.recipe, result, run.from_recipe,
                              ran=run.engine)
    accelerator_setup.end_processes(acc)
    return result


def save_final(acc, model, run_dir: Path, tokenizer, recipe: Recipe, result: TrainResult,
               from_recipe: bool = True, ran: Engine | None = None) -> nn.Module:
    """The final model (load.save_model: safetensors, patch in config.json, atomically) and result.json (with the
    engine that trained it), written last: it marks the run finished."""
    acc.wait_for_everyone()
    unwrapped = acc.unwrap_model(model, keep_torch_compile=False)
    peft = recipe.train.peft
    state = acc.get_state_dict(model) if acc.distributed_type.name == "FSDP" and peft is None else None
    if recipe.train.fsdp:
        state = fsdp.full_state_dict(model)  # gathered on every rank
    elif zero.is_engine(model):
        state = zero.full_state_dict(model)  # ZeRO-3: gathered one module at a time, on the main process
    saved = unwrapped
    if acc.is_main_process:
        saved = save_model(unwrapped, run_dir, tokenizer=tokenizer, peft_save=peft.save if peft else None,
                           state_dict=state, into_run=True)  # RUN/.tmp-final, renamed into place
        last = max(result.evals) if result.evals else None
        final_loss = result.losses.get(max(result.losses)) if result.losses else None
        summary = {"steps": result.steps, "final_loss": final_loss,
                   "eval": result.evals.get(last), "model_type": language_model(saved).config.model_type,
                   "retrofit": getattr(language_model(saved).config, "retrofit", None),
                   "processes": acc.num_processes, "model_from_recipe": from_recipe,
                   "engine": ran.as_dict() if ran is not None else None}
        atomic_write_text(run_dir / "result.json", json.dumps(summary, indent=2, default=str))  # marks the run finished
    acc.wait_for_everyone()
    return saved
