# %% [markdown]
# # The trainer
#
# > FSDP-2 training with gradient accumulation, NorMuon + AdamW on a WSD schedule, MoE bias updates, exact resume, and logging.

# %%
#| default_exp training.trainer

# %% [markdown]
# This chapter puts the pieces together. A `Trainer` owns a model, two optimisers, a data loader,
# and a run folder. One optimiser step is:
#
# 1. for each of `accum` micro-batches: forward (main + MTP loss), backward of `loss / accum`;
# 2. take the global gradient norm (the `grad_norm` logged) and clip the gradients to `grad_clip`;
# 3. if the loss or that norm is not finite, throw the gradients away and count a bad step; else set
#    each group's learning rate from the WSD schedule and step NorMuon and AdamW;
# 4. update every MoE layer's gate bias from the token counts of this step (summed over
#    micro-batches and all-reduced over ranks).
#
# Everything that changes what training does next is in the checkpoint: weights, both optimisers'
# state, the MoE buffers, the data loader's position, every RNG, and the step. A resumed run is
# therefore the same run: on CPU its losses equal the uninterrupted run's exactly. (A resume on
# another number of ranks cannot restore each rank's RNG streams and keeps those the seed and the
# model's initialisation left: nothing in training draws random numbers, so its losses still follow
# the uninterrupted run's, within rounding.)

# %%
#| export
from __future__ import annotations

import contextlib
import dataclasses
import errno
import hashlib
import itertools
import json
import logging
import math
import os
import pickle
import re
import shutil
import signal
import sys
import threading
import time
import warnings
import weakref
import zlib
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn as nn

from hymo.config import Config, ConfigError, ModelConfig, TrainingConfig, check_triton_chunk, load_config, shell_word, validate_config
from hymo.models.gdn import _load_triton
from hymo.models.model import HyMo, build_hymo, doc_keys_per_query
from hymo.models.moe import stats_paused
from hymo.training.data import ContentsCheck, DataError, TokenLoader, _bar_shows, check_compatible, prepare_default, read_tokenizer, to_devnull, to_disk, tokenizer_from_json
from hymo.training.optim import build_optimizers, wsd_schedule

# %%
import tempfile
from fastcore.test import test_eq, test_close, test_fail


# %% [markdown]
# ## Processes and devices
#
# Without `torchrun`, the trainer is one process on one device: the GPU if there is one, else the
# CPU. Under `torchrun --nproc_per_node N` every process reads its rank from the environment and
# joins a process group: NCCL on GPUs, gloo on CPUs. Several nodes work the same way through
# torchrun's rendezvous:
#
# ```sh
# torchrun --nnodes 4 --nproc_per_node 8 --rdzv_backend c10d --rdzv_endpoint HOST:29500 \
#     -m hymo.train --config hymo_750m data_dir=/data/shards
# ```
#
# Without `run_dir=`, a run makes a new folder named after the time it started. Every rank must
# write into the same one (each rank's checkpoint shards go to the folder *it* was given), and
# ranks on other nodes, or one that reads its clock a second later, would name another; so rank 0
# names it and sends the name to the others (`new_run_dir`). Multi-node runs need the run folder on
# a file system every node sees.

# %%
#| export
@dataclass
class Dist:
    "Where this process runs: its rank, the world size and its device."
    rank: int = 0  # Global rank
    world_size: int = 1  # Number of processes
    local_rank: int = 0  # Rank on this node (picks the GPU)
    device: torch.device = torch.device("cpu")  # This process's device
    joined: bool = False  # True when `setup_distributed` created the process group (and so should leave it)
    local_world_size: int = 1  # Processes on this node (torchrun's LOCAL_WORLD_SIZE; 1 without it: each its own node)

    @property
    def is_main(self) -> bool: return self.rank == 0

    @property
    def distributed(self) -> bool: return dist.is_available() and dist.is_initialized()


def setup_distributed() -> Dist:
    "Join the process group when launched by torchrun (NCCL on GPU, gloo on CPU); else a single process."
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local) if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cuda": torch.cuda.set_device(device)
    joined = world > 1 and not dist.is_initialized()
    if joined: dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    rank = dist.get_rank() if dist.is_initialized() else 0
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1")) if "LOCAL_RANK" in os.environ else 1
    return Dist(rank, dist.get_world_size() if dist.is_initialized() else 1, local, device, joined, local_world)


def new_run_dir(name: str, # Preset name
                d: Dist, # This process
               ) -> str:
    """`runs/<name>-<time>`, with rank 0's time given to every rank (ranks whose clocks read another second share one
    folder). Not yet created: `_create_new_run_dir` takes `-2`, `-3`, ... when a run started in the same second has it."""
    path = [f"runs/{name}-{time.strftime('%Y%m%d-%H%M%S')}"]
    if d.distributed: dist.broadcast_object_list(path, src=0)
    return path[0]


def _numbered(base: str):
    "`base`, `base-2`, `base-3`, ..."
    yield base
    for n in itertools.count(2): yield f"{base}-{n}"


def _create_new_run_dir(path: Path) -> Path:
    "Create a new run folder at `path`, or at the first of `path-2`, `path-3`, ... that no other run created first."
    path.parent.mkdir(parents=True, exist_ok=True)  # an OSError here (runs/ a broken link, say) is the caller's to report
    for p in _numbered(str(path)):
        try: Path(p).mkdir(); return Path(p)
        except FileExistsError:
            if not os.path.lexists(p): raise  # not a name another run took: do not try the next forever


# %% [markdown]
# ## Parallelising the model
#
# The model code is single-device. `parallelize` applies everything else from outside, always in
# the same order, because each step wraps the result of the one before:
#
# 1. **activation checkpointing** (by config): each block recomputes its activations in backward
#    (the MoE layers' balancing counts must not see that second forward: `forward_backward` runs the
#    backward inside `stats_paused`, chapter 30);
# 2. **`torch.compile`** (by config): each block (and each MTP head) is compiled on its own, so
#    the compiled regions are small and identical: two graphs for 32 blocks, one per block type.
#    The Triton GDN kernel is a registered operator, so a GDN block is one graph. The `hymo_750m`
#    preset turns it on;
# 3. **`fully_shard` per block**: each block's parameters become DTensor shards. By FSDP's default
#    they are all-gathered before the block runs and freed after, and gradients reduce-scattered;
#    the training step changes that to one gather and one reduce-scatter per block and step
#    (`fsdp_step`, below);
# 4. **`fully_shard` on the root**: the embedding, final norm and MTP heads.
#
# ::: {.callout-note collapse="true"}
# ## Two details: the MoE's counts under recompute, and what compiling buys
# Activation checkpointing's recompute routes the MoE's tokens again, and would add the same counts
# to `expert_counts` a second time (eager and compiled alike; `tests/test_moe.py` shows it on a bare
# `checkpoint`). The trainer runs each backward inside `stats_paused` (chapter 30), so every
# assignment is counted once, recompute or not (`tests/test_trainer.py` holds this).
#
# On the H200, compiling took a 750M optimiser step of 32 micro-batches from 15.9 s to 8.7 s when
# first measured. Since the GDN prelude has Triton kernels of its own, a step of one micro-batch
# (and its optimiser step) is about 1.2× faster compiled: 0.39 s against 0.47 s
# (`benchmarks/results/train_step.json`, 2026-12-02). With today's code, the preset's whole step
# of 32 micro-batches took 6.79 s compiled and 10.63 s eager, 1.57× (on an H100, 2026-12-05).
# :::
#
# On a GPU the FSDP mixed-precision policy computes in bf16 and reduces gradients in fp32, while
# the optimiser keeps fp32 master weights. On CPU everything stays fp32. A single GPU process
# without torchrun runs under `torch.autocast(bfloat16)` instead. The matrix products see the same
# bf16 operands either way, and the residual stream is bf16 in both (under autocast the model casts
# the embedding's output to bf16, chapter 41). They are still not bit for bit the same: FSDP hands
# the model bf16 copies of *every* parameter, so the norms' gains, the router's weight and the GDN
# gates' `A_log` and `dt_bias` are rounded to bf16 too, and their gradients are bf16 within a
# micro-batch (FSDP accumulates and reduces them in fp32), while under autocast all of those stay
# fp32.

# %%
#| export
def parallelize(model: HyMo, cfg: TrainingConfig, d: Dist) -> HyMo:
    "Activation checkpointing → compile → `fully_shard` per block → root. Returns the model."
    if cfg.activation_checkpointing:
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
        for i, blk in enumerate(model.layers): model.layers[i] = checkpoint_wrapper(blk)
    if cfg.compile:
        for blk in (*model.layers, *model.mtp.heads): blk.compile()
    if d.distributed:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        bf16 = resolve_precision(cfg, d.device) == torch.bfloat16
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else MixedPrecisionPolicy()
        # reshard_after_forward stays FSDP's default here: `fsdp_step` changes it for a step and restores that default
        for blk in model.layers: fully_shard(blk, mp_policy=mp)
        fully_shard(model, mp_policy=mp)
    return model


def resolve_precision(cfg: TrainingConfig, device: torch.device) -> torch.dtype:
    "The compute dtype: `precision='auto'` is bf16 on CUDA and fp32 on CPU."
    if cfg.precision == "auto": return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"bf16": torch.bfloat16, "fp32": torch.float32}[cfg.precision]


# %% [markdown]
# ## MFU
#
# Model FLOPs utilisation is the FLOPs the model needs per second (from the model's own
# accounting, `flops_per_token`) divided by what the hardware could do at peak. The peak comes
# from a small table of dense bf16 figures; on a CPU there is no meaningful peak, so no MFU.

# %%
#| export
PEAK_BF16_FLOPS = {  # the first name found in the GPU's name wins: the PCIe and NVL cards before the SXM ones
    "H200 NVL": 835e12, "H200": 989e12, "H100 PCIe": 756e12, "H100 NVL": 835e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12,
    "A10G": 125e12, "4090": 165e12}


def peak_flops(device: torch.device) -> float | None:
    "Dense bf16 peak FLOP/s of `device`, or None when unknown (CPUs)."
    if device.type != "cuda": return None
    return peak_of(torch.cuda.get_device_name(device))


def peak_of(gpu_name: str) -> float | None:
    "The `PEAK_BF16_FLOPS` entry of a GPU by its name (`torch.cuda.get_device_name`), or None."
    return next((v for k, v in PEAK_BF16_FLOPS.items() if k in gpu_name), None)


# %%
test_eq([peak_of(n) for n in ("NVIDIA H100 80GB HBM3", "NVIDIA H100 PCIe", "NVIDIA H100 NVL", "NVIDIA H200", "Tesla T4")],
        [989e12, 756e12, 835e12, 989e12, None])

# %% [markdown]
# ## Checkpoints
#
# A checkpoint is a folder `checkpoints/step_000100/` written with `torch.distributed.checkpoint`
# (DCP): every rank writes its own shards, and a later run with a different number of ranks
# reshards them on load. Beside the DCP files, each rank writes its RNG states and its loader's
# position, and rank 0 writes `meta.json` (step, counters, the config).
#
# A resume may split the batch differently: another number of ranks, or a smaller micro-batch with
# more accumulation after an out-of-memory error on a new machine. With the same global batch $G$,
# optimiser step $s$ reads the same windows of the epoch's order whatever the split, so the data is
# exactly as without the change. A resume with another $G$ continues in the saved run's epoch,
# after the windows of it the saved run had read (`TokenLoader.step_after`, rounded up to this run's
# optimiser steps: none is read twice); the windows an epoch leaves over, and so later epochs,
# then differ from the saved run's, and the resume says so.
#
# The folder is written as `step_000100.tmp` and renamed only when every rank has finished. A crash
# mid-write leaves an incomplete `.tmp` folder that is never read, so the last complete checkpoint
# stays the one a resume uses (a `.tmp` that is complete, whose rename alone was cut short, is
# renamed and resumed from). After a successful save, only the newest `keep_last_k` are kept, and
# the newest that has trained no step of the decay (`pruned`; once the decay has begun, one
# checkpoint more, about 10 GB at 750M, kept after the run ends too): warmup-stable-decay lets a
# finished run be trained further from there without the learning rate's jump back up. Only
# names of exactly that form are checkpoints: a copy you made as `step_000100.bak` is neither read nor
# pruned.
#
# A checkpoint can still be damaged afterwards (a disk that filled up, a file deleted by hand). A
# resume then says which one cannot be read and why, renames it `damaged-step_...` (kept, never
# read again) and falls back to the one before. Under `torchrun` the ranks agree on that verdict (one
# all-reduce) before the collective load, so a file only one rank cannot read moves them all back
# together. A checkpoint whose weights have other shapes than the model asked for is refused
# outright: every checkpoint of the run would say the same. So is one that meets an error of the
# reading rather than of what is read (`READ_FAULTS`: a permission, a failing mount, too many open
# files): the run stops in one line on every rank and the checkpoint stays as it is, since the cause
# may pass. Before, such a checkpoint was renamed `damaged-` for good and its steps trained again.
#
# Damage that leaves every file in place is found too. DCP keeps no checksums: a flipped bit in a
# shard (a failing disk or cable, a bad copy between clusters) loads without a word into weights
# or moments that differ from the saved ones, and training goes on from them. So each save
# records every file's size and CRC-32 in `meta.json`: each rank reads back the files it wrote
# (`__R_N.distcp`, `rankR.pt`) while the page cache still holds them, and rank 0 adds DCP's
# `.metadata`. A resume checks them before it reads anything else (`check_files`), each file on
# one rank, the one of the same number where the number of ranks is unchanged, and a file that
# differs is damage like a missing one. CRC-32 reads about 2.3 to 3.2 GB/s on one core (measured below, and by the benchmark that follows). On
# one H100 machine the 750M preset's checkpoint, 10.1 GB of weights and moments, took 17 to 22 s
# to save, of which the sums 3.8 to 4.4 s, and 10.3 s to load, of which the check 3.9 s
# (`benchmarks/ckpt_save.py`, in `benchmarks/results/ckpt_save.json`): once every `ckpt_every`
# steps (1000: about two hours of steps on one GPU), and less per rank on more ranks. A checkpoint written
# before HyMo recorded the sums has no list and loads unchecked.
#
# `meta.json` holds the sums, so it carries one of its own: `meta_crc32`, the CRC-32 of the rest
# as JSON writes it (`meta_sum`; reading and writing back gives the same text). Without it a
# flipped bit in `"step": 6` resumed at step 7, a step never trained, and one in its history or
# config misled the resume's checks (`check_meta`, which also holds a `step_N` folder to step N).

# %%
#| export
CKPT_PREFIX = "step_"


def list_checkpoints(run_dir: Path) -> list[Path]:
    """The checkpoints in `run_dir/checkpoints`, oldest first: folders named `step_` and the step's digits, renamed from
    `.tmp` once complete. Other names (`.tmp`, `damaged-...`, a backup copy `step_000100.bak`) are not checkpoints."""
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir(): return []
    done = [p for p in root.iterdir() if re.fullmatch(CKPT_PREFIX + r"\d{6,}", p.name) and p.is_dir()]
    return sorted(done, key=checkpoint_step)


def history_sum(history: list[dict]) -> str:
    "CRC-32 of a run's `history` (each step's losses): which line of steps a finish (`summary.json`) belongs to."
    return f"{zlib.crc32(json.dumps(history).encode()):08x}"


def on_line_of(ckpt: Path, history: list[dict]) -> bool:
    """Whether checkpoint `ckpt` lies on the line of steps that `history` (another checkpoint's) records: its own history
    begins that one, step for step. One whose meta.json cannot be read counts as on it (resuming finds it damaged)."""
    h = (_json_dict(ckpt / "meta.json") or {}).get("history")
    return not isinstance(h, list) or json.dumps(history[:len(h)]) == json.dumps(h)


def _json_dict(path: Path) -> dict | None:
    "The JSON object in `path` (a checkpoint's meta.json, a run's summary.json), or None if there is none to read."
    try: d = json.loads(path.read_text())
    except (OSError, ValueError): return None
    return d if isinstance(d, dict) else None


def tmp_checkpoints(run_dir: Path) -> list[Path]:
    """The checkpoints of `run_dir` still being written, or whose writing was cut short: `step_` and digits, then `.tmp`,
    as `save` names them; oldest first. A copy of yours named `step_best.tmp` is not one of them."""
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir(): return []
    tmps = [t for t in root.glob(f"{CKPT_PREFIX}*.tmp") if re.fullmatch(CKPT_PREFIX + r"\d{6,}", t.with_suffix("").name)]
    return sorted(tmps, key=lambda t: checkpoint_step(t.with_suffix("")))


def cut_short_renames(run_dir: Path) -> list[Path]:
    """The `.tmp` checkpoints of `run_dir` whose rename alone was cut short (a kill, or a refused rename, right after
    writing): every file there, a `meta.json` of the step the name says, newer than every checkpoint. Oldest first."""
    done = list_checkpoints(run_dir)
    newest, found = (checkpoint_step(done[-1]) if done else -1), []
    for tmp in tmp_checkpoints(run_dir):
        step = (_json_dict(tmp / "meta.json") or {}).get("step")
        if Trainer._whole(tmp) and step == checkpoint_step(tmp.with_suffix("")) > newest:
            found.append(tmp); newest = step
    return found


def checkpoint_step(ckpt: Path) -> int:
    "The step a checkpoint folder `step_000123` holds."
    return int(ckpt.name[len(CKPT_PREFIX):])


ASIDE = "damaged|superseded|replaced|before-decay"  # why a checkpoint folder was set aside (`Trainer._set_aside`)


def set_aside_as(name: str) -> tuple[str, str] | None:
    "For a checkpoint folder set aside as `{why}-step_N` (`-2`, ... where that name was taken): (why, `step_N`); else None."
    m = re.fullmatch(r"(" + ASIDE + r")-(" + CKPT_PREFIX + r"\d{6,})(?:-\d+)?", name)
    return (m[1], m[2]) if m else None


class CheckpointUnreadable(OSError):
    "A checkpoint's files are missing or damaged on some rank."


def file_crc(path: Path) -> dict:
    "The size and CRC-32 of file `path`, read in 16 MiB pieces: what a checkpoint records of each of its files."
    crc, size, piece = 0, 0, bytearray(1 << 24)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(piece):
            crc, size = zlib.crc32(memoryview(piece)[:n], crc), size + n
    return {"size": size, "crc32": f"{crc:08x}"}


def file_rank(name: str) -> int | None:
    "The rank that wrote a checkpoint's file: DCP's shards `__R_N.distcp`, HyMo's `rankR.pt`; None for the others (`.metadata`)."
    m = re.fullmatch(r"__(\d+)_\d+\.distcp|rank(\d+)\.pt", name)
    return None if m is None else int(m[1] or m[2])


def check_files(ckpt: Path, # A checkpoint folder
                meta: dict, # Its meta.json, whose `files` the save wrote: each file's size and CRC-32
                rank: int, world_size: int): # This process's rank and the number of ranks now
    """Raise `CheckpointUnreadable` if a file of `ckpt` this rank checks is missing, or its size or CRC-32 differs from the
    save's. Rank R checks the files rank R wrote (modulo `world_size`, when the number of ranks changed), rank 0 the others.
    A checkpoint without `files` (written before HyMo recorded them) is not checked. Sizes come first: a file cut short
    (a copy that stopped, a full disk) is named without reading gigabytes of the others."""
    files = meta.get("files", {})
    if not isinstance(files, dict): raise CheckpointUnreadable(f"{ckpt / 'meta.json'} is damaged: its 'files' is not a table")
    mine = [(ckpt / name, saved if isinstance(saved, dict) else {}) for name, saved in sorted(files.items())
            if (file_rank(name) or 0) % world_size == rank]
    for path, want in mine:
        if not path.is_file(): raise CheckpointUnreadable(f"{path} is missing")
        if (size := path.stat().st_size) != want.get("size"):
            raise CheckpointUnreadable(f"{path} holds {size} bytes, not the {want.get('size')} it was saved with")
    for path, want in mine:
        if (crc := file_crc(path)["crc32"]) != want.get("crc32"):
            raise CheckpointUnreadable(f"{path} has changed since it was saved (CRC-32 {crc}, saved as "
                                       f"{want.get('crc32')}): its bytes were damaged on the disk or in a copy")


def meta_sum(meta: dict) -> str:
    "The CRC-32 of a checkpoint's meta.json without its own sum (`meta_crc32`), as JSON reads and writes it back alike."
    return f"{zlib.crc32(json.dumps({k: v for k, v in meta.items() if k != 'meta_crc32'}).encode()):08x}"


def check_meta(ckpt: Path, meta: dict):
    """Raise `CheckpointUnreadable` if `ckpt`'s meta.json has changed since the save (its `meta_crc32`; checkpoints from
    before it was recorded are not checked), or holds another step than its folder's name says. A flipped digit of its
    step resumed at a step never trained; one of its history or config misled the resume's checks."""
    if (want := meta.get("meta_crc32")) is not None and (now := meta_sum(meta)) != want:
        raise CheckpointUnreadable(f"{ckpt / 'meta.json'} has changed since it was saved (CRC-32 {now}, saved as {want}): "
                                   "its bytes were damaged on the disk or in a copy")
    if re.fullmatch(CKPT_PREFIX + r"\d{6,}", ckpt.name) and meta.get("step") != checkpoint_step(ckpt):
        raise CheckpointUnreadable(f"{ckpt / 'meta.json'} is damaged: it holds step {meta.get('step')!r}, its folder's name "
                                   f"step {checkpoint_step(ckpt)}")


