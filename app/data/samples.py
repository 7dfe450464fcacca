"""What the loader reads of a training or held-out set (Samples), the same for loaded, mixed and streamed rows, and
the weights it gives each sample's loss."""
from torch.utils.data import Dataset


class Samples(Dataset):
    """A set the app builds: its samples, and what the loader and the log read of it, each with a default."""
    units = None
    """What each sample's loss averages over (answer tokens, a block's rows' answer tokens), one number a sample;
    None: one each."""
    sources = None
    """app/data/sources.py's Sources when the set is made of several sources; None: one."""
    stream = None
    """app/data/stream.py's Stream when the training samples are read as a stream; None: loaded."""
    repeats = 1
    """Optimizer steps each window of training samples takes (GRPO's --num_iterations): the loader gives each window
    this many times over (app/data/loader.py)."""

    def per_sample(self) -> dict:
        """Rows and real (not padding) tokens a sample holds, on average, for the summary's rates: nothing here."""
        return {}


ANY = Samples()  # what a foreign set (torchvision's, a TensorDataset, a Subset) declares: the defaults


def declared(dataset) -> Samples:
    """The set's own declarations (units, sources, stream, repeats, per_sample), or the defaults for a foreign set."""
    return dataset if isinstance(dataset, Samples) else ANY


def weights(units: list, window: float, world: int, accumulation: int) -> list:
    """Each sample's loss weight: W x A x its units / the units of its optimizer step's whole window, so that
    summing weight x per-unit mean loss over the window gives its mean over every unit (loader.ShardSampler)."""
    return [world * accumulation * u / window for u in units]
