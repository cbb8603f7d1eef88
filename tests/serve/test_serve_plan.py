"""retrofit.serve.plan: which patched checkpoints the vLLM plugin serves, and the one-line refusals. No vLLM needed:
the plan is read from the config.json a save writes (the parity itself: tests/serve/test_serve_vllm.py, in vLLM's
env)."""

from __future__ import annotations

import json

import pytest

import retrofit
from retrofit.errors import RetrofitError
from retrofit.record import GUARD, GUARD_KEY
from retrofit.serve import serve_plan
from tests.tiny import tiny_model


def saved_config(tmp_path, norm, model_type="llama", **options) -> dict:
    model = tiny_model(model_type)
    retrofit.patch(model, norm, **options)
    model.save_pretrained(tmp_path)
    return json.loads((tmp_path / "config.json").read_text())


@pytest.mark.parametrize("norm, options", [("avnorm", {}), ("ssmax", {"scale": "beyond"}), ("softmax1", {}),
                                           ("softmax", {"rope": "yarn:2"})])
def test_served_norms_have_a_plan(norm, options, tmp_path):
    config = saved_config(tmp_path, norm, **options)
    assert config[GUARD_KEY] == GUARD  # the guard rides along; vLLM's loader never passes it to transformers
    plan = serve_plan(config)
    assert plan.norm == norm and plan.layers is None and plan.heads is None and not plan.nope
    assert plan.original_positions == 64  # tiny max positions; a rope extension records the originals
    assert plan.options == config["retrofit"]["options"]


def test_a_plain_config_has_no_plan(tmp_path):
    tiny_model("llama").save_pretrained(tmp_path)
    assert serve_plan(json.loads((tmp_path / "config.json").read_text())) is None


def test_selection_and_nope_are_carried(tmp_path):
    plan = serve_plan(saved_config(tmp_path / "a", "ssmax", layers=[1], heads=[0, 2]))
    assert (plan.layers, plan.heads, plan.nope) == ((1,), (0, 2), False)
    assert serve_plan(saved_config(tmp_path / "b", "softmax", nope=True)).nope


@pytest.mark.parametrize("key, value, message", [
    ("layers", [0, 2], "retrofit.layers selects layer 2 but the model has 2 layers (0-1)"),
    ("heads", [4], "retrofit.heads selects head 4 but the model has 4 heads (0-3)"),
    ("heads", [0, 0], "retrofit.heads names head 0 twice"),
])
def test_a_selection_the_model_does_not_have_is_refused(key, value, message, tmp_path):
    """A plan is built from config.retrofit before vLLM builds a module: a layer or head past the model's counts
    would patch nothing there (or another head), silently; it is refused in one line."""
    config = saved_config(tmp_path, "ssmax", layers=[0, 1], heads=[0, 1])
    config["retrofit"][key] = value
    with pytest.raises(RetrofitError) as caught:
        serve_plan(config, where="ckpt")
    assert str(caught.value).startswith("ckpt: ") and message in str(caught.value), str(caught.value)


@pytest.mark.parametrize("norm, model_type, options, message", [
    ("psoftmax", "llama", {"p": 2}, "p-softmax is not served by vLLM: it rescales each row"),
    ("avnorm", "gpt2", {}, "serves LlamaForCausalLM checkpoints, not GPT2LMHeadModel"),
    ("softmax", "llama", {"rope": "dynamic:4"}, "rope dynamic is not served by vLLM: vLLM's dynamic NTK fixes"),
    ("ssmax", "llama", {"rope": {"rope_type": "longrope", "factor": 4.0, "short_factor": [1.5] * 4,
                                 "long_factor": [3.0] * 4}}, "rope longrope is not served by vLLM"),
    ("avnorm", "llama", {"gate": "head"}, "its output gate is not served by vLLM: the gate reads"),  # issue 55
    ("softmax", "llama", {"gate": "element:0.5:12"}, "its output gate is not served by vLLM"),
    ("softmax1", "llama", {"heads": [0, 1]}, "does not serve softmax1 on selected heads"),  # vLLM's sinks: every head
])
def test_refused_in_one_line(norm, model_type, options, message, tmp_path):
    config = saved_config(tmp_path, norm, model_type, **options)
    with pytest.raises(RetrofitError, match=message) as caught:
        serve_plan(config, where="ckpt")
    assert "\n" not in str(caught.value) and str(caught.value).startswith("ckpt: ")


def test_a_damaged_record_is_refused_by_the_loaders_own_check(tmp_path):
    config = saved_config(tmp_path, "avnorm")
    config["retrofit"]["options"]["affine"] = "false"  # a string is never a bool
    with pytest.raises(RetrofitError, match="retrofit.options.affine must be true or false"):
        serve_plan(config)


