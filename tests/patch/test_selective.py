"""Selective patches (issue #30 item 1): layers= and heads= — unselected layers and heads are the original model's,
bitwise; the selection is recorded, reloaded and unpatched exactly; bad selections are one-line errors."""

from __future__ import annotations

import copy

import pytest
import torch
import yaml

import retrofit
from retrofit.attention_modules import attention_modules
from retrofit.errors import RetrofitError
from retrofit.families import output_projection
from retrofit.record import describe_selection
from retrofit.selection import parse_selection
from tests.tiny import random_ids, tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")  # bitwise comparisons: one reduction order

# norm -> options that make it differ from the original on a tiny model (a short text is far inside L)
NORMS = {"avnorm": {"gain": 0.5}, "ssmax": {}, "softmax1": {}, "psoftmax": {"p": 2.0}, "softmax": {}}
PER_HEAD = ("avnorm", "ssmax", "softmax1")
FAMILIES = ("llama", "gpt2", "gemma2")  # sdpa, sdpa (no GQA), eager (the model's own eager function)


def four_layers(family: str):
    return tiny_model(family, **({"n_layer": 4} if family == "gpt2" else {"num_hidden_layers": 4}))


@pytest.mark.parametrize("spec, count, expected", [
    ("16-29", 30, list(range(16, 30))),
    ("0-29:4", 30, list(range(0, 30, 4))),
    (":4", 30, list(range(0, 30, 4))),
    ("16-", 30, list(range(16, 30))),
    ("0,3", 9, [0, 3]),
    ("0+3", 9, [0, 3]),
    ("5, 1-2 + 5", 9, [1, 2, 5]),
    ([16, 17, 18], 30, [16, 17, 18]),
    (7, 9, [7]),
    (None, 3, [0, 1, 2]),
])
def test_parse_selection(spec, count, expected):
    assert parse_selection(spec, count, "layers") == expected


def test_describe_selection_reads_back():
    for indices in ([16, 17, 18, 19], [0, 4, 8], [1, 2, 5, 7, 8]):
        assert parse_selection(describe_selection(indices), 30, "layers") == indices


@pytest.mark.parametrize("spec, message", [
    ("4", "layers: index 4 is out of range; this model has 4 layers (0-3)"),
    ("2-9", "layers: index 4 is out of range; this model has 4 layers (0-3)"),
    ([], "layers: the selection [] is empty"),
    ("", "layers: the selection '' is empty"),
    ("3-1", "layers: '3-1' is an empty range"),
    ("1-x", "layers: cannot read '1-x'"),
    ("0-3:0", "layers: '0-3:0' is an empty range"),
    ([True], "layers: cannot read True"),
])
def test_bad_selection_is_one_line(spec, message):
    with pytest.raises(RetrofitError) as err:
        parse_selection(spec, 4, "layers")
    assert str(err.value).startswith(message) and "\n" not in str(err.value)


def _capture_attention(model):
    """Forward hooks on every attention module: index -> (args, kwargs, output) of its last call."""
    seen, handles = {}, []
    for i, (_, module) in enumerate(attention_modules(model)):
        def hook(mod, args, kwargs, output, i=i):
            seen[i] = (args, kwargs, output)
        handles.append(module.register_forward_hook(hook, with_kwargs=True))
    return seen, handles


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("norm", list(NORMS))
def test_unselected_layers_are_the_original_module(family, norm):
    """Layers 0 and 2 unselected, 1 and 3 patched: each unselected module's output, on the input it got in the
    patched model (after a patched layer, for layer 2), is bitwise what the original module gives on it."""
    model = four_layers(family)
    original = copy.deepcopy(model)
    report = retrofit.patch(model, norm, layers="1,3", **NORMS[norm])
    assert report.layers == [1, 3] and len(report.modules) == 2
    seen, handles = _capture_attention(model)
    ids = random_ids()
    with torch.no_grad():
        patched_logits = model(ids, use_cache=False).logits
        reference_logits = original(ids, use_cache=False).logits
    for h in handles:
        h.remove()
    modules = [m for _, m in attention_modules(original)]
    for i in (0, 2):
        args, kwargs, output = seen[i]
        with torch.no_grad():
            expected = modules[i](*args, **kwargs)
        assert torch.equal(output[0], expected[0]), f"layer {i}"
    if norm != "softmax":  # softmax is the original attention everywhere; every other norm changes layers 1 and 3
        assert not torch.allclose(patched_logits, reference_logits, atol=1e-4)


