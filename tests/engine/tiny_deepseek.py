"""Tiny random-weight DeepSeek-V2 and V3 models from transformers' own config classes (seeded):
three layers, the first dense and the others MoE, small ranks and expert counts, saved as HF
folders that kvserve and transformers both load. Weights are redrawn (norms and the V3
correction bias included, which transformers initialises to ones and zeros) so every parameter
matters to the output."""

from __future__ import annotations

from pathlib import Path

import torch

COMMON = dict(
    vocab_size=97, hidden_size=64, intermediate_size=96, moe_intermediate_size=24, num_hidden_layers=3,
    num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=24,
    v_head_dim=20, first_k_dense_replace=1, max_position_embeddings=256, rms_norm_eps=1e-6,
    bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
)
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64,
        "mscale": 0.707, "mscale_all_dim": 0.707, "beta_fast": 32, "beta_slow": 1}

VARIANTS = {
    # V2-Lite's shape: a plain q projection, softmax routing over all experts, 2 shared experts.
    "v2-lite": ("DeepseekV2Config", "DeepseekV2ForCausalLM", dict(
        q_lora_rank=None, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=2, topk_method="greedy",
        n_group=1, topk_group=1, norm_topk_prob=False, routed_scaling_factor=1.0, rope_parameters=YARN)),
    # V2 with q LoRA and group-limited routing (4 groups, the best 2).
    "v2": ("DeepseekV2Config", "DeepseekV2ForCausalLM", dict(
        q_lora_rank=40, n_routed_experts=8, num_experts_per_tok=3, n_shared_experts=1,
        topk_method="group_limited_greedy", n_group=4, topk_group=2, norm_topk_prob=False,
        routed_scaling_factor=1.5, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})),
    # V3: q LoRA, sigmoid scoring with the correction bias, grouped top-k, normalised weights.
    "v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM", dict(
        q_lora_rank=40, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, n_group=4, topk_group=2,
        norm_topk_prob=True, routed_scaling_factor=2.5, rope_parameters=YARN, rope_interleave=True)),
}


def write_tiny_deepseek(path: Path, variant: str, seed: int = 0) -> Path:
    import transformers

    config_class, model_class, options = VARIANTS[variant]
    torch.manual_seed(seed)
    config = getattr(transformers, config_class)(**COMMON, **options)
    model = getattr(transformers, model_class)(config).eval()
    with torch.no_grad():
        for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
            if "inv_freq" in name:
                continue
            if name.endswith("norm.weight"):
                tensor.copy_(1 + 0.2 * torch.randn_like(tensor))
            elif "e_score_correction_bias" in name:
                tensor.copy_(0.1 * torch.randn_like(tensor))
            else:
                tensor.normal_(0.0, 0.15 if tensor.dim() > 1 and tensor.shape[-1] >= 32 else 0.3)
    model.save_pretrained(path)
    return path


