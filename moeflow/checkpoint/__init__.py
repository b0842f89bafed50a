"""Checkpoint parsing, conversion, verification and export (the `convert` stage).

- `parse`: config, index and shard headers without loading data; `inspect`.
- `families`: transformers' own module tree and conversion mapping per family.
- `plan` / `engine` / `convert`: streaming per-tensor conversion, one file per layer.
- `fp8`: block-scaled FP8 dequantisation.
- `verify`: tensor-by-tensor recomputation and from_pretrained/logits checks.
- `export`: back to the original Hugging Face layout.
- `st_io`: safetensors headers, ranged reads and streaming writes; `report`: tables, MLflow.
"""