@pytest.mark.parametrize("settings, message", [
    (dict(tasks=["lm"]), "--engine vllm runs the generation tasks .* not lm"),
    (dict(tasks=None), "not lm"),
    (dict(tasks=["niah", "passkey"]), "not passkey"),
    (dict(tasks=["niah"], rope="yarn:2"), "serves each checkpoint with the patch it carries"),
    (dict(tasks=["niah"], patch={"norm": "ssmax"}), "drop --patch, --rope and --variants"),
    (dict(tasks=["niah"], engine="sglang"), "unknown engine 'sglang'"),
])
def test_eval_engine_vllm_refuses_what_it_cannot_run(settings, message):
    from retrofit.evaluate import EvalSpec

    with pytest.raises(RetrofitError, match=message):
        EvalSpec(lengths=[64], **{"engine": "vllm", **settings})


def test_eval_engine_vllm_refusal_is_one_line_and_writes_nothing(tmp_path, capsys):
    from retrofit.cli import main

    tiny_model("llama").save_pretrained(tmp_path / "model")
    capsys.readouterr()  # the save's progress bar
    out = tmp_path / "out"
    assert main(["eval", str(tmp_path / "model"), "--engine", "vllm", "--tasks", "lm", "--lengths", "64",
                 "--out", str(out), "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert "--engine vllm runs the generation tasks" in err and "\n" not in err and "Traceback" not in err
    assert not out.exists()


def test_the_folder_vllm_serves_is_still_refused_by_plain_transformers(tmp_path):
    """One checkpoint, three loaders: vLLM (with the plugin) and retrofit serve it, plain transformers refuses it."""
    from transformers import AutoModelForCausalLM

    saved_config(tmp_path, "ssmax")
    with pytest.raises(Exception, match="retrofit.from_pretrained"):
        AutoModelForCausalLM.from_pretrained(tmp_path)
    assert retrofit.is_patched(retrofit.from_pretrained(tmp_path))


def test_what_the_plugin_serves_or_guards_is_read_from_the_family_table():
    """plan.ARCHITECTURES (served: vLLM's model code extended) and plan.GUARDED (vLLM's own model, refusing a patched
    checkpoint) are the families' vLLM rows (Family.vllm), one each; a family without one is vLLM's, unguarded."""
    from retrofit.families import FAMILIES
    from retrofit.serve.plan import ARCHITECTURES, GUARDED

    rows = [f.vllm for f in FAMILIES.values() if f.vllm is not None]
    assert ARCHITECTURES == ("LlamaForCausalLM",) == tuple(v.architecture for v in rows if v.served)
    assert GUARDED == {v.architecture: (f"vllm.model_executor.models.{v.module}", v.architecture)
                       for v in rows if not v.served}
    assert set(GUARDED) == {  # what the plugin guarded before the table moved into families.py
        "GPT2LMHeadModel", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "GemmaForCausalLM",
        "Gemma2ForCausalLM", "Gemma3ForCausalLM", "Phi3ForCausalLM", "GraniteForCausalLM", "MixtralForCausalLM",
        "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM", "GptOssForCausalLM"}
    assert GUARDED["Gemma3ForCausalLM"][0] == "vllm.model_executor.models.gemma3"  # model type gemma3_text


@pytest.mark.parametrize("where, value, message", [
    ("rope", "abc", r"retrofit.rope.original_positions must be a whole number of positions in 1..16,777,216 \(the "
                    r"context the model was trained on\), got 'abc'; save the checkpoint again$"),
    ("rope", 0, r"retrofit.rope.original_positions must be a whole number .*got 0;"),
    ("rope", 4096.5, r"retrofit.rope.original_positions must be a whole number .*got 4096.5;"),
    ("rope", 10 ** 400, r"retrofit.rope.original_positions must be a whole number .*got 1000000000000"),
    ("rope", True, r"retrofit.rope.original_positions must be a whole number .*got True;"),
    ("config", "64", r"max_position_embeddings must be a whole number of positions .*got '64';"),
    ("config", -1, r"max_position_embeddings must be a whole number of positions .*got -1;"),
    ("rope_type", ["yarn"], r"unknown rope type \['yarn'\]; retrofit knows: "),  # check_record's, not a TypeError
])
def test_the_plans_values_are_checked_before_vllm_sees_them(where, value, message, tmp_path):
    """Issue 61 (from round 5): a plan with `original_positions: "abc"` raised ValueError inside vLLM's loader (int()
    there). The positions (recorded by a rope extension, else the config's) and the rope type are checked here, in
    one line naming the checkpoint; vLLM itself is not needed for that."""
    config = saved_config(tmp_path, "ssmax", rope="yarn:2")
    if where == "rope":
        config["retrofit"]["rope"]["original_positions"] = value
    elif where == "rope_type":
        config["retrofit"]["rope"]["parameters"]["rope_type"] = value
    else:
        config["retrofit"]["rope"] = None
        config["max_position_embeddings"] = value
    with pytest.raises(RetrofitError, match=message) as caught:
        serve_plan(config, where="ckpt")
    assert str(caught.value).startswith("ckpt: ") and "\n" not in str(caught.value)
