# %% [markdown]
# # Configuration
#
# > One plain dataclass for the model, one for training, and YAML presets that override them.

# %%
#| default_exp config

# %% [markdown]
# Every value that shapes a HyMo run lives in one of two dataclasses. `ModelConfig` says what the
# network is; `TrainingConfig` says how it is trained. A *preset* is a YAML file shipped inside the
# package (`hymo/configs/*.yaml`) with two sections, `model:` and `train:`, each a set of overrides
# of the dataclass defaults. A run is a preset plus a few `key=value` overrides. There is nothing
# else: no registry, no lazily injected options, no `config.x.build()` trees. The origin of every
# value is the dataclass default, the preset, or your override.
#
# The defaults are the design document's "750M" model. The name is the design's, not a count: the
# built model stores 1.24 B parameters and uses 0.54 B per token (its 8 MoE layers hold 16 routed
# experts each, a token visits 2); chapter 41 counts them. The `hymo_tiny` preset shrinks the
# model's widths, depth, head counts, vocabulary and context (not its GDN head sizes or chunk) so that the notebooks, the tests and `python -m hymo.train` run on a laptop CPU.

# %%
#| export
from __future__ import annotations

import dataclasses
import datetime
import difflib
import json
import math
import numbers
import os
import re
import shlex
import typing
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Optional

import yaml

# %%
import numpy as np
from fastcore.test import test_eq, test_fail

# %% [markdown]
# ## The model
#
# Every field carries a one-line comment (a *docment*), which nbdev renders as the parameter table
# below. The field names are prefixed by the part of the model they configure (`gdn_`, `mla_`,
# `moe_`, `mtp_`), so that a flat `key=value` override is never ambiguous.

# %%
#| export
TRITON_CHUNK = 64  # The chunk length the Triton GDN kernels are written for (chapter 13's BT)


@dataclass
class ModelConfig:
    "The architecture of a HyMo model; the defaults are the 750M design."
    vocab_size: int = 64256  # Tokens in the vocabulary: embedding rows, also the tied output head
    dim: int = 896  # Width of the residual stream
    n_layers: int = 32  # Number of blocks, GDN and MLA together
    mla_every: int = 4  # Every `mla_every`-th block is MLA + MoE, the others GDN + SwiGLU (4 gives 3:1; 0: GDN only)
    norm_eps: float = 1e-6  # Epsilon of every RMSNorm
    max_seq_len: int = 4096  # Longest sequence (or packed document) the model accepts; RoPE positions stay below it
    init_std: float = 0.02  # Standard deviation of the embedding and hidden matrix initialisation
    # Gated DeltaNet blocks
    gdn_n_heads: int = 40  # GDN heads per block
    gdn_head_k_dim: int = 32  # Key/query size per head: rows K of the state S ∈ R^{K×V}
    gdn_head_v_dim: int = 32  # Value size per head: columns V of the state
    gdn_conv_size: int = 4  # Kernel width of the causal depthwise convolution on q, k, v
    gdn_chunk_size: int = 64  # Chunk length of the chunked (WY) algorithm; the Triton kernels run 64 only
    gdn_kernel: str = "auto"  # GDN implementation: 'auto' (Triton on CUDA, else torch), 'triton', 'torch' or 'naive'
    ffn_inter_dim: int = 2560  # Hidden width of the dense SwiGLU FFN of every GDN block
    # Multi-Head Latent Attention blocks
    mla_n_heads: int = 16  # Query heads per MLA block
    mla_n_kv_groups: int = 4  # Key/value groups; must divide `mla_n_heads` (equal: DeepSeek-V3's MLA)
    mla_q_lora_rank: int = 224  # Rank of the low-rank query path; 0 projects queries directly
    mla_kv_lora_rank: int = 128  # d_c: size of the cached key/value latent c_kv
    mla_qk_nope_dim: int = 96  # Per-head query/key dimensions without rotary position
    mla_qk_rope_dim: int = 32  # Per-head query/key dimensions with rotary position (shared key)
    mla_v_head_dim: int = 128  # Per-head value size
    rope_theta: float = 10000.0  # RoPE base frequency
    nope_layers: tuple[int, ...] = ()  # Block indices of MLA blocks that skip RoPE (the NoPE ablation)
    # DeepSeek-style mixture of experts (on MLA blocks)
    moe_n_routed: int = 16  # Routed experts per MoE layer
    moe_n_shared: int = 1  # Always-on shared experts per MoE layer
    moe_top_k: int = 2  # Routed experts each token is sent to
    moe_inter_dim: int = 2304  # Hidden width of every expert's SwiGLU
    moe_capacity_factor: Optional[float] = 1.5  # Per-expert token cap as a multiple of the mean load (below 1 drops even at an even load); None is dropless
    moe_score_func: str = "softmax"  # Router scores: 'softmax' (the design document) or 'sigmoid' (DeepSeek-V3)
    moe_route_scale: float = 1.0  # Routed scaling factor: the routed experts' weights times this (DeepSeek-V3: 2.5, V2: 16)
    moe_balance: str = "ema"  # Gate-bias balancing: 'ema' (HyMo), 'sign' (DeepSeek-V3) or 'none'
    moe_bias_speed: float = 0.001  # Step of each gate-bias update
    moe_ema_decay: float = 0.98  # Decay of the EMA of per-expert token counts
    moe_dead_band: float = 0.05  # No bias update while an expert's EMA load is within ±this fraction of the mean
    # Multi-token prediction
    mtp_depth: int = 2  # Extra prediction heads: head k predicts token t+1+k
    mtp_loss_weights: tuple[float, ...] = (0.3, 0.1)  # Loss weight of each MTP head
    mtp_inter_dim: int = 2304  # Hidden width of each MTP head

    def is_mla(self, i: int) -> bool:
        "Is block `i` (0-based) an MLA block? Blocks `mla_every-1, 2*mla_every-1, ...` are (none when `mla_every` is 0)."
        return self.mla_every > 0 and (i + 1) % self.mla_every == 0

    @property
    def layer_types(self) -> list[str]:
        "The kind of every block, in order: 'gdn' or 'mla'."
        return ["mla" if self.is_mla(i) else "gdn" for i in range(self.n_layers)]


# %% [markdown]
# `layer_types` is the architecture at a glance: with the defaults, three GDN blocks then one MLA
# block, eight times over.

# %%
print(ModelConfig().layer_types[:8])
test_eq(ModelConfig().layer_types.count("mla"), 8)
test_eq(ModelConfig().layer_types.count("gdn"), 24)


# %% [markdown]
# ## Training

