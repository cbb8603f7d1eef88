"""Bad input gets a one-line error: from Python a RetrofitError, from the CLI exit code 2 and no traceback."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from torch import nn

import retrofit
from retrofit.errors import RetrofitError
from tests.tiny import tiny_model


@pytest.mark.parametrize("norm,options,match", [
    ("avnrm", {}, "unknown norm 'avnrm' \\(did you mean 'avnorm'\\?\\)"),
    ("psoftmax", {"p": 0.5}, "p must be a finite number >= 1"),
    ("psoftmax", {"p": "two"}, "p must be a number"),
    ("avnorm", {"kind": "batch"}, "kind must be one of rms, layer, global"),
    ("avnorm", {"knd": "rms"}, "no option 'knd' \\(did you mean 'kind'\\?\\)"),
    ("psoftmax", {"kind": "rms"}, "norm 'psoftmax' has no option 'kind'"),
    ("ssmax", {"ref_len": 1}, "ref_len must be an integer >= 2"),
])
def test_bad_norm_or_option(norm, options, match):
    model = tiny_model("llama")
    with pytest.raises(RetrofitError, match=match) as err:
        retrofit.patch(model, norm, **options)
    assert "\n" not in str(err.value)
    assert not retrofit.is_patched(model)  # nothing half-done


def test_double_patch_is_refused():
    model = tiny_model("gpt2")
    retrofit.patch(model, "avnorm")
    with pytest.raises(RetrofitError, match="already patched; call retrofit.unpatch"):
        retrofit.patch(model, "psoftmax")


def test_unpatch_of_unpatched_model_is_refused():
    with pytest.raises(RetrofitError, match="not patched"):
        retrofit.unpatch(tiny_model("gpt2"))


def test_not_a_hf_model():
    with pytest.raises(RetrofitError, match="not a Hugging Face model"):
        retrofit.patch(nn.Linear(2, 2), "avnorm")


def test_gpt2_reorder_and_upcast_under_eager_bypasses_the_registry():
    model = tiny_model("gpt2", attn_implementation="eager", reorder_and_upcast_attn=True)
    with pytest.raises(RetrofitError, match="reorder_and_upcast_attn"):
        retrofit.patch(model, "psoftmax")  # bypassing the registry would bypass its kernels
    retrofit.patch(model, "avnorm")  # the output projection's hook is not bypassed


def test_unsupported_attention_implementation():
    """A kernel norm cannot run over paged attention (avnorm can: tests/norms/test_any_implementation.py)."""
    model = tiny_model("llama")
    model.config._attn_implementation_internal = "paged|sdpa"
    with pytest.raises(RetrofitError, match="cannot run this norm's kernels over paged attention"):
        retrofit.patch(model, "psoftmax")


def test_model_without_registry_attention():
    from transformers import AutoConfig, AutoModelForCausalLM
    cfg = AutoConfig.for_model("gpt_neox", hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                               intermediate_size=64, vocab_size=97)
    model = AutoModelForCausalLM.from_config(cfg)
    # gpt_neox is not in retrofit's table: plain norms work through the generic path, NoPE does not
    with pytest.raises(RetrofitError, match="nope needs to know where 'gpt_neox' adds positions"):
        retrofit.patch(model, "avnorm", nope=True)
    ids = torch.randint(0, 97, (1, 5))
    with torch.no_grad():
        before = model(ids).logits
        report = retrofit.patch(model, "avnorm")
        after = model(ids).logits
    assert report.family == "generic" and len(report.modules) == 1
    assert not torch.allclose(before, after)  # the norm is really in the path


def test_a_bad_softcap_from_the_model_is_a_one_line_error():
    """Soft-capping is supported by every kernel now (tests/kernels/test_softcap.py); a non-positive cap is refused."""
    model = tiny_model("gemma2", attn_logit_softcapping=-1.0)
    retrofit.patch(model, "psoftmax")
    with pytest.raises(ValueError, match="softcap"):
        model(torch.randint(3, 90, (1, 6)))


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "retrofit", *args], capture_output=True, text=True, timeout=120)


def _cli_in_process(args, capsys) -> subprocess.CompletedProcess:
    """retrofit.cli.main, the function `python -m retrofit` exits with; argparse's errors exit from inside it."""
    from retrofit.cli import main
    capsys.readouterr()
    try:
        code = main(list(args))
    except SystemExit as exit:
        code = exit.code
    out = capsys.readouterr()
    return subprocess.CompletedProcess(args, code, out.out, out.err)


# A process of its own (~3 s of imports each): one RetrofitError and one argparse error, so `python -m retrofit`
# itself is seen to exit 2 with one line; the other cases run the same main() in this process.
IN_A_PROCESS = ("./no/such/folder", "frobnicate")


@pytest.mark.parametrize("args,match", [
    (["patch", "./no/such/folder", "--norm", "avnorm"], "no such file or folder: ./no/such/folder"),
    (["patch", "x.gguf", "--norm", "avnorm"], "no such GGUF file"),
    (["patch", "gpt2", "--norm", "avnrm"], "did you mean 'avnorm'"),
    (["patch", "gpt2", "--norm", "psoftmax", "--p", "0.5"], "p must be a finite number >= 1"),
    (["patch", "gpt2", "--norm", "psoftmax", "--kind", "rms"], "has no option 'kind'"),
    (["patch", "gpt2", "--norm", "avnorm", "--bogus-flag"], "unrecognized arguments: --bogus-flag"),
    (["frobnicate"], "invalid choice: 'frobnicate'"),
])
def test_cli_bad_input_exits_2_without_traceback(args, match, tmp_path, capsys):
    args = [*args, *(["--out", str(tmp_path / "out")] if args[0] == "patch" else [])]
    run = _cli(*args) if set(args) & set(IN_A_PROCESS) else _cli_in_process(args, capsys)
    assert run.returncode == 2, run.stderr
    assert "Traceback" not in run.stderr
    lines = [line for line in run.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and __import__("re").search(match, lines[0]), run.stderr


def test_cli_patch_saves_a_folder_that_reloads(tmp_path, capsys):
    src = tmp_path / "src"
    model = tiny_model("llama")
    model.save_pretrained(src)
    out = tmp_path / "out"
    run = _cli("patch", str(src), "--norm", "avnorm", "--kind", "layer", "--nope", "--out", str(out))
    assert run.returncode == 0, run.stderr
    assert "attention modules 2 patched over sdpa" in run.stdout and "rotary made identity" in run.stdout
    loaded = retrofit.from_pretrained(str(out))
    assert loaded.config.retrofit["options"]["kind"] == "layer" and loaded.config.retrofit["nope"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out.")]  # no temporary left behind
    again = _cli_in_process(["patch", str(src), "--norm", "avnorm", "--out", str(out)], capsys)
    assert again.returncode == 2 and "exists and is not empty" in again.stderr


def test_cli_norms_lists_every_norm():
    run = _cli("norms")
    assert run.returncode == 0
    for name in retrofit.available_norms():
        assert name in run.stdout
