"""Where the books come from: a missing book (a path in a `books/` folder) says so, naming the docs section that
tells what the recipes' books are and where to get them."""

from __future__ import annotations

from pathlib import Path

import pytest

from retrofit.data.text import check_files
from retrofit.errors import RetrofitError, read_utf8
from retrofit.recipe import DataSection

BOOKS_HINT = ("the recipes' books (Austen's six novels, Moby-Dick) are not shipped: docs/training.md, 'The books', "
              "says where to get them")


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


def test_the_page_the_error_names_has_the_section():
    page = Path(__file__).resolve().parents[2] / "docs" / "training.md"
    assert "\n## The books\n" in page.read_text()  # books_hint sends readers to docs/training.md, 'The books'
