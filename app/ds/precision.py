"""Precision: which of the JSON's lower-precision sections the rank's device runs ("auto" decided once its device
is set), and the dtypes an engine built from it computes in."""
import copy

import torch

from app.errors import UserError

# Sections that switch a lower precision on, in the order "auto" prefers them. torch_autocast keeps fp32 weights
# and runs the forward in bf16 under torch.autocast (the recipe of plain PyTorch at its best); DeepSpeed's bf16
# and fp16 sections keep 16-bit weights behind an optimizer wrapper (docs/gpu.md, "Precision").
PRECISIONS = ("torch_autocast", "bf16", "fp16")
DTYPE_NAMES = {"bfloat16": "bf16", "bf16": "bf16", "float16": "fp16", "fp16": "fp16", "half": "fp16"}


def _label(ds: dict, name: str) -> str:
    """What a precision section computes in: 'bf16 autocast', 'bf16' or 'fp16'."""
    if name != "torch_autocast":
        return name
    return f"{DTYPE_NAMES.get(str(ds[name].get('dtype', 'bfloat16')).replace('torch.', ''), 'bf16')} autocast"


def weights_of(ds: dict) -> str:
    """What the engine keeps its weights in: 16-bit ones behind DeepSpeed's bf16 or fp16 section, else fp32."""
    return next((name for name in ("bf16", "fp16") if (ds.get(name) or {}).get("enabled") is True), "fp32")


def weights_dtype(ds: dict) -> torch.dtype:
    """The dtype a model is built in for an engine of ds: its bf16 or fp16 section's, else torch's default (fp32;
    the memory plan builds a bf16-weights model under bf16)."""
    return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(weights_of(ds), torch.get_default_dtype())


def bf16_runs(capability: tuple) -> bool:
    """Whether a CUDA device of this compute capability runs bf16 natively: Ampere (8.0) and later. Older GPUs
    (V100 7.0, T4 7.5) emulate it, slower than fp16, which torch.cuda.is_bf16_supported() counts as support."""
    return tuple(capability) >= (8, 0)


def resolve_precision(ds: dict, where: str, cuda=None, bf16_ok=None, device=None) -> tuple:
    """(ds with "enabled": "auto" made true or false, a note on what was picked and why).

    auto picks the first section in PRECISIONS order that the device can run: bf16 (autocast or weights) on a
    CUDA device that runs it natively, fp16 on one that does not, and fp32 on CPU, where bf16 matmuls are slower
    than fp32 and fp16 has no kernels. A section set to true wins over every "auto". The device is `device`
    (the rank's own, once set), else the current CUDA device; its compute capability is read without
    allocating on it.
    """
    ds = _switches_as_meant(ds, where)
    ds, cpu_note = _sixteen_bit_on_a_cpu(ds, where, device, cuda)
    if device is not None:
        cuda = device.type == "cuda"
        bf16_ok = cuda and bf16_runs(torch.cuda.get_device_capability(device)) if bf16_ok is None else bf16_ok
    sections = [name for name in PRECISIONS if isinstance(ds.get(name), dict)]
    for name in sections:
        enabled = ds[name].get("enabled", False)
        if not isinstance(enabled, bool) and enabled != "auto":
            raise UserError(f"{where}: {name}.enabled must be true, false or \"auto\", got {enabled!r}")
    autos = [name for name in sections if ds[name].get("enabled") == "auto"]
    if not autos and not _undated(ds):
        return ds, cpu_note
    cuda = torch.cuda.is_available() if cuda is None else cuda
    bf16_ok = cuda and (bf16_runs(torch.cuda.get_device_capability()) if bf16_ok is None else bf16_ok)
    ds = _autocast_dated(ds, cuda, bf16_ok)
    if not autos:
        return ds, cpu_note
    runs = {"bf16": bf16_ok, "fp16": cuda}
    fixed = [name for name in sections if ds[name].get("enabled") is True]
    pick = fixed[0] if fixed else next((name for name in autos if runs[_label(ds, name).split()[0]]), "")
    ds = copy.deepcopy(ds)
    for name in autos:
        ds[name]["enabled"] = name == pick
        if name == "fp16" and name != pick and ds[name].get("auto_cast"):
            ds[name]["auto_cast"] = False  # DeepSpeed casts inputs to fp16 by it even with fp16 off
        if name == pick == "torch_autocast":
            ds[name].setdefault("dtype", "bfloat16")
    why = _why(ds, pick, fixed, cuda, bf16_ok)
    return ds, f"{_label(ds, pick) if pick else 'fp32'} ({'/'.join(autos)} \"auto\": {why})"


