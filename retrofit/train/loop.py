"""The training loop: one function, `train(recipe)`, from a recipe to a saved run folder.

    result = train(load_recipe("recipes/train-tiny-counting.yaml"))
    result = train(recipe, model=my_model, resume=True, callbacks=[on_event])

Each optimizer step takes the step's global batch (built identically on every process), trains this
process's slice of it in `micro_batch_size` pieces (no gradient sync until the last), and divides
every loss sum by the global item count, so the gradient is the exact mean over the global batch for
any number of processes or accumulation steps. With train.sequence_parallel N, groups of N processes share each
row (sequence_parallel.py: each scores its T/N tokens; attention sees the whole row), and the groups split the batch;
evaluation and saving run unsharded. The learning rate is a pure function of the step, so
a resumed run needs only model, optimizer, RNG and data position to continue identically (plus the
open log window's loss sum, so a window spanning the resume logs the same mean).

Reliability: the run folder is locked (RUN/.lock holds the pid) for the life of the run; a device-side
flag records the first step whose loss or gradient norm was not finite, checked at log steps and before
every save, so no checkpoint is written from a diverged step; the final model is written into
RUN/.tmp-final and renamed into place, result.json last.

callbacks: callables `fn(event, step, info)` with event "step" (info: metrics), "eval" (info:
metrics, model), "checkpoint" (info: path) and "end" (info: model, before it is saved). The
experiment driver evaluates on a finetune schedule with `eval.at_steps: [0, 10, 20, 50]` and an
"eval" callback that runs its own evaluation on info["model"].
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from ..atomic import atomic_write_text, check_output, fsync_dir, output_folder, output_path, owned_folder, remove_owned
from ..data import build_data
from ..errors import RetrofitError
from ..load import apply_patch, language_model, load_base, recipe_tokenizer, save_model
from ..recipe import Recipe, flat, load_recipe, save_recipe
from ..recovery import apply_schedule, is_patch_parameter, knob_values, record_knob
from . import build, checkpoint
from .sequence_parallel import check_recipe, shard, sharded
from .tasks import evaluate, items, loss_sum, recovery_loss_sum


@dataclass
class TrainResult:
    run_dir: Path
    steps: int                                                   # optimizer steps completed
    losses: dict[int, float] = field(default_factory=dict)      # step -> mean training loss of its log window
    evals: dict[int, dict] = field(default_factory=dict)        # step -> eval metrics
    resumed_from: int | None = None
    model: nn.Module | None = None                               # the trained model, as saved


def run_dir_of(recipe: Recipe) -> Path:
    return output_path(recipe.output.dir or f"runs/{recipe.name or 'run'}")


def _check_run_dir(run_dir: Path, resume: bool) -> None:
    check_output(run_dir, "output.dir")  # new, empty or made by retrofit: never a folder of the user's files
    held = [n for n in ("result.json", "log.jsonl", "config.json", checkpoint.FOLDER) if (run_dir / n).exists()]
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
    build.check_lengths(model, recipe)
    build.check_packing(model, recipe)
    build.check_vocabulary(model, tokenizer if recipe.data.task != "counting" else None)
    model = build.wrap_task(model, recipe.data.task)
    if data is None:
        data = build_data(recipe.data, tokenizer, seed=recipe.train.seed, eval_lengths=recipe.eval_lengths())
    calibration = build.calibrate_patch(model, data, recipe) if report is not None else None
    model = build.apply_peft(model, recipe.train.peft)
    build.check_recovery(model, recipe)
    recovery = recipe.section("recovery")
    if recovery is not None and recovery.freeze_base:
        build.freeze_base(model)
    if recipe.train.gradient_checkpointing:
        build.enable_gradient_checkpointing(model)
    if report is not None:
        accelerator.print(str(report) + (f"\ncalibration       {calibration}" if calibration else ""))
    return model, tokenizer, data


def train(recipe: Recipe, *, model: nn.Module | None = None, tokenizer=None, data=None, resume: bool = False,
          callbacks=()) -> TrainResult:
    """Train as `recipe` says and save the run; see the module docstring. The loop itself is _train, run
    while this process holds the run folder's lock."""
    run_dir = run_dir_of(recipe)
    _check_run_dir(run_dir, resume)
    trackers = list(recipe.output.trackers)
    if "wandb" in trackers:
        import importlib.util
        if importlib.util.find_spec("wandb") is None:
            raise RetrofitError("output.trackers has wandb but it is not installed: pip install wandb")
    acc = build.make_accelerator(recipe.train, run_dir, trackers)
    # made, marked and locked (one writer per run folder; released on any exit); a run refused before it wrote
    # anything (a length beyond GPT-2's positions, say) leaves no folder behind
    with output_folder(run_dir, "output.dir", enabled=acc.is_main_process):
        return _train(recipe, acc, run_dir, model=model, tokenizer=tokenizer, data=data, resume=resume,
                      callbacks=callbacks)


