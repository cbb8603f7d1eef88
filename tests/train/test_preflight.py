"""The library checks itself: `train()`, `run_experiment()`, `evaluate_models()` and `diagnose_sources()` refuse
what cannot run (a missing data file, a layer past the model's, activations that cannot fit) in one line, before
a folder is made or a model allocated, as `retrofit train / experiment / eval / diagnose` do; the commands hold
no check of their own (they parse, call the library and print)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import retrofit.memory
from retrofit.errors import RetrofitError
from retrofit.recipe import load_recipe, recipe_from_dict
from retrofit.train import accelerator_setup, train
from tests.tiny import TINY, char_tokenizer, tiny_model

ROOT = Path(__file__).resolve().parents[2]
TINY_LLAMA = {"model_type": "llama", **TINY["llama"]}  # 2 layers, 4 heads


def _never(what: str):
    def reached(*args, **kwargs):
        raise AssertionError(f"{what} was reached: the check did not come first")
    return reached


def _recipe(tmp_path, **sections) -> dict:
    """A tiny lm run on tmp_path/text.txt, with `sections` merged into the recipe's sections."""
    (tmp_path / "text.txt").write_text("the cat sat on the mat. " * 50)
    char_tokenizer().save_pretrained(tmp_path / "tok")
    raw = {"model": {"config": TINY_LLAMA, "tokenizer": str(tmp_path / "tok")}, "patch": {"norm": "avnorm"},
           "data": {"task": "lm", "files": [str(tmp_path / "text.txt")], "seq_len": 32},
           "train": {"steps": 2, "batch_size": 2, "micro_batch_size": 2, "progress": False},
           "output": {"dir": str(tmp_path / "run")}}
    return {**raw, **{k: {**raw.get(k, {}), **v} for k, v in sections.items()}}


@pytest.mark.parametrize("sections,match", [
    ({"data": {"files": ["no-such-book.txt"]}}, "no-such-book.txt"),   # the data files: the simplest refusal
    ({"patch": {"layers": "7"}}, "patch.layers"),                       # a layer past the config's 2
    ({"data": {"seq_len": 2_000_000_000}}, "GiB of activations.*lower data.seq_len"),  # memory
])
def test_train_refuses_what_the_recipe_cannot_run_before_anything_is_allocated(sections, match, tmp_path,
                                                                                monkeypatch):
    """train(recipe) called from Python: the one-line RetrofitError the command line gave, before the accelerator
    is made and before the run folder exists."""
    monkeypatch.setattr(accelerator_setup, "make_accelerator", _never("the accelerator"))
    with pytest.raises(RetrofitError, match=match) as refused:
        train(recipe_from_dict(_recipe(tmp_path, **sections)))
    assert "\n" not in str(refused.value)
    assert not (tmp_path / "run").exists()


def test_a_model_and_data_passed_in_code_are_checked_instead_of_the_recipes(tmp_path):
    """check_recipe_fits(recipe, model=, data=), as train() calls it: data passed in code, so data.files is not
    read; a model passed in code, so its own config bounds the selections (model.config is not built)."""
    from retrofit.train.recipe_fits import check_recipe_fits

    missing = recipe_from_dict(_recipe(tmp_path, data={"files": ["no-such-book.txt"]}))
    check_recipe_fits(missing, data=[{"input_ids": [1, 2, 3]}])  # not refused: the recipe's files are not used
    four_layers = {"config": {**TINY_LLAMA, "num_hidden_layers": 4}, "tokenizer": str(tmp_path / "tok")}
    wide = recipe_from_dict(_recipe(tmp_path, patch={"layers": "3"}, model=four_layers))
    check_recipe_fits(wide)  # the recipe's own 4-layer config takes layer 3
    with pytest.raises(RetrofitError, match="patch.layers"):
        check_recipe_fits(wide, model=tiny_model("llama"))  # the 2-layer model passed in code does not


