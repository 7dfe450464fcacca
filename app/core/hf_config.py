"""The transformers config of a save_pretrained folder or a hub name. What the app cannot train from is one line
that says why: a folder without a config, a model that needs its own code (the app runs none that a model brings),
one newer than the installed transformers, a multimodal one, and a hub name that cannot be had (offline, gated,
misspelt), in transformers' own words."""
import json
from pathlib import Path

from app.errors import UserError, first_line


def read(name: str, presets: str = ""):
    """The config of the folder or hub name `name`; presets: the app's own, named in the line for a name that is
    none of them and no hub model either."""
    from transformers import AutoConfig
    folder = Path(name).is_dir()
    if folder:
        _check_folder(Path(name))
    try:
        config = AutoConfig.from_pretrained(name, trust_remote_code=False)
    except Exception as e:  # noqa: BLE001 (offline, gated, misspelt, damaged: transformers says which)
        raise UserError(_unread(name, folder, e, presets)) from None
    if config.get_text_config() is not config:
        kind = ", ".join(config.architectures or [config.model_type])
        raise UserError(f"{name} is a multimodal model ({kind}), and the app trains text models on their own: pass "
                        f"a text-only model (a ...ForCausalLM)")
    return config


def _check_folder(folder: Path):
    """Refuse a folder without config.json, one whose model brings its own code, or whose type transformers lacks."""
    from transformers import CONFIG_MAPPING, __version__
    path = folder / "config.json"
    if not path.is_file():
        raise UserError(f"model folder {folder} has no config.json; pass a folder written by save_pretrained")
    try:
        raw = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise UserError(_unread(str(folder), True, e)) from None
    if isinstance(raw, dict) and raw.get("auto_map"):
        raise UserError(f"{folder} is a model with its own code (auto_map in its config.json), which the app does not "
                        f"run: pass a model of a family transformers ships")
    kind = raw.get("model_type") if isinstance(raw, dict) else None
    if kind and kind not in CONFIG_MAPPING:
        raise UserError(f"{folder} is a {kind!r} model, which transformers {__version__} does not know: upgrade "
                        f"transformers (pip install -U transformers)")


def _unread(name: str, folder: bool, error: Exception, presets: str = "") -> str:
    if folder:
        return (f"{Path(name) / 'config.json'} cannot be read ({first_line(error)}): the folder may be damaged or cut "
                f"short; write it again with save_pretrained, or copy it again")
    return (f"unknown model {name!r}: not cnn, mlp, a torchvision classifier (resnet18, ...), a preset "
            f"({presets}), a save_pretrained folder, nor a hub model that can be had now "
            f"({first_line(error)})")
