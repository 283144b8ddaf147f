"""A literate hybrid language model: Gated DeltaNet + Multi-Head Latent Attention + DeepSeek-style MoE + multi-token prediction, derived in notebooks and trained with FSDP-2.

Modules:

- `hymo.models.moe`: Shared and routed SwiGLU experts, top-k routing in fp32, grouped dispatch, capacity with counted drops, and load balancing without an auxiliary loss (a gate bias steered by expert load).
- `hymo.training.data`: Text in, token shards out, and a loader that hands every rank its own windows in an order that survives a restart."""

__version__ = "0.1.0"