def test_run_experiment_refuses_an_arm_past_the_model_before_its_folder_is_made(tmp_path, monkeypatch):
    """run_experiment(recipe) called from Python: an arm's layer past the model's is refused in one line before
    DIR is made, not after the base trained."""
    from retrofit.experiment import driver

    monkeypatch.setattr(driver, "train", _never("training"))
    recipe = load_recipe(driver.DEMO_RECIPE, ["experiment.arms=[{name: far, patch: {norm: avnorm, layers: '7'}}]"])
    out = tmp_path / "exp"
    with pytest.raises(RetrofitError, match="experiment arm far: patch.layers") as refused:
        driver.run_experiment(recipe, out, progress=False)
    assert "\n" not in str(refused.value)
    assert not out.exists()


@pytest.fixture
def no_memory(monkeypatch):
    """Forwards that need a petabyte of activations: every one is refused by retrofit.memory.check_fits."""
    monkeypatch.setattr(retrofit.memory, "activation_bytes", lambda *args, **kwargs: 2 ** 50)


@pytest.fixture(scope="module")
def saved_model(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny") / "model"
    tiny_model("llama").save_pretrained(folder)
    return folder


def test_evaluate_models_checks_memory_before_loading(saved_model, no_memory, monkeypatch):
    """evaluate_models(sources, spec) called from Python: a forward that cannot fit is the one-line RetrofitError
    retrofit eval gave, before any model loads."""
    from retrofit.evaluate import EvalSpec, driver, evaluate_models

    monkeypatch.setattr(driver, "load", _never("loading the model"))
    spec = EvalSpec(lengths=[16], tokens=[list(range(3, 60))], tasks=["lm"])
    with pytest.raises(RetrofitError, match="at length 16: .* GiB .*lower --lengths or --batch-tokens") as refused:
        evaluate_models([str(saved_model)], spec)
    assert "\n" not in str(refused.value)


def test_diagnose_sources_checks_memory_before_reading(saved_model, no_memory, tmp_path, monkeypatch):
    """diagnose_sources(sources, spec) called from Python: the same memory check, before the tokenizer or the model
    is read and before --out exists."""
    from retrofit.diagnose import DiagnoseSpec, diagnose_sources, driver

    monkeypatch.setattr(driver, "load", _never("loading the model"))
    (tmp_path / "book.txt").write_text("the cat sat on the mat. " * 50)
    spec = DiagnoseSpec(data=str(tmp_path / "book.txt"), out=str(tmp_path / "diag"), lengths=[16, 32])
    with pytest.raises(RetrofitError, match="at length 32: .* GiB"):
        diagnose_sources([str(saved_model)], spec)
    assert not (tmp_path / "diag").exists()


# ---- the commands hold none of it ---------------------------------------------------------------------------------

MOVED = {"check_recipe", "check_model", "check_eval_memory", "check_selection_counts", "device_for_memory",
         "text_loss", "_rank", "_unpatch_parameter_free"}


def _defined(path: Path) -> set[str]:
    return {n.name for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.FunctionDef)}


def test_the_commands_define_no_preflight_check_and_no_library_code():
    """retrofit/commands/*.py parse, call the library and print: the recipe, model and memory checks, the text loss,
    the ranking and the unpatching live in the library (retrofit.train.recipe_fits, retrofit.load.preflight,
    retrofit.costs, retrofit.patching), and no command measures memory itself."""
    commands = sorted((ROOT / "retrofit" / "commands").glob("*.py"))
    assert commands
    found = {f"{p.name}: {name}" for p in commands for name in _defined(p) & MOVED}
    assert found == set()
    measuring = [p.name for p in commands if "check_fits" in p.read_text() or "..memory" in p.read_text()]
    assert measuring == []
    from retrofit.costs import rank_and_suggest, text_loss  # noqa: F401 -- where they went
    from retrofit.load.preflight import check_eval_memory, check_selection_counts, check_source  # noqa: F401
    from retrofit.patching import unpatch_parameter_free  # noqa: F401
    from retrofit.train.recipe_fits import check_recipe_fits  # noqa: F401


def test_no_two_recipe_checks_share_a_name():
    """Each check of a recipe says what it checks (check_recipe_fits, check_fsdp_recipe, check_deepspeed_recipe,
    plan_sequence_layout): no module-level function in retrofit is called plain `check_recipe`."""
    plain = [str(p.relative_to(ROOT)) for p in (ROOT / "retrofit").rglob("*.py")
             if any(isinstance(n, ast.FunctionDef) and n.name == "check_recipe" for n in ast.parse(p.read_text()).body)]
    assert plain == []
