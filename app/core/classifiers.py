"""torchvision's classifiers, randomly initialised and fitted to the data: its classes, its channels, and its image
side where a model is built for one; a model that cannot take the data's images is one line before any engine."""
import torch
from torch import nn

from app.data import DataInfo
from app.errors import UserError, first_line

AUXILIARY = ("googlenet", "inception_v3")
"""Built with auxiliary classifiers by default: their train-mode output is a tuple of logits, and the auxiliary
heads' weights would take no gradient from the one loss the app trains (torchvision's own training leaves them
off for these, but for inception_v3's pretrained weights)."""


def names() -> list:
    """Every torchvision classifier --model accepts."""
    import torchvision
    return torchvision.models.list_models(module=torchvision.models)


def build(name: str, info: DataInfo) -> nn.Module:
    """torchvision's classifier called name for info's classes, channels and image side."""
    import torchvision
    try:
        model = torchvision.models.get_model(name, weights=None, num_classes=info.num_classes, **_fitted(name, info))
    except (ValueError, AssertionError) as e:  # a side the model's blocks cannot divide (vit_b_16 at 8, maxvit_t)
        raise UserError(_too_small(name, info, e)) from None
    if info.in_channels != 3:
        _replace_first_conv(model, info.in_channels)
    _takes_images(model, name, info)
    return model


def _fitted(name: str, info: DataInfo) -> dict:
    """Arguments that fit name's build to the data: no auxiliary heads (AUXILIARY); the image side for the models
    built for one side (the vision transformers' position embeddings, MaxViT's windows)."""
    if name in AUXILIARY:
        return {"aux_logits": False, "init_weights": True}  # torchvision's own initialisation, said without a warning
    if name.startswith("vit_"):
        return {"image_size": info.image_size}
    if name.startswith("maxvit"):
        return {"input_size": (info.image_size, info.image_size)}
    return {}


def _takes_images(model: nn.Module, name: str, info: DataInfo):
    """A forward of two of the data's images on fake tensors (no compute, no memory): a model whose kernels or
    pools outgrow the images fails here, in one line, not in the first step."""
    from app.ds.internals import torch_private
    training = model.training
    model.eval()  # BatchNorm's own limit, one value per channel in training, is the micro batch's to say
    try:
        with torch.no_grad(), torch_private.fake_run():
            model(torch.empty(2, info.in_channels, info.image_size, info.image_size))
    except (RuntimeError, AssertionError, ValueError) as e:
        raise UserError(_too_small(name, info, e)) from None
    finally:
        model.train(training)


def _too_small(name: str, info: DataInfo, error: Exception) -> str:
    side = info.image_size
    return (f"--model {name} cannot take the data's {side}x{side} images ({first_line(error)}): use larger images "
            f"(an image folder's --image_size, 224 for most torchvision classifiers) or a model for small ones "
            f"(resnet18, cnn)")


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

