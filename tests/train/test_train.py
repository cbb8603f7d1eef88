"""retrofit.train: loss falls, 2 processes = 1 process, SIGKILL + resume = uninterrupted, LoRA round trip,
bad input fails before training, the CLI and the bench run. Tiny models, few steps, two subprocess launches."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import yaml

import retrofit
from retrofit.cli import main
from retrofit.data import counting_batch
from retrofit.errors import RetrofitError
from retrofit.load import load
from retrofit.recipe import load_recipe, recipe_from_dict
from retrofit.train import accelerator_setup, model_setup, read_log, resume_state, schedules, train
from tests.tiny import TINY, char_tokenizer, tiny_model

ROOT = Path(__file__).resolve().parents[2]
QUIET = {"progress": False, "log_every": 1}
TINY_GPT2 = {"model_type": "gpt2", **TINY["gpt2"]}
TINY_LLAMA = {"model_type": "llama", **TINY["llama"]}


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def subprocess_env() -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "TOKENIZERS_PARALLELISM": "false"}


def write_corpus(folder: Path) -> Path:
    """A char tokenizer saved to folder/tok (so a subprocess can load it) and folder/text.txt: 200 lines of a
    10-word language."""
    char_tokenizer().save_pretrained(folder / "tok")
    g = torch.Generator().manual_seed(0)
    words = ["the", "cat", "sat", "on", "a", "mat", "and", "dog", "ran", "far"]
    lines = [" ".join(words[int(i)] for i in torch.randint(0, len(words), (12,), generator=g)) + "."
             for _ in range(200)]
    (folder / "text.txt").write_text("\n".join(lines))
    return folder


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_corpus(tmp_path_factory.mktemp("corpus"))


def lm_recipe(corpus, out, **train) -> dict:
    return {"model": {"config": TINY_LLAMA, "tokenizer": str(corpus / "tok")},
            "patch": {"norm": "avnorm"},
            "data": {"task": "lm", "files": [str(corpus / "text.txt")], "seq_len": 32, "val_blocks": 2,
                     "cache_dir": str(corpus / "cache")},
            "train": {"steps": 10, "batch_size": 4, "micro_batch_size": 2, "lr": 1e-2, "warmup_steps": 2, **QUIET,
                      **train},
            "eval": {"every": 5, "batches": 1, "batch_size": 2},
            "output": {"dir": str(out), "save_every": 4}}


def losses_of(run_dir) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_log(Path(run_dir) / "log.jsonl") if "loss" in r}


# ---- convergence -------------------------------------------------------------------------------------------------

def test_patched_tiny_gpt2_learns_counting(tmp_path):
    model = tiny_model("gpt2")
    retrofit.patch(model, "avnorm")
    recipe = recipe_from_dict({
        "model": {"config": {"model_type": "gpt2"}}, "data": {"task": "counting", "seq_len": 32},
        "train": {"steps": 20, "batch_size": 8, "micro_batch_size": 8, "lr": 1e-2, "warmup_steps": 2, **QUIET},
        "eval": {"lengths": [32, 64], "batches": 1}, "output": {"dir": str(tmp_path / "run")}})
    result = train(recipe, model=model)
    losses = [result.losses[s] for s in sorted(result.losses)]
    assert len(losses) == 20 and sum(losses[-4:]) / 4 < 0.7 * sum(losses[:4]) / 4, losses
    assert set(result.evals[20]) == {"eval/l1@32", "eval/mse@32", "eval/l1@64", "eval/mse@64"}
    assert (tmp_path / "run" / "model.safetensors").is_file() and (tmp_path / "run" / "task_head.safetensors").is_file()
    back = load(tmp_path / "run")  # CountingModel: backbone (patched, from config.retrofit) + head
    batch = counting_batch(2, 48, alphabet=8, seed=5)
    assert torch.allclose(back(batch["input_ids"]), result.model.eval()(batch["input_ids"]), atol=1e-5)


def test_patched_tiny_llama_learns_passkey(tmp_path, corpus):
    model = tiny_model("llama")
    retrofit.patch(model, "psoftmax", p=2.0)
    recipe = recipe_from_dict({
        "model": {"config": {"model_type": "llama"}, "tokenizer": str(corpus / "tok")},
        "data": {"task": "passkey", "seq_len": 192, "passkey": {"digits": 3}},
        "train": {"steps": 20, "batch_size": 4, "micro_batch_size": 4, "lr": 1e-2, "warmup_steps": 2,
                  "gradient_checkpointing": True, **QUIET},
        "eval": {"batches": 1, "batch_size": 2}, "output": {"dir": str(tmp_path / "run")}})
    result = train(recipe, model=model)
    losses = [result.losses[s] for s in sorted(result.losses)]
    assert sum(losses[-4:]) / 4 < 0.7 * sum(losses[:4]) / 4, losses
    assert {"eval/loss@192", "eval/accuracy@192"} == set(result.evals[20])


# ---- two processes ------------------------------------------------------------------------------------------------

def test_two_cpu_processes_match_one_process(tmp_path, torchrun_launch):
    """Same global batch (4): one process accumulates 2 micro-batches of 2, two processes take 2 each.
    Tolerance 1e-5 absolute on every step's loss (fp32; gloo's all-reduce may sum in another order).
    The two processes: `torchrun --standalone --nproc_per_node 2 -m retrofit train` (docs/many-gpus.md's line,
    launched once for this test and tests/train/test_launchers.py; recipe: tests/train/test_launchers.py
    two_process_recipe)."""
    proc, path, two = torchrun_launch
    assert proc.returncode == 0, proc.stderr[-3000:]
    one = train(load_recipe(path, [f"output.dir={tmp_path / 'one'}"]))
    assert json.loads((two / "result.json").read_text())["processes"] == 2
    assert "2 process(es)" in proc.stdout + proc.stderr
    two_losses = losses_of(two)
    assert sorted(two_losses) == sorted(one.losses) == list(range(1, 7))
    for step, loss in one.losses.items():
        assert abs(two_losses[step] - loss) <= 1e-5, (step, loss, two_losses[step])
    two_eval = [r for r in read_log(two / "log.jsonl") if "eval/l1@64" in r][-1]
    assert abs(two_eval["eval/l1@64"] - one.evals[6]["eval/l1@64"]) <= 1e-5


class _Ending:
    """What end_processes reads of an accelerator: its trackers and how many processes run."""

    def __init__(self, processes):
        self.num_processes, self.trackers = processes, []


@pytest.fixture
def one_process_group(tmp_path):
    torch.distributed.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    yield torch.distributed.distributed_c10d._get_default_store()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def test_the_group_goes_down_only_once_every_process_has_counted_itself_in(one_process_group):
    """The CI hang: a peer still inside the final collective when rank 0 destroyed the group. A process now leaves
    only when the store counts every process; here the second process counts itself in before this one ends."""
    one_process_group.add(accelerator_setup.EXIT_KEY, 1)  # the peer, already past its last collective
    accelerator_setup.end_processes(_Ending(2), timeout_s=30)
    assert not torch.distributed.is_initialized()
    assert one_process_group.add(accelerator_setup.EXIT_KEY, 0) == 2


def test_a_peer_that_never_finishes_is_one_line_not_a_hang(one_process_group):
    with pytest.raises(RetrofitError, match="another process did not finish within 0 s"):
        accelerator_setup.end_processes(_Ending(2), timeout_s=0.2)
    assert torch.distributed.is_initialized()  # never torn down under a peer that may still be in a collective


# ---- kill and resume -----------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def uninterrupted(corpus, tmp_path_factory):
    out = tmp_path_factory.mktemp("full") / "run"
    result = train(recipe_from_dict(lm_recipe(corpus, out)))
    return result, out


def test_sigkill_mid_training_then_resume_ends_like_an_uninterrupted_run(corpus, uninterrupted, tmp_path):
    reference, _ = uninterrupted
    raw = lm_recipe(corpus, tmp_path / "run")
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(raw))
    script = textwrap.dedent(f"""
        import os, signal
        from retrofit.recipe import load_recipe
        from retrofit.train import train
        def kill(event, step, info):
            if event == "step" and step == 7:
                os.kill(os.getpid(), signal.SIGKILL)   # after the step-4 checkpoint, before the step-8 one
        train(load_recipe({str(tmp_path / 'r.yaml')!r}), callbacks=[kill])
    """)
    proc = subprocess.run([sys.executable, "-c", script], env=subprocess_env(), capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == -9, proc.stderr[-3000:]
    assert [s for s, _ in resume_state.complete_checkpoints(tmp_path / "run")] == [4]
    with pytest.raises(RetrofitError, match="already holds a run"):
        train(recipe_from_dict(raw))  # no silent overwrite without --resume
    resumed = train(recipe_from_dict(raw), resume=True)
    assert resumed.resumed_from == 4
    got = losses_of(tmp_path / "run")
    assert sorted(got) == list(range(1, 11))
    assert max(abs(got[s] - reference.losses[s]) for s in got) <= 1e-5
    assert abs(resumed.evals[10]["eval/loss@32"] - reference.evals[10]["eval/loss@32"]) <= 1e-5
    for (name, a), b in zip(resumed.model.state_dict().items(), reference.model.state_dict().values()):
        assert torch.allclose(a, b, atol=1e-5), name
    assert retrofit.from_pretrained(str(tmp_path / "run")).config.retrofit["norm"] == "avnorm"
    assert retrofit.load.load_tokenizer(str(tmp_path / "run")).eos_token == "<eos>"  # the tokenizer is saved too


def test_crash_while_writing_a_checkpoint_never_leaves_one_that_loads(corpus, uninterrupted, tmp_path, monkeypatch):
    reference, _ = uninterrupted
    raw = lm_recipe(corpus, tmp_path / "run")
    real_write = resume_state.write_state

    def crash_on_second(accelerator, folder, sharded=None):
        real_write(accelerator, folder, sharded)  # the files are there, meta.json and the rename are not
        if "0000008" in str(folder):
            raise KeyboardInterrupt("simulated kill during the checkpoint write")

    monkeypatch.setattr(resume_state, "write_state", crash_on_second)
    with pytest.raises(KeyboardInterrupt):
        train(recipe_from_dict(raw))
    monkeypatch.setattr(resume_state, "write_state", real_write)
    folder = tmp_path / "run" / resume_state.FOLDER
    assert (folder / ".tmp-step-0000008").is_dir()
    assert [s for s, _ in resume_state.complete_checkpoints(tmp_path / "run")] == [4]
    with pytest.raises(RetrofitError, match=r"recipe differs .*train.lr"):
        changed = lm_recipe(corpus, tmp_path / "run", lr=5e-3)
        train(recipe_from_dict(changed), resume=True)
    resumed = train(recipe_from_dict(raw), resume=True)
    assert resumed.resumed_from == 4 and not (folder / ".tmp-step-0000008").exists()
    got = losses_of(tmp_path / "run")
    assert max(abs(got[s] - reference.losses[s]) for s in reference.losses) <= 1e-5


# ---- LoRA ----------------------------------------------------------------------------------------------------------

def test_lora_trains_adapters_and_patch_parameters_and_reloads_to_identical_logits(corpus, tmp_path):
    lora = {"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]}
    raw = lm_recipe(corpus, tmp_path / "run", steps=6, peft=lora)
    raw["patch"]["calibrate"] = 64
    raw["output"]["save_every"] = 0
    ids = torch.randint(2, 60, (2, 24), generator=torch.Generator().manual_seed(3))
    seen = {}

    def at_end(event, step, info):
        if event != "end":
            return
        peft_model = info["model"].eval()
        named = dict(peft_model.named_parameters())
        seen["lora_b"] = [p for n, p in named.items() if "lora_B" in n]
        seen["gains"] = [(p.detach().clone(), named[n.replace("modules_to_save.default", "original_module")])
                         for n, p in named.items() if "retrofit.modules_to_save" in n]
        seen["trainable"] = {n for n, p in named.items() if p.requires_grad}
        seen["logits"] = peft_model(input_ids=ids).logits.detach()

    train(recipe_from_dict(raw), callbacks=[at_end])
    assert seen["lora_b"] and all(p.abs().sum() > 0 for p in seen["lora_b"])  # LoRA B starts at zero
    assert seen["gains"] and all(not torch.equal(new, old) for new, old in seen["gains"])
    assert all("lora_" in n or ".retrofit." in n for n in seen["trainable"])  # base weights frozen
    merged = load(tmp_path / "run")
    assert merged.config.retrofit["norm"] == "avnorm" and merged.config.retrofit["calibration"]
    assert torch.allclose(merged(input_ids=ids).logits, seen["logits"], atol=1e-5)
    adapter = load(tmp_path / "run", adapter=True)
    assert torch.allclose(adapter(input_ids=ids).logits, seen["logits"], atol=1e-5)


# ---- bad input, CLI, bench -------------------------------------------------------------------------------------------

def cli(args, capsys) -> tuple[int, str]:
    code = main(args)
    err = capsys.readouterr().err.strip()
    return code, err


@pytest.mark.parametrize("case, message", [
    ("missing file", "data.files: no such file"),
    ("tiny dataset", "not enough for"),
    ("empty file", "is empty; remove it from the list or give it text"),
    ("positions", "exceeds gpt2's 1024 learned positions; set patch.nope: true"),
    ("unknown key", "unknown recipe key train.setps (did you mean 'steps'?)"),
])
def test_bad_input_is_one_line_before_training(case, message, corpus, tmp_path, capsys):
    raw = lm_recipe(corpus, tmp_path / "run")
    overrides = []
    if case == "missing file":
        overrides = [f"data.files=[{tmp_path / 'missing.txt'}]"]
    elif case == "tiny dataset":  # a few tokens: not enough for the validation blocks and one training block
        (tmp_path / "tiny.txt").write_text("the cat sat.")
        overrides = [f"data.files=[{tmp_path / 'tiny.txt'}]"]
    elif case == "empty file":
        (tmp_path / "empty.txt").write_text("")
        overrides = [f"data.files=[{tmp_path / 'empty.txt'}]"]
    elif case == "positions":
        raw["model"]["config"] = {"model_type": "gpt2", "n_embd": 16, "n_layer": 1, "n_head": 2, "vocab_size": 97}
        overrides = ["data.seq_len=2048"]
    else:
        overrides = ["train.setps=3"]
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(raw))
    code, err = cli(["train", str(tmp_path / "r.yaml"), *overrides], capsys)
    assert code == 2 and message in err and "\n" not in err, err
    assert not (tmp_path / "run" / "log.jsonl").exists()


def test_cli_trains_the_shipped_tiny_recipe(tmp_path, capsys):
    out = tmp_path / "run"
    code = main(["train", str(ROOT / "recipes" / "train-tiny-counting.yaml"), "train.steps=4", "train.batch_size=4",
                 "train.micro_batch_size=4", "eval.lengths=[64]", "output.save_every=0", "--out", str(out)])
    assert code == 0, capsys.readouterr().err
    assert "done: 4 steps" in capsys.readouterr().out
    assert yaml.safe_load((out / "recipe.yaml").read_text())["train"]["steps"] == 4
    model = load(out)
    pred = model(counting_batch(2, 1024, alphabet=8)["input_ids"])  # evaluation at any length
    assert pred.shape == (2, 1024) and torch.isfinite(pred).all()
    assert retrofit.from_pretrained(str(out)).config.retrofit["norm"] == "psoftmax"
    assert main(["train", str(ROOT / "recipes" / "train-tiny-counting.yaml"), "--resume", str(out)]) == 2
    assert "recipe differs" in capsys.readouterr().err

    # A finetune starts from the finished run folder: new patch, evaluation on a finetune-step schedule.
    events = []
    finetune = load_recipe(ROOT / "recipes" / "train-tiny-counting.yaml", [
        f"model.source={out}", "model.config=null", "patch.norm=avnorm", "patch.p=null", "patch.calibrate=256",
        "train.steps=2", "train.init_len=null", "train.batch_size=4", "train.micro_batch_size=4",
        "eval.at_steps=[0, 1]", "eval.lengths=[64]", "output.save_every=0", f"output.dir={tmp_path / 'ft'}"])
    train(finetune, callbacks=[lambda event, step, info: events.append(step) if event == "eval" else None])
    assert events == [0, 1, 2]
    tuned = load(tmp_path / "ft")
    assert tuned.lm.config.retrofit["norm"] == "avnorm" and tuned.lm.config.retrofit["calibration"]["tokens"] >= 256


def test_schedule_staging_and_the_world_size_guard(monkeypatch):
    recipe = recipe_from_dict({"model": {"config": {"model_type": "llama"}},
                               "data": {"task": "counting", "seq_len": 64},
                               "train": {"steps": 100, "warmup_steps": 10, "lr": 1.0, "min_lr_ratio": 0.1,
                                         "init_len": 16, "double_every": 5}})
    t = recipe.train
    assert schedules.lr_at(0, t) == pytest.approx(0.1) and schedules.lr_at(9, t) == pytest.approx(1.0)
    assert schedules.lr_at(99, t) == pytest.approx(0.1, abs=1e-3)
    assert [schedules.seq_len_at(s, recipe) for s in (0, 4, 5, 10, 15, 99)] == [16, 16, 32, 64, 64, 64]
    seen = {}

    class FakeAccelerator:
        num_processes = 1

        def __init__(self, **kwargs):
            seen.update(kwargs)

    monkeypatch.setattr(accelerator_setup, "Accelerator", FakeAccelerator)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(RetrofitError, match="WORLD_SIZE is 2 but accelerate runs 1"):
        accelerator_setup.make_accelerator(t, "/tmp/unused")
    assert seen["cpu"] is True  # forced: without it, torchrun on CPU runs independent copies


def test_bench_train_prints_a_table_and_writes_json(tmp_path, capsys):
    import argparse

    from retrofit.bench import train as bench
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    args = parser.parse_args(["--batch", "2", "--seq-len", "16", "--steps", "4", "--warmup", "2", "--repeats", "1",
                              "--out", str(tmp_path / "b.json")])
    assert bench.run(args) == 0
    out = capsys.readouterr().out
    assert "| retrofit" in out and "| hf-trainer" in out and "retrofit / Trainer" in out
    result = json.loads((tmp_path / "b.json").read_text())
    assert set(result["loops"]) == {"retrofit", "hf-trainer"} and result["ratio"] > 0
    assert all(len(v["repeats"]) == 1 for v in result["loops"].values())


def test_a_tokenizer_beyond_the_vocabulary_is_refused_before_training(tmp_path):
    """IndexError in the first forward before; now refused in setup, naming both sides (the eval side is a CLI case)."""
    corpus = write_corpus(tmp_path)
    raw = lm_recipe(corpus, tmp_path / "run")
    raw["model"]["config"] = {**TINY_LLAMA, "vocab_size": 16}
    with pytest.raises(RetrofitError, match=r"^the tokenizer \(model.tokenizer\) has token ids up to \d+ but the "
                                            r"model has 16 embedding rows \(vocab_size\)") as err:
        train(recipe_from_dict(raw))
    assert "\n" not in str(err.value) and not (tmp_path / "run" / "log.jsonl").exists()
    raw["model"]["config"] = {**TINY_LLAMA, "vocab_size": 97}  # the char tokenizer's ids all fit: it trains
    raw["output"]["dir"], raw["train"]["steps"] = str(tmp_path / "run-fits"), 2
    assert train(recipe_from_dict(raw)).model is not None


# ---- the newcomer's path (issue 53) ---------------------------------------------------------------------------------

def test_the_loop_evaluation_says_its_size_shows_a_bar_and_prints_its_result(corpus, tmp_path, capsys):
    """The end-of-training evaluation ran silently (the training bar stalled) and its result went only to log.jsonl:
    it now says what it evaluates first, has a bar of its own and prints each length's loss."""
    raw = lm_recipe(corpus, tmp_path / "run", steps=2, progress=True)
    raw["eval"] |= {"lengths": [16, 32], "every": 0}
    result = train(recipe_from_dict(raw))
    out, err = capsys.readouterr()
    assert "eval after step 2: lengths 16, 32 x 1 batch x 2 rows = 96 tokens" in out, out
    evals = result.evals[2]
    assert f"eval after step 2: loss@16 {evals['eval/loss@16']:.4f}, loss@32 {evals['eval/loss@32']:.4f}" in out
    assert "eval step 2" in err  # the bar's own description


