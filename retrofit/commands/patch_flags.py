"""The norms' options as `retrofit patch` flags, written out so that building the parser imports no norm (no torch):
`retrofit patch --help` and an argument error then take a fraction of a second.

Generated from the norms' Options dataclasses (each option is declared once, in its norm's file):
`python -m retrofit.commands.patch_flags` prints the table to paste here; tests/cli/test_cli_habits.py fails when a
norm's options change and this table was not regenerated. option -> (type: "str" | "int" | "float" | None = a
switch, the norms that have it, its doc); NAMES: the registered norms (--norm's help).
"""

NAMES = ['avnorm', 'psoftmax', 'softmax', 'softmax1', 'ssmax']
FLAGS = {'kind': ('str', ['avnorm'], 'rms | layer | global'),
 'affine': (None, ['avnorm'], 'add a learned per-channel weight (and bias for layer/global)'),
 'eps': ('float', ['avnorm'], 'added to the variance before the square root'),
 'gain': ('float', ['avnorm', 'psoftmax'], 'initial per-head gain; retrofit.calibrate() overwrites it'),
 'floor': ('float',
           ['avnorm'],
           'kind=rms: per-head floor eps = floor * gain under the RMS; 0 = AVNorm, large (inf) = the original model; '
           'recovery.schedule anneals it to 0'),
 'mode': ('str',
          ['avnorm'],
          "always (normalize every token) | beyond (the original model inside L; beyond it each head's output times "
          '(n / L)^b_h, b_h calibrated and trainable)'),
 'exponent': ('float',
              ['avnorm'],
              'mode=beyond: initial b_h (0 = the original model everywhere); retrofit.calibrate() fits it per head'),
 'ref_len': ('int', ['avnorm', 'ssmax'], "mode=beyond: L; default the model's original max positions (before rope=)"),
 'p': ('float', ['psoftmax'], "the norm's order, >= 1 (1 = softmax, 2 = L2 softmax)"),
 'learnable': (None, ['softmax1'], 'learn a per-head sink logit b_h (init `sink`) instead of a fixed one'),
 'sink': ('float',
          ['softmax1'],
          'the sink logit b_h (learnable: its initial value); very negative = the original softmax, 0 = softmax+1'),
 'stack': (None,
           ['softmax1', 'ssmax'],
           'allow on models with learned sinks of their own (gpt_oss): both sinks count'),
 'scale': ('str', ['ssmax'], 'learned (s_h*log n) | beyond (max(1, log n/log L)) | llama4 (floored)'),
 's_init': ('float', ['ssmax'], 'learned: initial s; default 1/log(ref_len) (factor exactly 1 there)'),
 'beta': ('float', ['ssmax'], "llama4: strength; default 0.1 (Llama 4's attn_scale)"),
 'blend': ('float', ['ssmax'], 'alpha in factor 1 + alpha * (f(n) - 1): 0 = the original model, 1 = SSMax')}


def norm_flags() -> dict[str, dict]:
    """Every option of every registered norm as a flag: option -> {type (None = a switch), norms, doc}.

    Generated from the norms' Options dataclasses (each option is declared once, in its norm's file); only
    flags the user set are passed, so an option the chosen norm lacks is an error naming its options.
    FLAGS above holds its output, so that parsing imports no norm."""
    import dataclasses
    import typing

    from ..norms import NORMS

    flags: dict[str, dict] = {}
    for name, cls in sorted(NORMS.items()):
        hints = typing.get_type_hints(cls.Options)
        for f in dataclasses.fields(cls.Options):
            kinds = [t for t in (typing.get_args(hints[f.name]) or (hints[f.name],)) if t is not type(None)]
            kind = None if kinds == [bool] else kinds[0] if kinds[0] in (int, float, str) else str
            entry = flags.setdefault(f.name, {"type": kind, "norms": [], "doc": (f.metadata or {}).get("doc", "")})
            entry["norms"].append(name)
    return flags


def generated() -> str:
    """The table as this file writes it, from the registry (imports every norm, and so torch)."""
    import pprint

    from ..norms import available_norms

    table = {k: (v["type"].__name__ if v["type"] else None, v["norms"], v["doc"]) for k, v in norm_flags().items()}
    return f"NAMES = {available_norms()!r}\n" + "FLAGS = " + pprint.pformat(table, width=118, sort_dicts=False)


if __name__ == "__main__":
    print(generated())
