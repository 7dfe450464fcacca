"""The app's engine of a model, for tests that build one in a rank of their own (no conftest there: it hides the
GPUs)."""


def engine_of(model, ds: dict):
    """The app's engine of model under ds (a dict as a test writes it), made whole as a run makes its own
    (app/ds/run_dict.py: DeepSpeed's timer off, buckets fitted to the model)."""
    from app.core import loop
    from app.ds import run_dict
    return loop.build_engine(model, run_dict.for_engine(ds, run_dict.trainable(model), 1))
