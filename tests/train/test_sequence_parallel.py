"""Ulysses sequence parallelism on CPU (2 processes, gloo): for every norm, GQA with fewer KV heads than ranks,
eager, GPT-2's learned positions and LoRA + gradient checkpointing, the sharded forward's logits and gradients
equal one process's (fp32, 1e-5), under retrofit's all-to-all and under DeepSpeed's ALST around retrofit's adapter;
`retrofit train` with train.sequence_parallel: 2 under train.fsdp logs one process's losses, saves an unsharded
model, and a killed run resumes bitwise from its sharded checkpoint; 2 groups of 2 train like one process under DDP,
FSDP2 and FSDP2 + LoRA. Five launches (the first also runs every parity case; one runs them under ALST)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

import retrofit
from retrofit.errors import RetrofitError
from retrofit.recipe import load_recipe, recipe_from_dict
from retrofit.train import read_log, resume_state, train
from retrofit.train.fsdp import check_fsdp_recipe
from retrofit.train.losses import loss_sum
from retrofit.train.sequence_parallel import SequenceLayout, plan_sequence_layout, shard
from retrofit.train.sequence_parallel import sharded as sharded_model
from tests.train.sequence_parallel_common import CASES, batch, build, grads
from tests.train.test_train import lm_recipe, losses_of, write_corpus

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch built without distributed")


def launch(out: Path, *args: str, processes: int = 2) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "TOKENIZERS_PARALLELISM": "false"}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(processes),
               str(ROOT / "tests" / "train" / "sequence_parallel_worker.py"), str(out), *args]
    with subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as proc:
        try:
            stdout, stderr = proc.communicate(timeout=300)
        except subprocess.TimeoutExpired:
            proc.terminate()  # SIGTERM: torchrun ends its workers (they run in sessions of their own)
            stdout, stderr = proc.communicate(timeout=30)
            raise AssertionError(f"the launch timed out: {stderr[-3000:]}") from None
    return subprocess.CompletedProcess(command, proc.returncode, stdout, stderr)


def sp_recipe(folder: Path, name: str, sequence_parallel: int = 2, save_every: int = 4, **train) -> Path:
    """lm on a tiny Llama with SSMax (a per-head parameter), gradient checkpointing, 10 steps, a checkpoint every 4."""
    raw = lm_recipe(folder, folder / name, sequence_parallel=sequence_parallel, gradient_checkpointing=True, **train)
    raw["patch"] = {"norm": "ssmax"}
    raw["output"]["save_every"] = save_every
    path = folder / f"{name}.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    """One launch: every parity case, then the uninterrupted sequence-parallel training run (folder/full), FSDP2
    over both processes of its one sequence group (train.fsdp), a checkpoint every 4 steps."""
    folder = write_corpus(tmp_path_factory.mktemp("sp"))
    proc = launch(folder, str(sp_recipe(folder, "full", fsdp=True)))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return folder


@pytest.fixture(scope="module")
def one(launched):
    """The reference: the same recipe trained by one process."""
    return train(load_recipe(sp_recipe(launched, "one", sequence_parallel=1)))


def same_training(folder: Path, run: str, one) -> None:
    """`run`'s logged losses and gradient norms are one process's (1e-5: AdamW hides a gradient's scale, the norm
    shows it); its unsharded model reloads with one process's weights."""
    got = losses_of(folder / run)
    assert sorted(got) == sorted(one.losses) == list(range(1, 11))
    assert max(abs(got[s] - one.losses[s]) for s in got) <= 1e-5, (run, got, one.losses)
    logs = (read_log(f / "log.jsonl") for f in (folder / run, one.run_dir))
    norms = [[r["grad_norm"] for r in log if "grad_norm" in r] for log in logs]
    assert len(norms[0]) == 10 and norms[0] == pytest.approx(norms[1], rel=1e-5, abs=0), (run, norms)
    reloaded = retrofit.from_pretrained(str(folder / run)).state_dict()  # unsharded: one process loads it
    for name, weight in one.model.state_dict().items():
        torch.testing.assert_close(reloaded[name], weight, rtol=0, atol=1e-4, msg=f"{run}: {name}")


