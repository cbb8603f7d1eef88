"""Bad input to every verb: exit code 2, exactly one line on stderr, no traceback, nothing half-written.

Most cases run in-process through `retrofit.cli.main` (a subprocess costs ~3 s of imports); a handful run as
real subprocesses to prove the same end to end. One tiny model folder (and its damaged copies) per module.
`python tests/cli/bad_inputs_table.py` prints the table of these cases: input -> exit code -> first line.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

import retrofit
from retrofit.cli import main
from tests.tiny import char_tokenizer, tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

ROOT = os.geteuid() == 0  # root writes into a chmod 555 folder: test a path under a file instead


def build_world(root: Path) -> dict:
    """Every input the cases name, keyed by placeholder: a tiny model, its damaged copies, texts, recipes."""
    w = {"root": str(root)}
    model = root / "model"
    tiny_model("llama").save_pretrained(model)
    char_tokenizer().save_pretrained(model)
    w["model"] = str(model)
    ckpt = tiny_model("llama")
    retrofit.patch(ckpt, "avnorm")
    ckpt.save_pretrained(root / "ckpt")
    char_tokenizer().save_pretrained(root / "ckpt")
    w["ckpt"] = str(root / "ckpt")

    def copy(name, source=model):
        shutil.copytree(source, root / name)
        w[name] = str(root / name)
        return root / name

    weights = (copy("trunc") / "model.safetensors")
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    garbage = copy("garbage") / "model.safetensors"
    garbage.write_bytes((64).to_bytes(8, "little") + b"\x00garbage{" * 40 + garbage.read_bytes()[400:])
    (copy("badjson") / "config.json").write_text('{"model_type": "llama", ')
    for name, value in (("retro_empty", {}), ("retro_null", None), ("retro_str", "avnorm")):
        config = copy(name) / "config.json"
        config.write_text(json.dumps({**json.loads(config.read_text()), "retrofit": value}))
    ckpt_trunc = copy("ckpt_trunc", root / "ckpt") / "model.safetensors"
    ckpt_trunc.write_bytes(ckpt_trunc.read_bytes()[:-100])
    (copy("ckpt_badjson", root / "ckpt") / "config.json").write_text("not json at all")
    (root / "nocfg").mkdir()
    (root / "nocfg" / "model.safetensors").write_bytes(b"")
    w["nocfg"] = str(root / "nocfg")
    unfinished = root / "unfinished"
    unfinished.mkdir()
    (unfinished / "recipe.yaml").write_text("name: x\n")
    (unfinished / "log.jsonl").write_text('{"step": 1, "loss": 3.0}\n')
    (unfinished / "checkpoints").mkdir()
    w["unfinished"] = str(unfinished)

    w["text"] = str(root / "text.txt")
    Path(w["text"]).write_text("the cat sat on a mat and the dog ran far. " * 60)
    w["latin1"] = str(root / "latin1.txt")
    Path(w["latin1"]).write_bytes("caf\u00e9 cr\u00e8me ".encode("latin-1") * 10)
    w["empty"] = str(root / "empty.txt")
    Path(w["empty"]).write_text("")
    (root / "folder").mkdir()
    (root / "folder" / "a.txt").write_text("text in a folder")
    w["folder"] = str(root / "folder")
    w["missing"] = str(root / "no-such-thing")
    w["notmodel"] = str(root / "notmodel.bin")
    Path(w["notmodel"]).write_bytes(b"\x00" * 64)
    w["afile"] = str(root / "afile")
    Path(w["afile"]).write_text("precious")
    w["link"] = str(root / "link")
    os.symlink(root / "folder", w["link"])
    if ROOT:
        w["unwritable"] = str(root / "afile" / "sub")
    else:
        (root / "ro").mkdir()
        os.chmod(root / "ro", 0o555)
        w["unwritable"] = str(root / "ro" / "out")

    recipe = {"name": "bad-inputs",
              "model": {"source": str(model)},
              "patch": {"norm": "avnorm"},
              "data": {"task": "lm", "files": [w["text"]], "seq_len": 16, "val_blocks": 1},
              "train": {"steps": 1, "batch_size": 2, "micro_batch_size": 2, "lr": 1e-3, "warmup_steps": 1,
                        "progress": False},
              "eval": {"batches": 1, "batch_size": 2},
              "output": {"save_every": 0}}
    w["recipe"] = str(root / "recipe.yaml")
    Path(w["recipe"]).write_text(yaml.safe_dump(recipe))
    w["bad_yaml"] = str(root / "bad.yaml")
    Path(w["bad_yaml"]).write_text("model: [unclosed\n  source: x\n")
    w["list_yaml"] = str(root / "list.yaml")
    Path(w["list_yaml"]).write_text("- a\n- b\n")
    build_round3_errors(root, w)
    build_damaged(root, w, model, root / "ckpt")
    build_bounds_inputs(root, w)
    build_issue51_inputs(root, w)
    # round 3 (load): a folder whose auto_map names its own code; a patched checkpoint missing a base weight
    planted = copy("planted") / "config.json"
    planted.write_text(json.dumps({**json.loads(planted.read_text()), "auto_map": {"AutoConfig": "x.Config"}}))
    from safetensors.torch import load_file, save_file
    nokey = copy("ckpt_nokey", root / "ckpt") / "model.safetensors"
    tensors = load_file(str(nokey))
    del tensors["model.layers.0.self_attn.o_proj.weight"]
    save_file(tensors, str(nokey), metadata={"format": "pt"})
    # round 3 (files): a checkpoint whose tokenizer_config.json is a link to a file outside it
    linked = copy("ckpt_link", root / "ckpt")
    (linked / "tokenizer_config.json").unlink()
    os.symlink(w["afile"], linked / "tokenizer_config.json")
    return w


def build_round3_errors(root: Path, w: dict) -> None:
    """Inputs of the round 3 (errors) cases: an alias bomb, a 1000-deep recipe, a model with 16 embedding rows,
    GGUF files cut short, finished runs whose recipe.yaml is a list or whose log.jsonl has a foreign line."""
    w["bomb"] = str(root / "bomb.yaml")  # 9 levels of 9 aliases: 9**9 values written out, ~550 bytes
    lines = ["train:", "  steps:", "    - &a0 [lol,lol,lol,lol,lol,lol,lol,lol,lol]"]
    Path(w["bomb"]).write_text("\n".join(lines + [f"    - &a{i} [{','.join([f'*a{i - 1}'] * 9)}]"
                                                  for i in range(1, 9)]) + "\n")
    w["deep"] = str(root / "deep.yaml")
    Path(w["deep"]).write_text("train:\n  steps: " + "[" * 1000 + "]" * 1000 + "\n")
    small = tiny_model("llama")
    small.resize_token_embeddings(16)
    small.save_pretrained(root / "small_vocab")
    w["small_vocab"] = str(root / "small_vocab")
    import struct
    w["gguf_cut"] = str(root / "cut.gguf")  # the magic, a version, then nothing: the header ends early
    Path(w["gguf_cut"]).write_bytes(b"GGUF" + struct.pack("<I", 3) + b"\x01\x00")
    for name in ("run_list_recipe", "run_bad_log"):
        run = root / name
        shutil.copytree(root / "ckpt", run)
        (run / "result.json").write_text(json.dumps({"steps": 1}))
        (run / "recipe.yaml").write_text("name: x\nmodel: {source: model}\n")
        (run / "log.jsonl").write_text('{"step": 1, "loss": 3.0}\n{"step": 1, "eval/loss@16": 3.1}\n')
        w[name] = str(run)
    (root / "run_list_recipe" / "recipe.yaml").write_text("- a\n- b\n")
    with open(root / "run_bad_log" / "log.jsonl", "a") as f:
        f.write('[1, 2]\n{"step": 2, "loss": 2.9}\n')


def build_damaged(root: Path, w: dict, model: Path, ckpt: Path) -> None:
    """Issue 36: plain folders with a weight missing, extra or misshapen; config.json values no model can have;
    config.retrofit sections of the wrong types; a checkpoint with a NaN patch tensor or a misshapen base weight."""
    import torch
    from safetensors.torch import load_file, save_file

    def damaged(name, source, change_config=None, change_weights=None):
        folder = root / name
        shutil.copytree(source, folder)
        if change_config is not None:
            config = json.loads((folder / "config.json").read_text())
            change_config(config)
            (folder / "config.json").write_text(json.dumps(config))
        if change_weights is not None:
            tensors = load_file(str(folder / "model.safetensors"))
            change_weights(tensors)
            save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
        w[name] = str(folder)

    o_proj = "model.layers.0.self_attn.o_proj.weight"
    damaged("plain_missing", model, change_weights=lambda t: t.pop(o_proj))
    damaged("plain_extra", model,
            change_weights=lambda t: t.update({"model.layers.7.mlp.up_proj.weight": t[o_proj].clone()}))
    damaged("plain_misshapen", model, change_weights=lambda t: t.update({o_proj: t[o_proj][:, :16].contiguous()}))
    damaged("ckpt_misshapen", ckpt, change_weights=lambda t: t.update({o_proj: t[o_proj][:, :16].contiguous()}))
    damaged("ckpt_nan", ckpt, change_weights=lambda t: t.update(
        {k: torch.full_like(v, float("nan")) for k, v in t.items() if ".retrofit." in k}))
    for name, key, value in (("cfg_heads_zero", "num_attention_heads", 0),
                             ("cfg_heads_not_dividing", "num_key_value_heads", 3),
                             ("cfg_vocab_negative", "vocab_size", -5), ("cfg_width_string", "hidden_size", "32"),
                             ("cfg_float128", "dtype", "float128"),
                             ("cfg_yarn_no_factor", "rope_parameters", {"rope_type": "yarn", "rope_theta": 1e4})):
        damaged(name, model, change_config=lambda c, k=key, v=value: c.update({k: v}))
    tiny_model("gpt2").save_pretrained(root / "gpt2")
    damaged("cfg_gpt2_positions", root / "gpt2", change_config=lambda c: c.update(n_positions=10**12))
    for name, change in (("retro_nope_string", {"nope": "false"}),
                         ("retro_kernel", {"base_attn_implementation": "org/kernel"}),
                         ("retro_option_string", {"options": {"kind": "rms", "gain": "2"}})):
        damaged(name, ckpt, change_config=lambda c, change=change: c["retrofit"].update(change))


def build_bounds_inputs(root: Path, w: dict) -> None:
    """Inputs of the issue 36 (bounds) cases: a FIFO, --variants files nested 3000 deep or built of aliases, a
    3000-deep --patch value, a model whose config claims a million layers, a GGUF claiming 2**62 tensors, a run
    whose log.jsonl is binary, a folder of the user's notes beside a copied retrofit results.json."""
    import struct
    w["fifo"] = str(root / "fifo.txt")
    os.mkfifo(w["fifo"])
    w["variants_deep"] = str(root / "variants-deep.yaml")
    Path(w["variants_deep"]).write_text("- {name: a, patch: " + "[" * 3000 + "]" * 3000 + "}\n")
    nine = lambda i: "[" + ",".join([f"*v{i - 1}"] * 9) + "]"  # noqa: E731
    Path(root / "variants-aliases.yaml").write_text(
        "- {name: a, patch: {norm: avnorm, kind: [&v0 [x,x,x,x,x,x,x,x,x], "
        + ", ".join(f"&v{i} {nine(i)}" for i in range(1, 7)) + "]}}\n")
    w["variants_aliases"] = str(root / "variants-aliases.yaml")
    w["deep_value"] = "[" * 3000 + "]" * 3000
    million = root / "million"
    shutil.copytree(w["model"], million)
    config = json.loads((million / "config.json").read_text())
    (million / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 1_000_000}))
    w["million"] = str(million)
    key, arch = b"general.architecture", b"llama"
    w["gguf_huge"] = str(root / "huge.gguf")
    Path(w["gguf_huge"]).write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 2 ** 62, 1) + struct.pack("<Q", len(key)) + key
                                     + struct.pack("<IQ", 8, len(arch)) + arch + b"\x00" * 64)
    run = root / "run_binary_log"
    shutil.copytree(root / "run_bad_log", run)
    (run / "log.jsonl").write_bytes(b'{"step": 1, "loss": 3.0}\n\x00\xff\xfe binary\n')
    w["run_binary_log"] = str(run)
    notes = root / "notes"
    notes.mkdir()
    (notes / "results.json").write_text(json.dumps({"schema": "retrofit.eval/1", "models": []}))
    (notes / "my-notes.md").write_text("my own notes beside a copied results file\n")
    w["notes"] = str(notes)
    w["json_deep"] = str(root / "deep-tokens.json")
    Path(w["json_deep"]).write_text("[" * 100_000 + "]" * 100_000)


