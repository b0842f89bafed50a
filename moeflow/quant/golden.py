"""The golden set as model inputs: the text of every suite record, and its image
for image-text models (through the model's own processor).

    samples = golden_samples(load_suite(None), "demo-work/model", limit=48)
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from moeflow.core.errors import UserError
from moeflow.model.models import loads_image_text

_TEXT_FIELDS = ("prompt", "context", "question", "text")
log = logging.getLogger("moeflow.quant")


def record_text(record: dict) -> str:
    """The text a record feeds a model: its prompt/context/question/text, plus the gold
    answer (completion or gold choice) so the answer tokens are compared too."""
    text = next((record[k] for k in _TEXT_FIELDS if isinstance(record.get(k), str)), "")
    if isinstance(record.get("completion"), str):
        text += record["completion"]
    elif isinstance(record.get("choices"), list) and isinstance(record.get("gold"), int):
        text += record["choices"][record["gold"]]
    return text


def golden_samples(suite, model_dir: str | Path, limit: int = 64, max_tokens: int = 64,
                   note=None) -> list[dict]:
    """Model inputs ([1, T] each) for the suite's records, images included where the
    model is image-text (records with an image are skipped on a text model).

    Args:
        suite: a loaded suite (moeflow.evaluation.suite.load_suite).
        model_dir: the baseline checkpoint (tokenizer, processor, config).
        limit: at most this many samples, taken round-robin over the tasks.
        max_tokens: text is cut to this many tokens (image prompts are kept whole).
        note: callable(str) told when an image-text model's image records are left out
            (its processor cannot be built); default: a warning on the moeflow.quant logger.

    Returns:
        [{"input_ids": [1, T], ...}] (the processor's extra inputs for images).
        Raises UserError when the set is empty.
    """
    # lazy: transformers: heavy, loaded only when this runs
    import transformers


    tokenizer = transformers.AutoTokenizer.from_pretrained(str(model_dir))
    image_text = loads_image_text(model_dir) and _processor_or_note(model_dir, tokenizer, note)
    queues = [[r for r in t.records if image_text or "image_path" not in r] for t in suite.tasks
              if t.spec.type != "lm_eval"]
    records: list[dict] = []
    while len(records) < limit and any(queues):
        for q in queues:
            if q and len(records) < limit:
                records.append(q.pop(0))
    samples = [s for s in (_encode(r, tokenizer, model_dir, max_tokens) for r in records) if s]
    if not samples:
        raise UserError(f"golden set {suite.path}: no samples for {model_dir} (empty, or only "
                        f"image records on a text model)")
    return samples


def _encode(record: dict, tokenizer, model_dir, max_tokens: int) -> dict | None:
    # lazy: torch: heavy, loaded only when this runs
    import torch

    text = record_text(record)
    if "image_path" in record:
        return _image_inputs(record, text, tokenizer, model_dir)
    ids = tokenizer(text, add_special_tokens=True).input_ids[:max_tokens]
    return {"input_ids": torch.tensor([ids])} if ids else None


_PROCESSORS: dict[str, Any] = {}  # transformers processors


def _processor_or_note(model_dir, tokenizer, note=None) -> bool:
    """True when the image-text checkpoint's processor builds; else its image records are
    left out with a warning, as regress skips its image tasks (a checkpoint shipped without
    preprocessor_config.json is calibrated on text)."""
    from moeflow.model.multimodal import load_processor  # lazy: transformers' processors

    key = str(model_dir)
    if key not in _PROCESSORS:
        try:
            _PROCESSORS[key] = load_processor(model_dir, tokenizer)
        except UserError as exc:
            (note or log.warning)(f"golden set: image records left out, {exc}")
            return False
    return True


def _image_inputs(record: dict, text: str, tokenizer, model_dir) -> dict:
    """<image><question+answer> through the model's processor (as the regress runner builds it)."""
    # lazy: PIL: heavy, loaded only when this runs; loads torch, which importing this module does not
    from PIL import Image

    from moeflow.model.multimodal import load_processor

    key = str(model_dir)
    if key not in _PROCESSORS:
        _PROCESSORS[key] = load_processor(model_dir, tokenizer)
    proc = _PROCESSORS[key]
    try:
        with Image.open(record["image_path"]) as img:
            image = img.convert("RGB")
    except (OSError, ValueError) as exc:
        raise UserError(f"image {record['image_path']}: cannot read it: {exc}") from None
    start = getattr(proc, "vision_start_token", None) or getattr(proc, "image_start_token", "")
    end = getattr(proc, "vision_end_token", None) or getattr(proc, "image_end_token", "")
    return dict(proc(text=[f"{start}{proc.image_token}{end}{text}"], images=[image],
                     return_tensors="pt"))