def _projection_inputs(model):
    """Layer 0's output-projection input (B, T, H, D) — the heads' outputs after any AVNorm hook."""
    module = attention_modules(model)[0][1]
    got = {}
    handle = output_projection(module).register_forward_pre_hook(lambda m, args: got.setdefault("x", args[0]))
    with torch.no_grad():
        model(random_ids(), use_cache=False)
    handle.remove()
    x = got["x"]
    return x.view(*x.shape[:-1], model.config.num_attention_heads, -1)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("norm", PER_HEAD)
def test_selected_heads_only(family, norm):
    """heads=1,2: heads 0 and 3 bitwise the original model's, heads 1 and 2 bitwise the all-heads patch's."""
    model = four_layers(family)
    original = _projection_inputs(model)
    retrofit.patch(model, norm, **NORMS[norm])
    full = _projection_inputs(model)
    retrofit.unpatch(model)
    report = retrofit.patch(model, norm, heads="1-2", **NORMS[norm])
    assert report.heads == [1, 2] and "heads" in str(report)
    selected = _projection_inputs(model)
    assert torch.equal(selected[..., [0, 3], :], original[..., [0, 3], :])
    assert torch.equal(selected[..., [1, 2], :], full[..., [1, 2], :])
    assert not torch.allclose(selected[..., [1, 2], :], original[..., [1, 2], :], atol=1e-4)


def _state(model):
    return {k: v.clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("norm", PER_HEAD)
def test_reload_and_unpatch_are_exact(family, norm, tmp_path):
    model = four_layers(family)
    ids = random_ids()
    before_state = _state(model)
    with torch.no_grad():
        before = model(ids).logits
    retrofit.patch(model, norm, layers="0-3:2", heads=[0, 3], **NORMS[norm])
    with torch.no_grad():  # the patch's parameters move off their init: the reload must carry them
        for name, p in model.named_parameters():
            if ".retrofit." in name:
                p.add_(torch.linspace(0.1, 0.4, p.numel()).view_as(p))
        patched = model(ids).logits
    record = dict(retrofit.patch_record(model))
    assert record["layers"] == [0, 2] and record["heads"] == [0, 3] and record["format"] == 2
    model.save_pretrained(tmp_path / "m")
    reloaded = retrofit.from_pretrained(str(tmp_path / "m"))
    assert retrofit.patch_record(reloaded)["layers"] == [0, 2] and retrofit.patch_record(reloaded)["heads"] == [0, 3]
    assert [n for n, _ in reloaded.named_modules() if n.endswith(".retrofit")] == \
        [n for n, _ in model.named_modules() if n.endswith(".retrofit")]
    reloaded_state, state = reloaded.state_dict(), model.state_dict()
    assert set(reloaded_state) == set(state) and all(torch.equal(reloaded_state[k], state[k]) for k in state)
    with torch.no_grad():
        assert torch.equal(reloaded(ids).logits, patched)
    retrofit.unpatch(model)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, before)
    after = model.state_dict()
    assert set(after) == set(before_state) and all(torch.equal(after[k], before_state[k]) for k in after)
    assert getattr(model.config, "retrofit", None) is None


def test_a_selection_that_is_everything_records_as_such():
    """layers= naming every layer patches every layer (recorded as the list); no selection records None."""
    model = four_layers("llama")
    assert retrofit.patch(model, "avnorm").layers is None and retrofit.patch_record(model)["format"] == 1
    retrofit.unpatch(model)
    retrofit.patch(model, "avnorm", layers=":1")
    assert retrofit.patch_record(model)["layers"] == [0, 1, 2, 3]
    assert all(hasattr(m, "retrofit") for _, m in attention_modules(model))


