"""The CLI's bad input: exit code 2, one line on stderr, no traceback (`python -m retrofit` itself in a process of its
own for two cases, main() in this process for the rest); `retrofit patch` saves a folder that reloads and
`retrofit norms` lists every norm."""

from __future__ import annotations

import contextlib
import resource
import signal
import subprocess
import sys

import pytest

import retrofit
from tests.tiny import tiny_model


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "retrofit", *args], capture_output=True, text=True, timeout=120)


def _cli_in_process(args, capsys) -> subprocess.CompletedProcess:
    """retrofit.cli.main, the function `python -m retrofit` exits with; argparse's errors exit from inside it."""
    from retrofit.cli import main
    capsys.readouterr()
    try:
        code = main(list(args))
    except SystemExit as exit:
        code = exit.code
    out = capsys.readouterr()
    return subprocess.CompletedProcess(args, code, out.out, out.err)


# A process of its own (~3 s of imports each): one RetrofitError and one argparse error, so `python -m retrofit`
# itself is seen to exit 2 with one line; the other cases run the same main() in this process.
IN_A_PROCESS = ("./no/such/folder", "frobnicate")


@pytest.mark.parametrize("args,match", [
    (["patch", "./no/such/folder", "--norm", "avnorm"], "no such file or folder: ./no/such/folder"),
    (["patch", "x.gguf", "--norm", "avnorm"], "no such GGUF file"),
    (["patch", "gpt2", "--norm", "avnrm"], "did you mean 'avnorm'"),
    (["patch", "gpt2", "--norm", "psoftmax", "--p", "0.5"], "p must be a finite number >= 1"),
    (["patch", "gpt2", "--norm", "psoftmax", "--kind", "rms"], "has no option 'kind'"),
    (["patch", "gpt2", "--norm", "avnorm", "--bogus-flag"], "unrecognized arguments: --bogus-flag"),
    (["frobnicate"], "invalid choice: 'frobnicate'"),
])
def test_cli_bad_input_exits_2_without_traceback(args, match, tmp_path, capsys):
    args = [*args, *(["--out", str(tmp_path / "out")] if args[0] == "patch" else [])]
    run = _cli(*args) if set(args) & set(IN_A_PROCESS) else _cli_in_process(args, capsys)
    assert run.returncode == 2, run.stderr
    assert "Traceback" not in run.stderr
    lines = [line for line in run.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and __import__("re").search(match, lines[0]), run.stderr


def test_cli_patch_saves_a_folder_that_reloads(tmp_path, capsys):
    src = tmp_path / "src"
    model = tiny_model("llama")
    model.save_pretrained(src)
    out = tmp_path / "out"
    run = _cli("patch", str(src), "--norm", "avnorm", "--kind", "layer", "--nope", "--out", str(out))
    assert run.returncode == 0, run.stderr
    assert "attention modules 2 patched over sdpa" in run.stdout and "rotary made identity" in run.stdout
    loaded = retrofit.from_pretrained(str(out))
    assert loaded.config.retrofit["options"]["kind"] == "layer" and loaded.config.retrofit["nope"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out.")]  # no temporary left behind
    again = _cli_in_process(["patch", str(src), "--norm", "avnorm", "--out", str(out)], capsys)
    assert again.returncode == 2 and "exists and is not empty" in again.stderr


def test_cli_norms_lists_every_norm():
    run = _cli("norms")
    assert run.returncode == 0
    for name in retrofit.available_norms():
        assert name in run.stdout


@contextlib.contextmanager
def file_size_limit(most: int):
    """Files of this process may grow to `most` bytes (RLIMIT_FSIZE, as `ulimit -f` sets it); past it a write fails
    with EFBIG (SIGXFSZ ignored, as a shell's ulimit leaves a process that handles it)."""
    handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (most, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, handler)


@pytest.mark.parametrize("verb", ["patch", "train"])
def test_a_write_past_the_file_size_limit_is_one_line_saying_it_was_a_write(verb, world, tmp_path, capsys):
    """A write that hit the file-size limit (EFBIG) was 'a .safetensors file is damaged ... re-download' (patch: the
    safetensors writer) or torch's 'unexpected pos 141824 vs 141716' traceback (a checkpoint's optimizer.bin).
    Handled like a full disk: one line that says a write failed and why, nothing half-written left (train: the run
    resumes from its last complete checkpoint)."""
    from retrofit.train import resume_state

    out = tmp_path / "out"
    # the tiny model's weights are ~100 KB: patch's save passes 60 KB, train's first checkpoint (the weights, then
    # the optimizer's two moments) passes 150 KB
    argv, most = ((["patch", world["model"], "--norm", "ssmax", "--out", str(out)], 60_000) if verb == "patch" else
                  (["train", world["recipe"], "train.steps=2", "output.save_every=1", "--out", str(out)], 150_000))
    with file_size_limit(most):
        done = _cli_in_process(argv, capsys)
    lines = [line for line in done.stderr.splitlines() if line.strip() and "Writing model shards" not in line]
    assert done.returncode == 2 and "Traceback" not in done.stderr and len(lines) == 1, done.stderr
    said = "a write failed: a file reached the size limit" if verb == "patch" else "could not be written"
    assert "a file reached the size limit" in lines[0] and said in lines[0], lines[0]
    assert "damaged" not in lines[0] and "re-download" not in lines[0], lines[0]
    if verb == "patch":
        assert not out.exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".")]
    else:
        assert "could not be written" in lines[0] and f"--resume {out}" in lines[0]
        assert not list((out / resume_state.FOLDER).glob(".tmp-*"))  # its space given back
