"""What `diagnose_sources` measures and where it writes, as one checked dataclass (the CLI fills it).

    spec = DiagnoseSpec(data="book.txt", out="diag/", lengths=[32, 64, 128], patches=["avnorm"])
    diagnose_sources(["runs/demo/base", "./smollm2.gguf"], spec)

Wrong values fail in `__post_init__` with a one-line RetrofitError, before any model loads: too few windows or
queries, an unknown norm or a malformed --patch.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import yaml

from ..errors import RetrofitError, shown
from ..lengths import parse_lengths
from ..norms import get_norm
from ..recipe.schema import knob, load_yaml


def parse_patch(text: str) -> tuple[str, dict]:
    """'avnorm' or 'psoftmax:p=2' or 'avnorm:kind=layer,affine=true' -> (norm, options)."""
    name, _, rest = text.partition(":")
    options = {}
    for item in filter(None, (s.strip() for s in rest.split(","))):
        key, eq, value = item.partition("=")
        if not eq:
            raise RetrofitError(f"--patch {text!r}: options are key=value, e.g. avnorm:kind=layer")
        try:  # bounded: a 3000-deep [[[...]]] is a one-line error, not a RecursionError
            options[key.strip()] = load_yaml(value, f"--patch {shown(text, 40)}", "an option is a number or a word")
        except yaml.YAMLError:
            raise RetrofitError(f"--patch {shown(text, 40)}: {key.strip()}={shown(value, 40)} is not a value; "
                                "write key=value, e.g. avnorm:kind=layer") from None
    return name.strip(), options


@dataclass
class DiagnoseSpec:
    """The settings of one `retrofit diagnose`: the text, the lengths, the patched variants, the output folder."""

    data: str = knob(doc="a plain-text file, long enough for the windows (and the calibration tokens after them)")
    out: str | Path = knob(doc="output folder for diagnose.json, report.md and the figures (new, empty or retrofit's)")
    lengths: list[int] | str = knob(doc="context lengths L: [32, 64, 128] or '32,64,...,1024' (a doubling)")
    tokenizer: str | None = knob(None, "tokenizer folder or Hub id for every source (None: each model's own)")
    windows: int = knob(2, "text windows of max(L) tokens")
    queries: int = knob(8, "query rows measured per length")
    patches: list[str] = knob(factory=list, doc="also diagnose each source patched this way: 'avnorm', "
                                                "'psoftmax:p=2', 'avnorm:kind=layer,affine=true'")
    calibrate_tokens: int = knob(8192, "tokens of `data` after the windows that calibrate fresh AVNorm gains (0: none)")
    labels: list[str] | None = knob(None, "a name per source, in order (default: each source's folder or file)")
    dtype: str = knob("float32", "model dtype (auto: the dtype it was saved in)")
    seed: int = knob(0, "seed for the random directions of g(T, eps)")
    progress: bool = knob(True, "progress bars")
    command: str = knob("...", "the command line, recorded in the report's header")

    def __post_init__(self):
        if self.windows < 1 or self.queries < 1:
            raise RetrofitError("--windows and --queries must be >= 1")
        self.lengths = parse_lengths(self.lengths) if isinstance(self.lengths, str) else list(self.lengths)
        self.patches = list(self.patches)
        for spec in self.patches:
            get_norm(parse_patch(spec)[0])  # an unknown norm fails now, not after loading a model

    @property
    def norms(self) -> list[str]:
        """The norm of each patched variant, in order."""
        return [parse_patch(spec)[0] for spec in self.patches]