# %%
#| export
@dataclass
class TrainingConfig:
    "How a HyMo model is trained: data, batch, optimisers, schedule, checkpoints and logging."
    # Batch
    seq_len: int = 4096  # Tokens per training sequence
    micro_batch_size: int = 4  # Sequences per forward/backward on one rank
    global_batch_size: int = 128  # Sequences per optimiser step over all ranks; accumulation fills the gap
    max_steps: int = 57220  # Optimiser steps (hymo_750m's 57220 × 128 × 4096 ≈ 30 B tokens)
    # Optimisers (NorMuon for hidden matrices, AdamW for the rest)
    muon_lr: float = 0.02  # Peak learning rate of NorMuon
    muon_momentum: float = 0.95  # Nesterov momentum of NorMuon
    normuon_beta2: float = 0.95  # Decay of NorMuon's per-row second moment
    ns_steps: int = 5  # Newton–Schulz iterations per orthogonalisation
    adamw_lr: float = 3e-3  # Peak learning rate of AdamW
    adamw_betas: tuple[float, ...] = (0.9, 0.95)  # AdamW (beta1, beta2)
    adamw_eps: float = 1e-8  # AdamW epsilon
    weight_decay: float = 0.1  # Decoupled weight decay of the matrices
    cautious_weight_decay: bool = True  # Decay only where the update and the parameter agree in sign
    grad_clip: float = 1.0  # Clip the global gradient norm to this; 0 disables
    # Warmup-stable-decay schedule
    warmup_steps: int = 2000  # Linear warmup steps
    decay_fraction: float = 0.2  # Fraction of `max_steps` spent in the final decay
    decay_shape: str = "1-sqrt"  # Shape of the decay: 'linear', '1-sqrt' or 'cosine'
    min_lr_ratio: float = 0.0  # Learning rate at the end, as a fraction of the peak
    # Data
    data_dir: Optional[str] = None  # Folder of prepared token shards; None prepares the bundled corpus
    doc_masking: bool = False  # Keep documents apart inside a window (cu_seqlens for GDN, MLA and the MTP targets)
    # Loop, evaluation, checkpoints
    seed: int = 0  # Seed of initialisation, data order and sampling
    log_every: int = 10  # Steps between metric lines
    eval_every: int = 1000  # Steps between validation passes; 0: only the final one, at the end of the run
    eval_batches: int = 20  # Micro-batches per validation pass: eval_batches × micro_batch_size windows
    ckpt_every: int = 1000  # Steps between checkpoints; 0 saves only at the end
    keep_last_k: int = 3  # Checkpoints kept in the run folder, besides the newest from before the decay (one more; ~10 GB at 750M)
    max_bad_steps: int = 5  # Consecutive non-finite steps tolerated before the run stops
    sample_tokens: int = 200  # Tokens generated as a sample at the end of the run (0: no sample)
    sample_prompt: Optional[str] = None  # Text the end-of-run sample continues ('': a document's start); None: ROMEO: on the bundled corpus, else ''
    run_dir: Optional[str] = None  # Run folder; None makes runs/<preset>-<timestamp>
    # Systems
    precision: str = "auto"  # 'auto' (bf16 on CUDA, fp32 on CPU), 'bf16' or 'fp32'
    activation_checkpointing: bool = False  # Recompute each block's activations in backward
    compile: bool = True  # torch.compile each block (hymo_tiny turns it off: on a CPU the compile costs more than a short run saves)
    wandb: bool = False  # Log to Weights & Biases (offline unless you are logged in; WANDB_MODE decides where set)
    wandb_project: str = "hymo"  # W&B project name

    @property
    def decay_steps(self) -> int:
        "The WSD decay's length D: round(decay_fraction · max_steps), and at least one step when decay_fraction > 0."
        return max(1, round(self.decay_fraction * self.max_steps)) if self.decay_fraction > 0 else 0

    @property
    def prompt(self) -> str:
        "The end-of-run sample's prompt (and `python -m hymo.generate`'s default): `sample_prompt`, else 'ROMEO:' on the bundled corpus and a document's start ('') on other data."
        if self.sample_prompt is not None: return self.sample_prompt
        return "ROMEO:" if self.data_dir is None else ""


# %% [markdown]
# ## Validation
#
# A wrong config should fail at once, with a message that says what to do. Four kinds of mistake
# are caught: an unknown key (the message lists the valid keys and the closest one), a value of the
# wrong type (it names the expected type), a value out of its range, and sizes that cannot work
# together (it names both and why). The ranges matter because a bad number rarely fails where it
# is written: a NaN slips past every `x < 0` check, and a zero `norm_eps` divides by zero on the
# first all-zero row (a zero-initialised layer's output, a padded position), whose NaN then spreads
# through the run, which ends blaming the learning rate.
#
# `load_config` runs every check (`validate_config`), and each place a config is used runs the
# checks of its own part: the model (`HyMo`, chapter 41: `validate_model`), a lone MoE or MTP
# module (`validate_part`), `build_optimizers` (chapter 50: `validate_training`) and the `Trainer`
# (chapter 70: all of them). A
# config changed in code with `dataclasses.replace` skips `load_config`, and would otherwise train
# silently wrong: a micro-batch of 3 that does not divide a batch of 16 reads 15 sequences a step.

# %%
#| export
class ConfigError(ValueError):
    "A configuration that cannot be used; the message says which key and what to do."


_SCI = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+")  # a number in e-notation, such as 1e-3


def _check_type(name: str, value, tp):
    "Return `value` as type `tp` (ints are accepted as floats, lists as tuples), or raise `ConfigError`."
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is typing.Union:  # Optional[X]
        if value is None or value in ("none", "None"): return None  # the word, as a command line writes it
        inner = next(a for a in args if a is not type(None))
        if inner in (int, float) and isinstance(value, str) and value.strip().lstrip("+").lower() in ("inf", "infinity"):
            raise ConfigError(f"{name}={value}: for no limit write null (infinity is not a value here)")  # the MoE's cap
        return _check_type(name, value, inner)
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            listed = value[1:-1] if isinstance(value, str) and value[:1] + value[-1:] == "()" else value  # (0.9, 0.95)
            raise ConfigError(f"{name}: expected a list of {args[0].__name__}, got {type(value).__name__} {value!r}"
                              + (f"; write it as a list: [{listed}]" if isinstance(value, str) and "," in value else
                                 f"; write it as a list in brackets, [{value}, ...], as many values as it takes" if isinstance(value, (int, float))
                                 and not isinstance(value, bool) else ""))
        return tuple(_check_type(f"{name}[{i}]", v, args[0]) for i, v in enumerate(value))
    if getattr(value, "dtype", None) is not None and getattr(value, "ndim", None) == 0:  # a numpy scalar (a sweep's values)
        if value.dtype.kind == "b": value = bool(value)
        elif value.dtype.kind in "iu": value = int(value)
        elif value.dtype.kind == "f": value = float(str(value))  # float32's 0.02 stays 0.02, not 0.019999999552965164
    if tp is str and isinstance(value, os.PathLike): return os.fspath(value)  # data_dir=Path(...) from Python
    if isinstance(value, bool): pass  # a bool is an int to Python, never a number here
    elif tp is float and isinstance(value, numbers.Real):  # 3 is 3.0
        try: return float(value)
        except OverflowError: raise ConfigError(f"{name}={value}: too large for a float (at most about 1.8e308)") from None
    if tp is float and isinstance(value, str) and _SCI.fullmatch(value):
        return float(value)  # YAML 1.1 (PyYAML) reads 1e-3 as a string; it needs 1.0e-3
    if tp is int and isinstance(value, bool) or not isinstance(value, tp):
        raise ConfigError(f"{name}: expected {tp.__name__}, got {type(value).__name__} {value!r}{_type_hint(name, value, tp)}")
    return value


def _type_hint(name: str, value, tp) -> str:
    "The fix for the usual slips: a number where text is meant (off, read as False), a count written as a float, a 1,000."
    if tp is bool:  # compile=1, compile=y: YAML's true/false words are true, false, yes, no, on, off
        return "; write true or false"
    if name in CHOICES and (isinstance(value, (bool, int, float)) or value is None):  # moe_balance: off is YAML's False
        return (f"; choose one of {', '.join(map(repr, CHOICES[name]))}"
                + (" (off is the word none)" if (value is False or value is None) and "none" in CHOICES[name] else ""))
    if tp is str and isinstance(value, (int, float, datetime.date)):  # YAML reads run_dir: 2024 as a number, off as False
        return (f"; quote it ({name.split('.')[-1]}: '...' in a YAML file): unquoted, YAML reads numbers, dates and "
                f"yes/no/on/off as other types, and may change them (007 becomes 7)")
    if tp is str and value is None:  # moe_balance=None, meaning "off"
        return "; None and null are not text: give one of its values (off, where it can be, is the word none, lower case)"
    if tp is int and (isinstance(value, float) or isinstance(value, str) and _SCI.fullmatch(value)) and float(value).is_integer():
        return f"; write it as a whole number: {int(float(value))}"
    if tp in (int, float) and isinstance(value, str) and re.fullmatch(r"[-+]?\d{1,3}(,\d{3})+(\.\d*)?", value):  # 1,000
        return f"; write it without commas: {value.replace(',', '')} (or with underscores, {value.replace(',', '_')})"
    return ""