def wrapped(e: BaseException, kind) -> BaseException | None:
    "The first exception of type `kind` in `e` or what it wraps: DCP re-raises every error, Ctrl-C included, inside a `CheckpointException`."
    todo, seen = [e], []
    while todo:
        x = todo.pop(0)
        if x is None or any(x is y for y in seen): continue
        if isinstance(x, kind): return x
        seen.append(x)
        failures = getattr(x, "failures", None)  # CheckpointException: {rank: (exception, traceback)}
        if isinstance(failures, dict): todo += [f[0] if isinstance(f, tuple) else f for f in failures.values()]
        todo += [x.__cause__, None if x.__suppress_context__ else x.__context__]  # `raise ... from None` ends the chain
    return None


DISK_ERRORS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES)  # a run folder that cannot be written: one line
# errors of the reading, not of what was read: a checkpoint that meets one is not damaged for all we know
READ_FAULTS = (errno.EACCES, errno.EPERM, errno.EIO, errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ESTALE,
               errno.ETIMEDOUT, errno.ENOTCONN, errno.EAGAIN, errno.EINTR)


def reraise_interrupt(e: BaseException):
    "Raise the `KeyboardInterrupt` or `SystemExit` that `e` wraps, as itself; nothing if there is none."
    stop = wrapped(e, (KeyboardInterrupt, SystemExit))
    if stop is not None: raise stop.with_traceback(None) from None


def _read_fault(e: BaseException | None) -> OSError | None:
    "The `READ_FAULTS` error in `e` or what it wraps (permissions, a failing mount, too many open files), if any."
    x = None if e is None else wrapped(e, OSError)
    return x if x is not None and x.errno in READ_FAULTS else None


def _unreadable(e: BaseException, ckpt: Path) -> bool:
    """True for errors that mean damaged or missing files of checkpoint `ckpt`, not a setting that does not fit nor the
    machine's (`_not_the_files`). One that says nothing of the files (`_read_fault`) stops the run, the checkpoint left as it is."""
    from torch.distributed.checkpoint.api import CheckpointException  # DCP's, a BaseException
    reraise_interrupt(e)  # Ctrl-C while a checkpoint loads is not damage: it stops the run
    fault = _read_fault(e)
    if fault is not None:
        what = f"{fault.filename}: {fault.strerror}" if fault.filename else fault.strerror
        cause = ("the disk or its mount may be failing" if fault.errno == errno.EIO else
                 "permissions, the mount, too many open files")
        aside = Path(ckpt).with_name(f"damaged-{Path(ckpt).name}")
        raise ConfigError(f"{ckpt} cannot be read now ({what}). That need not be damage in its files, so it is left as "
                          f"it is: fix the cause ({cause}) and run the same command again; to resume from the checkpoint "
                          f"before instead, set it aside: mv {ckpt} {aside}") from None
    if _not_the_files(e): return False  # RuntimeErrors, raised as they are: the files' sums have passed
    return isinstance(e, (OSError, EOFError, KeyError, RuntimeError, json.JSONDecodeError, pickle.UnpicklingError,
                          CheckpointException))


def _not_the_files(e: BaseException) -> bool:
    """Whether a load error (or, for DCP's CheckpointException, a rank's) is the machine's, not the files': memory, a
    collective between ranks that timed out or lost a peer, the GPU. Counted as damage, it set a good checkpoint aside."""
    failures = getattr(e, "failures", None)
    errors = [e, *((f[0] if isinstance(f, tuple) else f) for f in failures.values())] if isinstance(failures, dict) else [e]
    machine = (torch.OutOfMemoryError, torch.distributed.DistError, *((torch.AcceleratorError,) if hasattr(torch, "AcceleratorError") else ()))
    return any(isinstance(x, machine) or (isinstance(x, RuntimeError) and "CUDA error" in str(x)) for x in errors)


def _reason(e: BaseException) -> str:
    "The last line of an error's message (DCP's include whole tracebacks), at most 300 characters."
    return ([l.strip() for l in str(e).splitlines() if l.strip()] or [type(e).__name__])[-1][:300]


def _rng_state() -> dict:
    "This process's random states: the CPU's and its own GPU's (not every visible GPU's: a resume may be shown fewer)."
    s = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available(): s["cuda"] = torch.cuda.get_rng_state()  # the current device: this rank's (`setup`)
    return s


def _set_rng_state(s: dict):
    torch.set_rng_state(s["torch"])
    cuda = s.get("cuda")
    if cuda is None or not torch.cuda.is_available(): return  # saved on a CPU, or resumed on one
    if isinstance(cuda, (list, tuple)):  # checkpoints before: every visible GPU's state, this rank's at its device's index
        i = torch.cuda.current_device()
        if i >= len(cuda): return  # fewer GPUs were visible then: this one's state was not saved
        cuda = cuda[i]
    torch.cuda.set_rng_state(cuda)


def _saved(cls, d: dict):
    "`cls` (ModelConfig or TrainingConfig) from a meta.json section; fields unknown to this version are left out."
    names = {f.name for f in dataclasses.fields(cls)}
    return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in d.items() if k in names})


def _shapes(cfg: ModelConfig) -> dict:
    "Name → shape of every tensor in the state_dict of `HyMo(cfg)`, built on the meta device (no memory, no init)."
    with torch.device("meta"): return {k: tuple(v.shape) for k, v in HyMo(cfg).state_dict().items()}


UNTRAINED = ("run_dir", "sample_prompt", "sample_tokens")  # settings that are not how a run trains (run_dir: where it lives)


def _how_it_trains(config: dict) -> dict:
    """A `Config.to_dict()`, or a meta.json's `config`, without `UNTRAINED`: what two runs must share to train alike. A
    setting newer than the checkpoint is its default there (a new setting's default is how HyMo trained before it)."""
    default = json.loads(json.dumps(Config(ModelConfig(), TrainingConfig()).to_dict()))
    return {sec: {k: v for k, v in {**default[sec], **(config.get(sec) or {})}.items() if k not in UNTRAINED}
            for sec in ("model", "train")}


def resume_changes(saved: dict, # The `config` a checkpoint's meta.json holds (`Config.to_dict()`)
                   model_cfg: ModelConfig, train_cfg: TrainingConfig, # This run's
                   step: int, # The checkpoint's step
                  ) -> list[str]:
    "Raise `ConfigError` if the checkpoint's weights cannot fit this model; return warnings for every other changed setting."
    saved, then, now = _then_and_now(saved, model_cfg, train_cfg)
    diff = {sec: "; ".join(f"{k}: {then[sec].get(k)!r} -> {v!r}" for k, v in now[sec].items() if then[sec].get(k) != v)
            for sec in ("model", "train")}
    old_model, old_train = _saved(ModelConfig, saved["model"]), _saved(TrainingConfig, saved["train"])
    if diff["model"] and _shapes(old_model) != _shapes(model_cfg):
        raise ConfigError(f"the checkpoint at step {step} holds weights of other shapes ({diff['model']}): a resumed run "
                          "keeps its architecture, so give it the config it was started with (its config.yaml: --config RUN_DIR/config.yaml) "
                          "without overrides of these, or give a new run_dir=... to start afresh")
    notes = [f"{sec} settings differ from the checkpoint's: {d}" for sec, d in diff.items() if d]
    old_w, new_w = (c.eval_batches * c.micro_batch_size for c in (old_train, train_cfg))
    if old_w != new_w:  # a smaller micro-batch after running out of memory, say
        keep = f", e.g. eval_batches={old_w // train_cfg.micro_batch_size}" if old_w % train_cfg.micro_batch_size == 0 else ""
        notes.append(f"validation reads up to {new_w} windows (eval_batches × micro_batch_size), not {old_w}: val_loss after step "
                     f"{step} is measured on other text than before; keep the product at {old_w} to compare it{keep}")
    if jump := schedule_jump(old_train, train_cfg, step):
        notes.append(f"the learning rate after step {step} jumps from {jump[0]:.3f} to {jump[1]:.3f} of its peak (the schedule "
                     "moved)" + (EXTEND if train_cfg.max_steps > old_train.max_steps else ""))
    return notes


def _then_and_now(saved: dict, model_cfg: ModelConfig, train_cfg: TrainingConfig) -> tuple[dict, dict, dict]:
    "A checkpoint's `config` (its data_dir made absolute), and `_how_it_trains` of it and of this run's settings."
    if isinstance(kept := saved["train"].get("data_dir"), str):  # runs before 2026-12 kept it as given: relative to where
        saved = {**saved, "train": {**saved["train"], "data_dir": os.path.abspath(os.path.expanduser(kept))}}  # they ran
    now = _how_it_trains(json.loads(json.dumps(Config(model_cfg, train_cfg).to_dict())))  # tuples as lists, as meta.json has
    return saved, _how_it_trains(saved), now  # (without run_dir: a default one is named only when resuming)


SAME_STEPS = ("max_steps", "micro_batch_size", "log_every", "eval_every", "eval_batches", "ckpt_every", "keep_last_k",
              "max_bad_steps", "activation_checkpointing", "compile", "wandb", "wandb_project")
# settings that leave a step's numbers as they were (but for rounding: micro_batch_size splits the same global batch
# otherwise, as another number of ranks does); max_steps moves the schedule, compared step by step


def steps_differ(saved: dict, # A `Config.to_dict()`: the settings the logged steps trained with
                 model_cfg: ModelConfig, train_cfg: TrainingConfig, # This run's
                 step: int, last: int, # The checkpoint's step; the last step logged
                ) -> bool:
    "Whether this run's steps `step + 1 .. last` differ from those `saved` trains: a setting of how it trains, or the schedule."
    saved, then, now = _then_and_now(saved, model_cfg, train_cfg)
    old = _saved(TrainingConfig, saved["train"])
    return (then["model"] != now["model"] or any(then["train"].get(k) != v for k, v in now["train"].items() if k not in SAME_STEPS)
            or any(schedule_jump(old, train_cfg, s) is not None for s in range(step, last)))  # step s + 1 trains at lr(s)


EXTEND = "; to extend a finished run without the jump, resume a checkpoint from before its decay"  # `Trainer.load` says which


def schedule_jump(saved: TrainingConfig, # The schedule a checkpoint was trained on
                  train_cfg: TrainingConfig, # The one a resume gives it
                  step: int, # The checkpoint's step
                 ) -> tuple[float, float] | None:
    "The learning-rate multipliers after `step` by the two schedules, (saved, new), where they differ; else None."
    try: a = wsd_schedule(step, saved)
    except ValueError: return None  # a run from before a decay_fraction > 0 meant at least one decay step: no longer valid
    b = wsd_schedule(step, train_cfg)
    return (a, b) if abs(a - b) > 1e-9 else None


def _lines(path: Path) -> list[str]:
    "A JSON-lines file's lines, each ending in a newline; damaged bytes kept as they were (`surrogateescape`)."
    if not path.exists(): return []
    return [l if l.endswith("\n") else l + "\n"
            for l in path.read_text(encoding="utf-8", errors="surrogateescape").splitlines(keepends=True)]


def _write_lines(path: Path, lines: list[str]):
    """Write a small file whole: beside itself, on the disk, then renamed over it (a kill or a power cut leaves old or new;
    a full disk or a Ctrl-C as it writes leaves the old, and no `NAME.tmp` beside it)."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "w", encoding="utf-8", errors="surrogateescape") as f: f.write("".join(lines)); to_disk(f)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError): tmp.unlink(missing_ok=True)  # (its own error would hide the one that matters)
        raise
    to_disk(path.parent)


def _metrics(line: str) -> dict | None:
    "A metrics line as a dict with an integer `step`, or None if it is not one (a line cut short by a crash)."
    try: m = json.loads(line)
    except ValueError: return None
    return m if isinstance(m, dict) and isinstance(m.get("step"), int) else None


def _finite(x):
    "`x`, or None for a NaN or infinite number: metrics.jsonl writes those as null, meta.json's history as NaN."
    return None if isinstance(x, float) and not math.isfinite(x) else x


def trim_metrics(run_dir: Path, # The run folder, whose metrics.jsonl is trimmed
                 step: int, # The step the run resumes from: the lines of later steps go
                 log=print, why: str = "steps this run redoes",
                 history: list[dict] | None = None): # The resumed checkpoint's: the line of steps whose lines stay
    """Keep `metrics.jsonl`'s lines up to `step`; later ones (steps a crashed run will redo) move to `metrics.discarded.jsonl`.
    Given the `history` of the checkpoint resumed, the lines of its steps must also hold its losses: another branch's
    (after a rewind) move too, and the line's own lines that a rewind set aside come back, in step order."""
    f, d = Path(run_dir) / "metrics.jsonl", Path(run_dir) / "metrics.discarded.jsonl"
    ours = {h["step"]: h for h in history or [] if isinstance(h, dict) and "step" in h}
    def on_line(m):  # the history's losses of that step (a step it lacks: kept); the first step after a branch point
        h = ours.get(m["step"], {}) if m else {}  # has the same loss on both branches, so one line is as good as the other
        return m is not None and m["step"] <= step and all(_finite(m.get(k)) == _finite(v) for k, v in h.items())
    keep, drop = [], []
    for line in _lines(f): (keep if on_line(_metrics(line)) else drop).append(line)
    have, back, stay = {_metrics(l)["step"] for l in keep}, [], []
    for line in _lines(d) if history else []:  # lines of the resumed line of steps, set aside by the rewind from it
        m = _metrics(line)
        if on_line(m) and m["step"] in ours and m["step"] not in have: have.add(m["step"]); back.append(line)
        else: stay.append(line)
    if not drop and not back: return
    if drop:  # in this order a crash part-way loses no line (at worst one is in both files)
        with open(d, "a", encoding="utf-8", errors="surrogateescape") as out: out.writelines(drop)
    _write_lines(f, sorted(keep + back, key=lambda l: _metrics(l)["step"]))
    if back: _write_lines(d, stay + drop)
    later = sum(1 for l in drop if (m := _metrics(l)) is None or m["step"] > step)  # a cut line: a crash's last
    if later: log(f"metrics.jsonl: {later} lines {f'after step {step} ' if step >= 0 else ''}({why}) moved to metrics.discarded.jsonl")
    if len(drop) > later: log(f"metrics.jsonl: {len(drop) - later} lines of another line of steps (a branch since set aside) "
                              "moved to metrics.discarded.jsonl")
    if back: log(f"metrics.jsonl: {len(back)} lines of the resumed checkpoint's steps back from metrics.discarded.jsonl")


def check_gdn_kernel(m: ModelConfig, device: torch.device):
    "Refuse, before the data and the model, a GDN kernel `device` cannot run: Triton off a GPU, or 'auto' on one with chunks other than 64."
    if m.gdn_kernel == "triton" and device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ConfigError(f"gdn_kernel=triton needs a CUDA GPU and this run is on {device.type}: use "
                          "gdn_kernel=auto (Triton on a GPU, PyTorch elsewhere) or torch, or set TRITON_INTERPRET=1 "
                          "to run the kernels in Triton's interpreter (slow: for checking them)")
    if m.gdn_kernel == "auto" and device.type == "cuda" and _load_triton("rule") is not None:  # else the PyTorch path, any chunk
        check_triton_chunk(m.gdn_chunk_size, "auto")


def split_micro_batches(cfg: TrainingConfig, world_size: int) -> int:
    "Micro-batches per rank per optimiser step; `ConfigError` if the global batch does not split over the ranks."
    B, G = cfg.micro_batch_size, cfg.global_batch_size
    n = G // B
    if n % world_size:
        fix = f"global_batch_size={B * world_size * math.ceil(n / world_size)}"
        if G % world_size == 0: fix += f" or micro_batch_size={G // world_size}"
        raise ConfigError(f"global_batch_size={G} is {n} micro-batch{'es' * (n != 1)} of {B}, which do not split over {world_size} "
                          f"ranks: make global_batch_size a multiple of micro_batch_size × ranks, e.g. {fix}")
    return n // world_size


# %% [markdown]
# Two processes training in one run folder (the same command started twice, or a requeued job
# while the old one still runs) would both resume from the same checkpoint, write the same
# `step_...` folders over each other and interleave `metrics.jsonl`. So the process that trains in
# a folder holds an exclusive lock on its `.lock` file for as long as it lives (`flock`: the
# operating system drops it when the process ends, however it ends, so a crash leaves no stale
# lock). A second process is refused with the first one's pid and host; another `Trainer` in the
# same process (a notebook re-running a cell) shares the lock. Of two such `Trainer`s, only the one
# made last trains (`fit` refuses the other): it resumed from what the folder held when it was made,
# and the older one would write over whatever the newer did there, a rewind to an older checkpoint
# included.
#
# A run also refuses a folder that holds files but nothing of a run (`run_dir=.` in a project, or
# a folder with a `config.yaml` of your own): it would write its `config.yaml`, `summary.json` and
# `loss.png` over files of those names. A folder with something only a HyMo run writes (its `.lock`,
# `metrics.jsonl`, a `checkpoints/step_...` folder, `wandb/hymo_run_id`) is a run's, even one that
# crashed before its first checkpoint; a project's own `checkpoints/` or `wandb/` folder is not. Hidden
# files alone (a `.DS_Store`, a `.gitkeep`) leave a folder empty enough.

# %%
#| export
_HELD_LOCKS: dict[Path, object] = {}  # run folder -> its open .lock file, for the life of this process
_FOLDER_USERS: dict[Path, weakref.ref] = {}  # run folder -> the Trainer of this process made in it last
RUN_MARKS = (".lock", "metrics.jsonl", "checkpoints/step_...", "wandb/hymo_run_id")  # what only a HyMo run writes


def is_run_folder(d: Path) -> bool:
    "Whether folder `d` holds one of `RUN_MARKS` (any `...step_NNNNNN...` name in checkpoints/: set aside or unfinished too)."
    d = Path(d)
    if any((d / n).exists() for n in RUN_MARKS if not n.startswith("checkpoints/")): return True
    ours = re.compile(r"(?:(?:" + ASIDE + r")-)?" + CKPT_PREFIX + r"\d{6,}(?:-\d+)?(?:\.tmp)?")  # as this code names them
    return (d / "checkpoints").is_dir() and any(ours.fullmatch(c.name) for c in (d / "checkpoints").iterdir())


def lock_run_dir(run_dir: Path) -> str | None:
    "Lock `run_dir/.lock` for this process; None if it is ours now, else who holds it."
    import fcntl, socket
    if _held_here(run_dir): return None
    key = Path(run_dir).resolve()
    f = open(key / ".lock", "a+")
    try: fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0); who = f.read().strip() or "another process"; f.close()
        return who
    f.seek(0); f.truncate(); f.write(f"pid {os.getpid()} on {socket.gethostname()}\n"); f.flush()
    _HELD_LOCKS[key] = f
    return None


