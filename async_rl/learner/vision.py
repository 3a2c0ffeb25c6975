"""Vision-language policies in the learner: which model class, where its layers are, and the
image inputs of a packed micro-batch.

A vision-language checkpoint (a ``config.json`` with a ``vision_config``) loads as
``AutoModelForImageTextToText``; its text decoder is packed exactly as a text model's
(``learner.kernels.attention``), its vision tower keeps plain ``sdpa`` (bidirectional over
each image's patches, no packing). Images arrive by reference (``RolloutGroup.images``); the
learner fetches each group's PNG bytes once, and :class:`VisionInputs` runs the model's image
processor once per group and lays the result out for any micro-batch of the step: every
sample repeats its group's images, in the order its image tokens appear in the packed row.

Supported families (:data:`LAYOUTS`: their processor outputs and how they concatenate):

* Idefics3 / SmolVLM: ``pixel_values`` ``[1, images, 3, H, W]`` and ``pixel_attention_mask``
  ``[1, images, H, W]``, joined along the image axis (pixels zero-padded to the largest);
* Qwen2.5-VL / Qwen2-VL: ``pixel_values`` ``[patches, C * T * P * P]`` and ``image_grid_thw``
  ``[images, 3]``, joined along the first axis; their M-RoPE positions ``[3, 1, S]`` are
  computed per packed sample by the model's own ``get_rope_index`` (:func:`mrope_positions`).

Others raise :class:`UnsupportedVisionModel` at load (and at ``--dry-run``), naming these.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

@dataclass(frozen=True)
class ImageLayout:
    """How one family's processed images join in a packed row."""

    axis: int
    """The axis along which the tensors of several images concatenate."""
    pad_pixels: bool
    """Zero-pad the last two (pixel) dimensions to the largest before joining."""
    mrope: bool
    """Multimodal rotary positions ``[3, 1, S]`` from ``image_grid_thw`` (Qwen-VL)."""


LAYOUTS = {
    "idefics3": ImageLayout(axis=1, pad_pixels=True, mrope=False),
    "smolvlm": ImageLayout(axis=1, pad_pixels=True, mrope=False),
    "qwen2_5_vl": ImageLayout(axis=0, pad_pixels=False, mrope=True),
    "qwen2_vl": ImageLayout(axis=0, pad_pixels=False, mrope=True),
}
"""``model_type`` -> the image input layout of the families the learner supports."""


class UnsupportedVisionModel(ValueError):
    """A vision-language model type the learner has no input layout for."""


def is_vision_language(model_config: Mapping[str, Any]) -> bool:
    """Whether a Hugging Face config dict describes a vision-language model."""
    return isinstance(model_config.get("vision_config"), Mapping)


def check_supported(model_config: Mapping[str, Any]) -> None:
    """Raise :class:`UnsupportedVisionModel` for a vision-language model outside :data:`LAYOUTS`."""
    kind = model_config.get("model_type")
    if is_vision_language(model_config) and kind not in LAYOUTS:
        raise UnsupportedVisionModel(
            f"vision-language model_type {kind!r} is not supported by the learner yet; supported: {', '.join(LAYOUTS)}"
        )


def text_model(model: nn.Module) -> nn.Module:
    """The decoder stack of a causal LM (``model.<base>``) or of a VLM (``model.<base>.text_model``,
    Qwen-VL's ``.language_model``)."""
    base = getattr(model, model.base_model_prefix)
    return getattr(base, "text_model", None) or getattr(base, "language_model", None) or base


def vision_tower(model: nn.Module) -> nn.Module | None:
    """The vision encoder of a VLM (``model.<base>.vision_model``, Qwen-VL's ``.visual``), None for a text model."""
    base = getattr(model, model.base_model_prefix)
    return getattr(base, "vision_model", None) or getattr(base, "visual", None)


def vision_layers(model: nn.Module) -> list[nn.Module]:
    """The vision encoder's layers (FSDP units of their own: ``encoder.layers``, Qwen-VL's
    ``blocks``); [] for a text model."""
    tower = vision_tower(model)
    if tower is None:
        return []
    encoder = getattr(tower, "encoder", None)
    return list(getattr(encoder, "layers", None) or getattr(tower, "blocks", None) or [])


