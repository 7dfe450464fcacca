"""build_model() for each family, and the loss and accuracy that go with classification."""
import torch
from torch import nn
import torch.nn.functional as F

from app.data import DataInfo
from app.errors import UserError


def _cnn(info: DataInfo) -> nn.Module:
    """A small CNN: two 3x3 convolutions, pooled to 4x4, then two linear layers (the digits default)."""
    return nn.Sequential(
        nn.Conv2d(info.in_channels, 32, 3, padding=1), nn.ReLU(),
        nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(),
        nn.AdaptiveAvgPool2d(4), nn.Flatten(),
        nn.Linear(64 * 16, 128), nn.ReLU(),
        nn.Linear(128, info.num_classes))


def _mlp(info: DataInfo) -> nn.Module:
    """A two-layer perceptron over the flattened image."""
    return nn.Sequential(nn.Flatten(), nn.Linear(info.in_channels * info.image_size ** 2, 64), nn.ReLU(),
                         nn.Linear(64, info.num_classes))


def _torchvision(name: str, info: DataInfo) -> nn.Module:
    """A torchvision classifier, randomly initialised, with classes and input channels fitted to the data."""
    import torchvision
    model = torchvision.models.get_model(name, weights=None, num_classes=info.num_classes)
    if info.in_channels != 3:
        _replace_first_conv(model, info.in_channels)
    return model


def _replace_first_conv(model: nn.Module, in_channels: int):
    """Swap the first Conv2d for one that takes in_channels, keeping its other settings."""
    for parent in model.modules():
        for child_name, child in parent.named_children():
            if isinstance(child, nn.Conv2d):
                setattr(parent, child_name, nn.Conv2d(
                    in_channels, child.out_channels, child.kernel_size, child.stride, child.padding,
                    child.dilation, child.groups, child.bias is not None, child.padding_mode))
                return
    raise UserError("this model has no Conv2d to adapt to the dataset's channels; pick another --model")


BUILTIN = {"cnn": _cnn, "mlp": _mlp}


def model_names() -> list:
    """Every name --model accepts."""
    import torchvision
    return sorted(BUILTIN) + torchvision.models.list_models(module=torchvision.models)


def build_model(name: str, info: DataInfo) -> nn.Module:
    """The model called name, shaped for the data described by info."""
    if name in BUILTIN:
        return BUILTIN[name](info)
    import torchvision
    if name in torchvision.models.list_models(module=torchvision.models):
        return _torchvision(name, info)
    raise UserError(f"unknown model {name!r}; choose cnn, mlp or a torchvision classifier such as resnet18 "
                    f"(python -c 'import torchvision; print(torchvision.models.list_models())')")


def per_sample_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Cross entropy for each sample, in fp32 whatever the model's precision."""
    return F.cross_entropy(logits.float(), labels, reduction="none")


def correct(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """1.0 where the top class is the label, else 0.0."""
    return (logits.argmax(-1) == labels).float()