def _train(recipe: Recipe, acc, run_dir: Path, *, model, tokenizer, data, resume: bool, callbacks) -> TrainResult:
    """train()'s body, run while the run folder is locked. Long by design: it is the loop, read top to
    bottom (setup, resume, steps with log/eval/checkpoint, final save)."""
    acc.wait_for_everyone()  # every process has checked the run folder before the main one writes to it
    t = recipe.train
    world, rank = acc.num_processes, acc.process_index
    layout = check_recipe(recipe)  # train.sequence_parallel: N processes share each row (None when 1)
    data_rank, data_world = (layout.data_rank, layout.data_size) if layout else (rank, world)
    accum = build.accumulation(t, data_world)
    if acc.distributed_type.name == "DEEPSPEED" and accum != 1:
        raise RetrofitError("with DeepSpeed set train.micro_batch_size = batch_size / processes (no accumulation)")
    if resume and (run_dir / "recipe.yaml").is_file():  # before anything loads: same recipe or a clear error
        checkpoint.check_same_recipe(flat(load_recipe(run_dir / "recipe.yaml")), flat(recipe), run_dir)
    done = run_dir / "result.json"
    if resume and done.is_file() and json.loads(done.read_text()).get("steps") == t.steps:
        acc.print(f"{run_dir} already finished {t.steps} steps; nothing to do")
        return TrainResult(run_dir, t.steps)

    from_recipe = model is None  # a LoRA adapter can only be rebuilt on a base the recipe describes
    model, tokenizer, data = setup(recipe, acc, model=model, tokenizer=tokenizer, data=data)
    model.train()
    rec = recipe.section("recovery")  # retrofit.recovery: schedules, distillation, patch learning rate
    schedule = build.probe_schedule(model, data, recipe, rec.schedule if rec is not None else None)
    if rec is not None and schedule is not rec.schedule:
        acc.print(f"recovery.schedule.costs measured (zero-shot, first training block): "
                  f"{schedule.costs}")  # every digit: pinned in a recipe, they give this schedule exactly
    mixed = rec is not None and (rec.lm_weight != 1.0 or rec.distills())  # else the task's own loss
    optimizer = build.make_optimizer(model, t, rec)
    model, optimizer = acc.prepare(model, optimizer)
    task, recipe_flat, start, window, saved_knob = recipe.data.task, flat(recipe), 0, None, None
    if resume:
        found = checkpoint.resume_checkpoint(acc, run_dir, recipe_flat)  # newest one whose manifest verifies
        if found:
            path, meta = found
            data.load_state_dict(meta["data"])
            start, window, saved_knob = meta["step"], meta.get("window"), meta.get("knob")
            acc.print(f"resumed from {path} (step {start})")
        else:
            acc.print(f"no complete checkpoint in {run_dir}: starting at step 0")
    result = TrainResult(run_dir, start, resumed_from=start if resume else None)
    if schedule is not None:  # the knob is a function of the step alone: a resumed run sets what it had
        knob = apply_schedule(model, schedule, start)
        if saved_knob is not None and knob != saved_knob:
            raise RetrofitError(f"the checkpoint's schedule knob {saved_knob} differs from step {start}'s; resume "
                                "with the recipe it was trained with")
    # stage one of recovery (match_steps): only the patch's parameters train
    base_params = [p for n, p in model.named_parameters() if p.requires_grad and not is_patch_parameter(n)]

    if acc.is_main_process:
        run_dir.mkdir(parents=True, exist_ok=True)
        save_recipe(recipe, run_dir / "recipe.yaml")
    acc.init_trackers(recipe.output.project,
                      config={k: ("null" if v is None else v) for k, v in recipe_flat.items()})
    tokens_per_step = t.batch_size * recipe.data.seq_len
    acc.print(f"{build.describe(model)} | {world} process(es) on {acc.device}, precision {acc.mixed_precision} | "
              f"{tokens_per_step} tokens/step, accumulation {accum} | steps {start}->{t.steps} | run {run_dir}")

    def notify(event, step, **info):
        for fn in callbacks:
            fn(event, step, {"accelerator": acc, **info})

    def run_eval(step):
        metrics = evaluate(model, data, task, recipe.eval_lengths(), recipe.eval.batches, recipe.eval.batch_size, acc,
                           t.loss_chunk_tokens)
        if metrics:
            acc.log(metrics, step=step)
            result.evals[step] = metrics
        notify("eval", step, metrics=metrics, model=acc.unwrap_model(model))

    if start == 0 and 0 in recipe.eval.at_steps:
        run_eval(0)

    from tqdm.auto import tqdm
    bar = tqdm(total=t.steps, initial=start, unit="step", dynamic_ncols=True,
               disable=not (acc.is_main_process and t.progress))
    window_loss = torch.zeros((), dtype=torch.float64, device=acc.device)
    window_items, window_tokens, window_start = 0, 0, time.perf_counter()
    if window:  # a log window that spans the checkpoint: its loss sum so far (counted once, on the main process)
        window_loss.fill_(window["loss"] if acc.is_main_process else 0.0)
        window_items = window["items"]
    # First step whose loss or gradient norm was not finite (0 = none): kept on the device, so no step waits
    # on the host; read (all processes together) at log steps and before anything is saved.
    first_bad = torch.zeros((), dtype=torch.long, device=acc.device)
    params = [p for p in model.parameters() if p.requires_grad]

    def check_finite(step: int, weights: bool = False) -> None:
        nonlocal first_bad
        if weights:  # an update from a finite loss can still overflow the weights
            finite = torch.stack([torch.isfinite(p.detach()).all() for p in params]).all()
            first_bad = torch.where((first_bad == 0) & ~finite, step, first_bad)
        bad = [s for s in acc.gather(first_bad.reshape(1)).tolist() if s]  # every process decides alike
        if bad:
            raise RetrofitError(f"the training loss is not finite (nan or inf) at step {min(bad)}; nothing was saved "
                                f"from it: lower train.lr or check the data")
    for step in range(start, t.steps):
        length = build.seq_len_at(step, recipe)
        rows = t.batch_size * recipe.data.seq_len // length        # global rows at this length
        batch = data.batch(step, rows, length)                       # the global batch, identical on every process
        n_items = items(batch, task)
        per_process, per_micro = rows // data_world, rows // data_world // accum
        rates = build.group_lrs(step, t, rec)
        lr = rates["decay"]
        for group in optimizer.param_groups:
            group["lr"] = rates[group.get("name", "decay")]
        for i in range(accum):
            lo = data_rank * per_process + i * per_micro
            part = {k: v[lo: lo + per_micro].to(acc.device) for k, v in batch.items() if torch.is_tensor(v)}
            part = shard(part, layout) if layout else part  # this rank's tokens of each row
            sync = contextlib.nullcontext() if i == accum - 1 else acc.no_sync(model)
            with sync, sharded(model, layout), build.activation_offload(t.activation_offload, acc.device):
                loss = (recovery_loss_sum(model, part, task, rec, step, t.loss_chunk_tokens) if mixed
                        else loss_sum(model, part, task, t.loss_chunk_tokens))
                acc.backward(loss * (world / n_items))  # DDP averages over processes: world/n makes it the global mean
            window_loss += loss.detach().double()
        if rec is not None and step < rec.match_steps:
            for p in base_params:
                p.grad = None  # fused AdamW skips a parameter without a gradient: no update, no moment change
        grad_norm = acc.clip_grad_norm_(params, t.grad_clip) if t.grad_clip > 0 else None
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        done_steps = step + 1
        if schedule is not None:  # the knob of the next update; evaluation and checkpoints see it too
            apply_schedule(model, schedule, done_steps)
        window_items, window_tokens = window_items + n_items, window_tokens + rows * length
        finite = torch.isfinite(window_loss)  # losses are >= 0: once not finite, the window sum stays so
        if torch.is_tensor(grad_norm):
            finite = finite & torch.isfinite(grad_norm)
        first_bad = torch.where((first_bad == 0) & ~finite, done_steps, first_bad)

        if done_steps % t.log_every == 0 or done_steps == t.steps:
            check_finite(done_steps)
            mean = float(acc.reduce(window_loss, "sum")) / window_items
            elapsed = time.perf_counter() - window_start
            metrics = {"loss": mean, "lr": lr, "seq_len": length, "tokens": done_steps * tokens_per_step,
                       "tokens_per_s": window_tokens / max(elapsed, 1e-9)}
            if grad_norm is not None:
                metrics["grad_norm"] = float(grad_norm)
            acc.log(metrics, step=done_steps)
            result.losses[done_steps] = mean
            bar.set_postfix(loss=f"{mean:.4g}", tok_s=f"{metrics['tokens_per_s']:.3g}", len=length, refresh=False)
            notify("step", done_steps, metrics=metrics)
            window_loss.zero_()
            window_items, window_tokens, window_start = 0, 0, time.perf_counter()
        bar.update(1)
        result.steps = done_steps
        if _eval_due(done_steps, recipe):
            run_eval(done_steps)
        if recipe.output.save_every and done_steps % recipe.output.save_every == 0 and done_steps < t.steps:
            check_finite(done_steps, weights=True)  # never a checkpoint from a diverged step
            window = {"loss": float(acc.reduce(window_loss.clone(), "sum")), "items": window_items}
            path = checkpoint.save_checkpoint(acc, run_dir, done_steps, data.state_dict(), recipe_flat,
                                              recipe.output.keep, window=window,
                                              knob=knob_values(model) if schedule is not None else None)
            notify("checkpoint", done_steps, path=path)
    bar.close()

    check_finite(result.steps, weights=True)
    if schedule is not None:
        record_knob(model)  # the final knob value into config.retrofit: a reload is what was trained
    notify("end", result.steps, model=acc.unwrap_model(model))
    result.model = save_final(acc, model, run_dir, tokenizer, recipe, result, from_recipe)
    build.end_processes(acc)
    return result


