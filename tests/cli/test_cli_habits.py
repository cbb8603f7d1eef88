"""What a user expects of a command line by habit (issue 40): the right package name, a fast `--help`, `--version`,
errors naming the verb, one spelling of the shared flags, a near-miss table for norm names, and `patch` refusing to
do work it would throw away. Speed is checked as laziness (what `--help` imports), never by a clock."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import retrofit
from retrofit.cli import COMMANDS, build_parser, main
from retrofit.errors import RetrofitError
from retrofit.experiment import driver as experiment
from retrofit.version import DISTRIBUTION, INSTALL
from tests.tiny import tiny_model

ROOT = Path(__file__).resolve().parents[2]


def _python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)


# ---- 1. the distribution name -------------------------------------------------------------------------------------

def test_the_distribution_is_not_pypis_unrelated_retrofit():
    pyproject = (ROOT / "pyproject.toml").read_text()  # (tomllib is 3.11+; the project supports 3.10)
    assert re.search(r'^name = "(.*)"$', pyproject, re.M).group(1) == DISTRIBUTION == "retrofit-attention"
    assert re.search(r'^version = "(.*)"$', pyproject, re.M).group(1) == retrofit.__version__
    assert 'retrofit = "retrofit.cli:main"' in pyproject  # the command and the import stay `retrofit`
    assert f"pip install {DISTRIBUTION}" in (ROOT / "README.md").read_text()


def test_the_model_cards_install_line_names_the_distribution(tmp_path):
    model = tiny_model("llama")
    retrofit.patch(model, "softmax1")
    model.save_pretrained(tmp_path / "m")
    assert main(["push", str(tmp_path / "m"), "--repo", "me/x", "--dry-run", str(tmp_path / "staged")]) == 0
    card = (tmp_path / "staged" / "README.md").read_text()
    [line] = [line for line in card.splitlines() if line.startswith("import retrofit")]
    assert INSTALL in line and "pip install retrofit " not in line + " "


def test_a_foreign_retrofit_in_the_same_folder_is_named_in_one_line(monkeypatch, capsys):
    monkeypatch.setattr("retrofit.cli.FOREIGN_MARKER", "cli.py")  # a file that is there: as if theirs were
    assert main(["norms"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "unrelated `retrofit`" in err and INSTALL in err


# ---- 2. speed (as laziness), --version, errors naming the verb ------------------------------------------------------

def test_help_version_and_argument_errors_import_neither_torch_nor_transformers():
    code = f"""
import sys
from retrofit.cli import build_parser, main
for argv in [["--help"], ["--version"]] + [[verb, "--help"] for verb in {sorted(COMMANDS)!r}]:
    try:
        main(argv)
    except SystemExit as done:
        assert done.code == 0, (argv, done.code)
for verb in {sorted(COMMANDS)!r}:
    try:
        main([verb, "--no-such-flag"])
    except SystemExit as done:
        assert done.code == 2, (verb, done.code)