def run_dir_holder(run_dir: Path) -> str | None:
    "Who trains in `run_dir` now (its `.lock` held by a live process), without taking the lock; None if no one."
    import fcntl
    if _held_here(run_dir): return None  # this process: a trainer in a notebook
    try: f = open(Path(run_dir) / ".lock")  # read-only: never made here
    except OSError: return None
    with f:
        try: fcntl.flock(f, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError: return f.read().strip() or "another process"
        except OSError: return None  # a file system without flock: no one can be seen
        fcntl.flock(f, fcntl.LOCK_UN)
    return None


def _held_here(run_dir: Path) -> bool:
    "Whether this process holds `run_dir`'s lock (the open `.lock` is still that folder's file)."
    held = _HELD_LOCKS.get(Path(run_dir).resolve())
    return held is not None and _same_file(held, Path(run_dir).resolve() / ".lock")


def _same_file(f, path: Path) -> bool:
    "Whether the open file `f` is still the file at `path` (not one of a folder deleted and made again)."
    try: return os.fstat(f.fileno()).st_ino == path.stat().st_ino
    except OSError: return False


# %% [markdown]
# ## The trainer

# %%
#| export
class NonFiniteError(RuntimeError):
    "Too many consecutive steps had a non-finite loss or gradient."


class Trainer:
    "Builds the model, optimisers and data for a `Config`, and trains with exact resume."
    no_val_why: str | None = None  # why there is no validation loss, where there is none (`setup_data` says)

    def __init__(self, model_cfg: ModelConfig, # The architecture
                 train_cfg: TrainingConfig, # The run
                 run_dir: str | Path | None = None, # Run folder (default: train_cfg.run_dir, else runs/<name>-<time>)
                 resume: str | Path | bool = True, # A checkpoint folder, True (latest in the run folder, if any) or False
                 name: str = "hymo", # Preset name, used in the default run folder
                 quiet: bool = False): # No progress bar or prints (tests)
        # `load_config`'s checks, also for configs changed in code (`dataclasses.replace` checks nothing): copies, as they normalise
        model_cfg, train_cfg = validate_config(dataclasses.replace(model_cfg), dataclasses.replace(train_cfg))
        self.given_data_dir = train_cfg.data_dir  # as given: a relative one is named so in an error
        if train_cfg.data_dir:  # absolute in config.yaml and the checkpoints: `--config RUN/config.yaml` works from any folder
            train_cfg = dataclasses.replace(train_cfg, data_dir=os.path.abspath(os.path.expanduser(train_cfg.data_dir)))
        self.mcfg, self.cfg, self.quiet, self.name = model_cfg, train_cfg, quiet, name
        self.d = setup_distributed()
        self.auto_dir = not (run_dir or train_cfg.run_dir)  # a new timestamped folder, whose name may still move on
        self.run_dir = Path(run_dir or train_cfg.run_dir or new_run_dir(name, self.d)).expanduser()
        if self.run_dir.exists() and not self.run_dir.is_dir():
            raise ConfigError(f"run_dir={self.run_dir} is a file: give a folder, new or an earlier run's")
        self.accum = split_micro_batches(train_cfg, self.d.world_size)
        if train_cfg.precision == "bf16" and self.d.device.type == "cpu" and not self.d.distributed:
            raise ConfigError("precision=bf16 on one CPU process: its model computes in fp32 (bf16 comes from autocast on "
                              "a GPU, or FSDP's policy under torchrun); use precision=auto or fp32 here")
        check_gdn_kernel(model_cfg, self.d.device)

        # first: preparing the default corpus is the slow part of a first run. Together: a dataset one node cannot
        # read stops every rank with one line, not only that one (the others would wait in the next collective)
        self.data_check = None  # setup_data's `ContentsCheck` of every byte of the data, read as the first steps train
        self._together(self.setup_data, Path(train_cfg.data_dir or "the bundled corpus"))
        if self.data_dir is not None and self.run_dir.resolve() == self.data_dir.resolve():  # None: synthetic tokens
            raise ConfigError(f"run_dir and data_dir are the same folder ({self.run_dir}): the run would write its "
                              "checkpoints and tokenizer.json into the dataset; give the run a folder of its own")

        torch.manual_seed(train_cfg.seed)
        self.model = parallelize(build_hymo(model_cfg, device=self.d.device), train_cfg, self.d)
        self.moes = self.model.moe_layers()  # in depth order: their gate biases are updated after every step
        self.optimizers = build_optimizers(self.model, train_cfg)
        for opt in self.optimizers:
            for g in opt.param_groups: g.setdefault("peak_lr", g["lr"])
        self.dtype = resolve_precision(train_cfg, self.d.device)
        single_gpu_autocast = self.d.device.type == "cuda" and self.dtype == torch.bfloat16 and not self.d.distributed
        self.matrices = BF16Matrices(self.model, self.dtype, compiled=train_cfg.compile) if single_gpu_autocast else None  # cast once per step
        self.flops_per_token = self.model.flops_per_token(train_cfg.seq_len)  # a window of one document; see `forward_backward`
        self.flops_per_key = self.model.flops_per_token(train_cfg.seq_len, 1) - self.model.flops_per_token(train_cfg.seq_len, 0)
        self.step, self.bad_steps, self.consecutive_bad, self.history = 0, 0, 0, []
        self.saved_step, self.stopped_by = None, None  # the step of the last checkpoint this Trainer wrote; see `fit`
        self.branched_from = None  # the checkpoint `--resume` gave this run (another folder's, or an older one of its own), in every meta.json
        self.foreign_start = False  # continuing another folder's checkpoint: what this folder logged before is another run's
        self.new_line = False  # a rewind, a branch or settings that change the steps: ones wandb has logged are redone otherwise
        self.saved_settings = None  # the resumed checkpoint's config (meta.json): a finish written again records it
        self._train_iter = iter(self.train_loader)
        self.resume_warnings: list[str] = []
        if not self.auto_dir:  # a folder that may exist: refused if foreign, locked before resuming changes anything in it
            self._refuse_a_foreign_folder()
            self._lock_run_dir()
            self._finish_cut_renames()
        self._resume(resume)
        self._create_run_dir()  # only now: a mistake leaves no empty run folder
        self._lock_run_dir()  # a new folder: now that it exists
        self._remove_partial_checkpoints()
        self._note_kept_folders()
        _FOLDER_USERS[self.run_dir.resolve()] = weakref.ref(self)  # the folder's Trainer in this process now (see `fit`)

    def _note_kept_folders(self):
        "Say what the folders set aside (`damaged-`, `superseded-`) and the finished copies hold: pruning never deletes them."
        if not self.d.is_main: return
        kept = sorted([p for p in (self.run_dir / "checkpoints").glob("*-step_*") if p.is_dir()] +
                      [p for p in self.run_dir.glob("finished-step_*") if p.is_dir()], key=lambda p: p.name)
        if not kept: return
        size = sum(f.stat().st_size for p in kept for f in p.rglob("*") if f.is_file())
        self.log(f"note: {self.run_dir} keeps {len(kept)} folder{'s' * (len(kept) > 1)} that keep_last_k never prunes "
                 f"({f'{size / 1e9:.1f} GB' if size >= 1e9 else f'{size / 1e6:.1f} MB'}: "
                 f"{', '.join(p.name for p in kept[:4])}{', ...' if len(kept) > 4 else ''}); delete those you no longer need")

    def _create_run_dir(self):
        "Create the run folder (rank 0); a new timestamped one that another run took first moves on to the next name."
        made = [None]
        def create():
            if not self.d.is_main: return
            if self.auto_dir: made[0] = str(_create_new_run_dir(self.run_dir))
            else: self.run_dir.mkdir(parents=True, exist_ok=True)
        try: self._together(create, self.run_dir)
        except OSError as e:
            raise ConfigError(f"cannot create run_dir={self.run_dir} ({e.strerror}): give a folder you can write to") from None
        if self.auto_dir:
            if self.d.distributed: dist.broadcast_object_list(made, src=0)
            self.run_dir = Path(made[0])

    def _refuse_a_foreign_folder(self):
        "Refuse a `run_dir` that holds files but nothing of a run: the run's own files would overwrite those of the same names."
        d = self.run_dir
        try:  # hidden files (.DS_Store, .ipynb_checkpoints) are nobody's work; an unreadable folder is refused by the lock
            ours = (not self.d.is_main or not d.is_dir() or is_run_folder(d)
                    or not any(not f.name.startswith(".") for f in d.iterdir()))
        except OSError: ours = True
        run = d.parent if d.name == "checkpoints" else d.parent.parent if d.parent.name == "checkpoints" else None
        ours = self._agree(ours)
        if not ours and run is not None and is_run_folder(run):
            raise ConfigError(f"run_dir={d} is {'the checkpoints of' if d.name == 'checkpoints' else 'a checkpoint of'} the run "
                              f"in {run}: give run_dir={shell_word(run)} to continue it, or --resume a checkpoint of it with a new "
                              "run_dir=... to branch from it")
        if not ours:
            raise ConfigError(f"run_dir={d} holds files but is not a HyMo run folder (it has none of {', '.join(RUN_MARKS)}): "
                              "a run writes config.yaml, metrics.jsonl, loss.png, summary.json and model.safetensors into "
                              "its folder, over any files of those names; give a new or empty run_dir=...")

    def _lock_run_dir(self):
        "Rank 0 locks the run folder if it exists (see `lock_run_dir`); every rank raises if another process holds it."
        who = None
        if self.d.is_main and self.run_dir.is_dir():
            try: who = lock_run_dir(self.run_dir)
            except OSError as e:  # a file system without flock (some network mounts): train, unguarded, and say so
                if e.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS): raise
                self.log(f"warning: cannot lock {self.run_dir} ({e.strerror}): nothing stops a second run from writing it")
        if not self._agree(who is None):
            raise ConfigError(f"run_dir={self.run_dir} is in use by another run ({who or 'see rank 0'}): wait for it to "
                              "finish or stop it, or give another run_dir=...")

    def setup_data(self):
        """Set `data_dir`, `tokenizer_json`, `train_loader` and `val_loader` (None without a validation split; a benchmark
        on synthetic tokens overrides this). The tokenizer is read now and kept: the finished run's copy is the one it
        trained with, even if the dataset is prepared again, moved or deleted meanwhile (the shards stay open)."""
        self.data_dir = Path(self.cfg.data_dir).expanduser() if self.cfg.data_dir else self._prepare_default()
        given = self.given_data_dir
        try: manifest = check_compatible(self.data_dir, self.mcfg.vocab_size)
        except DataError as e:
            if not given or os.path.isabs(os.path.expanduser(given)) or self.data_dir.exists(): raise
            raise DataError(f"{e} (data_dir={given} is relative: it is found from the current folder, {os.getcwd()}, "
                            "not from a config file's)") from None
        V, v = self.mcfg.vocab_size, manifest["vocab_size"]
        if 2 * v <= V:  # fits, but most rows of the embedding and the tied output head would never be a token
            asked = (manifest.get("source") or {}).get("vocab_size")  # None: a given tokenizer (or an older manifest)
            fix = (f"prepare the data with --vocab-size {V}, or set vocab_size={v}" if isinstance(asked, int) and asked < V
                   else f"set vocab_size={v}" + (f" (its tokenizer learned {v:,} of the {asked:,} tokens asked for: the "
                                                 "text has no more pairs worth merging)" if isinstance(asked, int) else ""))
            self.log(f"warning: {self.data_dir} was tokenized with {v:,} tokens and the model has vocab_size={V:,}: "
                     f"{V - v:,} rows of the embedding (tied to the output head, whose softmax still covers them) are never "
                     f"a token: {fix}")
        self.tokenizer_json = read_tokenizer(self.data_dir)
        mk = lambda split, accum: TokenLoader(self.data_dir, split, self.cfg.seq_len, self.cfg.micro_batch_size,
                                              rank=self.d.rank, world_size=self.d.world_size, seed=self.cfg.seed,
                                              doc_masking=self.cfg.doc_masking, accum=accum, eval_only=split == "val")
        self.train_loader = mk("train", self.accum)  # epochs of whole optimiser steps: the same data on any world size
        has_val = sum(s["tokens"] for s in self.train_loader.manifest["splits"].get("val", {}).get("shards", [])) > 0
        self.val_loader = None
        if not has_val:
            self.no_val_why = f"{self.data_dir} has no validation split"
            self.log(f"{self.no_val_why}: no validation loss is reported")
        else:
            try: self.val_loader = mk("val", 1)
            except DataError as e:  # fewer tokens than a sequence, or windows than a micro-batch: train anyway, and say so
                self.no_val_why = str(e).split(": use ")[0]  # (the advice is in the warning below)
                self.log(f"warning: no validation loss is reported: {e} (prepare with a larger --val-fraction)")
        if given:  # the bundled corpus's bytes were all read as prepare_default found it intact. Each node checks the
            # copy it reads (on its own disk, or the one all share), its ranks a share each
            self.data_check = ContentsCheck([L for L in (self.train_loader, self.val_loader) if L], self.d.local_rank,
                                            self.d.local_world_size)
            if not self.data_check.sums:
                self.log(f"warning: {self.data_dir} was prepared by an older HyMo: its manifest has no shard checksums, so "
                         "bytes changed on disk are not found as it trains. The command that prepared it prepares it "
                         "again with them (as the same data, which resumes)")

    def _data_damaged(self, wait: bool = False):
        """Raise what this rank's share of the `ContentsCheck` found: a damaged shard, or one it could not read. At once,
        or (`wait`) once it has read its share: `save` waits, so that no checkpoint holds a step trained on unchecked bytes."""
        if wait and self.data_check and self.data_check.running():
            self.log(f"the checkpoint of step {self.step} waits for the check of {self.data_dir}'s bytes to finish (no "
                     "checkpoint holds a step trained on bytes not yet checked)")
        found = self.data_check and (self.data_check.wait() if wait else self.data_check.error())
        if isinstance(found, DataError):
            raise DataError(f"{found}. The run stopped at step {self.step} without saving it (no checkpoint is written "
                            "before every shard is checked)")
        if found: raise found

    def data_summary(self) -> str:
        "One line on the data: its folder, each split's tokens, and how many epochs `max_steps` optimiser steps read."
        L, T = self.train_loader, self.cfg.seq_len
        val = L.manifest["splits"].get("val", {}).get("tokens", 0)  # the shards' lengths, checked when they opened
        epochs = self.cfg.max_steps * self.accum / L.steps_per_epoch  # an epoch: `steps_per_epoch` micro-batch steps
        return (f"data: {self.data_dir} (train {L.n_tokens:,} tokens, {L.n_windows:,} windows of seq_len {T}; "
                f"val {val:,} tokens): max_steps={self.cfg.max_steps:,} reads "
                f"{f'{epochs:,.0f}' if epochs >= 100 else f'{epochs:.3g}'} epoch{'s' * (epochs != 1)}")

    def _prepare_default(self) -> Path:
        "Rank 0 prepares the bundled corpus (once, cached); the others then find it in the cache."
        from hymo.training.data import default_cache_dir
        bar = not self.quiet and _bar_shows()  # as the training bar: not into a log file
        try: self._together(lambda: self.d.is_main and prepare_default(vocab_size=self.mcfg.vocab_size, progress=bar),
                            default_cache_dir())
        except OSError as e:
            raise DataError(f"cannot write the data cache {e.filename or default_cache_dir()} ({e.strerror}): set "
                            "HYMO_CACHE=... to a folder you can write to") from None
        return prepare_default(vocab_size=self.mcfg.vocab_size, progress=False)  # prepared: found by its fingerprint

    @staticmethod
    def _whole(ckpt: Path) -> bool:
        "Whether checkpoint folder `ckpt` has every file a complete one has (DCP's `.metadata`, meta.json, each rank's)."
        try: ranks = json.loads((ckpt / "meta.json").read_text())["world_size"]
        except (OSError, ValueError, KeyError, TypeError): return False
        return (ckpt / ".metadata").exists() and all((ckpt / f"rank{r}.pt").exists() for r in range(ranks))

    def _finish_cut_renames(self):
        "Rename the `.tmp` checkpoints whose rename alone was cut short (`cut_short_renames`): resumed from, not written over."
        def finish():
            if not self.d.is_main: return
            for tmp in cut_short_renames(self.run_dir):
                os.replace(tmp, tmp.with_suffix(""))
                self.log(f"{tmp} was complete (only its rename was cut short): it is now the checkpoint {tmp.with_suffix('').name}")
        self._together(finish, self.run_dir)

    def _remove_partial_checkpoints(self):
        "Remove `.tmp` checkpoint folders whose writing was cut short (a kill, a second Ctrl-C): never read, only space."
        if not self.d.is_main: return
        done = list_checkpoints(self.run_dir)
        newest = checkpoint_step(done[-1]) if done else -1
        for tmp in tmp_checkpoints(self.run_dir):  # only the names `save` writes: `step_best.tmp` is yours
            if self._whole(tmp) and checkpoint_step(tmp.with_suffix("")) > newest:  # complete, but not this step's
                self.log(f"warning: {tmp} looks complete and is newer than every checkpoint, but its meta.json names "
                         f"another step: it is left as it is")
                continue
            shutil.rmtree(tmp, ignore_errors=True)
            self.log(f"removed {tmp}, a checkpoint whose writing was cut short")

    def _listed(self) -> list[Path]:
        "Rank 0's `list_checkpoints` on every rank (on a network file system another node's listing may lag a rename)."
        done = [list_checkpoints(self.run_dir) if self.d.is_main and not self.auto_dir else []]  # a new folder holds none
        if self.d.distributed: dist.broadcast_object_list(done, src=0)
        return done[0]

    def _resume(self, resume):
        "Load what `resume` names: a checkpoint folder, True (the newest readable one in the run folder, if any) or False."
        done = self._listed()
        def not_finished():  # e.g. checkpoints/ deleted to free space: training again would start at step 0
            finished = [n for n in ("model.safetensors", "summary.json") if (self.run_dir / n).exists()]
            if finished and not done:
                raise ConfigError(f"{self.run_dir} holds a finished run's {' and '.join(finished)} but no checkpoint to "
                                  f"continue from: training there would start again at step 0 and replace them. Give a "
                                  f"new run_dir=..., or move {' and '.join(finished)} out of it to start afresh in that folder")
        self._together(not_finished, self.run_dir)  # every rank refuses, even if only one sees the files
        if resume is False or resume is None:
            if done:
                raise ConfigError(f"{self.run_dir} already holds checkpoints of a run (newest: {done[-1].name}); starting "
                                  "afresh in it would mix two runs in one folder, and pruning would delete one's checkpoints: "
                                  "give a new run_dir=..., or leave out --no-resume to continue that run")
            return
        if resume is not True:
            p = Path(resume).expanduser()
            newest = (_json_dict(done[-1] / "meta.json") or {}) if done else {}
            own = p.resolve().parent == (self.run_dir / "checkpoints").resolve()  # an older checkpoint of this folder
            same = _how_it_trains(json.loads(json.dumps(Config(self.mcfg, self.cfg).to_dict()))) == _how_it_trains(newest.get("config") or {})
            if newest.get("branched_from") == str(p.resolve()) and done[-1].resolve() != p.resolve() and (same or not own):
                # the same command again (a requeued job); a rewind with other settings (a new learning rate) is a new rewind
                self.log(f"{self.run_dir} began from {p} and has trained on since: resuming its newest checkpoint "
                         f"(to begin from {p.name} once more, change a setting or set aside the checkpoints after it)")
                resume = True
            elif ((aside := set_aside_as(p.name)) and aside[0] != "replaced" and own and not p.exists()
                  and (p.parent / aside[1] / "meta.json").exists()):
                # the same command again (a requeued job): before the first new checkpoint, or with the same settings since
                if done and (done[-1].name == aside[1] or same):
                    self.log(f"{p.name} was renamed back to {aside[1]} when a run resumed it: resuming the newest "
                             "checkpoint, as the same command given again does")
                    resume = True
                else:  # the run has trained on from it since, and other settings go back to it: a new rewind
                    self.log(f"{p.name} was renamed back to {aside[1]} when a run resumed it: resuming {aside[1]}")
                    p = p.parent / aside[1]
        if resume is not True:
            if not (p / "meta.json").exists():  # a run folder, or its checkpoints/, given for one of its checkpoints
                listed = list_checkpoints(p)
                inside = listed or (list_checkpoints(p.parent) if p.name == "checkpoints" else [])
                what = (f"is {'a run' if listed else 'the checkpoints'} folder, not a checkpoint: give one of "
                        f"its checkpoints, e.g. {inside[-1]}" if inside else
                        ("is a finished run's model, kept when the run was trained further (`python -m hymo.generate` "
                         "reads it), not a checkpoint" if p.is_dir() and p.name.startswith("finished-step_") else
                         "is not a complete checkpoint (no meta.json)" if p.is_dir() else
                         "is a file, not a checkpoint folder" if p.exists() else "does not exist")
                        + ": --resume takes a checkpoint folder, RUN/checkpoints/step_NNNNNN (leave it out to continue "
                          "run_dir's newest)")
                raise ConfigError(f"{p} {what}" + (f"; the checkpoints in {self.run_dir}: {[c.name for c in done]}" if done else ""))
            if p.name.endswith(".tmp"):
                raise ConfigError(f"{p} is a checkpoint whose writing was cut short: give a complete one, or leave out "
                                  "--resume to use the newest complete one")
            self._resume_given(p, done, own); return
        damaged = []
        for ckpt in reversed(done):  # every rank takes the same branch: `load` agrees on damage before DCP's collectives
            try: self.load(ckpt); break
            except BaseException as e:
                if not _unreadable(e, ckpt): raise  # the run's settings, or memory: every checkpoint would fail alike
                damaged.append(ckpt)
                self.log(f"warning: checkpoint {ckpt} cannot be read ({_reason(e)}); trying the one before")
        if damaged and len(damaged) == len(done):
            raise ConfigError(f"no checkpoint in {self.run_dir / 'checkpoints'} can be read ({', '.join(c.name for c in damaged)}; "
                              "the warnings above say why): restore one, or give a new run_dir=... to start afresh")
        self._set_aside(damaged, "damaged", "it will not be read again")

    def _resume_given(self, p: Path, done: list[Path], own: bool):
        "Load checkpoint `p` given by `--resume` (`own`: one of this folder's); `_resume` has ruled out a requeued rewind or branch."
        if done and not own:  # another folder's checkpoint into a folder with a run of its own: two runs in one
            raise ConfigError(f"{p} is not a checkpoint of run_dir={self.run_dir}, which holds a run of its own "
                              f"(newest: {done[-1].name}); continuing from {p} there would mix two runs and prune "
                              "one's checkpoints: leave out --resume to continue that run, or give a new run_dir=... "
                              f"to continue from {p.name}")
        try: self.load(p)
        except BaseException as e:
            if not _unreadable(e, p): raise
            raise ConfigError(f"{p} cannot be read ({_reason(e)}): give another checkpoint, or leave out --resume "
                              "to use the newest readable one") from None
        self.branched_from = str(p.resolve())  # a branch, or a rewind: the same command later continues it
        self.foreign_start = not own  # a folder without checkpoints may hold the metrics and wandb id of a run that crashed early
        self.new_line = True
        # a rewind sets aside the checkpoints not on `p`'s line: the newer ones, and an earlier rewind's branch when `p`
        # is a checkpoint that rewind set aside (a damaged checkpoint later would fall back onto that other branch)
        other = [c for c in done if checkpoint_step(c) > self.step or not on_line_of(c, self.history)] if own else []
        if other: self._set_aside(other, "superseded", f"the run now continues from {p.name}, and it is not on that "
                                  "line of steps: left as a checkpoint it would outrank the new ones, or be resumed from")
        plain = p.with_name(f"{CKPT_PREFIX}{self.step:06d}")
        if own and p.name != plain.name:  # one set aside before: it, and its line's older ones set aside with it
            kept = [(c, c.with_name(a[1])) for c in sorted(p.parent.iterdir()) if c != p and c.is_dir()
                    and (a := set_aside_as(c.name)) and a[0] == "superseded" and checkpoint_step(c.with_name(a[1])) < self.step
                    and isinstance((_json_dict(c / "meta.json") or {}).get("history"), list) and on_line_of(c, self.history)]
            self._put_back([*kept, (p, plain)])

    def _put_back(self, pairs: list[tuple[Path, Path]]):
        """Rename each set-aside checkpoint of the line a run resumes (`superseded-step_...`) to its plain name, once every
        rank has read what it needs: checkpoints of the run again, which a plain resume after a crash falls back on."""
        if self.d.distributed: dist.barrier()
        if not self.d.is_main: return
        for c, plain in pairs:
            if plain.exists(): continue  # a checkpoint of that step on the same line already: c stays a copy
            try: os.replace(c, plain)
            except OSError as e:
                self.log(f"warning: could not rename {c} back to {plain.name} ({e}); a plain resume would not find it")
            else: self.log(f"renamed {c.name} back to {plain.name}: a checkpoint of the run's line again")

    def _set_aside(self, ckpts: list[Path], why: str, then: str) -> list[Path]:
        """Rename each checkpoint folder to `{why}-step_...` (kept, never deleted), once every rank has read what it needs;
        return the new names (rank 0's; none on the other ranks)."""
        if self.d.distributed: dist.barrier()
        if not self.d.is_main: return []
        done = []
        for c in ckpts:
            dest, n = c.with_name(f"{why}-{c.name}"), 2
            while dest.exists(): dest, n = c.with_name(f"{why}-{c.name}-{n}"), n + 1
            try: os.replace(c, dest)
            except OSError as e:
                self.log(f"warning: could not set the {why} {c} aside ({e}); it stays in the run folder")
            else:
                self.log(f"kept the {why} {c.name} as {dest}: {then}")
                done.append(dest)
        return done

    def _agree(self, ok: bool) -> bool:
        "Whether `ok` holds on every rank (one all-reduce when distributed), so that all ranks take the same branch."
        if not self.d.distributed: return ok
        flag = torch.tensor([float(ok)], device=self.d.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        return bool(flag.item())

    def _together(self, fn, where: Path):
        """Run `fn` on this rank; an error on any rank is then raised on every rank (one all-reduce when distributed).
        A rank that raised alone would leave the others waiting in the next collective until the timeout."""
        error = None
        try: fn()
        except Exception as e: error = e
        if not self.d.distributed:
            if error is not None: raise error
            return
        # 0: fine; an OSError's errno; above every errno, a user's mistake or the data's (its own one line there: a
        # DataError stays one, as `hymo.train` says how to resume after it), else anything else
        mine = (0 if error is None else 20_002 if isinstance(error, DataError) else 20_001 if isinstance(error, ConfigError)
                else error.errno if isinstance(error, OSError) and error.errno else 20_000)
        code = torch.tensor([mine], device=self.d.device)
        dist.all_reduce(code, op=dist.ReduceOp.MAX)  # the worst of the ranks'
        if error is not None: raise error
        code = int(code)
        if code == 20_002: raise DataError(f"another rank stopped on {where}: its message says why")
        if code == 20_001: raise ConfigError(f"another rank refused {where}: its message says why")
        if code == 20_000: raise RuntimeError(f"another rank failed with {where}: see its log")
        if code: raise OSError(code, f"{os.strerror(code)} (on another rank)", str(where))

    def log(self, *a):
        if self.d.is_main and not self.quiet: print(*a, flush=True)

    def autocast(self):
        "bf16 autocast for a single GPU process; FSDP's policy handles the distributed case; fp32 on CPU."
        if self.d.device.type == "cuda" and self.dtype == torch.bfloat16 and not self.d.distributed:
            return torch.autocast("cuda", dtype=torch.bfloat16)
        return nullcontext()


# %% [markdown]
# ### One GPU: each matrix cast to bf16 once per optimiser step
#
# Under autocast the parameters stay fp32 and every matrix product casts its weight to bf16, every
# time it runs: 32 micro-batches per step cast each of the 750M preset's 1.18 B matrix entries 32
# times (and the backward casts each bf16 weight gradient to fp32 before adding it to `.grad`). The
# casts give the same bf16 numbers all step long, since the weights change only at the optimiser
# step. `BF16Matrices` makes them once per step instead:
#
# * `refresh()` (before the first micro-batch of a step) copies the fp32 masters into bf16 leaf
#   tensors, one `_foreach_copy_` for all of them;
# * `swapped()` puts the copies into the modules for a micro-batch's forward *and* backward (with
#   activation checkpointing the backward runs parts of the forward again, and must see the same
#   weights), and puts the masters back afterwards. Outside it the model holds its fp32 masters,
#   so the optimisers, checkpoints and evaluation see what they always saw;
# * `collect()` adds the copies' bf16 gradients into the masters' fp32 `.grad` after every
#   micro-batch, and drops them. Eager PyTorch has no fused kernel for a `_foreach_add_` of mixed
#   dtypes: it falls back to one unvectorised kernel per tensor, about 330 of them, 6.9 ms of GPU
#   time per micro-batch on an H200 for the 11.8 GB it moves. When the trainer compiles (`compile:
#   true`, the GPU presets), `add_into` runs the same `_foreach_add_` compiled on the GPU (inductor
#   fuses it, converting as it loads): 5.4 ms, and the
#   750M step went from 6.66–6.68 to 6.59–6.61 s (three alternating pairs in one process), with
#   identical gradients.
#
# The arithmetic is the same as autocast's: the products get the same bf16 operands, and the
# masters' gradients are the same fp32 sums of the same bf16 gradients. The check below runs both
# on the CPU (deterministic) and finds every gradient equal bit for bit. It also pins down which
# parameters may be copied: those that reach a product only through autocast's cast. These are
# the weights of every `nn.Linear` but the MoE router, which computes in fp32 on purpose
# (chapter 30), and the routed experts' stacked weights, which `experts_grouped` casts itself. The
# tied embedding (an index lookup in fp32, and the loss's head), the depthwise convolution (the
# prelude's kernel reads fp32 weights), the norms and the GDN gate parameters stay as they are.
#
# On an H200 the 750M step (32 micro-batches) went from 6.79 to 6.72 s, alternating in one process
# (results chapter). FSDP has its own version of this: its mixed-precision policy casts each
# block's shard as it gathers it, so `BF16Matrices` is only for the single-GPU autocast path.

# %%
#| export
def _add_into_eager(dst: list[torch.Tensor], src: list[torch.Tensor]): torch._foreach_add_(dst, src)
_add_into_compiled = torch.compile(_add_into_eager, dynamic=False)  # compiled at the first call


def add_into(dst: list[torch.Tensor], # fp32 tensors, added to in place
             src: list[torch.Tensor], # Tensors of the same shapes, any float dtype
             compiled: bool = True, # Compile it on a GPU (fused kernels for mixed dtypes); eager when False or on a CPU
            ):
    "`dst[i] += src[i]` for every i, as one `_foreach_add_`."
    if dst: (_add_into_compiled if compiled and dst[0].is_cuda else _add_into_eager)(dst, src)


class BF16Matrices:
    "bf16 copies of the matrices that autocast would cast at every use, refreshed once per optimiser step."
    def __init__(self, model: nn.Module, # The (possibly compiled or checkpoint-wrapped) HyMo
                 dtype: torch.dtype = torch.bfloat16, # Autocast's dtype
                 compiled: bool = False): # Add the gradients through a compiled `add_into` (the trainer: when it compiles)
        from hymo.models.moe import DeepSeekMoE
        routers = {id(m.gate) for m in model.modules() if isinstance(m, DeepSeekMoE)}
        self.compiled = compiled
        self.slots = []  # (module, attribute, fp32 master, bf16 copy)
        for mod in model.modules():
            if isinstance(mod, DeepSeekMoE): names = ("w1", "w2", "w3")
            elif isinstance(mod, nn.Linear) and id(mod) not in routers: names = ("weight",)
            else: continue
            for n in names:
                master = mod._parameters[n]
                self.slots.append((mod, n, master, nn.Parameter(master.detach().to(dtype))))
        self.masters = [s[2] for s in self.slots]
        self.copies = [s[3] for s in self.slots]

    @torch.no_grad()
    def refresh(self):
        "Copy the masters into the bf16 copies (after an optimiser step or a checkpoint load)."
        for c in self.copies: c.grad = None  # a micro-batch that failed before `collect` must not leak into this step
        torch._foreach_copy_(self.copies, self.masters)

    @contextmanager
    def swapped(self):
        "The copies in the modules for the duration (forward and backward); the masters back afterwards."
        for mod, n, _, c in self.slots: mod._parameters[n] = c
        try: yield
        finally:
            for mod, n, m, _ in self.slots: mod._parameters[n] = m

    @torch.no_grad()
    def collect(self):
        "Add the copies' gradients to the masters' (fp32) and drop them."
        pairs = [(m, c) for m, c in zip(self.masters, self.copies) if c.grad is not None]
        for m, c in pairs:
            if m.grad is None: m.grad = torch.zeros_like(m)
        add_into([m.grad for m, _ in pairs], [c.grad for _, c in pairs], self.compiled)
        for _, c in pairs: c.grad = None


# %% [markdown]
# The check: the tiny model under CPU autocast, two micro-batches accumulated as the trainer does,
# once through autocast's casts and once through the copies.

# %%
def _accumulated_grads(model, batches, mats=None):
    "Parameters' gradients after accumulating `batches` under bf16 autocast, through `mats` if given; and the last loss."
    for p in model.parameters(): p.grad = None
    if mats is not None: mats.refresh()
    for tok, tgt in batches:
        with mats.swapped() if mats else nullcontext():
            with torch.autocast("cpu", dtype=torch.bfloat16): loss, _ = model(tok, targets=tgt)
            (loss / len(batches)).backward()  # outside autocast, as the trainer runs it
        if mats is not None: mats.collect()
    return [p.grad.clone() for p in model.parameters()], loss.detach()

torch.manual_seed(0)
_cfg = load_config("hymo_tiny").model
_m = build_hymo(_cfg, device="cpu")
_mats = BF16Matrices(_m)
_batches = [(torch.randint(0, _cfg.vocab_size, (2, 64)), torch.randint(0, _cfg.vocab_size, (2, 64))) for _ in range(2)]
_buffers = {n: b.clone() for n, b in _m.named_buffers()}  # the MoE's counts change in training: same start for both
g_cast, l_cast = _accumulated_grads(_m, _batches)
with torch.no_grad():
    for n, b in _m.named_buffers(): b.copy_(_buffers[n])
g_copy, l_copy = _accumulated_grads(_m, _batches, _mats)
test_eq(l_copy, l_cast)
test_eq([torch.equal(a, b) for a, b in zip(g_copy, g_cast)], [True] * len(g_cast))  # every gradient, bit for bit
test_eq({p.dtype for p in _m.parameters()}, {torch.float32})  # the masters are back in the modules
test_eq(all(c.grad is None for c in _mats.copies), True)
print(f"{len(_mats.copies)} matrices copied, {sum(c.numel() for c in _mats.copies):,} of "
      f"{sum(p.numel() for p in _m.parameters()):,} parameters; all {len(g_cast)} gradients equal")


# %% [markdown]
# ### One optimiser step
#
# `train_step` consumes `accum` micro-batches, each through `forward_backward`, inside
# `accumulation` (what holds for the whole step: the bf16 copies refreshed, or FSDP's weights kept
# gathered). The benchmark's profile calls the same two, so what it records is what a step runs.
# Each micro-batch also returns its model FLOPs, for the MFU (see the question on MFU below).
# The loss of each micro-batch is divided by `accum` so the
# accumulated gradient is the mean over the global batch; FSDP's reduce-scatter then averages over
# ranks. That is exact when every micro-batch has the same number of targets, as the main loss
# always does. With `doc_masking`, MTP head $k$ does not predict across a document's end, so a
# micro-batch loses $k$ of its $B T$ targets per document boundary, and the step's MTP loss is a mean
# of per-micro-batch means: a micro-batch of many short documents weighs its targets slightly more.
# At 4 × 4096 tokens and documents of a few hundred tokens that is well under 1 % of a head's
# weight; weighting by counts instead would need every rank's count before the first backward.
# The learning rate of every group is set from the schedule before the step, from its
# `peak_lr`, so the schedule has no state beyond `step`.
#
# Under FSDP the gradients cross the network once per optimiser step, not once per micro-batch:
# `set_requires_gradient_sync(False)` before every micro-batch but the last makes each rank add its
# unsharded gradients locally, in fp32 (FSDP upcasts a bf16 gradient to the policy's
# `reduce_dtype` before it accumulates), and the last backward reduce-scatters the sum. Syncing
# every micro-batch would give the same numbers (up to the order of fp32 additions) for `accum`
# times the traffic: 32 micro-batches per step on one node of 8 GPUs is 4 per rank, so 4
# reduce-scatters of every gradient instead of one. The price is memory: each rank holds an
# unsharded fp32 gradient of every parameter between micro-batches (4.9 GB for `hymo_750m`).
#
# The weights go the same way. By default FSDP gathers a block's weights before its forward, frees
# them after it, gathers them again for its backward and frees them after that: two all-gathers
# per block and micro-batch, each also casting the fp32 shard to bf16. The weights cannot change
# within a step, so `fsdp_step` keeps each block's gathered bf16 weights from the first forward of
# a step to the last backward (`set_reshard_after_forward(False)`, and
# `set_reshard_after_backward` only on the last micro-batch): one all-gather per block and step,
# for the memory of one unsharded bf16 copy of the blocks (2.3 GB for `hymo_750m`). At the end of
# the step every block is sharded again, as FSDP left it, so evaluation and checkpoints see the
# usual layout.
#
# A step cut short (an exception, or a Ctrl-C in a notebook, between or inside its micro-batches)
# must leave nothing for the next. The micro-batches before the cut summed their gradients into
# FSDP's unsharded buffers, which `zero_grad` does not see, so `fsdp_step` drops them
# (`drop_unsharded_grads`): a cut after the first of two micro-batches otherwise gave the next step
# a gradient norm of 6.02 where 3.75 is right. A cut inside a backward also leaves FSDP in the middle
# of its iteration, some blocks gathered and its end-of-backward callback marked as queued. Torch
# 2.13's `reset_iter_state` clears that; torch 2.11 has none, and `reset_fsdp_iteration` does the
# same from FSDP's internals (without it, the next backward never queued the callback, and the
# gradients it reduces were missing: a norm of 3.47 where 3.75 is right). A second Ctrl-C can cut
# that reset too, so each step begins by asking whether FSDP was left inside an iteration
# (`mid_iteration`) and resets it if so. The tests cut a step between its micro-batches, before its
# first forward, inside 16 different backwards and as the reset begins, each with FSDP's reset and
# with HyMo's; FSDP is idle and sharded after each, and the step run again equals a clean one.
#
# On one H200, through FSDP on a group of one GPU (`train_step.py --fsdp`, 32 micro-batches per
# step), reducing once per step took the 750M step from 9.09 to 7.85 s (one process, one after the
# other). Gathering once per step then measured 7.88 s, on another machine, and 2.4 GB more peak
# memory: with one GPU an all-gather is a local copy, so there is nothing to win there. What it
# removes is $2 \cdot \text{accum} - 1$ all-gathers per block and step between GPUs, not measured
# here (only one-GPU machines were lent). Most of what was left between the FSDP step and the
# autocast step on one GPU was NorMuon's handling of sharded matrices (chapter 50): with that fixed,
# 6.70 s against 6.67 s on one machine. The autocast path then gained `add_into` (above), which
# FSDP has no use for: 6.649 s against 6.473 s on the round's last machine (round 11 in the
# results chapter).
# A batch goes to the GPU from pinned (page-locked) host memory, without blocking. A copy from
# ordinary memory makes the host wait until the GPU has finished everything queued before it, the
# whole backward of the previous micro-batch, and the GPU then idles while the host queues the next
# forward. In a profile of the 750M model on an H200 the GPU's idle time fell from 21.4 to 10.4 ms
# per micro-batch when the copies stopped blocking (the profiler slows the host, which exaggerates
# such waits).

# %%
#| export
def _to_device(self: Trainer, batch) -> tuple:
    """`(tokens, targets, cu_seqlens or None)` on the device. With document masking the loader's
    `cu_seqlens` index the batch flattened to one row, so the batch is packed to `[1, B*T]`."""
    dev = self.d.device
    move = (lambda t: t.pin_memory().to(dev, non_blocking=True)) if dev.type == "cuda" else (lambda t: t.to(dev))
    tokens, targets = move(batch[0]), move(batch[1])
    if len(batch) < 3: return tokens, targets, None
    return tokens.view(1, -1), targets.view(1, -1), move(batch[2])


def _grad_norm(self: Trainer) -> torch.Tensor:
    "The global gradient norm before clipping; the gradients are clipped in place to `grad_clip` when it is > 0."
    params = [p for p in self.model.parameters() if p.grad is not None]
    clip = self.cfg.grad_clip if self.cfg.grad_clip > 0 else float("inf")
    norm = torch.nn.utils.clip_grad_norm_(params, clip, foreach=True)
    return norm.full_tensor() if hasattr(norm, "full_tensor") else norm


@contextmanager
def fsdp_step(model: nn.Module):
    "An FSDP optimiser step: each block keeps its gathered weights from its first forward to the last backward."
    drop_unsharded_grads(model, reset=mid_iteration(model))  # none after a whole step; a cut clean-up (a second Ctrl-C) left some
    model.set_reshard_after_forward(False)
    try: yield
    except BaseException:  # a step cut short (an exception, a Ctrl-C in a notebook): its micro-batches' sums dropped
        try: drop_unsharded_grads(model)
        except Exception as e:  # never in place of what cut the step; the next step drops the sums before it starts
            warnings.warn(f"after the step cut short, FSDP's gathered weights could not be resharded ({e!r})")
        raise
    finally:  # FSDP's own defaults again: blocks reshard after forward, the root (needed first in backward) does not
        model.set_reshard_after_forward(True)
        model.set_reshard_after_forward(False, recurse=False)
        model.set_reshard_after_backward(True)
        model.set_requires_gradient_sync(True)


def _param_groups(state) -> list:
    "An FSDP state's parameter groups (a list in torch 2.13, one group or None in older ones; none for no state)."
    groups = getattr(state, "_fsdp_param_groups", None)
    return groups if groups is not None else [g for g in [getattr(state, "_fsdp_param_group", None)] if g is not None]


def drop_unsharded_grads(model: nn.Module, reset: bool = True):
    """After an FSDP step cut short: the gradients its micro-batches summed *unsharded* (while `requires_gradient_sync`
    was off) dropped, and the gathered weights resharded. `zero_grad` sees only the sharded gradients, and FSDP's
    `reset_iter_state` keeps these sums: left alone, the next step's reduce-scatter would add them in."""
    from torch.distributed.fsdp import FSDPModule
    for m in model.modules():  # FSDP-2's internals (torch 2.11, 2.13), read with care: a torch without them skips the drop
        state = m._get_fsdp_state() if isinstance(m, FSDPModule) else None
        for p in (p for g in _param_groups(state) for p in getattr(g, "fsdp_params", ())):
            if hasattr(p, "unsharded_accumulated_grad"): p.unsharded_accumulated_grad = None  # the sum in reduce_dtype
            if getattr(p, "_unsharded_param", None) is not None: p._unsharded_param.grad = None  # else the sum sits here
    if not reset or not _started(model): return  # no forward yet: nothing gathered, and FSDP's lazy init has not made
    if hasattr(model, "reset_iter_state"): model.reset_iter_state()  # what this reads
    else: reset_fsdp_iteration(model)  # torch 2.11 has no reset_iter_state


def _started(model: nn.Module) -> bool:
    "Whether FSDP's lazy init has run (the root's first forward): before it, no iteration state exists."
    return getattr(model._get_fsdp_state(), "_is_root", None) is not None


def mid_iteration(model: nn.Module) -> bool:
    "Whether FSDP is left inside an iteration (a forward or backward cut, and its clean-up cut too): a group or state not idle."
    from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState
    if not _started(model): return False
    ctx = model._get_fsdp_state()._state_ctx
    return ctx.post_backward_final_callback_queued or any(
        s._training_state != TrainingState.IDLE or any(g._training_state != TrainingState.IDLE for g in _param_groups(s))
        for s in ctx.all_states)


def reset_fsdp_iteration(model: nn.Module):
    """For a torch without FSDP's `reset_iter_state` (2.11 has none; 2.13 has): the same reset after a forward or backward
    cut short, as 2.13 does it. The current stream waits for FSDP's collectives in flight, the iteration's trackers are
    cleared, every group idle and sharded. Left set, the marker of a queued end-of-backward callback kept the next
    backward from queueing its own: the gradients that callback reduces were missing (grad norm 3.47 where 3.75 is right,
    a bf16 step cut in its first micro-batch's backward)."""
    from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState
    root = model._get_fsdp_state()
    ctx, comm = root._state_ctx, root._comm_ctx
    ctx.post_backward_final_callback_queued, ctx.iter_forward_root = False, None  # first: the marker that matters most
    stream = root._device_handle.current_stream()
    wait = lambda event: event is not None and stream.wait_event(event)
    for name in ("all_gather_state", "reduce_scatter_state"):  # a collective's pending state (2.11's names; 2.13 keeps
        wait(getattr(getattr(comm, name, None), "event", None))   # a list of reduce-scatters)
        if hasattr(comm, name): setattr(comm, name, None)
    for rs in getattr(comm, "reduce_scatter_states", ()): wait(rs.event)
    for event in getattr(comm, "_last_post_reduce_events", {}).values(): wait(event)
    for name in ("reduce_scatter_states", "_last_post_reduce_events", "post_forward_order"):
        if hasattr(comm, name): getattr(comm, name).clear()
    for state in ctx.all_states:
        state._training_state = TrainingState.IDLE
        if hasattr(state, "_modules_to_run_forward"): state._modules_to_run_forward.clear()
        for group in _param_groups(state):
            if (ag := getattr(group, "_all_gather_result", None)) is not None:
                wait(ag.all_gather_event)
                if isinstance(ag.all_gather_work, dist.distributed_c10d.Work): ag.all_gather_work.wait()
            wait(getattr(group, "_post_reduce_event", None))
            wait(getattr(getattr(group, "_all_reduce_state", None), "event", None))
            if getattr(group, "_reshard_after_forward_event", None) is not None:
                group._wait_all_gather_streams_on_event(group._reshard_after_forward_event)
            for name in ("_all_gather_result", "_post_reduce_event", "_all_reduce_state", "_partial_reduce_output",
                         "_reshard_after_forward_event"):
                if hasattr(group, name): setattr(group, name, None)
            if hasattr(group, "_post_forward_indices"): group._post_forward_indices.clear()
            group._training_state = TrainingState.IDLE
            group.reshard()  # idle: back to the sharded parameters


def fsdp_micro_batch(model: nn.Module, last: bool):
    "Before a micro-batch: gradients reduce-scattered and weights freed only after the step's last backward."
    model.set_requires_gradient_sync(last)
    model.set_reshard_after_backward(last)


@contextmanager
def accumulation(self: Trainer):
    "Around the micro-batches of one step: the bf16 copies refreshed (one GPU), or FSDP's weights kept gathered."
    if self.matrices is not None: self.matrices.refresh()
    with fsdp_step(self.model) if hasattr(self.model, "set_requires_gradient_sync") else nullcontext(): yield


def forward_backward(self: Trainer, last: bool) -> tuple[dict, int, float]:
    """One micro-batch, forward and backward of `loss / accum`; `last` is the step's last. Returns its losses, its token
    count and its model FLOPs (with packed documents, attention counted within each document)."""
    if hasattr(self.model, "set_requires_gradient_sync"): fsdp_micro_batch(self.model, last)
    mats = self.matrices  # one GPU under autocast: bf16 copies of the matrices, made once per step
    batch = next(self._train_iter)
    tokens, targets, cu = _to_device(self, batch)
    flops = tokens.numel() * self.flops_per_token
    if cu is not None:  # the loader's boundaries, still on the host: no wait for the GPU
        flops += tokens.numel() * self.flops_per_key * (doc_keys_per_query(batch[2]) - self.cfg.seq_len / 2)
    with mats.swapped() if mats is not None else nullcontext():  # the copies for forward and backward
        with self.autocast(): loss, parts = self.model(tokens, targets=targets, cu_seqlens=cu)
        with stats_paused(self.moes):  # activation checkpointing's re-run forward must not count assignments again
            (loss / self.accum).backward()  # outside autocast: its backward ops run in the forward's dtypes anyway
    if mats is not None: mats.collect()
    return {"total": loss.detach(), **parts}, tokens.numel(), flops


def train_step(self: Trainer) -> dict:
    "One optimiser step over `accum` micro-batches; returns its metrics. Non-finite steps are skipped and counted."
    self.model.train()
    for opt in self.optimizers: opt.zero_grad(set_to_none=True)  # a step cut short (an exception, a second Ctrl-C in a
    for m in self.moes: m.expert_counts.zero_(); m.dropped_tokens.zero_()  # notebook) left its gradients and counts
                                                                           # (FSDP's unsharded ones: `fsdp_step` dropped them)
    totals, n_tokens, flops = {}, 0, 0.0
    with accumulation(self):
        for i in range(self.accum):
            parts, n, f = forward_backward(self, last=i == self.accum - 1)
            for k, v in parts.items(): totals[k] = totals.get(k, 0.0) + v.float() / self.accum
            n_tokens += n; flops += f
    losses = totals  # mean over the micro-batches: the total and each part
    if self.d.distributed:  # means over the ranks, the FLOPs too (each rank's documents differ)
        names = sorted(losses)
        stacked = torch.stack([losses[k] for k in names] + [torch.tensor(flops, device=self.d.device)])
        dist.all_reduce(stacked, op=dist.ReduceOp.AVG)
        losses, flops = dict(zip(names, stacked[:-1])), float(stacked[-1])
    gnorm = _grad_norm(self)
    lr_mult = wsd_schedule(self.step, self.cfg)
    finite = bool(torch.isfinite(gnorm)) and all(bool(torch.isfinite(v)) for v in losses.values())
    moe = {}
    if finite:
        for opt in self.optimizers:
            for g in opt.param_groups: g["lr"] = g["peak_lr"] * lr_mult
            opt.step()
        for i, m in enumerate(self.moes):
            for k, v in (m.update_gate_bias() or {}).items(): moe[f"moe{i}/{k}"] = float(v)
        self.consecutive_bad = 0
    else:
        for m in self.moes:  # this step's routing counts must not steer the bias
            m.expert_counts.zero_(); m.dropped_tokens.zero_()
        self.bad_steps += 1
        self.consecutive_bad += 1
    for opt in self.optimizers: opt.zero_grad(set_to_none=True)
    self.step += 1
    metrics = {"step": self.step, "loss": float(losses.pop("total")),
               **{f"loss/{k}": float(v) for k, v in losses.items()}, "grad_norm": float(gnorm), "lr_mult": lr_mult,
               "tokens": n_tokens * self.d.world_size, "flops": flops, "skipped": not finite, "bad_steps": self.bad_steps, **moe}
    if not finite and self.consecutive_bad > self.cfg.max_bad_steps:
        last = list_checkpoints(self.run_dir)
        fix = "lower the learning rate or check the data"
        raise NonFiniteError(f"{self.consecutive_bad} consecutive steps had a non-finite loss or gradient (step {self.step}); "
                             "stopping. " + (f"The last good checkpoint is {last[-1]}; {fix}, then resume from it." if last else
                                             f"No checkpoint was saved yet; {fix}, then start afresh."))
    return metrics

Trainer.accumulation, Trainer.forward_backward, Trainer.train_step = accumulation, forward_backward, train_step


# %% [markdown]
# ### Evaluation
#
# The validation loader yields the same windows every time: the first `eval_batches` ×
# `micro_batch_size` windows of the validation split, on any number of ranks. So validation losses
# are comparable across steps, and across runs with the same product (a resume that changes it is
# told so). Only the main next-token loss is reported as `val_loss`.

# %%
#| export
@torch.no_grad()
def evaluate(self: Trainer) -> float | None:
    "Mean main loss over `eval_batches` validation micro-batches, all ranks together (the same windows every call and on any number of ranks); None without a validation split. The MTP heads are not run."
    if self.val_loader is None: return None
    self.model.eval()
    try:  # back to training mode however it ends (an interrupt in a notebook, an OOM): eval mode has no capacity limit
        total = torch.zeros(2, device=self.d.device)  # (sum of counted micro-batch losses, their number)
        plan = self.val_loader.eval_plan(self.cfg.eval_batches)
        for (_, counted), batch in zip(plan, self.val_loader.eval_batches(self.cfg.eval_batches)):
            tokens, targets, cu = _to_device(self, batch)
            with self.autocast():
                _, parts = self.model(tokens, targets=targets, cu_seqlens=cu, mtp=False)  # the main loss is what is reported
            if counted: total += torch.stack([parts["main"].float(), torch.ones((), device=total.device)])
        if self.d.distributed: dist.all_reduce(total)  # the same pass on any number of ranks (chapter 60)
    finally: self.model.train()
    return float(total[0] / total[1].clamp_min(1))

Trainer.evaluate = evaluate


# %% [markdown]
# ### Saving and loading
#
# `get_state_dict` / `set_state_dict` from `torch.distributed.checkpoint.state_dict` give the
# model and both optimisers' state keyed by parameter names, whether the parameters are plain
# tensors or FSDP shards; that is what lets DCP reshard between world sizes. Buffers (the MoE EMA
# counts and gate biases) are part of the model's state dict.
#
# A checkpoint is written in five phases: the main rank makes a fresh `.tmp` folder; every rank
# writes its DCP shards and its own `rank{r}.pt` (random state, loader position); every rank reads
# back the files it wrote for their CRC-32; the main rank writes `meta.json`, the mark of a complete
# folder, only once every rank's file is in (a job killed while another rank was still writing would
# otherwise leave a half-written `rank1.pt` beside it); the main rank renames the folder. Each phase
# but the shards' ends with every rank agreeing that it went well (`_together`, one all-reduce; DCP's
# own write raises on every rank when one fails), so a full disk on one node makes every rank stop
# with the same one-line error. Before, the other ranks sat at a barrier until the failed rank's exit broke
# the connection (a traceback from gloo) or torchrun killed them (NCCL). Each step's line in
# `metrics.jsonl` and the end's artefacts (`finish`) go through `_together` the same way.
#
# A process that dies loses nothing the operating system has accepted; a machine that loses power
# loses what is still in its page cache. So every file of a checkpoint is flushed to the disk
# before the rename (DCP does this for its shards, `to_disk` for `rank{r}.pt` and `meta.json`),
# and the rename itself is flushed before the checkpoint it replaces is deleted: at every instant
# one complete checkpoint is on the disk. A `.tmp` folder left by a kill between the last write and
# the rename is complete only if it has DCP's `.metadata`, `meta.json` and every rank's file
# (`_whole`, with a `meta.json` of the step its name says); the next start finishes its rename and
# resumes from it. Were it left, the run would resume from the checkpoint before and delete the
# `.tmp` when it came to write that step again.

# %%
#| export
class _MetadataNoise(logging.Filter):
    "DCP's log of a damaged checkpoint's metadata, two tracebacks; the warning `_resume` prints names the same reasons."
    def filter(self, record): return not str(record.msg).startswith(("Global metadata is not found", "Rank local metadata is not found"))


@contextmanager
def _single_process_quiet():
    "Silence DCP's warning that it runs without a process group (the normal single-process case) and its metadata noise."
    import torch.distributed.checkpoint.state_dict_loader as loader
    log, noise = getattr(loader, "logger", logging.getLogger()), _MetadataNoise()  # torch 2.13's is the root logger
    log.addFilter(noise)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            yield
    finally: log.removeFilter(noise)


def save(self: Trainer) -> Path:
    "Write a complete checkpoint for the current step (temp folder, then rename), keep the last k."
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    self._together(lambda: self._data_damaged(wait=True), self.data_dir)  # nothing trained on unchecked bytes is saved
    root = self.run_dir / "checkpoints"
    final, tmp = root / f"{CKPT_PREFIX}{self.step:06d}", root / f"{CKPT_PREFIX}{self.step:06d}.tmp"
    def fresh_folder():
        if self.d.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)

    def own_file():  # every rank's; through a file: a full disk is an OSError, as elsewhere
        with open(tmp / f"rank{self.d.rank}.pt", "wb") as f:
            torch.save({"rng": _rng_state(), "loader": self.train_loader.state_dict()}, f)
            to_disk(f)

    sums = {}
    def own_sums():  # every rank reads back the files it wrote, while the page cache holds them
        sums.update({p.name: file_crc(p) for p in sorted(tmp.iterdir()) if file_rank(p.name) == self.d.rank})

    def meta_file():  # last, once every rank's file is in: a folder with meta.json is complete (`Trainer._whole`)
        if self.d.is_main:
            files = {name: s for rank in every for name, s in rank.items()}
            files.update({p.name: file_crc(p) for p in sorted(tmp.iterdir())  # DCP's .metadata, and any file it
                          if p.name not in files and p.name != "meta.json" and p.is_file()})  # names otherwise
            data = getattr(self.train_loader, "manifest", {})  # (benchmarks train on synthetic batches: none)
            meta = {"step": self.step, "bad_steps": self.bad_steps, "consecutive_bad": self.consecutive_bad,
                    "history": self.history, "world_size": self.d.world_size, "branched_from": self.branched_from,
                    "data_fingerprint": data.get("fingerprint"), "data_tokenizer_sha256": data.get("tokenizer_sha256"),
                    "config": Config(self.mcfg, self.cfg, name=self.name).to_dict(), "files": files}  # `--config CKPT` reads it
            meta["meta_crc32"] = meta_sum(meta)  # its own sum, last: a flipped digit of its step would skip a step
            with open(tmp / "meta.json", "w") as f: f.write(json.dumps(meta)); to_disk(f)

    def publish():  # complete on every rank: the rename makes it a checkpoint
        if not self.d.is_main: return
        replaced = final.with_name(f"replaced-{final.name}")  # a checkpoint of this step is never deleted before its successor is in place
        if final.exists(): shutil.rmtree(replaced, ignore_errors=True); os.replace(final, replaced)
        to_disk(tmp)  # every rank's files are in: the folder's entries on disk before the rename names it a checkpoint
        os.replace(tmp, final)
        to_disk(root)  # the rename itself on disk before an older checkpoint goes: a power cut keeps one whole
        for old in [replaced, *pruned(list_checkpoints(self.run_dir), self.cfg.keep_last_k)]:
            if not old.exists(): continue  # `replaced`, when there was no checkpoint of this step
            try: shutil.rmtree(old)
            except OSError as e: self.log(f"warning: could not remove the old checkpoint {old} ({e.strerror}); remove it by hand")

    try:
        self._together(fresh_folder, tmp)
        model_sd, optim_sd = get_state_dict(self.model, self.optimizers)
        with _single_process_quiet():
            dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(tmp))  # a failure raises on every rank
        self._together(own_file, tmp)  # on every rank (an all-reduce when distributed) before ...
        self._together(own_sums, tmp)
        every = [sums]
        if self.d.distributed: every = [None] * self.d.world_size; dist.all_gather_object(every, sums)
        self._together(meta_file, tmp)  # ... rank 0 marks the folder complete: a kill in between leaves it partial
    except BaseException as e:  # DCP wraps what it meets (a full disk, a Ctrl-C): raise that, as itself
        reraise_interrupt(e)  # a kill would leave the .tmp folder too; the next start removes it
        if self.d.is_main: shutil.rmtree(tmp, ignore_errors=True)  # it would only hold on to space (that may be short)
        disk = wrapped(e, OSError)
        if disk is None or disk.errno not in DISK_ERRORS: raise  # DCP's report, every rank's failure in it
        raise disk from None  # its own traceback; `python -m hymo.train` says it in one line
    self._together(publish, final)
    self.saved_step = self.step
    return final


