"""The config matrix: every launcher x config file x backend either runs the engine it asks for or is refused in one
line (exit 2), and result.json + log.jsonl's first line name the engine, stage and world that ran.

    launcher                config                         backend  -> result
    retrofit train          none                           -        -> single (test_one_process_names_its_engine)
    torchrun, accelerate    none / --multi_gpu             gloo     -> ddp (tests/train/test_launchers.py)
    accelerate launch       DeepSpeed ZeRO-2 / ZeRO-3      gloo     -> deepspeed (tests/train/test_deepspeed.py)
    torchrun                train.deepspeed: ds.json       gloo     -> deepspeed ZeRO-3 (here, launched)
    deepspeed               train.deepspeed: ds.json       gloo     -> deepspeed ZeRO-2 (here, launched)
    deepspeed               none                           -        -> refused (here, launched)
    accelerate launch       FSDP                           gloo     -> refused: needs GPUs (here, launched)
    anything                Megatron / TP / CP / SP config, conflicting precision or compile,
                            a DeepSpeed config whose optimizer, scheduler, micro batch, clipping, precision,
                            zero.Init or offload the recipe would not honor  -> refused (unit tests below)
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from retrofit.errors import RetrofitError
from retrofit.recipe import recipe_from_dict
from retrofit.train import train
from retrofit.train.engine import Asked, check_compile, check_precision, requested
from retrofit.train.zero import configure
from tests.train.test_deepspeed import accelerate_config
from tests.train.test_launchers import free_port
from tests.train.test_train import lm_recipe, write_corpus

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.usefixtures("one_thread")
LAUNCHED = {"LOCAL_RANK": "0", "RANK": "0", "WORLD_SIZE": "2"}


def train_section(**keys):
    return recipe_from_dict({"model": {"config": {"model_type": "llama"}}, "data": {"task": "counting", "seq_len": 32},
                             "train": keys}).train


# ---- what a launch asks for: honored or refused before any process group ----------------------------------------

@pytest.mark.parametrize("env, keys, asked", [
    ({}, {}, Asked(None)),
    (LAUNCHED, {}, Asked(None)),                                              # torchrun / accelerate --multi_gpu
    ({**LAUNCHED, "ACCELERATE_USE_DEEPSPEED": "true"}, {}, Asked("deepspeed")),
    (LAUNCHED, {"deepspeed": "ds.json"}, Asked("deepspeed", "ds.json")),
    ({**LAUNCHED, "ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_USE_PARALLELISM_CONFIG": "true",
      "PARALLELISM_CONFIG_SP_SIZE": "2"}, {"sequence_parallel": 2}, Asked("deepspeed")),  # ALST, as the recipe says
    ({**LAUNCHED, "CROSS_SIZE": "1", "LOCAL_SIZE": "2"}, {"deepspeed": "ds.json"}, Asked("deepspeed", "ds.json")),
])
def test_what_each_launch_asks_for(env, keys, asked):
    assert requested(env, train_section(**keys)) == asked


@pytest.mark.parametrize("env, keys, message", [
    ({**LAUNCHED, "ACCELERATE_USE_FSDP": "true"}, {}, "accelerate's FSDP config needs GPUs .* set train.fsdp: true"),
    ({**LAUNCHED, "ACCELERATE_USE_FSDP": "true"}, {"fsdp": True}, "the accelerate config asks for FSDP too"),
    ({**LAUNCHED, "ACCELERATE_USE_MEGATRON_LM": "true"}, {}, "asks for Megatron-LM"),
    ({**LAUNCHED, "ACCELERATE_USE_PARALLELISM_CONFIG": "true", "PARALLELISM_CONFIG_TP_SIZE": "2"}, {},
     "parallelism_config asks for tp_size 2"),
    ({**LAUNCHED, "ACCELERATE_USE_PARALLELISM_CONFIG": "true", "PARALLELISM_CONFIG_CP_SIZE": "2"}, {},
     "asks for cp_size 2"),
    ({**LAUNCHED, "ACCELERATE_USE_PARALLELISM_CONFIG": "true", "PARALLELISM_CONFIG_SP_SIZE": "2"}, {},
     "asks for sp_size 2: set train.sequence_parallel: 2"),
    ({**LAUNCHED, "ACCELERATE_USE_PARALLELISM_CONFIG": "true", "PARALLELISM_CONFIG_SP_SIZE": "2",
      "ACCELERATE_USE_DEEPSPEED": "true"}, {"sequence_parallel": 4}, "asks for sp_size 2: set train.sequence_parallel"),
    ({**LAUNCHED, "CROSS_SIZE": "1", "LOCAL_SIZE": "2"}, {}, "deepspeed launcher started this run but no DeepSpeed"),
    ({**LAUNCHED, "ACCELERATE_USE_DEEPSPEED": "true"}, {"deepspeed": "ds.json"}, "DeepSpeed is configured twice"),
    ({**LAUNCHED, "ACCELERATE_USE_DEEPSPEED": "true"}, {"fsdp": True}, "train.fsdp shards the model itself and "),
    ({}, {"deepspeed": "ds.json"}, "train.deepspeed needs a launcher"),
])
def test_what_retrofit_cannot_run_is_refused_in_one_line(env, keys, message):
    with pytest.raises(RetrofitError, match=message) as err:
        requested(env, train_section(**keys))
    assert "\n" not in str(err.value)


def test_precision_and_compile_from_the_launcher_are_honored_or_refused():
    assert check_precision({}, "auto") == "auto"
    assert check_precision({"ACCELERATE_MIXED_PRECISION": "no"}, "bf16") == "bf16"  # "no" is accelerate's default
    assert check_precision({"ACCELERATE_MIXED_PRECISION": "bf16"}, "auto") == "bf16"
    assert check_precision({"ACCELERATE_MIXED_PRECISION": "bf16"}, "bf16") == "bf16"
    for launcher, recipe in (("bf16", "fp32"), ("fp16", "bf16"), ("fp8", "auto")):
        with pytest.raises(RetrofitError, match=f"mixed precision {launcher} but train.precision is {recipe}"):
            check_precision({"ACCELERATE_MIXED_PRECISION": launcher}, recipe)
    check_compile({"ACCELERATE_DYNAMO_BACKEND": "NO"}, False)
    check_compile({"ACCELERATE_DYNAMO_BACKEND": "INDUCTOR"}, True)
    with pytest.raises(RetrofitError, match="dynamo_backend inductor.* train.compile is false"):
        check_compile({"ACCELERATE_DYNAMO_BACKEND": "INDUCTOR"}, False)


# ---- a DeepSpeed config: the recipe fills its "auto"s; what it would not honor is refused ------------------------

def plugin(zero3_init=False, **config):
    return SimpleNamespace(deepspeed_config={"zero_optimization": {"stage": 3}, **config}, zero3_init_flag=zero3_init)


def test_the_recipe_fills_a_deepspeed_configs_autos():
    given = plugin(train_micro_batch_size_per_gpu="auto", gradient_clipping="auto")
    assert configure(given, train_section(micro_batch_size=2, batch_size=4, grad_clip=0.5), 1, 2, cpu=True) == 3
    assert {k: given.deepspeed_config[k] for k in ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
                                                   "train_batch_size", "gradient_clipping")} == {
        "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "train_batch_size": 4,
        "gradient_clipping": 0.5}
    same = plugin(train_micro_batch_size_per_gpu=2, gradient_clipping=0.5, bf16={"enabled": False})
    configure(same, train_section(micro_batch_size=2, batch_size=4, grad_clip=0.5), 1, 2, cpu=True)  # no conflict


@pytest.mark.parametrize("given, keys, accumulation, message", [
    (plugin(optimizer={"type": "AdamW"}), {}, 1, "has a optimizer section"),
    (plugin(scheduler={"type": "WarmupLR"}), {}, 1, "has a scheduler section"),
    (plugin(zero3_init=True), {}, 1, "set zero3_init_flag: false"),
    (plugin(zero_optimization={"stage": 3, "offload_optimizer": {"device": "cpu"}}), {}, 1,
     "zero_optimization.offload_optimizer to cpu: these processes already run on the CPU"),
    (plugin(tensor_parallel={"autotp_size": 2}), {}, 1, "tensor parallelism"),
    (plugin(train_micro_batch_size_per_gpu=4), {"micro_batch_size": 2, "batch_size": 4}, 1,
     "train_micro_batch_size_per_gpu is 4 but the recipe's train.micro_batch_size makes it 2"),
    (plugin(gradient_clipping=1.0), {"grad_clip": 0.0, "micro_batch_size": 2, "batch_size": 4}, 1,
     "gradient_clipping is 1.0 but the recipe's train.grad_clip makes it 0.0"),
    (plugin(bf16={"enabled": True}), {"precision": "fp32", "micro_batch_size": 2, "batch_size": 4}, 1,
     "enables bf16 but train.precision is fp32"),
    (plugin(), {"micro_batch_size": 1, "batch_size": 4}, 2, "no accumulation"),
])
def test_a_deepspeed_config_the_recipe_would_not_honor_is_refused(given, keys, accumulation, message):
    with pytest.raises(RetrofitError, match=message):
        configure(given, train_section(**keys), accumulation, 2, cpu=True)


# ---- issue 61 items 2, 3: a DeepSpeed JSON read as DeepSpeed reads it, on every launcher, before any process group --

BAD_DEEPSPEED = [  # (the JSON, what the one line says)
    ({"bf16": {"enabled": 1}}, "enables bf16 but train.precision is fp32"),        # DeepSpeed reads 1 as on
    ({"bf16": {"enabled": "true"}}, "enables bf16 but train.precision is fp32"),
    ({"bfloat16": {"enabled": "yes"}}, "enables bf16 but train.precision is fp32"),  # DeepSpeed's older name
    ({"fp16": {"enabled": 1}}, "enables fp16 but train.precision is fp32"),
    ({"zero_optimization": {"stage": "three"}}, "zero_optimization.stage: Input should be 0, 1, 2, 3"),
    ({"zero_optimization": {"stage": 4}}, r"zero_optimization.stage: .*\(given 4\)"),
    ({"bf16": True}, "bf16 is true, not an object"),
    ({"zero_optimization": {"stage": 3, "offload_optimizer": "cpu"}},
     "zero_optimization.offload_optimizer: Input should be a valid dictionary"),
    ({"tensor_parallel": {"autotp_size": "2"}}, r"tensor parallelism \(tensor_parallel.autotp_size 2\)"),
    ({"tensor_parallel": {"autotp_size": "two"}}, "tensor_parallel.autotp_size: Input should be a valid integer"),
    ({"zero_optimization": {"stage": 2, "bogus": 1}}, "zero_optimization.bogus: Extra inputs are not permitted"),
    ({"train_micro_batch_size_per_gpu": "2"}, "train_micro_batch_size_per_gpu is '2' but the recipe's"),
]


@pytest.mark.parametrize("launcher", ["train.deepspeed", "accelerate"])
@pytest.mark.parametrize("config, message", BAD_DEEPSPEED)
def test_a_bad_deepspeed_config_is_one_line_exit_2_before_any_process_group(config, message, launcher, tmp_path,
                                                                            run_cli, monkeypatch):
    """On 9ab1028 these trained bf16 under train.precision fp32 (log.jsonl saying fp32) or raised ValueError,
    TypeError, AttributeError or pydantic's multi-line error on every rank. Both launchers' configs take one path:
    DeepSpeed's own DeepSpeedConfig, then the recipe's refusals."""
    import torch.distributed as dist
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps(config))
    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump(lm_recipe(write_corpus(tmp_path), tmp_path / "run", precision="fp32", steps=2,
                                               batch_size=2)))
    # one process: where a case is not refused (as on 9ab1028) it trains and exits 0 rather than wait for a peer
    for key, value in {**LAUNCHED, "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29593"}.items():
        monkeypatch.setenv(key, value)
    argv = ["train", recipe]
    if launcher == "accelerate":  # what `accelerate launch` sets for a config naming deepspeed_config_file
        monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
        monkeypatch.setenv("ACCELERATE_DEEPSPEED_CONFIG_FILE", str(ds))
        monkeypatch.setenv("ACCELERATE_DEEPSPEED_ZERO3_INIT", "false")
    else:
        argv.append(f"train.deepspeed={ds}")
    code, lines, _ = run_cli(argv)
    assert code == 2 and len(lines) == 1, lines
    assert re.search(message, lines[0]), lines[0]
    assert not (tmp_path / "run").exists() and not dist.is_initialized()


def test_deepspeeds_own_reading_of_a_config_is_what_retrofit_checks():
    """"auto" is DeepSpeed's default (off) and accelerate fills it from train.precision: no conflict."""
    for enabled in ("auto", False, 0):
        configure(plugin(bf16={"enabled": enabled}), train_section(precision="fp32", micro_batch_size=2, batch_size=4),
                  1, 2, cpu=True)
    configure(plugin(bf16={"enabled": 1}), train_section(precision="bf16", micro_batch_size=2, batch_size=4), 1, 2,
              cpu=True)