heavy = sorted(m for m in ("torch", "transformers", "accelerate", "peft") if m in sys.modules)
print("HEAVY", heavy)
"""
    run = _python(code)
    assert run.returncode == 0, run.stderr
    assert "HEAVY []" in run.stdout, run.stdout[-500:]


def test_version_names_the_distribution():
    run = subprocess.run([sys.executable, "-m", "retrofit", "--version"], capture_output=True, text=True,
                         timeout=120, cwd=ROOT)
    assert run.returncode == 0 and run.stdout.strip() == f"retrofit {retrofit.__version__} ({DISTRIBUTION})"


@pytest.mark.parametrize("verb", sorted(set(COMMANDS) - {"bench"}))  # bench passes options to the benchmark
def test_an_unknown_flag_is_reported_by_the_verb(verb, capsys):
    extra = {"train": ["r.yaml"], "experiment": ["r.yaml", "--out", "x"], "patch": ["m", "--norm", "avnorm"],
             "eval": ["m"], "diagnose": ["m", "--data", "d", "--out", "o"], "push": ["m", "--repo", "a/b"],
             "tokenizer": ["train", "--data", "d", "--out", "o"], "info": ["m"], "adopt": ["d"],
             "report": ["d"]}.get(verb, [])
    with pytest.raises(SystemExit) as done:
        main([verb, *extra, "--no-such-flag"])
    err = capsys.readouterr().err
    assert done.value.code == 2 and err.startswith(f"retrofit {verb}: error: unrecognized arguments: --no-such-flag")


# ---- 2. one spelling for the shared flags --------------------------------------------------------------------------

def _defaults(verb: str, argv: list[str]):
    return build_parser(verb).parse_args([verb, *argv])


PROGRESS_VERBS = {"eval": ["m"], "diagnose": ["m", "--data", "d", "--out", "o"], "patch": ["m", "--norm", "softmax"],
                  "train": ["r.yaml"], "experiment": ["r.yaml", "--out", "o"], "demo": [],
                  "push": ["m", "--repo", "a/b"], "tokenizer": ["train", "--data", "d", "--out", "o"]}


@pytest.mark.parametrize("verb", sorted(PROGRESS_VERBS))
def test_no_progress_is_spelled_alike_in_every_verb(verb):
    assert _defaults(verb, PROGRESS_VERBS[verb]).no_progress is False
    assert _defaults(verb, [*PROGRESS_VERBS[verb], "--no-progress"]).no_progress is True
    assert _defaults(verb, [*PROGRESS_VERBS[verb], "--quiet"]).no_progress is True  # the old spelling, hidden


@pytest.mark.parametrize("verb", ["eval", "diagnose", "patch"])
def test_dtype_defaults_to_auto_wherever_a_model_is_loaded(verb):
    assert _defaults(verb, PROGRESS_VERBS[verb]).dtype == "auto"


def test_patch_is_one_flag_in_eval_and_diagnose():
    def patch_action(verb):
        [action] = [a for a in build_parser(verb)._subparsers._group_actions[0].choices[verb]._actions
                    if "--patch" in a.option_strings]
        return action
    assert patch_action("eval").metavar == patch_action("diagnose").metavar == "NORM[:KEY=VALUE,...]"
    assert _defaults("diagnose", [*PROGRESS_VERBS["diagnose"], "--patch", "psoftmax:p=2"]).patch == ["psoftmax:p=2"]


def test_the_patch_flag_table_is_the_registrys():
    """patch_flags.OPTIONS is the registry's options as written out (what the parser reads, importing no norm)."""
    from retrofit.commands.patch_flags import OPTIONS, declared_options, generated

    written = (ROOT / "retrofit/commands/patch_flags.py").read_text()
    assert generated() in written, "regenerate the copies: python -m retrofit.commands.patch_flags"
    assert OPTIONS == declared_options()


def test_every_copy_of_the_registry_is_current():
    """The flag table, the recipe reference page, the norms' tables (patching.md, README), their lines of the
    architecture tree and the registering import of norms/__init__.py are what one command writes from the registry
    (the import: from the files); none is stale."""
    from retrofit.commands.patch_flags import derived_copies

    copies = derived_copies()
    assert {p.relative_to(ROOT).as_posix() for p in copies} == {
        "retrofit/commands/patch_flags.py", "docs/reference/recipe.md", "docs/architecture.md",
        "retrofit/norms/__init__.py", "docs/patching.md", "README.md"}
    stale = [str(p.relative_to(ROOT)) for p, text in copies.items() if p.read_text() != text]
    assert stale == [], "rewrite them: python -m retrofit.commands.patch_flags"


