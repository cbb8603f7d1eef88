"""The seeds' posts in their own regime (issue #29): the BPE tokenizer step and the two post recipes.

`retrofit tokenizer train` must be deterministic and round-trip text exactly; recipes/avnorm-post.yaml,
recipes/avnorm-post-nope.yaml and recipes/counting-psoftmax.yaml must load, and a 2-step run of each on tiny
sizes must finish with every arm trained and evaluated. Everything is built here (no ../shared, no network).
"""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest
import torch

from retrofit.cli import main
from retrofit.errors import RetrofitError
from retrofit.experiment import driver as experiment
from retrofit.load import load, load_tokenizer
from retrofit.recipe import load_recipe

RECIPES = Path(experiment.__file__).resolve().parent.parent / "recipes"
WORDS = ("the of and to a in was her it she that not he be as had with for you his but at is all Emma Anne "
         "Captain whale sea ship ocean said would could been very much such there they which").split()


def _text(path: Path, words: int, seed: int) -> Path:
    rng = random.Random(seed)
    lines = [" ".join(rng.choice(WORDS) for _ in range(12)) + rng.choice(".,!?") for _ in range(words // 12)]
    path.write_text("\n".join(lines) + "\n“Quoted” — naïve café, 1811.\n", encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def books(tmp_path_factory):
    root = tmp_path_factory.mktemp("books")
    train = [_text(root / f"book{i}.txt", 6000, seed=i) for i in range(2)]
    return {"root": root, "train": train, "val": _text(root / "held_out.txt", 6000, seed=9)}


@pytest.fixture(scope="module")
def bpe(books, tmp_path_factory):
    out = tmp_path_factory.mktemp("tok") / "bpe"
    assert main(["tokenizer", "train", "--data", *map(str, books["train"]), "--vocab-size", "300",
                 "--out", str(out)]) == 0
    return out


# ---- the tokenizer step --------------------------------------------------------------------------------------------

def test_the_tokenizer_is_deterministic(books, bpe, tmp_path):
    again = tmp_path / "again"
    assert main(["tokenizer", "train", "--data", *map(str, books["train"]), "--vocab-size", "300",
                 "--out", str(again)]) == 0
    files = sorted(p.name for p in bpe.iterdir())
    assert files == ["tokenizer.json", "tokenizer_config.json"] == sorted(p.name for p in again.iterdir())
    for name in files:
        assert (bpe / name).read_bytes() == (again / name).read_bytes(), name
    other = tmp_path / "other"  # a different size is a different tokenizer (the files do depend on the input)
    assert main(["tokenizer", "train", "--data", *map(str, books["train"]), "--vocab-size", "280",
                 "--out", str(other)]) == 0
    assert (other / "tokenizer.json").read_bytes() != (bpe / "tokenizer.json").read_bytes()


def test_the_tokenizer_round_trips_text_exactly(books, bpe):
    tok = load_tokenizer(str(bpe))
    assert len(tok) == 300 and tok.eos_token == "<|endoftext|>" and tok.eos_token_id is not None
    unseen = "  Tabs\tand\r\nnew lines,\n\n emoji 😀, Ünïcödé, 中文, trailing spaces   "
    for text in (books["val"].read_text(encoding="utf-8"), unseen):
        ids = tok(text)["input_ids"]
        assert max(ids) < 300 and tok.decode(ids) == text
    # merges were learned: the training text takes far fewer tokens than its bytes
    text = books["train"][0].read_text(encoding="utf-8")
    assert len(tok(text)["input_ids"]) < 0.75 * len(text.encode())  # no merges: one token a byte


def test_a_too_small_vocabulary_is_refused_and_writes_nothing(books, tmp_path, capsys):
    out = tmp_path / "small"
    assert main(["tokenizer", "train", "--data", str(books["train"][0]), "--vocab-size", "100",
                 "--out", str(out)]) == 2
    assert "--vocab-size must be >= 257" in capsys.readouterr().err
    assert not out.exists()


# ---- the recipes -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["avnorm-post", "avnorm-post-nope", "counting-psoftmax"])
def test_the_post_recipes_load(name):
    exp = load_recipe(RECIPES / f"{name}.yaml").section("experiment")
    assert exp.arms and exp.finetune_steps >= 1
    if name.startswith("avnorm-post"):
        assert exp.base_steps == 3 * exp.finetune_steps  # the post's pretrain : finetune = 3 : 1
        points = [s for s in exp.recovery_at if 0 < s <= exp.finetune_steps]
        assert len(points) >= 8 and exp.finetune_steps // 2 in points  # dense, and at "half the finetune"
        assert max(load_recipe(RECIPES / f"{name}.yaml").eval.lengths) >= 16 * exp.train_len


@pytest.mark.parametrize("recipe,override,match", [
    ("avnorm-post-nope", "experiment.base_steps=0", "experiment.base_patch applies to a base pretrained here"),
    ("counting-psoftmax", "experiment.eval_sequences=0", "experiment.eval_sequences must be >= 1"),
    ("counting-psoftmax", "experiment.arms=[{name: p1, seed: x}]", "seed"),
])
def test_the_new_experiment_keys_refuse_bad_values(recipe, override, match):
    with pytest.raises(RetrofitError, match=match):
        load_recipe(RECIPES / f"{recipe}.yaml", [override])


def _reference(path: Path) -> str:
    lengths = [16, 32, 64]
    curves = {k: [3.0, 3.5, 4.0] for k in ("l1_baseline", "groupnorm", "rmsnorm", "layernorm", "l1")}
    path.write_text(json.dumps({"context_lengths": lengths, "pe": curves, "nope": curves}))
    return str(path)


TINY_LM = ["model.config.hidden_size=32", "model.config.intermediate_size=64", "model.config.num_hidden_layers=2",
           "model.config.num_attention_heads=2", "model.config.num_key_value_heads=2", "model.config.vocab_size=300",
           "data.seq_len=16", "train.batch_size=4", "train.micro_batch_size=4", "train.warmup_steps=1",
           "train.log_every=1", "train.progress=false", "eval.batches=1", "eval.batch_size=2",
           "eval.lengths=[16,64]", "experiment.base_steps=3", "experiment.finetune_steps=2",
           "experiment.recovery_at=[0,1]", "experiment.eval_max_tokens=256", "experiment.train_len=16"]


def _lm_overrides(books, bpe, tmp_path) -> list[str]:
    return TINY_LM + [f"model.tokenizer={bpe}", f"data.files=[{','.join(map(str, books['train']))}]",
                      f"data.val_files=[{books['val']}]", f"experiment.eval_data=[{books['val']}]",
                      f"experiment.reference.file={_reference(tmp_path / 'ref.json')}"]


def _check_run(results: dict, arms: list[str]) -> None:
    assert list(results["arms"]) == arms
    assert all(a["failed"] is None for a in results["arms"].values()), results["arms"]
    for arm in results["arms"].values():  # the recovery curve at 0, 1 and the last step, finite
        assert sorted(int(s) for s in arm["recovery"]) == [0, 1, 2]
        assert all(math.isfinite(v) for point in arm["recovery"].values() for v in point.values())
    models = {m["name"]: m for m in results["evaluation"]["models"]}
    assert list(models) == ["base"] + arms
    for m in models.values():
        rows = m.get("lengths") or m.get("counting")
        assert [r["length"] for r in rows] == [16, 64] and all(math.isfinite(r["loss"]) for r in rows)


def _positions_matter(model_dir: Path) -> bool:
    """Whether the position ids change the logits: RoPE applied (0, 1, 2 ... rotates queries and keys apart; all
    zeros rotates nothing) or not (NoPE). A uniform shift would not tell: RoPE sees only relative positions."""
    model = load(str(model_dir), dtype="float32").eval()
    ids = torch.randint(0, 300, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a = model(ids, position_ids=torch.arange(12)[None]).logits
        b = model(ids, position_ids=torch.zeros(1, 12, dtype=torch.long)).logits
    return not torch.allclose(a, b, atol=1e-5)


def test_avnorm_post_runs_small(books, bpe, tmp_path):
    out = tmp_path / "post"
    results = experiment.run_experiment(RECIPES / "avnorm-post.yaml", out, _lm_overrides(books, bpe, tmp_path),
                                        progress=False)
    _check_run(results, ["softmax", "avnorm-rms", "avnorm-layer", "avnorm-global"])
    assert {a: p["patch"].get("kind") for a, p in results["arms"].items()} == \
        {"softmax": None, "avnorm-rms": "rms", "avnorm-layer": "layer", "avnorm-global": "global"}
    assert set(results["reference"]["arms"]) == {"avnorm-rms", "avnorm-layer", "avnorm-global"}
    assert "Against the published table" in (out / "report.md").read_text()
    assert _positions_matter(out / "base") and _positions_matter(out / "arms" / "softmax")  # RoPE kept


def test_avnorm_post_nope_runs_small_from_a_nope_base(books, bpe, tmp_path):
    out = tmp_path / "nope"
    results = experiment.run_experiment(RECIPES / "avnorm-post-nope.yaml", out, _lm_overrides(books, bpe, tmp_path),
                                        progress=False)
    _check_run(results, ["softmax-nope", "avnorm-layer-nope"])
    assert all(a["patch"]["nope"] for a in results["arms"].values())
    base_record = json.loads((out / "base" / "config.json").read_text())["retrofit"]
    assert base_record["nope"] and base_record["norm"] == "softmax"  # the base itself trained without positions
    for folder in (out / "base", out / "arms" / "softmax-nope", out / "arms" / "avnorm-layer-nope"):
        assert not _positions_matter(folder), folder


def test_counting_psoftmax_runs_small(tmp_path):
    overrides = ["data.seq_len=16", "train.init_len=8", "train.double_every=1", "train.batch_size=4",
                 "train.micro_batch_size=4", "train.warmup_steps=1", "train.progress=false", "eval.batches=1",
                 "eval.batch_size=2", "eval.lengths=[16,64]", "experiment.finetune_steps=2",
                 "experiment.recovery_at=[0,1]", "experiment.eval_sequences=3"]
    recipe = load_recipe(RECIPES / "counting-psoftmax.yaml", overrides)
    arms = [a.name for a in recipe.section("experiment").arms]
    results = experiment.run_experiment(recipe, tmp_path / "count", progress=False)
    assert len(arms) >= 2 and {a.patch.options.get("p") for a in recipe.section("experiment").arms} == {1.0, 2.0}
    assert list(results["arms"]) == arms and all(a["failed"] is None for a in results["arms"].values())
    models = {m["name"]: m for m in results["evaluation"]["models"]}
    assert set(models) == set(arms)  # base_steps 0: no base, every arm from the same seeded init
    for m in models.values():
        assert [(r["length"], r["sequences"]) for r in m["counting"]] == [(16, 3), (64, 3)]  # eval_sequences
        assert all(math.isfinite(r["mse"]) and math.isfinite(r["l1"]) for r in m["counting"])
    # the seed replicates: each arm trained with its own seed (init and data), the others with train.seed
    seeds = {a: load_recipe(tmp_path / "count" / "arms" / a / "recipe.yaml").train.seed for a in arms}
    assert seeds == {"p1": 0, "p2": 0, "p1-s1": 1, "p2-s1": 1}
    first = {n: load(str(tmp_path / "count" / "arms" / a)).state_dict() for n, a in (("s0", "p1"), ("s1", "p1-s1"))}
    key = next(k for k in first["s0"] if k.endswith("q_proj.weight"))
    assert not torch.equal(first["s0"][key], first["s1"][key])  # another init, not a copy
