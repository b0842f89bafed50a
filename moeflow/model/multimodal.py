"""Image inputs for served image-text models (OpenAI `image_url` content parts).

A chat request's `image_url` parts (data URIs) are decoded to PIL images, the
messages are rendered by the chat template with one image placeholder per
image, and the model's own processor (transformers' Qwen3VLProcessor,
Ernie4_5_VLMoeProcessor, ...) expands each placeholder to the image's token
count and returns pixel values, grids and the modality type ids. The engine
then needs, per request:

- which prompt positions hold each image (so chunked prefill never splits an
  image: vLLM's `disable_chunked_mm_input` policy, since the vision tower
  encodes whole images),
- each image's rows of `pixel_values` (they are concatenated patches, one row
  per patch, `grid_thw.prod()` rows per image),
- the multimodal RoPE (M-RoPE) positions of the prompt and the offset that
  continues them for generated tokens, computed once by the model's own
  `get_rope_index`, so no per-model state is shared between requests in a
  batch (transformers keeps `rope_deltas` on the model, which only works for
  one request at a time).

Only `data:` URIs are accepted: the server never fetches a URL (no SSRF, no
network needed on a cluster node).
"""

from __future__ import annotations

import base64
import binascii
import io
import json
from dataclasses import dataclass
from pathlib import Path

import torch

from moeflow.core.errors import UserError

MAX_IMAGE_BYTES = 20 << 20  # decoded size of one image
MAX_IMAGE_PIXELS = 64 << 20  # width x height, before the processor resizes


@dataclass
class ImagePrompt:
    """What the engine needs for one prompt with images.

    Attributes:
        pixel_values: [P, D] patches of all images, in prompt order.
        grids: [N, 3] (t, h, w) per image; image i owns grids[i].prod() patch rows.
        spans: [(start, end)] prompt positions of each image's tokens.
        positions: [3, L] M-RoPE positions of the prompt (None: 1-D RoPE model).
        rope_delta: generated token t (0-based in the whole sequence) has
            M-RoPE position t + rope_delta.
        extra: other per-token inputs the model needs, [L] each
            (e.g. ERNIE-VL's `moe_mm_token_type_ids`, which routes image
            tokens to the vision experts).
    """

    pixel_values: torch.Tensor
    grids: torch.Tensor
    spans: list[tuple[int, int]]
    positions: torch.Tensor | None
    rope_delta: int
    extra: dict[str, torch.Tensor]

    def chunk_end(self, start: int, end: int) -> int:
        """Move a prefill chunk's end [start, end) off the inside of an image:
        back to the image's start, or (chunk starting at it) past its end."""
        for s, e in self.spans:
            if s < end < e:
                return s if s > start else e
        return end

    def inputs(self, start: int, end: int) -> dict[str, torch.Tensor]:
        """Model kwargs for prompt positions [start, end) (a chunk; whole images only)."""
        out: dict[str, torch.Tensor] = {}
        rows = self.grids.prod(-1).tolist()  # patches per image
        offsets = [0]
        for r in rows:
            offsets.append(offsets[-1] + r)
        chosen = [i for i, (s, e) in enumerate(self.spans) if start <= s and e <= end]
        if chosen:
            first, last = chosen[0], chosen[-1]
            out["pixel_values"] = self.pixel_values[offsets[first]:offsets[last + 1]]
            out["image_grid_thw"] = self.grids[first:last + 1]
        for key, value in self.extra.items():
            out[key] = value[start:end].unsqueeze(0)  # [1, C]
        return out


def load_processor(model_dir: str | Path, tokenizer):
    """The model's processor for images, or raise UserError saying why there is none.

    Why not AutoProcessor: every transformers image-text processor also
    requires a video processor, and those need torchvision, which does not
    work beside the CPU torch build (PyPI's torchvision fails to import next to
    it: 'operator torchvision::nms does not exist'). Images never touch it, so
    the processor class is instantiated with `video_processor=None` — the same
    class and code (placeholder expansion, modality ids), minus video.
    """
    # lazy: transformers: heavy, loaded only when this runs
    import transformers
    from transformers import AutoConfig, AutoImageProcessor
    from transformers.models.auto.processing_auto import PROCESSOR_MAPPING_NAMES

    config = AutoConfig.from_pretrained(str(model_dir))
    name = PROCESSOR_MAPPING_NAMES.get(config.model_type) or _declared_processor(model_dir)
    if not name or not hasattr(transformers, name):
        raise UserError(f"transformers has no processor for model type {config.model_type!r}")
    cls = getattr(transformers, name)
    try:
        image_processor = AutoImageProcessor.from_pretrained(str(model_dir))
    except (OSError, ValueError, ImportError) as exc:
        raise UserError(f"{model_dir}: no usable image processor (preprocessor_config.json): "
                        f"{str(exc).strip().splitlines()[0]}") from None
    try:
        return _image_only(cls)(image_processor=image_processor, tokenizer=tokenizer, video_processor=None)
    except (AttributeError, TypeError, ValueError) as exc:  # e.g. tokenizer lacks the image tokens
        raise UserError(f"{model_dir}: cannot build {name} for images: {exc}") from None


