"""Each registered norm trains as its formula does (Liger-Kernel's `test/convergence/`, STYLE.md item 10).

A tiny Llama patched with the norm (retrofit's kernels, fp32) and its twin whose attention is tests/reference.py's
float64 formula, both starting from the same weights, the norm's parameters included (randomized first, so no norm
starts at an identity: AVNorm's gains, which retrofit.calibrate sets on a pretrained model, too), take the same
AdamW steps on one fixed batch: their loss curves agree step by step, their final parameters agree, and the loss
falls. Parity at one forward (tests/patch/test_patch.py) cannot see a backward
that is wrong only for the norm's own parameters, or for what several steps compound; this can.

The norms come from the registry (`available_norms()`, each with its `example_options`), so a new norm is trained
here as soon as it is registered; it passes once tests/reference.py computes it from its formula. Variants the
reference writes out (AVNorm's three kinds, softmax+1's fixed sink) are added because they cost ~0.1 s each.

Tolerances. One forward of the two twins agrees to fp32 rounding (the reference rounds its float64 output to fp32;
the rest of both models is the same fp32 code). Over 10 steps AdamW compounds that: its update m / sqrt(v) ignores
a gradient's scale, so small differences in small gradient components become lr-sized differences in the update.
Measured here (torch 2.13, CPU, 1 or 2 threads): on this batch losses within 2.1e-7 relative at every step and
parameters within 2.5e-5; over five other batches, 7.4e-7 and 1.5e-4. Asserted: losses rtol 1e-5 (13x the worst
seen) and parameters atol 1e-3 (1% of the 0.1 that 10 steps at lr 1e-2 can move a parameter). A norm whose
parameters never train is far outside both (`test_the_comparison_sees_untrained_norm_parameters`: losses 4e-5 to
3e-3 apart, its parameters ~0.1 apart).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import retrofit
from retrofit.norms import available_norms, get_norm
from tests.reference import reference_model
from tests.tiny import random_ids, randomize_patch, tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")
STEPS, LR = 10, 1e-2
LOSS_RTOL, PARAM_ATOL = 1e-5, 1e-3  # see the module docstring
VARIANTS = [(name, get_norm(name).example_options) for name in available_norms()] + [
    ("avnorm", {"kind": "layer"}), ("avnorm", {"kind": "global"}), ("softmax1", {"learnable": False}),
]
IDS = [name + "".join(f"-{k}={v}" for k, v in options.items()) for name, options in VARIANTS]


def twins(norm: str, options: dict):
    """(patched, reference): a tiny Llama patched with `norm`, its norm parameters randomized in [0.5, 1.5), and its
    float64-reference twin (tests/reference.py) with the same weights, whose copies of those parameters train too."""
    original, patched = tiny_model("llama"), tiny_model("llama")  # the same seed: the same weights
    retrofit.patch(patched, norm, **options)
    randomize_patch(patched)
    reference = reference_model(original, patched, nope=False)
    # reference_model hands the reference detached copies of the norm's tensors; the learned ones become parameters
    # of the reference's attention module (reference_attention reads them from its spec, so gradients reach them).
    norms = {name: m.retrofit for name, m in patched.named_modules() if hasattr(m, "retrofit")}
    for name, module in reference.named_modules():
        if hasattr(module, "reference_spec"):
            params = module.reference_spec["params"]
            for key, _ in norms[name].named_parameters():
                params[key] = nn.Parameter(params[key])
                module.register_parameter("reference_" + key.replace(".", "_"), params[key])
    assert sum(p.numel() for p in reference.parameters()) == sum(p.numel() for p in patched.parameters())
    return patched, reference


def train(model: nn.Module, ids: torch.Tensor) -> list[float]:
    """The loss before each of STEPS AdamW steps on `ids` (next-token loss, training mode)."""
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    losses = []
    for _ in range(STEPS):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def learned(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's parameters by a name both twins share: a norm's `...self_attn.retrofit.gain` and the reference's
    `...self_attn.reference_gain` both become `...self_attn.gain`."""
    rename = {".retrofit.": ".", ".reference_": "."}
    named = {}
    for name, p in model.named_parameters():
        for old, new in rename.items():
            name = name.replace(old, new)
        named[name] = p.detach()
    return named


@pytest.mark.parametrize("norm, options", VARIANTS, ids=IDS)
def test_training_follows_the_reference(norm, options):
    """10 AdamW steps of the patched model and of its float64-reference twin: the same loss at every step and the same
    final parameters, the norm's own included; the loss falls by a fifth and the norm's parameters move (neither a
    frozen model nor a frozen norm passes)."""
    patched, reference = twins(norm, options)
    before = {k: v.clone() for k, v in learned(patched).items()}
    ids = random_ids(4, 16)
    got, want = train(patched, ids), train(reference, ids)
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=LOSS_RTOL, atol=0)
    after, reference_after = learned(patched), learned(reference)
    assert after.keys() == reference_after.keys()
    for name, p in after.items():
        torch.testing.assert_close(p, reference_after[name], atol=PARAM_ATOL, rtol=0, msg=lambda m, n=name: f"{n}: {m}")
    assert got[-1] < 0.8 * got[0], got
    own = [name.replace(".retrofit.", ".") for name, _ in patched.named_parameters() if ".retrofit." in name]
    for name in own:  # the norm's parameters (gains, sinks, s)
        assert not torch.equal(after[name], before[name]), f"{name} did not train"


@pytest.mark.parametrize("norm, options", [("avnorm", {}), ("softmax1", {"learnable": True}), ("ssmax", {})],
                         ids=["avnorm", "softmax1-learnable", "ssmax"])
def test_the_comparison_sees_untrained_norm_parameters(norm, options):
    """The comparison can fail: with the patched twin's norm parameters frozen (a backward that never reaches them),
    its loss curve leaves the reference's beyond LOSS_RTOL within the 10 steps."""
    patched, reference = twins(norm, options)
    frozen = [p for name, p in patched.named_parameters() if ".retrofit." in name]
    assert frozen, f"{norm} {options} has no parameters to freeze"
    for p in frozen:
        p.requires_grad_(False)
    ids = random_ids(4, 16)
    got, want = torch.tensor(train(patched, ids)), torch.tensor(train(reference, ids))
    assert got[0] == pytest.approx(float(want[0]), rel=LOSS_RTOL)  # the same start: only training tells them apart
    assert ((got - want).abs() / want).max() > 10 * LOSS_RTOL
