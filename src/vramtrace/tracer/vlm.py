"""The inputs of a vision-language model's step: what its processor feeds the model for text with images.

A vision-language model (Qwen2-VL, Qwen2.5-VL, Gemma-3 multimodal) reads the images' pixels, and its text holds
one run of placeholder tokens per image, which the model replaces by the image's features. vramtrace feeds
`--images N` images per sample (default `DEFAULT_IMAGES`), each `--image-size` square before the processor's
resize, and `--seq` counts every token of a sample, the image tokens included.

Qwen2-VL and Qwen2.5-VL (transformers' `Qwen2VLImageProcessor`, models/qwen2_vl/image_processing_qwen2_vl.py, the
processor of both): each image resized by `smart_resize` to a multiple of patch_size × merge_size (28) with at
least 56·56 and at most 28·28·1280 pixels (the processor's default `size`), then cut into patches
(`patchify`): `pixel_values` (sum over images of t·h·w, C·temporal_patch_size·patch_size²) (an image is one frame
repeated temporal_patch_size times: t = 1), `image_grid_thw` (images, 3) = [1, H/patch, W/patch]. The processor
(processing_qwen2_vl.py `replace_image_token`) expands each `<|image_pad|>` to t·h·w / merge_size² copies of
`image_token_id`; the chat template puts `<|vision_start|>` before and `<|vision_end|>` after it, and
`mm_token_type_ids` (processing_utils.py `create_mm_token_type_ids`) is 1 at the image tokens, 0 elsewhere.

Gemma-3 (`Gemma3Processor`, models/gemma3/processing_gemma3.py): every image resized to vision_config.image_size
(pan-and-scan off, its default), `pixel_values` (images, C, H, W); each image becomes `boi`, mm_tokens_per_image
image tokens, `eoi` (`full_image_sequence`; the "\\n\\n" around it are text tokens), and `token_type_ids` is 1
at the image tokens (the processor's `mm_token_type_ids`, renamed).

Training labels are `input_ids`, image tokens included: TRL's `DataCollatorForVisionLanguageModeling`
(trl/trainer/sft_trainer.py `_collate_language_modeling`) masks only padding ("Vision tokens are left unchanged
because their handling in loss computation has to be done by the model"); the batch has no padding.

The layout of a sample: its image blocks first, then text tokens (random ids that are none of the special
ones). Batches are unpadded, so no `attention_mask` in training and inference (as for text LMs here); a
generation gets the prompt's mask of ones, as from the processor.

On the meta device the integer inputs the model reads as Python values (Qwen-VL's `image_grid_thw` and
`mm_token_type_ids`: its vision rotary positions loop over the grid, its M-RoPE positions group the token
types) are real CPU tensors with the processor's values (bridges.py `QWEN_VL_POSITIONS` moves what the model
computes from them to meta); on a CUDA target these and what is computed from
them on the host are not counted (a few int64 per token).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum
from typing import Any

import torch

from ..errors import UsageError
from ..spec import Mode, RunSpec

DEFAULT_IMAGES = 1  # images per sample without --images
DEFAULT_IMAGE_SIZE = 224  # H = W of each image before the processor's resize, without --image-size (Qwen-VL)
# Qwen2VLImageProcessor's defaults (image_processing_qwen2_vl.py): size {"shortest_edge": 56 * 56,
# "longest_edge": 28 * 28 * 1280}, the pixels smart_resize keeps an image within
QWEN_MIN_PIXELS = 56 * 56
QWEN_MAX_PIXELS = 28 * 28 * 1280


class VlmFamily(str, Enum):
    """How a family's processor lays out images (see the module docstring)."""

    QWEN_VL = "qwen-vl"  # qwen2_vl, qwen2_5_vl
    GEMMA3 = "gemma3"


_FAMILIES = {"qwen2_vl": VlmFamily.QWEN_VL, "qwen2_5_vl": VlmFamily.QWEN_VL, "gemma3": VlmFamily.GEMMA3}


def vlm_family(config) -> VlmFamily | None:
    """The family of a vision-language config (by `model_type`, with a `vision_config`), else None."""
    family = _FAMILIES.get(getattr(config, "model_type", None))
    return family if family is not None and getattr(config, "vision_config", None) is not None else None


@dataclass(frozen=True, slots=True)
class VlmLayout:
    """One sample's images: `images` of `image_hw` [H, W] (after the processor's resize), each `tokens` image
    tokens between `open_id` and `close_id` (the block is tokens + 2 long); `grid` (t, h, w) patches per image
    (Qwen-VL) or None; `special`: the ids text tokens must not take."""

    family: VlmFamily
    images: int
    image_hw: tuple[int, int]
    tokens: int
    image_id: int
    open_id: int
    close_id: int
    special: tuple[int, ...]
    grid: tuple[int, int, int] | None = None

    @property
    def block(self) -> int:
        return self.tokens + 2


