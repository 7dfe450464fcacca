"""Image datasets: one small builder per source, each returning (train set, eval set, DataInfo)."""
import contextlib
import os
import sys
from pathlib import Path

import torch
from PIL import Image
from torch.utils.data import Subset, TensorDataset

from app.data import DataInfo
from app.errors import UserError, first_line


def _digits(data_dir, image_size):
    """scikit-learn's bundled 8x8 handwritten digits: 1,797 real images, a fixed 80/20 split.

    Importing scikit-learn takes seconds in every process that trains, so the split tensors are kept in
    data_dir after the first run (per scikit-learn version); a cache that cannot be read or written is skipped.
    """
    import importlib.metadata
    cache = Path(data_dir) / f"digits-sklearn-{importlib.metadata.version('scikit-learn')}.pt"
    try:
        train_x, train_y, eval_x, eval_y = torch.load(cache, weights_only=True)
    except (OSError, RuntimeError, ValueError, EOFError):
        train_x, train_y, eval_x, eval_y = _digits_split()
        _save_quietly((train_x, train_y, eval_x, eval_y), cache)
    return TensorDataset(train_x, train_y), TensorDataset(eval_x, eval_y), DataInfo(10, 1, 8)


def _digits_split() -> tuple:
    """(train images, train labels, eval images, eval labels) from scikit-learn, stratified with a fixed seed."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split
    digits = load_digits()
    images = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    images = (images - 0.3) / 0.4  # roughly zero mean, unit variance
    labels = torch.tensor(digits.target, dtype=torch.long)
    train_idx, eval_idx = train_test_split(range(len(labels)), test_size=0.2, random_state=0, stratify=labels)
    train_idx, eval_idx = torch.tensor(train_idx), torch.tensor(eval_idx)
    return images[train_idx], labels[train_idx], images[eval_idx], labels[eval_idx]


def _save_quietly(tensors, path: Path):
    """torch.save to path through a temporary file (readers see all or nothing); nothing if it cannot be written."""
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save(tensors, tmp)
        os.replace(tmp, path)
    except OSError:
        with contextlib.suppress(OSError):
            tmp.unlink()


def _synthetic(data_dir, image_size, n_train=2048, n_eval=512, classes=10, noise=8.0):
    """3x32x32 images of class patterns under noise, no files needed: each class is a smooth colour pattern
    (random 4x4 blobs per channel, scaled up), each image its class's pattern shifted by up to 4 pixels plus
    Gaussian noise of std `noise`, which hides any one pixel. A model that learns tells them apart, one that does not
    stays at chance (10%): docs/data-and-models.md."""
    gen = torch.Generator().manual_seed(1234)
    patterns = torch.nn.functional.interpolate(torch.randn(classes, 3, 4, 4, generator=gen), size=40,
                                               mode="bilinear", align_corners=False)
    labels = torch.randint(classes, (n_train + n_eval,), generator=gen)
    shifts = torch.randint(0, 9, (n_train + n_eval, 2), generator=gen)
    images = torch.stack([patterns[y, :, dy:dy + 32, dx:dx + 32] for y, (dy, dx) in zip(labels.tolist(),
                                                                                         shifts.tolist())])
    images = images / images.std() + noise * torch.randn(images.shape, generator=gen)
    return (TensorDataset(images[:n_train], labels[:n_train]), TensorDataset(images[n_train:], labels[n_train:]),
            DataInfo(classes, 3, 32))


TORCHVISION = {
    # name: (torchvision class, channels, size, mean, std, folder it creates under data_dir)
    "mnist": ("MNIST", 1, 28, (0.1307,), (0.3081,), "MNIST/raw"),
    "fashion_mnist": ("FashionMNIST", 1, 28, (0.2860,), (0.3530,), "FashionMNIST/raw"),
    "cifar10": ("CIFAR10", 3, 32, (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616), "cifar-10-batches-py"),
}


def _torchvision(name, data_dir, image_size):
    """A torchvision dataset from data_dir, downloaded there first when missing and online."""
    import torchvision
    from torchvision import transforms
    cls_name, channels, size, mean, std, folder = TORCHVISION[name]
    cls = getattr(torchvision.datasets, cls_name)
    tf = transforms.Compose([transforms.ToTensor(), transforms.Normalize(mean, std)])
    try:
        train = _open_torchvision(cls, data_dir, tf, folder, train=True)
    except FileNotFoundError:
        if os.environ.get("HF_HUB_OFFLINE") == "1":
            raise UserError(f"{cls_name} is not in {Path(data_dir) / folder} and HF_HUB_OFFLINE=1 forbids downloading "
                            f"it; put the dataset files there or unset HF_HUB_OFFLINE while online") from None
        try:
            train = cls(data_dir, train=True, transform=tf, download=True)
        except Exception as e:
            raise UserError(f"{cls_name} is not in {Path(data_dir) / folder} and could not be downloaded "
                            f"({type(e).__name__}); put the dataset files there or run once while online") from None
    eval_set = _open_torchvision(cls, data_dir, tf, folder, train=False)
    return train, eval_set, DataInfo(len(train.classes), channels, size)


def _open_torchvision(cls, data_dir, tf, folder, train: bool):
    """cls's split from data_dir; FileNotFoundError when it is not there, one line when its files are damaged."""
    try:
        return cls(data_dir, train=train, transform=tf, download=False)
    except RuntimeError as e:
        if "not found" in str(e).lower():
            raise FileNotFoundError(folder) from None
        error = e
    except Exception as e:  # noqa: BLE001 (a file cut short fails inside torchvision's reader as anything)
        error = e
    where = _file_being_read(error, Path(data_dir) / folder) or f"the {cls.__name__} files in {Path(data_dir) / folder}"
    raise UserError(f"{where} cannot be read ({first_line(error)}): it may be damaged or cut short; delete "
                    f"{Path(data_dir) / folder} so the dataset is downloaded again, or copy it again") from None


