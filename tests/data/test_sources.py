"""Which source trains (retrofit.data.text.sources): given data.dataset and data.files both, the local files when
every one is here (the offline path), the Hub dataset when none is, an error when some are; and a missing book says
where the books come from. The Hub is never reached: datasets.load_dataset is replaced for every name that is not
one of its local builders (text, json, parquet)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from retrofit.data import build_data
from retrofit.data.text import check_files, sources
from retrofit.errors import RetrofitError, read_utf8
from retrofit.recipe import DataSection
from tests.tiny import char_tokenizer

HUB = "someone/books"
BOOKS_HINT = ("the recipes' books (Austen's six novels, Moby-Dick) are not shipped: docs/training.md, 'The books', "
              "says where to get them")


class Rows(list):
    """Rows as a streamed datasets split hands them out (StreamBlocks saves and restores its position)."""

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


def fake_hub(monkeypatch, splits: dict | None = None, error: Exception | None = None) -> list:
    """datasets.load_dataset as it is for local files; for a Hub name, the rows of `splits[split]` or `error`
    raised. Returns the list of (name, split) the Hub was asked for."""
    import datasets
    real, asked = datasets.load_dataset, []

    def load(path, *args, **kwargs):
        if path in ("text", "json", "parquet"):
            return real(path, *args, **kwargs)
        asked.append((path, kwargs.get("split")))
        if error is not None:
            raise error
        return Rows(splits[kwargs["split"]])

    monkeypatch.setattr(datasets, "load_dataset", load)
    return asked


def section(tmp_path, **kw) -> DataSection:
    return DataSection(**{"task": "lm", "seq_len": 16, "val_blocks": 2, "shuffle": False,
                          "cache_dir": str(tmp_path / "cache"), **kw})


def ids_of(tok, text: str) -> set[int]:
    return set(tok(text, add_special_tokens=False)["input_ids"]) | {tok.eos_token_id}


def test_the_files_train_when_every_one_is_here_and_the_hub_is_not_asked(tmp_path, monkeypatch):
    tok = char_tokenizer()
    asked = fake_hub(monkeypatch, {"train": [{"text": "xyz " * 50}], "validation": [{"text": "xyz " * 50}]})
    (tmp_path / "book.txt").write_text("abc " * 50)
    (tmp_path / "held.txt").write_text("de " * 50)
    data_section = section(tmp_path, dataset=HUB, val_split="validation", files=[str(tmp_path / "b*.txt")],
                           val_files=[str(tmp_path / "held.txt")])
    assert sources(data_section) == (data_section.files, data_section.val_files, None)
    data = build_data(data_section, tok, eval_lengths=[16])
    assert asked == []
    assert set(data.train.blocks.flatten().tolist()) <= ids_of(tok, "abc ")
    assert set(data.val.flatten().tolist()) <= ids_of(tok, "de ")  # val_files, not the Hub's val_split


def test_the_hub_trains_when_none_of_the_files_is_here(tmp_path, monkeypatch, capsys):
    tok = char_tokenizer()
    asked = fake_hub(monkeypatch, {"train": [{"text": "xyz " * 50}], "validation": [{"text": "uv " * 50}]})
    missing = [str(tmp_path / "books" / "emma.txt"), str(tmp_path / "books" / "*.txt")]
    data_section = section(tmp_path, dataset=HUB, val_split="validation", files=missing,
                           val_files=[str(tmp_path / "books" / "persuasion.txt")])
    assert sources(data_section) == (None, None, "validation")
    check_files(data_section)  # the absent files are not an error: the Hub trains
    data = build_data(data_section, tok, eval_lengths=[16])
    assert asked == [(HUB, "train"), (HUB, "validation")]
    assert set(data.train.blocks.flatten().tolist()) <= ids_of(tok, "xyz ")
    assert set(data.val.flatten().tolist()) <= ids_of(tok, "uv ")  # val_split; val_files (absent) not read
    assert f"none of data.files is here ({missing[0]}, {missing[1]}): training on Hub dataset '{HUB}'" in \
        capsys.readouterr().out


def test_offline_without_the_files_names_where_to_put_them(tmp_path, monkeypatch):
    fake_hub(monkeypatch, error=ConnectionError("Couldn't reach 'someone/books' on the Hub (LocalEntryNotFoundError)"))
    book = str(tmp_path / "data" / "books" / "emma.txt")
    with pytest.raises(RetrofitError) as err:
        build_data(section(tmp_path, dataset=HUB, files=[book]), char_tokenizer())
    message = str(err.value)
    assert message.startswith(f"cannot reach Hub dataset '{HUB}' (offline?): Couldn't reach")
    assert message.endswith(f"; put its local copy at data.files ({book}); {BOOKS_HINT}") and "\n" not in message


def test_some_files_but_not_all_is_an_error_before_any_loading(tmp_path, monkeypatch):
    asked = fake_hub(monkeypatch, {"train": [{"text": "xyz " * 50}]})
    (tmp_path / "here.txt").write_text("abc " * 50)
    gone = str(tmp_path / "gone.txt")
    data_section = section(tmp_path, dataset=HUB, files=[str(tmp_path / "here.txt"), gone])
    for attempt in (check_files, sources, lambda s: build_data(s, char_tokenizer())):
        with pytest.raises(RetrofitError, match=f"^data.files: no such file: {re.escape(gone)}; data.dataset "
                                                f"'{HUB}' trains only when none of data.files is here$"):
            attempt(data_section)
    assert asked == []


def test_a_missing_book_says_where_the_books_come_from(tmp_path):
    book, other = tmp_path / "data" / "books" / "persuasion.txt", tmp_path / "notes" / "persuasion.txt"
    with pytest.raises(RetrofitError) as err:
        check_files(DataSection(files=[str(book)]))
    assert str(err.value) == f"data.files: no such file: {book}; {BOOKS_HINT}"
    with pytest.raises(RetrofitError) as err:
        check_files(DataSection(files=[str(other)]))
    assert str(err.value) == f"data.files: no such file: {other}"  # not a book: no word about the books
    with pytest.raises(RetrofitError) as err:  # every verb's text (--data, --calibration-text, eval_data)
        read_utf8(book, "--data")
    assert str(err.value) == f"--data {book}: no such file; {BOOKS_HINT}"


def test_the_section_takes_both_sources_and_their_own_validation():
    both = DataSection(dataset=HUB, files=["data/books/emma.txt"], val_files=["v.txt"], val_split="validation")
    assert (both.dataset, both.files, both.val_files, both.val_split) == (HUB, ["data/books/emma.txt"], ["v.txt"],
                                                                         "validation")
    with pytest.raises(RetrofitError, match="not both"):  # one source: one validation key
        DataSection(files=["a.txt"], val_files=["v.txt"], val_split="validation")


def test_the_page_the_error_names_has_the_section():
    page = Path(__file__).resolve().parents[2] / "docs" / "training.md"
    assert "\n## The books\n" in page.read_text()  # books_hint sends readers to docs/training.md, 'The books'
