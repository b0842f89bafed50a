"""Tiny-model factory: random "debug models" of real MoE families, saved in the
family's real Hugging Face on-disk layout (sharded safetensors + index +
config.json + an offline tokenizer).

This is torchtitan's debugmodel idea: every family we support gets a flavour
small enough for a laptop CPU, built from the family's own transformers config
class, so tests and the demo exercise the real formats and the real module
trees. No hub access: the tokenizer is trained here on the demo corpus.

Any other transformers MoE family gets a debug model shrunk from its own
default config (moeflow_testing.tiny_auto); `FAMILIES` holds hand-tuned flavours
(config class, model class and the overrides that make it tiny). Families: qwen3_moe, mixtral, deepseek_v3
(MLA, shared experts, dense first layer), gpt_oss, qwen3_vl_moe,
ernie4_5_vl_moe, llama4; `build_fp8_debug_model` writes DeepSeek-V3 with FP8
block-scaled weights as DeepSeek ships them.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from moeflow.core.fsutil import staged_dir
from moeflow_testing.demo_data import corpus

# Chat template shipped with every debug tokenizer (ChatML-like, as Qwen uses).
# Content is a string or a list of parts (HF convention); an image part renders
# as the family's image placeholder (IMAGE below), which the processor expands,
# as the real Qwen-VL / ERNIE-VL templates do.
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'text' %}{{ part['text'] }}"
    "{% elif part['type'] in ('image', 'image_url') %}IMAGE{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<pad>"]


@dataclass(frozen=True)
class Family:
    """How to build a tiny model of one transformers MoE family."""

    config_class: str  # transformers config class name
    model_class: str  # transformers model class name (what from_pretrained loads)
    overrides: dict[str, Any] = field(default_factory=dict)
    # nested configs of multimodal packages: {"text_config": {...}, "vision_config": {...}}
    nested: dict[str, dict[str, Any]] = field(default_factory=dict)
    finalize: Callable[[Any, int], None] | None = None  # (config, vocab_size) -> None
    # rewrites the saved shards into the family's real on-disk layout where
    # transformers' save_pretrained does not (dir) -> None
    on_disk: Callable[[Path], None] | None = None
    # multimodal: config attribute -> special token the tokenizer must hold
    vision_tokens: dict[str, str] = field(default_factory=dict)
    image_processor: Callable[[Path], None] | None = None  # (dir) -> None, saves one
    chat_image: str = ""  # what the chat template writes for an image part


_TEXT = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
             rms_norm_eps=1e-6, tie_word_embeddings=False)

def _transpose_fused_experts(out_dir: Path) -> None:
    """Real Qwen3-VL-MoE checkpoints store fused experts as gate_up [E, H, 2I] and
    down [E, I, H], the transpose of the runtime layout; save_pretrained keeps the
    runtime one (its reverse Transpose is shape-checked), so rewrite them here."""
    # lazy: safetensors: heavy, loaded only when this runs
    from safetensors.torch import load_file, save_file

    for shard in sorted(out_dir.glob("*.safetensors")):
        tensors = load_file(str(shard))
        hit = {k: v.transpose(1, 2).contiguous() for k, v in tensors.items()
               if k.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj")) and v.dim() == 3}
        if hit:
            tensors.update(hit)
            save_file(tensors, str(shard), metadata={"format": "pt"})


QWEN_VL_TOKENS = dict(vision_start_token_id="<|vision_start|>", vision_end_token_id="<|vision_end|>",
                      image_token_id="<|image_pad|>", video_token_id="<|video_pad|>")
ERNIE_VL_TOKENS = dict(image_start_token_id="<|IMAGE_START|>", image_end_token_id="<|IMAGE_END|>",
                       image_token_id="<|IMAGE_PLACEHOLDER|>", video_start_token_id="<|VIDEO_START|>",
                       video_end_token_id="<|VIDEO_END|>", video_token_id="<|VIDEO_PLACEHOLDER|>")
LLAMA4_TOKENS = dict(boi_token_index="<|image_start|>", eoi_token_index="<|image_end|>",
                     image_token_index="<|image|>")


def _qwen_vl_processor(out_dir: Path) -> None:
    # the PIL variant: the default (fast) one needs torchvision, not installed here
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    Qwen2VLImageProcessorPil(patch_size=8, temporal_patch_size=2, merge_size=2,
                             min_pixels=16 * 16, max_pixels=64 * 64).save_pretrained(str(out_dir))


def _ernie_vl_processor(out_dir: Path) -> None:
    # lazy: transformers: heavy, loaded only when this runs
    from transformers.models.ernie4_5_vl_moe.image_processing_pil_ernie4_5_vl_moe import Ernie4_5_VLMoeImageProcessorPil

    # min/max_pixels: read by the processor, absent from its typed kwargs
    Ernie4_5_VLMoeImageProcessorPil(patch_size=8, merge_size=2, min_pixels=16 * 16,  # type: ignore[call-arg]
                                    max_pixels=64 * 64).save_pretrained(str(out_dir))


FAMILIES: dict[str, Family] = {
    "qwen3_moe": Family(
        "Qwen3MoeConfig", "Qwen3MoeForCausalLM",
        dict(_TEXT, head_dim=16, moe_intermediate_size=32, num_experts=8,
             num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=1,
             output_router_logits=False)),
    "mixtral": Family(
        "MixtralConfig", "MixtralForCausalLM",
        dict(_TEXT, head_dim=16, intermediate_size=64, num_local_experts=4,
             num_experts_per_tok=2)),
    # MLA attention (q/kv LoRA ranks), 1 shared expert, first layer dense.
    "deepseek_v3": Family(
        "DeepseekV3Config", "DeepseekV3ForCausalLM",
        dict(_TEXT, num_hidden_layers=3, moe_intermediate_size=48, n_routed_experts=8,
             n_shared_experts=1, num_experts_per_tok=2, n_group=2, topk_group=1,
             first_k_dense_replace=1, q_lora_rank=32, kv_lora_rank=32, qk_rope_head_dim=16,
             qk_nope_head_dim=16, v_head_dim=16, num_key_value_heads=4,
             rope_parameters=dict(rope_type="default", rope_theta=10000.0))),
    "gpt_oss": Family(
        "GptOssConfig", "GptOssForCausalLM",
        dict(_TEXT, head_dim=16, intermediate_size=32, num_local_experts=4,
             num_experts_per_tok=2, sliding_window=16,
             layer_types=["sliding_attention", "full_attention"])),
    "qwen3_vl_moe": Family(
        "Qwen3VLMoeConfig", "Qwen3VLMoeForConditionalGeneration",
        dict(tie_word_embeddings=False),
        nested=dict(
            text_config=dict(_TEXT, head_dim=16, moe_intermediate_size=16, num_experts=8,
                             num_experts_per_tok=2, decoder_sparse_step=1,
                             rope_parameters=dict(rope_type="default", rope_theta=10000.0,
                                                  mrope_section=[2, 3, 3],
                                                  mrope_interleaved=True)),
            vision_config=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2,
                               patch_size=8, temporal_patch_size=2, spatial_merge_size=2,
                               out_hidden_size=64, num_position_embeddings=16,
                               deepstack_visual_indexes=[1])),
        on_disk=_transpose_fused_experts, vision_tokens=QWEN_VL_TOKENS,
        image_processor=_qwen_vl_processor,
        chat_image="<|vision_start|><|image_pad|><|vision_end|>"),
    "ernie4_5_vl_moe": Family(
        "Ernie4_5_VLMoeConfig", "Ernie4_5_VLMoeForConditionalGeneration",
        dict(tie_word_embeddings=False),
        nested=dict(
            text_config=dict(_TEXT, moe_intermediate_size=[32, 16], moe_num_experts=4,
                             moe_k=2, moe_num_shared_experts=1,
                             mlp_layer_types=["dense", "sparse"],
                             rope_parameters=dict(rope_type="default", rope_theta=500000.0,
                                                  mrope_section=[3, 3, 2])),
            vision_config=dict(depth=2, hidden_size=32, intermediate_size=128, num_heads=2,
                               patch_size=8, spatial_merge_size=2)),
        vision_tokens=ERNIE_VL_TOKENS, image_processor=_ernie_vl_processor,
        chat_image="<|IMAGE_START|><|IMAGE_PLACEHOLDER|><|IMAGE_END|>"),
    # Natively multimodal; vision intermediate_size must be 4 x hidden (docs/facts.md).
    "llama4": Family(
        "Llama4Config", "Llama4ForConditionalGeneration",
        dict(tie_word_embeddings=False),
        nested=dict(
            text_config=dict(_TEXT, head_dim=16, intermediate_size=32, intermediate_size_mlp=128,
                             num_local_experts=4, num_experts_per_tok=1,
                             interleave_moe_layer_step=1, attention_chunk_size=64),
            vision_config=dict(hidden_size=32, intermediate_size=128, num_hidden_layers=2,
                               num_attention_heads=2, image_size=32, patch_size=8,
                               vision_output_dim=64, projector_input_dim=64,
                               projector_output_dim=64, pixel_shuffle_ratio=0.5)),
        # no image processor: Llama4's needs torchvision, which is not installed here
        vision_tokens=LLAMA4_TOKENS, chat_image="<|image|>"),
}


def supported_families() -> list[str]:
    return sorted(FAMILIES)


def debug_config(family: str, vocab_size: int = 512, **overrides: Any):
    """A tiny transformers config of `family` (overrides win over the defaults)."""
    # lazy: transformers: heavy, loaded only when this runs
    import transformers

    if family not in FAMILIES:
        raise ValueError(f"no debug model for family {family!r}; "
                         f"known: {', '.join(supported_families())}")
    spec = FAMILIES[family]
    kwargs: dict[str, Any] = dict(spec.overrides)
    kwargs.update(overrides)
    for key, sub in spec.nested.items():
        kwargs[key] = dict(sub, **kwargs.get(key, {}))
    if spec.nested and "text_config" in spec.nested:
        kwargs["text_config"]["vocab_size"] = vocab_size
    else:
        kwargs["vocab_size"] = vocab_size
    config = getattr(transformers, spec.config_class)(**kwargs)
    config.architectures = [spec.model_class]
    if spec.finalize:
        spec.finalize(config, vocab_size)
    return config


def build_tokenizer(out_dir: str | Path, corpus: list[str], vocab_size: int = 512,
                    extra_special: list[str] | dict[str, str] | None = None, chat_image: str = ""):
    """Train a small byte-level BPE tokenizer offline and save it (HF format).

    Args:
        extra_special: special tokens after SPECIAL_TOKENS (e.g. vision tokens);
            the trainer gives special tokens the first ids, in list order. A
            dict names them ({"image_token": "<|image_pad|>"}), so the tokenizer
            has `image_token` / `image_token_id` as the real multimodal ones do
            (their processors read these attributes).
        chat_image: what the chat template writes for an image content part.

    Returns the `PreTrainedTokenizerFast`; its length is the model vocab size.
    """
    named = extra_special if isinstance(extra_special, dict) else None
    extra = list(named.values()) if named else list(extra_special or [])
    specials = SPECIAL_TOKENS + [t for t in extra if t not in SPECIAL_TOKENS]
    # lazy: tokenizers, transformers: heavy, loaded only when this runs
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=specials, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<pad>",
        bos_token=None, unk_token=None, model_max_length=512,
        extra_special_tokens=named or specials[len(SPECIAL_TOKENS):] or None)
    fast.chat_template = CHAT_TEMPLATE.replace("IMAGE", chat_image)
    fast.save_pretrained(str(out_dir))
    return fast


def build_debug_model(family: str, out_dir: str | Path, *, corpus: list[str] | None = None,
                      seed: int = 0, dtype: str = "bfloat16",
                      max_shard_size: str = "100KB", **overrides: Any) -> Path:
    """Write a random-initialised debug model of `family` to `out_dir`.

    The directory holds sharded safetensors + `model.safetensors.index.json` +
    `config.json` + tokenizer files, written to a temporary directory first and
    renamed into place, so an interrupted build leaves nothing that looks done.

    Returns:
        The output directory.
    """
    # lazy: torch, transformers: heavy, loaded only when this runs
    import torch
    import transformers

    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    with staged_dir(out_dir) as tmp:
        spec = FAMILIES[family] if family in FAMILIES else None
        vision = spec.vision_tokens if spec else {}
        # tokenizer attribute names as the real tokenizers have them: image_token_id -> image_token
        named = {k.removesuffix("_id").removesuffix("_index"): t for k, t in vision.items()}
        tokenizer = build_tokenizer(tmp, corpus or _default_corpus(), extra_special=named or None,
                                    chat_image=spec.chat_image if spec else "")
        ids = {k: tokenizer.convert_tokens_to_ids(t) for k, t in vision.items() if k not in overrides}
        torch.manual_seed(seed)
        if spec:
            config = debug_config(family, vocab_size=len(tokenizer), **ids, **overrides)
            _set_special_ids(config, tokenizer)
            model = getattr(transformers, spec.model_class)(config)
        else:  # any other transformers MoE family: shrunk from its default config
            from moeflow_testing.tiny_auto import tiny_config, tiny_model

            config = tiny_config(family, vocab_size=len(tokenizer))
            for key, value in overrides.items():
                setattr(config, key, value)
            _set_special_ids(config, tokenizer)
            model = tiny_model(family, config=config)
        model = model.to(getattr(torch, dtype)).eval()
        model.save_pretrained(str(tmp), max_shard_size=max_shard_size)
        if spec and spec.on_disk:
            spec.on_disk(tmp)
        if spec and spec.image_processor:
            spec.image_processor(tmp)
    return out_dir


def _set_special_ids(config, tokenizer) -> None:
    ids = dict(eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
               bos_token_id=None)
    targets = [config] + [getattr(config, k) for k in ("text_config",) if hasattr(config, k)]
    for target in targets:
        for key, value in ids.items():
            setattr(target, key, value)


def _default_corpus() -> list[str]:
    return corpus()


def read_config(path: str | Path) -> dict:
    return json.loads((Path(path) / "config.json").read_text())


def build_fp8_debug_model(out_dir: str | Path, *, block: tuple[int, int] = (16, 16),
                          seed: int = 0, corpus: list[str] | None = None, **overrides: Any) -> Path:
    """A DeepSeek-V3 debug model stored the way DeepSeek ships it: every decoder
    projection weight as float8_e4m3fn plus a float32 `weight_scale_inv` per
    `block` tile, and `quantization_config` (fp8, e4m3, weight_block_size) in
    config.json. The default block (16, 16) gives several blocks per matrix (as
    [128, 128] does on the real 7168-wide model) and divides every quantised
    dimension, which transformers' own FP8 dequantisation (the reference the
    verification compares logits against) requires.

    Returns:
        The output directory.
    """
    # lazy: safetensors: heavy, loaded only when this runs; loads torch, which importing this module does not
    from safetensors.torch import load_file, save_file

    from moeflow.checkpoint.fp8 import quantize

    out_dir = Path(out_dir)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        model_dir = build_debug_model("deepseek_v3", tmp / "m", corpus=corpus, seed=seed, **overrides)
        index_path = model_dir / "model.safetensors.index.json"
        index = json.loads(index_path.read_text())
        for shard in sorted(model_dir.glob("*.safetensors")):
            tensors = load_file(str(shard))
            for name in [k for k, v in tensors.items() if _fp8_target(k, v)]:
                tensors[name], tensors[name + "_scale_inv"] = quantize(tensors[name], block)
                index["weight_map"][name + "_scale_inv"] = shard.name
            save_file(tensors, str(shard), metadata={"format": "pt"})
        index_path.write_text(json.dumps(index, indent=2))
        config = json.loads((model_dir / "config.json").read_text())
        config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3",
                                         "activation_scheme": "dynamic",
                                         "weight_block_size": list(block)}
        (model_dir / "config.json").write_text(json.dumps(config, indent=2))
        if out_dir.exists():
            shutil.rmtree(out_dir)
        model_dir.rename(out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def _fp8_target(name: str, tensor) -> bool:
    # DeepSeek-V3 quantises the decoder's linear projections, not norms, router,
    # embeddings or head.
    return ".layers." in name and name.endswith("_proj.weight") and tensor.dim() == 2 \
        and ".gate." not in name
