"""Keys older DeepSpeed took, put as today's DeepSpeed reads them before the strict check: each change worth knowing
is said in a note, and one the app cannot put right is one line."""
import copy

from app.ds import internals as ds_internals
from app.ds.auto import AUTO
from app.errors import UserError

# fp16's loss scaling, which older DeepSpeed let a "bf16" section carry (and ignored there); today's refuses it
LOSS_SCALING = ("loss_scale", "initial_scale_power", "loss_scale_window", "hysteresis", "consecutive_hysteresis",
                "min_loss_scale")
# older DeepSpeed's offload switches inside zero_optimization, and the sections DeepSpeed reads them as when true
OFFLOAD_SWITCHES = {"cpu_offload": "offload_optimizer", "cpu_offload_param": "offload_param"}
# older DeepSpeed's "compile" section, handed to torch.compile; today's has none of these, the app's --compile owns them
OLD_COMPILE = ("disable", "backend", "kwargs")


def today(ds: dict, where: str, say) -> dict:
    """ds with the keys older DeepSpeed took put as today's reads them, a note for each change worth knowing."""
    ds = copy.deepcopy(ds)
    if "bfloat16" in ds and "bf16" not in ds:  # DeepSpeed's older name for the section, read the same: no note
        ds["bf16"] = ds.pop("bfloat16")
    for change in (_zero_true, _offload_switches, _bf16_loss_scaling, _old_compile, _aio_inside_zero,
                   _aio_thread_count, _apex_amp_off):
        note = change(ds, where)
        if note:
            say(f"note: {where}: {note}")
    return ds


def _zero_true(ds: dict, where: str) -> str:
    """"zero_optimization": true or false (DeepSpeed's first form, still in its getting-started tutorial) as the
    section DeepSpeed reads it as: stage 1, or none."""
    if not isinstance(ds.get("zero_optimization"), bool):
        return ""
    stage = int(ds["zero_optimization"])
    ds["zero_optimization"] = {"stage": stage}
    return f'read "zero_optimization": {str(bool(stage)).lower()} as {{"stage": {stage}}}, as DeepSpeed does'


def _offload_switches(ds: dict, where: str) -> str:
    """zero_optimization's cpu_offload and cpu_offload_param (DeepSpeed's older switches, in published configs) as
    the sections DeepSpeed puts them in: true, the section with device cpu and its defaults; false, none (dropped).
    The memory plan and the host-memory check read the sections. What was read."""
    zero = ds.get("zero_optimization")
    read = []
    for switch, section in OFFLOAD_SWITCHES.items():
        if not isinstance(zero, dict) or not isinstance(zero.get(switch), bool):
            continue  # anything but true or false stays for DeepSpeed's own check
        if not zero.pop(switch):
            continue
        if section in zero:
            raise UserError(f"{where}: zero_optimization sets both {switch}, DeepSpeed's older switch, and "
                            f"{section}, which replaces it: keep {section}")
        zero[section] = {"device": "cpu"}
        read.append(f'zero_optimization.{switch}: true as "{section}": {{"device": "cpu"}}')
    return f"read {' and '.join(read)}, as DeepSpeed does" if read else ""


def _bf16_loss_scaling(ds: dict, where: str) -> str:
    """Drop fp16's loss-scaling keys that DeepSpeed's bf16 section does not take; what was dropped."""
    section = ds.get("bf16")
    if not isinstance(section, dict):
        return ""
    taken = ds_internals.section_fields("DeepSpeedBF16Config")  # a later DeepSpeed may take some: keep those then
    dropped = [key for key in LOSS_SCALING if key in section and key not in taken]
    for key in dropped:
        del section[key]
    if not dropped:
        return ""
    return f"dropped {', '.join(f'bf16.{key}' for key in dropped)}: fp16's loss scaling, which bf16 (fp32's range) " \
           f"does not need and DeepSpeed no longer takes there"


def _old_compile(ds: dict, where: str) -> str:
    """Drop older DeepSpeed's torch.compile settings; what decides instead (the app's --compile flag)."""
    section = ds.get("compile")
    old = {key: section.pop(key) for key in OLD_COMPILE if key in section} if isinstance(section, dict) else {}
    if not old:
        return ""
    if not section:
        del ds["compile"]  # nothing left for DeepSpeed's own compile options
    backend = old.get("backend", "inductor")
    by = "inductor" if backend == "inductor" else f"inductor, not {backend!r}"
    asks = ": pass --compile off to train eager, as the file asks" if old.get("disable") is True else ""
    return f"dropped {', '.join(f'compile.{key}' for key in old)}: older DeepSpeed's torch.compile settings; the " \
           f"app's --compile flag decides (auto: compiled on a CUDA device, by {by}){asks}"


def _aio_inside_zero(ds: dict, where: str) -> str:
    """Move an "aio" section from inside "zero_optimization", which refuses it, to the top level; what was moved."""
    zero = ds.get("zero_optimization")
    if not isinstance(zero, dict) or "aio" not in zero:
        return ""
    aio = zero.pop("aio")
    if ds.setdefault("aio", aio) != aio:
        raise UserError(f"{where}: aio is set at the top level and, differently, inside zero_optimization, where "
                        f"DeepSpeed does not read it: keep the top-level one")
    return "moved zero_optimization.aio to the top level, where DeepSpeed reads it"


def _aio_thread_count(ds: dict, where: str) -> str:
    """Rename aio.thread_count, older DeepSpeed's key, to intra_op_parallelism, which DeepSpeed reads today in its
    place (transformers' NVMe example still writes the old one); what was renamed."""
    aio = ds.get("aio")
    if not isinstance(aio, dict) or "thread_count" not in aio:
        return ""
    count = aio.pop("thread_count")
    if aio.setdefault("intra_op_parallelism", count) != count:
        raise UserError(f"{where}: aio.thread_count and aio.intra_op_parallelism differ; DeepSpeed reads only "
                        f"intra_op_parallelism, the newer name: keep that one")
    return f"renamed aio.thread_count to aio.intra_op_parallelism, DeepSpeed's name for it today"


def _apex_amp_off(ds: dict, where: str) -> str:
    """Drop an "amp" section (NVIDIA Apex's amp, which DeepSpeed 0.19 refuses wherever it is) that is off or
    "auto", as transformers' docs write it and fill it (off unless --fp16_backend apex); what was dropped. One that
    is on stays, for DeepSpeed's own line."""
    amp = ds.get("amp")
    if not isinstance(amp, dict) or amp.get("enabled", False) not in (False, AUTO):
        return ""
    del ds["amp"]
    return "dropped the amp section (NVIDIA Apex's amp, off or \"auto\"), which DeepSpeed no longer has: the fp16, " \
           "bf16 and torch_autocast sections pick the precision"
