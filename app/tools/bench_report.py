"""The benchmark's rows turned into ratios, a table, the headline line and a chart."""
from pathlib import Path

TORCH_MODES = ("raw", "raw-compile", "raw-1thread", "ddp", "dataparallel", "fsdp2")


def is_split(row) -> bool:
    """Whether the mode splits the model: pipeline stages or tensor-parallel shards."""
    return row.get("pipeline_stages", 1) > 1 or row.get("tensor_parallel", 1) > 1


def one_device(rows: list):
    """The reference a split model is measured against: the app's first unsplit mode on one rank, else raw."""
    app = [r for r in rows if r["ranks"] == 1 and r["mode"] not in TORCH_MODES and not is_split(r)]
    return app[0] if app else next((r for r in rows if r["mode"] == "raw" and r["ranks"] == 1), None)


def add_ratios(rows: list):
    """Step time against the raw loop and against torch at the same world size; weak-scaling efficiency; speed
    against one device; speed against torch's FSDP2 at the same world size. None against a mode that ran in another
    dtype (--dtype for the torch modes, the ds_config's precision for the app's): that is no like for like; no
    scaling efficiency for ranks of more threads than the one-thread reference (a machine of more cores than ranks)."""
    by_mode = {(r["mode"], r["ranks"]): r for r in rows}
    by_mode[("one device", 0)] = one_device(rows)
    for r in rows:
        def like(mode, ranks):
            found = by_mode.get((mode, ranks))
            return found if found is not None and found["dtype"] == r["dtype"] else None
        raw, one_thread, best, single = like("raw", 1), like("raw-1thread", 1), like("raw-compile", 1), \
            like("one device", 0)
        fsdp2, torch_ref = like("fsdp2", r["ranks"]), raw if r["ranks"] == 1 else like("ddp", r["ranks"])
        r["speed_vs_fsdp2"] = fsdp2["step_time_s"] / r["step_time_s"] if fsdp2 else None
        r["speed_vs_one_device"] = r["samples_per_s"] / single["samples_per_s"] if single else None
        r["speed_vs_raw_compile"] = best["step_time_s"] / r["step_time_s"] if best and r["ranks"] == 1 else None
        r["ratio_to_raw"] = r["step_time_s"] / raw["step_time_s"] if raw else None
        r["ratio_to_torch"] = r["step_time_s"] / torch_ref["step_time_s"] if torch_ref else None
        r["scaling_efficiency"] = r["samples_per_s"] / (r["ranks"] * one_thread["samples_per_s"]) \
            if one_thread and r["ranks"] > 1 and r["threads_per_rank"] == one_thread["threads_per_rank"] else None


def _fmt(value, spec):
    return "-" if value is None else format(value, spec)


def table(rows: list) -> str:
    """The rows as a fixed-width text table (the mode column as wide as its longest name)."""
    rate = "tokens/s" if rows[0]["tokens_per_s"] is not None else "samples/s"
    wide = max(16, *(len(r["mode"]) + 1 for r in rows))
    lines = [f"{'mode':<{wide}}{'ranks':>6}{'thr':>4}{'batch':>6}{'dtype':>9}{'step ms':>9}{rate:>11}{'vs raw':>8}"
             f"{'vs torch':>9}{'speed/rc':>9}{'MFU':>6}{'MFU ds':>7}{'wait':>7}{'first s':>8}{'peak MB':>9}"
             f"{'scale':>7}{'ZeRO/formula':>13}"]
    for r in rows:
        zero = r["zero_state"]
        lines.append(
            f"{r['mode']:<{wide}}{r['ranks']:>6}{r['threads_per_rank']:>4}{r['micro_batch']:>6}{r['dtype']:>9}"
            f"{r['step_time_s'] * 1e3:>9.1f}{r['tokens_per_s'] or r['samples_per_s']:>11.0f}"
            f"{_fmt(r['ratio_to_raw'], '.3f'):>8}{_fmt(r['ratio_to_torch'], '.3f'):>9}"
            f"{_fmt(r['speed_vs_raw_compile'], '.3f'):>9}{r['mfu']:>6.2f}{_fmt(r['mfu_datasheet'], '.2f'):>7}"
            f"{r['data_wait_share']:>7.1%}{r['time_to_first_step_s']:>8.2f}{max(r['peak_memory_bytes']) / 2**20:>9.0f}"
            f"{_fmt(r['scaling_efficiency'], '.3f'):>7}{_fmt(zero and zero['measured_over_formula'], '.3f'):>13}")
    return "\n".join(lines)


def headline(rows: list) -> str:
    """The app's speed over raw PyTorch + torch.compile + fused AdamW at one rank, mode by mode."""
    app = [r for r in rows if r["speed_vs_raw_compile"] is not None and r["mode"] not in TORCH_MODES
           and not r["mode"].endswith("+lora")]
    if not app:
        return "headline: needs the raw-compile mode and an app mode at 1 rank"
    return "headline (app speed / raw PyTorch + compile + fused AdamW, 1 rank): " + ", ".join(
        f"{r['mode']} {r['speed_vs_raw_compile']:.3f}" for r in app)