def test_the_regenerate_command_rewrites_a_stale_copy(tmp_path, monkeypatch):
    """A copy planted stale is rewritten by the command (into tmp_path: the checkout is never written by a test)."""
    from retrofit.commands import patch_flags

    page = tmp_path / "recipe.md"
    page.write_text("# Recipes\n\n| key | default | what it is |\n|---|---|---|\n| `old.key` | `1` | gone |\n\nafter\n")
    copies = {page: patch_flags.replace_table(page.read_text(), "| key | default | what it is |\n| `new` | `2` | x |")}
    monkeypatch.setattr(patch_flags, "derived_copies", lambda: copies)
    assert patch_flags.main() == 0 and page.read_text() == copies[page]
    assert page.read_text() == "# Recipes\n\n| key | default | what it is |\n| `new` | `2` | x |\n\nafter\n"
    assert patch_flags.main() == 0  # current now: nothing to rewrite


# ---- 2. the near-miss table ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("name, hint", [("l2softmax", "psoftmax:p=2"), ("l2", "psoftmax:p=2"),
                                        ("L2-Softmax", "psoftmax:p=2"), ("scalable-softmax", "'ssmax'"),
                                        ("ssm", "'ssmax'"), ("softmax+1", "'softmax1'"),
                                        ("quiet-softmax", "'softmax1'"), ("nope", "--nope"), ("avnrm", "'avnorm'")])
def test_a_near_miss_norm_name_points_at_the_right_spelling(name, hint):
    with pytest.raises(RetrofitError, match="unknown norm") as err:
        retrofit.patch(tiny_model("llama"), name)
    assert hint in str(err.value) and "did you mean 'softmax'?" not in str(err.value)


# ---- 2. patch without --out; uncalibrated AVNorm ---------------------------------------------------------------------

@pytest.fixture
def tiny_folder(tmp_path):
    tiny_model("llama").save_pretrained(tmp_path / "m")
    return tmp_path / "m"


