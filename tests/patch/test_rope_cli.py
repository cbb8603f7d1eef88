"""RoPE extension wired through the tools: `retrofit patch --rope`, recipes' patch.rope (and experiment arms),
`retrofit eval --patch/--rope`, dynamic NTK order-independence, tables naming the rope, hub, bad input.

    pytest tests/patch/test_rope_cli.py

Tiny llamas trained for L = 16 positions (max_position_embeddings 16), evaluated up to 64. No network.
"""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

import retrofit
from retrofit.cli import main
from retrofit.errors import RetrofitError
from retrofit.evaluate import EvalSpec, evaluate_lengths, evaluate_models, scoring
from retrofit.evaluate.report import length_marks, loss_table_markdown, validate
from retrofit.hub.publish import patch_has_parameters
from retrofit.load import apply_patch, load
from retrofit.recipe import PatchSection, load_recipe
from tests.tiny import VOCAB, tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")

L = 16


def _tokens(n=1500, seed=0):
    return torch.randint(3, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture
def llama_folder(tmp_path):
    folder = tmp_path / "tiny-llama"
    tiny_model("llama", max_position_embeddings=L).save_pretrained(folder)
    return folder


@pytest.fixture
def token_file(tmp_path):
    path = tmp_path / "tokens.json"
    path.write_text(json.dumps(_tokens()))
    return path


# ---- 1. retrofit patch --rope ------------------------------------------------------------------------------------

def test_patch_cli_rope_is_printed_saved_and_reloaded(llama_folder, tmp_path, capsys):
    out = tmp_path / "avnorm-yarn"
    assert main(["patch", str(llama_folder), "--norm", "avnorm", "--kind", "rms", "--rope", "yarn:4",
                 "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert f"rope              yarn x4 (orig {L})" in printed
    config = json.loads((out / "config.json").read_text())
    assert config["retrofit"]["rope"]["parameters"]["rope_type"] == "yarn"
    assert config["max_position_embeddings"] == 4 * L
    loaded = retrofit.from_pretrained(str(out))
    assert loaded.config.retrofit["rope"]["original_positions"] == L
    expected = tiny_model("llama", max_position_embeddings=L)
    retrofit.patch(expected, "avnorm", kind="rms", rope="yarn:4")
    ids = torch.randint(3, VOCAB, (1, 48), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, expected(ids).logits, atol=1e-5, rtol=1e-5)


def _finetuned_checkpoint(folder, norm, **options):
    """A tiny llama with moved weights (a finetune's stand-in) saved patched as retrofit's experiment arms save."""
    model = tiny_model("llama", max_position_embeddings=L)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    plain = copy.deepcopy(model)
    retrofit.patch(model, norm, **options)
    with torch.no_grad():  # the patch's own parameters trained too (AVNorm gains)
        for n, p in model.named_parameters():
            if ".retrofit." in n:
                p.add_(torch.linspace(0.1, 0.9, p.numel()).view_as(p))
    model.save_pretrained(folder)
    return plain


def test_patch_cli_replaces_a_checkpoints_parameter_free_patch(tmp_path, capsys):
    """An arm finetuned under softmax + YaRN, re-patched with AVNorm beyond L + dynamic NTK: exactly its finetuned
    weights under the new patch, as if the new patch had been put on the plain weights; YaRN is gone."""
    plain = _finetuned_checkpoint(tmp_path / "arm", "softmax", rope="yarn:4")
    out = tmp_path / "arm-avnorm-beyond"
    assert main(["patch", str(tmp_path / "arm"), "--norm", "avnorm", "--mode", "beyond", "--exponent", "0.3",
                 "--rope", "dynamic:4", "--out", str(out)]) == 0
    assert "replaced" in capsys.readouterr().out
    record = json.loads((out / "config.json").read_text())["retrofit"]
    assert record["norm"] == "avnorm" and record["rope"]["parameters"]["rope_type"] == "dynamic"
    retrofit.patch(plain, "avnorm", mode="beyond", exponent=0.3, rope="dynamic:4")
    loaded = retrofit.from_pretrained(str(out))
    ids = torch.randint(3, VOCAB, (1, 48), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, plain.eval()(ids).logits)


def test_patch_cli_keeps_a_nope_checkpoint_without_positions(tmp_path, capsys):
    _finetuned_checkpoint(tmp_path / "arm", "softmax", nope=True)
    capsys.readouterr()
    assert main(["patch", str(tmp_path / "arm"), "--norm", "softmax1", "--out", str(tmp_path / "out")]) == 2
    assert "trained without positions (nope)" in capsys.readouterr().err.strip().splitlines()[-1]
    assert not (tmp_path / "out").exists()
    assert main(["patch", str(tmp_path / "arm"), "--norm", "softmax1", "--nope", "--out", str(tmp_path / "ok")]) == 0
    assert json.loads((tmp_path / "ok" / "config.json").read_text())["retrofit"]["nope"] is True


def test_patch_cli_refuses_to_drop_a_checkpoints_trained_patch_parameters(tmp_path, capsys):
    _finetuned_checkpoint(tmp_path / "arm", "avnorm", kind="rms")
    out = tmp_path / "out"
    capsys.readouterr()
    assert main(["patch", str(tmp_path / "arm"), "--norm", "softmax", "--out", str(out)]) == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]  # above it only transformers' loading bars (\r)
    assert last.startswith("retrofit patch: error: ") and "trained patch parameters" in last
    assert "unpatched base" in last
    assert not out.exists()


# ---- 7. bad input: one line, exit 2 --------------------------------------------------------------------------------

@pytest.mark.parametrize("argv,message", [
    (["--norm", "softmax", "--rope", "yarm:4"], "did you mean 'yarn'"),
    (["--norm", "softmax", "--rope", "yarn:0"], "rope factor must be >= 1"),
    (["--norm", "softmax", "--rope", "yarn:-2"], "rope factor must be >= 1"),
    (["--norm", "softmax", "--rope", "yarn:4", "--nope"], "--rope and --nope together"),
])
def test_patch_cli_bad_rope_is_one_line_exit_2(llama_folder, argv, message, capsys):
    assert main(["patch", str(llama_folder), *argv, "--out", str(llama_folder.parent / "never")]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_patch_cli_rope_on_gpt2_is_refused_without_traceback(tmp_path):
    folder = tmp_path / "tiny-gpt2"
    tiny_model("gpt2").save_pretrained(folder)
    done = subprocess.run([sys.executable, "-m", "retrofit", "patch", str(folder), "--norm", "softmax",
                           "--rope", "yarn:4", "--out", str(tmp_path / "never")], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    last = done.stderr.strip().splitlines()[-1]  # above it: transformers' weight-loading progress bar
    assert last.startswith("retrofit patch: error: gpt2 has learned absolute positions")


# ---- 2. recipes: patch.rope ----------------------------------------------------------------------------------------

def test_patch_section_rope_reaches_the_patch_and_an_equal_patch_is_kept():
    section = PatchSection(norm="softmax", rope="yarn:4")
    model = tiny_model("llama", max_position_embeddings=L)
    report = apply_patch(model, section)
    assert report.rope == f"yarn x4 (orig {L})" and model.config.max_position_embeddings == 4 * L
    rotary = model.model.rotary_emb
    assert apply_patch(model, PatchSection(norm="softmax", rope={"rope_type": "yarn", "factor": 4})) is None
    assert model.model.rotary_emb is rotary  # the same patch: kept
    assert apply_patch(model, PatchSection(norm="softmax", rope="dynamic:4")).rope == f"dynamic x4 (orig {L})"
    assert apply_patch(model, PatchSection(norm="softmax")).rope is None  # no rope: the plain rotary comes back
    assert model.config.max_position_embeddings == L and "rope_type" not in (model.config.rope_parameters or {}) \
        or model.config.rope_parameters.get("rope_type") == "default"


@pytest.mark.parametrize("patch,message", [
    ({"norm": "softmax", "rope": "yarm:4"}, "did you mean 'yarn'"),
    ({"norm": "softmax", "rope": "yarn:0"}, "rope factor must be >= 1"),
    ({"norm": "softmax", "rope": "yarn:4", "nope": True}, "rope and nope together"),
    ({"norm": None, "rope": "yarn:4"}, "patch.norm is null"),
])
def test_bad_recipe_rope_is_one_line(tmp_path, patch, message):
    recipe = Path(retrofit.__file__).parent / "recipes" / "train-tiny-counting.yaml"
    raw = yaml.safe_load(recipe.read_text())
    raw["patch"] = patch
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(raw))
    with pytest.raises(RetrofitError, match=message) as err:
        load_recipe(path)
    assert "\n" not in str(err.value)


def test_a_rope_arm_trains_in_an_experiment_and_reloads_with_its_rope(tmp_path):
    from retrofit.experiment import driver
    recipe = yaml.safe_load((Path(retrofit.__file__).parent / "recipes" / "train-tiny-counting.yaml").read_text())
    recipe["model"]["config"].update(hidden_size=32, intermediate_size=64, max_position_embeddings=L)
    recipe["patch"] = {"norm": None}
    recipe["data"]["seq_len"] = L
    recipe["train"].update(steps=2, init_len=None, double_every=0, warmup_steps=1, batch_size=4,
                           micro_batch_size=4, progress=False, log_every=1)
    recipe["eval"] = {"batches": 1, "batch_size": 2, "lengths": [L, 4 * L]}
    recipe["output"] = {"save_every": 0}
    recipe["experiment"] = {"base_steps": 0, "finetune_steps": 2, "recovery_at": [0],
                            "arms": [{"name": "softmax", "patch": {"norm": "softmax"}},
                                     {"name": "softmax-yarn", "patch": {"norm": "softmax", "rope": "yarn:4"}}]}
    path = tmp_path / "rope-arms.yaml"
    path.write_text(yaml.safe_dump(recipe))
    results = driver.run_experiment(path, tmp_path / "out", progress=False)
    assert not any(a["failed"] for a in results["arms"].values())
    assert results["arms"]["softmax-yarn"]["patch"]["rope"] == "yarn:4"
    assert "rope" not in results["arms"]["softmax"]["patch"]
    model = load(tmp_path / "out" / "arms" / "softmax-yarn")
    assert model.lm.config.retrofit["rope"]["parameters"]["rope_type"] == "yarn"
    entries = {m["name"]: m for m in results["evaluation"]["models"]}
    assert entries["softmax-yarn"]["rope"] == f"yarn x4 (orig {L})" and entries["softmax"]["rope"] == "none"
    assert entries["softmax-yarn"]["original_positions"] == L
    assert "rope=yarn:4" in (tmp_path / "out" / "report.md").read_text()


# ---- 3. retrofit eval --patch / --rope -----------------------------------------------------------------------------

def test_eval_cli_rope_equals_the_model_patched_in_python(llama_folder, token_file, tmp_path):
    out = tmp_path / "eval"
    assert main(["eval", str(llama_folder), "--data", str(token_file), "--lengths", "16,32,64", "--patch",
                 "avnorm:kind=rms", "--rope", "yarn:4", "--out", str(out), "--no-progress"]) == 0
    results = json.loads((out / "results.json").read_text())
    validate(results)
    (entry,) = results["models"]
    model = tiny_model("llama", max_position_embeddings=L)
    retrofit.patch(model, "avnorm", kind="rms", rope="yarn:4")
    python = evaluate_models([model], EvalSpec(tokens=_tokens(), lengths=[16, 32, 64], progress=False))["models"][0]
    assert [r["loss"] for r in entry["lengths"]] == pytest.approx([r["loss"] for r in python["lengths"]], abs=1e-6)
    assert entry["rope"] == f"yarn x4 (orig {L})" and entry["original_positions"] == L
    assert entry["max_position_embeddings"] == 4 * L  # raised by the patch; the flag below follows the original
    assert [r["beyond_max_positions"] for r in entry["lengths"]] == [False, True, True]
    assert entry["eval_patch"]["norm"] == "avnorm" and entry["eval_patch"]["rope"]["rope_type"] == "yarn"
    markdown = (out / "results.md").read_text()
    assert f"tiny-llama [yarn x4 (orig {L})]" in markdown and "original positions" in markdown


def test_eval_rope_alone_is_softmax_and_applies_to_every_model(llama_folder, token_file):
    results = evaluate_models([str(llama_folder), str(llama_folder)],
                              EvalSpec(data=str(token_file), lengths=[32], rope="linear:2", progress=False))
    assert [m["rope"] for m in results["models"]] == [f"linear x2 (orig {L})"] * 2
    assert [m["retrofit"]["norm"] for m in results["models"]] == ["softmax", "softmax"]
    plain = evaluate_models([str(llama_folder)], EvalSpec(data=str(token_file), lengths=[32], progress=False))
    plain = plain["models"][0]
    assert plain["rope"] == "none" and plain["lengths"][0]["loss"] != results["models"][0]["lengths"][0]["loss"]


def test_eval_keeps_a_model_with_the_same_rope_and_refuses_another(llama_folder, tmp_path, capsys):
    out = tmp_path / "yarn"
    assert main(["patch", str(llama_folder), "--norm", "softmax", "--rope", "yarn:4", "--out", str(out)]) == 0
    same = evaluate_models([str(out)], EvalSpec(tokens=_tokens(), lengths=[32], rope="yarn:4", progress=False))
    assert same["models"][0]["rope"] == f"yarn x4 (orig {L})"
    with pytest.raises(RetrofitError, match="already patched with rope yarn x4"):
        evaluate_models([str(out)], EvalSpec(tokens=_tokens(), lengths=[32], rope="dynamic:4", progress=False))
    (tmp_path / "tokens.json").write_text(json.dumps(_tokens()))  # valid data: the rope is what is wrong
    assert main(["eval", str(out), "--data", str(tmp_path / "tokens.json"), "--rope", "yarm:4"]) == 2
    assert "did you mean 'yarn'" in capsys.readouterr().err


def test_eval_rope_extends_a_patched_arm_keeping_its_trained_norm(tmp_path):
    """An AVNorm arm finetuned without an extension, evaluated with --rope dynamic:4: its own trained gains under
    dynamic NTK, exactly the plain weights patched with both; inside L it is the arm itself (dynamic: the identity)."""
    plain = _finetuned_checkpoint(tmp_path / "arm", "avnorm", kind="rms")
    saved = retrofit.from_pretrained(str(tmp_path / "arm"))
    gains = {n: p.detach().clone() for n, p in saved.named_parameters() if ".retrofit." in n}
    assert gains and all((g != 1).all() for g in gains.values())
    retrofit.patch(plain, "avnorm", kind="rms", rope="dynamic:4")
    with torch.no_grad():
        for n, p in plain.named_parameters():
            if n in gains:
                p.copy_(gains[n])
    docs = _tokens()
    extended = evaluate_models([str(tmp_path / "arm")], EvalSpec(tokens=docs, lengths=[L, 4 * L], rope="dynamic:4",
                                                                progress=False))
    expected = evaluate_models([plain], EvalSpec(tokens=docs, lengths=[L, 4 * L], progress=False))
    as_trained = evaluate_models([str(tmp_path / "arm")], EvalSpec(tokens=docs, lengths=[L], progress=False))
    mine, theirs = extended["models"][0], expected["models"][0]
    assert mine["rope"] == f"dynamic x4 (orig {L})"
    assert [r["window_losses"] for r in mine["lengths"]] == [r["window_losses"] for r in theirs["lengths"]]
    assert mine["lengths"][0]["window_losses"] == as_trained["models"][0]["lengths"][0]["window_losses"]
    with pytest.raises(RetrofitError, match="patch an unpatched one"):
        retrofit.extend_rope(tiny_model("llama", max_position_embeddings=L), "dynamic:4")
    with pytest.raises(RetrofitError, match="already extends RoPE"):
        retrofit.extend_rope(plain, "yarn:4")


def test_eval_bad_patch_fails_before_loading(tmp_path):
    with pytest.raises(RetrofitError, match="has no option 'kinf'"):
        evaluate_models([str(tmp_path / "missing")], EvalSpec(tokens=_tokens(), lengths=[16],
                                                                      patch={"norm": "avnorm", "kinf": "rms"}))


# ---- 3b. dynamic NTK: the loss at a length does not depend on the lengths before -----------------------------------

def test_dynamic_rope_loss_does_not_depend_on_earlier_lengths(monkeypatch):
    model = tiny_model("llama", max_position_embeddings=L)
    with torch.no_grad():  # sharp attention, so that RoPE frequencies show in the loss
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(8)
            layer.self_attn.k_proj.weight.mul_(8)
    retrofit.patch(model, "softmax", rope="dynamic:2")
    fresh = copy.deepcopy(model)
    tokens = _tokens()
    alone = {n: evaluate_lengths(copy.deepcopy(fresh), tokens, [n], progress=False)[0]["loss"] for n in (32, 128)}
    evaluate_lengths(model, tokens, [128], progress=False)  # grows inv_freq to 128 positions
    assert evaluate_lengths(model, tokens, [32], progress=False)[0]["loss"] == alone[32]  # bitwise: same inv_freq
    both = evaluate_lengths(model, tokens, [128, 32], progress=False)  # non-rising order in one call
    assert {r["length"]: r["loss"] for r in both} == alone
    # without the reset, transformers keeps the 128-position frequencies for the later 32: history would show
    monkeypatch.setattr(scoring, "fresh_dynamic_rope", lambda model: 0)
    stale = copy.deepcopy(fresh)
    evaluate_lengths(stale, tokens, [128], progress=False)
    assert abs(evaluate_lengths(stale, tokens, [32], progress=False)[0]["loss"] - alone[32]) > 1e-5


# ---- 4. tables and plots -------------------------------------------------------------------------------------------

def test_tables_name_the_rope_and_mark_beyond_the_original_positions():
    def entry(name, rope, original, maximum):
        rows = [{"length": n, "loss": 3.0, "windows": 1, "tokens": n, "time_s": 0.1, "peak_memory_mb": 1.0,
                 "beyond_max_positions": n > original, "by_position": []} for n in (16, 32, 64)]
        return {"name": name, "model_type": "llama", "rope": rope, "original_positions": original,
                "max_position_embeddings": maximum, "lengths": rows}
    results = {"schema": "retrofit.eval/1", "train_len": 8, "lengths": [16, 32, 64],
               "models": [entry("plain", "none", L, L), entry("yarn", f"yarn x4 (orig {L})", L, 4 * L)]}
    validate(results)
    table = loss_table_markdown(results)
    assert f"| yarn [yarn x4 (orig {L})] | 3.000 (n=1) | 3.000 (n=1) † | 3.000 (n=1) † |" in table  # n beside each
    assert "| plain | 3.000 (n=1) | 3.000 (n=1) † |" in table and "original positions" in table
    assert length_marks(results) == [(8, "train length"), (L, "original positions")]


# ---- 6. hub: a patch without parameters ----------------------------------------------------------------------------

@pytest.mark.parametrize("options,expected", [({}, True), ({"scale": "beyond"}, False), ({"scale": "llama4"}, False)])
def test_hub_asks_the_built_norm_whether_it_has_parameters(options, expected):
    assert patch_has_parameters({"norm": "ssmax", "options": options}) is expected
    assert patch_has_parameters({"norm": "avnorm", "options": {"kind": "rms"}})