def save_final(acc, model, run_dir: Path, tokenizer, recipe: Recipe, result: TrainResult,
               from_recipe: bool = True) -> nn.Module:
    """The final model (save_pretrained, safetensors, patch in config.json) and result.json."""
    acc.wait_for_everyone()
    unwrapped = acc.unwrap_model(model, keep_torch_compile=False)
    sharded = acc.distributed_type.name in ("FSDP", "DEEPSPEED")
    peft = recipe.train.peft
    state = acc.get_state_dict(model) if sharded and peft is None else None  # FSDP: gathered on every rank
    saved = unwrapped
    if acc.is_main_process:
        with _atomic_files(run_dir) as tmp:
            saved = save_model(unwrapped, tmp, tokenizer=tokenizer, peft_save=peft.save if peft else None,
                               state_dict=state)
        last = max(result.evals) if result.evals else None
        final_loss = result.losses.get(max(result.losses)) if result.losses else None
        summary = {"steps": result.steps, "final_loss": final_loss,
                   "eval": result.evals.get(last), "model_type": language_model(saved).config.model_type,
                   "retrofit": getattr(language_model(saved).config, "retrofit", None),
                   "processes": acc.num_processes, "model_from_recipe": from_recipe}
        atomic_write_text(run_dir / "result.json", json.dumps(summary, indent=2, default=str))  # marks the run finished
    acc.wait_for_everyone()
    return saved


@contextlib.contextmanager
def _atomic_files(run_dir: Path):
    """A temporary folder inside the run folder; on success each file (or folder: adapter/) in it is renamed
    into run_dir, so a kill mid-save never leaves a truncated model.safetensors under its final name."""
    tmp = run_dir / ".tmp-final"
    remove_owned(tmp, run_dir)  # left by a kill during an earlier save
    owned_folder(tmp)
    yield tmp
    checkpoint.fsync_tree(tmp)
    old = owned_folder(tmp / ".replaced")  # what the new files replace goes here, then with tmp
    for entry in sorted(tmp.iterdir()):
        if entry.name in (".replaced", checkpoint.MARKER):
            continue
        target = run_dir / entry.name
        if target.is_dir() and not target.is_symlink():  # a folder (adapter/) cannot be replaced in one rename
            os.replace(target, old / entry.name)
        os.replace(entry, target)
    fsync_dir(run_dir)
    remove_owned(tmp, run_dir)
