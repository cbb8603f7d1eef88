"""Resume state is data, never code: a planted pickle in any file a resume reads never runs, and a state that cannot
be read is a one-line refusal, never a silent fresh start.

Whoever crafts a run folder can re-sign its manifest (resume_state.write_manifest), so every case here re-signs: the
manifest catches damage, not intent. The canary is a pickle whose unpickling would write a file; each test asserts
that file never appears. torch.distributed.checkpoint is read in one process (no process group: its no-dist mode),
the same reader train.fsdp uses on every process; accelerate's files through a real `train(..., resume=True)`.
"""

from __future__ import annotations

import pickle
import random
import shutil
from pathlib import Path

import pytest
import torch

from retrofit.errors import RetrofitError
from retrofit.recipe import recipe_from_dict
from retrofit.train import fsdp, resume_state, train
from tests.train.test_checkpoints import Killed, counting_recipe, kill_at

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


class Canary:
    """Unpickled, it writes `path` (pickle calls exec with the code below): the proof that code ran."""

    def __init__(self, path: Path):
        self.path = path

    def __reduce__(self):
        return exec, (f"open({str(self.path)!r}, 'w').write('ran')",)


# ---- torch.distributed.checkpoint (train.fsdp): .metadata and the shards' non-tensor values ------------------------

def _trained() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A layer and its AdamW one step in: tensors (weights, moments, step) and plain values (lr, betas, foreach)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.25)
    model(torch.randn(4, 3)).sum().backward()
    optimizer.step()
    return model, optimizer


def test_sharded_state_reads_back_through_the_data_only_reader(tmp_path):
    """The reader that refuses code still reads what train.fsdp writes: weights, moments, numbers, tuples, None."""
    model, optimizer = _trained()
    fsdp.save_shards(tmp_path, model, optimizer)
    saved_weights, saved_groups = model.weight.detach().clone(), optimizer.state_dict()["param_groups"]
    with torch.no_grad():
        model.weight.zero_()
    optimizer.param_groups[0]["lr"] = 0.0
    fsdp.load_shards(tmp_path, model, optimizer)
    assert torch.equal(model.weight, saved_weights)
    assert optimizer.state_dict()["param_groups"] == saved_groups


@pytest.mark.parametrize("where", [".metadata", "a shard's value"])
def test_a_pickle_planted_in_sharded_state_never_runs(where, tmp_path):
    """torch reads .metadata with pickle.load and a shard's non-tensor values (AdamW's lr) with
    torch.load(weights_only=False): on 25e7ae4 either ran the planted code on `retrofit train ... --resume`."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    canary, (model, optimizer) = tmp_path / "ran", _trained()
    folder = tmp_path / "step"
    fsdp.save_shards(folder, model, optimizer)
    if where == ".metadata":
        (folder / fsdp.SHARDS / ".metadata").write_bytes(pickle.dumps(Canary(canary)))
    else:  # the same checkpoint, with a value that runs code when torch.load unpickles it in full
        states = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optimizer)}
        states["optim"]["param_groups"][0]["lr"] = Canary(canary)
        shutil.rmtree(folder / fsdp.SHARDS)
        dcp.save(states, checkpoint_id=str(folder / fsdp.SHARDS))
    with pytest.raises(RetrofitError) as caught:
        fsdp.load_shards(folder, model, optimizer)
    assert not canary.exists()
    message = str(caught.value)
    assert "\n" not in message and str(folder / fsdp.SHARDS) in message and "not data" in message, message


def test_a_planted_metadata_is_one_line_and_torch_logs_no_traceback(tmp_path, caplog, capfd):
    """Issue 61 item 12: dcp.load logged two tracebacks (the allow-list's UnpicklingError, then FileNotFoundError for
    the rank-local __0.metadata it falls back to) before retrofit's one line; the metadata is now read first."""
    model, optimizer = _trained()
    fsdp.save_shards(tmp_path, model, optimizer)
    (tmp_path / fsdp.SHARDS / ".metadata").write_bytes(pickle.dumps(Canary(tmp_path / "ran")))
    with caplog.at_level("DEBUG"), pytest.raises(RetrofitError, match=r"fsdp/\.metadata is not data"):
        fsdp.load_shards(tmp_path, model, optimizer)
    assert not (tmp_path / "ran").exists()
    assert [r.getMessage() for r in caplog.records if r.exc_info or r.levelname in ("WARNING", "ERROR")] == []
    assert "Traceback" not in "".join(capfd.readouterr())


