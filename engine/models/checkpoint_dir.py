"""A checkpoint folder's files, checked before anything is loaded: a missing folder, one without
config.json or without readable safetensors weights is one error that names the field and the
file, not a traceback from inside the loader. Torch-free, so that the server checks `--model`
before it binds a port (server/preflight.py) without importing torch."""
from __future__ import annotations

import json
import os

from safetensors import SafetensorError, safe_open

CONFIG_FILE = "config.json"
SAFETENSORS_INDEX = "model.safetensors.index.json"


def safetensors_files(path: str) -> list[str]:
    """The folder's weight files, sorted: those its index names, else every *.safetensors.
    ValueError naming the index if it cannot be read."""
    index = os.path.join(path, SAFETENSORS_INDEX)
    if os.path.exists(index):
        try:
            with open(index) as f:
                return sorted(set(json.load(f)["weight_map"].values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"{index}: not a safetensors index ({type(e).__name__}: {e})") from None
    return sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))


def open_safetensors(file: str, framework: str, field: str = "model"):
    """safe_open(file), a bad file being ValueError `{field}: {file}: why` (safetensors' own
    error does not name the file)."""
    try:
        return safe_open(file, framework=framework)
    except (SafetensorError, OSError) as e:
        raise ValueError(f"{field}: {file}: not a readable safetensors file ({e})") from None


def read_config(path: str, field: str) -> dict:
    """The folder's config.json, after checking the folder: ValueError `{field}: {path}: why`
    for a missing folder, a file in its place, a missing config.json or one that is not a JSON
    object."""
    if not os.path.exists(path):
        raise ValueError(f"{field}: {path}: no such directory")
    if not os.path.isdir(path):
        raise ValueError(f"{field}: {path}: not a directory (give a Hugging Face model folder)")
    config = os.path.join(path, CONFIG_FILE)
    if not os.path.isfile(config):
        raise ValueError(f"{field}: {path}: no {CONFIG_FILE} (not a Hugging Face model folder)")
    try:
        with open(config) as f:
            raw = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"{field}: {config}: cannot be read as JSON ({e})") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{field}: {config}: not a JSON object")
    return raw


def check_checkpoint_dir(path: str, field: str) -> dict:
    """read_config, and the folder must hold weights: safetensors files whose headers parse
    (a few ms a file: the tensors are not read); returns the config."""
    raw = read_config(path, field)
    try:
        files = safetensors_files(path)
    except ValueError as e:
        raise ValueError(f"{field}: {e}") from None
    if not files:
        raise ValueError(f"{field}: {path}: no *.safetensors weight files")
    missing = [name for name in files if not os.path.isfile(os.path.join(path, name))]
    if missing:
        raise ValueError(f"{field}: {path}: the index names {missing[0]}, which is not there")
    for name in files:
        with open_safetensors(os.path.join(path, name), "numpy", field):
            pass
    return raw
