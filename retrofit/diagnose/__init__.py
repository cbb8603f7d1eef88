"""`retrofit diagnose`: the measures of "Limitations of Normalization in Attention Mechanism" on any model.

    retrofit diagnose runs/demo/base runs/demo/avnorm ./smollm2.gguf \\
        --data books/persuasion.txt --lengths 32,64,...,1024 --out diag/

    from retrofit.diagnose import Plan, diagnose
    result = diagnose(model, windows, Plan(lengths=[32, 64, 128]))   # windows: (B, T) token ids

Per model, per layer and head, as diagnose.json, report.md and PNG figures:
  1. vanishing attention (Lemma 1, Corollary 1): entropy and max weight vs L, against (1/L) exp(+-2 Delta / T)
  2. variance collapse (the L2-softmax post): head-output variance and ||A||_2^2 vs L, against
     Var = sum a_i^2 Var(v_i); measured after the norm for AVNorm (and as is for p-softmax)
  3. distance (Theorem 1): true d~ of the top-N set, its fixed-set bound, the random-set expectation;
     N = 5 as L grows, N in {1, 5, 10, 20, 100} at the largest L; critical N by a KS test
  4. geometric separability (Theorem 2): N_s / N with its lower and upper bounds
  5. gradient sensitivity (Corollary 3): finite-difference g(T, eps) vs temperature

Layout: measures.py (pure tensor math, equation numbers in docstrings) <- capture.py (the patcher's
attention seam) <- collect.py (one forward, per-head reductions) <- summary.py (JSON) <- figures.py
(plots) + markdown.py (report.md) <- driver.py (sources, text, patched variants, `diagnose`), whose settings
are spec.py (DiagnoseSpec, checked before any model loads).
The CLI is retrofit/commands/diagnose.py.
"""

from __future__ import annotations

from .collect import Plan, diagnose_model
from .driver import diagnose, diagnose_sources
from .spec import DiagnoseSpec, parse_patches
from .summary import summarize

__all__ = ["DiagnoseSpec", "Plan", "diagnose", "diagnose_model", "diagnose_sources", "parse_patches", "summarize"]