def test_patch_without_out_refuses_before_loading(tiny_folder, capsys, monkeypatch):
    monkeypatch.setattr("retrofit.load.load", lambda *a, **k: pytest.fail("loaded the model"))
    assert main(["patch", str(tiny_folder), "--norm", "avnorm"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("retrofit patch: error: nothing would be saved") and err.count("\n") == 1
    assert main(["patch", "no/such/model", "--norm", "avnorm"]) == 2  # a bad source is still the first error
    assert "no such file or folder" in capsys.readouterr().err


def test_uncalibrated_avnorm_warns_with_the_measured_cost(tiny_folder, tmp_path, capsys):
    assert main(["patch", str(tiny_folder), "--norm", "avnorm", "--out", str(tmp_path / "out")]) == 0
    err = capsys.readouterr().err
    assert "warning: AVNorm without calibration" in err and "14.29" in err and "4.58" in err
    assert main(["patch", str(tiny_folder), "--norm", "avnorm", "--gain", "2", "--out", str(tmp_path / "o2")]) == 0
    assert "warning" not in capsys.readouterr().err  # gains given: nothing to warn about


def test_check_text_without_out_measures_and_says_nothing_was_saved(tiny_folder, tmp_path, capsys):
    from tests.tiny import char_tokenizer

    char_tokenizer().save_pretrained(tiny_folder)
    text = tmp_path / "t.txt"
    text.write_text("the quick brown fox jumps over the lazy dog " * 4)
    assert main(["patch", str(tiny_folder), "--norm", "softmax1", "--check-text", str(text), "--check-tokens", "32",
                 "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "loss on" in out and out.strip().endswith("nothing saved (no --out): this run only measured")
    assert "zero-shot cost" not in out and "ranking" not in out  # the ranking is asked for (issue 53)


def test_the_ranking_is_opt_in_and_says_its_cost_first(tiny_folder, tmp_path, capsys):
    """--check-text measures before/after only; --rank adds the ranking, announced with its forward count (tiny
    Llama: 2 patched layers, softmax1 is per head with 4 query heads: (2 + 2) + (2 + 4) forwards) and an estimate."""
    from tests.tiny import char_tokenizer

    char_tokenizer().save_pretrained(tiny_folder)
    text = tmp_path / "t.txt"
    text.write_text("the quick brown fox jumps over the lazy dog " * 4)
    argv = ["patch", str(tiny_folder), "--norm", "softmax1", "--check-text", str(text), "--check-tokens", "32",
            "--no-progress"]
    assert main([*argv, "--rank"]) == 0
    out = capsys.readouterr().out
    announced = out.index("ranking 2 patched layers and 4 query heads: 10 forwards of 32 tokens, about ")
    assert announced < out.index("zero-shot cost per layer") < out.index("zero-shot cost per head")
    assert main(["patch", str(tiny_folder), "--norm", "softmax1", "--rank", "--out", str(tmp_path / "o")]) == 2
    assert "--rank ranks by the loss on a text" in capsys.readouterr().err


# ---- 7. feedback on long work --------------------------------------------------------------------------------------

def test_the_rankings_forwards_show_a_bar_unless_told_not_to(capsys):
    from retrofit.costs import head_costs, layer_costs
    from tests.tiny import random_ids

    model = tiny_model("llama")
    retrofit.patch(model, "softmax1", learnable=True)
    ids = random_ids(1, 12)
    for measure, what in ((layer_costs, "rank layers"), (head_costs, "rank heads")):
        measure(model, ids, progress=True)
        assert what in capsys.readouterr().err
        measure(model, ids, progress=False)
        assert capsys.readouterr().err == ""


def test_push_says_what_it_is_doing_unless_no_progress(tmp_path, capsys):
    model = tiny_model("llama")
    retrofit.patch(model, "softmax1")
    model.save_pretrained(tmp_path / "m")
    assert main(["push", str(tmp_path / "m"), "--repo", "me/x", "--dry-run", str(tmp_path / "a")]) == 0
    assert "[push] staging" in capsys.readouterr().out
    assert main(["push", str(tmp_path / "m"), "--repo", "me/x", "--dry-run", str(tmp_path / "b"), "--no-progress"]) == 0
    assert "[push]" not in capsys.readouterr().out


@pytest.mark.parametrize("flag", [[], ["--no-progress"]])
def test_tokenizer_training_shows_the_libraries_bars_unless_no_progress(flag, tmp_path, monkeypatch):
    import tokenizers.trainers

    seen = {}
    real = tokenizers.trainers.BpeTrainer
    monkeypatch.setattr(tokenizers.trainers, "BpeTrainer", lambda **kw: seen.update(kw) or real(**kw))
    text = tmp_path / "t.txt"
    text.write_text("a few words of text to merge " * 50)
    assert main(["tokenizer", "train", "--data", str(text), "--vocab-size", "300", "--out", str(tmp_path / "tok"),
                 *flag]) == 0
    assert seen["show_progress"] is (not flag)


# ---- 6. the package's basics ---------------------------------------------------------------------------------------

def test_license_changelog_and_py_typed_ship():
    assert "Apache License" in (ROOT / "LICENSE").read_text() and "Version 2.0" in (ROOT / "LICENSE").read_text()
    assert 'license = { text = "Apache-2.0" }' in (ROOT / "pyproject.toml").read_text()
    assert (ROOT / "CHANGELOG.md").read_text().startswith("# Changelog")
    assert (ROOT / "retrofit" / "py.typed").is_file()
    assert re.search(r'^retrofit = \[.*"py\.typed".*\]$', (ROOT / "pyproject.toml").read_text(), re.M)


def test_the_public_api_is_typed():
    import inspect

    for name in ("patch", "unpatch", "calibrate", "from_pretrained", "is_patched", "patch_record", "observe",
                 "extend_rope", "patch_bypassed", "info", "peft_config", "available_norms", "describe_norms"):
        signature = inspect.signature(getattr(retrofit, name))
        assert signature.return_annotation is not inspect.Signature.empty, name
        untyped = [p.name for p in signature.parameters.values() if p.annotation is inspect.Parameter.empty
                   and p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)]
        assert not untyped, (name, untyped)


@pytest.mark.parametrize("verb", ["experiment", "demo"])
@pytest.mark.parametrize("flag", [True, False])
def test_no_progress_turns_off_training_and_evaluation_bars(verb, flag, tmp_path, monkeypatch):

    import retrofit.experiment as library
    from retrofit.commands import experiment as command
    seen = {}

    def fake_run(recipe, out, progress=True):
        seen.update(train=recipe.train.progress, eval=progress)
        return {}

    monkeypatch.setattr(library, "run_experiment", fake_run)  # imported by the command when it runs
    monkeypatch.setattr(command, "_print_summary", lambda results, out: None)
    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)  # demo's; the fixture's 1 thread stays
    argv = [verb, *([str(experiment.DEMO_RECIPE)] if verb == "experiment" else []), "--out", str(tmp_path / "x")]
    assert main(argv + (["--no-progress"] if flag else [])) == 0
    assert seen == {"train": not flag, "eval": not flag}


def test_every_help_shows_examples(run_cli):
    """`--help` had no examples (issue 53): the top level shows the common commands, and each verb the usage lines of
    its own module's docstring, which is where they are kept."""
    from retrofit.cli import COMMANDS
    code, _, out = run_cli(["--help"])
    assert code == 0 and "examples:" in out and "retrofit patch " in out.split("examples:")[1]
    for verb in COMMANDS:
        code, _, out = run_cli([verb, "--help"])
        assert code == 0 and "examples:" in out, verb
        shown = [line.strip() for line in out.split("examples:")[1].splitlines() if line.strip()]
        assert shown and all(f"retrofit {verb}" in line or line.startswith(("--", "data.", "#")) or
                             not line.startswith(("retrofit", "accelerate")) for line in shown), (verb, shown)
        assert any(f"retrofit {verb}" in line for line in shown), (verb, shown)


def test_a_cpu_save_prints_no_deepspeed_accelerator_warning(tiny_folder, tmp_path):
    """Issue 62: with DeepSpeed installed (transformers -> accelerate imports it), every save on a CPU machine printed
    "[WARNING] ... Setting accelerator to CPU. If you have GPU ...". The CLI drops that one record; DeepSpeed's other
    warnings still show. In a subprocess, so DeepSpeed's logger is fresh and imported after the CLI starts."""
    import os
    code = ("import logging, sys; from retrofit.cli import main\n"
            f"rc = main(['patch', {str(tiny_folder)!r}, '--norm', 'avnorm', '--gain', '1', '--no-progress',"
            f" '--out', {str(tmp_path / 'out')!r}])\n"
            "logging.getLogger('DeepSpeed').warning('Setting accelerator to CPU. If you have GPU ...')\n"
            "logging.getLogger('DeepSpeed').warning('another deepspeed warning')\n"
            "sys.exit(rc)\n")
    env = {k: v for k, v in os.environ.items() if k != "DS_ACCELERATOR"}
    env["PYTHONPATH"] = str(ROOT)
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=tmp_path,
                         env=env)
    output = run.stdout + run.stderr
    assert run.returncode == 0, output
    assert (tmp_path / "out" / "config.json").is_file()
    assert "Setting accelerator to CPU" not in output, output
    assert "another deepspeed warning" in output  # DeepSpeed's logger (or the root's last resort) still speaks


def test_import_retrofit_drops_the_deepspeed_cpu_notice_and_stays_light():
    """Issue 62, the Python API: a script that only does `import retrofit` (then retrofit.patch, save_pretrained ...)
    printed DeepSpeed's "Setting accelerator to CPU" at every save; the package root now installs the CLI's filter,
    once however often it is asked (a reloaded module too), without importing torch and leaving DS_ACCELERATOR
    unset. The record is emitted on DeepSpeed's own logger, so no save (and no DeepSpeed) is needed to see it."""
    import os
    code = ("import importlib, logging, os, sys; import retrofit\n"
            "heavy = [m for m in ('torch', 'transformers', 'accelerate', 'deepspeed') if m in sys.modules]\n"
            "print('HEAVY', heavy)\n"
            "from retrofit import notices\n"
            "notices.quiet_deepspeed_cpu_notice(); importlib.reload(notices).quiet_deepspeed_cpu_notice()\n"
            "print('FILTERS', len(logging.getLogger('DeepSpeed').filters), 'DS', os.environ.get('DS_ACCELERATOR'))\n"
            "logging.getLogger('DeepSpeed').warning('Setting accelerator to CPU. If you have GPU or other accelerator,"
            " we were unable to detect it.')\n"
            "logging.getLogger('DeepSpeed').warning('Setting accelerator to CPU %s', 'with arguments')\n"
            "logging.getLogger('DeepSpeed').warning('another deepspeed warning')\n")
    env = {k: v for k, v in os.environ.items() if k != "DS_ACCELERATOR"}
    env["PYTHONPATH"] = str(ROOT)
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT, env=env)
    output = run.stdout + run.stderr
    assert run.returncode == 0, output
    assert "HEAVY []" in run.stdout and "FILTERS 1 DS None" in run.stdout, output
    assert "Setting accelerator to CPU" not in output, output
    assert "another deepspeed warning" in run.stderr, output  # the last resort handler: DeepSpeed's others still show


