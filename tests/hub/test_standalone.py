"""retrofit push --standalone: a folder plain transformers loads with trust_remote_code=True, with no retrofit.

The exported folders are loaded in a fresh virtual environment that sees this environment's torch and transformers
but not retrofit (checked in it), and its logits are compared with retrofit.from_pretrained's: equal, bitwise.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers
from transformers.dynamic_module_utils import get_imports, get_relative_imports

import retrofit
from retrofit.cli import main
from retrofit.errors import RetrofitError
from retrofit.hub import push
from retrofit.hub.standalone import FILE, module_path, rename, sources, vendored_modules
from retrofit.record import STANDALONE_GUARD
from tests.tiny import random_ids, randomize_patch, tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

# name -> (model type, patch): an output norm, a kernel norm on selected heads of GPT-2, SSMax owning YaRN's temperature
SETTINGS = {
    "llama-avnorm": ("llama", dict(norm="avnorm")),
    "gpt2-softmax1-heads": ("gpt2", dict(norm="softmax1", learnable=True, heads=[0, 2])),
    "llama-ssmax-yarn": ("llama", dict(norm="ssmax", rope="yarn:4")),
}
LENGTH = 80  # past the tiny Llama's 64 positions: SSMax's and YaRN's beyond-L paths run
SIZES = {"gpt2": dict(n_positions=128)}  # GPT-2's learned table must reach LENGTH

CHILD = """
import importlib.util, json, sys
import torch
assert importlib.util.find_spec("retrofit") is None, "retrofit is importable in the bare environment"
from transformers import AutoConfig, AutoModelForCausalLM

torch.set_num_threads(1)
folders, ids, out = json.loads(sys.argv[1]), torch.load(sys.argv[2]), {}
for name, folder in folders.items():
    try:
        AutoModelForCausalLM.from_pretrained(folder)
        out[name + ":plain"] = "loaded"
    except Exception as err:
        out[name + ":plain"] = str(err)
    model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)
    with torch.no_grad():
        out[name] = model(ids).logits
    out[name + ":class"] = type(model).__name__
    fresh = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder), trust_remote_code=True)
    out[name + ":fresh"] = sum(".retrofit." in k for k in fresh.state_dict())