def _why(ds: dict, pick: str, fixed: list, cuda: bool, bf16_ok: bool) -> str:
    """Why "auto" resolved to pick: the device, a section set true (which wins), or the file's only choice."""
    if not cuda:
        return "no CUDA device"
    if fixed:
        return f"{fixed[0]} is set true"
    if _label(ds, pick).startswith("bf16"):
        return "the CUDA device supports bf16"
    return "the CUDA device has no native bf16" if not bf16_ok else "the file's only 16-bit section"


def _undated(ds: dict) -> bool:
    """Whether torch_autocast is set true without a dtype."""
    section = ds.get("torch_autocast")
    return isinstance(section, dict) and section.get("enabled") is True and "dtype" not in section


def _autocast_dated(ds: dict, cuda: bool, bf16_ok: bool) -> dict:
    """ds with torch_autocast, set true without a dtype, given the device's: DeepSpeed would hand torch.autocast
    none, which is fp16 on a GPU, with no loss scaler."""
    if not _undated(ds):
        return ds
    return {**ds, "torch_autocast": {**ds["torch_autocast"], "dtype": "bfloat16" if bf16_ok or not cuda else
                                     "float16"}}


def _switches_as_meant(ds: dict, where: str) -> dict:
    """ds with "enabled": "true"/"false" made booleans, and one line for "bf16" and "fp16" both set true."""
    for name in PRECISIONS:  # DeepSpeed reads the word as set (even "false"); take it as meant
        if isinstance(ds.get(name), dict) and ds[name].get("enabled") in ("true", "false"):
            ds = {**ds, name: {**ds[name], "enabled": ds[name]["enabled"] == "true"}}
    # both true leaves open the dtype the weights are kept in; refused before a CPU run would drop fp16, so the file
    # fails alike on every device. "auto" in both (transformers' files) is no contradiction: the device picks one
    if all(isinstance(ds.get(name), dict) and ds[name].get("enabled") is True for name in ("bf16", "fp16")):
        raise UserError(f"{where}: bf16.enabled and fp16.enabled are both true, and a run keeps its weights in one "
                        f"of them: set one to false, or both to \"auto\" to let the device pick")
    return ds


def _sixteen_bit_on_a_cpu(ds: dict, where: str, device, cuda) -> tuple:
    """(ds, note): an "fp16" section set true where there is no CUDA device trains in fp32 here, so that a
    cluster's config can be tried on a laptop as it is; a GPU runs the file as written. (DeepSpeed has no fp16
    on a CPU: it would stop with "Type fp16 is not supported on your device".)"""
    on_cuda = device.type == "cuda" if device is not None else cuda
    if on_cuda is None:
        import torch
        on_cuda = torch.cuda.is_available()
    section = ds.get("fp16")
    if on_cuda or not isinstance(section, dict) or section.get("enabled") is not True:
        return ds, ""
    ds = {**ds, "fp16": {**section, "enabled": False, **({"auto_cast": False} if section.get("auto_cast") else {})}}
    return ds, (f"fp32 ({where} sets fp16.enabled true, which needs a CUDA device: this CPU run trains in fp32, "
                f"a GPU runs the file as written)")


def set_tf32(device: torch.device, dtype: torch.dtype, choice: str) -> str:
    """Let fp32 CUDA matmuls and convolutions use TF32 (unless --tf32 off); a note for the mode line."""
    if device.type != "cuda" or dtype != torch.float32:
        return ""
    on = choice == "on"
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = on
    return "TF32 matmuls" if on else "full-fp32 matmuls (--tf32 off)"


def input_dtype(engine) -> torch.dtype:
    """The dtype the engine's parameters are kept in for the forward pass."""
    if engine.bfloat16_enabled():
        return torch.bfloat16
    if engine.fp16_enabled():
        return torch.float16
    return torch.float32


def compute_dtype(engine) -> torch.dtype:
    """The dtype the model's matmuls run in: torch_autocast's, else the weights' own."""
    if engine.torch_autocast_enabled():
        return engine.torch_autocast_dtype() or torch.bfloat16
    return input_dtype(engine)


def precision_name(engine) -> str:
    """'bf16 autocast' (fp32 weights), 'bf16' or 'fp16' (16-bit weights), or 'fp32'."""
    short = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}[compute_dtype(engine)]
    return f"{short} autocast" if engine.torch_autocast_enabled() else short
