"""The training core: the loop and its schedule (loop.py), the training step (step.py) and its torch.compile
(compiling.py), one task per kind of job (tasks.py), model builders (models.py)."""
