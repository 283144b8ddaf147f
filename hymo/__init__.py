"""A literate hybrid language model: Gated DeltaNet + Multi-Head Latent Attention + DeepSeek-style MoE + multi-token prediction, derived in notebooks and trained with FSDP-2."""

__version__ = "0.1.0"