def test_retrofit_train_of_an_experiment_recipe_evaluates_at_the_training_length(corpus, tmp_path, capsys):
    """An experiment recipe's eval.lengths are its length evaluation (retrofit eval's windows, up to 32K in the
    SmolLM2 recipe): `retrofit train` of it evaluates where an experiment's stage does, experiment.recovery_lengths
    or data.seq_len, unless those are set."""
    import retrofit.experiment  # noqa: F401  registers the experiment section
    raw = lm_recipe(corpus, tmp_path / "run", steps=1)
    raw["eval"] |= {"lengths": [16, 32], "every": 0}
    raw["experiment"] = {"arms": [{"name": "softmax", "patch": {"norm": "softmax"}}]}
    assert set(train(recipe_from_dict(raw)).evals[1]) == {"eval/loss@32"}  # data.seq_len 32
    raw["experiment"]["recovery_lengths"] = [16]
    raw["output"]["dir"] = str(tmp_path / "run2")
    assert set(train(recipe_from_dict(raw)).evals[1]) == {"eval/loss@16"}
    capsys.readouterr()


def test_a_tracker_whose_package_is_missing_is_refused_before_anything_is_written(corpus, tmp_path):
    """accelerate drops a tracker it cannot import without a word (tensorboard wrote nothing); every tracker is
    refused up front like wandb was, naming the package to install. aim is not installed here."""
    from accelerate.tracking import get_available_trackers
    assert "aim" not in {str(t) for t in get_available_trackers()}
    raw = lm_recipe(corpus, tmp_path / "run", steps=1)
    raw["output"]["trackers"] = ["aim"]
    with pytest.raises(RetrofitError, match=r"^output\.trackers has aim but it is not installed: pip install aim$"):
        train(recipe_from_dict(raw))
    assert not (tmp_path / "run").exists()


