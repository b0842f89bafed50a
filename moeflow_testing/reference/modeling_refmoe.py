"""Modeling code of the reference-shape debug model (remote code shipped with its checkpoint).

Module tree (the names moeflow's anatomy reads):

    model.language_model.embed_tokens
    model.language_model.layers[i].input_layernorm / post_attention_layernorm
    model.language_model.layers[i].linear_attn      (layer_types "linear_attention")
    model.language_model.layers[i].self_attn        (layer_types "full_attention": MLA)
    model.language_model.layers[i].mlp.gate         (router: sigmoid scores + bias, top-k)
    model.language_model.layers[i].mlp.latent_down / latent_up   (hidden <-> expert latent)
    model.language_model.layers[i].mlp.experts      (fused [E, 2I, L] / [E, L, I])
    model.language_model.layers[i].mlp.shared_experts
    model.language_model.norm, model.visual, lm_head

Linear attention: a decayed (retention-style) outer-product memory per head
after a short causal convolution; its conv and recurrent states live in
transformers' `DynamicCache` (layer type "linear_attention"). MLA: low-rank
queries and a compressed KV with a shared rotary key, as DeepSeek-V3 does; its
keys and values live in the same cache. Images: the processor's patches go
through a small vision tower; every 2x2 group of patches merges into one image
token that replaces an `image_token_id` position of the prompt.
"""

import math

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers.cache_utils import DynamicCache
from transformers.integrations import use_experts_implementation
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import CausalLMOutputWithPast

from .configuration_refmoe import RefMoeConfig


class RefMoeRMSNorm(nn.Module):
    def __init__(self, size, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x):
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def _rotate(x, positions, theta):
    """Rotary embedding of the last dim of x [B, H, T, D] at positions [B, T]."""
    half = x.shape[-1] // 2
    inv = 1.0 / (theta ** (torch.arange(half, device=x.device, dtype=torch.float32) / half))
    ang = positions.float()[:, None, :, None] * inv  # [B, 1, T, D/2]
    cos, sin = ang.cos().to(x.dtype), ang.sin().to(x.dtype)
    a, b = x[..., :half], x[..., half:]
    return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)


class RefMoeLatentAttention(nn.Module):
    """Multi-head latent attention: queries and keys/values through low-rank bottlenecks."""

    def __init__(self, config, layer_idx):
        super().__init__()
        self.layer_idx = layer_idx
        self.heads = config.num_attention_heads
        self.nope, self.rope, self.vdim = config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim
        self.kv_rank = config.kv_lora_rank
        self.theta = config.rope_theta
        self.q_a_proj = nn.Linear(config.hidden_size, config.q_lora_rank, bias=False)
        self.q_a_layernorm = RefMoeRMSNorm(config.q_lora_rank, config.rms_norm_eps)
        self.q_b_proj = nn.Linear(config.q_lora_rank, self.heads * config.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(config.hidden_size, self.kv_rank + self.rope, bias=False)
        self.kv_a_layernorm = RefMoeRMSNorm(self.kv_rank, config.rms_norm_eps)
        self.kv_b_proj = nn.Linear(self.kv_rank, self.heads * (self.nope + self.vdim), bias=False)
        self.o_proj = nn.Linear(self.heads * self.vdim, config.hidden_size, bias=False)

    def forward(self, x, positions, mask, cache):
        b, t, _ = x.shape
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))).view(b, t, self.heads, -1).transpose(1, 2)
        q_nope, q_rot = q.split([self.nope, self.rope], dim=-1)
        compressed, k_rot = self.kv_a_proj_with_mqa(x).split([self.kv_rank, self.rope], dim=-1)
        kv = self.kv_b_proj(self.kv_a_layernorm(compressed)).view(b, t, self.heads, -1).transpose(1, 2)
        k_nope, v = kv.split([self.nope, self.vdim], dim=-1)
        k_rot = _rotate(k_rot.view(b, 1, t, self.rope), positions, self.theta).expand(-1, self.heads, -1, -1)
        q = torch.cat([q_nope, _rotate(q_rot, positions, self.theta)], dim=-1)
        k = torch.cat([k_nope, k_rot], dim=-1)
        if cache is not None:
            k, v = cache.update(k, v, self.layer_idx)
        scores = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1]) + mask  # [B, H, T, S]
        out = torch.softmax(scores.float(), dim=-1).to(v.dtype) @ v
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))


