"""torchvision's classifiers fitted to the data: auxiliary heads off, the image side where a model is built for
one, and a model that cannot take the data's images one line at build, not a traceback in the first step."""
import argparse
from pathlib import Path

import pytest
import torch

from app.core import classifiers
from app.data import DataInfo
from app.errors import UserError


@pytest.mark.parametrize("name, info", [("googlenet", DataInfo(10, 3, 32)), ("inception_v3", DataInfo(5, 3, 80)),
                                        ("vit_b_16", DataInfo(10, 3, 32)), ("vit_b_32", DataInfo(7, 1, 64))])
def test_a_classifier_trains_to_plain_logits_at_the_datas_side(name, info):
    """googlenet and inception_v3 give a tuple with auxiliary logits in train mode unless built without them; the
    vision transformers assert the 224-pixel side they are built for unless built for the data's."""
    model = classifiers.build(name, info)
    assert model.training
    logits = model(torch.randn(2, info.in_channels, info.image_size, info.image_size))
    assert isinstance(logits, torch.Tensor) and logits.shape == (2, info.num_classes)
    logits.sum().backward()
    assert all(p.grad is not None for p in model.parameters()), "every weight takes part in the loss"


@pytest.mark.parametrize("name, info, cause", [
    ("alexnet", DataInfo(10, 3, 32), "Output size is too small"),
    ("inception_v3", DataInfo(10, 3, 32), "Kernel size can't be greater than actual input size"),
    ("vit_b_16", DataInfo(10, 1, 8), "Input shape indivisible by patch size"),
    ("maxvit_t", DataInfo(10, 3, 32), "not divisible by partition size"),
])
def test_a_model_whose_kernels_outgrow_the_images_is_one_line(name, info, cause, caplog):
    side = info.image_size
    with pytest.raises(UserError) as refused:
        classifiers.build(name, info)
    said = str(refused.value)
    assert said.startswith(f"--model {name} cannot take the data's {side}x{side} images (") and cause in said
    assert said.endswith("use larger images (an image folder's --image_size, 224 for most torchvision "
                         "classifiers) or a model for small ones (resnet18, cnn)") and "\n" not in said
    assert not [r for r in caplog.records if r.levelname == "ERROR"], "the fake tensors' own log stays quiet"


def test_the_check_leaves_the_model_in_train_mode_with_real_weights():
    model = classifiers.build("resnet18", DataInfo(10, 1, 28))
    assert model.training and model.conv1.in_channels == 1
    assert all(type(p) is torch.nn.Parameter and p.device.type == "cpu" for p in model.parameters())
    assert model.bn1.num_batches_tracked.item() == 0, "the check's forward ran in eval mode: no statistics taken"


def _imagenet_resnet18():
    """resnet18 as torchvision's ImageNet weights shape it (1,000 classes), its values drawn from a seed."""
    import torchvision
    torch.manual_seed(3)
    return torchvision.models.resnet18(num_classes=1000).state_dict()


def test_pretrained_weights_start_the_body_and_the_head_is_new_for_the_datas_classes(tmp_path, capsys):
    """A state-dict file (as torchvision's reference scripts save it: under "model", DDP's "module." names) starts
    every weight of the body; the 1,000-class head cannot hold the data's 10 classes and starts fresh, said."""
    state = _imagenet_resnet18()
    path = tmp_path / "resnet18.pth"
    torch.save({"model": {f"module.{k}": v for k, v in state.items()}, "epoch": 89,
                "args": argparse.Namespace(lr=0.5, model="resnet18")}, path)
    model = classifiers.build("resnet18", DataInfo(10, 3, 32), str(path))
    own = model.state_dict()
    assert all(torch.equal(own[k], v) for k, v in state.items() if not k.startswith("fc."))
    assert own["fc.weight"].shape == (10, 512)
    assert f"model weights: resnet18 from {path}; new for the data's classes: fc.weight, fc.bias" in \
        capsys.readouterr().out


