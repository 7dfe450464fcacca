"""Pipeline parallelism through DeepSpeed's PipelineModule: the JSON's "pipeline" section, the split of a model
into a sequence of layers, and the forward pass that feeds whole batches to engine.train_batch.

Each rank builds the whole model on the host from the same seed (so a split run starts from the very weights
of an unsplit one) and keeps only its stage's layers on its device. DeepSpeed's PipeDataParallelTopology lays
ranks out pipe-major: rank = stage x replicas + replica, so a rank's data-parallel rank is rank % replicas.
"""
import json
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from app.core.fused_loss import masked_padding
from app.distributed import dist
from app.ds import internals as ds_internals
from app.ds.precision import input_dtype
from app.errors import UserError
from app.observe.metrics import Meter
from app.parallel import activations

LAYOUT = "pipeline_layers.json"
"""In a pipeline checkpoint: for each layer index, its parameter names -> the unsplit model's names."""
KEYS = {"stages": int, "partition": str, "activation_checkpoint_interval": int, "seed_layers": bool,
        "pipe_partitioned": bool, "grad_partitioned": bool, "use_reentrant": bool}
"""The keys DeepSpeed's "pipeline" section has, with their types; the app reads stages and partition."""
PARTITIONS = ("parameters", "uniform", "type:<regex>")


@dataclass
class StagePlan:
    """How a run splits its model: stages, how layers are partitioned, activation checkpointing."""
    stages: int
    partition: str = "parameters"
    activation_checkpoint_interval: int = 0


def stage_plan(ds: dict, world_size: int, where: str):
    """The StagePlan the JSON's "pipeline" section asks for (None without one), checked against the world size and
    the ZeRO stage before anything is built."""
    from app.ds.config import suggest, zero_stage
    section = ds.get("pipeline")
    if section is None:
        return None
    if not isinstance(section, dict):
        raise UserError(f"{where}: \"pipeline\" must be an object such as {{\"stages\": 2}}")
    for key, value in section.items():
        if key not in KEYS:
            raise UserError(f"{where}: unknown key pipeline.{key}{suggest(key, KEYS)}")
        if type(value) is not KEYS[key]:
            raise UserError(f"{where}: pipeline.{key} must be {KEYS[key].__name__}, got {value!r}")
    found = StagePlan(section.get("stages", 0), section.get("partition", "parameters"),
                 section.get("activation_checkpoint_interval", 0))
    if found.stages < 1:
        raise UserError(f"{where}: set pipeline.stages to the number of pipeline stages (1 or more)")
    _check_partition(found.partition, where)
    if section.get("seed_layers"):  # DeepSpeed seeds the layers it builds from LayerSpecs: the app's are built
        raise UserError(f"{where}: pipeline.seed_layers reseeds layers DeepSpeed builds; the app builds the model "
                        f"whole before it splits it (--seed seeds the run): leave seed_layers out")
    if found.activation_checkpoint_interval < 0:
        raise UserError(f"{where}: pipeline.activation_checkpoint_interval must be 0 (off) or more")
    if zero_stage(ds) >= 2:
        raise UserError(f"{where}: DeepSpeed cannot pipeline with ZeRO stage {zero_stage(ds)} (it partitions "
                        f"gradients across the stages' replicas); use ZeRO stage 0 or 1 with \"pipeline\"")
    if world_size % found.stages:
        raise UserError(f"{where}: pipeline.stages {found.stages} does not divide the world size {world_size}; "
                        f"launch a multiple of {found.stages} ranks (stages x data-parallel replicas), e.g. "
                        f"`deepspeed --num_gpus {found.stages} app/train.py ...`")
    return found


def _check_partition(partition: str, where: str):
    """pipeline.partition is one of PARTITIONS, a type: regex as DeepSpeed reads it (lower case, up to a ':')."""
    if partition in PARTITIONS[:2]:
        return
    if not partition.startswith("type:"):
        raise UserError(f"{where}: pipeline.partition must be one of {', '.join(PARTITIONS)}, got {partition!r}")
    pattern = partition[len("type:"):]
    if ":" in pattern:
        raise UserError(f"{where}: pipeline.partition {partition!r}: DeepSpeed reads the regex only up to its first "
                        f"':' ({pattern.split(':')[0]!r}); write it without one, e.g. type:Conv2d|Linear")
    try:
        re.compile(pattern.lower())
    except re.error as e:
        raise UserError(f"{where}: pipeline.partition {partition!r} is not a regular expression: {e}") from None


def data_parallel(found, world_size: int, rank: int) -> tuple:
    """(data-parallel rank, data-parallel size) of this rank: pipeline stages share one replica's data."""
    replicas = world_size // (found.stages if found else 1)
    return rank % replicas, replicas


class TokenEmbedding(nn.Module):
    """GPT-2's token embedding: the pipeline's first layer, tied to its last (the output projection)."""

    def __init__(self, wte: nn.Embedding, real_vocab: int):
        super().__init__()
        self.wte, self.real_vocab = wte, real_vocab

    def forward(self, input_ids):
        return self.wte(input_ids)