class RefMoeLinearAttention(nn.Module):
    """Decayed linear attention: S_t = g * S_{t-1} + k_t v_t^T, o_t = q_t S_t, per head."""

    def __init__(self, config, layer_idx):
        super().__init__()
        self.layer_idx = layer_idx
        self.heads, self.dim = config.linear_num_heads, config.linear_head_dim
        self.kernel = config.linear_conv_kernel
        inner = self.heads * self.dim
        self.q_proj = nn.Linear(config.hidden_size, inner, bias=False)
        self.k_proj = nn.Linear(config.hidden_size, inner, bias=False)
        self.v_proj = nn.Linear(config.hidden_size, inner, bias=False)
        self.conv1d = nn.Conv1d(3 * inner, 3 * inner, self.kernel, groups=3 * inner, bias=False)
        # per-head decay g = sigmoid(decay): heads remember over different spans
        self.decay = nn.Parameter(torch.linspace(1.0, 4.0, self.heads))
        self.o_norm = RefMoeRMSNorm(self.dim, config.rms_norm_eps)
        self.o_proj = nn.Linear(inner, config.hidden_size, bias=False)

    def _conv(self, mixed, cache):
        """Causal depthwise conv over [B, C, T]; the cache keeps the last `kernel` inputs."""
        t = mixed.shape[-1]
        if cache is not None and cache.layers[self.layer_idx].has_previous_state[0]:
            full = cache.update_conv_state(mixed, self.layer_idx, conv_kernel_size=self.kernel)
            return F.conv1d(full, self.conv1d.weight, groups=mixed.shape[1])[..., -t:]
        if cache is not None:
            cache.update_conv_state(mixed, self.layer_idx, conv_kernel_size=self.kernel)
        return F.conv1d(F.pad(mixed, (self.kernel - 1, 0)), self.conv1d.weight, groups=mixed.shape[1])

    def forward(self, x, pad_mask, cache):
        b, t, _ = x.shape
        if pad_mask is not None:  # left padding must not enter the memory
            x = x * pad_mask[..., None].to(x.dtype)
        mixed = torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], dim=-1).transpose(1, 2)
        q, k, v = F.silu(self._conv(mixed, cache)).transpose(1, 2).chunk(3, dim=-1)
        q, k, v = (z.view(b, t, self.heads, self.dim).transpose(1, 2) for z in (q, k, v))
        q, k = F.normalize(q, dim=-1), F.normalize(k, dim=-1)
        if pad_mask is not None:
            k = k * pad_mask[:, None, :, None].to(k.dtype)
        state = cache.get_recurrent_state(self.layer_idx) if cache is not None else None
        out, state = self._retention(q, k, v, state)
        if cache is not None:
            cache.update_recurrent_state(state, self.layer_idx)
        out = self.o_norm(out).transpose(1, 2).reshape(b, t, -1)
        return self.o_proj(out)

    def _retention(self, q, k, v, state):
        """Chunk-parallel form of the recurrence; state [B, H, D, D] carries it across calls."""
        t = q.shape[2]
        log_g = F.logsigmoid(self.decay.float())  # [H], < 0
        pos = torch.arange(t, device=q.device)
        gap = (pos[:, None] - pos[None, :]).float()  # [T, T]: t - s
        weights = torch.where(gap >= 0, torch.exp(log_g[:, None, None] * gap.clamp(min=0)),
                              torch.zeros((), device=q.device))  # [H, T, T]
        out = ((q @ k.transpose(-1, -2)).float() * weights).to(v.dtype) @ v
        tail = torch.exp(log_g[:, None] * (t - 1 - pos).float())  # [H, T]: decay to the last step
        new = (k * tail[None, :, :, None].to(k.dtype)).transpose(-1, -2) @ v  # [B, H, D, D]
        if state is not None:
            head = torch.exp(log_g[:, None] * (pos + 1).float())  # [H, T]
            out = out + (q @ state.to(q.dtype)) * head[None, :, :, None].to(q.dtype)
            new = new + state.to(new.dtype) * torch.exp(log_g * t)[None, :, None, None].to(new.dtype)
        return out, new