def build_issue51_inputs(root: Path, w: dict) -> None:
    """Inputs of the issue 51 cases: files of the wrong type or with 5,000-digit numbers in run and results folders,
    a run whose recipe.yaml has a string for an int, an adapter whose config is a list, a folder whose marker is a
    link into the user's file."""
    def folder(name, files, source=None):
        path = root / name
        shutil.copytree(source, path) if source else path.mkdir()
        for file, text in files.items():
            (path / file).write_text(text)
        w[name] = str(path)

    digits = "1" * 5000
    folder("results_list", {"results.json": "[1, 2]\n", ".retrofit-owned": "made by retrofit\n"})
    folder("results_digits", {"results.json": '{"schema": "retrofit.eval/2", "train_len": ' + digits + "}\n",
                              ".retrofit-owned": "made by retrofit\n"})
    run = {"result.json": json.dumps({"steps": 1}), "recipe.yaml": "name: x\nmodel: {source: model}\n",
           "log.jsonl": '{"step": 1, "loss": 3.0}\n'}
    folder("run_result_list", {**run, "result.json": "[1]\n"}, root / "ckpt")
    folder("run_result_digits", {**run, "result.json": '{"steps": ' + digits + "}\n"}, root / "ckpt")
    folder("run_model_list", {**run, "recipe.yaml": "name: x\nmodel: [1, 2]\n"}, root / "ckpt")
    from tests.cli.test_output_folders import counting_run  # a finished tiny counting run (two steps)
    counting, _ = counting_run(root, "counting_run")
    recipe = yaml.safe_load((counting / "recipe.yaml").read_text())
    recipe["data"]["counting"] = {"alphabet": "many"}
    folder("run_str_alphabet", {"recipe.yaml": yaml.safe_dump(recipe)}, counting)
    folder("adapter_list", {"adapter_config.json": "[1]\n"})
    folder("marker_link", {"notes.md": "my notes\n"})
    os.symlink(w["afile"], root / "marker_link" / ".retrofit-owned")
    build_planted_run(root, w)


def build_planted_run(root: Path, w: dict) -> None:
    """An unfinished run (two steps, a checkpoint after the first, result.json gone) whose checkpoint's RNG file is
    a pickle that would write W/ran if unpickled, its manifest signed again as whoever planted it would."""
    import torch

    from retrofit.recipe import recipe_from_dict
    from retrofit.train import resume_state, train
    from tests.train.test_resume_state import Canary

    run = root / "run_planted"
    raw = yaml.safe_load(Path(w["recipe"]).read_text())
    raw["train"]["steps"], raw["output"] = 2, {"dir": str(run), "save_every": 1}
    train(recipe_from_dict(raw))
    (run / "result.json").unlink()
    step = sorted((run / resume_state.FOLDER).glob("step-*"))[-1]  # the one a resume reads (the run's last step)
    torch.save(Canary(root / "ran"), step / "random_states_0.pkl")
    resume_state.write_manifest(step)
    w["run_planted"] = str(run)


