"""The norm contract (issue 41 item 2): every registered norm, with its example options, passes the same checks on a
tiny Llama — causal, KV cache, left padding, reload, unpatch, torch.compile (aot_eager), bf16, and its own `weights`
hook against its forward. A new norm is tested by being registered (docs/adding-a-norm.md); nothing here names one.
Every norm runs each check ungated and under both output gates (retrofit.gate, issue 55: head and element).

The patch's parameters are randomized first (gains, sinks, s, gate weights in [0.5, 1.5]), so a check cannot pass
because a fresh patch happens to be the identity."""

from __future__ import annotations

import ast

import pytest
import torch

import retrofit
from retrofit.norms import Norm, available_norms, get_norm
from tests.tiny import random_ids, randomize_patch, tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")
T = 12
GATES = {"": None, "-gate-head": "head", "-gate-element": "element:0.5:12"}  # ungated, and each gate kind
NORMS = [(norm, gate) for norm in available_norms() for gate in GATES.values()]
IDS = [f"{norm}{suffix}" for norm in available_norms() for suffix in GATES]


def _patched(norm: str, gate: str | None = None, **config):
    model = tiny_model("llama", **config)
    retrofit.patch(model, norm, gate=gate, **get_norm(norm).example_options)
    return randomize_patch(model).eval()


def _logits(model, ids, **kwargs) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids, use_cache=False, **kwargs).logits