def tied_logits(embedding: TokenEmbedding, hidden: torch.Tensor) -> torch.Tensor:
    """The last layer: hidden states times the token embedding, padded vocabulary rows masked as unsplit."""
    return masked_padding(hidden @ embedding.wte.weight.t(), embedding.real_vocab)


class Positions(nn.Module):
    """GPT-2's position embedding (and embedding dropout) added to the token embeddings."""

    def __init__(self, wpe: nn.Embedding, drop: nn.Module):
        super().__init__()
        self.wpe, self.drop = wpe, drop

    def forward(self, hidden):
        return self.drop(hidden + self.wpe(torch.arange(hidden.size(1), device=hidden.device)))


class Block(nn.Module):
    """One GPT-2 block, causal on its own: SDPA and flash attention take no mask as causal; others get one."""

    def __init__(self, block: nn.Module, attention: str):
        super().__init__()
        self.block, self.needs_mask = block, attention not in ("sdpa", "flash_attention_2", "flash_attention_3")

    def forward(self, hidden):
        mask = None
        if self.needs_mask:
            size = hidden.size(1)
            above = torch.ones(size, size, dtype=torch.bool, device=hidden.device).triu(1)
            mask = torch.zeros(size, size, dtype=hidden.dtype, device=hidden.device).masked_fill(
                above, torch.finfo(hidden.dtype).min)[None, None]
        out = self.block(hidden, attention_mask=mask)
        return out[0] if isinstance(out, tuple) else out


def layers_of(model: nn.Module, model_name: str) -> list:
    """The model as a sequence of layers DeepSpeed's PipelineModule can split, or one line saying why not."""
    from deepspeed.pipe import TiedLayerSpec
    from app.core.models import HFLogits
    if isinstance(model, nn.Sequential):
        return list(model)
    if type(model).__name__ == "ResNet":
        blocks = [block for stage in (model.layer1, model.layer2, model.layer3, model.layer4) for block in stage]
        return [model.conv1, model.bn1, model.relu, model.maxpool, *blocks, model.avgpool, nn.Flatten(), model.fc]
    if isinstance(model, HFLogits) and model.hf.config.model_type == "gpt2" and hasattr(model.hf, "lm_head"):
        body, attention = model.hf.transformer, model.hf.config._attn_implementation
        tied = dict(key="wte", typename=TokenEmbedding, tied_weight_attr=["wte.weight"], wte=body.wte,
                    real_vocab=model.real_vocab)
        return [TiedLayerSpec(**tied), Positions(body.wpe, body.drop), *[Block(b, attention) for b in body.h],
                body.ln_f, TiedLayerSpec(**tied, forward_fn=tied_logits)]
    raise UserError(f"{model_name} cannot be split into pipeline stages: the app splits the built-in cnn and mlp, "
                    f"torchvision ResNets and GPT-2 language models (presets and folders); for another model "
                    f"drop \"pipeline\" and spread its weights with ZeRO stage 3 (ds_configs/zero3.json)")


def layer_names(model: nn.Module, layers: list) -> list:
    """For each layer, {its state-dict name: [the unsplit model's names for that tensor]}; every tensor of the
    model must belong to some layer, or the split would lose weights."""
    names = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        names.setdefault(id(tensor), []).append(name)
    found, covered = [], set()
    for layer in layers:
        module = layer.build() if not isinstance(layer, nn.Module) else layer
        own = {name: names.get(id(t), []) for name, t in module.state_dict(keep_vars=True).items()}
        covered |= {id(t) for t in module.state_dict(keep_vars=True).values()}
        found.append(own)
    lost = [n[0] for key, n in names.items() if key not in covered]
    if lost:
        raise UserError(f"this model cannot be split into pipeline stages: {lost[0]} belongs to no layer")
    return found


class StageLoss:
    """The loss DeepSpeed calls on the last stage, on (logits, (labels, weights)); it adds each micro batch's
    loss sums (and accuracy when evaluating) to the meter the forward pass hands it."""

    def __init__(self, task):
        self.task, self.meter = task, None

    def __call__(self, logits, labels):
        y, w = labels
        losses = self.task.loss(logits, y)
        sums = {"loss": (losses.detach() * w).sum()}
        if "accuracy" in self.meter.names:
            sums["accuracy"] = (self.task.correct(logits.detach(), y) * w).sum()
        self.meter.add((w > 0).sum(), w.sum(), **sums)
        return (losses * w).sum()