def _declared_processor(model_dir: str | Path) -> str | None:
    """The transformers processor class a checkpoint names in its preprocessor_config.json
    (`processor_class`): how a model with its own code (no entry in transformers'
    processor mapping) says which of transformers' processors prepares its images."""

    path = Path(model_dir) / "preprocessor_config.json"
    try:
        name = json.loads(path.read_text()).get("processor_class") if path.is_file() else None
    except json.JSONDecodeError:
        raise UserError(f"{path}: invalid JSON") from None
    return name if isinstance(name, str) else None


def _image_only(cls):
    def check_argument_for_proper_class(self, argument_name, argument):
        if argument_name == "video_processor" and argument is None:
            return None
        return cls.check_argument_for_proper_class(self, argument_name, argument)

    return type(f"{cls.__name__}ImagesOnly", (cls,), {
        "check_argument_for_proper_class": check_argument_for_proper_class})


def decode_image(url: str, where: str):
    """A `data:image/...;base64,...` URI -> RGB PIL image; UserError naming `where`."""
    # lazy: PIL: heavy, loaded only when this runs
    from PIL import Image, UnidentifiedImageError

    if not isinstance(url, str) or not url.startswith("data:"):
        scheme = url.split(":", 1)[0] if isinstance(url, str) and ":" in url else "no scheme"
        raise UserError(f"{where}: only data: URIs are accepted (got {scheme}); "
                        f"the server does not fetch URLs")
    header, sep, payload = url.partition(",")
    if not sep or not header.endswith(";base64"):
        raise UserError(f"{where}: expected data:image/<type>;base64,<data>")
    if not header[5:].startswith("image/"):
        raise UserError(f"{where}: media type {header[5:-7] or '(none)'!r} is not an image")
    if len(payload) > MAX_IMAGE_BYTES * 4 // 3 + 4:
        raise UserError(f"{where}: image larger than {MAX_IMAGE_BYTES >> 20} MiB")
    try:
        raw = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise UserError(f"{where}: invalid base64 data") from None
    try:
        with Image.open(io.BytesIO(raw)) as img:
            if img.width * img.height > MAX_IMAGE_PIXELS:
                raise UserError(f"{where}: image of {img.width}x{img.height} pixels is too large")
            return img.convert("RGB")
    except (UnidentifiedImageError, OSError, Image.DecompressionBombError) as exc:
        raise UserError(f"{where}: not a readable image ({str(exc).splitlines()[0]})") from None


def prepare(processor, model, text: str, images: list) -> tuple[list[int], ImagePrompt]:
    """Run the processor on the rendered prompt and its images.

    Returns:
        (prompt token ids, ImagePrompt).
    """
    try:
        enc = processor(text=[text], images=images, return_tensors="pt")
    except ValueError as exc:  # placeholder count does not match the images, ...
        raise UserError(f"messages: {str(exc).splitlines()[0]}") from None
    ids = enc["input_ids"][0]  # [L]
    types = enc["mm_token_type_ids"]  # [1, L]: 1 = image token
    grids = enc["image_grid_thw"]  # [N, 3]
    merge = getattr(processor.image_processor, "merge_size", 1)
    spans = _spans((types[0] == 1).nonzero().flatten().tolist(),
                   [int(g.prod()) // merge ** 2 for g in grids])
    positions, delta = None, 0
    inner = getattr(model, "model", None)
    if inner is not None and hasattr(inner, "get_rope_index"):  # M-RoPE (Qwen-VL, ERNIE-VL)
        pos, deltas = inner.get_rope_index(enc["input_ids"], mm_token_type_ids=types,
                                           image_grid_thw=grids, attention_mask=enc["attention_mask"])
        positions, delta = pos[:, 0], int(deltas.reshape(-1)[0])  # [3, L]
    extra = {k: enc[k][0] for k in ("moe_mm_token_type_ids",) if k in enc}
    return ids.tolist(), ImagePrompt(enc["pixel_values"], grids, spans, positions, delta, extra)


def _spans(image_positions: list[int], counts: list[int]) -> list[tuple[int, int]]:
    """[(start, end)] of each image's tokens: consecutive runs of `counts` positions."""
    if sum(counts) != len(image_positions):
        raise UserError(f"messages: the prompt has {len(image_positions)} image tokens, "
                        f"its {len(counts)} images need {sum(counts)}")
    spans, k = [], 0
    for n in counts:
        first, last = image_positions[k], image_positions[k + n - 1]
        if last - first != n - 1:
            raise UserError("messages: an image's tokens are not contiguous in the prompt")
        spans.append((first, last + 1))
        k += n
    return spans
