"""data.packing documents is allowed exactly on the attention implementations whose mask keeps each packed document
to itself: transformers' own (run_checks.PACKED_MASKS, checked against transformers' mask registry here) and
retrofit's, which pack as the implementation they wrap (attention_seam.BASE_OF, not a second list of names)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, flash_attention_mask

from retrofit import attention_seam
from retrofit.errors import RetrofitError
from retrofit.train.run_checks import PACKED_MASKS, check_packing


def _model(implementation: str):
    return SimpleNamespace(config=SimpleNamespace(_attn_implementation=implementation))


DOCUMENTS = SimpleNamespace(data=SimpleNamespace(packing="documents"))


def test_packed_masks_are_transformers_implementations_whose_mask_sees_the_documents():
    """Each is in transformers' mask registry with a mask built from the position-id resets; flash's is not one."""
    assert all(ALL_MASK_ATTENTION_FUNCTIONS[name] is not flash_attention_mask for name in PACKED_MASKS)


def test_retrofits_implementations_pack_as_the_one_they_wrap(monkeypatch):
    for name, base in attention_seam.BASE_OF.items():  # retrofit (sdpa), retrofit_eager (eager)
        assert base in PACKED_MASKS
        check_packing(_model(name), DOCUMENTS)
    monkeypatch.setitem(attention_seam.BASE_OF, "retrofit_flash", "flash_attention_2")  # one more, planted
    monkeypatch.setitem(attention_seam.BASE_OF, "retrofit_flex", "flex_attention")
    check_packing(_model("retrofit_flex"), DOCUMENTS)
    with pytest.raises(RetrofitError, match="'retrofit_flash' would let a row's documents attend to each other"):
        check_packing(_model("retrofit_flash"), DOCUMENTS)
    with pytest.raises(RetrofitError, match="'flash_attention_2' would let"):
        check_packing(_model("flash_attention_2"), DOCUMENTS)