@pytest.mark.parametrize("norm, gate", NORMS, ids=IDS)
def test_causal(norm, gate):
    """Changing the tokens after position t changes no logit up to t."""
    model, ids = _patched(norm, gate), random_ids(1, T)
    changed = ids.clone()
    changed[:, T // 2:] = (changed[:, T // 2:] + 7) % model.config.vocab_size
    a, b = _logits(model, ids), _logits(model, changed)
    torch.testing.assert_close(a[:, :T // 2], b[:, :T // 2], atol=1e-5, rtol=1e-5)
    assert not torch.allclose(a[:, T // 2:], b[:, T // 2:])  # the check can fail: the later logits did move


@pytest.mark.parametrize("norm, gate", NORMS, ids=IDS)
def test_kv_cache_decoding_equals_the_full_forward(norm, gate):
    """A prefill of half the tokens, then one token at a time through the cache: the full forward's logits."""
    model, ids = _patched(norm, gate), random_ids(1, T)
    full = _logits(model, ids)
    with torch.no_grad():
        out = model(input_ids=ids[:, :T // 2], use_cache=True)
        steps, cache = [out.logits], out.past_key_values
        for t in range(T // 2, T):
            out = model(input_ids=ids[:, t:t + 1], past_key_values=cache, use_cache=True)
            steps.append(out.logits)
            cache = out.past_key_values
    torch.testing.assert_close(torch.cat(steps, 1), full, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("norm, gate", NORMS, ids=IDS)
def test_left_padding_changes_nothing(norm, gate):
    """A row left-padded in a batch has the logits it has alone, on its real tokens."""
    model, ids = _patched(norm, gate), random_ids(2, T)
    pad = 4
    mask = torch.ones(2, T, dtype=torch.long)
    mask[1, :pad] = 0
    padded = ids.clone()
    padded[1, :pad] = 0
    batch = _logits(model, padded, attention_mask=mask)
    alone = _logits(model, ids[1:, pad:])
    torch.testing.assert_close(batch[1:, pad:], alone, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("norm, gate", NORMS, ids=IDS)
def test_reload_gives_the_same_logits(norm, gate, tmp_path):
    """save_pretrained, then retrofit.from_pretrained: the same patch, the same (randomized) parameter values."""
    model, ids = _patched(norm, gate), random_ids(2, T)
    model.save_pretrained(tmp_path / "m")
    again = retrofit.from_pretrained(str(tmp_path / "m")).eval()
    assert retrofit.patch_record(again)["norm"] == norm and retrofit.patch_record(again).get("gate") == \
        retrofit.patch_record(model).get("gate")
    torch.testing.assert_close(_logits(again, ids), _logits(model, ids), atol=0, rtol=0)


@pytest.mark.parametrize("norm, gate", NORMS, ids=IDS)
def test_unpatch_gives_the_original_model_bitwise(norm, gate):
    ids = random_ids(2, T)
    original = _logits(tiny_model("llama").eval(), ids)
    model = _patched(norm, gate)
    retrofit.unpatch(model)
    assert not retrofit.is_patched(model) and not any(isinstance(m, Norm) for m in model.modules())
    assert not any(m._forward_pre_hooks for m in model.modules())  # the gate's input hook went with it
    torch.testing.assert_close(_logits(model, ids), original, atol=0, rtol=0)


@pytest.mark.parametrize("norm, gate", NORMS, ids=IDS)
def test_compiled_equals_eager(norm, gate):
    """torch.compile (aot_eager: traced by Dynamo and AOTAutograd, no C compiler needed) computes what eager does."""
    torch._dynamo.reset()
    model, ids = _patched(norm, gate), random_ids(2, T)
    eager = _logits(model, ids)
    compiled = torch.compile(model, backend="aot_eager")
    torch.testing.assert_close(_logits(compiled, ids), eager, atol=1e-5, rtol=1e-5)
    torch._dynamo.reset()


@pytest.mark.parametrize("norm, gate", NORMS, ids=IDS)
def test_bf16_autocast_is_finite_and_close_to_fp32(norm, gate):
    """Under bf16 autocast (q, k in fp32 from RoPE, v in bf16) the loss is finite, within 2% of fp32's, and every
    trainable parameter gets a finite gradient."""
    model, ids = _patched(norm, gate), random_ids(2, T)
    model.train()
    with torch.no_grad():
        fp32 = float(model(input_ids=ids, labels=ids).loss)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    assert loss.isfinite() and abs(float(loss) - fp32) <= 0.02 * fp32, (float(loss), fp32)
    assert all(p.grad is not None and p.grad.isfinite().all() for p in model.parameters() if p.requires_grad)


@pytest.mark.parametrize("norm, gate", NORMS, ids=IDS)
def test_the_weights_hook_matches_the_forward(norm, gate):
    """What diagnose rebuilds from the norm's own `weights` hook, times the values, is what its forward computes
    (a norm acting inside attention); a norm acting on the heads' outputs keeps softmax weights, so there the
    rebuilt average is the wrapped kernel's output and the norm's output differs from it."""
    from retrofit.diagnose.capture import capture_rows

    model, ids = _patched(norm, gate), random_ids(1, T)
    rows = []
    with capture_rows(model, torch.arange(T), rows.append), torch.no_grad():
        model(input_ids=ids, use_cache=False)
    assert len(rows) == model.config.num_hidden_layers
    for r in rows:
        assert torch.isfinite(r.weights).all() and (r.weights[~r.visible] == 0).all()
        norm_module = next(m for m in model.modules() if isinstance(m, Norm))
        if not norm_module.acts_on_output:
            torch.testing.assert_close(r.head_out, r.head_out_raw, atol=1e-4, rtol=1e-4)


# ---- what a norm knows lives in its file --------------------------------------------------------------------------
# A registered norm's name, or one of its option names, as a whole string constant outside retrofit/norms/ is knowledge
# of that norm kept elsewhere (a branch, a table, a list); so is any option read from a norm's options by name. What is
# left, and why, is in docs/adding-a-norm.md ("What not to do"), which names every file here.
NAMED_ELSEWHERE = {
    "retrofit/commands/patch_flags.py": "generated from the registry (python -m retrofit.commands.patch_flags) so "
                                        "that `retrofit patch --help` imports no norm; a test checks it is current",
    "retrofit/bench/attention.py": "names retrofit.kernels' attention functions (psoftmax_attention, ...), not norms",
    "retrofit/bench/gpu.py": "the kernels the attention benchmark runs (bench/attention.py's names), not norms",
    "retrofit/bench/parity.py": "the kernels' float64 reference, keyed by kernel (psoftmax at p = 1, 2, 3, ...) with "
                                "each kernel's per-head argument (s, sink)",
    "retrofit/bench/decode.py": "--p, the order of the p-softmax kernel the decode benchmark times, passed to a norm "
                                "whose example options have a p",
    "retrofit/kernels/dispatch.py": "the CUDA backend order per kernel call (psoftmax_attention at p = 1 and p != 1, "
                                    "ssmax_attention, softmax1_attention), keyed as bench/attention.py names them",
    "retrofit/kernels/__init__.py": "each kernel function passes its dispatch key (dispatch.py's CUDA_ORDER)",
    "retrofit/recipe/experiment_section.py": "BASELINE_NORM, the default control's norm, so a recipe's keys are "
                                             "checked before torch loads; tests/recipe/test_recipe_yaml.py holds it "
                                             "equal to baseline_norm()",
}


# Option names that are also ordinary words of another part of retrofit, each declared so in its norm's file
# (option(..., elsewhere="what else it names")): as constants they are not counted (an option read from a norm's
# options by these names still is).
def _generic_option_names() -> set[str]:
    return {o.name for norm in available_norms() for o in get_norm(norm).option_schema() if o.elsewhere}


OPTION_HOLDERS = ("options", "opts", "norm_options")  # what a norm's options are called where they are passed on


def _option_names() -> set[str]:
    return {o.name for norm in available_norms() for o in get_norm(norm).option_schema()}


def _holds_options(node) -> bool:
    return (node.id if isinstance(node, ast.Name) else getattr(node, "attr", None)) in OPTION_HOLDERS


def _text(node) -> str | None:
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None


def _option_read(node) -> str | None:
    """The option name `node` reads from a norm's options: opts.gain, options["p"], options.get("kind"),
    getattr(opts, "stack", ...), "p" in options; None for anything else."""
    if isinstance(node, ast.Attribute) and _holds_options(node.value):
        return node.attr
    if isinstance(node, ast.Subscript) and _holds_options(node.value):
        return _text(node.slice)
    if isinstance(node, ast.Call) and node.args:
        func = node.func
        if isinstance(func, ast.Attribute) and func.attr in ("get", "pop") and _holds_options(func.value):
            return _text(node.args[0])
        if isinstance(func, ast.Name) and func.id in ("getattr", "hasattr") and len(node.args) >= 2 \
                and _holds_options(node.args[0]):
            return _text(node.args[1])
    if isinstance(node, ast.Compare) and any(isinstance(op, (ast.In, ast.NotIn)) for op in node.ops) \
            and any(_holds_options(c) for c in node.comparators):
        return _text(node.left)
    return None


def _norm_names_in(path) -> list[str]:
    """'path:line 'name'' for each registered norm's name, and each option name not declared `elsewhere`, as a whole
    string constant in the file, and for each option of any norm read from a norm's options by name."""
    norms, options = set(available_norms()), _option_names()
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        text, read = _text(node), _option_read(node)
        if text in norms or text in options - _generic_option_names():
            found.add((node.lineno, text))
        if read in options:
            found.add((node.lineno, read))
    return [f"{path}:{line} {name!r}" for line, name in sorted(found)]


def test_no_norm_is_named_outside_its_file():
    """Adding a norm means adding its file (docs/adding-a-norm.md): the card, diagnose, calibration, serving, reports
    and benchmarks ask the norm class (Norm's hooks) or iterate the registry, never test its name or read one of its
    options by name. The files left out each have their reason in docs/adding-a-norm.md."""
    from tests.project.test_layout import ROOT

    found = [line for path in sorted(ROOT.rglob("*.py")) if "norms" not in path.relative_to(ROOT).parts
             and str(path.relative_to(ROOT.parent)) not in NAMED_ELSEWHERE for line in _norm_names_in(path)]
    assert found == []
    assert all((ROOT.parent / path).is_file() for path in NAMED_ELSEWHERE)  # no stale exception
    guide = (ROOT.parent / "docs" / "adding-a-norm.md").read_text()
    assert [path for path in NAMED_ELSEWHERE if f"`{path}`" not in guide] == []  # each one's reason is written there
    constants = {node.value for path in ROOT.rglob("*.py") if "norms" not in path.relative_to(ROOT).parts
                 for node in ast.walk(ast.parse(path.read_text())) if _text(node)}
    assert _generic_option_names() - constants == set()  # no stale `elsewhere`: the word is used elsewhere


def test_the_name_check_catches_a_branch(tmp_path):
    planted = tmp_path / "planted.py"
    planted.write_text('def gain(norm):\n    return 1.0 if norm == "avnorm" else None\n')
    assert _norm_names_in(planted) == [f"{planted}:2 'avnorm'"]


def test_the_name_check_catches_a_branch_on_an_option(tmp_path):
    """An option's name as a constant (a branch on which parameter calibrate sets), or any option, generic names
    included, read from a norm's options by name, is caught; the generic names used for something else are not."""
    planted = tmp_path / "planted.py"
    planted.write_text("\n".join([
        'def fit(norm, spec, opts, options, gate, config):',
        '    by_length = norm.calibrated_parameter() == "exponent"',  # 2: a specific option name as a constant
        '    stacked = getattr(opts, "stack", False)',                # 3
        '    order = spec.options["p"] if "p" in options else 1.0',   # 4: a generic name read from options
        '    shape = options.get("kind"), opts.floor',                # 5
        '    return gate["kind"], config["p"], by_length, stacked, order, shape',  # 6: generic, not options: fine
    ]) + "\n")
    assert _norm_names_in(planted) == [f"{planted}:{line} {name!r}" for line, name in
                                       [(2, "exponent"), (3, "stack"), (4, "p"), (5, "floor"), (5, "kind")]]