# (id, argv with {placeholders} (a string, or a list of arguments), regex the one line must match). {out} is a fresh
# path that must not exist after.
CASES = [
    # ---- patch: models
    ("patch-missing", "patch {missing} --norm avnorm", r"no such file or folder: .*no-such-thing"),
    ("patch-a-file", "patch {notmodel} --norm avnorm", r"notmodel.bin is a file, not a model folder"),
    ("patch-no-config", "patch {nocfg} --norm avnorm", r"folder without config.json"),
    ("patch-truncated", "patch {trunc} --norm avnorm --out {out}", r"trunc/model.safetensors is damaged .*truncated"),
    ("patch-garbage-header", "patch {garbage} --norm avnorm --out {out}", r"garbage/model.safetensors is damaged"),
    ("patch-config-not-json", "patch {badjson} --norm avnorm --out {out}", r"badjson/config.json is not valid JSON"),
    ("patch-retrofit-empty", "patch {retro_empty} --norm avnorm --out {out}", r"malformed 'retrofit' section"),
    ("patch-retrofit-null", "patch {retro_null} --norm avnorm --out {out}", r"malformed 'retrofit' section"),
    ("patch-retrofit-string", "patch {retro_str} --norm avnorm --out {out}", r"malformed 'retrofit' section"),
    ("patch-ckpt-truncated", "patch {ckpt_trunc} --norm avnorm --out {out}", r"ckpt_trunc/model.safetensors is dam"),
    ("patch-unfinished-run", "patch {unfinished} --norm avnorm --out {out}", r"unfinished training run.*--resume"),
    # ---- patch: options, texts, outputs
    ("patch-unknown-norm", "patch {model} --norm avnrm", r"did you mean 'avnorm'"),
    ("patch-bad-option", "patch {model} --norm psoftmax --p 0.5", r"p must be a finite number >= 1"),
    ("patch-option-of-other-norm", "patch {model} --norm psoftmax --kind rms", r"has no option 'kind'"),
    ("patch-unknown-flag", "patch {model} --norm avnorm --bogus", r"unrecognized arguments: --bogus"),
    ("patch-bad-dtype", "patch {model} --norm avnorm --dtype float8 --out {out}", r"unknown dtype 'float8'"),
    ("patch-calibrate-tokens-negative",
     "patch {model} --norm avnorm --calibration-text {text} --calibrate-tokens -5",
     r"--calibrate-tokens must be >= 1, got -5"),
    ("patch-check-tokens-zero", "patch {model} --norm avnorm --check-text {text} --check-tokens 0",
     r"--check-tokens must be >= 1, got 0"),
    ("patch-calibrate-not-utf8", "patch {model} --norm avnorm --calibration-text {latin1} --out {out}",
     r"--calibration-text .*latin1.txt is not UTF-8 text \(byte 3 is 0xe9\); convert it"),
    ("patch-check-text-not-utf8", "patch {model} --norm avnorm --check-text {latin1}",
     r"--check-text .*latin1.txt is not UTF-8"),
    ("patch-calibrate-folder", "patch {model} --norm avnorm --calibration-text {folder}",
     r"folder is a folder; give a text"),
    ("patch-calibrate-missing", "patch {model} --norm avnorm --calibration-text {missing}",
     r"no-such-thing: no such file"),
    ("patch-calibrate-empty", "patch {model} --norm avnorm --calibration-text {empty}", r"empty.txt is empty"),
    ("patch-calibrate-not-avnorm", "patch {model} --norm psoftmax --calibration-text {text}",
     r"needs a norm that has them: avnorm, or psoftmax with gain=1"),
    ("patch-out-is-a-file", "patch {model} --norm avnorm --out {afile}", r"--out .*afile is a file, not a folder"),
    ("patch-out-unwritable", "patch {model} --norm avnorm --out {unwritable}", r"--out .*(not writable|is a file)"),
    ("patch-out-symlink", "patch {model} --norm avnorm --out {link}", r"--out .*link is a symbolic link"),
    ("patch-out-not-empty", "patch {model} --norm avnorm --out {folder}", r"exists and is not empty"),
    # ---- norms
    ("norms-unknown-flag", "norms --bogus", r"unrecognized arguments: --bogus"),
    # ---- train: recipes, overrides, data, outputs, memory
    ("train-no-recipe", "train", r"name a recipe"),
    ("train-missing-recipe", "train {missing}.yaml --out {out}", r"no such recipe file: .*no-such-thing.yaml"),
    ("train-bad-yaml", "train {bad_yaml} --out {out}", r"bad.yaml is not valid YAML at line 2"),
    ("train-yaml-not-a-mapping", "train {list_yaml} --out {out}", r"list.yaml: a recipe must be a YAML mapping"),
    ("train-unknown-key", "train {recipe} train.lrr=1 --out {out}", r"train.*lrr.*did you mean 'lr'"),
    ("train-bad-type", "train {recipe} train.steps=many --out {out}", r"train.steps must be an integer, got 'many'"),
    ("train-lr-inf", "train {recipe} train.lr=.inf --out {out}", r"train.lr must be >= 0 and finite, got inf"),
    ("train-lr-negative", "train {recipe} train.lr=-1 --out {out}", r"train.lr must be >= 0 and finite, got -1"),
    ("train-unknown-section", "train {recipe} trian.lr=1 --out {out}",
     r"unknown recipe section 'trian' \(did you mean 'train'\?\)"),
    ("train-data-folder", "train {recipe} data.files=[{folder}] --out {out}", r"data.files: .*folder is a folder"),
    ("train-data-not-utf8", "train {recipe} data.files=[{latin1}] --out {out}",
     r"data.files .*latin1.txt is not UTF-8"),
    ("train-data-empty", "train {recipe} data.files=[{empty}] --out {out}", r"data.files: .*empty.txt is empty"),
    ("train-data-missing", "train {recipe} data.files=[{missing}.txt] --out {out}", r"data.files: no such file"),
    ("train-book-missing", "train {recipe} data.files=[{root}/data/books/emma.txt] --out {out}",
     r"data.files: no such file: .*/data/books/emma.txt; the recipes' books .*docs/training.md, 'The books'"),
    ("train-data-unknown-type", "train {recipe} data.files=[{notmodel}] --out {out}", r"cannot read .bin files"),
    ("train-seq-len-huge", "train {recipe} data.seq_len=2000000000 --out {out}",
     r"data.seq_len 2,000,000,000 .* GiB .*lower data.seq_len or train.micro_batch_size"),
    ("train-seq-len-2e9", "train {recipe} data.seq_len=2e9 --out {out}", r"data.seq_len must be an integer, got '2e9'"),
    ("train-model-truncated", "train {recipe} model.source={trunc} --out {out}", r"trunc/model.safetensors is dam"),
    ("train-model-unfinished", "train {recipe} model.source={unfinished} --out {out}", r"unfinished training run"),
    ("train-model-retrofit-string", "train {recipe} model.source={retro_str} --out {out}", r"malformed 'retrofit'"),
    ("train-out-is-a-file", "train {recipe} --out {afile}", r"--out .*afile is a file"),
    ("train-out-unwritable", "train {recipe} --out {unwritable}", r"--out .*(not writable|is a file)"),
    ("train-out-symlink", "train {recipe} --out {link}", r"symbolic link"),
    ("train-out-and-resume", "train {recipe} --out {out} --resume {out}", r"either --out or --resume"),
    # ---- eval
    ("eval-missing", "eval {missing} --data {text} --out {out}", r"no such file or folder"),
    ("eval-truncated", "eval {trunc} --data {text} --lengths 8 --out {out}", r"trunc/model.safetensors is damaged"),
    ("eval-garbage", "eval {garbage} --data {text} --lengths 8 --out {out}", r"garbage/model.safetensors is damaged"),
    ("eval-config-not-json", "eval {badjson} --data {text} --lengths 8 --out {out}", r"config.json is not valid JSON"),
    ("eval-retrofit-null", "eval {retro_null} --data {text} --lengths 8 --out {out}", r"malformed 'retrofit'"),
    ("eval-unfinished-run", "eval {unfinished} --data {text} --lengths 8 --out {out}",
     r"unfinished.*retrofit train .*recipe.yaml --resume"),
    ("eval-data-not-utf8", "eval {model} --data {latin1} --lengths 8 --out {out}", r"--data .*latin1.txt is not UTF-8"),
    ("eval-data-folder", "eval {model} --data {folder} --lengths 8 --out {out}", r"--data .*folder is a folder"),
    ("eval-data-empty", "eval {model} --data {empty} --lengths 8 --out {out}", r"--data .*empty.txt is empty"),
    ("eval-data-missing", "eval {model} --data {missing} --lengths 8 --out {out}", r"no such file"),
    ("eval-trials-zero", "eval {model} --data {text} --trials 0 --out {out}", r"--trials must be >= 1, got 0"),
    ("eval-batch-tokens-zero", "eval {model} --data {text} --batch-tokens 0 --out {out}", r"--batch-tokens must be"),
    ("eval-max-tokens-negative", "eval {model} --data {text} --max-tokens -1 --out {out}", r"--max-tokens must be"),
    ("eval-chunk-tokens-zero", "eval {model} --data {text} --chunk-tokens 0 --out {out}", r"--chunk-tokens must be"),
    ("eval-bad-lengths", "eval {model} --data {text} --lengths 8,x --out {out}", r"--lengths"),
    ("eval-bad-depths", "eval {model} --data {text} --depths a,b --lengths 8 --out {out}", r"--depths"),
    ("eval-length-huge", "eval {model} --data {text} --lengths 2000000000 --out {out}",
     r"at length 2,000,000,000: .* GiB .*lower --lengths or --batch-tokens"),
    ("eval-out-is-a-file", "eval {model} --data {text} --lengths 8 --out {afile}", r"--out .*afile is a file"),
    ("eval-out-unwritable", "eval {model} --data {text} --lengths 8 --out {unwritable}", r"not writable|is a file"),
    # ---- experiment and demo
    ("experiment-missing-recipe", "experiment {missing}.yaml --out {out}", r"no such recipe file"),
    ("experiment-no-section", "experiment {recipe} --out {out}", r"no experiment section"),
    ("experiment-arm-dotdot",
     "demo experiment.arms=[{{\"name\":\"..\",\"patch\":{{\"norm\":\"softmax\"}}}}] --out {out}",
     r"arm name '..'"),
    ("demo-lr-inf", "demo train.lr=.inf --out {out}", r"train.lr must be >= 0 and finite, got inf"),
    ("demo-unknown-key", "demo experiment.finetune_stepz=3 --out {out}",
     r"experiment.finetune_stepz \(did you mean 'finetune_steps'\?\)"),
    ("demo-seq-len-huge", "demo data.seq_len=2000000000 --out {out}", r"GiB .*lower data.seq_len"),
    ("demo-out-is-a-file", "demo --out {afile}", r"--out .*afile is a file"),
    ("demo-out-symlink", "demo --out {link}", r"symbolic link"),
    # ---- diagnose
    ("diagnose-missing", "diagnose {missing} --data {text} --out {out}", r"no such file or folder"),
    ("diagnose-truncated", "diagnose {trunc} --data {text} --lengths 8,16 --out {out}", r"safetensors is damaged"),
    ("diagnose-unfinished", "diagnose {unfinished} --data {text} --lengths 8,16 --out {out}", r"unfinished"),
    ("diagnose-data-not-utf8", "diagnose {model} --data {latin1} --out {out}", r"--data .*latin1.txt is not UTF-8"),
    ("diagnose-data-folder", "diagnose {model} --data {folder} --out {out}", r"--data .*folder is a folder"),
    ("diagnose-data-empty", "diagnose {model} --data {empty} --out {out}", r"--data .*empty.txt is empty"),
    ("diagnose-windows-zero", "diagnose {model} --data {text} --windows 0 --out {out}", r"--windows must be >= 1"),
    ("diagnose-calibrate-negative", "diagnose {model} --data {text} --calibrate-tokens -5 --out {out}",
     r"--calibrate-tokens must be >= 0, got -5"),
    ("diagnose-unknown-patch", "diagnose {model} --data {text} --lengths 8,16 --patch avnrm --out {out}", r"avnrm"),
    ("diagnose-out-is-a-file", "diagnose {model} --data {text} --out {afile}", r"--out .*afile is a file"),
    # ---- push (dry runs: nothing is uploaded)
    ("push-missing", "push {missing} --repo me/x --dry-run {out}", r"no-such-thing"),
    ("push-plain-model", "push {model} --repo me/x --dry-run {out}", r"not a retrofit checkpoint"),
    ("push-unfinished-run", "push {unfinished} --repo me/x --dry-run {out}", r"unfinished training run"),
    ("push-ckpt-truncated", "push {ckpt_trunc} --repo me/x --dry-run {out}", r"ckpt_trunc/model.safetensors is dam"),
    ("push-config-not-json", "push {ckpt_badjson} --repo me/x --dry-run {out}", r"config.json is not valid JSON"),
    ("push-bad-repo", "push {ckpt} --repo not/a/repo --dry-run {out}", r"--repo must be a Hub repository id"),
    ("push-dry-run-is-a-file", "push {ckpt} --repo me/x --dry-run {afile}", r"--dry-run .*afile is a file"),
    ("push-dry-run-unwritable", "push {ckpt} --repo me/x --dry-run {unwritable}", r"not writable|is a file"),
    # ---- bench
    ("bench-unknown", "bench nosuch", r"unknown benchmark 'nosuch'"),
    ("bench-heads-zero", "bench attention --heads 0 --out {out}/b.json", r"--heads must be >= 1, got 0"),
    ("bench-unknown-flag", "bench attention --bogus", r"unrecognized arguments: --bogus"),
    ("bench-out-is-a-folder", "bench attention --seq 8 --out {folder}", r"--out .*folder is a folder"),
    ("bench-eval-length-zero", "bench eval --length 0 --out {out}/b.json", r"--length must be >= 1"),
    # round 3 (bench decode, bench gpu)
    ("bench-decode-missing-model", "bench decode {missing} --out {out}/d.json", r"no-such-thing"),
    ("bench-decode-unknown-norm", "bench decode {model} --norms avnorm,nosuch --out {out}/d.json",
     r"unknown --norms \['nosuch'\]: choose from"),
    ("bench-decode-prompt-too-long", "bench decode {model} --prompt-tokens 100 --out {out}/d.json",
     r"--prompt-tokens 100 \+ --new-tokens 64 exceeds the model's 64 positions"),
    ("bench-decode-new-tokens-zero", "bench decode {model} --new-tokens 0 --out {out}/d.json",
     r"--new-tokens must be >= 1, got 0"),
    ("bench-decode-out-is-a-link", "bench decode {model} --out {link}", r"--out .*link is a symbolic link"),
    ("bench-gpu-cpu-without-tiny", "bench gpu --device cpu --out {out}", r"--device cpu runs only with --tiny"),
    ("bench-gpu-out-not-empty", "bench gpu --device cpu --tiny --out {folder}", r"--out .*folder exists and is not "
     r"empty"),
    ("bench-gpu-unknown-part", "bench gpu --device cpu --tiny --parts parity,nope --out {out}",
     r"unknown --parts \['nope'\]: choose from parity, attention, finetune"),
    ("bench-gpu-missing-model", "bench gpu --device cpu --tiny --model {missing} --out {out}", r"no-such-thing"),
    # round 3 (errors)
    ("train-yaml-alias-bomb", "train {bomb} --out {out}",
     r"bomb.yaml expands to more than 100,000 values through its aliases \(\*name\) \(line \d+\); a recipe is"),
    ("train-yaml-nested-1000", "train {deep} --out {out}", r"deep.yaml nests deeper than 32 levels \(line 2\)"),
    ("train-adam-eps-negative", "train {recipe} train.adam_eps=-1 --out {out}",
     r"train.adam_eps must be > 0 and finite .*got -1.0$"),
    ("train-adam-eps-nan", "train {recipe} train.adam_eps=.nan --out {out}", r"train.adam_eps must be > 0 .*got nan$"),
    ("train-seed-negative", "train {recipe} train.seed=-1 --out {out}", r"train.seed must be in 0..2\*\*32-1 .*-1$"),
    ("train-val-blocks-zero", "train {recipe} data.val_blocks=0 --out {out}", r"data.val_blocks must be >= 1 .*got 0$"),
    ("train-config-size-not-a-number",
     "train {recipe} model.source=null model.config.model_type=llama model.config.hidden_size=abc --out {out}",
     r"model.config is not a valid llama config \(.*'hidden_size' expected int, got str .*'abc'.*\); fix that value"),
    ("train-config-size-negative",
     "train {recipe} model.source=null model.config.model_type=llama model.config.hidden_size=-64 --out {out}",
     r"model.config.hidden_size must be >= 1, got -64$"),
    ("eval-tokenizer-beyond-vocab", "eval {small_vocab} --data {text} --tokenizer {model} --lengths 8 --out {out}",
     r"the evaluation data has token ids up to \d+ but small_vocab has 16 embedding rows \(vocab_size\)"),
    ("patch-gguf-header-cut", "patch {gguf_cut} --norm avnorm --out {out}",
     r"cut.gguf is damaged: its GGUF header ends early \(.*\); re-download or convert it again$"),
    ("eval-gguf-header-cut", "eval {gguf_cut} --data {text} --tokenizer {model} --lengths 8 --out {out}",
     r"cut.gguf is damaged: its GGUF header ends early"),
    ("push-recipe-a-list", "push {run_list_recipe} --repo me/x --dry-run {out}",
     r"run_list_recipe/recipe.yaml is not a recipe \(a YAML mapping of sections\), it holds \['a', 'b'\]"),
    ("push-log-malformed-line", "push {run_bad_log} --repo me/x --dry-run {out}",
     r"run_bad_log/log.jsonl line 3 is not a training log record \('\[1, 2\]'\); remove that line"),
    # round 3 (load)
    ("patch-auto-map", "patch {planted} --norm avnorm --out {out}",
     r"planted: config.json has an auto_map \(custom code\); retrofit never runs a model folder's code"),
    ("eval-auto-map", "eval {planted} --data {text} --lengths 8 --out {out}", r"planted: config.json has an auto_map"),
    ("eval-tokenizer-auto-map", "eval {model} --tokenizer {planted} --data {text} --lengths 8 --out {out}",
     r"planted: config.json has an auto_map"),
    ("eval-ckpt-missing-weight", "eval {ckpt_nokey} --data {text} --lengths 8 --out {out}",
     r"ckpt_nokey is damaged or was saved from another model: weights missing "
     r"model.layers.0.self_attn.o_proj.weight; save the model again"),
    ("train-dtype-unknown", "train {recipe} model.dtype=float8 --out {out}",
     r"model.dtype must be one of auto, float32, bfloat16, float16, got 'float8'"),
    ("patch-dtype-unknown", "patch {model} --norm avnorm --dtype fp8 --out {out}",
     r"unknown dtype 'fp8'; use auto \(the saved dtype\) or one of float32"),
    # round 3 (files): a folder of the user's own files ({folder} holds a.txt) or / is never written into
    ("train-out-users-folder", "train {recipe} --out {folder}",
     r"^retrofit train: error: --out .*/folder holds files retrofit did not write \(it has no .retrofit-owned\)"),
    ("train-output-dir-root", "train {recipe} output.dir=/", r"output.dir / holds files retrofit did not write"),
    ("train-resume-users-folder", "train {recipe} --resume {folder}", r"--resume .*/folder holds files retrofit did"),
    ("demo-out-users-folder", "demo --out {folder}", r"--out .*/folder holds files retrofit did not write"),
    ("demo-out-root", "demo --out /", r"--out / holds files retrofit did not write"),
    ("eval-out-users-folder", "eval {model} --data {text} --lengths 8 --out {folder}", r"--out .*/folder holds files"),
    ("diagnose-out-users-folder", "diagnose {model} --data {text} --lengths 8,16 --out {folder}",
     r"--out .*/folder holds files retrofit did not write"),
    ("push-dry-run-users-folder", "push {ckpt} --repo me/x --dry-run {folder}", r"--dry-run .*/folder exists and is "
                                                                                 r"not empty"),
    ("push-link-in-checkpoint", "push {ckpt_link} --repo me/x --dry-run {out}",
     r"tokenizer_config.json in .*/ckpt_link is a symbolic link; push never publishes what a link points to"),
    # round 3 (house): --calibrate is --calibration-text's old name, still read and checked under the new one
    ("patch-calibrate-old-name", "patch {model} --norm avnorm --calibrate {missing}",
     r"--calibration-text .*no-such-thing: no such file"),
    # round 4 (intervals): the paired-differences reference must name one of the evaluated models
    ("eval-reference-unknown",
     "eval {model} {model} --names a,b --reference nope --data {text} --lengths 8 --out {out}",
     r"^retrofit eval: error: --reference nope is not one of the models: a, b$"),
    # round 4 (ruler): an unknown task, a depth outside [0, 1], a haystack shorter than the length, export misuse
    ("eval-unknown-task", "eval {model} --tasks niah,needles --lengths 1024 --out {out}",
     r"^retrofit eval: error: unknown tasks \['needles'\]: choose from lm, passkey, counting, niah, .*--list-tasks"),
    ("eval-depth-above-one", "eval {model} --tasks niah --depths 0,1.5 --lengths 1024 --out {out}",
     r"--depths '0,1.5': 1.5 is outside \[0, 1\]; give depths between 0 \(start\) and 1 \(end\)"),
    ("eval-depth-negative", "eval {model} --tasks niah --depths -0.25 --lengths 1024 --out {out}",
     r"--depths '-0.25': -0.25 is outside \[0, 1\]"),
    ("eval-haystack-too-short", "eval {model} --tasks niah --data {text} --lengths 8192 --out {out}",
     r"the --data text is too short for the asked length: \d+ tokens, \d+ needed for the haystack; give more text"),
    ("eval-ruler-length-too-short", "eval {model} --tasks niah_multiquery --lengths 256 --out {out}",
     r"niah_multiquery length 256 is too short: the question and needles take \d+ tokens"),
    ("eval-export-no-tokenizer", "eval --export-harness {out} --tasks niah --lengths 1024",
     r"--export-harness needs --tokenizer PATH"),
    ("eval-export-not-ruler", "eval --export-harness {out} --tasks lm --lengths 1024 --tokenizer {model}",
     r"--export-harness: 'lm' is not a RULER task; choose from niah, "),
    ("eval-export-users-folder", "eval --export-harness {folder} --tasks niah --lengths 1024 --tokenizer {model}",
     r"--export-harness .*/folder holds files retrofit did not write"),
    ("eval-no-model", "eval --tasks niah --lengths 1024 --out {out}", r"retrofit eval needs at least one model"),
    # round 4 (beyond): avnorm mode=beyond, floor endpoints above 0, the loss-shaped schedule
    ("patch-avnorm-beyond-kind-layer", "patch {model} --norm avnorm --mode beyond --kind layer --out {out}",
     r"avnorm mode=beyond rescales each head's output by length and has no kind=layer \(drop kind, or use "
     r"mode=always\)$"),
    ("patch-avnorm-beyond-floor", "patch {model} --norm avnorm --mode beyond --floor 2 --out {out}",
     r"avnorm mode=beyond takes no floor, affine or gain"),
    ("patch-avnorm-mode-typo", "patch {model} --norm avnorm --mode beyon --out {out}",
     r"avnorm mode must be one of always, beyond, got 'beyon' \(did you mean 'beyond'\?\)"),
    ("patch-avnorm-exponent-without-beyond", "patch {model} --norm avnorm --exponent 0.5 --out {out}",
     r"avnorm exponent and ref_len apply to mode=beyond only \(add mode=beyond\)$"),
    ("train-schedule-end-floor-negative", "train {recipe} recovery.schedule.steps=1 recovery.schedule.end=-1 "
                                          "--out {out}",
     r"recovery.schedule.end -1: avnorm floor must be >= 0 \(0 = AVNorm, inf = the original model\), got -1.0$"),
    ("train-schedule-loss-one-cost", "train {recipe} recovery.schedule.steps=1 recovery.schedule.shape=loss "
                                     "recovery.schedule.costs=[4.1] --out {out}",
     r"recovery.schedule.shape loss needs costs: at least 2 zero-shot probe losses"),
    ("train-schedule-beyond-no-floor", "train {recipe} patch.mode=beyond recovery.schedule.steps=1 --out {out}",
     r"recovery.schedule.start 8: avnorm mode=beyond takes no floor"),
    # round 4 (selective): --layers / --heads (the tiny model has 2 layers of 4 heads)
    ("patch-layers-out-of-range", "patch {model} --norm avnorm --layers 1-5 --out {out}",
     r"--layers: index 2 is out of range; this model has 2 layers \(0-1\)$"),
    ("patch-heads-out-of-range", "patch {model} --norm ssmax --heads 0,4 --out {out}",
     r"--heads: index 4 is out of range; this model has 4 heads \(0-3\)$"),
    ("patch-heads-not-per-head", "patch {model} --norm psoftmax --heads 0 --out {out}",
     r"--heads: psoftmax has no per-head parameters; --heads applies to avnorm, softmax1, ssmax$"),
    ("patch-layers-empty", "patch {model} --norm avnorm --layers , --out {out}",
     r"--layers: the selection ',' is empty; select at least one: N, A-B, A-, A-B:STEP or :STEP"),
    ("patch-layers-malformed", "patch {model} --norm avnorm --layers 1..3 --out {out}",
     r"--layers: cannot read '1..3'; write N, A-B, A-, A-B:STEP or :STEP, joined by ',' or '\+'"),
    ("patch-layers-backwards", "patch {model} --norm avnorm --layers 3-1 --out {out}",
     r"--layers: '3-1' is an empty range \(write A-B with A <= B, a step >= 1\)$"),
    ("train-patch-layers-malformed", "train {recipe} patch.layers=1..3 --out {out}",
     r"patch.layers: cannot read '1..3'; write N, A-B"),
    ("train-patch-heads-not-per-head", "train {recipe} patch.norm=psoftmax patch.heads=0 --out {out}",
     r"patch.heads: psoftmax has no per-head parameters; patch.heads applies to avnorm, softmax1, ssmax$"),
    # round 4 (posts): `retrofit tokenizer train`
    ("tokenizer-vocab-too-small", "tokenizer train --data {text} --vocab-size 100 --out {out}",
     r"^retrofit tokenizer: error: --vocab-size must be >= 257 \(256 bytes \+ <\|endoftext\|>\), got 100$"),
    ("tokenizer-vocab-zero", "tokenizer train --data {text} --vocab-size 0 --out {out}",
     r"--vocab-size must be >= 257 \(256 bytes \+ <\|endoftext\|>\), got 0$"),
    ("tokenizer-data-missing", "tokenizer train --data {missing} --out {out}", r"--data .*no-such-thing"),
    ("tokenizer-out-users-folder", "tokenizer train --data {text} --out {folder}",
     r"--out .*/folder exists and is not empty; choose another --out or remove it"),
    # issue 36 (guard): a plain folder is checked like a checkpoint; config.json and config.retrofit with types
    ("patch-plain-missing-weight", "patch {plain_missing} --norm avnorm --out {out}",
     r"plain_missing is damaged or was saved from another model: weights missing model.layers.0.self_attn.o_proj"),
    ("patch-plain-extra-weight", "patch {plain_extra} --norm avnorm --out {out}",
     r"plain_extra is damaged .*: weights unexpected model.layers.7.mlp.up_proj.weight; save the model again"),
    ("patch-plain-misshapen-weight", "patch {plain_misshapen} --norm avnorm --out {out}",
     r"plain_misshapen is damaged .*: weights of the wrong shape model.layers.0.self_attn.o_proj.weight"),
    ("eval-ckpt-misshapen-weight", "eval {ckpt_misshapen} --data {text} --lengths 8 --out {out}",
     r"ckpt_misshapen is damaged .*: weights of the wrong shape model.layers.0.self_attn.o_proj.weight"),
    ("eval-ckpt-nan-gain", "eval {ckpt_nan} --data {text} --lengths 8 --out {out}",
     r"ckpt_nan: patch tensor model.layers.0.self_attn.retrofit.gain holds NaN or infinite values"),
    ("patch-config-zero-heads", "patch {cfg_heads_zero} --norm avnorm --out {out}",
     r"cfg_heads_zero/config.json: num_attention_heads must be an integer in 1..16,777,216, got 0$"),
    ("patch-config-kv-heads-not-dividing", "patch {cfg_heads_not_dividing} --norm avnorm --out {out}",
     r"cfg_heads_not_dividing/config.json: num_key_value_heads \(3\) must divide num_attention_heads \(4\)$"),
    ("patch-config-negative-vocab", "patch {cfg_vocab_negative} --norm avnorm --out {out}",
     r"cfg_vocab_negative/config.json: vocab_size must be an integer in 1..16,777,216, got -5$"),
    ("patch-config-string-width", "patch {cfg_width_string} --norm avnorm --out {out}",
     r"cfg_width_string/config.json: hidden_size must be an integer in 1..16,777,216, got '32'$"),
    ("patch-config-float128", "patch {cfg_float128} --norm avnorm --out {out}",
     r"cfg_float128/config.json: dtype must be a torch floating-point type .*got 'float128'$"),
    ("patch-config-yarn-no-factor", "patch {cfg_yarn_no_factor} --norm avnorm --out {out}",
     r"cfg_yarn_no_factor/config.json is not a valid config \(.*rope_parameters.*yarn.*factor.*\); fix that value$"),
    ("patch-config-gpt2-positions-1e12", "patch {cfg_gpt2_positions} --norm avnorm --out {out}",
     r"cfg_gpt2_positions/config.json: n_positions must be an integer in 1..16,777,216, got 1000000000000$"),
    ("eval-retrofit-nope-string", "eval {retro_nope_string} --data {text} --lengths 8 --out {out}",
     r"retro_nope_string/config.json: retrofit.nope must be true or false \(a JSON boolean, not a string\), got "
     r"'false'$"),
    ("eval-retrofit-hub-kernel", "eval {retro_kernel} --data {text} --lengths 8 --out {out}",
     r"retro_kernel/config.json: retrofit.base_attn_implementation must be one of sdpa, eager, .*got 'org/kernel'$"),
    ("patch-retrofit-option-string", "patch {retro_option_string} --norm psoftmax --out {out}",
     r"retro_option_string/config.json: retrofit.options.gain must be a number, got '2'$"),
    # issue 36 (bounds): every size is checked before anything is allocated (SIZE_CASES also measure memory)
    ("eval-lengths-range-huge", "eval {model} --data {text} --lengths 2,3,...,100000000 --out {out}",
     r"^retrofit eval: error: --lengths '2,3,...,100000000': the number of lengths 99,999,999 is outside 1..256 "),
    ("eval-export-length-huge", "eval --export-harness {out} --tasks niah --lengths 1000000000 --tokenizer {model}",
     r"--export-harness length 1,000,000,000 is outside 1..16,777,216"),
    ("eval-samples-huge", "eval {model} --tasks niah --lengths 1024 --samples 1000000000 --out {out}",
     r"--samples 1,000,000,000 is outside 1..100,000 \(every sample's prediction is kept in results.json\)$"),
    ("eval-export-samples-huge",
     "eval --export-harness {out} --tasks niah --lengths 1024 --samples 1000000000 --tokenizer {model}",
     r"--samples 1,000,000,000 is outside 1..100,000"),
    ("eval-trials-huge", "eval {model} --tasks passkey --lengths 64 --trials 1000000000000000000000 --out {out}",
     r"--trials 1,000,000,000,000,000,000,000 is outside 1..100,000"),
    ("eval-max-windows-huge", "eval {model} --data {text} --lengths 8 --max-windows 10000000000 --out {out}",
     r"--max-windows 10,000,000,000 is outside 1..100,000"),
    ("eval-depths-many", "eval {model} --tasks niah --data {text} --lengths 64 --depths " + ",".join(["0.5"] * 5000)
     + " --out {out}", r"the number of depths 5,000 is outside 1..101"),
    ("diagnose-windows-huge", "diagnose {model} --data {text} --lengths 8 --windows 10000000000 --out {out}",
     r"--windows 10,000,000,000 is outside 1..100,000"),
    ("diagnose-queries-huge", "diagnose {model} --data {text} --lengths 8 --queries 10000000000 --out {out}",
     r"--queries 10,000,000,000 is outside 1..65,536"),
    ("eval-rope-1e308", "eval {model} --data {text} --lengths 8 --rope yarn:1e308 --out {out}",
     r"rope factor 1e\+308 is outside 1..1,024"),
    ("patch-rope-1e308", "patch {model} --norm avnorm --rope yarn:1e308 --out {out}",
     r"rope factor 1e\+308 is outside"),
    ("tokenizer-vocab-2-64", "tokenizer train --data {text} --vocab-size 18446744073709551616 --out {out}",
     r"--vocab-size 18,446,744,073,709,551,616 is outside 257..1,048,576"),
    ("eval-variants-deep", "eval {model} --data {text} --lengths 8 --variants {variants_deep} --out {out}",
     r"--variants .*variants-deep.yaml nests deeper than 32 levels \(line 1\)"),
    ("eval-variants-aliases", "eval {model} --data {text} --lengths 8 --variants {variants_aliases} --out {out}",
     r"--variants .*variants-aliases.yaml expands to more than 100,000 values through its aliases"),
    ("diagnose-patch-deep",
     "diagnose {model} --data {text} --lengths 8,16 --patch avnorm:kind={deep_value} --out {out}",
     r"--patch 'avnorm:kind=\[\[\[.*: kind='\[\[\[.* is not a value: a value is a number or a word"),
    ("patch-million-layers", "patch {million} --norm avnorm --out {out}",
     r"million/config.json: num_hidden_layers 1,000,000 is outside 0..4,096 \(the deepest models in use have"),
    ("eval-million-layers", "eval {million} --data {text} --lengths 8 --out {out}", r"num_hidden_layers 1,000,000 is"),
    # only regular files are read as data
    ("eval-data-urandom", "eval {model} --data /dev/urandom --lengths 8 --out {out}",
     r"--data /dev/urandom is a device, not a regular file"),
    ("eval-data-fifo", "eval {model} --data {fifo} --lengths 8 --out {out}",
     r"--data .*fifo.txt is a FIFO \(named pipe\), not a regular file"),
    ("patch-calibration-fifo", "patch {model} --norm avnorm --calibration-text {fifo}", r"fifo.txt is a FIFO"),
    ("diagnose-data-urandom", "diagnose {model} --data /dev/urandom --out {out}", r"/dev/urandom is a device"),
    ("train-data-fifo", "train {recipe} data.files=[{fifo}] --out {out}", r"data.files: .*fifo.txt is a FIFO"),
    ("tokenizer-data-urandom", "tokenizer train --data /dev/urandom --out {out}", r"/dev/urandom is a device"),
    ("eval-data-json-deep", "eval {model} --data {json_deep} --lengths 8 --out {out}",
     r"token file .*deep-tokens.json nests too deep to read"),
    # damaged files name themselves and what is wrong
    ("patch-gguf-2-62-tensors", "patch {gguf_huge} --norm avnorm --out {out}",
     r"huge.gguf is damaged: its GGUF header claims 4,611,686,018,427,387,904 tensors and 1 metadata entries, more "
     r"than its \d+ bytes can hold"),
    ("push-log-binary", "push {run_binary_log} --repo me/x --dry-run {out}",
     r"run_binary_log/log.jsonl is not UTF-8 text \(byte \d+ is 0xff\)"),
    # only the marker makes a folder retrofit's: a copied results.json among the user's notes does not
    ("eval-out-copied-results", "eval {model} --data {text} --lengths 8 --out {notes}",
     r"--out .*/notes holds files retrofit did not write .*`retrofit adopt .*/notes` first\)$"),
    ("train-out-copied-results", "train {recipe} --out {notes}", r"--out .*/notes holds files retrofit did not write"),
    ("adopt-a-file", "adopt {afile}", r"afile is not a folder; adopt takes a folder retrofit wrote$"),
    ("adopt-missing", "adopt {missing}", r"no-such-thing is missing"),
    # issue 51 (tracebacks): a control character in an echoed value is escaped, the error stays one line
    ("eval-path-newline", ["eval", "{missing}\nsecond", "--data", "{text}", "--lengths", "8", "--out", "{out}"],
     r"no such file or folder: .*no-such-thing\\nsecond$"),
    ("eval-flag-escape-sequence", ["eval", "{model}", "--data", "{text}", "--lengths", "8", "--bogus\x1b[2J"],
     r"unrecognized arguments: --bogus\\x1b\[2J"),
    # issue 51 (tracebacks): a file read from a folder has its type checked first, then its fields
    ("report-results-a-list", "report {results_list}", r"results_list/results.json holds a list, not a mapping"),
    ("info-result-a-list", "info {run_result_list}", r"run_result_list/result.json holds a list, not a mapping"),
    ("push-result-a-list", "push {run_result_list} --repo me/x --dry-run {out}",
     r"run_result_list/result.json holds a list, not a mapping"),
    ("info-recipe-model-a-list", "info {run_model_list}",
     r"run_model_list/recipe.yaml: model must be a mapping \(source or config\), got \[1, 2\]$"),
    ("info-adapter-config-a-list", "info {adapter_list}", r"adapter_list/adapter_config.json holds a list, not a"),
    ("eval-run-recipe-string-alphabet", "eval {run_str_alphabet} --tasks counting --lengths 16 --out {out}",
     r"run_str_alphabet/recipe.yaml: data.counting.alphabet must be an integer, got 'many'$"),
    # issue 51 (tracebacks): numbers bounded before int() / float(), and finite
    ("info-result-5000-digits", "info {run_result_digits}",
     r"run_result_digits/result.json holds a number of 5,000 digits; .*at most 100"),
    ("report-results-5000-digits", "report {results_digits}", r"results.json holds a number of 5,000 digits"),
    ("train-override-5000-digits", "train {recipe} train.steps=" + "1" * 5000 + " --out {out}",
     r"override train.steps holds a number of 5,000 digits"),
    ("patch-layers-5000-digits", "patch {model} --norm ssmax --layers " + "1" * 5000 + " --out {out}",
     r"--layers: '1111.* holds a number of 5,000 digits; a selection's numbers have at most 100$"),
    ("train-plan-for-1e400", "train {recipe} --dry-run --plan-for cuda:1e400",
     r"--plan-for: the memory after ':' must be a finite number of GiB.*got '1e400'$"),
    # issue 51 (tracebacks): the three left from round 4, and train.fsdp without a launcher
    ("train-config-gpt2-width-not-divisible",
     "train {recipe} model.source=null model.tokenizer={model} model.config.model_type=gpt2 model.config.n_embd=30 "
     "model.config.n_head=4 --out {out}", r"model.config: n_head \(4\) must divide n_embd \(30\)$"),
    ("train-config-kv-heads-not-dividing",
     "train {recipe} model.source=null model.tokenizer={model} model.config.model_type=llama "
     "model.config.hidden_size=32 model.config.num_attention_heads=4 model.config.num_key_value_heads=3 --out {out}",
     r"model.config: num_key_value_heads \(3\) must divide num_attention_heads \(4\)$"),
    ("train-fsdp-without-launcher", "train {recipe} train.fsdp=true --out {out}",
     r"train.fsdp shards the model over several processes .*torchrun --nproc_per_node N"),
    # issue 51 (swapped): a --patch key given twice; (links) adopt never writes through a marker that is a link
    ("eval-patch-key-twice", "eval {model} --data {text} --lengths 8 --patch avnorm:kind=rms,kind=layer --out {out}",
     r"--patch 'avnorm:kind=rms,kind=layer': kind is given twice \('rms', then 'layer'\); give it once$"),
    # issue 51 (code on resume): a planted pickle in a run's checkpoint is refused as data, never run
    ("train-resume-planted-pickle", "train {run_planted}/recipe.yaml --resume {run_planted}",
     r"step-\d+/random_states_0.pkl is not data retrofit can read as training state \(Unsupported global: "
     r"GLOBAL exec was not an allowed global by default\); it was not written by retrofit"),
    ("adopt-marker-is-a-link", "adopt {marker_link}",
     r"marker_link/.retrofit-owned is a symbolic link; .*never writes through a link"),
    # issue 61: a gate start whose 2 * start overflows float32 made every logit NaN
    ("patch-gate-start-1e39", "patch {model} --norm softmax --gate head:1e39 --out {out}",
     r"--gate start 1e\+39 is outside 1e-06\.\.1000 \(the gate's value at step 0.*give a start in that range$"),
    ("patch-gate-start-1e308", "patch {model} --norm avnorm --gate head:1e308 --out {out}",
     r"--gate start 1e\+308 is outside 1e-06\.\.1000"),
    ("train-gate-start-1e39", "train {recipe} patch.gate=head:1e39 --out {out}",
     r"patch.gate start 1e\+39 is outside 1e-06\.\.1000"),
]
SIZE_CASES = ["eval-lengths-range-huge", "eval-export-length-huge", "eval-samples-huge", "eval-export-samples-huge",
              "eval-trials-huge", "eval-rope-1e308", "tokenizer-vocab-2-64", "eval-variants-aliases",
              "patch-million-layers", "eval-million-layers", "eval-max-windows-huge", "diagnose-windows-huge",
              "diagnose-queries-huge"]


