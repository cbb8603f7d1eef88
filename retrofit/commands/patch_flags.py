"""`retrofit patch`'s norm flags, built when the parser is built from each norm's declared options.

The registry's options (each norm's Options dataclass: its fields' names, types and docs) are written out below as
OPTIONS, because reading them from the registry imports every norm, and so torch: `retrofit patch --help` takes
0.05 s with the table and 2.7 s through the registry (the import alone), and an argument error as long. The table is
the registry's, field by field, and nothing else: each norm is named once, as the key of its options.
`python -m retrofit.commands.patch_flags` prints it to paste here; tests/cli/test_cli_habits.py fails while it is
stale. norm -> {option: (type: "str" | "int" | "float" | None = a switch, its doc)}.
"""

OPTIONS = {'avnorm': {'kind': ('str', 'rms | layer | global'),
            'affine': (None, 'add a learned per-channel weight (and bias for layer/global)'),
            'eps': ('float', 'added to the variance before the square root'),
            'gain': ('float', 'initial per-head gain; retrofit.calibrate() overwrites it'),
            'floor': ('float',
                      'kind=rms: per-head floor eps = floor * gain under the RMS; 0 = AVNorm, large (inf) = the '
                      'original model; recovery.schedule anneals it to 0'),
            'mode': ('str',
                     "always (normalize every token) | beyond (the original model inside L; beyond it each head's "
                     'output times (n / L)^b_h, b_h calibrated and trainable)'),
            'exponent': ('float',
                         'mode=beyond: initial b_h (0 = the original model everywhere); retrofit.calibrate() fits it '
                         'per head'),
            'ref_len': ('int', "mode=beyond: L; default the model's original max positions (before rope=)")},
 'psoftmax': {'p': ('float', "the norm's order, >= 1 (1 = softmax, 2 = L2 softmax)"),
              'gain': ('float',
                       'initial per-head output gain (learned); retrofit.calibrate() sets it from text; null = no '
                       'gain')},
 'softmax': {},
 'softmax1': {'learnable': (None, 'learn a per-head sink logit b_h (init `sink`) instead of a fixed one'),
              'sink': ('float',
                       'the sink logit b_h (learnable: its initial value); very negative = the original softmax, 0 = '
                       'softmax+1'),
              'stack': (None, 'allow on models with learned sinks of their own (gpt_oss): both sinks count')},
 'ssmax': {'scale': ('str', 'learned (s_h*log n) | beyond (max(1, log n/log L)) | llama4 (floored)'),
           's_init': ('float', 'learned: initial s; default 1/log(ref_len) (factor exactly 1 there)'),
           'ref_len': ('int', "L: default the model's original max positions (before rope=)"),
           'beta': ('float', "llama4: strength; default 0.1 (Llama 4's attn_scale)"),
           'stack': (None, 'allow on models that already scale queries by position (Llama 4)'),
           'blend': ('float', 'alpha in factor 1 + alpha * (f(n) - 1): 0 = the original model, 1 = SSMax')}}

TYPES = {"str": str, "int": int, "float": float}


def declared_options() -> dict[str, dict[str, tuple]]:
    """Every registered norm's options as OPTIONS writes them, read from the registry (imports every norm, and so
    torch): norm -> {option: (type name, or None for a bool switch; doc)}, in the order its Options declares them."""
    import dataclasses
    import typing

    from ..norms import NORMS

    table: dict[str, dict[str, tuple]] = {}
    for name, cls in sorted(NORMS.items()):
        hints = typing.get_type_hints(cls.Options)
        table[name] = {}
        for f in dataclasses.fields(cls.Options):
            kinds = [t for t in (typing.get_args(hints[f.name]) or (hints[f.name],)) if t is not type(None)]
            kind = None if kinds == [bool] else kinds[0].__name__ if kinds[0] in (int, float, str) else "str"
            table[name][f.name] = (kind, (f.metadata or {}).get("doc", ""))
    return table


def norm_flags(options: dict[str, dict[str, tuple]] = OPTIONS) -> dict[str, dict]:
    """One flag per option any norm declares: option -> {type (None = a switch), norms (that declare it), doc (each
    norm's, prefixed by the norms that share it)}. Only flags the user set are passed on, so an option the chosen
    norm lacks is the PatchSpec's error naming that norm's options."""
    flags: dict[str, dict] = {}
    for norm, declared in sorted(options.items()):
        for option, (kind, doc) in declared.items():
            flag = flags.setdefault(option, {"type": TYPES.get(kind) if kind else None, "norms": [], "docs": {}})
            if flag["type"] != (TYPES.get(kind) if kind else None):
                raise ValueError(f"norms {flag['norms'][0]!r} and {norm!r} declare option {option!r} with different "
                                 "types; one flag takes one type: give one of them another name")
            flag["norms"].append(norm)
            flag["docs"].setdefault(doc, []).append(norm)
    for flag in flags.values():
        flag["doc"] = "; ".join(f"{'/'.join(norms)}: {doc}" for doc, norms in flag.pop("docs").items())
    return flags


def add_norm_flags(parser, options: dict[str, dict[str, tuple]] = OPTIONS) -> dict[str, dict]:
    """Add `--option` for every norm_flags(options) entry to `parser` (default None: not given); returns the flags."""
    flags = norm_flags(options)
    for option, flag in flags.items():
        name = "--" + option.replace("_", "-")
        if flag["type"] is None:
            parser.add_argument(name, dest=option, action="store_const", const=True, default=None, help=flag["doc"])
        else:
            parser.add_argument(name, dest=option, type=flag["type"], default=None, help=flag["doc"])
    return flags


def generated() -> str:
    """OPTIONS as this file writes it, from the registry (imports every norm, and so torch)."""
    import pprint

    return "OPTIONS = " + pprint.pformat(declared_options(), width=118, sort_dicts=False)


if __name__ == "__main__":
    print(generated())