@pytest.fixture(scope="module")
def sharded(launched):
    return torch.load(launched / "sharded.pt")


@pytest.fixture(scope="module")
def alst_sharded(tmp_path_factory):
    """One launch: every parity case sharded by DeepSpeed's ALST around retrofit's adapter (the engine's sequence
    parallelism under train.deepspeed or an accelerate DeepSpeed config)."""
    out = tmp_path_factory.mktemp("alst")
    proc = launch(out, "", "alst")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return torch.load(out / "alst.pt")


@pytest.mark.parametrize("case", list(CASES))
def test_sharded_logits_and_gradients_equal_one_process(case, sharded):
    same_as_one_process(case, sharded[case])


@pytest.mark.parametrize("case", list(CASES))
def test_alst_sharded_logits_and_gradients_equal_one_process(case, alst_sharded):
    same_as_one_process(case, alst_sharded[case])


def same_as_one_process(case: str, got: dict) -> None:
    torch.set_num_threads(1)
    model = build(case)
    loss = loss_sum(model, batch(), "lm")
    loss.backward()
    with torch.no_grad():
        logits = model(input_ids=batch()["input_ids"], use_cache=False).logits
    # fp32: 1e-5. bf16: one bf16 rounding (2^-8 relative) where a sum runs over T/N rows and two halves, not T
    half = case.startswith("bf16")
    tol = dict(rtol=2e-2, atol=2e-2) if half else dict(rtol=0, atol=1e-5)
    torch.testing.assert_close(got["logits"], logits, **tol)
    torch.testing.assert_close(got["loss"], loss.detach(), **(tol if half else dict(rtol=1e-6, atol=1e-5)))
    reference = grads(model)
    assert got["grads"].keys() == reference.keys() and reference
    for name, g in reference.items():
        torch.testing.assert_close(got["grads"][name], g, **tol, msg=name)
    patch_grads = [g for n, g in reference.items() if ".retrofit." in n]
    assert all(g.abs().min() > 0 for g in patch_grads)  # every head of a per-head parameter got its gradient


def test_shard_scores_the_token_after_a_boundary():
    layout = SequenceLayout(size=2, rank=0, data_rank=0, data_size=1)
    part = shard(batch(), layout)
    ids = batch()["input_ids"]
    assert torch.equal(part["shift_labels"][:, -1], ids[:, 8])  # rank 0's last token predicts rank 1's first
    assert torch.equal(shard(batch(), SequenceLayout(2, 1, 0, 1))["position_ids"][0], torch.arange(8, 16))
    with pytest.raises(RetrofitError, match="not a multiple of train.sequence_parallel"):
        shard({"input_ids": ids[:, :15]}, layout)
    with pytest.raises(RetrofitError, match="padded rows"):
        shard({**batch(), "attention_mask": torch.ones_like(ids).index_fill(1, torch.tensor([0]), 0)}, layout)