def headline_vs_fsdp2(rows: list) -> list:
    """The line that compares every app mode (LoRA aside) with torch's FSDP2 at its own world size, for each world
    size that has an fsdp2 row; none without."""
    app = [r for r in rows if r.get("speed_vs_fsdp2") is not None and r["mode"] not in TORCH_MODES
           and not r["mode"].endswith("+lora")]
    return ["headline vs FSDP2 (app speed / torch FSDP2 at the same world size): " + ", ".join(
        f"{r['mode']} x{r['ranks']} {r['speed_vs_fsdp2']:.3f}" for r in app)] if app else []


def splitting(rows: list) -> list:
    """For each split mode, the course's question: what splitting costs in speed, what it saves per rank."""
    single = one_device(rows)
    return [f"{r['mode']} x{r['ranks']}: {r['speed_vs_one_device']:.3f}x the speed of {single['mode']} on one "
            f"rank; per rank {max(r['param_bytes']) / max(single['param_bytes']):.0%} of its parameter bytes, "
            f"{max(r['peak_memory_bytes']) / max(single['peak_memory_bytes']):.0%} of its peak memory"
            for r in rows if is_split(r) and single]


def checkpointing(rows: list) -> list:
    """For each mode that checkpoints activations: what it saves in peak memory and costs in speed against the
    plain data-parallel mode (dp) at the same ranks and compile setting."""
    plain = {(r["ranks"], r["compiled"]): r for r in rows if r["mode"].partition("+")[0] == "dp"
             and not r["mode"].endswith("+lora")}
    lines = []
    for r in rows:
        base = plain.get((r["ranks"], r["compiled"]))
        if r.get("activation_checkpointing") and base:
            lines.append(f"{r['mode']} x{r['ranks']}: activation checkpointing runs at "
                         f"{base['step_time_s'] / r['step_time_s']:.3f}x the speed of {base['mode']} and peaks at "
                         f"{max(r['peak_memory_bytes']) / max(base['peak_memory_bytes']):.0%} of its memory "
                         f"({(max(base['peak_memory_bytes']) - max(r['peak_memory_bytes'])) / 2**20:,.0f} MB saved)")
    return lines


def adapters(rows: list) -> list:
    """For each mode+lora: LoRA's tokens/s and peak memory against training the whole model in the same mode."""
    whole = {(r["mode"], r["ranks"]): r for r in rows}
    lines = []
    for r in rows:
        full = whole.get((r["mode"].removesuffix("+lora"), r["ranks"])) if r["mode"].endswith("+lora") else None
        if full:
            rate = "tokens_per_s" if r["tokens_per_s"] else "samples_per_s"
            lines.append(f"{r['mode']} x{r['ranks']}: LoRA trains at {r[rate] / full[rate]:.3f}x the {rate[:-6]}/s of "
                         f"the whole model ({r[rate]:,.0f} vs {full[rate]:,.0f}) and peaks at "
                         f"{max(r['peak_memory_bytes']) / max(full['peak_memory_bytes']):.0%} of its memory "
                         f"({max(r['peak_memory_bytes']) / 2**20:,.0f} vs {max(full['peak_memory_bytes']) / 2**20:,.0f} MB)")
    return lines


def plot(rows: list, path: Path):  # long: three panels
    """Bars of throughput, of the largest rank's peak memory and of its parameter bytes, one per mode; the modes
    that split the model are drawn in their own colour, so the chart shows what splitting costs and saves."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    labels = [f"{r['mode']} x{r['ranks']}" for r in rows]
    rate = "tokens_per_s" if rows[0]["tokens_per_s"] is not None else "samples_per_s"
    colours = ["tab:red" if is_split(r) else "tab:blue" for r in rows]
    fig, (top, middle, bottom) = plt.subplots(3, 1, figsize=(max(6, len(rows) * 0.8), 9), sharex=True)
    top.bar(labels, [r[rate] for r in rows], color=colours)
    top.set_ylabel(rate.replace("_per_s", "/s"))
    top.set_title("red: the model split across ranks (pipeline stages or tensor-parallel shards)", fontsize=9)
    middle.bar(labels, [max(r["peak_memory_bytes"]) / 2**20 for r in rows], color=colours)
    middle.set_ylabel("peak memory, largest rank (MiB)")
    bottom.bar(labels, [max(r["param_bytes"]) / 2**20 for r in rows], color=colours)
    bottom.set_ylabel("parameters held, largest rank (MiB)")
    bottom.tick_params(axis="x", rotation=45)
    for ax in (top, middle, bottom):
        ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