def _field_types(cls) -> dict:
    "Field name → resolved type annotation of dataclass `cls`."
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in fields(cls)}


# %% [markdown]
# The semantic checks. Each names the keys involved.

# %%
#| export
def _choice(name, value):
    if value not in CHOICES[name]: raise ConfigError(f"{name}={value!r}: choose one of {', '.join(map(repr, CHOICES[name]))}")


def _divides(a_name, a, b_name, b, why):
    if b % a: raise ConfigError(f"{b_name}={b} is not divisible by {a_name}={a}: {why}")


def _finite(sec, cfg):
    "Refuse NaN and ±inf in every float field and list item: NaN passes `x < 0` checks and inf passes `x > 0`."
    for name in _field_types(type(cfg)):
        v = getattr(cfg, name)
        for i, x in enumerate(v if isinstance(v, tuple) else (v,)):
            if isinstance(x, float) and not math.isfinite(x):
                raise ConfigError(f"{sec}.{name}{f'[{i}]' if isinstance(v, tuple) else ''}={x} must be a finite number")


def check_triton_chunk(chunk_size: int, # The configured gdn_chunk_size
                       kernel: str = "triton", # The configured gdn_kernel ('auto' picks Triton on a GPU)
                      ):
    "Raise `ConfigError` unless the Triton GDN kernels can run chunks of `chunk_size` tokens (only `TRITON_CHUNK`)."
    if chunk_size != TRITON_CHUNK:
        picked = " (which gdn_kernel: auto picks on a GPU)" if kernel == "auto" else ""
        raise ConfigError(f"gdn_chunk_size={chunk_size} but the Triton GDN kernels{picked} run chunks of {TRITON_CHUNK} only: "
                          f"set gdn_chunk_size: {TRITON_CHUNK}, or gdn_kernel: torch for the PyTorch chunked path")


def validate_model(m: ModelConfig):
    "Raise `ConfigError` if the sizes or values of `m` cannot build a model that trains."
    for name, tp in _field_types(ModelConfig).items():
        setattr(m, name, _check_type(f"model.{name}", getattr(m, name), tp))
    _finite("model", m)
    positive = ["vocab_size", "dim", "n_layers", "gdn_n_heads", "gdn_head_k_dim", "gdn_head_v_dim",
                "gdn_conv_size", "gdn_chunk_size", "ffn_inter_dim", "mla_n_heads", "mla_n_kv_groups",
                "mla_kv_lora_rank", "mla_qk_nope_dim", "mla_qk_rope_dim", "mla_v_head_dim", "moe_n_routed",
                "moe_top_k", "moe_inter_dim", "mtp_inter_dim", "max_seq_len",
                "norm_eps", "init_std", "rope_theta",  # 0 or less: NaN from the first norm or RoPE table, or no init
                "moe_route_scale"]  # 0: the routed experts silently switched off
    for name in positive:
        if getattr(m, name) <= 0: raise ConfigError(f"model.{name}={getattr(m, name)} must be positive")
    for name in ["mla_every", "mla_q_lora_rank", "moe_n_shared", "mtp_depth", "moe_bias_speed", "moe_dead_band"]:  # 0 turns each off
        if getattr(m, name) < 0: raise ConfigError(f"model.{name}={getattr(m, name)} must be 0 or more")
    if m.mla_every > m.n_layers:  # e.g. a shallow test model: not the hybrid, and nothing would say so
        raise ConfigError(f"model.n_layers={m.n_layers} with mla_every={m.mla_every} has no MLA block (blocks "
                          f"{m.mla_every - 1}, {2 * m.mla_every - 1}, … are): give n_layers ≥ {m.mla_every}, or a smaller "
                          f"mla_every; mla_every=0 asks for GDN blocks only")
    if m.moe_dead_band >= 1:
        raise ConfigError(f"model.moe_dead_band={m.moe_dead_band} must be below 1: at 1 an expert that gets no token is "
                          f"inside the band and its bias is never raised (moe_balance: none turns balancing off)")
    if m.moe_balance == "ema" and not 0 <= m.moe_ema_decay < 1:  # (unused by the other rules)
        raise ConfigError(f"model.moe_ema_decay={m.moe_ema_decay} must be in [0, 1): at 1 the load average never moves "
                          f"and the gate bias is never updated (moe_balance: none is the way to turn balancing off)")
    if any(w < 0 for w in m.mtp_loss_weights):
        raise ConfigError(f"model.mtp_loss_weights={list(m.mtp_loss_weights)} must be 0 or more: a negative weight trains against its head")
    _divides("model.mla_n_kv_groups", m.mla_n_kv_groups, "model.mla_n_heads", m.mla_n_heads,
             "every key/value group serves the same number of query heads")
    if m.mla_qk_rope_dim % 2: raise ConfigError(f"model.mla_qk_rope_dim={m.mla_qk_rope_dim} must be even: RoPE rotates pairs of dimensions")
    if m.moe_n_routed == 1:
        raise ConfigError("model.moe_n_routed=1: with one routed expert its weight is always 1, so the router gets no gradient "
                          "and routing chooses nothing; use 2 or more")
    if m.norm_eps < 1e-30:  # RMSNorm adds it in fp32, where below about 1e-45 it is 0: NaN again on an all-zero row
        raise ConfigError(f"model.norm_eps={m.norm_eps} must be at least 1e-30: RMSNorm adds it to a mean square in fp32, "
                          "where a value that small rounds to 0 (NaN on an all-zero row); the usual value is 1e-6")
    if m.rope_theta >= 3.4e38:  # fp32's largest number: the table's theta^(-2i/d) would be 0 past the first pair
        raise ConfigError(f"model.rope_theta={m.rope_theta} must be below 3.4e38 (fp32's largest number): the RoPE table "
                          "is computed in fp32, and above it every pair but the first stands still; the usual value is 10000")
    if m.rope_theta <= 1:
        raise ConfigError(f"model.rope_theta={m.rope_theta} must be above 1: the frequencies theta^(-2i/d) then fall from 1 rad per "
                          "token (at 1 they all are 1 rad, and below 1 they rise); the usual value is 10000")
    if m.moe_top_k > m.moe_n_routed:
        raise ConfigError(f"model.moe_top_k={m.moe_top_k} > model.moe_n_routed={m.moe_n_routed}: a token cannot pick more experts than exist")
    if len(m.mtp_loss_weights) != m.mtp_depth:
        fit = (list(m.mtp_loss_weights) + [0.1] * m.mtp_depth)[:m.mtp_depth]  # mtp_depth=0: []
        raise ConfigError(f"model.mtp_loss_weights has {len(m.mtp_loss_weights)} entries but model.mtp_depth={m.mtp_depth}: give one "
                          f"weight per MTP head, e.g. model.mtp_loss_weights=[{','.join(map(str, fit))}]")
    if m.moe_capacity_factor is not None and m.moe_capacity_factor <= 0:
        raise ConfigError(f"model.moe_capacity_factor={m.moe_capacity_factor} must be positive, or null for dropless routing")
    bad = [i for i in m.nope_layers if not (0 <= i < m.n_layers and m.is_mla(i))]
    if bad: raise ConfigError(f"model.nope_layers {bad} are not MLA blocks; MLA blocks are {[i for i in range(m.n_layers) if m.is_mla(i)]}")
    _choice("model.gdn_kernel", m.gdn_kernel)
    if m.gdn_kernel == "triton": check_triton_chunk(m.gdn_chunk_size)
    _choice("model.moe_score_func", m.moe_score_func)
    if m.moe_score_func == "sigmoid" and m.moe_top_k == 1 and m.moe_n_routed:
        raise ConfigError("model.moe_score_func='sigmoid' with model.moe_top_k=1 gives the router no gradient: the one "
                          "chosen expert's weight is normalised to exactly 1. Use moe_score_func='softmax', or moe_top_k=2 or more")
    _choice("model.moe_balance", m.moe_balance)
    return m