@pytest.mark.parametrize("call, message", [
    (dict(norm="avnorm", layers="4"), "layers: index 4 is out of range; this model has 4 layers (0-3)"),
    (dict(norm="avnorm", heads="4"), "heads: index 4 is out of range; this model has 4 heads (0-3)"),
    (dict(norm="psoftmax", heads="0"), "heads: psoftmax has no per-head parameters; heads= applies to avnorm, "
                                       "softmax1, ssmax"),
    (dict(norm="softmax", heads="0"), "heads: softmax has no per-head parameters"),
    (dict(norm="avnorm", layers=[]), "layers: the selection [] is empty"),
    (dict(norm="avnorm", heads=""), "heads: the selection '' is empty"),
    (dict(norm="avnorm", layers="1--2"), "layers: cannot read '1--2'"),
    (dict(norm="avnorm", layers="1", nope=True), "nope removes positions from the whole model"),
])
def test_bad_patch_calls_change_nothing(call, message):
    model = four_layers("llama")
    with pytest.raises(RetrofitError) as err:
        retrofit.patch(model, **call)
    assert str(err.value).startswith(message) and "\n" not in str(err.value)
    assert not retrofit.is_patched(model) and getattr(model.config, "retrofit", None) is None


def test_recipe_patch_layers_and_heads():
    """patch.layers / patch.heads reach retrofit.patch; the same selection again is no re-patch, another is."""
    from retrofit.load import apply_patch
    from retrofit.recipe import PatchSection
    model = four_layers("llama")
    report = apply_patch(model, PatchSection(norm="softmax1", layers="2-", heads="0+1"))
    assert report.layers == [2, 3] and report.heads == [0, 1]
    assert apply_patch(model, PatchSection(norm="softmax1", layers=[2, 3], heads="0,1")) is None
    report = apply_patch(model, PatchSection(norm="softmax1", layers=3))
    assert report.layers == [3] and report.heads is None and retrofit.patch_record(model)["heads"] is None



def test_an_experiment_arm_reports_its_selection(tmp_path):
    """The experiment's report labels an arm by what its checkpoint recorded, layers and heads included; a
    whole-model arm's label has neither; a failed arm (no checkpoint) is labelled from its recipe."""
    from retrofit.experiment.labels import trained_patch
    from retrofit.recipe import ArmSection, PatchSection
    selective = ArmSection(name="sel", patch=PatchSection(norm="avnorm", layers="2-", heads="0+1"))
    model = four_layers("llama")
    retrofit.patch(model, "avnorm", layers="2-", heads="0+1")
    model.save_pretrained(tmp_path / "sel")
    (tmp_path / "sel" / "result.json").write_text("{}")  # a finished run
    label = trained_patch(tmp_path / "sel", selective)
    assert (label["norm"], label["layers"], label["heads"]) == ("avnorm", [2, 3], [0, 1])
    assert trained_patch(tmp_path / "failed", selective)["layers"] == "2-"
    whole = four_layers("llama")
    retrofit.patch(whole, "avnorm")
    whole.save_pretrained(tmp_path / "whole")
    (tmp_path / "whole" / "result.json").write_text("{}")
    label = trained_patch(tmp_path / "whole", ArmSection(name="whole", patch=PatchSection(norm="avnorm")))
    assert label["norm"] == "avnorm" and "layers" not in label and "heads" not in label

@pytest.mark.parametrize("section, message", [
    (dict(norm="psoftmax", heads=0), "patch.heads: psoftmax has no per-head parameters; patch.heads applies to "
                                     "avnorm, softmax1, ssmax"),
    (dict(norm="avnorm", layers="1..3"), "patch.layers: cannot read '1..3'"),
    (dict(norm="avnorm", layers=[]), "patch.layers: the selection [] is empty"),
    (dict(norm="avnorm", layers="1", nope=True), "patch: nope removes positions from the whole model"),
    (dict(norm=None, layers="1"), "patch: nope/calibrate_tokens/rope/gate given but patch.norm is null"),
    (dict(norm=None, gate="head"), "patch: nope/calibrate_tokens/rope/gate given but patch.norm is null"),
])
def test_bad_recipe_selection(section, message):
    from retrofit.recipe import PatchSection
    with pytest.raises(RetrofitError) as err:
        PatchSection(**section)
    assert str(err.value).startswith(message)