def argv(template: str | list, world: dict, out: Path) -> list[str]:
    """The command line of a case: a string splits on whitespace; a list is one argument per item (an argument that
    holds a space or a newline)."""
    if isinstance(template, list):
        return [item.format(**world, out=out) for item in template]
    return template.format(**world, out=out).split()


def snapshot(root: Path) -> dict:
    """Every path under root with its size and modification time: what a failed command must not change. A run's
    .lock holds the pid of whoever took it last (a resume refused after taking it rewrites it): its time is left out;
    and a folder's own time moves when that lock is made and removed inside it (a finished run keeps no .lock), so
    folders are compared by what they hold, every entry listed here with its own size and time."""
    return {str(p): (p.is_dir(), p.lstat().st_size if not p.is_dir() else 0,
                     None if p.name == ".lock" or p.is_dir() else p.lstat().st_mtime_ns)
            for p in sorted(root.rglob("*"))}


@pytest.mark.parametrize("case_id,template,match", CASES, ids=[c[0] for c in CASES])
def test_bad_input_is_one_line_exit_2_and_leaves_nothing(case_id, template, match, world, tmp_path, capsys):
    out = tmp_path / "out"
    before = snapshot(Path(world["root"]))
    try:
        code = main(argv(template, world, out))
    except SystemExit as exit_:  # argparse usage errors exit 2 themselves
        code = exit_.code
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2, (code, err)
    assert "Traceback" not in err
    assert len(lines) == 1, err
    assert __import__("re").search(match, lines[0]), lines[0]
    assert not out.exists(), f"{out} was left behind"
    assert snapshot(Path(world["root"])) == before  # no temporary folder, no half-written file, no change