def smart_resize(height: int, width: int, factor: int, min_pixels: int = QWEN_MIN_PIXELS,
                 max_pixels: int = QWEN_MAX_PIXELS) -> tuple[int, int]:
    """(H, W) of an image after Qwen2-VL's resize: multiples of `factor`, within [min_pixels, max_pixels] pixels,
    the aspect ratio kept (transformers models/qwen2_vl/image_processing_qwen2_vl.py `smart_resize`, the same
    arithmetic)."""
    h_bar, w_bar = round(height / factor) * factor, round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar, w_bar = math.ceil(height * beta / factor) * factor, math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def vlm_layout(spec: RunSpec, config, family: VlmFamily) -> VlmLayout:
    """The images of one sample for `spec` (--images, --image-size). Raises UsageError when --seq is missing, an
    image size the model cannot take, or when the image blocks do not fit in --seq."""
    if spec.seq is None:
        raise UsageError("--seq is required for this model (the text length, image tokens included), e.g. --seq 2048")
    if spec.serve_requests is not None:
        raise UsageError("vramtrace serve traces text prompts only; a vision-language model's images are not fed")
    vision, n = config.vision_config, spec.images or DEFAULT_IMAGES
    if family is VlmFamily.QWEN_VL:
        patch, merge = vision.patch_size, vision.spatial_merge_size
        size = spec.image_size or DEFAULT_IMAGE_SIZE
        h, w = smart_resize(size, size, patch * merge)
        grid = (1, h // patch, w // patch)
        layout = VlmLayout(family, n, (h, w), grid[1] * grid[2] // merge**2, config.image_token_id,
                           config.vision_start_token_id, config.vision_end_token_id,
                           (config.image_token_id, config.video_token_id, config.vision_start_token_id,
                            config.vision_end_token_id), grid)
        what = f"{size}×{size} images (resized to {h}×{w} by Qwen2-VL's processor)"
    else:
        size = vision.image_size
        if spec.image_size is not None and spec.image_size != size:
            raise UsageError(f"--image-size {spec.image_size}: Gemma-3's processor resizes every image to its vision "
                             f"tower's image_size, {size}; drop --image-size")
        layout = VlmLayout(family, n, (size, size), config.mm_tokens_per_image, config.image_token_id,
                           config.boi_token_id, config.eoi_token_id,
                           (config.image_token_id, config.boi_token_id, config.eoi_token_id))
        what = f"{size}×{size} images"
    need = n * layout.block
    if need > spec.seq:
        raise UsageError(f"{n} {what} take {need} tokens per sample ({layout.tokens} image tokens + 2 delimiters "
                         f"each), more than --seq {spec.seq}; raise --seq (it counts the image tokens), or lower "
                         f"--images or --image-size")
    return layout


def _sample_ids(layout: VlmLayout, text: torch.Tensor) -> torch.Tensor:
    """One sample's ids (S,): the image blocks, then `text` (S - images · block,) ids."""
    block = [layout.open_id, *([layout.image_id] * layout.tokens), layout.close_id]
    return torch.cat([torch.tensor(block * layout.images, dtype=torch.int64), text])


def _text_ids(shape: tuple[int, int], vocab: int, avoid: set[int]) -> torch.Tensor:
    """Random text ids (B, T) in [0, vocab) that are none of `avoid` (special tokens, padding)."""
    ids = torch.randint(0, vocab, shape, dtype=torch.int64)
    safe = next(i for i in range(vocab) if i not in avoid)
    for s in avoid:
        ids[ids == s] = safe
    return ids


def vlm_inputs(spec: RunSpec, config, layout: VlmLayout, device: str, float_dtype: torch.dtype) -> dict[str, Any]:
    """The keyword inputs of a vision-language model's step (the module docstring), on `device` (on meta: empty
    tensors, except Qwen-VL's `image_grid_thw` and `mm_token_type_ids`, real on the CPU):

    - `input_ids` int64 (B, S), `pixel_values` in `float_dtype`: Qwen-VL (B·N·h·w, C·temporal_patch_size·patch²),
      Gemma-3 (B·N, C, H, W) (N: --images);
    - Qwen-VL: `image_grid_thw` int64 (B·N, 3), `mm_token_type_ids` int64 (B, S); Gemma-3: `token_type_ids` int64
      (B, S);
    - to train, `labels` = input_ids; --mode generate, `attention_mask` int64 (B, S) of ones.
    """
    B, S, real = spec.batch, spec.seq, device != "meta"
    text = config.get_text_config()
    pad = getattr(text, "pad_token_id", None)
    avoid = set(layout.special) | ({pad} if isinstance(pad, int) else set())
    images = B * layout.images
    ids = torch.stack([_sample_ids(layout, row)
                       for row in _text_ids((B, S - layout.images * layout.block), text.vocab_size, avoid)])
    types = (ids == layout.image_id).to(torch.int64)  # processing_utils.py create_mm_token_type_ids: 1 = image
    vision = config.vision_config
    channels = getattr(vision, "in_channels", None) or getattr(vision, "num_channels", 3)
    host: dict[str, torch.Tensor] = {}
    if layout.family is VlmFamily.QWEN_VL:
        t, h, w = layout.grid
        pixels = (images * t * h * w, channels * vision.temporal_patch_size * vision.patch_size ** 2)
        host["image_grid_thw"] = torch.tensor([layout.grid] * images, dtype=torch.int64)
        host["mm_token_type_ids"] = types
    else:
        pixels = (images, channels, *layout.image_hw)
    out: dict[str, Any] = {"input_ids": ids.to(device) if real else torch.empty_like(ids, device="meta")}
    out["pixel_values"] = (torch.randn(pixels, dtype=float_dtype, device=device) if real
                           else torch.empty(pixels, dtype=float_dtype, device="meta"))
    out.update({k: v.to(device) if real else v for k, v in host.items()})  # on meta: on the CPU, values the model reads
    if layout.family is VlmFamily.GEMMA3:
        out["token_type_ids"] = types.to(device) if real else torch.empty_like(types, device="meta")
    if spec.mode is Mode.TRAIN:
        out["labels"] = out["input_ids"]
    elif spec.mode is Mode.GENERATE:
        out["attention_mask"] = (torch.ones((B, S), dtype=torch.int64, device=device) if real
                                 else torch.empty((B, S), dtype=torch.int64, device="meta"))
    return out