def validate_part(m: ModelConfig, # The config a module is built from
                  prefix: str, # The module's keys: 'moe_' or 'mtp_'
                 ) -> ModelConfig:
    "`m` with its `prefix` keys (and dim, init_std, norm_eps) checked as `validate_model` checks them; the other keys, which the module never reads, are not."
    own = {f: getattr(m, f) for f in _field_types(ModelConfig) if f.startswith(prefix) or f in ("dim", "init_std", "norm_eps")}
    checked = validate_model(ModelConfig(**own))  # the design defaults around them, which pass
    return dataclasses.replace(m, **{f: getattr(checked, f) for f in own})


DECAY_SHAPES = ("linear", "1-sqrt", "cosine")  # the WSD schedule's decays (chapter 50)
CHOICES = {"model.gdn_kernel": ("auto", "triton", "torch", "naive"), "model.moe_score_func": ("softmax", "sigmoid"),
           "model.moe_balance": ("ema", "sign", "none"), "train.decay_shape": DECAY_SHAPES,
           "train.precision": ("auto", "bf16", "fp32")}  # the settings that take one of a few words

def validate_training(t: TrainingConfig):
    "Raise `ConfigError` if `t` cannot drive a run."
    for name, tp in _field_types(TrainingConfig).items():
        setattr(t, name, _check_type(f"train.{name}", getattr(t, name), tp))
    _finite("train", t)
    for name in ["seq_len", "micro_batch_size", "global_batch_size", "max_steps", "ns_steps", "keep_last_k", "max_bad_steps"]:
        if getattr(t, name) <= 0: raise ConfigError(f"train.{name}={getattr(t, name)} must be positive")
    _divides("train.micro_batch_size", t.micro_batch_size, "train.global_batch_size", t.global_batch_size,
             "an optimiser step is a whole number of micro-batches")
    for name in ["warmup_steps", "eval_every", "ckpt_every", "sample_tokens", "grad_clip", "weight_decay", "seed"]:  # seed: NumPy refuses a negative one
        if getattr(t, name) < 0: raise ConfigError(f"train.{name}={getattr(t, name)} must be 0 or more")
    if t.seed >= 2**64: raise ConfigError(f"train.seed={t.seed} must be below 2**64 (torch's seeds are 64-bit)")
    for name in ["data_dir", "run_dir", "wandb_project"]:  # "" (a quoted empty value) would mean the default silently
        if getattr(t, name) is not None and not getattr(t, name).strip():
            raise ConfigError(f"train.{name}={getattr(t, name)!r} is empty: give a value"
                              + ("" if name == "wandb_project" else ", or null for the default"))
    for name in ["log_every", "eval_batches", "muon_lr", "adamw_lr"]:
        if not getattr(t, name) > 0: raise ConfigError(f"train.{name}={getattr(t, name)} must be positive")
    if not t.adamw_eps > 0:
        raise ConfigError(f"train.adamw_eps={t.adamw_eps} must be positive: at 0 a parameter without gradient (an unseen "
                          f"token's embedding row) becomes 0/0 = NaN, e.g. adamw_eps=1e-8")
    if len(t.adamw_betas) != 2: raise ConfigError(f"train.adamw_betas={t.adamw_betas}: give two numbers, (beta1, beta2)")
    for name, b in [("muon_momentum", t.muon_momentum), ("normuon_beta2", t.normuon_beta2),
                    ("adamw_betas[0]", t.adamw_betas[0]), ("adamw_betas[1]", t.adamw_betas[1])]:
        if not 0 <= b < 1: raise ConfigError(f"train.{name}={b} must be in [0, 1)")
    if not 0 <= t.min_lr_ratio <= 1: raise ConfigError(f"train.min_lr_ratio={t.min_lr_ratio} must be in [0, 1]: the decay ends at this fraction of the peak")
    if not 0 <= t.decay_fraction <= 1: raise ConfigError(f"train.decay_fraction={t.decay_fraction} must be in [0, 1]")
    name = max(("muon_lr", "adamw_lr"), key=lambda n: getattr(t, n))  # decoupled decay: weights × (1 − lr·weight_decay)
    if (lr := getattr(t, name)) * t.weight_decay >= 1:
        bound = 10 ** (math.floor(math.log10(1 / lr)) - 2)  # 1/lr rounded down to three digits: a bound that holds
        raise ConfigError(f"train.weight_decay={t.weight_decay} with train.{name}={lr}: each step would multiply the weights "
                          f"by 1 − {name}·weight_decay = {1 - lr * t.weight_decay:.3g}, "
                          f"{'zeroing' if lr * t.weight_decay == 1 else 'flipping'} them; give weight_decay < "
                          f"{math.floor(1 / lr / bound) * bound:.3g}, or check {name} (usual: muon_lr 0.02, adamw_lr 3e-3, "
                          f"weight_decay 0.1)")
    decay_start = t.max_steps - t.decay_steps  # as in the WSD schedule
    if t.warmup_steps > decay_start:
        raise ConfigError(f"train.warmup_steps={t.warmup_steps} runs into the decay, which starts at step {decay_start} "
                          f"= max_steps={t.max_steps} − {t.decay_steps} decay steps (decay_fraction={t.decay_fraction}): lower warmup_steps "
                          f"(e.g. warmup_steps={max(decay_start // 10, min(1, decay_start))}) or decay_fraction, or raise max_steps")
    _choice("train.decay_shape", t.decay_shape)
    _choice("train.precision", t.precision)
    return t


# %% [markdown]
# ## Presets and overrides
#
# `load_config` reads a preset by name (a file in `hymo/configs/`) or by path, then applies
# overrides. An override key is a field name, optionally prefixed by its section: `dim=64` and
# `model.dim=64` are the same, because no field name appears in both dataclasses.
#
# A YAML file of your own overrides the dataclass defaults, which are the 750M design. To change a
# few values of another preset instead, name it as the file's `base:` (a preset, or another YAML
# file, relative to this one): `base: hymo_tiny` and a `model:` section with `dim: 96` is hymo_tiny
# with a wider model. The base's values come first, the file's over them, the command line's last.
# A key written twice in one section is refused, with both its lines: plain YAML would keep the
# second without a word, so editing the first of two `adamw_lr:` lines would change nothing.
#
# A training checkpoint's folder (`RUN/checkpoints/step_N`, or its `meta.json`) is read as a config too: the settings
# its run trained with, which `meta.json` records (chapter 70), checked against that file's own CRC-32 first, so that a
# damaged digit is not read as a setting. It is how a run's settings come back when its `config.yaml` is lost. A setting
# this version does not know (a newer HyMo's) is left out, as resuming from the checkpoint leaves it out.