def split(model: nn.Module, model_name: str, found: StagePlan, task):
    """(PipelineModule holding this rank's stage, layer layout for checkpoints)."""
    from deepspeed.pipe import PipelineModule
    layers = layers_of(model, model_name)
    if len(layers) < found.stages:
        raise UserError(f"pipeline.stages {found.stages} is more than the {len(layers)} layers {model_name} "
                        f"splits into; use at most {len(layers)} stages")
    names = layer_names(model, layers)
    # Reentrant activation checkpointing cuts the gradient of a layer whose input is token ids (it needs an
    # input that requires grad), so a transformer checkpoints its blocks only; other models any weighted layer.
    blocks = ["Block"] if any(isinstance(layer, Block) for layer in layers) else None
    try:
        module = PipelineModule(layers, num_stages=found.stages, loss_fn=StageLoss(task),
                                partition_method=found.partition, checkpointable_layers=blocks,
                                activation_checkpoint_interval=found.activation_checkpoint_interval)
    except (RuntimeError, NotImplementedError) as e:
        raise UserError(f"pipeline.partition {found.partition!r}: {str(e).splitlines()[0]}") from None
    ds_internals.count_every_stage_in_grad_norm(module)
    ds_internals.drop_other_stages(module)
    if found.activation_checkpoint_interval > 0:  # ResNet's checkpointed layers hold batch norms
        activations.norms_kept_when_recomputed(module)
    parts = module.partitions()
    for stage, (start, stop) in enumerate(zip(parts, parts[1:])):
        if not any(names[start:stop]):  # DeepSpeed's optimizer refuses a stage without weights
            raise UserError(f"pipeline.partition {found.partition!r} leaves stage {stage} of {model_name} without "
                            f"weights (layers {start}-{stop - 1}); use \"parameters\" or fewer stages")
    return module, names


def describe(engine) -> str:
    """The start-up line of a pipeline run: stages, replicas, and which layers each stage holds."""
    parts = engine.module.partitions()
    bounds = ", ".join(f"{stage}: {parts[stage]}-{parts[stage + 1] - 1}" for stage in range(engine.num_stages))
    stages = f"{engine.num_stages} stage{'s' if engine.num_stages > 1 else ''}"
    return (f"pipeline: {stages} x {engine.dp_world_size} data-parallel replica(s), "
            f"{engine.gradient_accumulation_steps()} micro batches per step; layers by stage {bounds}")


def save_layer_names(names: list, folder: Path):
    """Write the layer layout into a checkpoint folder (app.tools.export reads it)."""
    (folder / LAYOUT).write_text(json.dumps(names))


def unsplit_state_dict(folder: Path) -> dict:
    """The unsplit model's state dict from a pipeline checkpoint's per-layer files."""
    names, state = json.loads((folder / LAYOUT).read_text()), {}
    for index, own in enumerate(names):
        files = sorted(folder.glob(f"layer_{index:02d}-*model_states.pt"))
        if not files:
            continue  # a layer without weights, or the tied output projection saved with the first layer
        for name, tensor in torch.load(files[0], map_location="cpu", weights_only=True).items():
            for original in own.get(name, []):
                state[original] = tensor
    return state


class PipeStep:
    """What the loop runs on a PipelineEngine: micro batches gathered into one engine.train_batch per
    optimizer step, evaluation through engine.eval_batch. The last stage's loss fills the meters."""

    def __init__(self, engine, task, compile_model: bool, board=None):
        self.engine, self.task, self.dtype = engine, task, input_dtype(engine)
        self.pending = []
        if compile_model:
            dist.print0("compile: pipeline stages run eager (the app compiles whole models, not stages)")

    metrics = ["loss"]
    """What the meter sums at each micro step, and the log rows show."""
    compiled = False
    """Pipeline stages run eager."""

    def trial_parts(self, batch) -> list:
        """The micro batch search's step: the whole batch through the pipeline's schedule, in one part."""
        return [lambda: self.micro_step(batch, Meter(self.metrics, self.engine.device))]

    def _batch(self, batch) -> tuple:
        x, y, w = batch
        return (x.to(self.dtype) if x.is_floating_point() else x), (y, w)

    def micro_step(self, batch, meter: Meter):
        """Add a micro batch; once a whole batch is gathered, run the pipeline's schedule over it."""
        self.pending.append(self._batch(batch))
        if len(self.pending) == self.engine.gradient_accumulation_steps():
            self.engine.module.loss_fn.meter = meter
            self.engine.train_batch(iter(self.pending))
            self.pending = []

    def evaluate(self, loader) -> dict:
        """Eval loss and accuracy over every replica's shard, padding excluded."""
        meter = Meter(["loss", "accuracy"], self.engine.device)
        self.engine.module.loss_fn.meter = meter
        chunk, size = [], self.engine.gradient_accumulation_steps()
        for index, batch in enumerate(loader, start=1):
            chunk.append(self._batch(batch))
            if len(chunk) == size or index == len(loader):
                self.engine.eval_batch(iter(chunk), num_micro_batches=len(chunk))
                chunk = []
        self.engine.train()
        result = meter.reduce()
        return {"eval_loss": result["loss"], "eval_accuracy": result["accuracy"],
                **self.task.eval_metrics(result["loss"])}