@dataclass(frozen=True)
class VisionInputs:
    """The images of one step's groups, processed once per group (CPU tensors).

    ``images[g]`` are group ``g``'s PIL images (its position among the batch's groups,
    ``Batch.group_index``), empty for a text prompt; ``per_group[g]`` the image processor's
    output for them (None for text); ``layout`` how they join in a packed row; ``process``
    the image processor (``images -> {name: tensor}``)."""

    images: tuple[tuple[Any, ...], ...]
    per_group: tuple[dict[str, Tensor] | None, ...]
    layout: ImageLayout
    process: Callable[[list[Any]], Mapping[str, Tensor]] = field(repr=False, compare=False)

    @classmethod
    def build(cls, model_type: str, groups_images: Sequence[Sequence[Any]], process: Callable[[list[Any]], Mapping[str, Tensor]]) -> VisionInputs:
        """Process every group's images (once per group)."""
        if model_type not in LAYOUTS:
            raise UnsupportedVisionModel(f"no image input layout for model_type {model_type!r}; supported: {', '.join(LAYOUTS)}")
        images = tuple(tuple(group) for group in groups_images)
        return cls(images, tuple(dict(process(list(group))) if group else None for group in images), LAYOUTS[model_type], process)

    def for_samples(self, group_index: Sequence[int], device: torch.device) -> dict[str, Tensor]:
        """The model's image keyword arguments for a packed row of samples of groups
        ``group_index`` (in row order); {} when none of them has images."""
        parts = [p for g in group_index if (p := self.per_group[g]) is not None]
        if not parts:
            return {}
        join = _cat_padded if self.layout.pad_pixels else torch.cat
        return {key: join([p[key] for p in parts], dim=self.layout.axis).to(device) for key in parts[0]}

    def grids(self, group_index: Sequence[int]) -> list[Tensor | None]:
        """Per sample of the row, its images' ``image_grid_thw`` ``[images, 3]`` (None for text)."""
        return [None if (p := self.per_group[g]) is None else p["image_grid_thw"] for g in group_index]

    def transformed(self, transform: Callable[[Any, int, int], Any]) -> VisionInputs:
        """The same groups with each image replaced by ``transform(image, group, index)``
        (e.g. VPPO's blackened copies), processed again."""
        images = tuple(tuple(transform(im, g, k) for k, im in enumerate(group)) for g, group in enumerate(self.images))
        per_group = tuple(dict(self.process(list(group))) if group else None for group in images)
        return VisionInputs(images, per_group, self.layout, self.process)


def mrope_positions(model: nn.Module, input_ids: Tensor, bounds: Sequence[int], grids: Sequence[Tensor | None], image_token: int) -> Tensor:
    """Qwen-VL's multimodal rotary positions ``[3, 1, S]`` of a packed row ``input_ids``
    ``[1, S]`` whose samples span ``bounds``: each sample's own, from the model's
    ``get_rope_index`` (text-only samples: ``0..L-1`` on all three axes)."""
    base = getattr(model, model.base_model_prefix)
    parts = []
    for (start, end), grid in zip(zip(bounds, bounds[1:]), grids):
        ids = input_ids[:, start:end]
        if grid is None:
            parts.append(torch.arange(end - start, device=ids.device).view(1, 1, -1).expand(3, 1, -1))
        else:
            positions, _ = base.get_rope_index(ids, mm_token_type_ids=(ids == image_token).int(), image_grid_thw=grid.to(ids.device))
            parts.append(positions)
    return torch.cat(parts, dim=-1)


def _cat_padded(tensors: list[Tensor], dim: int) -> Tensor:
    """Concatenate along ``axis``, zero-padding the last two (pixel) dimensions to the largest
    (images of different groups were processed separately; zeros are the processors' padding)."""
    height, width = max(t.shape[-2] for t in tensors), max(t.shape[-1] for t in tensors)
    padded = [torch.nn.functional.pad(t, (0, width - t.shape[-1], 0, height - t.shape[-2])) for t in tensors]
    return torch.cat(padded, dim=dim)


def load_image_processor(model_path: str) -> Callable[[list[Any]], Mapping[str, Tensor]]:
    """The model's image processor as ``images of one prompt -> {name: tensor}`` (the
    checkpoint's ``preprocessor_config.json``, as the inference servers use it)."""
    from transformers import AutoImageProcessor

    processor = AutoImageProcessor.from_pretrained(model_path)

    def process(images: list[Any]) -> Mapping[str, Tensor]:
        return dict(processor(images=[images], return_tensors="pt"))

    return process
