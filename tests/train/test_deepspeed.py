"""DeepSpeed ZeRO through `accelerate launch --config_file` on 2 CPU processes (DeepSpeed's CPU accelerator, gloo):
ZeRO-3 logs one process's losses (rel 1e-4) for softmax, p-softmax, SSMax, AVNorm and softmax+1, saves the gathered
model (one process's weights), trains LoRA (adapter = one process's) and the counting head (GPT-2, tied embeddings);
with train.sequence_parallel: 2 (DeepSpeed's ALST sharing each row, ZeRO-3 beneath) every norm logs the same losses;
a killed ZeRO-3 run resumes bitwise, reading DeepSpeed's files with weights_only; ZeRO-2 trains like one process.
Three launches of the ZeRO-3 config (every run, the kill, the resume), one of ZeRO-2, one of 4 processes."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import deepspeed  # noqa: F401  (the `test` extra installs it; CI builds its one op before pytest)
import pytest
import torch
import yaml
from safetensors.torch import load_file

from retrofit.recipe import load_recipe
from retrofit.train import resume_state, train
from tests.train.test_checkpoints import counting_recipe
from tests.train.test_train import lm_recipe, losses_of, write_corpus

ROOT = Path(__file__).resolve().parents[2]
WORKER = ROOT / "tests" / "train" / "deepspeed_worker.py"
NORMS = {"softmax": {"norm": "softmax"}, "psoftmax": {"norm": "psoftmax", "p": 2, "gain": 1.0},
         "ssmax": {"norm": "ssmax"}, "avnorm": {"norm": "avnorm"},
         "softmax1": {"norm": "softmax1", "learnable": True}}


def accelerate_config(folder: Path, stage: int, json_file: bool = False) -> Path:
    """What `accelerate config` writes for DeepSpeed ZeRO-`stage` on one machine, two processes: its own keys, or
    (json_file) a DeepSpeed JSON config file it names, here with every parameter partitioned (DeepSpeed keeps
    parameters under 100,000 elements whole by default: every weight of a tiny model)."""
    path = folder / f"ds_zero{stage}{'-json' if json_file else ''}.yaml"
    keys = {"zero_stage": stage, "zero3_init_flag": False, "zero3_save_16bit_model": False,
                 "gradient_accumulation_steps": 1, "offload_optimizer_device": "none", "offload_param_device": "none"}
    config = {"compute_environment": "LOCAL_MACHINE", "distributed_type": "DEEPSPEED", "num_machines": 1,
              "num_processes": 2, "machine_rank": 0, "mixed_precision": "no", "use_cpu": False,
              "deepspeed_config": keys}
    if json_file:
        ds = folder / f"ds_zero{stage}.json"
        ds.write_text(json.dumps({"zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
                                  "train_micro_batch_size_per_gpu": "auto", "gradient_clipping": "auto"}))
        config.pop("mixed_precision")  # accelerate refuses keys its JSON file would set
        config["deepspeed_config"] = {"deepspeed_config_file": str(ds), "zero3_init_flag": False}
    path.write_text(yaml.safe_dump(config))
    return path


def launch(config: Path, recipes: list[Path], mode: str = "full") -> subprocess.CompletedProcess:
    accelerate = Path(sys.executable).parent / "accelerate"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "TOKENIZERS_PARALLELISM": "false"}
    from tests.train.test_launchers import free_port  # accelerate's default port would be shared by parallel launches
    command = [str(accelerate), "launch", "--config_file", str(config), "--main_process_port", str(free_port()),
               str(WORKER), ",".join(map(str, recipes)), mode]
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=400, cwd=config.parent)


def recipe_file(folder: Path, name: str, raw: dict) -> Path:
    path = folder / f"{name}.yaml"
    raw["output"]["dir"] = str(folder / name)
    path.write_text(yaml.safe_dump(raw))
    return path


def norm_recipe(folder: Path, name: str, patch: dict, **train_keys) -> Path:
    """lm on a tiny Llama: 6 steps of a global batch of 4 (one micro-batch of 2 on each of two processes), no
    checkpoint unless asked."""
    raw = lm_recipe(folder, folder / name, steps=6, **train_keys)
    raw["patch"], raw["output"]["save_every"], raw["eval"]["every"] = patch, 0, 3
    return recipe_file(folder, name, raw)


@pytest.fixture(scope="module")
def zero3(tmp_path_factory):
    """One launch of a ZeRO-3 accelerate config (naming a DeepSpeed JSON file) trains, in turn: every norm, LoRA,
    the counting head and SSMax with a checkpoint every 2 steps (the uninterrupted run of the resume test)."""
    folder = write_corpus(tmp_path_factory.mktemp("zero3"))
    recipes = [norm_recipe(folder, norm, patch) for norm, patch in NORMS.items()]
    recipes += [norm_recipe(folder, f"alst-{norm}", patch, sequence_parallel=2, micro_batch_size=4)
                for norm, patch in NORMS.items()]  # ALST: both processes share each row
    recipes.append(norm_recipe(folder, "lora", NORMS["softmax1"], peft={"r": 4, "save": "adapter"}))
    recipes.append(recipe_file(folder, "counting", counting_recipe(folder / "counting", steps=6, save_every=0)))
    ckpt = norm_recipe(folder, "ckpt", NORMS["ssmax"])
    raw = yaml.safe_load(ckpt.read_text())
    raw["output"]["save_every"] = 2
    ckpt.write_text(yaml.safe_dump(raw))
    recipes.append(ckpt)
    config = accelerate_config(folder, 3, json_file=True)
    done = launch(config, recipes)
    assert done.returncode == 0, done.stderr[-4000:]
    return folder, config, done


ALONE = {}  # (folder, name) -> the one-process run, trained once for the tests that compare with it


def one_process(folder: Path, name: str):
    """The same recipe trained by one process (no launcher, whole rows, accumulating) into folder/NAME-one."""
    if (folder, name) not in ALONE:
        raw = yaml.safe_load((folder / f"{name}.yaml").read_text())
        raw["train"].update(sequence_parallel=1, micro_batch_size=2)
        ALONE[folder, name] = train(load_recipe(recipe_file(folder, f"{name}-one", raw)))
    return ALONE[folder, name]


def same_losses(folder: Path, name: str, one, rel: float = 1e-4) -> None:
    got = losses_of(folder / name)
    assert sorted(got) == sorted(one.losses) == list(range(1, 7)), (name, got)
    worst = max(abs(got[s] - one.losses[s]) / abs(one.losses[s]) for s in got)
    assert worst <= rel, (name, worst, got, one.losses)
    assert one.losses[6] < one.losses[1]  # it trained


@pytest.mark.parametrize("norm", list(NORMS))
def test_zero3_on_two_processes_logs_one_process_losses_and_saves_its_weights(norm, zero3):
    folder, _, _ = zero3
    one = one_process(folder, norm)
    same_losses(folder, norm, one)
    result = json.loads((folder / norm / "result.json").read_text())
    assert result["engine"] == {"name": "deepspeed", "stage": 3, "world": 2, "backend": "gloo", "nodes": 1,
                                "sequence_parallel": 1}
    first = json.loads((folder / norm / "log.jsonl").read_text().splitlines()[0])
    assert first["event"] == "config" and first["engine"] == result["engine"]
    saved, alone = (load_file(folder / run / "model.safetensors") for run in (norm, f"{norm}-one"))
    assert saved.keys() == alone.keys() and any(".retrofit." in k for k in saved) == (norm != "softmax")
    for name, weight in alone.items():  # gathered from both partitions: every weight whole
        torch.testing.assert_close(saved[name], weight, rtol=0, atol=1e-4, msg=f"{norm}: {name}")


@pytest.mark.parametrize("norm", list(NORMS))
def test_alst_under_zero3_logs_one_process_losses_and_saves_its_weights(norm, zero3):
    """train.sequence_parallel: 2 under DeepSpeed: ALST shares each row between the two processes (retrofit's
    adapter slicing the norm's per-head tensors), ZeRO-3 partitions the weights; one process's losses and weights."""
    folder, _, _ = zero3
    one = one_process(folder, norm)
    same_losses(folder, f"alst-{norm}", one)
    engine = json.loads((folder / f"alst-{norm}" / "result.json").read_text())["engine"]
    assert (engine["name"], engine["stage"], engine["sequence_parallel"]) == ("deepspeed", 3, 2)
    saved, alone = (load_file(folder / run / "model.safetensors") for run in (f"alst-{norm}", f"{norm}-one"))
    assert saved.keys() == alone.keys()
    for name, weight in alone.items():
        torch.testing.assert_close(saved[name], weight, rtol=0, atol=1e-4, msg=f"alst {norm}: {name}")


def test_two_alst_groups_of_two_train_like_one_process(zero3):
    """4 processes, train.sequence_parallel: 2: two ALST groups of two, data parallel between them (accelerate sizes
    DeepSpeed's batch from the groups: without that, DeepSpeed refused the batch sizes); one process's losses."""
    folder, _, _ = zero3
    config = yaml.safe_load((folder / "ds_zero3-json.yaml").read_text())
    config["num_processes"] = 4
    (folder / "ds_zero3-4.yaml").write_text(yaml.safe_dump(config))
    recipe = norm_recipe(folder, "alst-groups", NORMS["ssmax"], sequence_parallel=2)
    done = launch(folder / "ds_zero3-4.yaml", [recipe])
    assert done.returncode == 0, done.stderr[-4000:]
    same_losses(folder, "alst-groups", one_process(folder, "ssmax"))
    engine = json.loads((folder / "alst-groups" / "result.json").read_text())["engine"]
    assert (engine["world"], engine["sequence_parallel"]) == (4, 2)


def test_zero3_trains_lora_and_the_counting_head_like_one_process(zero3):
    folder, _, _ = zero3
    same_losses(folder, "lora", one_process(folder, "lora"))
    adapters = [load_file(folder / run / "adapter" / "adapter_model.safetensors") for run in ("lora", "lora-one")]
    assert adapters[0].keys() == adapters[1].keys() and any("lora_B" in k for k in adapters[1])
    for name, weight in adapters[1].items():
        torch.testing.assert_close(adapters[0][name], weight, rtol=0, atol=1e-4, msg=name)
    one = one_process(folder, "counting")
    got = losses_of(folder / "counting")
    assert max(abs(got[s] - one.losses[s]) / one.losses[s] for s in got) <= 1e-4, (got, one.losses)
    heads = [load_file(folder / run / "task_head.safetensors") for run in ("counting", "counting-one")]
    assert heads[0].keys() == heads[1].keys() == {"weight", "bias"}
    for name, weight in heads[1].items():
        torch.testing.assert_close(heads[0][name], weight, rtol=0, atol=1e-4, msg=name)


def test_a_killed_zero3_run_resumes_bitwise_reading_its_files_weights_only(zero3):
    folder, config, _ = zero3
    raw = yaml.safe_load((folder / "ckpt.yaml").read_text())
    killed = recipe_file(folder, "killed", raw)
    done = launch(config, [killed], "kill:5")  # both processes kill themselves after step 5
    assert done.returncode != 0 and not (folder / "killed" / "result.json").exists()
    [*_, (step, path)] = resume_state.complete_checkpoints(folder / "killed")
    assert step == 4 and sorted(p.name for p in (path / "deepspeed" / "state").glob("*_states.pt")) == [
        f"zero_pp_rank_{r}_mp_rank_00_{kind}_states.pt" for r in (0, 1) for kind in ("model", "optim")]
    done = launch(config, [killed], "resume")
    assert done.returncode == 0, done.stderr[-4000:]
    assert "resumed from" in done.stdout + done.stderr
    assert losses_of(folder / "killed") == losses_of(folder / "ckpt")  # bitwise: the same floats in the log
    saved, resumed = (load_file(folder / run / "model.safetensors") for run in ("ckpt", "killed"))
    assert saved.keys() == resumed.keys() and all(torch.equal(saved[k], resumed[k]) for k in saved)
    loads = json.loads((folder / "killed" / "loads.json").read_text())
    assert {entry["file"] for entry in loads} >= {"zero_pp_rank_0_mp_rank_00_model_states.pt",
                                                  "zero_pp_rank_0_mp_rank_00_optim_states.pt"}
    assert all(entry["weights_only"] is True for entry in loads), loads


def test_zero2_on_two_processes_logs_one_process_losses(zero3):
    folder, _, _ = zero3
    recipe = norm_recipe(folder, "zero2", NORMS["avnorm"])
    done = launch(accelerate_config(folder, 2), [recipe])
    assert done.returncode == 0, done.stderr[-4000:]
    same_losses(folder, "zero2", one_process(folder, "zero2"))
    assert json.loads((folder / "zero2" / "result.json").read_text())["engine"]["stage"] == 2


def test_the_checkpoint_reader_refuses_a_pickled_object(tmp_path):
    from retrofit.train.zero import safe_checkpoint_engine
    marker = tmp_path / "ran"

    class Planted:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    path = tmp_path / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    path.write_bytes(pickle.dumps({"optimizer_state_dict": Planted()}))
    with pytest.raises(pickle.UnpicklingError):
        safe_checkpoint_engine().load(str(path))
    assert not marker.exists()


@pytest.mark.parametrize("damage", ["truncated", "planted"])
def test_a_damaged_zero_shard_is_one_line_naming_it_before_deepspeed_reads(damage, tmp_path):
    """Issue 61 item 5: a truncated optimizer shard (manifest re-signed) was torch's "PytorchStreamReader failed
    reading zip archive" on rank 0 and a lost gloo connection on rank 1; every process now refuses it in one line
    before DeepSpeed's load_checkpoint (the engine here would fail on any attribute: it is never reached)."""
    from retrofit.errors import RetrofitError
    from retrofit.train.zero import FOLDER, TAG, load_state
    state = tmp_path / FOLDER / TAG
    state.mkdir(parents=True)
    torch.save({"module": {"w": torch.ones(3)}}, state / "zero_pp_rank_0_mp_rank_00_model_states.pt")
    shard = state / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    torch.save({"optimizer_state_dict": {"state": {0: torch.zeros(64)}}}, shard)
    if damage == "truncated":
        shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    else:
        shard.write_bytes(pickle.dumps({"optimizer_state_dict": os.system}))
    with pytest.raises(RetrofitError) as caught:
        load_state(tmp_path, engine=None)
    message = str(caught.value)
    assert "\n" not in message and message.startswith(f"{shard} is not data"), message