@pytest.mark.parametrize("case_id", SIZE_CASES)
def test_a_size_is_refused_before_anything_is_allocated(case_id, world, tmp_path, capsys):
    """The size cases in-process under retrofit.memory.PeakMemory (the resident set's high-water mark): refused
    in seconds, with at most 64 MB added. On 9f7e963 these passed gigabytes, built every instance or aborted."""
    from retrofit.memory import PeakMemory

    template = next(c for c in CASES if c[0] == case_id)[1]
    start = time.perf_counter()
    with PeakMemory("cpu") as memory:
        code = main(argv(template, world, tmp_path / "out"))
    assert code == 2, capsys.readouterr().err
    assert memory.added_mb < 64 and time.perf_counter() - start < 20, (memory.added_mb, memory.method)


END_TO_END = ["patch-truncated", "train-seq-len-huge"]  # the rest run in-process: same code, no imports


def test_end_to_end_in_subprocesses(world, tmp_path):
    """`python -m retrofit ...` for a few cases, started together (each pays ~3 s of imports, more when busy)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    runs = {}
    for case_id in END_TO_END:
        template = next(c for c in CASES if c[0] == case_id)[1]
        runs[case_id] = subprocess.Popen([sys.executable, "-m", "retrofit", *argv(template, world, tmp_path / case_id)],
                                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    for case_id, proc in runs.items():
        _, stderr = proc.communicate(timeout=180)
        lines = [line for line in stderr.splitlines() if line.strip()]
        assert proc.returncode == 2 and "Traceback" not in stderr and len(lines) == 1, (case_id, stderr)
        assert not (tmp_path / case_id).exists()


def test_the_memory_guard_fails_fast_before_allocating(world, tmp_path, capsys):
    start = time.perf_counter()
    code = main(argv("train {recipe} data.seq_len=2000000000 train.micro_batch_size=1 train.batch_size=1 --out {out}",
                     world, tmp_path / "out"))
    assert code == 2 and time.perf_counter() - start < 10
    assert "GiB of activations" in capsys.readouterr().err


@pytest.mark.parametrize("value", ["3e-4", "0.0003", "1e-3"])
def test_valid_floats_train(value, world, tmp_path, capsys):
    out = tmp_path / "run"
    assert main(argv(f"train {{recipe}} train.lr={value} --out {{out}}", world, out)) == 0, capsys.readouterr().err
    assert (out / "result.json").is_file()


def test_an_internal_bug_keeps_its_traceback(monkeypatch, world):
    def broken(args):
        raise KeyError("a bug")
    monkeypatch.setattr("retrofit.commands.norms.run", broken)
    with pytest.raises(KeyError):
        main(["norms"])


@pytest.mark.parametrize("error,match", [
    (PermissionError(13, "Permission denied", "/x/y"), r"Permission denied: /x/y; check its permissions"),
    (OSError(28, "No space left on device", "/x"), r"No space left on device: /x; the disk is full"),
    (OSError(30, "Read-only file system", "/x"), r"read-only: choose another --out"),
    (OSError(27, "File too large", "/x"), r"File too large: /x; a file reached the size limit: raise `ulimit -f`"),
    (RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 141824 vs 141716"),
     r"a write failed: the disk is full or a file reached the size limit \(\[enforce fail"),
    (IsADirectoryError(21, "Is a directory", "/x"), r"Is a directory: /x; give a file"),
    (RuntimeError("[enforce fail at alloc_cpu.cpp:121] DefaultCPUAllocator: can't allocate memory: you tried to "
                  "allocate 68719476736 bytes"), r"out of memory .*lower the length or batch"),
    (MemoryError(), r"out of memory"),
    (json.JSONDecodeError("Expecting value", "x", 0), r"a JSON file is damaged \(Expecting value, line 1"),
    (UnicodeDecodeError("utf-8", b"ab\xff", 2, 3, "invalid start byte"), r"not UTF-8 text \(byte 2 is 0xff\)"),
])
def test_machine_and_file_errors_at_the_boundary_are_one_line(error, match, monkeypatch, capsys):
    def failing(args):
        raise error
    monkeypatch.setattr("retrofit.commands.norms.run", failing)
    assert main(["norms"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and __import__("re").search(match, err), err


def test_a_safetensors_error_at_the_boundary_is_one_line(monkeypatch, capsys, world):
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    def failing(args):
        load_file(str(Path(world["garbage"]) / "model.safetensors"))
    monkeypatch.setattr("retrofit.commands.norms.run", failing)
    assert main(["norms"]) == 2
    assert "safetensors file is damaged" in capsys.readouterr().err
    assert SafetensorError  # the type the boundary maps by name


def test_push_publishes_names_not_local_paths(world, tmp_path, capsys):
    """A finished run pushed as a dry run: recipe.yaml and the card carry file names, not this machine's paths."""
    run = tmp_path / "runs" / "tiny-run"
    assert main(argv(f"train {{recipe}} model.tokenizer={{model}} --out {run}", world, tmp_path)) == 0
    staged = tmp_path / "staged"
    assert main(["push", str(run), "--repo", "me/x", "--dry-run", str(staged)]) == 0, capsys.readouterr().err
    published = (staged / "recipe.yaml").read_text() + (staged / "README.md").read_text()
    for local in (str(tmp_path), world["root"], str(run), world["text"], world["model"]):
        assert local not in published
    recipe = yaml.safe_load((staged / "recipe.yaml").read_text())
    assert recipe["output"]["dir"] == "tiny-run" and recipe["data"]["files"] == ["text.txt"]
    assert recipe["model"]["tokenizer"] == "model" and recipe["model"]["source"] == "model"
