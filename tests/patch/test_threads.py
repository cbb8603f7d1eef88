"""A patched model under threads and in DataParallel-style replicas (issue 26, item 5): 16 threads on one model give
the single-threaded outputs bitwise, a LoRA-wrapped o_proj normalizes once, and each replica uses its own norm."""

from __future__ import annotations

import pytest

from tests.tiny import randomize_patch, tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


THREAD_NORMS = [("avnorm", {"kind": "rms"}), ("avnorm", {"kind": "layer", "affine": True}),
                ("avnorm", {"floor": 2.0}), ("psoftmax", {"p": 2.0}), ("ssmax", {}), ("softmax1", {"learnable": True}),
                ("avnorm", {"kind": "layer", "gate": "head"}), ("softmax", {"gate": "element:0.5"})]  # issue 55


def randomized(model_type: str, norm: str, options: dict):

    import retrofit

    model = tiny_model(model_type)
    retrofit.patch(model, norm, **options)
    return randomize_patch(model)


def run_in_threads(fns: list) -> list:
    """Call every fn at once, one thread each (started together at a barrier); their results in order."""
    import threading

    results, errors = [None] * len(fns), []
    barrier = threading.Barrier(len(fns))

    def work(i):
        try:
            barrier.wait()
            results[i] = fns[i]()
        except Exception as err:  # noqa: BLE001  (re-raised below, in the test's thread)
            errors.append(err)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(fns))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results


@pytest.mark.parametrize("model_type", ["llama", "gpt2"])
@pytest.mark.parametrize("norm, options", THREAD_NORMS, ids=[f"{n}-{'-'.join(map(str, o.values()))}"
                                                              for n, o in THREAD_NORMS])
def test_16_threads_on_one_model_equal_the_single_threaded_outputs_bitwise(model_type, norm, options):
    import torch

    from tests.tiny import random_ids

    model = randomized(model_type, norm, options)
    inputs = [random_ids(2, 12, seed=s) for s in range(16)]
    with torch.no_grad():
        alone = [model(input_ids=ids).logits for ids in inputs]

        def forward(ids):
            return lambda: [model(input_ids=ids).logits for _ in range(3)]

        together = run_in_threads([forward(ids) for ids in inputs])
    bad = [i for i, outs in enumerate(together) if not all(torch.equal(o, alone[i]) for o in outs)]
    assert not bad, f"threads {bad} differ from their single-threaded outputs"


def test_threads_on_a_lora_wrapped_o_proj_normalize_once(tmp_path):
    """PEFT wraps o_proj after the patch: the first forwards (in 16 threads at once) hook the wrapper exactly once."""
    import torch
    from peft import LoraConfig, get_peft_model

    from retrofit.norms.output_hook import ProjectionHook
    from tests.tiny import random_ids

    model = randomized("llama", "avnorm", {})
    reference = get_peft_model(randomized("llama", "avnorm", {}),
                               LoraConfig(r=4, target_modules=["o_proj"], init_lora_weights=False))
    torch.manual_seed(0)
    lora = get_peft_model(model, LoraConfig(r=4, target_modules=["o_proj"], init_lora_weights=False))
    lora.load_state_dict(reference.state_dict())
    lora.eval(), reference.eval()
    inputs = [random_ids(2, 12, seed=s) for s in range(16)]
    with torch.no_grad():
        together = run_in_threads([lambda ids=ids: lora(input_ids=ids).logits for ids in inputs])
        alone = [reference(input_ids=ids).logits for ids in inputs]
    assert all(torch.equal(a, b) for a, b in zip(together, alone))
    for layer in lora.base_model.model.model.layers:
        wrapper = layer.self_attn.o_proj
        assert sum(isinstance(h, ProjectionHook) for h in wrapper._forward_pre_hooks.values()) == 1


def test_data_parallel_replicas_each_use_their_own_norm(monkeypatch):
    """nn.DataParallel's replicate (its broadcast emulated on CPU) shares hook tables between replicas: each replica,
    run concurrently, must still normalize with its own norm's parameters (here: different gains per replica)."""
    import copy
    import sys as _sys

    import torch
    import torch.nn.parallel  # noqa: F401  (loads torch.nn.parallel.replicate)

    from tests.tiny import random_ids

    replicate_module = _sys.modules["torch.nn.parallel.replicate"]
    monkeypatch.setattr(replicate_module, "_broadcast_coalesced_reshape",
                        lambda tensors, devices, detach=False: [[t.detach().clone() for t in tensors] for _ in devices])
    model = randomized("llama", "avnorm", {})
    replicas = replicate_module.replicate(model, list(range(8)), detach=True)
    expected = []
    for j, replica in enumerate(replicas):
        twin = copy.deepcopy(model)
        for (name, module), (_, twin_module) in zip(replica.named_modules(), twin.named_modules()):
            if name.endswith("self_attn.retrofit"):
                module.gain = module.gain * (j + 2)  # the replica's own tensor, as DataParallel sets it
                twin_module.gain.data.mul_(j + 2)
        expected.append(twin)
    ids = random_ids(2, 12)
    with torch.no_grad():
        outs = run_in_threads([lambda r=r: [r(input_ids=ids).logits for _ in range(5)] for r in replicas])
        for j, twin in enumerate(expected):
            assert all(torch.equal(o, twin(input_ids=ids).logits) for o in outs[j]), f"replica {j}"
        assert not torch.equal(expected[0](input_ids=ids).logits, model(input_ids=ids).logits)
        plain = model(input_ids=ids).logits  # the original is untouched by its replicas
        assert torch.equal(plain, copy.deepcopy(model)(input_ids=ids).logits)
