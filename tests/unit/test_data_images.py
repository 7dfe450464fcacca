"""Image datasets build offline: the digits' fixed split, torchvision files from --data_dir, ImageFolder."""
import struct

import pytest
import torch

from app.data import images
from app.errors import UserError


def test_digits_is_a_fixed_real_split(tmp_path):
    train, held_out, info = images.build_image_sets("digits", str(tmp_path))
    assert (len(train), len(held_out)) == (1437, 360)
    assert (info.num_classes, info.in_channels, info.image_size) == (10, 1, 8)
    x, y = train[0]
    assert x.shape == (1, 8, 8) and 0 <= int(y) < 10
    assert torch.bincount(held_out.tensors[1]).min() >= 34, "stratified: every digit held out"
    cached = list(tmp_path.glob("digits-sklearn-*.pt"))
    assert len(cached) == 1, "the split is kept in --data_dir, so later runs need not import scikit-learn"
    again_train, again_held_out, _ = images.build_image_sets("digits", str(tmp_path))  # read from the cache
    fresh = images._digits_split()
    for a, b, c in zip((train.tensors + held_out.tensors), (again_train.tensors + again_held_out.tensors), fresh):
        assert torch.equal(a, b) and torch.equal(a, c), "the cache holds exactly what scikit-learn gives"


def test_digits_without_a_writable_data_dir_still_load(tmp_path):
    blocked = tmp_path / "file"
    blocked.write_text("")  # a file where the folder would be: the cache cannot be written
    train, held_out, _ = images.build_image_sets("digits", str(blocked / "data"))
    assert (len(train), len(held_out)) == (1437, 360)


def _write_idx(path, array, magic):
    with open(path, "wb") as f:
        f.write(struct.pack(">I", magic) + b"".join(struct.pack(">I", d) for d in array.shape))
        f.write(array.numpy().tobytes())


@pytest.mark.parametrize("name, folder", [("mnist", "MNIST"), ("fashion_mnist", "FashionMNIST")])
def test_torchvision_idx_files_from_data_dir(name, folder, tmp_path):
    raw = tmp_path / folder / "raw"
    raw.mkdir(parents=True)
    for prefix, n in (("train", 12), ("t10k", 5)):
        _write_idx(raw / f"{prefix}-images-idx3-ubyte", torch.randint(0, 256, (n, 28, 28), dtype=torch.uint8), 0x803)
        _write_idx(raw / f"{prefix}-labels-idx1-ubyte", torch.arange(n, dtype=torch.uint8) % 10, 0x801)
    train, held_out, info = images.build_image_sets(name, str(tmp_path))
    assert (len(train), len(held_out), info.num_classes, info.in_channels) == (12, 5, 10, 1)
    x, y = train[3]
    assert x.shape == (1, 28, 28) and y == 3


def _images(root, classes=("cat", "dog"), per_class=5):
    from PIL import Image
    for c, name in enumerate(classes):
        (root / name).mkdir(parents=True)
        for i in range(per_class):
            Image.new("RGB", (20, 12), (40 * c, 10 * i, 0)).save(root / name / f"{i}.png")


def test_imagefolder_with_val_dir(tmp_path):
    _images(tmp_path / "train")
    _images(tmp_path / "val", per_class=2)
    train, held_out, info = images.build_image_sets("imagefolder", str(tmp_path), image_size=16)
    assert (len(train), len(held_out), info.num_classes) == (10, 4, 2)
    assert train[0][0].shape == (3, 16, 16)


def test_a_val_folder_without_one_of_trains_classes_keeps_trains_labels(tmp_path):
    _images(tmp_path / "train", classes=("cat", "dog", "fox"))
    _images(tmp_path / "validation", classes=("cat", "fox"), per_class=1)
    train, held_out, info = images.build_image_sets("imagefolder", str(tmp_path), image_size=8)
    assert info.num_classes == 3 and train.class_to_idx["fox"] == 2
    assert [label for _, label in held_out] == [0, 2]  # fox is 2 in both, though val/ has two classes


