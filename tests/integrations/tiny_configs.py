"""The tiny model configs the integration tests build from transformers' Config classes: one
shared base, and DeepSeek's latent attention and routing settings, which each test file sizes."""

VOCAB = 128
TINY = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    pad_token_id=0,
    # Weights large enough that attention is sharp: every feature then moves the logits far past
    # the disagreement of two correct implementations (1e-6 in float32, about 1e-2 in bf16).
    initializer_range=0.2,
)
# YaRN's mscale makes DeepSeek's module scaling differ from 1/sqrt(q/k head dim).
YARN = {
    "rope_type": "yarn",
    "factor": 4.0,
    "original_max_position_embeddings": 64,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
    "rope_theta": 10000.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
}


def deepseek(**head_dims) -> dict:
    """DeepSeek's overrides (multi-head latent attention, decompressed, and MoE) at the given
    lora ranks and head dims."""
    return dict(
        rope_parameters=YARN,
        **head_dims,
        n_routed_experts=4,
        # Every expert on every token: a top-2 routing turns two backends' rounding into a
        # different expert for a token (a logits difference no attention tolerance covers).
        num_experts_per_tok=4,
        moe_intermediate_size=32,
        n_shared_experts=1,
        n_group=1,
        topk_group=1,
        first_k_dense_replace=1,
        num_key_value_heads=4,
    )
