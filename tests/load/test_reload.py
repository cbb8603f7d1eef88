"""Save -> retrofit.from_pretrained in a fresh process gives identical logits and parameter values."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import retrofit
from tests.patch.test_patch import NORMS, patched_pair
from tests.tiny import random_ids

ROOT = Path(__file__).resolve().parents[2]

LOADER = r"""
import sys, json, torch
sys.path.insert(0, sys.argv[1])
import retrofit
from tests.tiny import random_ids
torch.set_num_threads(1)  # the same reduction order as the parent: bitwise comparisons
out = {}
for folder in json.loads(sys.argv[2]):
    model = retrofit.from_pretrained(folder)
    with torch.no_grad():
        logits = model(random_ids(2, 12)).logits
    params = {n: p.detach().clone() for n, p in model.named_parameters() if ".retrofit." in n}
    torch.save({"logits": logits, "params": params, "record": model.config.retrofit}, folder + "/reloaded.pt")
"""


FAMILIES = ["gpt2", "llama", "gemma2"]


@pytest.fixture(scope="module")
def reloaded(tmp_path_factory):
    """Every family's every norm (with and without NoPE) saved, then all reloaded by one fresh process (a start
    costs ~3 s of imports; the families share nothing a fresh process would reset between them)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # matmul results depend on the thread count; the child uses 1 too
    try:
        cases = {family: {} for family in FAMILIES}
        for family in FAMILIES:
            for norm_key in NORMS:
                for nope in (False, True):
                    _, model = patched_pair(family, norm_key, nope)
                    folder = tmp_path_factory.mktemp(f"{family}-{norm_key}-{nope}")
                    model.save_pretrained(folder)
                    with torch.no_grad():
                        logits = model(random_ids(2, 12)).logits
                    params = {n: p.detach().clone() for n, p in model.named_parameters() if ".retrofit." in n}
                    cases[family][str(folder)] = (logits, params, model.config.retrofit)
    finally:
        torch.set_num_threads(threads)
    folders = [folder for family in FAMILIES for folder in cases[family]]
    run = subprocess.run([sys.executable, "-c", LOADER, str(ROOT), json.dumps(folders)],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    return cases


@pytest.mark.parametrize("family", FAMILIES)
def test_reload_in_fresh_process(family, reloaded):
    for folder, (logits, params, record) in reloaded[family].items():
        got = torch.load(Path(folder) / "reloaded.pt")
        assert torch.equal(got["logits"], logits), folder
        assert got["params"].keys() == params.keys()
        for name in params:
            assert torch.equal(got["params"][name], params[name]), (folder, name)
        assert got["record"] == record


def test_config_json_carries_the_patch(tmp_path):
    _, model = patched_pair("llama", "ssmax", nope=True)
    model.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["retrofit"]["norm"] == "ssmax" and saved["retrofit"]["nope"] is True
    assert saved["retrofit"]["base_attn_implementation"] == "sdpa"


def test_from_pretrained_refuses_a_plain_checkpoint(tmp_path):
    original, _ = patched_pair("llama", "softmax", nope=False)
    original.save_pretrained(tmp_path)
    with pytest.raises(retrofit.RetrofitError, match="not a retrofit checkpoint"):
        retrofit.from_pretrained(str(tmp_path))


def test_from_pretrained_refuses_missing_patch_tensors(tmp_path):
    from safetensors.torch import load_file, save_file
    _, model = patched_pair("llama", "avnorm", nope=False)  # kind=rms, its default
    model.save_pretrained(tmp_path)
    weights = load_file(tmp_path / "model.safetensors")
    save_file({k: v for k, v in weights.items() if ".retrofit." not in k}, tmp_path / "model.safetensors",
              metadata={"format": "pt"})
    with pytest.raises(retrofit.RetrofitError, match="lacks .* patch tensors"):
        retrofit.from_pretrained(str(tmp_path))


def test_load_rebuilds_a_patched_folder(tmp_path):
    _, model = patched_pair("qwen2", "psoftmax", nope=False)  # p = 2, its example
    model.save_pretrained(tmp_path)
    loaded = retrofit.load.load(str(tmp_path))
    assert retrofit.is_patched(loaded) and loaded.config.retrofit["norm"] == "psoftmax"
