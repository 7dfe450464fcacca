"""torchvision's classifiers fitted to the data: auxiliary heads off, the image side where a model is built for
one, and a model that cannot take the data's images one line at build, not a traceback in the first step."""
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