out["retrofit-imported"] = sorted(m for m in sys.modules if m == "retrofit" or m.startswith("retrofit."))
torch.save(out, sys.argv[3])
"""


def _patched(model_type: str, patch: dict):
    model = tiny_model(model_type, **SIZES.get(model_type, {}))
    spec = dict(patch)
    retrofit.patch(model, spec.pop("norm"), **spec)
    return randomize_patch(model)


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """name -> (the saved checkpoint, its standalone export)."""
    root = tmp_path_factory.mktemp("standalone")
    folders = {}
    for name, (model_type, patch) in SETTINGS.items():
        model = _patched(model_type, patch)
        model.save_pretrained(root / name)
        out = root / f"{name}-export"
        push(str(root / name), "me/tiny", dry_run=str(out), standalone=True, progress=False)
        folders[name] = (root / name, out)
    return folders


@pytest.fixture(scope="module")
def bare_python(tmp_path_factory):
    """A venv's python that imports this environment's torch and transformers, and no retrofit."""
    venv = tmp_path_factory.mktemp("bare") / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    site = next(venv.glob("lib/python*/site-packages"))
    found = {str(Path(m.__file__).resolve().parents[1]) for m in (torch, transformers)}
    (site / "packages.pth").write_text("\n".join(sorted(found)) + "\n")  # paths only: their .pth files are not read
    return venv / "bin" / "python"


def test_plain_transformers_in_a_venv_without_retrofit_gives_retrofits_logits(exported, bare_python, tmp_path):
    ids = random_ids(2, LENGTH)
    torch.save(ids, tmp_path / "ids.pt")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env.update(HF_HOME=str(tmp_path / "hf"), HF_HUB_OFFLINE="1")  # transformers copies the modeling file there
    (tmp_path / "child.py").write_text(CHILD)
    folders = {name: str(out) for name, (_, out) in exported.items()}
    done = subprocess.run([str(bare_python), "child.py", json.dumps(folders), "ids.pt", "out.pt"], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    got = torch.load(tmp_path / "out.pt")
    assert got["retrofit-imported"] == []
    for name, (saved, _) in exported.items():
        with torch.no_grad():
            want = retrofit.from_pretrained(str(saved))(ids).logits
            plain_model = tiny_model(SETTINGS[name][0], **SIZES.get(SETTINGS[name][0], {}))
            unpatched = plain_model(ids).logits
        assert torch.equal(got[name], want), name  # the same code on the same weights: bitwise
        assert not torch.allclose(want, unpatched, atol=1e-3), name  # ... and the patch changes the logits
        assert got[name + ":class"].startswith("Retrofit"), name
        assert got[name + ":fresh"] > 0, name  # from_config: patched too
        assert "trust_remote_code=True" in got[name + ":plain"], name  # without it: refused by name, not run


def test_retrofits_own_loader_reads_an_export_without_running_its_file(exported, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("retrofit ran a folder's modeling code")

    monkeypatch.setattr(transformers.dynamic_module_utils, "get_class_from_dynamic_module", refuse)
    ids = random_ids(1, LENGTH)
    for name, (saved, out) in exported.items():
        model = retrofit.from_pretrained(str(out))
        with torch.no_grad():
            assert torch.equal(model(ids).logits, retrofit.from_pretrained(str(saved))(ids).logits), name
        assert getattr(model.config, "auto_map", None) is None  # its save is a retrofit checkpoint, not an export
    saved, out = exported["llama-avnorm"]
    retrofit.enable()  # the Auto classes load it through retrofit too, without trust_remote_code
    try:
        auto = transformers.AutoModelForCausalLM.from_pretrained(str(out))
    finally:
        retrofit.disable()
    with torch.no_grad():
        assert torch.equal(auto(ids).logits, retrofit.from_pretrained(str(saved))(ids).logits)


def test_a_planted_modeling_file_never_runs_under_retrofits_loader(exported, tmp_path):
    """Canary: a folder shaped like an export, whose modeling file would leave a file behind if run."""
    import shutil

    saved, out = exported["llama-avnorm"]
    planted = tmp_path / "planted"
    shutil.copytree(out, planted)
    canary = tmp_path / "canary"
    (planted / FILE).write_text(f"open({str(canary)!r}, 'w').write('ran')\n")
    ids = random_ids(1, 16)
    with torch.no_grad():
        assert torch.equal(retrofit.from_pretrained(str(planted))(ids).logits,
                           retrofit.from_pretrained(str(saved))(ids).logits)
        retrofit.enable()
        try:
            transformers.AutoModelForCausalLM.from_pretrained(str(planted))(ids)
        finally:
            retrofit.disable()
    assert not canary.exists()


def test_the_export_says_how_to_load_it(exported):
    saved, out = exported["llama-avnorm"]
    config = json.loads((out / "config.json").read_text())
    assert config["auto_map"] == {"AutoModelForCausalLM": "modeling_retrofit.RetrofitLlamaForCausalLM"}
    assert config["attn_implementation"] == STANDALONE_GUARD
    assert config["retrofit"] == json.loads((saved / "config.json").read_text())["retrofit"]
    card = (out / "README.md").read_text()
    assert 'AutoModelForCausalLM.from_pretrained("me/tiny", trust_remote_code=True)' in card


def test_the_modeling_file_imports_no_retrofit(exported):
    path = exported["llama-avnorm"][1] / FILE
    assert get_relative_imports(path) == []  # transformers would look for sibling files
    assert set(get_imports(path)) <= {"importlib", "linecache", "sys", "transformers"}
    namespace = {}
    tree = ast.parse(path.read_text())
    for node in tree.body:  # PACKAGE, PACKAGES and SOURCES, without running the file
        if isinstance(node, ast.Assign) and node.targets[0].id in ("PACKAGE", "PACKAGES", "SOURCES"):
            namespace[node.targets[0].id] = ast.literal_eval(node.value)
    package, embedded = namespace["PACKAGE"], namespace["SOURCES"]
    assert package.startswith("retrofit_standalone_") and "remote_code" in embedded
    for key, text in embedded.items():
        for node in ast.walk(ast.parse(text)):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            assert node.__class__ is not ast.ImportFrom or node.level == 0, (key, node.lineno)
            for module in names:
                assert module.split(".")[0] != "retrofit", (key, module)
                if module.startswith(package + "."):  # every embedded import is embedded itself
                    inner = module[len(package) + 1:]
                    assert inner in embedded or any(f"{inner}.{a.name}" in embedded for a in node.names), (key, module)
    vendored = sorted(m.partition(".")[2] for m in vendored_modules() if m != "retrofit")
    assert sorted(k for k in embedded if k) == vendored


def test_each_embedded_module_is_retrofits_own_but_for_its_package_name():
    package = "retrofit_standalone_test"
    for name, text in sources().items():
        if name == "retrofit":
            continue
        renamed = rename(name, text, package)
        assert renamed.count("\n") == text.count("\n"), name
        for before, after in zip(text.splitlines(), renamed.splitlines()):
            if before != after:  # an import of retrofit, or the custom op's namespace
                assert after.lstrip().startswith(f"from {package}") or f'"{package}::' in after, (name, after)
        assert text == module_path(name).read_text()


def test_lazy_imports_are_vendored_too():
    modules = vendored_modules()
    assert "retrofit.kernels.triton_psoftmax" in modules  # imported inside a function (kernels/dispatch.py)
    assert not any(m.startswith(("retrofit.load.", "retrofit.hub.", "retrofit.train.")) for m in modules)


def test_an_adapter_has_no_standalone_form(tmp_path):
    from peft import LoraConfig, get_peft_model

    model = _patched("llama", dict(norm="avnorm"))
    lora = get_peft_model(model, LoraConfig(r=2, target_modules=["q_proj"]))
    lora.save_pretrained(tmp_path / "adapter")
    with pytest.raises(RetrofitError, match="add --merged"):
        push(str(tmp_path / "adapter"), "me/tiny", dry_run=str(tmp_path / "out"), standalone=True, progress=False)
    assert not (tmp_path / "out").exists()


def test_the_cli_flag_writes_the_file(exported, tmp_path, capsys):
    saved, _ = exported["llama-avnorm"]
    code = main(["push", str(saved), "--repo", "me/tiny", "--standalone", "--dry-run", str(tmp_path / "out"),
                 "--no-progress"])
    assert code == 0
    assert FILE in capsys.readouterr().out
    assert (tmp_path / "out" / FILE).read_text() == (exported["llama-avnorm"][1] / FILE).read_text()