def test_sp_size_that_does_not_divide_the_world_is_one_line(monkeypatch):
    """Issue 61 item 4: sp_size 3 (and train.sequence_parallel 3) on 2 processes was a ZeroDivisionError in
    accelerator_setup.accumulation on every rank; refused with the launch, before any process group."""
    env = {**LAUNCHED, "ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_USE_PARALLELISM_CONFIG": "true",
           "PARALLELISM_CONFIG_SP_SIZE": "3"}
    with pytest.raises(RetrofitError, match=r"^train.sequence_parallel 3 does not divide the 2 process\(es\)") as err:
        requested(env, train_section(sequence_parallel=3))
    assert "\n" not in str(err.value)


# ---- the command line: exit 2, one line, nothing written --------------------------------------------------------

def test_an_accelerate_fsdp_config_on_cpu_is_one_line_and_exit_2(tmp_path, run_cli, monkeypatch):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump(lm_recipe(write_corpus(tmp_path), tmp_path / "run")))
    for key, value in {"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2", "LOCAL_RANK": "0", "RANK": "0",
                       "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29591"}.items():
        monkeypatch.setenv(key, value)
    code, lines, _ = run_cli(["train", recipe])
    assert code == 2 and len(lines) == 1 and "accelerate's FSDP config needs GPUs" in lines[0]
    assert not (tmp_path / "run").exists()