# %%
#| export
def package_dir() -> Path:
    "The installed `hymo` package folder (presets in `configs/`, the bundled corpus in `assets/`)."
    import hymo
    return Path(hymo.__file__).parent


PRESET_DIR = package_dir() / "configs"


@dataclass
class Config:
    "A full run: the model and how to train it."
    model: ModelConfig = field(default_factory=ModelConfig)  # The architecture
    train: TrainingConfig = field(default_factory=TrainingConfig)  # The training run
    name: str = "custom"  # Name of the preset this came from

    def to_dict(self) -> dict:
        "Plain nested dict (YAML-ready)."
        d = dataclasses.asdict(self)
        return {"name": d["name"], "model": _plain(d["model"]), "train": _plain(d["train"])}

    def __str__(self): return yaml.dump(self.to_dict(), Dumper=_Yaml12Dumper, sort_keys=False)  # quoted as it is read back


def _plain(d: dict) -> dict: return {k: list(v) if isinstance(v, tuple) else v for k, v in d.items()}


def presets() -> list[str]:
    "Names of the presets shipped in the package."
    return sorted(p.stem for p in PRESET_DIR.glob("*.yaml"))


# %%
#| export
_SECTIONS = {"model": ModelConfig, "train": TrainingConfig}


def _closest(key: str, valid) -> str:
    near = difflib.get_close_matches(key, list(valid), n=1, cutoff=0.5)
    near = near or [v for v in valid if key in v.split("_")][:3]  # `lr`: muon_lr, adamw_lr, ...
    return f" Did you mean {' or '.join(repr(v) for v in near)}?" if near else ""


def _section_of(key: str) -> tuple[str, str]:
    "Split an override key into (section, field); a bare field name is looked up in both sections."
    if "." in key:
        sec, name = key.split(".", 1)
        if sec not in _SECTIONS: raise ConfigError(f"unknown section '{sec}' in '{key}': use 'model.' or 'train.'")
        if name not in _field_types(_SECTIONS[sec]):
            other = next((o for o, cls in _SECTIONS.items() if name in _field_types(cls)), None)
            if other:  # a real key in the wrong section: say where it lives rather than guess a near name
                raise ConfigError(f"unknown key '{key}': {name} is a {other} key; write {name}=... or {other}.{name}=... "
                                  f"(in a YAML file, put it under '{other}:')")
            valid = list(_field_types(_SECTIONS[sec]))
            raise ConfigError(f"unknown key '{key}'.{_closest(name, valid)} Valid {sec} keys: {', '.join(valid)}")
        return sec, name
    for sec, cls in _SECTIONS.items():
        if key in _field_types(cls): return sec, key
    if key in _SECTIONS:  # load_config(..., model={"dim": 64}), or model=... on a command line
        ex = next(iter(_field_types(_SECTIONS[key])))  # one of its keys, for the example
        raise ConfigError(f"'{key}' is a section, not a key: set its keys one by one, as {key}.{ex}=... on a command line, "
                          f"or load_config(..., **{{'{key}.{ex}': ...}})")
    valid = [n for cls in _SECTIONS.values() for n in _field_types(cls)]
    raise ConfigError(f"unknown key '{key}'.{_closest(key, valid)} Valid keys: {', '.join(valid)}")


def takes_text(key: str) -> bool:
    "Whether config key `key` (bare or `section.key`) holds text; False for an unknown key, which `load_config` names."
    try: sec, name = _section_of(key)
    except ConfigError: return False
    tp = _field_types(_SECTIONS[sec])[name]
    return tp is str or str in typing.get_args(tp)  # str, or Optional[str]


def null_is_default(key: str) -> bool:
    """Whether config key `key`'s default is null (data_dir, run_dir, sample_prompt: null means what their comment says);
    not moe_capacity_factor's, whose null (dropless) is not its default (1.5). False for an unknown key."""
    try: sec, name = _section_of(key)
    except ConfigError: return False
    return next(f.default for f in fields(_SECTIONS[sec]) if f.name == name) is None


def shell_word(x) -> str:
    "`x` (a path, a value) as one word of a command a message tells the user to run: quoted only where a shell needs it."
    return shlex.quote(str(x))


class _KeyTwice(yaml.YAMLError): pass


class _Yaml12Ints(yaml.SafeLoader):
    "YAML's safe loader with YAML 1.2's numbers: `0123` is 123 (PyYAML, YAML 1.1, reads octal 83); `2:00` and `1:30.5` are text (1.1: base 60)."


class _Yaml12Dumper(yaml.SafeDumper):
    "YAML's safe dumper quoting as `_Yaml12Ints` reads: the text `0o17` is written '0o17', not as what it would read back as, 15."