class RefMoeMLP(nn.Module):
    def __init__(self, hidden, inner):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inner, bias=False)
        self.up_proj = nn.Linear(hidden, inner, bias=False)
        self.down_proj = nn.Linear(inner, hidden, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class RefMoeRouter(nn.Module):
    """Sigmoid scores; a per-expert bias steers the choice (not the weights); top-k renormalised."""

    def __init__(self, config):
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.num_experts = config.n_routed_experts
        self.scale = config.routed_scaling_factor
        self.weight = nn.Parameter(torch.empty(config.n_routed_experts, config.hidden_size))
        self.register_buffer("e_score_correction_bias", torch.zeros(config.n_routed_experts))

    def forward(self, x):
        logits = F.linear(x.float(), self.weight.float())  # [T, E]
        scores = logits.sigmoid()
        index = (scores + self.e_score_correction_bias.float()).topk(self.top_k, dim=-1).indices
        weights = scores.gather(-1, index)
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20) * self.scale
        return logits, weights, index


@use_experts_implementation
class RefMoeExperts(nn.Module):
    """Routed experts as fused tensors, computing in the latent width L (< hidden)."""

    def __init__(self, config):
        super().__init__()
        self.num_experts = config.n_routed_experts
        self.hidden_dim = config.expert_latent_size
        self.intermediate_dim = config.moe_intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(self.num_experts, 2 * self.intermediate_dim, self.hidden_dim))
        self.down_proj = nn.Parameter(torch.empty(self.num_experts, self.hidden_dim, self.intermediate_dim))
        self.act_fn = nn.SiLU()

    def forward(self, hidden_states, top_k_index, top_k_weights):
        # reference form: gather each (token, choice)'s expert weights and multiply in one batch
        flat = top_k_index.reshape(-1)  # [T*K]
        x = hidden_states.repeat_interleave(top_k_index.shape[1], dim=0)  # [T*K, L]
        gate, up = torch.bmm(self.gate_up_proj[flat], x[..., None]).squeeze(-1).chunk(2, dim=-1)
        y = torch.bmm(self.down_proj[flat], (self.act_fn(gate) * up)[..., None]).squeeze(-1)
        y = y * top_k_weights.reshape(-1, 1).to(y.dtype)
        return y.view(*top_k_index.shape, -1).sum(1)  # [T, L]


class RefMoeSparseBlock(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.gate = RefMoeRouter(config)
        self.latent_down = nn.Linear(config.hidden_size, config.expert_latent_size, bias=False)
        self.experts = RefMoeExperts(config)
        self.latent_up = nn.Linear(config.expert_latent_size, config.hidden_size, bias=False)
        self.shared_experts = RefMoeMLP(config.hidden_size, config.moe_intermediate_size * config.n_shared_experts)

    def forward(self, x):
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        _, weights, index = self.gate(flat)
        routed = self.latent_up(self.experts(self.latent_down(flat), index, weights))
        return (routed + self.shared_experts(flat)).view(shape)


class RefMoeDecoderLayer(GradientCheckpointingLayer):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.layer_type = config.layer_types[layer_idx]
        self.input_layernorm = RefMoeRMSNorm(config.hidden_size, config.rms_norm_eps)
        if self.layer_type == "linear_attention":
            self.linear_attn = RefMoeLinearAttention(config, layer_idx)
        else:
            self.self_attn = RefMoeLatentAttention(config, layer_idx)
        self.post_attention_layernorm = RefMoeRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = RefMoeSparseBlock(config)

    def forward(self, hidden_states, attention_mask=None, position_ids=None, past_key_values=None,
                pad_mask=None, **kwargs):
        h = self.input_layernorm(hidden_states)
        if position_ids is None:
            position_ids = torch.arange(h.shape[1], device=h.device)[None].expand(h.shape[0], -1)
        if self.layer_type == "linear_attention":
            h = self.linear_attn(h, pad_mask, past_key_values)
        else:
            if attention_mask is None:
                attention_mask = _causal_mask(None, h.shape[1], 0, h.dtype, h.device)
            h = self.self_attn(h, position_ids, attention_mask, past_key_values)
        hidden_states = hidden_states + h
        return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))