# ---- accelerate's files: the RNG states, the optimizer ----------------------------------------------------------

@pytest.fixture(scope="module")
def killed_run(tmp_path_factory) -> Path:
    """A tiny counting run killed after its checkpoint at step 4."""
    root = tmp_path_factory.mktemp("resume")
    torch.set_num_threads(1)
    with pytest.raises(Killed):
        train(recipe_from_dict(counting_recipe(root / "run", steps=6, save_every=4)), callbacks=[kill_at("step", 5)])
    return root / "run"


def _plant(killed_run: Path, tmp_path: Path, name: str, content) -> tuple[Path, Path]:
    """A copy of the killed run with checkpoint step 4's `name` replaced by `content` (bytes, or an object torch.save
    writes) and the manifest signed again; returns (run, the checkpoint)."""
    run = tmp_path / "run"
    shutil.copytree(killed_run, run)
    step = run / resume_state.FOLDER / "step-0000004"
    if isinstance(content, bytes):
        (step / name).write_bytes(content)
    else:
        torch.save(content, step / name)
    resume_state.write_manifest(step)  # re-signed, as whoever planted it would
    return run, step


@pytest.mark.parametrize("name", ["random_states_0.pkl", "optimizer.bin"])
def test_a_pickle_planted_in_accelerates_state_never_runs(name, killed_run, tmp_path):
    canary = tmp_path / "ran"
    run, step = _plant(killed_run, tmp_path, name, Canary(canary))
    with pytest.raises(RetrofitError) as caught:
        train(recipe_from_dict(counting_recipe(run, steps=6, save_every=4)), resume=True)
    assert not canary.exists()
    message = str(caught.value)
    assert "\n" not in message and str(step / name) in message and "not data" in message, message
    assert not (run / "result.json").exists()  # refused: no fresh start either


@pytest.mark.parametrize("content, what", [
    ({"step": 4}, "holds no random_state"),                                    # a dict of the wrong keys
    ({"step": 4, "random_state": "x", "numpy_random_seed": None, "torch_manual_seed": torch.zeros(3)},
     "random_state is not a Python random state"),
    (b"\x00\x01 not a torch file", "not data"),                                # bytes torch cannot read
], ids=["missing-keys", "wrong-types", "garbage"])
def test_a_replaced_rng_state_is_refused_not_swallowed(content, what, killed_run, tmp_path, capsys):
    """accelerate logs "Could not load random states" and goes on: the run said it resumed, with another RNG."""
    run, step = _plant(killed_run, tmp_path, "random_states_0.pkl", content)
    capsys.readouterr()
    with pytest.raises(RetrofitError) as caught:
        train(recipe_from_dict(counting_recipe(run, steps=6, save_every=4)), resume=True)
    message = str(caught.value)
    assert "\n" not in message and str(step / "random_states_0.pkl") in message and what in message, message
    assert "resumed from" not in capsys.readouterr().out


def test_a_resume_restores_every_rng_from_its_own_file(killed_run, tmp_path, monkeypatch):
    """The RNG states are read and set by retrofit (not left to accelerate's try/except): right after the checkpoint
    is restored, Python's and torch's generators are what its file says."""
    run = tmp_path / "run"
    shutil.copytree(killed_run, run)
    saved = torch.load(run / resume_state.FOLDER / "step-0000004" / "random_states_0.pkl", weights_only=False)
    random.seed(1234)
    torch.manual_seed(1234)  # anything but the saved states
    real, seen = resume_state.load_checkpoint, {}

    def restored(*args, **kwargs):
        real(*args, **kwargs)
        seen.update(random=random.getstate(), torch=torch.get_rng_state())
        raise Killed("look, then stop")

    monkeypatch.setattr(resume_state, "load_checkpoint", restored)
    with pytest.raises(Killed):
        train(recipe_from_dict(counting_recipe(run, steps=6, save_every=4)), resume=True)
    assert seen["random"] == saved["random_state"]
    assert torch.equal(seen["torch"], saved["torch_manual_seed"])