_INT, _FLOAT = "tag:yaml.org,2002:int", "tag:yaml.org,2002:float"
_NUMBERS_12 = {  # YAML 1.1's, less base 60 (and less 0b for integers, which 1.2's core schema leaves as text)
    _INT: (re.compile(r"^[-+]?(?:0x_*[0-9a-fA-F][0-9a-fA-F_]*|0o_*[0-7][0-7_]*|[0-9][0-9_]*)$"), list("-+0123456789")),
    _FLOAT: (re.compile(r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+][0-9]+)?|\.[0-9][0-9_]*(?:[eE][-+][0-9]+)?
                            |[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$""", re.X), list("-+0123456789."))}
for _cls in (_Yaml12Ints, _Yaml12Dumper):
    _cls.yaml_implicit_resolvers = {c: [(tag, rx) for tag, rx in rs if tag not in _NUMBERS_12]
                                    for c, rs in yaml.SafeLoader.yaml_implicit_resolvers.items()}
    for _tag, (_rx, _first) in _NUMBERS_12.items(): _cls.add_implicit_resolver(_tag, _rx, _first)


def _int12(loader, node) -> int:
    s = loader.construct_scalar(node).replace("_", "")
    return int(s, 0) if s.lstrip("+-")[:2].lower() in ("0x", "0o") else int(s, 10)  # 0123: decimal (int(.., 0) refuses it)


_Yaml12Ints.add_constructor(_INT, _int12)


class _UniqueKeys(_Yaml12Ints):
    "YAML's safe loader, refusing a key given twice in one mapping: plain YAML keeps the last one without a word."
    def flatten_mapping(self, node):  # every mapping comes here before `<<: *base` merges rewrite it (a merged one first)
        checked = self.__dict__.setdefault("_checked", set())
        if id(node) not in checked:
            checked.add(id(node))
            lines = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge": continue  # merged keys may be overridden
                key, line = self.construct_object(key_node, deep=True), key_node.start_mark.line + 1
                try: first = lines.get(key)
                except TypeError: continue  # an unhashable key: the safe loader's own error says so
                if first is not None:
                    where = f"line {line}" if first == line else f"lines {first} and {line}"
                    raise _KeyTwice(f"'{key}' is given twice ({where}); YAML would keep the second without a word: keep one")
                lines[key] = line
        super().flatten_mapping(node)


def checkpoint_folder(config: str | Path, # A `--config` value: a preset's name, a YAML file, a checkpoint folder or its meta.json
                     ) -> Path | None:
    """The checkpoint folder a `--config` value names (the folder, or its meta.json), as an absolute path with its links
    kept (a `checkpoints/` folder linked to another disk is still its run's); None for a preset, a file or a folder
    without a meta.json."""
    p = Path(config).expanduser()
    p = Path(os.path.abspath(p.parent if p.name == "meta.json" else p))
    return p if (p / "meta.json").is_file() else None


def _read_preset(name_or_path, named_by: Path | None = None) -> tuple[str, dict, Path]:
    "One config file, checked: (its name, its raw YAML, its path). A `base:` is found next to the file `named_by` it."
    if not isinstance(name_or_path, (str, Path)) or not str(name_or_path).strip():
        raise ConfigError((f"{named_by}: 'base:'" if named_by else "the config") + f" is {name_or_path!r}: give a preset "
                          f"({', '.join(presets())}) or a path to a .yaml file")
    p = Path(name_or_path).expanduser()
    bare = p.suffix.lower() not in (".yaml", ".yml")  # a preset's name
    if bare:
        preset = PRESET_DIR / f"{name_or_path}.yaml"
        if not preset.exists() and named_by is None and (ckpt := checkpoint_folder(p)): return _read_checkpoint(ckpt)
        ckpt = p.parent if p.name == "meta.json" else p  # one that is not there
        if not preset.exists() and named_by is None and ckpt.parent.name == "checkpoints" and not ckpt.exists() and (
                yaml_file := ckpt.parent.parent / "config.yaml").is_file():  # its run's saves pruned it (keep_last_k)
            raise ConfigError(f"no checkpoint {ckpt} (deleted, or pruned as its run saved newer ones): the run's settings "
                              f"are in its config.yaml: give --config {shell_word(yaml_file)}")
        if not preset.exists() and (p.is_dir() or p.is_file()):  # a run folder, or a file of another kind: not a preset either
            hint = f" (a run folder's settings are its config.yaml: {p / 'config.yaml'})" if (p / "config.yaml").is_file() else ""
            raise ConfigError(f"{name_or_path} is a {'folder' if p.is_dir() else 'file'} but not a .yaml file: give a preset "
                              f"({', '.join(presets())}) or a .yaml file{hint}")
        p = preset
    elif named_by is not None and not p.is_absolute(): p = named_by.parent / p  # a base: next to the file that names it
    if not p.exists():
        if named_by is not None and bare:  # presets only
            beside = [f"{name_or_path}{s}" for s in (".yaml", ".yml") if (named_by.parent / f"{name_or_path}{s}").is_file()]
            raise ConfigError(f"{named_by} names 'base: {name_or_path}', which is not a preset ({', '.join(presets())})"
                              + (f"; for the file beside it, write 'base: {beside[0]}'" if beside else
                                 "; a file is named with its .yaml, from the folder of the file that names it"))
        if named_by is not None:
            raise ConfigError(f"{named_by} names 'base: {name_or_path}', which is not a file at {p}: a base's path is taken "
                              f"from the folder of the file that names it")
        hint = f" (a preset is named without .yaml: {p.stem})" if p.stem in presets() and p.parent == Path() else ""
        raise ConfigError(f"no preset or YAML file '{name_or_path}'{hint}.{'' if hint else _closest(p.stem, presets())} "
                          f"Presets: {', '.join(presets())}; "
                          f"or give a path to a .yaml file")
    try: text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError: raise ConfigError(f"{p} is not a text file (not UTF-8): give a YAML config file") from None
    except OSError as e: raise ConfigError(f"{p} cannot be read ({e.strerror}): give a YAML config file") from None
    try: raw = yaml.load(text, Loader=_UniqueKeys)
    except _KeyTwice as e: raise ConfigError(f"{p}: {e}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{p} is not valid YAML ({' '.join(str(e).split())}); for one that is, see "
                          f"{PRESET_DIR / 'hymo_tiny.yaml'} or a run folder's config.yaml") from None
    if raw is None:  # empty, or only comments: the defaults are hymo_750m's, surely not what was meant
        raise ConfigError(f"{p} is empty: a config file has 'model:' and 'train:' sections (see {PRESET_DIR / 'hymo_tiny.yaml'}); "
                          f"for a preset as it is, name it ({', '.join(presets())})")
    if not isinstance(raw, dict) or set(raw) - {"model", "train", "name", "base"}:
        raise ConfigError(f"{p}: a config file has the sections 'model:' and 'train:' (and a 'name:', as a printed config "
                          f"has, and a 'base:' preset it changes); "
                          f"found {sorted(map(str, raw)) if isinstance(raw, dict) else f'a {type(raw).__name__}, not a mapping'}"
                          + "".join(f"; did you mean '{near[0]}' for '{k}'?" for k in (raw if isinstance(raw, dict) else ())
                                    if (near := difflib.get_close_matches(str(k), ["model", "train", "name", "base"], n=1, cutoff=0.6))
                                    and k != near[0])
                          + "".join(map(_placed, raw if isinstance(raw, dict) else ())))
    if raw.get("base") is not None and not isinstance(raw["base"], str):
        raise ConfigError(f"{p}: 'base:' names one preset ({', '.join(presets())}) or a .yaml file; found {raw['base']!r}")
    for sec, example in (("model", "dim: 128"), ("train", "max_steps: 100")):
        if raw.get(sec) is not None and not isinstance(raw[sec], dict):  # `train: 5` or `model: [1, 2]`
            raise ConfigError(f"{p}: the '{sec}:' section must be a mapping of key: value lines indented under it "
                              f"(like '  {example}'); found {type(raw[sec]).__name__} {raw[sec]!r}")
    name = raw.get("name")
    if name is not None and (isinstance(name, (bool, list, dict)) or not str(name).strip() or set(str(name)) & {"/", "\\"}
                             or str(name) in (".", "..")):  # a number or a date is its text, as before: name: 2024
        raise ConfigError(f"{p}: 'name:' names the run (its folder is runs/NAME-<time>): give a word such as "
                          f"{p.stem}, without / or \\; found {name!r}")
    return str(name or p.stem), raw, p


def _read_checkpoint(ckpt: Path) -> tuple[str, dict, Path]:
    """A checkpoint folder's settings as `_read_preset` gives a file's: those its meta.json records the run trained with,
    checked against its own CRC-32 (chapter 70), so that a damaged digit is not a setting."""
    path = ckpt / "meta.json"
    try: meta = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise ConfigError(f"{path} cannot be read ({getattr(e, 'strerror', None) or e}): give another checkpoint's folder, "
                          "or a .yaml file") from None
    from hymo.training.trainer import CheckpointUnreadable, check_meta  # (torch: only when a checkpoint is given)
    try:
        if not isinstance(meta, dict) or not isinstance(meta.get("config"), dict): raise CheckpointUnreadable(
            f"{path} holds no settings (a JSON object with 'config', as a checkpoint's meta.json has)")
        check_meta(ckpt, meta)
    except CheckpointUnreadable as e: raise ConfigError(f"{e}: give another checkpoint's folder, or a .yaml file") from None
    # a setting this version does not know (a newer HyMo's, or one removed since) is left out, as a resume leaves it out
    section = lambda sec: s if isinstance(s := meta["config"].get(sec), dict) else {}
    raw = {sec: {k: v for k, v in section(sec).items() if k in {f.name for f in dataclasses.fields(_SECTIONS[sec])}}
           for sec in ("model", "train")}
    return str(meta["config"].get("name") or ckpt.resolve().parent.parent.name), raw, path


def _placed(key) -> str:
    "'; put KEY under SECTION:' for a config key found at a file's top level, or '' if it names no key."
    try: sec, name = _section_of(str(key))
    except ConfigError: return ""  # 'base', a section's name, a misspelling: said elsewhere
    return f"; put '{key}' under '{sec}:'" + (f" (as '{name}:')" if name != key else "")


def _read_with_bases(name_or_path) -> tuple[str, list[tuple[dict, Path]]]:
    "The config's name and its (raw YAML, path), then its base's, and so on, the file itself first."
    name, raw, p = _read_preset(name_or_path)
    chain, seen = [(raw, p)], [p.resolve()]
    while raw.get("base") is not None:
        _, raw, p = _read_preset(raw["base"], named_by=p)
        if p.resolve() in seen:
            raise ConfigError(f"the config files name each other as 'base:' in a circle: {' -> '.join(map(str, seen + [p]))}")
        chain.append((raw, p)); seen.append(p.resolve())
    return name, chain


# %%
#| export
def load_config(name_or_path: str = "hymo_tiny", # A preset name (see `presets()`) or a path to a YAML file
                **overrides, # `field=value` (or `{'model.field': value}` via `**`): applied after the preset
               ) -> Config:
    "Read a preset or YAML file, apply `overrides`, validate, and return the `Config`."
    name, chain = _read_with_bases(name_or_path)
    values, source = {"model": {}, "train": {}}, {}  # source: (section, field) -> the file that set it last
    for raw, path in reversed(chain):  # the deepest base first
        for sec in ("model", "train"):
            for k, v in (raw.get(sec) or {}).items():
                try: f = _section_of(f"{sec}.{k}")[1]
                except ConfigError as e: raise ConfigError(f"{path}: {e}") from None  # reported with its file
                values[sec][f], source[sec, f] = v, path
    spelled = {}
    for k, v in overrides.items():
        sec, f = _section_of(k)
        if spelled.setdefault((sec, f), k) != k:
            raise ConfigError(f"'{spelled[sec, f]}' and '{k}' both set {sec}.{f}: give it once")
        values[sec][f] = v
        source.pop((sec, f), None)  # the command line's value replaces the file's, a wrong one included
    for (sec, f), path in source.items():  # a wrong type in the value a file gave and nothing replaced: name the file
        try: values[sec][f] = _check_type(f"{sec}.{f}", values[sec][f], _field_types(_SECTIONS[sec])[f])
        except ConfigError as e: raise ConfigError(f"{path}: {e}") from None
    return Config(*validate_config(ModelConfig(**values["model"]), TrainingConfig(**values["train"])), name=name)


def validate_config(m: ModelConfig, t: TrainingConfig) -> tuple[ModelConfig, TrainingConfig]:
    """Raise `ConfigError` if `m` or `t` cannot train, alone or together; return them, their values normalised in place
    (3 → 3.0, a list → a tuple). `load_config` calls it, and so does the `Trainer` (chapter 70) on copies of what it is given."""
    validate_model(m); validate_training(t)
    if t.seq_len > m.max_seq_len:
        raise ConfigError(f"train.seq_len={t.seq_len} is longer than model.max_seq_len={m.max_seq_len}, the "
                          f"longest sequence the model is built for: lower seq_len or raise max_seq_len")
    if t.seq_len <= m.mtp_depth:
        raise ConfigError(f"train.seq_len={t.seq_len} leaves MTP head {m.mtp_depth} no position to train "
                          f"(head k needs k + 1 tokens): use seq_len > mtp_depth={m.mtp_depth}")
    return m, t


# %% [markdown]
# The command line (chapter 71) asks two more things of a key: whether it holds text (kept as
# typed, not read as YAML: `run_dir=007` stays `'007'`) and whether null is its default, what an
# empty value is told to write instead. Messages that name a command to run quote its paths for the shell, so they paste as
# they are.

# %%
test_eq([takes_text(k) for k in ("data_dir", "train.sample_prompt", "max_steps", "no_such_key")], [True, True, False, False])
test_eq([null_is_default(k) for k in ("data_dir", "moe_capacity_factor", "train.max_steps", "model.dim", "no_such_key")],
        [True, False, False, False, False])
test_eq([shell_word(p) for p in (Path("runs/a"), "my runs/a", "it's")], ["runs/a", "'my runs/a'", "'it'\"'\"'s'"])

# %% [markdown]
# The 750M preset is the design document's model. Printing a config gives YAML you can save and
# load back.

# %%
cfg = load_config("hymo_750m")
print(cfg)

# %%
import tempfile

# %%
saved = Path(tempfile.mkdtemp()) / "my_run.yaml"
saved.write_text(str(cfg))
test_eq(load_config(saved), cfg)  # the printed YAML loads back to the same config, name included
broken = saved.with_name("broken.yaml"); broken.write_text("model: {dim: [\n")
test_fail(lambda: load_config(broken), contains="is not valid YAML")

# %% [markdown]
# A file with a `base:` changes that preset (here hymo_tiny); one without changes the design
# defaults; a circle of bases is refused:

# %%
wider = saved.with_name("wider.yaml"); wider.write_text("base: hymo_tiny\nmodel:\n  dim: 96\ntrain:\n  max_steps: 70\n")
test_eq(load_config(wider), dataclasses.replace(load_config("hymo_tiny", dim=96, max_steps=70), name="wider"))
test_eq(load_config(wider, max_steps=500).train.max_steps, 500)  # the command line over the file
on_wider = saved.with_name("on_wider.yaml"); on_wider.write_text("base: wider.yaml\ntrain:\n  seed: 3\n")
test_eq(load_config(on_wider).model.dim, 96)  # a base of a base, found next to the file
bare = saved.with_name("bare.yaml"); bare.write_text("model:\n  dim: 128\n")
test_eq((load_config(bare).model.dim, load_config(bare).model.n_layers), (128, 32))  # no base: the design defaults
wider.write_text("base: on_wider.yaml\n")
test_fail(lambda: load_config(on_wider), contains="in a circle")
wider.write_text("base: [hymo_tiny]\n")
test_fail(lambda: load_config(wider), contains="'base:' names one preset")

# %%
test_eq((cfg.model.dim, cfg.model.n_layers, cfg.model.vocab_size), (896, 32, 64256))
test_eq((cfg.model.gdn_n_heads, cfg.model.gdn_head_k_dim, cfg.model.gdn_head_v_dim), (40, 32, 32))
test_eq((cfg.model.mla_n_heads, cfg.model.mla_n_kv_groups, cfg.model.mla_kv_lora_rank), (16, 4, 128))
test_eq((cfg.model.moe_n_routed, cfg.model.moe_n_shared, cfg.model.moe_top_k), (16, 1, 2))
test_eq(cfg.model.mtp_loss_weights, (0.3, 0.1))

# %% [markdown]
# The tiny preset is the default everywhere: the notebooks, the tests and `python -m hymo.train`.

# %%
tiny = load_config()
print(tiny.model.layer_types, tiny.model.dim, tiny.train.seq_len)
test_eq(tiny.name, "hymo_tiny")

# %% [markdown]
# Overrides take a bare field name or a `section.field` name:

# %%
c = load_config("hymo_tiny", dim=96, max_steps=70, **{"model.n_layers": 8})
test_eq((c.model.dim, c.train.max_steps, c.model.n_layers), (96, 70, 8))
test_eq(c.model.layer_types.count("mla"), 2)

# %% [markdown]
# The run's last act is a short sample (chapter 70). Its prompt, `train.prompt`, is "ROMEO:" only on the
# bundled corpus; on your own data it is the start of a document, unless `sample_prompt` gives one:

# %%
test_eq([load_config("hymo_tiny", **kw).train.prompt for kw in
         [{}, dict(data_dir="data/mine"), dict(data_dir="data/mine", sample_prompt="def "), dict(sample_prompt="")]],
        ["ROMEO:", "", "def ", ""])


# %% [markdown]
# ### What a mistake looks like
#
# Each of these raises a `ConfigError` whose message says what to change; an unknown key, or a
# value of the wrong type, that came from a YAML file (or from one of its `base:` files) is reported
# with that file's path.

# %%
def error_of(f):
    "The message `f()` raises, for display."
    try: f()
    except ConfigError as e: return str(e)
    raise AssertionError("no ConfigError raised")

msg = error_of(lambda: load_config("hymo_tiny", dimm=64))
print(msg[:120])
assert "Did you mean 'dim'?" in msg and "Valid keys" in msg

# %%
msg = error_of(lambda: load_config("hymo_tiny", mla_n_heads=6, mla_n_kv_groups=4))
print(msg)
assert "mla_n_heads=6" in msg and "mla_n_kv_groups=4" in msg

# %%
msg = error_of(lambda: load_config("hymo_tiny", dim="wide"))
print(msg)
assert "expected int" in msg

# %%
test_fail(lambda: load_config("hymo_tiny", global_batch_size=10, micro_batch_size=4), contains="not divisible")
test_fail(lambda: load_config("hymo_tiny", mtp_depth=3), contains="one weight per MTP head")
test_fail(lambda: load_config("no_such_preset"), contains="Presets:")
test_fail(lambda: load_config("hymo_tiny", gdn_kernel="cuda"), contains="choose one of")
test_fail(lambda: load_config("hymo_tiny", gdn_kernel="triton", gdn_chunk_size=32), contains="gdn_kernel: torch")
test_fail(lambda: load_config("hymo_tiny", max_steps=10), contains="warmup_steps=12 runs into the decay")
test_fail(lambda: load_config("hymo_tiny", seq_len=512), contains="longer than model.max_seq_len=256")
test_fail(lambda: load_config("hymo_tiny", seq_len=2), contains="use seq_len > mtp_depth=2")
test_fail(lambda: load_config("hymo_tiny", **{"model.max_steps": 3}), contains="max_steps is a train key")

# %% [markdown]
# Values in range: a NaN or an infinity is refused everywhere, and each number must lie where the
# code that reads it can work (a positive `norm_eps`, a `moe_ema_decay` below 1 with `moe_balance: ema`, the only rule that reads it, a non-negative MTP
# weight, ...). Zero stays allowed where the field's comment says it turns something off. A
# weight decay is refused where a learning rate times it reaches 1: decoupled decay multiplies the
# weights by $1 - \eta\lambda$ each step, so the weights would be zeroed or flip sign. One key set
# twice, by two spellings (`dim=` and `model.dim=`) or twice on the command line, is refused too.

# %%
test_fail(lambda: load_config("hymo_tiny", grad_clip=float("nan")), contains="train.grad_clip=nan must be a finite number")
test_fail(lambda: load_config("hymo_tiny", weight_decay=50.0), contains="flipping them; give weight_decay <")
test_fail(lambda: load_config("hymo_tiny", **{"dim": 64, "model.dim": 96}), contains="both set model.dim: give it once")
test_fail(lambda: load_config("hymo_tiny", mtp_loss_weights=[0.3, float("inf")]), contains="mtp_loss_weights[1]=inf")
test_fail(lambda: load_config("hymo_tiny", norm_eps=0), contains="model.norm_eps=0.0 must be positive")
test_fail(lambda: load_config("hymo_tiny", norm_eps=1e-50), contains="norm_eps=1e-50 must be at least 1e-30")  # 0 in fp32
test_fail(lambda: load_config("hymo_tiny", rope_theta=1e39), contains="rope_theta=1e+39 must be below 3.4e38")
test_fail(lambda: load_config("hymo_tiny", moe_ema_decay=1), contains="must be in [0, 1)")
test_fail(lambda: load_config("hymo_tiny", mtp_loss_weights=[0.3, -0.1]), contains="trains against its head")
test_eq(load_config("hymo_tiny", grad_clip=0, moe_bias_speed=0, mtp_loss_weights=[0.3, 0]).train.grad_clip, 0.0)

# %% [markdown]
# One leniency: PyYAML follows YAML 1.1, which reads `1e-3` (no dot) as a string. A float field
# takes it as the number anyone writing it means; `max_steps=1e5` is still refused, as an int field,
# with the whole number to write instead. Integers are read as YAML 1.2 writes them: YAML 1.1 reads
# `seed: 0123` as the octal 83 and `2:00` as 120 (base 60), without a word; here they are 123 and
# text (refused, for an int), as are `1:30.5` and `0b101`. A run's config.yaml is quoted by the same
# rules, so the text `0o17` is written `'0o17'` and reads back as text. The reverse slip, `run_dir: 2024` in a YAML file, is told to quote
# it, and `moe_balance: off` (YAML's False) is told its choices, where off is the word none; on the
# command line a key that holds text keeps what was typed (chapter 71).
# NumPy's scalars (a sweep's `np.int64(64)`, `np.float32(0.02)`, `np.True_`) are the plain values
# they print, so the config a run writes is plain YAML.

# %%
test_eq(load_config("hymo_tiny", muon_lr="1e-3", adamw_lr="3E-4").train.muon_lr, 1e-3)
test_fail(lambda: load_config("hymo_tiny", muon_lr="fast"), contains="expected float")
test_fail(lambda: load_config("hymo_tiny", max_steps="1e5"), contains="expected int, got str '1e5'; write it as a whole number: 100000")
test_fail(lambda: load_config("hymo_tiny", run_dir=2024), contains="expected str, got int 2024; quote it (run_dir: '...' in a YAML file)")
test_fail(lambda: load_config("hymo_tiny", moe_balance=False), contains="choose one of 'ema', 'sign', 'none' (off is the word none)")
test_eq(yaml.load("seed: 0123", Loader=_Yaml12Ints), {"seed": 123})
test_fail(lambda: load_config("hymo_tiny", data_dir=""), contains="train.data_dir='' is empty: give a value, or null")  # data_dir="" in a launcher
test_fail(lambda: load_config("hymo_tiny", model={"dim": 64}), contains="'model' is a section, not a key")
test_eq(load_config("hymo_tiny", dim=np.int64(64), muon_lr=np.float32(0.02), wandb=np.False_).train.muon_lr, 0.02)

# %% [markdown]
# ## Interview questions
#
# ::: {.callout-tip collapse="true"}
# ## Why keep one flat dataclass per concern rather than a tree of nested configs?
# Because every value's origin should be one look away. With two flat dataclasses, a value comes
# from the default in this file, from the preset's YAML, or from an override on the command line,
# and the printed config shows the result. Nested builder configs hide defaults in many places and
# make it hard to tell what a run actually used.
# :::
#
# ::: {.callout-tip collapse="true"}
# ## Why validate divisibility at load time instead of letting the model fail?
# A shape error deep in `forward` (say, 6 query heads over 4 KV groups) surfaces as an opaque
# reshape failure minutes into a multi-node launch. Checking at load time names the two keys and
# the reason, before any GPU is allocated.
# :::
#
# ::: {.callout-tip collapse="true"}
# ## How is the 3:1 layout encoded, and why not a list of layer types?
# `mla_every = 4` makes blocks 3, 7, 11, … MLA blocks and the rest GDN. A single integer cannot
# describe an inconsistent layout, and changing depth keeps the ratio (exactly when `n_layers` is a
# multiple of `mla_every`). `layer_types` derives the
# explicit list when you want to see it. The two ends are ablations: `mla_every = 1` is all MLA,
# `mla_every = 0` all GDN. A model shallower than `mla_every` is refused rather than silently
# built without MLA blocks.
# :::
#
# ::: {.callout-tip collapse="true"}
# ## Where does the 57 220-step default come from?
# A global batch of 128 sequences of 4096 tokens is 524 288 tokens per step; 30 B tokens divided by
# that is about 57 220 optimiser steps.
# :::
