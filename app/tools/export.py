"""Export a checkpoint's fp32 weights: python -m app.tools.export <run or checkpoint> <out.safetensors | folder>.

A .safetensors file holds the plain state dict; a folder (transformers models) gets save_pretrained form. A LoRA
run's folder is the adapter folder peft loads (PeftModel.from_pretrained), or with --merged the base model with the
adapters folded in.
"""
import argparse
import contextlib
import errno
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

import torch

from app.core import lora
from app.ds import internals as ds_internals
from app.parallel import pipeline
from app.checkpoint import resume
from app.checkpoint.save import same_base
from app.parallel import tensor_parallel
from app.ds.internals.safe_load import data_only
from app.errors import UserError, first_line, report


def fp32_state_dict(folder: Path) -> dict:
    """The model's full fp32 weights from a checkpoint folder of any ZeRO stage or pipeline split, loaded as data."""
    with data_only(f"a file under {folder}"):  # zero_to_fp32 loads with weights_only=False
        return _fp32_state_dict(folder)


def _fp32_state_dict(folder: Path) -> dict:
    if (folder / tensor_parallel.FULL_WEIGHTS).is_file():  # gathered from the shards when it was saved
        return torch.load(folder / tensor_parallel.FULL_WEIGHTS, map_location="cpu", weights_only=True)
    if (folder / pipeline.LAYOUT).is_file():  # per-layer files, named back to the unsplit model
        return {name: tensor.float() for name, tensor in pipeline.unsplit_state_dict(folder).items()}
    if any(folder.glob("*optim_states.pt")):
        # ZeRO 1-3 (and bf16, whose fp32 master copies live in partitioned optimizer files)
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
        return get_fp32_state_dict_from_zero_checkpoint(str(folder.parent), tag=folder.name)
    # ZeRO stage 0 keeps the whole module in one file, which DeepSpeed's own converter refuses.
    return {name: tensor.float() for name, tensor in ds_internals.module_states(folder).items()}


def save_pretrained(folder: Path, state: dict, task: str, out: Path):
    """Write a transformers model folder (config, safetensors weights, generation settings, tokenizer) that
    from_pretrained loads; a vocabulary padded for speed is cut back to the tokenizer's tokens."""
    from transformers import AutoTokenizer
    from app.core.models import HF_FILES, exported_config, hf_class, vocab_size
    files = folder / HF_FILES
    hf = hf_class(task).from_config(exported_config(files))
    missing, unexpected = hf.load_state_dict({k.removeprefix("hf."): v for k, v in state.items()}, strict=False)
    tied = {name for name, p in hf.named_parameters(remove_duplicate=False)} - dict(hf.named_parameters()).keys()
    if unexpected or set(missing) - tied:
        raise UserError(f"{folder} does not match its saved config (missing {sorted(set(missing) - tied)[:3]}, "
                        f"unexpected {sorted(unexpected)[:3]})")
    if vocab_size(hf.config) < hf.config.vocab_size:  # the padding rows never trained; left in, they would be sampled
        hf.resize_token_embeddings(vocab_size(hf.config), mean_resizing=False)
        del hf.config.unpadded_vocab_size
    if hf.generation_config is not None:
        _generation(hf, files)
    hf.save_pretrained(out)
    AutoTokenizer.from_pretrained(files).save_pretrained(out)


def _generation(hf, files: Path):
    """The base model's generation settings the checkpoint kept (its sampling defaults, its end tokens), with the KV
    cache on."""
    from transformers import GenerationConfig
    if (files / "generation_config.json").is_file():
        hf.generation_config = GenerationConfig.from_pretrained(files)
    hf.generation_config.use_cache = True


WRITE_ERRORS = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOTDIR,
                errno.EEXIST}  # where the cure is space or another path (else a read: a base model, a tokenizer)


@contextlib.contextmanager
def _writing(out: Path):
    """A path beside out to write, moved to out once whole: a failed export leaves nothing at out, and a failure to
    write (a full disk, a folder without write access) is one line."""
    from safetensors import SafetensorError  # how safetensors says an OSError
    partial = out.with_name(f".{out.name}.partial")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        _remove(partial)
        yield partial
        os.replace(partial, out)
    except (OSError, SafetensorError) as e:
        _remove(partial)
        cure = ": free some space or name a path you can write" if isinstance(e, SafetensorError) or \
            getattr(e, "errno", None) in WRITE_ERRORS else ""
        raise UserError(f"export to {out} failed ({first_line(e)}); nothing was written there{cure}") from None
    except BaseException:
        _remove(partial)
        raise