def _causal_mask(pad_mask, t, past, dtype, device):
    """Additive [B or 1, 1, T, past+T] mask: causal, and padding (0 in pad_mask) hidden."""
    keys = torch.arange(past + t, device=device)
    allowed = keys[None, :] <= (past + torch.arange(t, device=device))[:, None]  # [T, S]
    allowed = allowed[None, None]
    if pad_mask is not None:
        allowed = allowed & pad_mask[:, None, None, -(past + t):].bool()
    return torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill(~allowed, torch.finfo(dtype).min)


class RefMoeVisionTower(nn.Module):
    """Patches [P, C*T*p*p] -> a few transformer blocks within each image -> 2x2 merge -> hidden."""

    def __init__(self, config):
        super().__init__()
        vc = config.vision_config
        width, self.merge = vc.get("hidden_size", 32), vc.get("spatial_merge_size", 2)
        patch = vc.get("in_channels", 3) * vc.get("temporal_patch_size", 2) * vc.get("patch_size", 8) ** 2
        self.heads = vc.get("num_heads", 2)
        self.patch_embed = nn.Linear(patch, width, bias=False)
        self.blocks = nn.ModuleList(RefMoeVisionBlock(width, self.heads) for _ in range(vc.get("depth", 1)))
        self.merger = nn.Sequential(nn.LayerNorm(width * self.merge ** 2),
                                    nn.Linear(width * self.merge ** 2, config.hidden_size), nn.GELU(),
                                    nn.Linear(config.hidden_size, config.hidden_size))

    def forward(self, pixel_values, grid_thw):
        x = self.patch_embed(pixel_values.to(self.patch_embed.weight.dtype))
        sizes = grid_thw.prod(-1).tolist()
        image = torch.repeat_interleave(torch.arange(len(sizes), device=x.device),
                                        torch.tensor(sizes, device=x.device))
        same = image[:, None] == image[None, :]  # attention stays inside one image
        mask = torch.zeros(same.shape, dtype=x.dtype, device=x.device).masked_fill(~same, torch.finfo(x.dtype).min)
        for block in self.blocks:
            x = block(x, mask)
        return self.merger(x.reshape(-1, x.shape[-1] * self.merge ** 2))


class RefMoeVisionBlock(nn.Module):
    def __init__(self, width, heads):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.fc1, self.fc2 = nn.Linear(width, 2 * width), nn.Linear(2 * width, width)

    def forward(self, x, mask):
        p, w = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(p, 3, self.heads, -1).permute(1, 2, 0, 3)
        att = torch.softmax((q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1]) + mask, dim=-1) @ v
        x = x + self.proj(att.transpose(0, 1).reshape(p, w))
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x))))


class RefMoePreTrainedModel(PreTrainedModel):
    config_class = RefMoeConfig
    config: RefMoeConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["RefMoeDecoderLayer", "RefMoeVisionBlock"]
    _is_stateful = True  # linear-attention layers keep a recurrent state

    def _init_weights(self, module):
        super()._init_weights(module)
        std = self.config.initializer_range
        if isinstance(module, RefMoeExperts):
            nn.init.normal_(module.gate_up_proj, std=std)
            nn.init.normal_(module.down_proj, std=std)
        elif isinstance(module, RefMoeRouter):
            nn.init.normal_(module.weight, std=std)
            module.e_score_correction_bias.zero_()
        elif isinstance(module, RefMoeLinearAttention):
            with torch.no_grad():
                module.decay.copy_(torch.linspace(1.0, 4.0, module.heads))
        elif isinstance(module, RefMoeRMSNorm):
            nn.init.ones_(module.weight)


