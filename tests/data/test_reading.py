"""Reading within bounds (issue 36): texts are read as far as a token budget needs, in pieces, a binary text is
named with its byte, and RULER instances and haystacks are built when read. The CLI cases (one line, exit 2,
nothing written, peak memory) are in tests/cli/test_bad_inputs.py; the model card's escaping in tests/hub."""

from __future__ import annotations

import tracemalloc

import pytest

from retrofit.errors import RetrofitError
from tests.tiny import char_tokenizer

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def big_text(tmp_path_factory):
    """8 MiB of text: read whole and tokenized into Python ints (as 9f7e963 did) it takes hundreds of MB."""
    path = tmp_path_factory.mktemp("texts") / "big.txt"
    sentence = "the cat sat on a mat and the dog ran far. "
    path.write_text(sentence * (8 * 2 ** 20 // len(sentence)))
    return path


def test_a_token_budget_reads_only_as_far_as_it_needs(big_text):
    from retrofit.patch_job import text_tokens  # --calibration-text and --check-text read this way

    tok = char_tokenizer()
    tracemalloc.start()
    try:
        ids = text_tokens(tok, str(big_text), 1000)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    head = big_text.read_text()[:5000]
    assert ids.tolist() == tok(head)["input_ids"][:1000]
    assert peak < 4 * 2 ** 20, f"{peak / 2 ** 20:.1f} MiB to read 1,000 tokens"


def test_a_whole_text_is_read_in_pieces_and_gives_the_same_tokens(tmp_path):
    from retrofit.data.read import read_tokens

    path = tmp_path / "t.txt"
    text = "".join(f"word{i % 97} and caf\u00e9 {i}\n" for i in range(3000))  # multi-byte characters across pieces
    path.write_text(text)
    tok = char_tokenizer()
    assert read_tokens(path, tok, "--data", piece=1000).tolist() == tok(text)["input_ids"]


def test_a_binary_text_names_the_file_and_the_byte(tmp_path):
    from retrofit.data.read import read_tokens

    path = tmp_path / "bin.txt"
    path.write_bytes(b"abc " * 100 + b"\xff")
    with pytest.raises(RetrofitError, match=r"--data .*bin.txt is not UTF-8 text \(byte 400 is 0xff\)"):
        read_tokens(path, char_tokenizer(), "--data", piece=64)


def test_ruler_instances_are_built_when_read_not_all_first(monkeypatch):
    """--samples N built N instances (each `length` tokens of text) before the first model ran (9f7e963)."""
    import retrofit.data.ruler_tasks as ruler
    from retrofit.evaluate.ruler import ruler_instances

    built = []
    make = ruler.make_instance
    monkeypatch.setattr(ruler, "make_instance", lambda *a, **k: built.append(k.get("index")) or make(*a, **k))
    prepared = ruler_instances(char_tokenizer(), ["niah"], [512], None, {"samples": 10_000, "depths": [0.0, 1.0]})
    insts = prepared[("niah", 512)]
    assert len(insts) == 20_000 and len(built) == 1  # the first, built at once: a too-short haystack fails early
    last = insts[19_999]
    assert last["depth"] == 1.0 and last["index"] == 9_999 and len(built) == 2
    assert insts[3]["input"] == make("niah", char_tokenizer(), ruler.Haystack(char_tokenizer()), length=512,
                                     depth=0.0, index=3)["input"]  # the same instance, built again on demand


def test_a_ruler_haystack_reads_as_far_as_the_longest_length_needs(big_text):
    from retrofit.evaluate.ruler import HAYSTACK_READ, read_texts

    tracemalloc.start()
    try:
        texts = read_texts([big_text], [512])
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert texts[0] == big_text.read_text()[:HAYSTACK_READ * 512]  # its start, exactly, and no more
    assert peak < 4 * 2 ** 20 + 4 * HAYSTACK_READ * 512, f"{peak / 2 ** 20:.1f} MiB"