def test_torchvisions_named_weights_are_read_from_torch_homes_cache(tmp_path, monkeypatch):
    """IMAGENET1K_V1 (and DEFAULT, its alias here) as torchvision fetches it once into TORCH_HOME: the file there is
    read, nothing downloaded."""
    import torchvision
    monkeypatch.setenv("TORCH_HOME", str(tmp_path))
    cached = tmp_path / "hub" / "checkpoints" / Path(torchvision.models.ResNet18_Weights.IMAGENET1K_V1.url).name
    cached.parent.mkdir(parents=True)
    state = _imagenet_resnet18()
    torch.save(state, cached)
    for name in ("IMAGENET1K_V1", "DEFAULT"):
        model = classifiers.build("resnet18", DataInfo(1000, 3, 32), name)
        assert all(torch.equal(model.state_dict()[k], v) for k, v in state.items()), "1,000 classes: the head too"


@pytest.mark.parametrize("weights, info, said", [
    ("IMAGENET1K_V9", DataInfo(10, 3, 32), "neither a file nor one of resnet18's torchvision weights "
                                           "\\(IMAGENET1K_V1, DEFAULT\\)"),
    ("IMAGENET1K_V1", DataInfo(10, 1, 28), "pretrained weights take 3-channel images and the data has 1"),
])
def test_weights_a_classifier_cannot_start_from_are_one_line(weights, info, said):
    with pytest.raises(UserError, match=said):
        classifiers.build("resnet18", info, weights)


def test_another_models_weights_are_one_line(tmp_path):
    import torchvision
    path = tmp_path / "mobilenet.pth"
    torch.save(torchvision.models.mobilenet_v3_small().state_dict(), path)
    with pytest.raises(UserError, match="not resnet18's weights \\(it has no features.0.0.weight"):
        classifiers.build("resnet18", DataInfo(10, 3, 32), str(path))
    (tmp_path / "cut.pth").write_bytes(path.read_bytes()[:100])
    with pytest.raises(UserError, match="cut.pth cannot be read"):
        classifiers.build("resnet18", DataInfo(10, 3, 32), str(tmp_path / "cut.pth"))


def test_googlenets_pretrained_weights_load_without_its_auxiliary_heads(tmp_path):
    """torchvision's googlenet and inception_v3 weights hold the auxiliary heads the app builds them without, and
    were trained with their input transform on."""
    import torchvision
    torch.manual_seed(3)
    state = torchvision.models.googlenet(num_classes=1000, aux_logits=True, init_weights=True).state_dict()
    assert any(key.startswith("aux1.") for key in state)
    torch.save(state, tmp_path / "googlenet.pth")
    model = classifiers.build("googlenet", DataInfo(1000, 3, 64), str(tmp_path / "googlenet.pth"))
    assert model.transform_input and model.aux1 is None
    assert all(torch.equal(model.state_dict()[k], v) for k, v in state.items() if not k.startswith("aux"))


def test_a_vision_transformers_weights_at_another_side_keep_their_position_embeddings(tmp_path, capsys):
    """vit_b_16's weights hold 197 positions (224 / 16, squared, and the class token); built for 32x32 images the
    model has 5: the weights' embeddings are interpolated to them, as torchvision does, not left fresh."""
    import torchvision
    from torchvision.models.vision_transformer import interpolate_embeddings
    torch.manual_seed(0)
    state = torchvision.models.vit_b_16().state_dict()
    torch.save(state, tmp_path / "vit.pth")
    model = classifiers.build("vit_b_16", DataInfo(10, 3, 32), str(tmp_path / "vit.pth"))
    expected = interpolate_embeddings(32, 16, state)["encoder.pos_embedding"]
    assert model.encoder.pos_embedding.shape == (1, 5, 768)
    assert torch.equal(model.encoder.pos_embedding.detach(), expected)
    assert capsys.readouterr().out.strip().endswith("new for the data's classes: heads.head.weight, heads.head.bias")