@pytest.mark.parametrize("spec, message", [
    ("16-", "layers: index 16 is out of range; this model has 4 layers (0-3)"),
    ("0-99999999999", "layers: index 4 is out of range"),
    ("1-99999999999:2", "layers: index 5 is out of range"),
    ([-1], "layers: index -1 is out of range; indices start at 0"),
])
def test_out_of_range_never_lists_the_range(spec, message):
    with pytest.raises(RetrofitError) as err:
        parse_selection(spec, 4, "layers")
    assert str(err.value).startswith(message)


def test_syntax_only_check_takes_no_count():
    """Before loading (no count): huge or open ranges are checked, never expanded; errors as with a count."""
    assert parse_selection("0-99999999999,:4,16-", None, "--layers") == [0, 16]
    with pytest.raises(RetrofitError, match="is an empty range"):
        parse_selection("5-1", None, "--layers")


def test_eval_patch_spec_takes_a_selection():
    """eval --patch avnorm:layers=1-2,heads=0+3: PatchSpec.parse splits on commas, '+' joins the selection's items."""
    from retrofit.evaluate.driver import _patch_on_the_fly
    from retrofit.evaluate.spec import _eval_patch
    wanted = _eval_patch("softmax1:layers=1-2,heads=0+3,sink=-1", None)
    assert wanted["layers"] == "1-2" and wanted["heads"] == "0+3" and wanted["options"]["sink"] == -1.0
    model = four_layers("llama")
    _patch_on_the_fly(model, wanted, "tiny")
    record = retrofit.patch_record(model)
    assert record["layers"] == [1, 2] and record["heads"] == [0, 3] and record["options"]["sink"] == -1.0
    with pytest.raises(RetrofitError, match="the evaluation patch's layers: cannot read '1..2'"):
        _eval_patch({"norm": "avnorm", "layers": "1..2"}, None)


def _loss(model, ids) -> float:
    with torch.no_grad():
        return float(model(input_ids=ids, labels=ids, use_cache=False).loss)


@pytest.mark.parametrize("family, norm", [("llama", "avnorm"), ("gpt2", "softmax1"), ("llama", "ssmax")])
def test_cost_ranking_equals_brute_force(family, norm):
    """layer_costs / head_costs (masks on one patched model) equal patching a fresh copy with layers=[i] or
    heads=[h] and measuring: the same losses (bitwise) and so the same order."""
    from retrofit.costs import head_costs, layer_costs, selection_loss
    ids = random_ids(1, 24)
    base = four_layers(family)
    model = copy.deepcopy(base)
    retrofit.patch(model, norm, **NORMS[norm])
    baseline, layers = layer_costs(model, ids)
    assert baseline == _loss(base, ids)
    brute = {}
    for i in range(4):
        one = copy.deepcopy(base)
        retrofit.patch(one, norm, layers=[i], **NORMS[norm])
        brute[i] = _loss(one, ids)
    assert [c.index for c in layers] == sorted(brute, key=lambda i: (brute[i] - baseline, i))
    assert all(c.loss == brute[c.index] and c.cost == brute[c.index] - baseline for c in layers)
    assert len({c.loss for c in layers}) == 4  # the layers differ, so the order is a real ranking
    _, heads = head_costs(model, ids)
    for c in heads:
        one = copy.deepcopy(base)
        retrofit.patch(one, norm, heads=[c.index], **NORMS[norm])
        assert c.loss == _loss(one, ids)
    assert [c.cost for c in heads] == sorted(c.cost for c in heads)
    pair = copy.deepcopy(base)
    retrofit.patch(pair, norm, layers=[1, 3], heads=[0, 2], **NORMS[norm])
    assert selection_loss(model, ids, [1, 3], [0, 2]) == _loss(pair, ids)
    full = copy.deepcopy(base)
    retrofit.patch(full, norm, **NORMS[norm])
    assert _loss(model, ids) == _loss(full, ids)  # the ranking restored every norm's own mask
    assert all(m.retrofit.head_mask is None for _, m in attention_modules(model))