class RefMoeTextModel(RefMoePreTrainedModel):
    def __init__(self, config):
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(RefMoeDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RefMoeRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.gradient_checkpointing = False
        self.post_init()

    def forward(self, input_ids=None, inputs_embeds=None, attention_mask=None, position_ids=None,
                past_key_values=None, use_cache=None, **kwargs):
        h = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        b, t = h.shape[:2]
        if use_cache and past_key_values is None:
            past_key_values = DynamicCache(config=self.config)
        past = past_key_values.get_seq_length() if past_key_values is not None else 0
        if position_ids is None:
            position_ids = (past + torch.arange(t, device=h.device))[None].expand(b, -1)
        pad_mask = attention_mask if attention_mask is not None and attention_mask.dim() == 2 else None
        mask = _causal_mask(pad_mask, t, past, h.dtype, h.device)
        step_pad = pad_mask[:, -t:] if pad_mask is not None else None
        for layer in self.layers:
            h = layer(h, attention_mask=mask, position_ids=position_ids, past_key_values=past_key_values,
                      pad_mask=step_pad)
        return self.norm(h), past_key_values


class RefMoeModel(RefMoePreTrainedModel):
    def __init__(self, config):
        super().__init__(config)
        self.language_model = RefMoeTextModel(config)
        self.visual = RefMoeVisionTower(config)
        self.post_init()

    def get_image_features(self, pixel_values, image_grid_thw):
        return self.visual(pixel_values, image_grid_thw)

    def forward(self, input_ids=None, inputs_embeds=None, pixel_values=None, image_grid_thw=None, **kwargs):
        if inputs_embeds is None:
            inputs_embeds = self.language_model.embed_tokens(input_ids)
        slots = input_ids == self.config.image_token_id if input_ids is not None else None
        if pixel_values is not None and slots is not None and slots.any():  # decode steps have none
            images = self.get_image_features(pixel_values, image_grid_thw).to(inputs_embeds.dtype)
            if int(slots.sum()) != images.shape[0]:
                raise ValueError(f"{int(slots.sum())} image tokens in the prompt, {images.shape[0]} "
                                 "image features")
            inputs_embeds = inputs_embeds.masked_scatter(slots[..., None].expand_as(inputs_embeds), images)
        return self.language_model(inputs_embeds=inputs_embeds, **kwargs)


class RefMoeForConditionalGeneration(RefMoePreTrainedModel, GenerationMixin):
    _tied_weights_keys = {}

    def __init__(self, config):
        super().__init__(config)
        self.model = RefMoeModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self):
        return self.model.language_model.embed_tokens

    def set_input_embeddings(self, value):
        self.model.language_model.embed_tokens = value

    def get_output_embeddings(self):
        return self.lm_head

    def get_image_features(self, pixel_values, image_grid_thw=None, **kwargs):
        return self.model.get_image_features(pixel_values, image_grid_thw)

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                inputs_embeds=None, labels=None, use_cache=None, pixel_values=None, image_grid_thw=None,
                logits_to_keep=0, **kwargs):
        hidden, cache = self.model(input_ids=input_ids, inputs_embeds=inputs_embeds, pixel_values=pixel_values,
                                   image_grid_thw=image_grid_thw, attention_mask=attention_mask,
                                   position_ids=position_ids, past_key_values=past_key_values,
                                   use_cache=use_cache)
        keep = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
        logits = self.lm_head(hidden[:, keep, :])
        loss = None
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs)
        return CausalLMOutputWithPast(loss=loss, logits=logits, past_key_values=cache)


__all__ = ["RefMoeForConditionalGeneration", "RefMoeModel", "RefMoeTextModel", "RefMoePreTrainedModel"]
