"""Build the reference-shape debug checkpoint (remote code) and the demo's data beside it.

    python -m moeflow_testing.reference.build demo-work/reference-tiny

writes `<out>/model` — config.json with `auto_map`, the modeling code
(`configuration_refmoe.py`, `modeling_refmoe.py`) copied from this package,
sharded safetensors, a byte-level BPE tokenizer with Qwen-VL's image tokens
and a Qwen2-VL image processor (PIL) — and `<out>/data` (the demo's
fine-tuning task). Built at run time, never committed; deterministic for a
seed. `--experts mxfp4` stores the routed experts in the MXFP4 layout
(`*_blocks` uint8 [E, out, in/32, 16], `*_scales` e8m0 [E, out, in/32],
`quantization_config.quant_method: mxfp4`) as releases of this shape do.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

from moeflow.checkpoint.mxfp4_files import store_experts_mxfp4
from moeflow.core.fsutil import staged_dir
from moeflow_testing.demo_data import make_dataset
from moeflow_testing.tiny import QWEN_VL_TOKENS, _default_corpus, _qwen_vl_processor, build_tokenizer

HERE = Path(__file__).parent
CODE = ("configuration_refmoe.py", "modeling_refmoe.py")
AUTO_MAP = {"AutoConfig": "configuration_refmoe.RefMoeConfig",
            "AutoModel": "modeling_refmoe.RefMoeModel",
            "AutoModelForImageTextToText": "modeling_refmoe.RefMoeForConditionalGeneration"}
VISION = dict(depth=1, hidden_size=32, num_heads=2, patch_size=8, temporal_patch_size=2,
              spatial_merge_size=2, in_channels=3)
# The reference's structure at debug width: 896 routed experts, top-16, 2 shared,
# 3 linear-attention layers per MLA layer, experts in a latent width (32) below
# hidden (64); widths are multiples of 32, MXFP4's block.
SHAPE = dict(hidden_size=64, num_hidden_layers=4, n_routed_experts=896, num_experts_per_tok=16,
             n_shared_experts=2, moe_intermediate_size=32, expert_latent_size=32,
             num_attention_heads=4, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16,
             qk_rope_head_dim=8, v_head_dim=16, linear_num_heads=4, linear_head_dim=16)


def _code_classes():
    """The config and model classes from this package's files (as the checkpoint ships them)."""
    # lazy: loads torch, transformers, which importing this module does not
    from moeflow_testing.reference.configuration_refmoe import RefMoeConfig
    from moeflow_testing.reference.modeling_refmoe import RefMoeForConditionalGeneration

    return RefMoeConfig, RefMoeForConditionalGeneration


def build_model(out_dir: str | Path, *, seed: int = 0, dtype: str = "bfloat16", experts: str = "bf16",
                max_shard_size: str = "2MB", **overrides) -> Path:
    """Write the reference-shape checkpoint to `out_dir` (staged, renamed into place)."""
    # lazy: torch: heavy, loaded only when this runs
    import torch


    config_cls, model_cls = _code_classes()
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    with staged_dir(out_dir) as tmp:
        named = {k.removesuffix("_id"): t for k, t in QWEN_VL_TOKENS.items()}
        tok = build_tokenizer(tmp, _default_corpus(), extra_special=named,
                              chat_image="<|vision_start|><|image_pad|><|vision_end|>")
        ids = {k: tok.convert_tokens_to_ids(t) for k, t in QWEN_VL_TOKENS.items()}
        config = config_cls(vocab_size=len(tok), vision_config=VISION, eos_token_id=tok.eos_token_id,
                            pad_token_id=tok.pad_token_id, bos_token_id=None, **ids, **dict(SHAPE, **overrides))
        config.architectures = [model_cls.__name__]
        torch.manual_seed(seed)
        model = model_cls(config).to(getattr(torch, dtype)).eval()
        model.save_pretrained(str(tmp), max_shard_size=max_shard_size)
        raw = json.loads((tmp / "config.json").read_text())
        raw["auto_map"] = AUTO_MAP
        (tmp / "config.json").write_text(json.dumps(raw, indent=2))
        for name in CODE:
            shutil.copyfile(HERE / name, tmp / name)
        _qwen_vl_processor(tmp)
        pre = json.loads((tmp / "preprocessor_config.json").read_text())
        pre["processor_class"] = "Qwen2VLProcessor"  # transformers' processor for these image tokens
        (tmp / "preprocessor_config.json").write_text(json.dumps(pre, indent=2))
        if experts == "mxfp4":
            store_experts_mxfp4(tmp)
    return out_dir


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m moeflow_testing.reference.build",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("out", help="output directory (model/ and data/ are written under it)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--experts", choices=("bf16", "mxfp4"), default="mxfp4",
                        help="on-disk format of the routed experts (default: mxfp4, as the release)")
    parser.add_argument("--force", action="store_true", help="rebuild even when the output exists")
    args = parser.parse_args(argv)

    out = Path(args.out)
    if args.force or not (out / "model" / "config.json").is_file():
        if (out / "model").exists():
            shutil.rmtree(out / "model")
        build_model(out / "model", seed=args.seed, experts=args.experts)
    if args.force or not (out / "data" / "train.jsonl").is_file():
        make_dataset(out / "data", n_train=400, n_eval=40)
    print(f"reference-shape model: {out / 'model'}  data: {out / 'data'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