def test_tensorboard_receives_the_run(corpus, tmp_path):
    pytest.importorskip("tensorboard", reason="tensorboard is in the test extra")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    raw = lm_recipe(corpus, tmp_path / "run", steps=2)
    raw["output"]["trackers"] = ["tensorboard"]
    result = train(recipe_from_dict(raw))
    folder = tmp_path / "run" / "retrofit"  # output.project; the config's hparams go to a subfolder of it
    assert list(folder.glob("events.out.tfevents.*"))
    scalars = EventAccumulator(str(folder)).Reload().Scalars("loss")
    logged = [(s, round(v, 5)) for s, v in sorted(result.losses.items())]
    assert [(e.step, round(e.value, 5)) for e in scalars] == logged


def test_lora_runs_and_adapter_loads_print_no_transformers_deprecation(tmp_path):
    """Every LoRA run and adapter load printed transformers' `is_gradient_checkpointing` FutureWarning (PEFT reads
    the deprecated property when it wraps a model): nothing a user can act on."""
    import warnings

    from retrofit.load.adapters import load_adapter, save_adapter
    from retrofit.recipe.sections import PeftSection
    model = tiny_model("llama")
    retrofit.patch(model, "avnorm")
    model.save_pretrained(tmp_path / "base")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        wrapped = model_setup.apply_peft(retrofit.from_pretrained(str(tmp_path / "base")), PeftSection(r=2))
        save_adapter(wrapped, tmp_path / "adapter")
        load_adapter(tmp_path / "adapter")
    assert not [w for w in caught if "is_gradient_checkpointing" in str(w.message)]


def test_a_second_process_and_no_progress_print_no_done_line_and_no_bars(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("RANK", "1")  # what accelerate launch / torchrun give the second process
    code = main(["train", str(ROOT / "recipes" / "train-tiny-counting.yaml"), "train.steps=2", "train.batch_size=4",
                 "train.micro_batch_size=4", "eval.lengths=[64]", "output.save_every=0", "--out", str(tmp_path / "r"),
                 "--no-progress"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "done:" not in out  # the main process says it once
    assert "Writing model shards" not in err and "it/s]" not in err  # transformers' save bar off too
