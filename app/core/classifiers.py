"""torchvision's classifiers, randomly initialised and fitted to the data: its classes, its channels, and its image
side where a model is built for one; a model that cannot take the data's images is one line before any engine."""
from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import nn

from app.data import DataInfo
from app.errors import UserError, first_line

AUXILIARY = ("googlenet", "inception_v3")
"""Built with auxiliary classifiers by default: their train-mode output is a tuple of logits, and the auxiliary
heads' weights would take no gradient from the one loss the app trains (torchvision's own training leaves them
off for these, but for inception_v3's pretrained weights)."""


AUXILIARY_HEADS = ("AuxLogits.", "aux1.", "aux2.")  # their weights, in the pretrained state dicts of AUXILIARY


def names() -> list:
    """Every torchvision classifier --model accepts."""
    import torchvision
    return torchvision.models.list_models(module=torchvision.models)


def build(name: str, info: DataInfo, weights: str = "") -> nn.Module:
    """torchvision's classifier called name for info's classes, channels and image side; weights: pretrained ones
    to start from (pretrained()), its head new where the data's classes are not the weights'."""
    import torchvision
    if weights and info.in_channels != 3:
        raise UserError(f"--model_weights: {name}'s pretrained weights take 3-channel images and the data has "
                        f"{info.in_channels}; train on colour images (imagefolder, cifar10), or leave the weights out")
    try:
        model = torchvision.models.get_model(name, weights=None, num_classes=info.num_classes,
                                             **_fitted(name, info, bool(weights)))
    except (ValueError, AssertionError) as e:  # a side the model's blocks cannot divide (vit_b_16 at 8, maxvit_t)
        raise UserError(_too_small(name, info, e)) from None
    if info.in_channels != 3:
        _replace_first_conv(model, info.in_channels)
    _takes_images(model, name, info)
    if weights:
        _start_from(model, _positions_fitted(model, pretrained(name, weights)), name, weights)
    return model


def pretrained(name: str, weights: str) -> dict:
    """The state dict of weights for torchvision's model name: a file, or a member of torchvision's weights for it
    (DEFAULT, IMAGENET1K_V1, ...), read from TORCH_HOME's cache or fetched there once."""
    import torchvision
    if Path(weights).is_file():
        return _state_file(weights)
    kinds = torchvision.models.get_model_weights(name)
    if weights not in kinds.__members__:
        raise UserError(f"--model_weights {weights!r} is neither a file nor one of {name}'s torchvision weights "
                        f"({', '.join(kinds.__members__)})")
    try:
        return kinds[weights].get_state_dict(progress=False)
    except (OSError, RuntimeError, ValueError) as e:  # offline, a cut download
        file = Path(torch.hub.get_dir()) / "checkpoints" / Path(kinds[weights].url).name
        raise UserError(f"{name}'s {weights} weights are not in {file} and cannot be fetched ({first_line(e)}): "
                        f"run once online, or copy {kinds[weights].url} there") from None


def _state_file(path: str) -> dict:
    """A file's state dict: plain, under "model" or "state_dict" (torchvision's reference scripts, Lightning), its
    keys without DDP's "module." (a run's own export loads as it is)."""
    from argparse import Namespace
    from safetensors import SafetensorError
    from app.ds.internals.safe_load import data_only
    try:  # Namespace: the "args" beside "model" in the checkpoints of torchvision's reference scripts
        with data_only(path), torch.serialization.safe_globals([Namespace]):
            state = load_file(path) if path.endswith(".safetensors") else \
                torch.load(path, map_location="cpu", weights_only=True)
    except (OSError, RuntimeError, EOFError, SafetensorError) as e:
        raise UserError(f"--model_weights {path} cannot be read ({first_line(e)}): save the model's state dict "
                        f"with torch.save or safetensors") from None
    held = next((state[key] for key in ("model", "state_dict") if isinstance(state, dict) and
                 isinstance(state.get(key), dict)), state)
    if not isinstance(held, dict):
        raise UserError(f"--model_weights {path} holds a {type(held).__name__}, not a state dict")
    return {key.removeprefix("module."): value for key, value in held.items()}


def _positions_fitted(model: nn.Module, state: dict) -> dict:
    """state with a vision transformer's position embeddings interpolated to the model's image side, as torchvision
    does for weights trained at another side (vit_b_16's at 224, SWAG's at 384); other states as they are."""
    from torchvision.models.vision_transformer import VisionTransformer, interpolate_embeddings
    held = state.get("encoder.pos_embedding")
    if not isinstance(model, VisionTransformer) or held is None or \
            held.shape == model.encoder.pos_embedding.shape:
        return state
    return interpolate_embeddings(model.image_size, model.patch_size, state)


def _start_from(model: nn.Module, state: dict, name: str, weights: str):
    """Load the weights whose names and shapes are the model's; the others (the head, where the data's classes are
    not the weights') keep their fresh start, and are said."""
    own = model.state_dict()
    state = {key: value for key, value in state.items() if not key.startswith(AUXILIARY_HEADS)}  # built without
    unknown = [key for key in state if key not in own]
    fits = {key: value for key, value in state.items() if key in own and own[key].shape == value.shape}
    if unknown or not fits:
        missing = ", ".join(unknown[:3]) or "tensor of their names and shapes"
        raise UserError(f"--model_weights {weights}: not {name}'s weights (it has no {missing}); pass {name}'s own")
    model.load_state_dict(fits, strict=False)
    fresh = [key for key in own if key not in fits and own[key].is_floating_point()]
    from app.distributed import dist
    dist.print0(f"model weights: {name} from {weights}" + (f"; new for the data's classes: {', '.join(fresh)}"
                                                           if fresh else ""))


def _fitted(name: str, info: DataInfo, pretrained: bool = False) -> dict:
    """Arguments that fit name's build to the data: no auxiliary heads (AUXILIARY), and for pretrained weights the
    input transform torchvision builds them with; the image side for the models built for one side (the vision
    transformers' position embeddings, MaxViT's windows)."""
    if name in AUXILIARY:  # init_weights: torchvision's own initialisation, said without a warning
        return {"aux_logits": False, "init_weights": True, **({"transform_input": True} if pretrained else {})}
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