def test_one_process_names_its_engine(tmp_path):
    result = train(recipe_from_dict(lm_recipe(write_corpus(tmp_path), tmp_path / "run", steps=2)))
    engine = json.loads((result.run_dir / "result.json").read_text())["engine"]
    assert engine == {"name": "single", "world": 1, "backend": None, "nodes": 1, "stage": None,
                      "sequence_parallel": 1}
    first = json.loads((result.run_dir / "log.jsonl").read_text().splitlines()[0])
    assert first["engine"] == engine


# ---- launched: the `deepspeed` launcher, torchrun with train.deepspeed, accelerate's FSDP config ------------------

def ds_json(folder: Path, stage: int) -> Path:
    path = folder / f"ds{stage}.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": stage}, "train_micro_batch_size_per_gpu": "auto"}))
    return path


def run(argv: list[str], folder: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "TOKENIZERS_PARALLELISM": "false"}
    program = Path(sys.executable).parent / argv[0]
    return subprocess.run([str(program), *argv[1:]], env=env, capture_output=True, text=True, timeout=400, cwd=folder)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    folder = write_corpus(tmp_path_factory.mktemp("engines"))
    raw = lm_recipe(folder, folder / "unused", steps=4)
    raw["output"]["save_every"] = 0
    (folder / "lm.yaml").write_text(yaml.safe_dump(raw))
    return folder


