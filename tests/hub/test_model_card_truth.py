"""The model card says what is so (issue 62, item 3): calibrated gains read "calibrated on N tokens", not the option's
start value gain=1.0; a .gguf or `pkg:` base names its Hub origin from its own header (general.source.url ...), and
where it names none `retrofit push` asks for --base-model in one line."""

from __future__ import annotations

import re

import pytest
from huggingface_hub import ModelCard

import retrofit
from retrofit.hub.model_card import model_card
from retrofit.hub.origin import card_base_model, gguf_origin
from retrofit.hub.publish import push
from retrofit.load import load, save_model
from tests.hub.test_hub import card_info
from tests.tiny import char_tokenizer, tiny_gguf

ORIGIN = "HuggingFaceTB/SmolLM2-135M-Instruct"


def _options_row(card: str) -> str:
    return next(line for line in card.splitlines() if line.startswith("| options |"))


def test_calibrated_gains_read_calibrated_not_their_start_value():
    card = model_card(card_info(options={"kind": "rms", "gain": 1.0, "eps": 1e-5},
                                calibration={"tokens": 8192, "batches": 4, "gain_mean": 1.73}))
    row = _options_row(card)
    assert "gain=calibrated on 8192 tokens" in row and "gain=1.0" not in card
    assert re.search(r"\| calibration \|.*8192", card)  # the calibration's own summary stays


def test_uncalibrated_gains_say_so():
    row = _options_row(model_card(card_info(options={"kind": "rms", "gain": 1.0})))
    assert re.search(r"gain=1\.0 \\?\(not calibrated\\?\)", row), row


def _with_base(base: str) -> dict:
    return {**card_info(), "base_model": base}


def _gguf_with_header(path, **strings) -> None:
    """A minimal GGUF file: the given general.* strings and one tiny tensor (the reader needs a whole file)."""
    import gguf
    import numpy as np
    writer = gguf.GGUFWriter(str(path), "llama")
    for key, value in strings.items():
        writer.add_string(key, value)
    writer.add_tensor("token_embd.weight", np.zeros((2, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("key, value", [("general.source.url", f"https://huggingface.co/{ORIGIN}"),
                                        ("general.source.huggingface.repository", ORIGIN),
                                        ("general.base_model.0.repo_url", f"https://huggingface.co/{ORIGIN}/")])
def test_a_gguf_base_names_its_header_origin(tmp_path, key, value):
    path = tmp_path / "m.gguf"
    _gguf_with_header(path, **{"general.name": "SmolLM2 135M Instruct", key: value})
    assert gguf_origin(path) == ORIGIN
    assert ModelCard(model_card(_with_base(str(path)))).data.base_model == ORIGIN


def test_a_display_name_or_another_site_is_no_origin(tmp_path):
    path = tmp_path / "m.gguf"
    _gguf_with_header(path, **{"general.name": "SmolLM2 135M Instruct", "general.url": "https://example.com/a/b"})
    assert gguf_origin(path) is None and card_base_model(str(path)) is None
    assert ModelCard(model_card(_with_base(str(path)))).data.base_model is None


def test_a_pkg_base_names_its_header_origin(tmp_path, monkeypatch):
    package = tmp_path / "site" / "tiny_origin_pkg"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    _gguf_with_header(package / "m.Q4_1.gguf", **{"general.source.url": f"https://huggingface.co/{ORIGIN}"})
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    assert card_base_model("pkg:tiny_origin_pkg/m.Q4_1.gguf") == ORIGIN
    assert card_base_model("pkg:not_installed_pkg_xyz/m.gguf") is None  # not here: no base, no crash


def test_push_asks_for_base_model_when_the_card_would_name_none(tmp_path, capsys):
    gguf = tmp_path / "tiny.gguf"  # tests.tiny's GGUF: no general.source.* keys
    tiny_gguf(gguf)
    model = load(str(gguf))
    retrofit.patch(model, "softmax1")
    save_model(model, tmp_path / "ckpt", tokenizer=char_tokenizer())
    with_origin = tmp_path / "origin.gguf"
    _gguf_with_header(with_origin, **{"general.source.url": f"https://huggingface.co/{ORIGIN}"})
    for out, base in (("gguf", str(gguf)), ("none", None), ("origin", str(with_origin)), ("named", ORIGIN)):
        push(str(tmp_path / "ckpt"), "me/x", dry_run=str(tmp_path / out), base_model=base)
        said = [line for line in capsys.readouterr().out.splitlines() if "--base-model" in line]
        card_base = ModelCard.load(tmp_path / out / "README.md").data.base_model
        if out in ("gguf", "none"):
            assert len(said) == 1 and "names no base_model" in said[0] and card_base is None
        else:
            assert said == [] and card_base == ORIGIN
    assert "tiny.gguf is not a Hub id" in said_for(tmp_path / "ckpt", str(gguf), tmp_path / "again", capsys)


def said_for(source, base, out, capsys) -> str:
    push(str(source), "me/x", dry_run=str(out), base_model=base)
    return capsys.readouterr().out
