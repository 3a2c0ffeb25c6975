"""Vision-language policies in the learner: which model class, where its layers are, and the
image inputs of a packed micro-batch.

A vision-language checkpoint (a ``config.json`` with a ``vision_config``) loads as
``AutoModelForImageTextToText``; its text decoder is packed exactly as a text model's
(``learner.kernels.attention``), its vision tower keeps plain ``sdpa`` (bidirectional over
each image's patches, no packing). Images arrive by reference (``RolloutGroup.images``); the
learner fetches each group's PNG bytes once, and :class:`VisionInputs` runs the model's image
processor once per group and lays the result out for any micro-batch of the step: every
sample repeats its group's images, in the order its image tokens appear in the packed row.

Supported families (their processor outputs and how they concatenate): Idefics3 / SmolVLM
(``pixel_values`` ``[1, images, 3, H, W]`` and ``pixel_attention_mask`` ``[1, images, H, W]``,
joined along the image axis). Others raise :class:`UnsupportedVisionModel` at load, naming them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

IMAGE_AXIS = {"idefics3": 1, "smolvlm": 1}
"""``model_type`` -> the axis along which the image processor's tensors of several images
join (the families the learner supports)."""


class UnsupportedVisionModel(ValueError):
    """A vision-language model type the learner has no input layout for."""


def is_vision_language(model_config: Mapping[str, Any]) -> bool:
    """Whether a Hugging Face config dict describes a vision-language model."""
    return isinstance(model_config.get("vision_config"), Mapping)


def check_supported(model_config: Mapping[str, Any]) -> None:
    """Raise :class:`UnsupportedVisionModel` for a vision-language model outside :data:`IMAGE_AXIS`."""
    kind = model_config.get("model_type")
    if is_vision_language(model_config) and kind not in IMAGE_AXIS:
        raise UnsupportedVisionModel(
            f"vision-language model_type {kind!r} is not supported by the learner yet; supported: {', '.join(IMAGE_AXIS)}"
        )


def text_model(model: nn.Module) -> nn.Module:
    """The decoder stack of a causal LM (``model.<base>``) or of a VLM (``model.<base>.text_model``)."""
    base = getattr(model, model.base_model_prefix)
    return getattr(base, "text_model", base)


def vision_tower(model: nn.Module) -> nn.Module | None:
    """The vision encoder of a VLM (``model.<base>.vision_model``), None for a text model."""
    return getattr(getattr(model, model.base_model_prefix), "vision_model", None)


def vision_layers(model: nn.Module) -> list[nn.Module]:
    """The vision encoder's layers (FSDP units of their own); [] for a text model."""
    tower = vision_tower(model)
    encoder = getattr(tower, "encoder", None)
    return list(getattr(encoder, "layers", [])) if encoder is not None else []


@dataclass(frozen=True)
class VisionInputs:
    """The images of one step's groups, processed once per group (CPU tensors).

    ``images[g]`` are group ``g``'s PIL images (its position among the batch's groups,
    ``Batch.group_index``), empty for a text prompt; ``per_group[g]`` the image processor's
    output for them (None for text); ``axis`` the axis along which the tensors of several
    images join; ``process`` the image processor (``images -> {name: tensor}``)."""

    images: tuple[tuple[Any, ...], ...]
    per_group: tuple[dict[str, Tensor] | None, ...]
    axis: int
    process: Callable[[list[Any]], Mapping[str, Tensor]] = field(repr=False, compare=False)

    @classmethod
    def build(cls, model_type: str, groups_images: Sequence[Sequence[Any]], process: Callable[[list[Any]], Mapping[str, Tensor]]) -> VisionInputs:
        """Process every group's images (once per group)."""
        if model_type not in IMAGE_AXIS:
            raise UnsupportedVisionModel(f"no image input layout for model_type {model_type!r}; supported: {', '.join(IMAGE_AXIS)}")
        images = tuple(tuple(group) for group in groups_images)
        return cls(images, tuple(dict(process(list(group))) if group else None for group in images), IMAGE_AXIS[model_type], process)

    def for_samples(self, group_index: Sequence[int], device: torch.device) -> dict[str, Tensor]:
        """The model's image keyword arguments for a packed row of samples of groups
        ``group_index`` (in row order); {} when none of them has images."""
        parts = [p for g in group_index if (p := self.per_group[g]) is not None]
        if not parts:
            return {}
        return {key: _cat_padded([p[key] for p in parts], self.axis).to(device) for key in parts[0]}

    def transformed(self, transform: Callable[[Any, int, int], Any]) -> VisionInputs:
        """The same groups with each image replaced by ``transform(image, group, index)``
        (e.g. VPPO's blackened copies), processed again."""
        images = tuple(tuple(transform(im, g, k) for k, im in enumerate(group)) for g, group in enumerate(self.images))
        per_group = tuple(dict(self.process(list(group))) if group else None for group in images)
        return VisionInputs(images, per_group, self.axis, self.process)


def _cat_padded(tensors: list[Tensor], axis: int) -> Tensor:
    """Concatenate along ``axis``, zero-padding the last two (pixel) dimensions to the largest
    (images of different groups were processed separately; zeros are the processors' padding)."""
    height, width = max(t.shape[-2] for t in tensors), max(t.shape[-1] for t in tensors)
    padded = [torch.nn.functional.pad(t, (0, width - t.shape[-1], 0, height - t.shape[-2])) for t in tensors]
    return torch.cat(padded, dim=axis)


def load_image_processor(model_path: str) -> Callable[[list[Any]], Mapping[str, Tensor]]:
    """The model's image processor as ``images of one prompt -> {name: tensor}`` (the
    checkpoint's ``preprocessor_config.json``, as the inference servers use it)."""
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(model_path).image_processor

    def process(images: list[Any]) -> Mapping[str, Tensor]:
        return dict(processor(images=[images], return_tensors="pt"))

    return process