def engine_of(run_dir: Path) -> dict:
    return json.loads((run_dir / "result.json").read_text())["engine"]


def test_torchrun_with_train_deepspeed_runs_zero3(corpus):
    out = corpus / "torchrun-ds"
    done = run(["torchrun", "--standalone", "--nproc_per_node", "2", "-m", "retrofit", "train", "lm.yaml",
                f"train.deepspeed={ds_json(corpus, 3)}", "--out", str(out)], corpus)
    assert done.returncode == 0, done.stderr[-4000:]
    assert engine_of(out) == {"name": "deepspeed", "stage": 3, "world": 2, "backend": "gloo", "nodes": 1,
                              "sequence_parallel": 1}
    assert "engine deepspeed ZeRO-3, 2 process(es) on 1 node(s) (gloo)" in done.stdout


def test_the_deepspeed_launcher_runs_its_config_and_refuses_none(corpus):
    out = corpus / "deepspeed-launcher"
    line = ["deepspeed", "--num_gpus", "2", "--master_port", str(free_port()), "--module", "retrofit", "train",
            "lm.yaml"]
    done = run([*line, f"train.deepspeed={ds_json(corpus, 2)}", "--out", str(out)], corpus)
    assert done.returncode == 0, done.stderr[-4000:]
    assert engine_of(out)["name"] == "deepspeed" and engine_of(out)["stage"] == 2
    refused = run([*line, "--out", str(corpus / "refused")], corpus)
    assert refused.returncode != 0 and not (corpus / "refused").exists()
    errors = [x for x in refused.stderr.splitlines() if x.startswith("retrofit train: error:")]
    assert len(errors) == 2 and all("no DeepSpeed config is named" in x for x in errors)  # one line per process