def _remove(path: Path):
    with contextlib.suppress(OSError):
        shutil.rmtree(path) if path.is_dir() else path.unlink(missing_ok=True)


def export_lora(folder: Path, saved, state: dict, out: Path, merged: bool):
    """A LoRA checkpoint: the adapter folder peft loads, or (merged) the base model with the adapters folded in,
    in save_pretrained form; either with the run's tokenizer."""
    from transformers import AutoTokenizer
    from app.core.models import HF_FILES, hf_spec
    files = folder / HF_FILES
    task = "sequence_classification" if saved.data_info.get("task") == "sequence_classification" else "causal_lm"
    if not merged:
        lora.write_adapters(files, state, out)
    else:
        base = saved.settings["model"]
        spec = hf_spec(base)
        if not spec.pretrained:
            raise UserError(f"--merged folds the adapters into the base model's weights, and {base} was built from "
                            f"random weights the checkpoint does not hold; export the adapters alone (leave out "
                            f"--merged)")
        if not same_base(saved.lora["base"], lora.fingerprint(base, spec.pretrained, saved.settings["seed"],
                                                              spec.config)):
            raise UserError(f"{base} is not the base model the adapters of {folder} were trained on (its config or "
                            f"weights differ); put that model back, or export the adapters alone")
        with tempfile.TemporaryDirectory() as adapters:
            lora.write_adapters(files, state, Path(adapters))
            lora.merge(Path(adapters), spec.pretrained, task, out, files)
    AutoTokenizer.from_pretrained(files).save_pretrained(out)


def export(folder: Path, out: Path, merged: bool = False) -> dict:
    """Verify the checkpoint, then write its fp32 weights to out with the run's record as metadata (LoRA: the
    adapter folder, or the merged model)."""
    from safetensors.torch import save_file
    named, folder = folder, resume.checkpoint_folder(folder)
    if folder != named:
        print(f"exporting the newest complete checkpoint of {named}: {folder.name}", flush=True)
    saved = resume.verify(folder)
    if merged and not saved.lora:
        raise UserError(f"--merged folds LoRA adapters into their base model, and {folder} holds a whole model; "
                        f"leave out --merged")
    if saved.lora and out.suffix == ".safetensors":  # the checkpoint holds the adapters alone, not the base
        raise UserError(f"{folder} holds LoRA adapters: export them to a folder (the adapter folder peft loads), "
                        f"or with --merged to a folder of the whole model; not to {out.name}")
    if out.exists():
        raise UserError(f"{out} already exists; pick a new output path")
    task = saved.data_info.get("task", "image_classification")
    if out.suffix != ".safetensors" and task == "image_classification":
        raise UserError(f"{folder} holds a {saved.model} image model; export it to a file ending in .safetensors")
    state = {name: tensor.detach().to(torch.float32).contiguous().clone() for name, tensor in
             fp32_state_dict(folder).items()}
    with _writing(out) as partial:
        if out.suffix != ".safetensors":
            export_lora(folder, saved, state, partial, merged) if saved.lora else save_pretrained(folder, state, task,
                                                                                                 partial)
        else:
            meta = {key: json.dumps(getattr(saved, key)) for key in ("model", "dataset", "step", "zero_stage",
                                                                     "world_size", "data_info")}
            save_file(state, str(partial), metadata=meta)
    return state


def main(argv=None) -> int:
    """Command-line entry point; returns the exit code."""
    parser = argparse.ArgumentParser(prog="python -m app.tools.export", description=__doc__)
    parser.add_argument("checkpoint", type=Path, help="a run folder (its newest complete checkpoint) or a checkpoint "
                                                      "folder, e.g. <output_dir>/checkpoints/step00000100")
    parser.add_argument("out", type=Path, help="the .safetensors file to write, or (transformers models) a folder "
                                               "to write in save_pretrained form")
    parser.add_argument("--merged", action="store_true", help="LoRA checkpoints: write the base model with the "
                        "adapters folded into its weights (default: the adapter folder peft loads)")
    args = parser.parse_args(argv)
    try:
        state = export(args.checkpoint, args.out, args.merged)
    except UserError as e:
        return report(e)
    count = sum(t.numel() for t in state.values())
    print(f"wrote {len(state)} tensors ({count:,} fp32 parameters) to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