def test_training_matches_one_process_and_a_killed_run_resumes_bitwise(launched, one):
    folder = launched
    same_training(folder, "full", one)
    assert one.losses[10] < one.losses[1]  # it trained
    full = losses_of(folder / "full")
    killed = sp_recipe(folder, "killed", fsdp=True)
    proc = launch(folder, str(killed), "kill:7")  # both processes kill themselves after step 7
    assert proc.returncode != 0 and not (folder / "killed" / "result.json").exists()
    [(step, path)] = resume_state.complete_checkpoints(folder / "killed")
    assert step == 4 and not list(path.glob("*.safetensors")) and not list(path.glob("optimizer*"))
    assert sorted(p.name for p in (path / "fsdp").iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    proc = launch(folder, str(killed), "resume")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resumed from" in proc.stdout + proc.stderr
    assert losses_of(folder / "killed") == full  # bitwise: the same floats in the log
    saved, resumed = (load_file(folder / run / "model.safetensors") for run in ("full", "killed"))
    assert saved.keys() == resumed.keys() and all(torch.equal(saved[k], resumed[k]) for k in saved)


def test_two_groups_of_two_train_like_one_process_with_ddp_fsdp2_and_lora(launched, one):
    """4 processes: 2 sequence groups of 2 (data parallel across groups), under DDP, then under FSDP2 over all
    4 (train.fsdp), then FSDP2 with LoRA: the same global batch, so one process's losses, weights and adapter."""
    folder = launched
    lora = {"r": 4, "save": "adapter"}
    recipes = [sp_recipe(folder, "groups-ddp", save_every=0), sp_recipe(folder, "groups-fsdp", save_every=0, fsdp=True),
               sp_recipe(folder, "groups-lora", save_every=8, fsdp=True, peft=lora)]
    proc = launch(folder, ",".join(map(str, recipes)), "groups", processes=4)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "4 process(es)" in proc.stdout + proc.stderr
    for run in ("groups-ddp", "groups-fsdp"):
        same_training(folder, run, one)
    alone = train(load_recipe(sp_recipe(folder, "one-lora", sequence_parallel=1, save_every=0, peft=lora)))
    got = losses_of(folder / "groups-lora")
    assert sorted(got) == list(range(1, 11)) and max(abs(got[s] - alone.losses[s]) for s in got) <= 1e-5
    sharded, single = (load_file(folder / run / "adapter" / "adapter_model.safetensors")
                       for run in ("groups-lora", "one-lora"))
    assert sharded.keys() == single.keys() and any("lora_B" in k for k in single)
    for name, weight in single.items():
        torch.testing.assert_close(sharded[name], weight, rtol=0, atol=1e-4, msg=name)
    from torch.distributed.checkpoint import FileSystemReader
    _, path = resume_state.complete_checkpoints(folder / "groups-lora")[-1]  # the last step's
    keys = FileSystemReader(str(path / "fsdp")).read_metadata().state_dict_metadata
    assert any("lora_A" in k for k in keys) and not any("base_layer" in k for k in keys)  # the frozen base: not saved


def test_what_sequence_parallelism_cannot_run_is_refused_in_one_line(tmp_path):
    from tests.tiny import tiny_model
    three = SequenceLayout(size=3, rank=0, data_rank=0, data_size=1)
    with pytest.raises(RetrofitError, match="4 attention heads cannot be split over train.sequence_parallel 3"):
        with sharded_model(tiny_model("llama"), three):
            pass
    with pytest.raises(RetrofitError, match="sliding-window"):
        with sharded_model(tiny_model("gemma2"), SequenceLayout(2, 0, 0, 1)):
            pass
    raw = lm_recipe(tmp_path, tmp_path / "run", sequence_parallel=2)
    with pytest.raises(RetrofitError, match="train.sequence_parallel must be >= 1"):
        recipe_from_dict({**raw, "train": {**raw["train"], "sequence_parallel": 0}})
    counting = {**raw, "data": {"task": "counting", "seq_len": 32}}
    with pytest.raises(RetrofitError, match="counting's regression head is not sharded"):
        plan_sequence_layout(recipe_from_dict(counting))
    packed = {**raw, "data": {**raw["data"], "packing": "documents"}}
    with pytest.raises(RetrofitError, match="packing documents .* is not supported"):
        plan_sequence_layout(recipe_from_dict(packed))
    odd = {**raw, "data": {**raw["data"], "seq_len": 33}}
    with pytest.raises(RetrofitError, match="33 is not a multiple of train.sequence_parallel 2"):
        plan_sequence_layout(recipe_from_dict(odd))
    model = tiny_model("llama")
    assert sharded_model(model, None).__enter__() is model  # off: the model as it is
    fsdp = {**raw, "train": {**raw["train"], "fsdp": True}, "output": {**raw["output"], "save_every": 0}}
    check_fsdp_recipe(recipe_from_dict(fsdp), "MULTI_CPU")  # what it runs
    for change, message in [({"train": {**fsdp["train"], "peft": {"r": 4}}}, "saves the adapter only"),
                            ({"train": {**fsdp["train"], "compile": True}}, "train.compile is not built")]:
        with pytest.raises(RetrofitError, match=message):
            check_fsdp_recipe(recipe_from_dict({**fsdp, **change}), "MULTI_CPU")
    with pytest.raises(RetrofitError, match="accelerate already runs FSDP"):
        check_fsdp_recipe(recipe_from_dict(fsdp), "FSDP")
