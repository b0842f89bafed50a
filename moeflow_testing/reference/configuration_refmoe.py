"""Configuration of the reference-shape debug model (remote code shipped with its checkpoint).

The shape of the 2.8T reference model, shrunk in width and depth only:
many routed experts with a large top-k and shared experts beside them,
linear-attention token mixers interleaved with multi-head latent attention
(three to one), routed experts that compute in a latent width narrower than
the hidden size, and a small vision tower whose merged patches become image
tokens of the language model. This file travels inside the checkpoint and is
loaded by transformers' `auto_map` when the user opts in to remote code.
"""

from transformers import PretrainedConfig


class RefMoeConfig(PretrainedConfig):
    model_type = "moeflow_refmoe"
    keys_to_ignore_at_inference = ["past_key_values"]

    def __init__(self, vocab_size=512, hidden_size=64, num_hidden_layers=4, layer_types=None,
                 num_attention_heads=4, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16,
                 qk_rope_head_dim=8, v_head_dim=16, linear_num_heads=4, linear_head_dim=16,
                 linear_conv_kernel=4, n_routed_experts=896, num_experts_per_tok=16,
                 n_shared_experts=2, moe_intermediate_size=32, expert_latent_size=32,
                 routed_scaling_factor=1.0, rms_norm_eps=1e-6, max_position_embeddings=512,
                 rope_theta=10000.0, vision_config=None, image_token_id=None,
                 vision_start_token_id=None, vision_end_token_id=None, video_token_id=None,
                 initializer_range=0.02, tie_word_embeddings=False, **kwargs):
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.num_hidden_layers = num_hidden_layers
        # three linear-attention layers, then one MLA layer ("full_attention": it keeps a KV cache)
        self.layer_types = layer_types or [
            "full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(num_hidden_layers)]
        self.num_attention_heads = num_attention_heads
        self.q_lora_rank = q_lora_rank
        self.kv_lora_rank = kv_lora_rank
        self.qk_nope_head_dim = qk_nope_head_dim
        self.qk_rope_head_dim = qk_rope_head_dim
        self.qk_head_dim = qk_nope_head_dim + qk_rope_head_dim
        self.v_head_dim = v_head_dim
        self.linear_num_heads = linear_num_heads
        self.linear_head_dim = linear_head_dim
        self.linear_conv_kernel = linear_conv_kernel
        self.n_routed_experts = n_routed_experts
        self.num_experts_per_tok = num_experts_per_tok
        self.n_shared_experts = n_shared_experts
        self.moe_intermediate_size = moe_intermediate_size
        self.expert_latent_size = expert_latent_size
        self.routed_scaling_factor = routed_scaling_factor
        self.rms_norm_eps = rms_norm_eps
        self.max_position_embeddings = max_position_embeddings
        self.rope_theta = rope_theta
        self.vision_config = dict(vision_config or {})
        self.image_token_id = image_token_id
        self.vision_start_token_id = vision_start_token_id
        self.vision_end_token_id = vision_end_token_id
        self.video_token_id = video_token_id
        self.initializer_range = initializer_range
        self.tie_word_embeddings = tie_word_embeddings
        super().__init__(tie_word_embeddings=tie_word_embeddings, **kwargs)