def test_accelerate_launch_with_an_fsdp_config_is_refused_by_every_process(corpus):
    config = accelerate_config(corpus, 3)
    raw = yaml.safe_load(config.read_text())
    raw.pop("deepspeed_config")
    raw.update(distributed_type="FSDP",
               fsdp_config={"fsdp_version": 2, "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP"})
    config.write_text(yaml.safe_dump(raw))
    done = run(["accelerate", "launch", "--config_file", str(config), "--main_process_port", str(free_port()), "-m",
                "retrofit", "train", "lm.yaml", "--out", str(corpus / "fsdp")], corpus)
    assert done.returncode != 0 and not (corpus / "fsdp").exists()
    errors = [x for x in done.stderr.splitlines() if x.startswith("retrofit train: error:")]
    assert len(errors) == 2 and all("accelerate's FSDP config needs GPUs" in x for x in errors)


def test_dynamo_config_in_an_accelerate_deepspeed_config_is_read_from_the_launchers_file(tmp_path):
    """Issue 61 item 7: accelerate's DeepSpeed launcher passes no ACCELERATE_DYNAMO_* to its workers, so a
    dynamo_config trained uncompiled, silently; the worker reads the file its launcher (its parent) was given."""
    from retrofit.train.engine import launcher_dynamo
    config = accelerate_config(tmp_path, 2)
    launch = ["/venv/bin/python", "/venv/bin/accelerate", "launch", "--config_file", str(config), "-m", "retrofit"]
    assert launcher_dynamo(launch) is None  # no dynamo_config
    raw = yaml.safe_load(config.read_text())
    config.write_text(yaml.safe_dump({**raw, "dynamo_config": {"dynamo_backend": "INDUCTOR"}}))
    assert launcher_dynamo(launch) == "inductor"
    assert launcher_dynamo([*launch[:3], f"--config-file={config}", "--dynamo_backend", "no"]) == "no"  # CLI wins
    assert launcher_dynamo(["/usr/bin/bash", "-c", "retrofit train"]) is None  # not started by accelerate launch
    env = {**LAUNCHED, "ACCELERATE_USE_DEEPSPEED": "true"}
    with pytest.raises(RetrofitError, match="dynamo_backend inductor.* drop the config's dynamo_config") as err:
        check_compile(env, False, launch)
    assert "\n" not in str(err.value)
    check_compile({**env, "ACCELERATE_DYNAMO_BACKEND": "NO"}, False, launch)  # a launcher that passed it: as DDP


def test_accelerate_launch_with_dynamo_config_and_deepspeed_is_refused_by_every_process(corpus):
    """The same, launched: the workers find the launcher's config through their parent process."""
    config = accelerate_config(corpus, 2)
    raw = yaml.safe_load(config.read_text())
    config.write_text(yaml.safe_dump({**raw, "dynamo_config": {"dynamo_backend": "INDUCTOR"}}))
    done = run(["accelerate", "launch", "--config_file", str(config), "--main_process_port", str(free_port()), "-m",
                "retrofit", "train", "lm.yaml", "--out", str(corpus / "dynamo")], corpus)
    assert done.returncode != 0 and not (corpus / "dynamo").exists()
    errors = [x for x in done.stderr.splitlines() if x.startswith("retrofit train: error:")]
    assert len(errors) == 2 and all("dynamo_backend inductor" in x for x in errors), done.stderr[-3000:]
    assert "Traceback" not in done.stderr.split("retrofit train: error:")[0]


def test_what_the_loop_does_not_run_under_deepspeed_is_refused(tmp_path):
    from retrofit.train.zero import check_deepspeed_recipe
    raw = lm_recipe(tmp_path, tmp_path / "run")
    check_deepspeed_recipe(recipe_from_dict(raw), None)  # not DeepSpeed: nothing to refuse
    lora = {**raw, "train": {**raw["train"], "peft": {"r": 4}}}
    check_deepspeed_recipe(recipe_from_dict(lora), 2)  # ZeRO-2: whole weights
    for train_keys, stage, message in [
            ({"compile": True}, 3, "train.compile is not built yet"),
            ({"sequence_parallel": 2, "init_len": 16, "double_every": 2}, 3, "staged length"),
            ({"peft": {"r": 4}}, 3, "ZeRO-3 with LoRA saves the adapter only")]:
        with pytest.raises(RetrofitError, match=message):
            check_deepspeed_recipe(recipe_from_dict({**raw, "train": {**raw["train"], **train_keys}}), stage)
    with pytest.raises(RetrofitError, match="recovery section is not built yet"):
        check_deepspeed_recipe(recipe_from_dict({**raw, "recovery": {"lm_weight": 0.5, "kl_weight": 0.5}}), 3)