def _file_being_read(error: BaseException, folder: Path) -> str:
    """The file under folder that a reader was reading when it raised error (a path among its frames' locals)."""
    tb, found = error.__traceback__, ""
    while tb is not None:
        for value in tb.tb_frame.f_locals.values():
            if isinstance(value, (str, Path)) and str(value).startswith(str(folder)) and Path(value).is_file():
                found = str(value)
        tb = tb.tb_next
    return found


# PIL's errors for a file that is not an image it reads: not an image and cut short (OSErrors), and one too large to
# decode (DecompressionBombError: over twice Image.MAX_IMAGE_PIXELS)
_UNREADABLE = (OSError, ValueError, SyntaxError, Image.DecompressionBombError)
IMAGENET = ((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))  # the mean and std torchvision's weights were trained at


def _imagefolder(data_dir, image_size, normal=((0.5, 0.5, 0.5), (0.25, 0.25, 0.25))):
    """data_dir/train/<class>/*.png and data_dir/val/<class>/*.png (or a fixed 10% held out of train), normalised by
    normal's (mean, std)."""
    import torchvision
    from torchvision import transforms
    root = Path(data_dir)
    train_dir = root / "train" if (root / "train").is_dir() else root
    beside = next((d for d in EVAL_FOLDERS if (root / d).is_dir()), None)
    if train_dir == root and beside:  # ImageFolder would read the held-out images as one more class, and train on them
        raise UserError(f"ImageFolder {root} has {beside}/ but no train/: move the class folders beside it into "
                        f"{root}/train")
    if not train_dir.is_dir() or not any(train_dir.iterdir()):
        raise UserError(f"ImageFolder data directory {train_dir} is missing or empty; put one folder of images "
                        f"per class in {root}/train (and optionally {root}/val)")
    tf = transforms.Compose([transforms.Resize(image_size), transforms.CenterCrop(image_size), transforms.ToTensor(),
                             transforms.Normalize(*normal)])
    try:
        train = torchvision.datasets.ImageFolder(str(train_dir), transform=tf, loader=open_image)
    except (FileNotFoundError, RuntimeError) as e:
        raise UserError(f"ImageFolder {train_dir}: {e}") from None
    if beside:
        eval_set = _eval_folder(root / beside, train, tf)
    else:
        order = torch.randperm(len(train), generator=torch.Generator().manual_seed(0)).tolist()
        cut = max(1, len(order) // 10)
        eval_set = Subset(train, order[:cut])
        train = Subset(train, order[cut:])
    classes = len(train.dataset.classes if isinstance(train, Subset) else train.classes)
    return train, eval_set, DataInfo(classes, 3, image_size)


EVAL_FOLDERS = ("val", "validation", "valid", "test")  # the held-out folder beside train/, first found


def _eval_folder(val_dir: Path, train, tf):
    """The ImageFolder of val_dir, each image labelled by the index its class has in train (ImageFolder numbers
    each folder's classes on its own, so a val/ without one of train's classes would shift the others' labels)."""
    import torchvision
    try:
        held_out = torchvision.datasets.ImageFolder(str(val_dir), transform=tf, loader=open_image)
    except (FileNotFoundError, RuntimeError) as e:
        raise UserError(f"ImageFolder {val_dir}: {e}") from None
    unknown = [name for name in held_out.classes if name not in train.class_to_idx]
    if unknown:
        raise UserError(f"{val_dir} has class folders {train.root} has not ({', '.join(unknown[:5])}): the model "
                        f"learns only the classes of train/; add them there or remove them from {val_dir.name}/")
    held_out.samples = [(path, train.class_to_idx[held_out.classes[label]]) for path, label in held_out.samples]
    held_out.imgs, held_out.targets = held_out.samples, [label for _, label in held_out.samples]
    held_out.classes, held_out.class_to_idx = train.classes, train.class_to_idx
    return held_out


def open_image(path: str):
    """An image file as RGB (16-bit grey scaled to 8 bits, not clipped); one line naming the file when it is not a
    readable image."""
    try:
        with open(path, "rb") as f:
            image = Image.open(f)
            if image.mode.startswith("I;16") or image.mode == "I":  # PIL's convert clips every value above 255
                image = image.point(lambda value: value * (1 / 257)).convert("L")
            return image.convert("RGB")
    except _UNREADABLE as e:
        raise UserError(f"{path} is not a readable image ({first_line(e)}); replace or remove it") from None


def unreadable_images(*datasets) -> str:
    """'' when every file of the image folders behind datasets is an image whose structure checks out (PIL's
    verify: a PNG's chunks and checksums, a JPEG's header; no pixel is decoded), else the line naming the first
    that is not. Other datasets: ''."""
    from concurrent.futures import ThreadPoolExecutor
    bases = {id(base): base for base in (d.dataset if isinstance(d, Subset) else d for d in datasets)}.values()
    vision = sys.modules.get("torchvision")  # an image folder exists only once torchvision was imported to read it
    folders = vision.datasets.DatasetFolder if vision is not None else ()
    paths = [path for base in bases if isinstance(base, folders) for path, _ in base.samples]

    def problem(path):
        try:
            with Image.open(path) as image:
                image.verify()
                return ""
        except _UNREADABLE as e:
            return f"{path} is not a readable image ({first_line(e)}); replace or remove it"
    with ThreadPoolExecutor(8) as pool:  # file reads: threads overlap their waits
        return next((said for said in pool.map(problem, paths) if said), "")


BUILDERS = {
    "digits": _digits,
    "synthetic": _synthetic,
    "imagefolder": _imagefolder,
    **{name: (lambda data_dir, image_size, _n=name: _torchvision(_n, data_dir, image_size)) for name in TORCHVISION},
}


def build_image_sets(name: str, data_dir: str, image_size: int = 224, imagenet: bool = False):
    """(train set, eval set, DataInfo) for an image dataset name; imagenet: an image folder normalised as ImageNet's
    images were, for weights pretrained on them."""
    if name not in BUILDERS:
        hint = " (text needs a transformers model, e.g. --model gpt2-tiny)" if Path(name).exists() else ""
        raise UserError(f"unknown image dataset {name!r}; choose one of {', '.join(sorted(BUILDERS))}{hint}")
    if name == "imagefolder":
        return _imagefolder(data_dir, image_size, IMAGENET if imagenet else ((0.5, 0.5, 0.5), (0.25, 0.25, 0.25)))
    return BUILDERS[name](data_dir, image_size)
