"""What `diagnose_sources` measures and where it writes, as one checked dataclass (the CLI fills it).

    spec = DiagnoseSpec(data="book.txt", out="diag/", lengths=[32, 64, 128], patches=["avnorm"])
    diagnose_sources(["runs/demo/base", "./smollm2.gguf"], spec)

Wrong values fail in `__post_init__` with a one-line RetrofitError, before any model loads: too few windows or
queries, an unknown norm or a malformed --patch.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..errors import RetrofitError
from ..lengths import parse_lengths
from ..patch_spec import FieldNames, PatchSpec
from ..recipe.schema import setting

# how diagnose's --patch names a selection in its errors
DIAGNOSE = FieldNames("--patch layers", "--patch heads")


def parse_patches(patches) -> list[PatchSpec]:
    """Each --patch text as a checked PatchSpec: 'avnorm', 'psoftmax:p=2', 'avnorm:kind=layer,affine=true'."""
    return [PatchSpec.parse(text, DIAGNOSE) for text in patches]


@dataclass
class DiagnoseSpec:
    """The settings of one `retrofit diagnose`: the text, the lengths, the patched variants, the output folder."""

    data: str = setting(doc="a plain-text file, long enough for the windows (and the calibration tokens after them)")
    out: str | Path = setting(doc="output folder for diagnose.json, report.md and the figures (new, empty or "
                                  "retrofit's)")
    lengths: list[int] | str = setting(doc="context lengths L: [32, 64, 128] or '32,64,...,1024' (a doubling)")
    tokenizer: str | None = setting(None, "tokenizer folder or Hub id for every source (None: each model's own)")
    windows: int = setting(2, "text windows of max(L) tokens")
    queries: int = setting(8, "query rows measured per length")
    patches: list[str] = setting(factory=list, doc="also diagnose each source patched this way: 'avnorm', "
                                                   "'psoftmax:p=2', 'avnorm:kind=layer,affine=true'")
    calibrate_tokens: int = setting(8192, "tokens of `data` after the windows that calibrate fresh AVNorm gains "
                                          "(0: none)")
    labels: list[str] | None = setting(None, "a name per source, in order (default: each source's folder or file)")
    dtype: str = setting("float32", "model dtype (auto: the dtype it was saved in)")
    seed: int = setting(0, "seed for the random directions of g(T, eps)")
    progress: bool = setting(True, "progress bars")
    command: str = setting("...", "the command line, recorded in the report's header")

    def __post_init__(self):
        if self.windows < 1 or self.queries < 1:
            raise RetrofitError("--windows and --queries must be >= 1")
        self.lengths = parse_lengths(self.lengths) if isinstance(self.lengths, str) else list(self.lengths)
        self.patches = list(self.patches)
        parse_patches(self.patches)  # an unknown norm or option fails now, not after loading a model

    @property
    def norms(self) -> list[str]:
        """The norm of each patched variant, in order."""
        return [spec.norm for spec in parse_patches(self.patches)]
