"""DeepSpeed's config parser: what it reads, its sections' fields, its defaults."""

from collections.abc import KeysView


class Recorder(dict):
    """A dict that remembers which keys DeepSpeed's config parser looked at."""

    def __init__(self, data):
        super().__init__({k: Recorder(v) if isinstance(v, dict) else v for k, v in data.items()})
        self.read = set()

    def __getitem__(self, key):
        self.read.add(key)
        return super().__getitem__(key)

    def get(self, key, default=None):
        self.read.add(key)
        return super().get(key, default)

    def __contains__(self, key):
        self.read.add(key)
        return super().__contains__(key)

    def keys(self):
        """A view whose `in` is recorded: DeepSpeed asks `"optimizer" in param_dict.keys()` of some sections."""
        return KeysView(self)


def parse_config(ds: dict):
    """Run DeepSpeed's own config parser on ds (in place: a Recorder records what it read), batch sizes made
    consistent for one rank."""
    from deepspeed.runtime.config import DeepSpeedConfig
    micro, accum = ds.get("train_micro_batch_size_per_gpu"), ds.get("gradient_accumulation_steps", 1)
    if isinstance(micro, int) and isinstance(accum, int):
        dict.__setitem__(ds, "train_batch_size", micro * accum)
    return DeepSpeedConfig(ds)


def scalar_defaults() -> dict:
    """{top-level key: DeepSpeed's default} for its scalar settings that have one (runtime/constants.py)."""
    from deepspeed.runtime import constants
    found = {}
    for name, key in vars(constants).items():
        default = getattr(constants, f"{name}_DEFAULT", None) if isinstance(key, str) else None
        if isinstance(default, (bool, int, float, str)):
            found[key] = default
    return found


def section_fields(model_title: str, path: tuple = ()) -> set:
    """The field names of DeepSpeed's pydantic config model called model_title (a section's), or of the model
    nested in it at path (zero_optimization's offload_optimizer); empty where none is found."""
    from deepspeed.runtime.config_utils import DeepSpeedConfigModel
    model = next((cls for cls in _subclasses(DeepSpeedConfigModel) if cls.__name__ == model_title), None)
    for name in path:
        model = _nested_model(model, str(name)) if model is not None else None
    return set(model.model_fields) if model is not None else set()


def _subclasses(cls):
    for sub in cls.__subclasses__():
        yield sub
        yield from _subclasses(sub)


def _nested_model(model, name: str):
    """The pydantic model of model's field name (or alias), where that field holds one (an Optional one too)."""
    import typing
    from pydantic import BaseModel
    field = model.model_fields.get(name) or next((f for f in model.model_fields.values() if f.alias == name), None)
    kinds = [field.annotation, *typing.get_args(field.annotation)] if field is not None else []
    return next((kind for kind in kinds if isinstance(kind, type) and issubclass(kind, BaseModel)), None)
