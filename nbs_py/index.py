# %% [markdown]
# # HyMo
#
# > A hybrid language model you can read, check and train: Gated DeltaNet, Multi-Head Latent Attention, DeepSeek-style MoE and multi-token prediction, derived step by step.

# %% [markdown]
# HyMo is a literate codebase. Each chapter is a notebook that derives one mechanism from first
# principles, checks every step numerically, and exports the final version into the `hymo`
# package. The package is a real training stack: a chunked Triton kernel for the gated delta rule
# (forward and backward), the 3:1 hybrid model (24 Gated DeltaNet blocks with dense SwiGLU FFNs,
# 8 Multi-Head Latent Attention blocks with a mixture of experts), NorMuon + AdamW with a
# warmup-stable-decay schedule, and an FSDP-2 trainer.
#
# ## Reading order
#
# | Part | Chapters |
# |--|----------|
# | Foundations | [configuration](00_config.ipynb); [shared layers](01_layers.ipynb) (RMSNorm, SwiGLU) |
# | Linear attention | [linear attention](10_linear_attention.ipynb); [the delta rule](11_delta_rule.ipynb) and [the gated delta rule, its chunked WY form and the GDN block](12_gated_deltanet.ipynb); the Triton kernels [for the rule](13_gdn_triton.ipynb) and [for the prelude](14_gdn_conv_triton.ipynb) (short conv, SiLU, norm) |
# | Attention | [RoPE and partial RoPE](20_rope.ipynb); [Multi-Head Latent Attention](21_mla.ipynb) and its latent KV cache |
# | Sparsity | [DeepSeek-style MoE](30_moe.ipynb) and aux-loss-free load balancing |
# | The model | [multi-token prediction](40_mtp.ipynb); [the hybrid model](41_model.ipynb) and its accounting; [the loss's softmax pass as a Triton kernel](42_ce_triton.ipynb) |
# | Training | [optimisers](50_optim.ipynb) (NorMuon, AdamW, cautious weight decay, WSD); [data](60_data.ipynb) and [its `prepare` command](61_data_cli.ipynb); [the trainer](70_trainer.ipynb); [`python -m hymo.train`](71_train.ipynb); [generating text from a run](72_generate.ipynb) |
# | Results | [the `hymo_750m` preset's training step](80_results.ipynb) (1.24 B parameters stored, 0.54 B active) on one H200 (and, in later rounds, H100s): throughput, MFU, memory, and what was tried |
#
# Every chapter ends with interview questions whose answers are folded: try before you open them.
# (The results page is a lab notebook, not a chapter, and has none.)
#
# ## Install
#
# ```sh
# pip install torch==2.13.0   # or any torch >= 2.11 with CUDA on a GPU machine
# # or: pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu   # a machine without a GPU: the CPU build, not GBs of CUDA
# pip install -e ".[dev]"
# ```
#
# ## Test
#
# ```sh
# nbdev-test && pytest
# ```
#
# nbdev 3 names its commands with hyphens (`nbdev-test`, `nbdev-export`); the underscore names
# (`nbdev_test`) belong to nbdev 2. Its settings live in `[tool.nbdev]` of `pyproject.toml`:
# nbdev 3 refuses a `settings.ini`.
#
# ## Train
#
# ```sh
# python -m hymo.train                      # hymo_tiny on the bundled Shakespeare, CPU, minutes
# torchrun --nproc_per_node 8 -m hymo.train --config hymo_750m data_dir=...   # the full run
# python -m hymo.generate runs/hymo_tiny-... --prompt "JULIET:"   # continue a prompt with a finished run's model
# ```
#
# ## Workshop slides
#
# Four reveal.js decks teach the material, each covering a few chapters, with interview
# questions whose answers appear on the next click:
#
# - [From linear attention to Gated DeltaNet](slides/01_linear_attention_gdn.html): part 1, the 24 recurrent blocks
# - [Multi-Head Latent Attention](slides/02_mla.html): part 2, the 8 attention blocks and their cache
# - [Mixture of experts and multi-token prediction](slides/03_moe_mtp.html): part 3, sparse feed-forwards and extra targets
# - [Training HyMo](slides/04_training.html): part 4, the hybrid stack, NorMuon, the schedule and FSDP-2
#
# ## A first look
#
# The configuration is plain data. The architecture is the list of block kinds:

# %%
from hymo.config import load_config

# %%
cfg = load_config("hymo_750m")
print(" ".join(t.upper() for t in cfg.model.layer_types))
