"""The teacher: the patched model with its patch bypassed — the same weights, no second copy in memory.

    with patch_bypassed(model):
        teacher_logits = model(input_ids=ids).logits      # bitwise the unpatched model's

retrofit's attention function dispatches to each attention module's `retrofit` child and runs the wrapped kernel
unchanged when there is none (attention_seam.py's dispatch), and AVNorm's output-projection hook does nothing when its
norm is not attached (norms/base.py `before_projection`); so detaching the children for the duration is the
original model. A RoPE extension is undone for the duration too (the original rotary modules and config values,
rope.py `original_rope`), so the teacher of an extended student is the original model, not the extended one; NoPE
is refused: its teacher would need the position embeddings it removed.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from torch import nn

from ..errors import RetrofitError
from ..patching import CHILD
from ..record import read_record
from ..rope import original_rope


def _records(model: nn.Module) -> list[dict]:
    records = [read_record(m.config) for m in model.modules() if hasattr(m, "config")]
    return [record for record in records if record is not None]


@contextlib.contextmanager
def patch_bypassed(model: nn.Module) -> Iterator[nn.Module]:
    """While active, every attention module of `model` runs as it did before the patch (its norm detached)."""
    owners = [m for m in model.modules() if CHILD in m._modules]
    if not owners:
        raise RetrofitError("a teacher needs a patched model (the teacher is the patch bypassed); this model has no "
                            "retrofit norm: patch it first, or drop recovery.kl_weight / match_steps")
    records = _records(model)
    if any(record.get("nope") for record in records):
        raise RetrofitError("distillation bypasses the attention norm and a RoPE extension, not NoPE: a nope patch "
                            "removed the position embeddings its teacher would need; drop nope or the KL")
    rope = next((record["rope"] for record in records if record.get("rope")), None)
    saved = [(m, dict(m._modules)) for m in owners]  # children in order: parameters() order must not change
    for m in owners:
        del m._modules[CHILD]
    try:
        with original_rope(model, rope) if rope else contextlib.nullcontext():
            yield model
    finally:
        for m, children in saved:
            m._modules.clear()
            m._modules.update(children)
