"""How a run lays out its ranks: data parallel alone, pipeline stages (app/parallel/pipeline.py) or tensor-parallel shards
(app/parallel/tensor_parallel.py), each with data-parallel replicas. train.py asks this module, not the two."""
from dataclasses import dataclass

from app.errors import UserError
from app.parallel import activations, pipeline
from app.parallel import sequence_parallel, tensor_parallel, tiled


@dataclass
class RankLayout:
    split: object
    """The pipeline.StagePlan, or None when the model is not split into stages."""
    tensor: int
    """Tensor-parallel degree (1: none)."""
    replica: int
    """This rank's data-parallel replica: which shard of the data it loads."""
    replicas: int
    """Data-parallel replicas: the world size over stages, tensor-parallel or sequence-parallel degree."""
    sequence: int = 1
    """Sequence-parallel degree: ranks that each hold a part of every sequence (1: none)."""

    def prepare(self, model, task, model_name: str, ds: dict) -> tuple:
        """(the module the engine trains, extra(folder) files rank 0 saves, every_rank(engine, folder) files every rank
        saves): the model (its blocks checkpointed where the JSON asks), this rank's pipeline stage of it, or the model
        AutoTP will shard."""
        if self.sequence > 1:
            sequence_parallel.attach(model, self.sequence, model_name)
        tiled.for_run(model, task, self.sequence, model_name)
        model = activations.apply(model, ds)
        if self.split:
            module, names = pipeline.split(model, model_name, self.split, task)
            return (module, lambda folder: (task.save_files(folder), pipeline.save_layer_names(names, folder)),
                    task.save_rank_files)
        if self.tensor > 1:
            tensor_parallel.check_model(model, model_name)
            return model, task.save_files, lambda engine, folder: (tensor_parallel.save_full_weights(engine, folder),
                                                                   task.save_rank_files(engine, folder))
        return model, task.save_files, task.save_rank_files

    def train_step(self, engine, task, compile_model: bool, board=None):
        """What the loop runs: whole batches through the pipeline's schedule, else micro steps (board: the run's
        endings.Board, for the first compiled step)."""
        if self.split:
            return pipeline.PipeStep(engine, task, compile_model, board)
        if self.sequence > 1:
            return task.make_sequence_step(engine, compile_model, board)
        return task.make_step(engine, compile_model, board)

    def describe(self, engine, task) -> str:
        """The start-up line of a model-parallel run, and of its tiles ('' for data parallel alone)."""
        return "; ".join(line for line in (self._parallel(engine), tiled.describe(engine.module, task.fused_logits))
                         if line)

    def _parallel(self, engine) -> str:
        """The model-parallel part of the start-up line."""
        if self.split:
            return pipeline.describe(engine)
        if self.tensor > 1:
            return (f"tensor parallel: DeepSpeed AutoTP shards each layer across {self.tensor} ranks x "
                    f"{self.replicas} data-parallel replica(s)")
        if self.sequence > 1:
            return sequence_parallel.describe(self.sequence, self.replicas)
        return ""


def rank_layout(ds: dict, world_size: int, rank: int, where: str) -> RankLayout:
    """The layout the JSON asks for on this world, checked before anything is built."""
    split = pipeline.stage_plan(ds, world_size, where)
    tensor = tensor_parallel.size(ds, world_size, where)
    sequence = sequence_parallel.size(ds, world_size, where)
    replica, replicas = (pipeline.data_parallel(split, world_size, rank) if split else
                         tensor_parallel.data_parallel(max(tensor, sequence), world_size, rank))
    return RankLayout(split, tensor, replica, replicas, sequence)