def write_tiny_deepseek_gguf(path: Path, hf_folder: Path, split_kv_b: bool) -> Path:
    """The same weights as llama.cpp's converter lays out `deepseek2`: experts stacked in one
    [experts, out, in] tensor per projection, and (newer converters, `split_kv_b`) kv_b_proj
    split per head into attn_k_b ([heads, latent, nope], transposed) and attn_v_b."""
    import json

    import gguf
    import numpy as np
    from safetensors.numpy import load_file

    config = json.loads((hf_folder / "config.json").read_text())
    weights = load_file(hf_folder / "model.safetensors")
    heads, nope, v_dim = config["num_attention_heads"], config["qk_nope_head_dim"], config["v_head_dim"]
    latent, rope_dim = config["kv_lora_rank"], config["qk_rope_head_dim"]
    writer = gguf.GGUFWriter(path, "deepseek2")
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_rope_freq_base(config["rope_parameters"]["rope_theta"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_vocab_size(config["vocab_size"])
    writer.add_eos_token_id(config["eos_token_id"])
    if config.get("q_lora_rank"):
        writer.add_q_lora_rank(config["q_lora_rank"])
    writer.add_kv_lora_rank(latent)
    writer.add_rope_dimension_count(rope_dim)
    if split_kv_b:  # the MLA sizes move to *_mla; key/value lengths become the latent's
        writer.add_head_count_kv(1)
        writer.add_key_length(latent + rope_dim)
        writer.add_value_length(latent)
        writer.add_key_length_mla(nope + rope_dim)
        writer.add_value_length_mla(v_dim)
    else:
        writer.add_head_count_kv(heads)
        writer.add_key_length(nope + rope_dim)
        writer.add_value_length(v_dim)
    writer.add_leading_dense_block_count(config["first_k_dense_replace"])
    writer.add_expert_count(config["n_routed_experts"])
    writer.add_expert_used_count(config["num_experts_per_tok"])
    writer.add_expert_shared_count(config["n_shared_experts"])
    writer.add_expert_feed_forward_length(config["moe_intermediate_size"])
    writer.add_expert_weights_scale(config["routed_scaling_factor"])
    v3 = config["model_type"] == "deepseek_v3"
    writer.add_expert_weights_norm(bool(config.get("norm_topk_prob", False)) if v3 else False)
    writer.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID if v3 else gguf.ExpertGatingFuncType.SOFTMAX)
    if config.get("n_group", 1) and config.get("n_group", 1) > 1:
        writer.add_expert_group_count(config["n_group"])
        writer.add_expert_group_used_count(config["topk_group"])
    rope = config["rope_parameters"]
    if rope.get("rope_type") == "yarn":
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(rope["factor"])
        writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        writer.add_rope_scaling_yarn_log_mul(0.1 * rope["mscale_all_dim"])
    names = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
             "self_attn.q_a_proj": "attn_q_a", "self_attn.q_a_layernorm": "attn_q_a_norm", "self_attn.q_b_proj": "attn_q_b",
             "self_attn.kv_a_proj_with_mqa": "attn_kv_a_mqa", "self_attn.kv_a_layernorm": "attn_kv_a_norm",
             "self_attn.kv_b_proj": "attn_kv_b", "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate",
             "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down", "mlp.gate": "ffn_gate_inp",
             "mlp.shared_experts.gate_proj": "ffn_gate_shexp", "mlp.shared_experts.up_proj": "ffn_up_shexp",
             "mlp.shared_experts.down_proj": "ffn_down_shexp"}
    experts: dict[str, dict[int, np.ndarray]] = {}
    for name, array in weights.items():
        if name == "model.embed_tokens.weight":
            writer.add_tensor("token_embd.weight", array)
            continue
        if name in ("model.norm.weight", "lm_head.weight"):
            writer.add_tensor("output_norm.weight" if name == "model.norm.weight" else "output.weight", array)
            continue
        _, _, layer, rest = name.split(".", 3)
        module, suffix = rest.rsplit(".", 1)
        if module.startswith("mlp.experts."):
            _, _, expert, projection = module.split(".")
            experts.setdefault(f"blk.{layer}.ffn_{projection.removesuffix('_proj')}_exps.weight", {})[int(expert)] = array
        elif suffix == "e_score_correction_bias":
            writer.add_tensor(f"blk.{layer}.exp_probs_b.bias", array)
        elif module == "self_attn.kv_b_proj" and split_kv_b:
            kv_b = array.reshape(heads, nope + v_dim, latent)
            writer.add_tensor(f"blk.{layer}.attn_k_b.weight", np.ascontiguousarray(kv_b[:, :nope].transpose(0, 2, 1)))
            writer.add_tensor(f"blk.{layer}.attn_v_b.weight", np.ascontiguousarray(kv_b[:, nope:]))
        else:
            writer.add_tensor(f"blk.{layer}.{names[module]}.{suffix}", array)
    for gguf_name, by_expert in experts.items():
        writer.add_tensor(gguf_name, np.stack([by_expert[e] for e in sorted(by_expert)]))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