def test_cli_check_text_ranks_layers_and_heads(tmp_path, capsys):
    """retrofit patch --check-text prints the layer and head rankings, cheapest first, as a brute-force
    recomputation (a fresh patch of one layer, or one head, per row) orders them, and suggests the k cheapest."""
    import re

    from retrofit.cli import main
    from tests.tiny import char_tokenizer
    folder, text = tmp_path / "m", tmp_path / "t.txt"
    base = four_layers("llama")
    base.save_pretrained(folder)
    tok = char_tokenizer()
    tok.save_pretrained(folder)
    text.write_text("the cat sat on the mat and the dog ran after it. " * 4)
    assert main(["patch", str(folder), "--norm", "softmax1", "--check-text", str(text), "--check-tokens", "64",
                 "--rank-k", "2"]) == 0
    out = capsys.readouterr().out
    ids = tok(text.read_text(), return_tensors="pt").input_ids[:, :64]

    def brute(**selection):
        one = copy.deepcopy(base)
        retrofit.patch(one, "softmax1", **selection)
        return _loss(one, ids)

    for what, count, flag in (("layer", 4, "--layers"), ("head", 4, "--heads")):
        table = out.split(f"zero-shot cost per {what}")[1].split("suggested:")[0]
        rows = [(int(i), float(loss)) for i, loss, _ in re.findall(r"^\s+(\d+)\s+(\S+)\s+(\S+)$", table, re.M)]
        losses = {i: brute(**{f"{what}s": [i]}) for i in range(count)}
        assert [i for i, _ in rows] == sorted(losses, key=lambda i: (losses[i], i))
        assert all(abs(loss - losses[i]) < 5e-5 for i, loss in rows)  # printed to 4 decimals
        cheapest = sorted(i for i, _ in rows[:2])
        assert f"suggested: {flag} {describe_selection(cheapest)} (the 2 cheapest {what}s together" in out


@pytest.mark.parametrize("norm, options", [("avnorm", {}), ("softmax1", {"learnable": True})])
def test_adapter_round_trip_keeps_the_selection(tmp_path, norm, options):
    """A LoRA adapter on a selective patch (the patch trained through modules_to_save) reloads with the same
    layers and heads and the same logits (the adapter's record is compared with layers and heads too)."""
    from retrofit.load.adapters import save_adapter
    from tests.load.test_adapters import peft_on_patched
    model, _, ids = peft_on_patched(tmp_path, "llama", norm, layers=[1], heads="0,2", **options)
    with torch.no_grad():
        expected = model(input_ids=ids).logits
    loaded = retrofit.from_pretrained(str(save_adapter(model, tmp_path / "adapter")))
    record = retrofit.patch_record(loaded.base_model.model)
    assert record["layers"] == [1] and record["heads"] == [0, 2]
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=ids).logits, expected)


@pytest.mark.parametrize("verb, override, message", [
    ("train", "patch.layers=7", "patch.layers: index 7 is out of range; this model has 4 layers (0-3)"),
    ("train", "patch.heads=9", "patch.heads: index 9 is out of range; this model has 4 heads (0-3)"),
    ("experiment", 'experiment.arms=[{name: sel, patch: {norm: avnorm, layers: "2-5"}}]',
     "experiment arm sel: patch.layers: index 4 is out of range; this model has 4 layers (0-3)"),
])
def test_a_recipe_selection_out_of_range_fails_before_the_weights_load(verb, override, message, tmp_path, capsys):
    """From the model's config, before anything loads: one line, exit 2, no loading bar above it, nothing written."""
    from retrofit.cli import main
    four_layers("llama").save_pretrained(tmp_path / "model")
    (tmp_path / "book.txt").write_text("Some text to train on. " * 50)
    recipe = {"name": "sel", "model": {"source": str(tmp_path / "model")}, "patch": {"norm": "avnorm"},
              "data": {"task": "lm", "files": [str(tmp_path / "book.txt")], "seq_len": 16},
              "train": {"steps": 1, "batch_size": 1, "micro_batch_size": 1}, "eval": {"lengths": [16]},
              "experiment": {"arms": [{"name": "softmax", "patch": {"norm": "softmax"}}]}}
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(recipe))
    out = tmp_path / "out"
    capsys.readouterr()
    assert main([verb, str(tmp_path / "r.yaml"), override, "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err, err
    assert not out.exists()