def before_decay(meta: dict) -> TrainingConfig | None:
    """A checkpoint's training config (from its meta.json) if it has trained no step of its schedule's decay (its step is
    at most max_steps - decay_steps, by the config it was saved with), else None."""
    train, s = (meta.get("config") or {}).get("train"), meta.get("step")
    if not (isinstance(train, dict) and isinstance(s, int)): return None
    try: own = _saved(TrainingConfig, train)
    except TypeError: return None  # settings this version no longer takes
    return own if own.decay_steps and s <= own.max_steps - own.decay_steps else None


def pruned(done: list[Path], # A run's checkpoints, oldest first (`list_checkpoints`)
           keep_last_k: int, # How many of the newest are kept
          ) -> list[Path]:
    """The checkpoints a save deletes: all but the newest `keep_last_k` and the newest that has trained no step of its
    decay (`before_decay`), from which a finished run is trained further without the learning rate's jump back up."""
    old = done[:-keep_last_k]
    keep = next((c for c in reversed(done) if before_decay(_json_dict(c / "meta.json") or {})), None) if old else None
    return [c for c in old if c != keep]


def load(self: Trainer, ckpt: Path):
    "Restore everything from checkpoint folder `ckpt` (any world size for the weights and optimisers)."
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    ckpt, error = Path(ckpt), None
    try:  # this rank's own files first; all ranks then agree on them before DCP's collective load
        try: meta = json.loads((ckpt / "meta.json").read_text())
        except ValueError as e: raise CheckpointUnreadable(f"{ckpt / 'meta.json'} is damaged ({e})") from None
        if not isinstance(meta, dict): raise CheckpointUnreadable(f"{ckpt / 'meta.json'} is damaged (not a JSON object)")
        check_meta(ckpt, meta)
        check_files(ckpt, meta, self.d.rank, self.d.world_size)  # before anything reads them
        mine = ckpt / f"rank{self.d.rank}.pt"
        same_ranks = meta["world_size"] == self.d.world_size  # else DCP reshards and the loader position is recomputed
        extra = torch.load(mine, weights_only=False) if same_ranks else None  # missing: damaged, as a cut one is
        if not (ckpt / ".metadata").exists(): raise FileNotFoundError(f"{ckpt / '.metadata'} is missing")
    except Exception as e: error = e
    def no_read_fault():  # one rank's stops every rank (`_together`; then `_unreadable` says so), before any agrees on damage
        if (fault := _read_fault(error)) is not None: raise fault
    self._together(no_read_fault, ckpt)
    if error is not None and not _unreadable(error, ckpt): raise error
    if not self._agree(error is None):
        raise error or CheckpointUnreadable(f"another rank cannot read its files in {ckpt}")
    step, planned = meta["step"], (meta.get("config") or {}).get("train", {}).get("max_steps", meta["step"])
    if step > self.cfg.max_steps or step == self.cfg.max_steps < planned:  # nothing to train: finishing would export
        least = step if planned == step else step + 1                       # a model that never had its decay as final
        raise ConfigError(f"{ckpt} is at step {step} of a run planned for {planned}: with max_steps={self.cfg.max_steps} "
                          f"there is nothing to train{', and its weights never had their decay' if step < planned else ''}. "
                          f"Give max_steps={least} or "
                          f"more, or --resume an earlier checkpoint (in {ckpt.parent}) to branch a shorter run from it")
    # the weights' shapes first: a new vocab_size also means other data, and the shapes are what was changed
    notes = resume_changes(meta["config"], self.mcfg, self.cfg, meta["step"]) if "config" in meta else []
    # wandb has the steps logged past the checkpoint (before a crash), trained as run_dir/config.yaml says (each `fit`
    # writes it before its first step; a resume with other settings may have logged some): redone otherwise, a new line
    last = max((m["step"] for l in _lines(self.run_dir / "metrics.jsonl") if (m := _metrics(l))), default=0) if self.d.is_main else 0
    logged = meta.get("config")
    if (past := last > meta["step"]) and (self.run_dir / "config.yaml").exists():  # (nothing past it: nothing for wandb to drop)
        try: logged = load_config(str(self.run_dir / "config.yaml")).to_dict()
        except (ConfigError, OSError, ValueError): pass  # (cut short by a crash before it was written whole: the checkpoint's)
    self.new_line = past and logged is not None and steps_differ(logged, self.mcfg, self.cfg, meta["step"], last)
    old = (meta.get("config") or {}).get("train", {})  # the data and its order: checked here on any number of ranks
    if hasattr(self.train_loader, "check_same_data"):  # (benchmarks train on synthetic batches: nothing to check)
        try: self.train_loader.check_same_data({"fingerprint": meta.get("data_fingerprint"),
                                                "tokenizer_sha256": meta.get("data_tokenizer_sha256"),
                                                **{k: old[k] for k in ("seq_len", "seed") if k in old}}, str(ckpt))
        except DataError as e:  # most often the data_dir= of the run left out: name it
            if "data_dir" not in old or old["data_dir"] == self.cfg.data_dir: raise  # (both absolute; None: the bundled corpus)
            raise DataError(f"{e}. It trained with " + (f"data_dir={shell_word(old['data_dir'])}: give that to resume it" if old["data_dir"]
                            else "the bundled corpus: leave out data_dir= to resume it")) from None
    model_sd, optim_sd = get_state_dict(self.model, self.optimizers)
    state = {"model": model_sd, "optim": optim_sd}
    with _single_process_quiet():
        dcp.load(state, checkpoint_id=str(ckpt))  # a damaged shard raises on every rank
    settings = [[{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups] for opt in self.optimizers]
    set_state_dict(self.model, self.optimizers, model_state_dict=state["model"], optim_state_dict=state["optim"])
    for opt, groups in zip(self.optimizers, settings):  # the state (moments) resumes; the settings are this run's config
        for g, mine in zip(opt.param_groups, groups): g.update(mine)
    self.step, self.bad_steps, self.consecutive_bad = meta["step"], meta["bad_steps"], meta["consecutive_bad"]
    self.branched_from = meta.get("branched_from")
    self.history = meta["history"]
    self.saved_settings = meta.get("config")
    # the loader's position after the windows the saved run read in its epoch (none twice), in this run's micro-steps
    where = _saved_loader(ckpt, meta, extra)
    position = 0 if where is None else self.train_loader.step_after(where)
    if extra is not None:
        _set_rng_state(extra["rng"])
        saved = {"accum": 1, **extra["loader"]}  # written before the loader saved it: it then had none (1)
        ours = {"accum": self.accum, "micro_batch_size": self.cfg.micro_batch_size}
        self.train_loader.load_state_dict({**saved, **ours})  # the other settings (data, seed, seq_len, ranks) must match
        if any(saved[k] != v for k, v in ours.items()):  # another split of the batch, or another global batch
            self.train_loader.step = position
            G = lambda d: d["accum"] * d["micro_batch_size"] * d.get("world_size", self.d.world_size)
            notes.append(f"each rank's step was {saved['accum']} micro-batches of {saved['micro_batch_size']}, now "
                         f"{self.accum} of {self.cfg.micro_batch_size}: " + (
                             "the same global batch, so the same data" if G(saved) == G({**ours, "world_size": self.d.world_size})
                             else "the data continues in the saved run's epoch after the windows it had read there, and "
                                  "later epochs' order differs from the saved run's"))
    else:  # resharded resume: the data position follows from the windows consumed; the RNG streams stay as the seed left them
        self.train_loader.step = position
    self._train_iter = iter(self.train_loader)
    self.saved_step = self.step  # that checkpoint exists: a stop right away need not write it again
    home = Path(ckpt).resolve().parent.parent
    self.log(f"resumed from {ckpt} at step {self.step}" + ("" if home == self.run_dir.resolve() else
             f", in a new run folder (a branch: {home} is left as it is; give run_dir={shell_word(home)} to rewind that run instead)"))
    notes = [n + self._keep_before_decay(Path(ckpt)) if n.endswith(EXTEND) else n for n in notes]
    self.resume_warnings = notes
    for w in notes: self.log(f"warning: {w}")


def _keep_before_decay(self: Trainer, ckpt: Path) -> str:
    """Where a checkpoint from before the decay is, for a run resumed from `ckpt` with its schedule stretched (a finished
    run trained further): the newest of `ckpt`'s folder on its line that the new schedule continues without a jump. One
    of this run's is set aside as `before-decay-step_...` first: the resumed run's saves would prune it."""
    damaged = []
    def fits(c: Path) -> bool:  # on the resumed line, no decayed step trained, the new schedule's rate there, and whole
        meta = _json_dict(c / "meta.json") or {}
        if (own := before_decay(meta)) is None or meta["step"] >= self.step or not on_line_of(c, self.history): return False
        try:  # its rate by its own schedule without the decay (warmup, then the plateau) is the new schedule's there
            if abs(wsd_schedule(meta["step"], dataclasses.replace(own, decay_fraction=0.0))
                   - wsd_schedule(meta["step"], self.cfg)) > 1e-9: return False
        except ValueError: return False  # a schedule this version no longer takes
        try: check_files(c, meta, 0, 1)  # every rank's files: the one to resume must be readable
        except CheckpointUnreadable as e:
            damaged.append(f"{c} is one, but cannot be read ({e}): restore it from a copy")
            return False
        return True
    found = [None]
    if self.d.is_main:
        mine = []  # (step, folder) of the checkpoints beside `ckpt`, and of those set aside before for this
        for c in ckpt.parent.iterdir():
            why, name = set_aside_as(c.name) or ("", c.name)
            if why in ("", "before-decay") and re.fullmatch(CKPT_PREFIX + r"\d{6,}", name) and c.is_dir():
                mine.append((checkpoint_step(Path(name)), c))
        found[0] = next((c for _, c in sorted(mine, reverse=True) if fits(c)), None) or (damaged[:1] or [None])[0]
    if self.d.distributed: dist.broadcast_object_list(found, src=0)
    c, own = found[0], ckpt.resolve().parent == (self.run_dir / "checkpoints").resolve()
    if isinstance(c, str): return f": {c}"  # only a damaged one
    if c is None: return f": {ckpt.parent} keeps none (ckpt_every and keep_last_k decide which are kept)"
    if not own: return f": {c} is one (continue from it with a new run_dir=...)"
    if c.name.startswith("before-decay-"): return f": {c} is one, kept for that (--resume {shell_word(c)})"
    kept = self._set_aside([c], "before-decay", "pruning never deletes it: --resume it to extend this run without the "
                                              "learning rate's jump back up, or delete it once you no longer need it")
    where = kept[0] if kept else c  # (rank 0's name; the others do not log)
    return f": {where} is one, kept for that (--resume {shell_word(where)})"

def _saved_loader(ckpt: Path, meta: dict, extra: dict | None) -> dict | None:
    """Where `ckpt`'s run was in its data, for `TokenLoader.step_after`: rank 0's saved loader (its micro-steps, ranks,
    micro-batch and accumulation), else meta.json's optimiser step and global batch; None if neither is known."""
    try: state = extra["loader"] if extra is not None else torch.load(ckpt / "rank0.pt", weights_only=False)["loader"]
    except Exception: state = None  # a rank-0 file that cannot be read: the global batch in meta.json
    if state and "world_size" in state: return state
    G = (meta.get("config") or {}).get("train", {}).get("global_batch_size")
    return {"optimizer_step": meta["step"], "global_batch_size": G} if G else None


Trainer.save, Trainer.load, Trainer._keep_before_decay = save, load, _keep_before_decay

# %% [markdown]
# Why the sums: DCP loads a shard with one flipped bit without complaint, into a tensor that
# differs from the one it saved. `check_files` names the file. CRC-32's speed is measured after.

# %%
import torch.distributed.checkpoint as dcp

# %%
saved = {"w": torch.randn(256, 64, generator=torch.Generator().manual_seed(0))}
with tempfile.TemporaryDirectory() as d, _single_process_quiet():
    dcp.save(saved, checkpoint_id=d)
    sums = {p.name: file_crc(p) for p in Path(d).iterdir()}
    shard = Path(d) / "__0_0.distcp"
    data = bytearray(shard.read_bytes()); data[len(data) // 2] ^= 0x40; shard.write_bytes(bytes(data))
    back = {"w": torch.zeros(256, 64)}
    dcp.load(back, checkpoint_id=d)  # no error
    changed = int((back["w"] != saved["w"]).sum())
    print(f"DCP loaded it: {changed} of {saved['w'].numel()} weights differ from the saved ones")
    assert changed > 0
    test_fail(lambda: check_files(Path(d), {"files": sums}, rank=0, world_size=1), contains="__0_0.distcp has changed")
    check_files(Path(d), {"files": {k: v for k, v in sums.items() if k != "__0_0.distcp"}}, rank=0, world_size=1)
    check_files(Path(d), {"files": sums}, rank=1, world_size=2)  # rank 0's shard is not rank 1's to check
    meta_file = Path(d) / ".metadata"  # checked before the shard by name; a size is found before any bytes are read
    meta_file.write_bytes(meta_file.read_bytes()[::-1]); shard.write_bytes(shard.read_bytes()[:-1])
    test_fail(lambda: check_files(Path(d), {"files": sums}, rank=0, world_size=1), contains="__0_0.distcp holds")
test_eq([file_rank(n) for n in ("__3_0.distcp", "rank12.pt", ".metadata", "meta.json")], [3, 12, None, None])

# %%
with tempfile.TemporaryDirectory() as d:
    big = Path(d) / "big.bin"
    big.write_bytes(torch.randint(0, 256, (1 << 28,), dtype=torch.uint8, generator=torch.Generator().manual_seed(0)).numpy().tobytes())
    times = []
    for _ in range(3):
        t0 = time.perf_counter(); file_crc(big); times.append(time.perf_counter() - t0)
best = min(times)
print(f"CRC-32 of 256 MiB (in the page cache): {(1 << 28) / best / 1e9:.1f} GB/s")


# %% [markdown]
# ### The loop
#
# `fit` runs until `max_steps` (or `num_steps` more steps, which is how a test stops a run
# half-way). It logs a JSON line per step to `metrics.jsonl` (a skipped step's NaN loss as `null`:
# JSON has no NaN, and tools such as `jq` refuse it), shows a progress bar on a terminal, evaluates
# every `eval_every` steps and at `max_steps` (so the final validation loss is in `metrics.jsonl`
# and the loss curve too, not only in `summary.json`), checkpoints every `ckpt_every` steps and at the end, then writes the
# loss curve, a generated sample and `model.safetensors`. Every `log_every` steps, on the first
# and last step of the call, and whenever it evaluates, it also prints one line of metrics
# (`metric_line`), which stays in the scroll-back and in a job's log file. The line adds `moe dropped
# N%` while an MoE block's capacity (`moe_capacity_factor`) cuts more than 1 % of its routed
# assignments, the largest share of any block: in the tiny preset none for the first few steps, then
# about a quarter around steps 8 to 14, falling to a few per cent by step 30 as the gate biases
# even out the load (chapter 30); one that stays high asks for a larger capacity
# factor, or null (dropless). The bar is drawn only
# when stderr is a terminal (`_a_terminal`): in a log file each redraw would be one more line.
#
# With `wandb=true` the same metrics go to Weights & Biases: online when you are logged in, else
# offline into `run_dir/wandb` (`wandb sync run_dir/wandb/offline-run-*` uploads it later).
# `WANDB_MODE` (`offline`, `disabled`) decides instead where you set it.
#
# ::: {.callout-note collapse="true"}
# ## A resumed run in wandb
# Every part of a run (each resume starts one) is in the wandb group named after the run folder.
# Online, a resumed run also continues the *same* wandb run: its id is kept in
# `run_dir/wandb/hymo_run_id` and given back to `wandb.init`, so a run preempted ten times is one
# curve, not eleven. Steps trained again after a crash (those between the last checkpoint and the
# crash) are in `metrics.jsonl` once, rewritten, but wandb keeps the first copy: its steps only go
# forward. So a resume whose steps are not those of the first copy starts a new wandb run in the
# group: a rewind (`--resume` of an older checkpoint), a branch, or, where the crashed run logged
# steps past its checkpoint, settings that change those steps (a lower learning rate after a
# `NonFiniteError`, a `max_steps` that moves the schedule there; not `log_every`, `ckpt_every` or
# the like, `SAME_STEPS`); otherwise the new line's steps up to the old one's last would be dropped and the
# chart would show the abandoned line. That new wandb run is the new line's: a later `fit` of the
# same `Trainer` (a notebook training on in parts) continues it. Offline, each part is a run of its own, since syncing several offline folders of one id
# replaces rather than appends; the group keeps them together.
# :::
#
# A run is stopped from outside by Ctrl-C (SIGINT) or by a scheduler's SIGTERM (preemption, a time
# limit). Either one, during `fit`, is only *noted* (`StopSignals`): the step in flight finishes,
# every rank agrees that a stop was asked for (a signal may reach the ranks at different steps, and
# the checkpoint is collective), a checkpoint of that step is written, and `fit` returns with
# `stopped_by` set; `python -m hymo.train` then says where the checkpoint is and exits with
# 128 + the signal's number, as a killed process would. A signal while the last step's checkpoint is
# written lets it complete and stops the run there: the resume does the rest of the finish. (A
# SIGTERM during the finish itself, the final validation, sample and export, ends the process at
# once, without that line; nothing is lost either: `summary.json` is written last, and the same
# command finishes the run.) Nothing since the last checkpoint is lost, and the line printed last
# says how to resume: the same command, with `run_dir=` added if the run
# made a new timestamped folder, and without `--resume` or `--no-resume` (which would go back to
# an older checkpoint, or refuse the folder). A second Ctrl-C stops at once, without a checkpoint
# (run directly; under `torchrun`, below, it does not reach the ranks as a Ctrl-C).
#
# Two more ways a run loses its terminal are handled the same way, with a checkpoint of the step in flight: a
# hang-up (SIGHUP: the SSH session or the terminal window closed; a run started under `nohup` ignores it, and
# keeps ignoring it, though not under `torchrun`, below), and a reader of its output going away (`python -m hymo.train | head`, a `tee` that died). Python
# ignores SIGPIPE and raises `BrokenPipeError` at the next print instead, which would end the run with a
# traceback and lose every step since the last checkpoint; while `fit` runs, stdout and stderr are wrapped so
# that the first failed write (EPIPE, or EIO from a hung-up terminal) turns that stream off and asks for a stop,
# as SIGPIPE (exit status 141), with a line on the other stream if it still has a reader. `python -m hymo.train`
# guards its output from the start to the end the same way (`guarded_output`), so a reader gone before training
# begins stops the run after its first step, and one gone during the final export only silences the rest.
#
# Under `torchrun` the ranks run in sessions of their own, so a Ctrl-C in the terminal reaches
# torchrun alone. It passes the signal to every rank (each then stops as above, together) and
# reports it itself: it ends with a `SignalException` traceback and exit status 1, after the ranks
# have written their checkpoint. A second Ctrl-C reaches the ranks as SIGTERM, which they answer
# with a checkpoint too; a third makes torchrun exit at once and leaves the ranks to finish on their
# own (to stop them at once, signal the rank processes). torchrun catches SIGHUP as well and passes
# it on whatever `nohup` set, so under torchrun `nohup` alone does not keep a run alive past its
# terminal: add `--signals-to-handle SIGTERM,SIGINT` (torchrun then leaves SIGHUP to the ranks, which
# ignore it under `nohup`), or run inside tmux or screen.
#
# torchrun also waits for its workers only so long: it kills them 30 s after the signal unless told
# otherwise (`--shutdown-timeout`, or the `TORCH_ELASTIC_SHUTDOWN_TIMEOUT` variable), and at 750M
# the step in flight and a checkpoint of several GB can take about that long (on one H100 a step
# took 6.8 s and a rank's whole 10.1 GB checkpoint 17 to 22 s to a local disk,
# `benchmarks/ckpt_save.py`; a shared file system is slower). Give it a few minutes. A scheduler's
# own grace is usually short and not yours to set: at the time limit Slurm waits `KillWait` (a
# cluster setting, often 30 s) between SIGTERM and SIGKILL, so ask for an early signal instead
# (`#SBATCH --signal=TERM@300` with `srun torchrun ...`: SIGTERM five minutes before the limit). A
# worker killed mid-checkpoint loses the steps since the last one. In a run's first minutes the checkpoint may also
# wait for the check of the dataset's bytes (chapter 60's `ContentsCheck`, which no checkpoint goes ahead of) to
# finish, and says so: each node reads its copy of the data once, at most as long as `python -m hymo.data info` takes.

# %%
#| export
def metric_line(m: dict, # One step's metrics, as `fit` writes them to metrics.jsonl
                max_steps: int, # The run's last step
               ) -> str:
    "The printed line for one step: step, loss and its parts, validation loss, schedule, gradient norm, speed."
    parts = [f"step {m['step']}/{max_steps}", f"total loss {m['loss']:.4f}"]
    heads = [f"{k.removeprefix('loss/')} {v:.3f}" for k, v in m.items() if k.startswith("loss/")]
    if heads: parts[-1] += " (" + ", ".join(heads) + ")"
    if m.get("val_loss") is not None: parts.append(f"val {m['val_loss']:.4f}")
    parts += [f"lr x{m['lr_mult']:.3f}", f"grad {m['grad_norm']:.3f}", f"{m['tokens_per_s']:,.0f} tok/s"]
    if m.get("mfu") is not None: parts.append(f"mfu {m['mfu']:.1%}")
    drops = [v for k, v in m.items() if k.endswith("/moe_drop_frac")]  # each MoE block's share of routed assignments cut
    if drops and max(drops) > 0.01: parts.append(f"moe dropped {max(drops):.1%}")  # capacity too low, or routing collapsing
    if m.get("skipped"): parts.append("skipped: non-finite loss or gradient")
    return " | ".join(parts)


class _Guarded:
    """A text stream whose reader may go away (EPIPE: `| head` exited; EIO: the terminal hung up): it then writes
    nowhere and calls `on_lost(name)`, once."""
    def __init__(self, stream, name: str):
        self.stream, self.name, self.gone, self.on_lost = stream, name, False, None

    def _do(self, fn, *a):
        if self.gone: return None
        try: return fn(*a)
        except OSError as e:
            if e.errno not in (errno.EPIPE, errno.EIO): raise
            self.gone = True
            try: to_devnull(self.stream)
            except (OSError, ValueError): pass  # a stream without a file descriptor (a notebook's, pytest's)
            if self.on_lost: self.on_lost(self.name)

    def write(self, s: str) -> int:
        n = self._do(self.stream.write, s)
        return len(s) if n is None else n

    def writelines(self, lines):
        for line in lines: self.write(line)

    def flush(self): self._do(self.stream.flush)
    def __getattr__(self, name): return getattr(self.stream, name)


@contextmanager
def guarded_output():
    """While active, `sys.stdout` and `sys.stderr` are `_Guarded` (nested uses share them): a reader that goes away
    turns its stream off instead of raising `BrokenPipeError` wherever the next line is printed."""
    old = sys.stdout, sys.stderr
    if not isinstance(sys.stdout, _Guarded): sys.stdout = _Guarded(sys.stdout, "stdout")
    if not isinstance(sys.stderr, _Guarded): sys.stderr = _Guarded(sys.stderr, "stderr")
    try: yield sys.stdout, sys.stderr
    finally: sys.stdout, sys.stderr = old


_SIGPIPE, _SIGHUP = getattr(signal, "SIGPIPE", signal.SIGTERM), getattr(signal, "SIGHUP", None)  # POSIX: not on Windows


class StopSignals:
    """While active (in the main thread), SIGINT, SIGTERM and SIGHUP call `on_signal(signal)` instead of stopping, and so
    does stdout or stderr losing its reader (as SIGPIPE); a second SIGINT raises `KeyboardInterrupt`."""
    def __init__(self, on_signal: Callable, # Called with the `signal.Signals` received
                 announce: bool = True): # Print a line when a signal arrives (rank 0)
        self.on_signal, self.announce, self.received, self.old, self.hooks = on_signal, announce, None, {}, []
        self.interrupted = False  # a SIGINT came

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():  # signal handlers can only be set there
            wanted = [signal.SIGINT, signal.SIGTERM]
            if _SIGHUP is not None and signal.getsignal(_SIGHUP) is not signal.SIG_IGN: wanted.append(_SIGHUP)  # not under nohup
            self.old = {s: signal.signal(s, self._note) for s in wanted}
        self.output = guarded_output()
        streams = self.output.__enter__()
        self.hooks = [(s, s.on_lost) for s in streams]
        for s in streams: s.on_lost = self._lost
        for s in streams:
            if s.gone: self._lost(s.name)  # lost before this began (a data preparation's lines): stop after the first step
        return self

    def _note(self, signum, frame):
        if signum == signal.SIGINT and self.interrupted: raise KeyboardInterrupt  # the second Ctrl-C, not one after a SIGTERM
        self.interrupted |= signum == signal.SIGINT
        self.received = signal.Signals(signum)
        self.on_signal(self.received)
        if self.announce:
            print(f"\n{self.received.name}: stopping after this step with a checkpoint" +
                  " (Ctrl-C again stops at once, without one)" * (signum == signal.SIGINT), file=sys.stderr, flush=True)

    def _lost(self, which: str):
        if self.received is None:
            self.received = _SIGPIPE
            self.on_signal(_SIGPIPE)
        if self.announce:
            print(f"\n{which} was closed (its reader exited, or the terminal hung up): stopping after this step with a "
                  "checkpoint; the same command resumes", file=sys.stderr if which == "stdout" else sys.stdout, flush=True)

    def __exit__(self, *exc):
        for s, handler in self.old.items(): signal.signal(s, handler)
        for s, hook in self.hooks: s.on_lost = hook
        if self.hooks: self.output.__exit__(*exc)


# %% [markdown]
# `fit` is the loop around `train_step`: metrics, validation, checkpoints, stops. On a CPU it first
# checks the size of a step: `hymo_750m` there would take about 6 hours a step at 100 GFLOP/s
# ($4.4 \times 10^9$ FLOPs for each of 524 288 tokens) and some 15 GB for its weights, gradients and
# optimiser states (4 bytes each for the weights and gradients; NorMuon keeps one momentum and a
# number per row, AdamW two moments), so such a run begins with a line that says so rather than going quiet for hours
# (or being killed for memory without a word).

# %%
#| export
CPU_FLOPS = 1e11  # what a laptop CPU sustains in fp32 on these shapes, roughly: only for the warning below


def _warn_if_slow_on_cpu(self: Trainer):
    "A line before a CPU run whose steps would take more than ten minutes each (hymo_750m: hours, and some 15 GB)."
    step = self.flops_per_token * self.cfg.global_batch_size * self.cfg.seq_len
    if step / CPU_FLOPS < 600: return
    normuon, adamw = self.optimizers
    n = lambda opt: sum(p.numel() for g in opt.param_groups for p in g["params"])
    state_gb = (12 * n(normuon) + 16 * n(adamw)) / 1e9  # fp32 weights and gradients; NorMuon's momentum, AdamW's two moments
    self.log(f"warning: a step of this run is {step:.1e} FLOPs, about {step / CPU_FLOPS / 3600:.1f} h on a CPU at "
             f"{CPU_FLOPS / 1e9:.0f} GFLOP/s, and its weights, gradients and optimiser states take some {state_gb:.3g} GB. "
             "It is meant for GPUs (torchrun ... --config hymo_750m on CUDA); hymo_tiny trains on a CPU in minutes")


def fit(self: Trainer, num_steps: int | None = None) -> list[dict]:
    "Train until `max_steps`, or for `num_steps` more steps; returns this call's metrics."
    from tqdm.auto import tqdm
    end = self.cfg.max_steps if num_steps is None else min(self.cfg.max_steps, self.step + num_steps)
    self.stopped_by = None  # a stop asked for before fit, or one that ended the last call, does not stop this one
    user = _FOLDER_USERS.get(self.run_dir.resolve())  # the lock is the process's: two Trainers of a folder share it
    if user is not None and user() is not self:  # every rank alike: each process made its Trainers in the same order
        raise ConfigError(f"a newer Trainer in this process took over {self.run_dir} (it resumed there after this one "
                          f"was made, at step {self.step}): train with that one, or make a new Trainer to continue from "
                          "the folder's newest checkpoint. This one would write over what the other did there")
    done = _json_dict(self.run_dir / "summary.json") if self.d.is_main else None  # what `finish` wrote, if it did
    line = history_sum(self.history)  # a summary of this step but another line of steps (a rewind) is not this run's
    ours = done is not None and done.get("step") == self.step and done.get("history_crc32", line) == line
    lost = {}  # what the finish wrote that was deleted, moved or damaged since; a read fault (EIO, EACCES) stops every rank
    self._together(lambda: lost.update(self._lost_finish(done) if self.d.is_main and ours else {}), self.run_dir)
    if redo := not self._agree(not lost):  # `finish` writes them again from the final checkpoint, before a step trains over it
        self.log(f"{self.run_dir} finished at step {self.step}, but {'; '.join(lost.values())}: writing the final files again "
                 "from the final checkpoint" + ("" if self.step >= self.cfg.max_steps else ", before training on"))
        self._together(lambda: self._set_aside_finish(lost), self.run_dir)
        self.finish(self.saved_settings, write_config="config.yaml" in lost)  # its settings; a config.yaml whole is kept
    elif self.step >= self.cfg.max_steps and self._agree(not self.d.is_main or ours):
        # finished already: nothing to train, and re-finishing would rewrite the final checkpoint with this run's config
        self.log(f"{self.run_dir} finished at step {self.step} (summary.json): raise max_steps to train further")
        self.summary = done or {}  # what `finish` wrote (rank 0 reads it), so `main` returns the run's summary again
        return []
    if redo and self.step >= self.cfg.max_steps: return []  # written again above: nothing to train
    logger = _wandb(self)
    metrics_file = self.run_dir / "metrics.jsonl"
    peak = peak_flops(self.d.device)
    if self.d.device.type == "cpu": _warn_if_slow_on_cpu(self)
    start = self.step
    with StopSignals(self.request_stop, announce=self.d.is_main and not self.quiet) as signals, \
         tqdm(total=end, initial=self.step, disable=self.quiet or not self.d.is_main or not _bar_shows(tqdm),
              dynamic_ncols=True) as bar:
        out = self._fit_steps(end, start, logger, bar, peak, metrics_file)  # the bar writes to the guarded stderr
        signals.on_signal = lambda sig: None  # from here on `stopped_by` is final (a repeated SIGTERM is still absorbed)
        if not self._agree(self.stopped_by is None):  # every rank: a signal after the last step's check counts too
            self.request_stop("a stop on another rank")
            if self.saved_step != self.step: self.save()  # collective; mid-streak too: skipped steps left the weights as they were
        elif self.step >= self.cfg.max_steps and self.saved_step != self.step:
            self.save()  # the final checkpoint, under the handlers too: a SIGTERM now cannot cut it short
            if not self._agree(signals.received is None):  # ... but stops the run there: `finish` is left to the resume
                self.request_stop(signals.received or "a stop on another rank")
    if self.stopped_by is None and self.step >= self.cfg.max_steps:
        if self.step == start:  # no step trained in this call: the folder is not yet this run's if it is a branch from a
            # final checkpoint (another run's until now), or a rewind to one whose run finished later (its export is not this one)
            stale = self.d.is_main and done is not None and not ours
            if not self._agree(not (self.foreign_start or stale)):
                self._together(lambda: self._first_write(start), self.run_dir)
        self.finish()
    if logger: logger.finish()
    return out


def request_stop(self: Trainer, why="a request"):  # What asked: a `signal.Signals`, or any description
    "Ask `fit` to stop after the step in flight, with a checkpoint of it (the SIGINT and SIGTERM handlers call this)."
    if self.stopped_by is None: self.stopped_by = why


def _first_write(self: Trainer, start: int):
    "Rank 0's first change to the run folder in a `fit` call: metrics of steps it redoes set aside, its config.yaml."
    if not self.d.is_main: return
    if any((self.run_dir / f).exists() for f in ("summary.json", "model.safetensors")):  # a finish's, damaged or not
        self._keep_finished((_json_dict(self.run_dir / "summary.json") or {}).get("step"))
    if self.foreign_start:  # none of it is this branch's: its steps up to `start` are in the other folder
        trim_metrics(self.run_dir, -1, self.log, f"a run that never saved a checkpoint; this one continues {self.branched_from}")
        self.foreign_start = False
    else: trim_metrics(self.run_dir, start, self.log, history=self.history)  # the lines of this line of steps
    _write_lines(self.run_dir / "config.yaml", [str(Config(self.mcfg, self.cfg, name=self.name))])  # `load_config` reads it; whole


FINISHED_FILES = ("config.yaml", "model.safetensors", "tokenizer.json", "summary.json", "loss.png")  # what `finish` writes


def _keep_finished(self: Trainer, step):
    """Copy a finished run's final model and what describes it into `finished-step_N/`, once, before training in its folder
    goes on. A summary.json that cannot be read (`step` None) or is gone still keeps the model: copied unchecked, to `finished/`."""
    have = [f for f in FINISHED_FILES if (self.run_dir / f).is_file()]
    mark = "summary.json" if "summary.json" in have else "model.safetensors"  # copied last: a folder that has it is complete
    same = lambda a, b: a.is_file() and a.stat().st_size == b.stat().st_size and file_crc(a) == file_crc(b)
    if any(same(d / mark, self.run_dir / mark) for d in self.run_dir.glob("finished*")): return  # kept by an earlier call
    base = self.run_dir / (f"finished-{CKPT_PREFIX}{step:06d}" if isinstance(step, int) else "finished")
    dest = next(d for d in map(Path, _numbered(str(base))) if not (d / mark).exists())  # another finish of that step: -2, ...
    dest.mkdir(exist_ok=True)  # one without its mark is a copy cut short: done again
    put_back = ""
    for f in sorted(have, key=lambda f: f == mark):
        if f == mark: put_back = self._as_trained(dest)  # before the mark: a complete copy loads
        shutil.copyfile(self.run_dir / f, dest / (f + ".tmp"))
        os.replace(dest / (f + ".tmp"), dest / f)
    to_disk(dest)
    if put_back: self.log(f"{dest / 'config.yaml'}: its model settings put back as the weights trained with ({put_back})")
    checked = isinstance(step, int) and mark == "summary.json"
    self.log((f"the run finished before at step {step}: its final model, config and summary are kept in {dest}" if checked else
              f"the run finished before, but its summary.json {'cannot be read' if mark == 'summary.json' else 'is gone'}: its "
              f"final files are kept, unchecked, in {dest}") + f" (python -m hymo.generate {shell_word(dest)}); its "
             "checkpoints are pruned as any others (keep_last_k)")


FREE_TO_EDIT = ("gdn_kernel", "gdn_chunk_size",  # how the GDN runs, not what it computes; and what only training uses:
                "init_std", "mtp_loss_weights", "moe_capacity_factor", "moe_balance", "moe_bias_speed", "moe_ema_decay",
                "moe_dead_band")  # (capacity applies in training only): a finished run's config.yaml may change them


def model_drift(cfg: Config, trained: dict) -> list[str]:
    """The model settings of `cfg` (a run's config.yaml, read) that differ from `trained` (summary.json's `model_config`:
    those the final weights trained with), each as 'key: now (trained: then)', but for `FREE_TO_EDIT`."""
    now = cfg.to_dict()["model"]
    return [f"{k}: {now[k]!r} (trained: {v!r})" for k, v in trained.items() if k not in FREE_TO_EDIT and k in now and now[k] != v]


def _as_trained(self: Trainer, dest: Path) -> str:
    """Make the copy of config.yaml in `dest` (`_keep_finished`) hold the model settings the run's summary.json records (its
    `model_config`), if it holds others (edited to train on with them), none or cannot be read; return what changed."""
    trained = (_json_dict(self.run_dir / "summary.json") or {}).get("model_config")
    if not isinstance(trained, dict): return ""  # a run from before it was recorded, or a summary that cannot be read
    try: kept = load_config(dest / "config.yaml")
    except (ConfigError, OSError, ValueError): drift, train = ["a config.yaml that cannot be read"], self.cfg
    else: drift, train = model_drift(kept, trained), kept.train
    if not drift: return ""
    try: model = _saved(ModelConfig, trained)
    except (TypeError, ValueError, ConfigError): return ""  # another version's settings: the copy is left as it is
    _write_lines(dest / "config.yaml", [str(Config(model, train, name=self.name))])
    return ", ".join(drift)


def _lost_finish(self: Trainer, done: dict) -> dict[str, str]:
    "What a finish (its summary.json `done`, of this step) wrote that is gone or has changed since: {file name: what is wrong}."
    out = {}  # (config.yaml is the user's to edit: one whose model settings changed is left, and generate names them)
    for name in ("config.yaml", "model.safetensors", "tokenizer.json")[:2 + (self.data_dir is not None)]:
        p = self.run_dir / name
        if not p.is_file(): out[name] = f"its {name} is missing"; continue
        if name == "config.yaml":
            try: load_config(p)
            except (ConfigError, ValueError) as e: out[name] = f"its config.yaml cannot be read ({e})"
        elif name == "model.safetensors":
            if isinstance(saved := done.get("model_file"), dict) and (
                    p.stat().st_size != saved.get("size") or file_crc(p) != saved):  # the size first: no read
                out[name] = "its model.safetensors has changed since it was written (its size or CRC-32)"
        elif (want := done.get("tokenizer_sha256")) and hashlib.sha256(p.read_text(encoding="utf-8", errors="replace")
                                                                        .encode("utf-8")).hexdigest() != want:
            out[name] = "its tokenizer.json is not the one it trained with (its sha256)"
    return out


def _set_aside_finish(self: Trainer, lost: dict[str, str]):
    "Rank 0's: move the damaged files of `lost` (`_lost_finish`), which `finish` writes again, aside as `NAME.damaged`."
    if not self.d.is_main: return
    for name in lost:
        if not (p := self.run_dir / name).is_file(): continue  # missing
        aside = next(a for a in map(Path, _numbered(f"{p}.damaged")) if not a.exists())
        os.replace(p, aside)
        self.log(f"{p} set aside as {aside} (delete it once you have no use for it)")


def _fit_steps(self: Trainer, end, start, logger, bar, peak, metrics_file) -> list[dict]:
    "The loop of `fit`: train steps until `end`, or until a stop is requested on any rank."
    out = []
    while self.step < end:
        t0 = time.perf_counter()
        m = self.train_step()
        if self.d.device.type == "cuda": torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        m["tokens_per_s"] = m["tokens"] / dt
        flops = m.pop("flops")  # the model FLOPs of a rank's share of the step (the ranks' mean), at one device's peak
        m["mfu"] = flops / (dt * peak) if peak else None
        due = (self.cfg.eval_every and self.step % self.cfg.eval_every == 0) or self.step == self.cfg.max_steps
        if due and self.val_loader is not None: m["val_loss"] = self.evaluate()  # the last step's is the final one too
        self.history.append({k: m[k] for k in ("step", "loss", "loss/main", "val_loss") if k in m})
        out.append(m)

        def step_files():  # rank 0's; a full disk here stops every rank (`_together`)
            if not self.d.is_main: return
            if self.step == start + 1: self._first_write(start)  # this call's first step: only now does the folder change
            with open(metrics_file, "a") as f: f.write(json_line(m) + "\n")

        self._together(self._data_damaged, self.data_dir)  # damage a rank's share of the check found stops every rank
        self._together(step_files, metrics_file)
        if logger: logger.log(m, step=self.step)
        bar.update(1)
        bar.set_postfix_str(f"loss {m['loss']:.3f}" + (f" (main {m['loss/main']:.3f})" if "loss/main" in m else "") +
                            f" tok/s {m['tokens_per_s']:.0f}" +
                            (f" mfu {m['mfu']:.1%}" if m["mfu"] is not None else "") +
                            (f" val {m['val_loss']:.3f}" if "val_loss" in m else ""))
        if self.step % self.cfg.log_every == 0 or self.step in (start + 1, end) or "val_loss" in m:
            if bar.disable: self.log(metric_line(m, self.cfg.max_steps))  # no bar: quiet (prints nothing) or not rank 0
            else: bar.write(metric_line(m, self.cfg.max_steps))       # above the bar, which stays at the bottom
        due = self.cfg.ckpt_every and self.step % self.cfg.ckpt_every == 0 and self.step < self.cfg.max_steps
        if due and self.consecutive_bad == 0: self.save()  # not mid-streak: a streak may end the run, and its checkpoints
        # would push good ones out of keep_last_k (a stop saves mid-streak: there the run ends, and the good steps are kept)
        if not self._agree(self.stopped_by is None): break  # a stop was asked for, on some rank: all stop here (fit saves)
    return out


def _no_nan(m: dict) -> dict:
    "`m` with every non-finite number (a skipped step's loss, a diverged validation loss) as None: JSON has no NaN."
    return {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in m.items()}


def json_line(m: dict) -> str:
    "One metrics line, non-finite numbers written as null (`jq` and most JSON readers refuse NaN)."
    return json.dumps(_no_nan(m))


def wandb_mode() -> str:
    """The mode a run's wandb logs in: `WANDB_MODE` where you set it (`offline`, `disabled`, ...), else online if wandb has
    an API key (`WANDB_API_KEY`, or the one `wandb login` saved), else offline. Asked without a prompt and without the
    network; `wandb.api`, the older way to ask, is deprecated."""
    if mode := os.environ.get("WANDB_MODE", "").strip().lower(): return mode
    if os.environ.get("WANDB_API_KEY"): return "online"
    import wandb
    try: logged_in = wandb.login(prompt=False, verify=False)
    except TypeError: logged_in = getattr(wandb.api, "api_key", None)  # a wandb whose login has no prompt=
    return "online" if logged_in else "offline"


def _wandb(self: Trainer):
    """Rank 0's wandb run when enabled: online if you are logged in, else offline (sync later with `wandb sync`).
    Online, a resumed run continues the wandb run it began (its id is in run_dir/wandb/hymo_run_id); every part of a
    run is in the wandb group named after the run folder. A rewind, a branch or a resume with changed settings starts a
    new wandb run in that group: wandb ignores steps at or below the last it has, so the new line's would be lost."""
    if not self.cfg.wandb: return None
    run = None
    def start():  # rank 0's; a failure (no network, a full disk) stops every rank, not rank 0 alone
        nonlocal run
        if not self.d.is_main: return
        import wandb
        mode = wandb_mode()
        online = mode == "online"
        id_file = self.run_dir / "wandb" / "hymo_run_id"
        reuse = online and self.step > 0 and id_file.exists() and not (self.foreign_start or self.new_line)
        run = wandb.init(project=self.cfg.wandb_project, dir=str(self.run_dir), mode=mode,
                         config=Config(self.mcfg, self.cfg, name=self.name).to_dict(), group=self.run_dir.name,
                         id=(id_file.read_text().strip() or None) if reuse else None, resume="allow")
        id_file.parent.mkdir(parents=True, exist_ok=True)
        id_file.write_text(run.id)
    self._together(start, self.run_dir / "wandb")
    self.new_line = False  # the wandb run begun here is this line's: a later `fit` of this Trainer continues it
    return run

Trainer.fit, Trainer._fit_steps, Trainer._first_write, Trainer.request_stop = fit, _fit_steps, _first_write, request_stop
Trainer._keep_finished, Trainer._lost_finish, Trainer._set_aside_finish = _keep_finished, _lost_finish, _set_aside_finish
Trainer._as_trained = _as_trained


# %% [markdown]
# ### The end of a run
#
# The final checkpoint, a validation pass, a loss-curve PNG, a short sample from the model (it
# continues `sample_prompt`: by default "ROMEO:" on the bundled corpus, the start of a document on your own data), and
# the weights as one `safetensors` file (full tensors, gathered to rank 0) for inference.
# `summary.json` is written last, and whole (beside itself, then renamed over: a reader such as `generate` never sees
# half of it), so a run whose `finish` was cut short finishes again when resumed;
# one that has it for its last step is left alone (`fit` says so and returns), since finishing again
# would rewrite the final checkpoint with whatever settings the resuming command gave; unless a file
# it wrote is gone or damaged (`_lost_finish`, on rank 0 under `_together`, so that a read fault
# stops every rank): `model.safetensors` whose size or CRC-32 is not `summary.json`'s `model_file`,
# `tokenizer.json` whose sha256 is not its `tokenizer_sha256`, a `config.yaml` that cannot be read.
# Then `finish` writes them again from the final checkpoint, recording the settings that checkpoint
# trained with (in this folder, on the data it resumed), and the damaged ones are set aside as
# `NAME.damaged`, not written over. A `config.yaml` that reads is left as it is (it is the user's to
# edit). This happens before a step of a run trained further, too: the final checkpoint is the one
# good copy of those weights, and pruning would delete it once the damaged file was kept as the final
# model. `summary.json` records the model settings the weights trained with (`model_config`): generate
# refuses a `config.yaml` whose own differ, but for `FREE_TO_EDIT` (how the GDN runs, and what only
# training uses). A finished run trained further (a larger `max_steps`, or `--resume` of one of its
# checkpoints) would overwrite that final model: its first new step (or, for a rewind that trains
# no step, its finish) copies `FINISHED_FILES` into `finished-step_NNNNNN/`, once, a folder
# `python -m hymo.generate` loads as it loads the run's own. A `summary.json` that cannot be read or
# is gone does not stop the copy (it did, and the new finish wrote over the model): the files are
# kept, unchecked, in `finished/`. Each file is copied beside itself and renamed, the mark of a
# complete copy (`summary.json`, else the model) last; before it, the copy's `config.yaml` gets the
# model settings the weights trained with where the run's was edited to train on with others
# (`_as_trained`), so the kept folder loads. The run folder keeps its files until
# the new finish replaces them (`generate` notes that they are older than its checkpoints). Its
# checkpoints are pruned as any others: the weights it finished with are kept, its optimiser state
# only while `keep_last_k` keeps that checkpoint. `summary.json` also records the size and CRC-32
# of `model.safetensors` (`model_file`), which `generate` checks (chapter 72).

# %%
#| export
def finish(self: Trainer, settings: dict | None = None, write_config: bool = True) -> dict:
    """Final checkpoint, validation, loss curve, sample and safetensors export; returns a summary. `settings`: the config
    that config.yaml and summary.json record (a checkpoint's, as meta.json has it), else this Trainer's; `write_config`
    False leaves config.yaml as it is (a finish written again for a damaged model keeps the user's edits)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    if self.saved_step != self.step: self.save()  # resumed at the end (the export failed, say): that checkpoint stays
    last = self.history[-1] if self.history else {}
    val = last["val_loss"] if last.get("step") == self.step and "val_loss" in last else self.evaluate()  # fit's, at the last step
    summary = {"step": self.step, "val_loss": val, "bad_steps": self.bad_steps, "history_crc32": history_sum(self.history)}
    full = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    sample = self.sample() if self.cfg.sample_tokens else None  # sample_tokens=0: none
    try: record = Config(_saved(ModelConfig, settings["model"]), name=self.name,  # in this folder, on the data resumed (moved,
                         train=dataclasses.replace(_saved(TrainingConfig, settings["train"]),  # a copy: not the original's)
                                                   run_dir=self.cfg.run_dir, data_dir=self.cfg.data_dir))
    except (TypeError, KeyError, ValueError, ConfigError): record = Config(self.mcfg, self.cfg, name=self.name)  # none, or another version's
    summary["model_config"] = record.to_dict()["model"]  # what the weights trained with: a config.yaml edited since is named

    def artefacts():  # the main rank's; a failure stops every rank (`_together`), and the resume finishes again
        if not self.d.is_main: return
        write_safetensors(full, self.run_dir / "model.safetensors")
        summary["model_file"] = file_crc(self.run_dir / "model.safetensors")  # its size and CRC-32: generate checks them
        if self.data_dir is not None:  # with config.yaml, the folder alone is enough to generate (chapter 72)
            _write_lines(self.run_dir / "tokenizer.json", [self.tokenizer_json])  # whole: the old one stays until the new is in
            summary["tokenizer_sha256"] = hashlib.sha256(self.tokenizer_json.encode("utf-8")).hexdigest()  # generate checks it
        plot_losses(self.history, self.run_dir / "loss.png")
        if write_config: _write_lines(self.run_dir / "config.yaml", [str(record)])  # the final one's
        summary["sample"] = sample
        _write_lines(self.run_dir / "summary.json", [json.dumps(_no_nan(summary), indent=1)])  # whole or not at all

    self._together(artefacts, self.run_dir)
    if self.d.is_main:
        self.log((f"final val loss {summary['val_loss']:.4f}" if summary["val_loss"] is not None else
                  f"no validation loss{': ' + self.no_val_why if self.no_val_why else ''}")
                 + (f"\n--- sample ---\n{sample}\n--------------" if sample is not None else ""))
    self.summary = summary
    return summary


def write_safetensors(tensors: dict[str, torch.Tensor], path: Path):
    "`safetensors`' `save_file`, with its I/O errors (a full disk) raised as the `OSError` they are."
    from safetensors.torch import save_file
    try: save_file({k: v.contiguous() for k, v in tensors.items()}, str(path))
    except Exception as e:  # safetensors' own SafetensorError, e.g. "I/O error: ... (os error 28)"
        code = re.search(r"os error (\d+)|code: (\d+)", str(e))  # "... (os error 28)", or older "Os { code: 28, ..."
        if code is None: raise
        n = int(code[1] or code[2])
        raise OSError(n, os.strerror(n), str(path)) from e
    umask = os.umask(0); os.umask(umask)
    try: os.chmod(path, 0o666 & ~umask)  # its temporary file was private (0600); the run's other files are not
    except OSError: pass  # a file system without modes (vfat, some network mounts): the file is written all the same


@torch.no_grad()
def sample(self: Trainer, prompt: str | None = None, max_new_tokens: int | None = None, temperature: float = 0.8) -> str:
    "Generate text from `prompt` (None: the config's, `TrainingConfig.prompt`) with the current weights (seeded, so it is reproducible)."
    from hymo.generate import generate_text  # chapter 72: the same seeded sampling from a finished run's folder
    with self.autocast():  # every rank draws the same tokens
        return generate_text(self.model, tokenizer_from_json(self.tokenizer_json), self.cfg.prompt if prompt is None else prompt,
                             max_new_tokens or self.cfg.sample_tokens,
                             temperature=temperature, top_k=50, seed=self.cfg.seed,
                             stop=not self.d.distributed,  # FSDP: every rank runs every forward (all-gathers), then cuts
                             window=self.cfg.seq_len,  # as `python -m hymo.generate` reads the finished run
                             cache=not (self.d.distributed or self.cfg.compile or self.cfg.activation_checkpointing))
    # `decode` calls the blocks outside the root's forward (FSDP's hooks) and with a growing state (a compiled
    # block would recompile): those models re-run the forward per token instead


def plot_losses(history: list[dict], path: Path):
    "Training and validation loss against step, saved as a PNG."
    import matplotlib; matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot([h["step"] for h in history], [h["loss"] for h in history], label="train (main + MTP)", lw=1, alpha=0.5)
    main = [h for h in history if "loss/main" in h]  # (a run resumed from before 2026-12-06 lacks its earlier steps')
    if main: ax.plot([h["step"] for h in main], [h["loss/main"] for h in main], label="train (main)", lw=1)
    val = [h for h in history if h.get("val_loss") is not None]
    if val: ax.plot([h["step"] for h in val], [h["val_loss"] for h in val], "o-", label="validation (main)")
    ax.set_xlabel("step"); ax.set_ylabel("loss"); ax.legend(); ax.grid(alpha=0.3)
    fig.tight_layout(); fig.savefig(path, dpi=110); plt.close(fig)

Trainer.finish, Trainer.sample = finish, sample

# %% [markdown]
# ## A short run
#
# The tiny model on the bundled corpus, shortened to a few steps on short windows so this chapter
# runs in seconds. (`python -m hymo.train` runs the full tiny preset.) The data preparation is
# cached, so only the first run anywhere pays for training the tokenizer.

# %%
torch.set_num_threads(1)  # tiny matrices: one thread is faster than two fighting over a small CPU
work = Path(tempfile.mkdtemp())
small = dict(seq_len=32, micro_batch_size=4, global_batch_size=8, max_steps=12, warmup_steps=2, eval_every=6,
             ckpt_every=6, sample_tokens=16)
cfg = load_config("hymo_tiny", **small)
trainer = Trainer(cfg.model, cfg.train, run_dir=work / "run", quiet=True)
print(f"accumulation: {trainer.accum} micro-batches per step; {trainer.flops_per_token/1e6:.1f} MFLOPs per token")
metrics = trainer.fit()
for m in metrics[::3]: print(metric_line(m, trainer.cfg.max_steps))  # what a run prints every log_every steps
test_eq(metric_line(metrics[5], 12).split(" | ")[:2],
        [f"step 6/12", f"total loss {metrics[5]['loss']:.4f} (main {metrics[5]['loss/main']:.3f}, "
                       f"mtp_1 {metrics[5]['loss/mtp_1']:.3f}, mtp_2 {metrics[5]['loss/mtp_2']:.3f})"])
assert f"val {metrics[5]['val_loss']:.4f}" in metric_line(metrics[5], 12)  # step 6 evaluated (eval_every=6)
test_eq(trainer.step, 12)
assert metrics[-1]["loss"] < metrics[0]["loss"]

# %% [markdown]
# The run folder holds the config it ran with (`config.yaml`), the metrics, the checkpoints (the
# last `keep_last_k`, and the newest from before the decay), the loss curve, the sample, the exported weights and the tokenizer; the last
# three with `config.yaml` are all that generating text needs (chapter 72):

# %%
print(sorted(p.name for p in trainer.run_dir.iterdir()))
assert {"config.yaml", "model.safetensors", "tokenizer.json", "summary.json", "metrics.jsonl"} <= {p.name for p in trainer.run_dir.iterdir()}
saved = load_config(trainer.run_dir / "config.yaml")
test_eq((saved.model, saved.train), (cfg.model, cfg.train))
print([p.name for p in list_checkpoints(trainer.run_dir)])
print(trainer.summary["sample"])

# %% [markdown]
# ## Resume is exact
#
# Stop after 6 steps (there is a checkpoint at step 6), build a new `Trainer` on the same folder,
# and finish: the losses are those of the uninterrupted run above, to the last bit.

# %%
t1 = Trainer(cfg.model, cfg.train, run_dir=work / "resumed", quiet=True)
first = t1.fit(num_steps=6)
del t1
t2 = Trainer(cfg.model, cfg.train, run_dir=work / "resumed", quiet=True)
test_eq(t2.step, 6)
second = t2.fit()
test_eq([m["loss"] for m in first + second], [m["loss"] for m in metrics])

# %% [markdown]
# A stop from outside ends the same way. Here a scheduler's SIGTERM arrives while step 3 runs: the
# step is wrapped to call `request_stop`, which is what the signal handler calls (a notebook's cells
# may run outside the main thread, where Python lets no handler be installed; the tests send real
# signals to `python -m hymo.train`). Step 3 finishes, is checkpointed although `ckpt_every` is 6, and a new
# `Trainer` on the folder carries on with the losses of the uninterrupted run.

# %%
t3 = Trainer(cfg.model, cfg.train, run_dir=work / "preempted", quiet=True)
step_once = t3.train_step
def step_then_sigterm():
    m = step_once()
    if t3.step == 3: t3.request_stop(signal.SIGTERM)
    return m
t3.train_step = step_then_sigterm
test_eq(len(t3.fit()), 3)
test_eq((t3.step, t3.stopped_by), (3, signal.SIGTERM))
test_eq([c.name for c in list_checkpoints(t3.run_dir)], ["step_000003"])
t3 = Trainer(cfg.model, cfg.train, run_dir=work / "preempted", quiet=True)
test_eq([m["loss"] for m in t3.fit()], [m["loss"] for m in metrics[3:]])

# %% [markdown]
# ## Mistakes that are caught
#
# A global batch that does not split over the ranks, a checkpoint path that is not a complete
# checkpoint, and a dataset built for another vocabulary each stop with a message that says what
# to do, before the run folder is made. A relative `data_dir` that is not there says it was looked for from the
# current folder (not from the config file's). Data that fits but would leave at least half the embedding's rows
# unused (a dataset prepared with the default 2 048 tokens under the 750M model's 64 256) is a warning, and the
# command line prints one line on the data before the first step: its folder, each split's tokens, and how many
# epochs `max_steps` reads (`data_summary`), so that 30 epochs over a small corpus is never a surprise.

# %%
test_fail(lambda: Trainer(cfg.model, cfg.train, run_dir=work / "x", resume=work / "run" / "nope", quiet=True),
          contains="nope does not exist")
test_fail(lambda: Trainer(cfg.model, cfg.train, run_dir=work / "x", resume=work / "run", quiet=True),  # the run, not one of its checkpoints
          contains=f"is a run folder, not a checkpoint: give one of its checkpoints, e.g. {work / 'run' / 'checkpoints'}")
test_fail(lambda: Trainer(cfg.model, cfg.train, run_dir=work / "x", resume=work / "run" / "config.yaml", quiet=True),
          contains="config.yaml is a file, not a checkpoint folder")
bad = load_config("hymo_tiny", **small, vocab_size=1024, data_dir=str(trainer.data_dir))  # ids up to 2047 do not fit
test_fail(lambda: Trainer(bad.model, bad.train, run_dir=work / "y", quiet=True), contains="vocab")
assert not (work / "x").exists() and not (work / "y").exists()
print(trainer.data_summary())
test_eq(split_micro_batches(cfg.train, 2), 1)
test_fail(lambda: split_micro_batches(load_config("hymo_tiny").train, 2), contains="e.g. global_batch_size=32 or micro_batch_size=8")

# %% [markdown]
# More guard the run folder and its checkpoints.
#
# * Starting afresh (`resume=False`, the CLI's `--no-resume`) in a folder that holds checkpoints is
#   refused: the two runs' checkpoints would be pruned together, by step. So is continuing another
#   folder's checkpoint there (`--resume other/checkpoints/step_...`); into a folder without checkpoints it
#   is how a run branches. The branch records where it began (`branched_from` in `meta.json`), so
#   the same command given again (a requeued job) continues the branch instead of being refused.
#   A rewind to an older checkpoint of the folder (below) records it the same way: the same command
#   again continues from the newest checkpoint since, instead of going back once more and setting
#   aside every step trained since (to go back again, set the newer checkpoints aside by hand).
# * Resuming into weights of other shapes is refused, naming what changed; most other changed
#   settings only warn (the MoE's capacity, say, or the schedule; those that fix the data's order
#   are refused, below), and a moved learning-rate
#   schedule says how far the rate jumps. A finished run trained further jumps from the end of its
#   decay back up to the plateau; warmup-stable-decay is extended without that jump from a checkpoint
#   taken before the decay, so pruning keeps the newest one from before it (`pruned`, above), and the
#   warning names it, setting it aside as `before-decay-step_...` first (the new run's saves would
#   prune it; one whose files fail their CRC-32 is passed over for the one before): `--resume` it.
#   Once resumed, it is a checkpoint of the run's line again, pruned as any other (the new line keeps
#   its own newest from before its decay). The optimisers' moments come from the checkpoint, their
#   settings (peak learning rates, weight decay, betas) from this run's config: lowering `muon_lr`
#   after a divergence takes effect.
# * A checkpoint that cannot be read, or whose files' sizes or CRC-32s differ from those its save
#   recorded, is set aside as `damaged-step_...` and the one before is used;
#   one that cannot be read for now (a permission, a failing mount) stops the run and stays.
#   Resuming an older checkpoint of the same folder (`--resume run/checkpoints/step_...`, to redo a
#   decay, say) sets the newer ones aside as `superseded-step_...`: left in place they would outrank
#   the new run's checkpoints, which pruning would delete and a later plain resume would skip.
#   `metrics.jsonl` loses the lines of steps the resumed run will redo: they move to
#   `metrics.discarded.jsonl`. One of those set aside can be resumed in turn
#   (`--resume run/checkpoints/superseded-step_...`, to go back to the first line of steps): then
#   the branch it leaves is set aside as well, older checkpoints included, since a damaged
#   checkpoint later would otherwise fall back onto it, and the resumed one gets its plain name back,
#   as do the older checkpoints of its line that were set aside with it (a crash before the next
#   checkpoint resumes from it; the same command given again finds it under that name, and
#   continues the run's newest; given with other settings once the run has trained on, it goes back
#   to that checkpoint again, as a new rewind). A checkpoint is on the resumed one's line when its `history` (each step's
#   losses, in `meta.json`) begins the resumed one's (`on_line_of`). Every resume keeps in
#   `metrics.jsonl` only the lines that agree with that history: another branch's move out, and
#   the resumed line's come back from `metrics.discarded.jsonl` (the first step after a branch
#   point has the same losses on both branches, so its line may be either's). `summary.json`
#   records the history's CRC-32, so a finish of another line at the same step is not taken for
#   this run's: going back to a finished line writes its final model again, after keeping the
#   other's in `finished-step_...`.
#   Pruning never deletes a folder set aside, nor a finished run's copy (`finished-step_...`, below):
#   a run that starts among them says how many there are and what they hold (at 750M, 10 GB a
#   checkpoint), so that you delete those you no longer need.
# * A `step_....tmp` folder, a checkpoint whose writing a kill cut short, is removed when a run
#   starts in the folder (never read; at 750M it holds gigabytes), unless it is complete and newer
#   than every checkpoint: then only its rename was cut short, so it is renamed and resumed from
#   (the start says so). One that looks complete but whose `meta.json` names another step is left
#   as it is, with a warning.
#   Writing a step's checkpoint again sets the old one aside (`replaced-step_...`) until the new one
#   is in place, and `finish` does not write again the checkpoint it was loaded from.
# * A `run_dir` that is the dataset's folder, or that cannot be created, is refused before anything
#   is written. So is a finished run's folder whose checkpoints are gone (deleted to free space,
#   say): training there would start again at step 0 and replace its `model.safetensors`.
# * A checkpoint at a step past `max_steps` is refused: there is nothing to train, and finishing
#   would export a model that never had its decay as the final one. So is one at exactly
#   `max_steps` taken mid-way through a longer run (the checkpoint of a finished run is at its own
#   `max_steps`, and finishing exports it).
# * A resume reads the data the checkpoint trained on, in its order: `meta.json` holds the dataset's
#   fingerprint, so a `data_dir` prepared again from other text is refused, and so are a changed
#   `seq_len` or `seed`, on any number of ranks. The split of the global batch may change (see
#   *Checkpoints*).
# * A shard whose bytes changed on disk, a token changed to another valid id that no size or range check sees, stops
#   the run. As the first steps train, a `ContentsCheck` (chapter 60) compares every shard the loaders opened with the
#   CRC-32 in the manifest, each rank a share of them, and `save` waits for it: no checkpoint holds a step trained on
#   bytes not yet checked. The run stops at the step where the damage is found, without saving it, with one line on
#   every rank (the rank that found it names the shard); once the data is prepared again, the same command resumes
#   from the newest checkpoint. (The bundled corpus is not checked again: `prepare_default` read every byte as it found it intact.)

# %%
test_fail(lambda: Trainer(cfg.model, cfg.train, run_dir=work / "run", resume=False, quiet=True), contains="--no-resume")
wide = load_config("hymo_tiny", **small, dim=96)
test_fail(lambda: Trainer(wide.model, wide.train, run_dir=work / "run", quiet=True), contains="dim: 128 -> 96")
longer = load_config("hymo_tiny", **{**small, "max_steps": 20}, moe_capacity_factor=None)
t3 = Trainer(longer.model, longer.train, run_dir=work / "run", quiet=True)  # extends the finished 12-step run, dropless
print(*t3.resume_warnings, sep="\n")
model_w, train_w, lr_w = t3.resume_warnings
assert "moe_capacity_factor: 1.5 -> None" in model_w and "max_steps: 12 -> 20" in train_w and "jumps from" in lr_w

# %%
run = work / "resumed"  # checkpoints at steps 6 and 12; damage the newest and pretend a crash left steps 13-14
(run / "checkpoints" / "step_000012" / ".metadata").unlink()
with open(run / "metrics.jsonl", "a") as f: f.write('{"step": 13, "loss": 1.0}\n{"step": 14, "lo')
t4 = Trainer(cfg.model, cfg.train, run_dir=run, quiet=True)
test_eq(t4.step, 6)
test_eq(sorted(p.name for p in (run / "checkpoints").iterdir()), ["damaged-step_000012", "step_000006"])
t4.fit(num_steps=1)  # the metrics are trimmed when the resumed run logs its first step
test_eq([json.loads(l)["step"] for l in (run / "metrics.jsonl").read_text().splitlines()], list(range(1, 8)))
test_eq(len((run / "metrics.discarded.jsonl").read_text().splitlines()), 8)  # steps 7-12, 13 and the cut line
t4.fit()  # on to step 12, whose new checkpoint is damaged again: it is set aside under a second name
(run / "checkpoints" / "step_000012" / "rank0.pt").write_bytes(b"cut short")
t5 = Trainer(cfg.model, cfg.train, run_dir=run, quiet=True)
test_eq((t5.step, (run / "checkpoints" / "damaged-step_000012-2").exists()), (6, True))

# %% [markdown]
# ## Interview questions
#
# ::: {.callout-tip collapse="true"}
# ## Why does `parallelize` apply activation checkpointing, compile and `fully_shard` in that order?
# Each wraps what the previous step produced. Checkpointing must wrap the plain block so that the
# recomputation replays the block's own forward; compiling the checkpointed block lets the compiler
# see (and fuse) the recomputation; `fully_shard` goes on last, the order torchtitan uses. Its
# all-gather and reduce-scatter hooks stay out of the compiled graph either way (FSDP-2 marks them
# for dynamo to skip, and `Module.compile` runs a module's hooks around the compiled forward); they
# run around each block (`fsdp_step` then gathers each block once per step and reduce-scatters on the last backward). The root is sharded after the blocks so that it owns only what is left: the
# embedding, the final norm and the MTP heads.
# :::
#
# ::: {.callout-tip collapse="true"}
# ## What must a checkpoint hold for a resumed run to equal the uninterrupted one?
# Everything that influences the next step: the weights, both optimisers' moments and momentum
# buffers, the learning-rate schedule's position (here just the step), the MoE gate biases and EMA
# counts (buffers, so they are in the model's state dict), the data loader's position, and the RNG
# states (nothing in HyMo's step draws from them today; dropout or random augmentation would).
# Missing any one of the others makes the resumed run diverge; the MoE EMA counts are the one the design
# document left out (it registered them as non-persistent).
# :::
#
# ::: {.callout-tip collapse="true"}
# ## Why write a checkpoint to a temporary folder and rename it?
# A process can die mid-write (pre-emption, out of disk). If the checkpoint were written in place,
# a half-written folder would look like the newest checkpoint and the resume would fail or, worse,
# load garbage. Renaming a finished folder is atomic on one filesystem (and durable once the files
# and the folders are flushed to disk, as `save` does with `to_disk`), so the newest complete checkpoint is always a good one; an incomplete `.tmp` leftover is never read, and the next start
# removes it (a complete one newer than every checkpoint, whose rename alone was cut short, is
# renamed and resumed from).
# :::
#
# ::: {.callout-tip collapse="true"}
# ## Why is the MoE gate bias updated once per optimiser step, with counts summed over micro-batches and ranks?
# The bias should respond to the load of the batch the optimiser step was computed on, not to one
# micro-batch's noise, and all ranks must hold the same bias or they would route identical tokens
# differently. Summing counts over micro-batches and all-reducing them over ranks gives every rank
# the same global counts, hence the same update, at the cost of one tiny all-reduce per MoE layer
# per step.
# :::
#
# ::: {.callout-tip collapse="true"}
# ## Why skip a step whose loss or gradient is not finite, and why stop after several in a row?
# One bad batch or a transient overflow should not poison the weights: skipping it (zeroing the
# gradients, not stepping the optimisers or the MoE bias) costs one step. Several in a row mean
# something is systematically wrong (a learning rate too high, corrupt data), and continuing would
# only burn compute, so the run stops and points at the last good checkpoint.
# :::
#
# ::: {.callout-tip collapse="true"}
# ## How is MFU computed, and why is it not reported on a CPU?
# MFU = tokens per second × training FLOPs per token ÷ (peak FLOP/s × number of devices). The
# FLOPs per token come from the model's own accounting (`HyMo.flops_per_token`: 3 × the forward,
# counting a multiply-add as two FLOPs, with attention and the GDN recurrence included), and the
# peak from a table of dense bf16 figures (989 TFLOP/s for an H100/H200). With `doc_masking` a
# query attends only within its document, so each micro-batch's attention is counted from its own
# document lengths (`doc_keys_per_query`, chapter 41) rather than over the whole window: counted
# over the window, 1 024-token documents at $T = 4096$ would overstate the 750M's MFU by some 7 %.
# A CPU has no comparable single peak figure, so the trainer reports tokens per second only.
# :::