def test_a_val_class_that_train_has_not_is_one_line(tmp_path):
    _images(tmp_path / "train")
    _images(tmp_path / "val", classes=("cat", "owl"), per_class=1)
    with pytest.raises(UserError, match=r"val has class folders .* has not \(owl\)"):
        images.build_image_sets("imagefolder", str(tmp_path))
    (tmp_path / "val" / "owl" / "0.png").unlink()
    with pytest.raises(UserError, match="Found no valid file for the classes owl"):
        images.build_image_sets("imagefolder", str(tmp_path))


def test_imagefolder_for_pretrained_weights_is_normalised_as_imagenet_was(tmp_path):
    """A black pixel is 0 - mean over std, with torchvision's ImageNet mean and std where the weights came from."""
    from PIL import Image
    for name in ("cat", "dog"):
        (tmp_path / "train" / name).mkdir(parents=True)
        Image.new("RGB", (8, 8), (0, 0, 0)).save(tmp_path / "train" / name / "0.png")
    train, _, _ = images.build_image_sets("imagefolder", str(tmp_path), image_size=8, imagenet=True)
    assert train[0][0][:, 0, 0].tolist() == pytest.approx([-0.485 / 0.229, -0.456 / 0.224, -0.406 / 0.225])
    plain, _, _ = images.build_image_sets("imagefolder", str(tmp_path), image_size=8)
    assert plain[0][0][:, 0, 0].tolist() == pytest.approx([-2.0] * 3)


def test_a_val_folder_beside_class_folders_without_train_is_one_line(tmp_path):
    """Without train/ the root's folders are the classes: a val/ among them would be read as one more class, its
    images trained on and evaluated."""
    _images(tmp_path)
    _images(tmp_path / "val", per_class=1)
    with pytest.raises(UserError, match=f"ImageFolder {tmp_path} has val/ but no train/: move the class folders"):
        images.build_image_sets("imagefolder", str(tmp_path))


def test_sixteen_bit_grey_images_are_scaled_not_clipped(tmp_path):
    """PIL's convert to RGB clips a 16-bit grey image's values at 255 (a ramp turns white); they are scaled."""
    import numpy as np
    from PIL import Image
    ramp = np.tile(np.linspace(0, 65535, 256).astype("uint16"), (2, 1))
    Image.fromarray(ramp).save(tmp_path / "ramp.png")
    assert Image.open(tmp_path / "ramp.png").mode == "I;16"
    pixels = np.asarray(images.open_image(str(tmp_path / "ramp.png")))
    assert pixels.shape == (2, 256, 3) and pixels[0, :, 0].tolist() == [round(v / 257) for v in ramp[0]]


def test_an_image_too_large_to_decode_is_one_line(tmp_path, monkeypatch):
    """PIL refuses an image over twice MAX_IMAGE_PIXELS with DecompressionBombError, not an OSError."""
    from PIL import Image
    _images(tmp_path / "train", per_class=1)
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 100)
    train, held_out, _ = images.build_image_sets("imagefolder", str(tmp_path), image_size=8)
    assert "train/cat/0.png is not a readable image (Image size (240 pixels) exceeds limit" in \
        images.unreadable_images(train, held_out)
    with pytest.raises(UserError, match="cat/0.png is not a readable image"):
        images.open_image(str(tmp_path / "train" / "cat" / "0.png"))


def test_imagefolder_without_val_holds_out_a_tenth(tmp_path):
    _images(tmp_path, per_class=10)
    train, held_out, info = images.build_image_sets("imagefolder", str(tmp_path), image_size=8)
    assert (len(train), len(held_out), info.num_classes) == (18, 2, 2)


def test_empty_imagefolder_is_a_user_error(tmp_path):
    (tmp_path / "train").mkdir()
    with pytest.raises(UserError, match="missing or empty"):
        images.build_image_sets("imagefolder", str(tmp_path))


def test_unknown_dataset_names_the_choices(tmp_path):
    with pytest.raises(UserError, match="unknown image dataset 'imagenet22k'; choose one of cifar10, digits"):
        images.build_image_sets("imagenet22k", str(tmp_path))
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("some text\n")
    with pytest.raises(UserError, match="text needs a transformers model"):
        images.build_image_sets(str(corpus), str(tmp_path))