@pytest.mark.parametrize("norm, flags, after, hint", [
    ("psoftmax", ["--p", "2"], 12.60, True),    # issue 62: SmolLM2 3.34 -> 12.60, and no word of what to do
    ("psoftmax", ["--p", "2"], 3.40, False),    # a small rise: nothing to add
    ("ssmax", [], 4.10, True),
])
def test_a_large_check_text_rise_prints_the_recovery_command(tiny_folder, tmp_path, capsys, monkeypatch, norm, flags,
                                                             after, hint):
    """--check-text showing a rise over RISE_NATS prints one `next step:` line: the recovery recipe with this
    patch's overrides, starting at the norm's identity (recovery.schedule); the command it prints loads as printed.
    The losses are pinned (a random tiny model has nothing to ruin); the rule and the command are what is tested."""
    import shlex

    from retrofit.patch_job import RISE_NATS
    from retrofit.recipe import load_recipe
    from tests.tiny import char_tokenizer

    char_tokenizer().save_pretrained(tiny_folder)
    text = tmp_path / "t.txt"
    text.write_text("the quick brown fox jumps over the lazy dog " * 4)
    losses = iter([3.34, after])
    monkeypatch.setattr("retrofit.costs.text_loss", lambda *a, **k: next(losses))
    assert main(["patch", str(tiny_folder), "--norm", norm, *flags, "--check-text", str(text), "--check-tokens", "32",
                 "--no-progress"]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("next step:")]
    assert bool(lines) is hint and (after - 3.34 > RISE_NATS) is hint
    if not hint:
        return
    assert len(lines) == 1 and f"costs {after - 3.34:+.2f} nats" in lines[0]
    command = shlex.split(lines[0].split(": retrofit train ", 1)[1])
    recipe = load_recipe(command[0], command[1:])
    assert recipe.model.source == str(tiny_folder) and recipe.patch.norm == norm
    assert recipe.extras["recovery"].schedule.steps > 0  # from the identity (p 1, blend 0) to the patch
    if flags:
        assert recipe.patch.options == {"p": 2.0}


def test_the_tree_keeps_shared_files_and_drops_a_removed_norms_line():
    """The norms' lines of the architecture tree: every registered norm's, the shared files' that exist, and no line
    of a norm whose file is gone (it would name a file the tree test then cannot find)."""
    from retrofit.commands.patch_flags import norm_tree_lines
    from retrofit.norms import NORMS

    text = ("intro\n  norms/ what\n    base.py  kept\n    gone.py  a norm since removed\n    avnorm.py  stale\n"
            "  gate.py x\n")
    lines = norm_tree_lines(text).split("\n")
    body = lines[2:lines.index("  gate.py x")]
    assert body[0] == "    base.py  kept" and not any("gone.py" in line for line in lines)
    assert [line.split()[0] for line in body[1:]] == [f"{name}.py" for name in sorted(NORMS)]
    assert "stale" not in "\n".join(lines)
