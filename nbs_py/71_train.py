# %% [markdown]
# # `python -m hymo.train`
#
# > The command line: a preset, `key=value` overrides, resume, and a help text that lists every option.

# %%
#| default_exp train

# %% [markdown]
# ```sh
# python -m hymo.train                                   # hymo_tiny on the bundled corpus (CPU, minutes)
# python -m hymo.train max_steps=50 dim=96               # overrides: any config field, bare or as model./train.
# python -m hymo.train --config hymo_750m data_dir=/data/shards   # the full run (use torchrun for several GPUs)
# python -m hymo.train --config my_run.yaml run_dir=runs/a       # a YAML file (with base: hymo_tiny, it changes that preset)
# python -m hymo.train --config my_run.yaml run_dir=runs/a       # the same command again: resumes from runs/a's latest checkpoint
# python -m hymo.train --config runs/a/checkpoints/step_000200   # the settings that checkpoint trained with (its meta.json)
# python -m hymo.train --config hymo_750m --print-config         # the settings and what they make; nothing trained
# ```
#
# A checkpoint folder given as `--config` gives the settings its run trained with, as its `meta.json` records them
# (checked against that file's own CRC-32): the way back to a run's settings when its `config.yaml` is lost, and a
# start for a new run from them (`run_dir=...`). Like a run folder's `config.yaml`, it continues its own run unless
# `run_dir=` says otherwise, from the run's newest checkpoint (`--resume` names another). Its saves may prune the
# checkpoint given (`keep_last_k`), so the line a stop ends with names the run's `config.yaml` instead, which holds the
# same settings, and a pruned checkpoint given again is told to. A setting the checkpoint has and this version does
# not (a newer HyMo's) is left out, as a resume leaves it out.
#
# A YAML file without `base:` changes the design defaults, hymo_750m's; one that leaves values
# unset that way gets a note saying so first (its `seq_len` of 4 096, say, would otherwise surface
# only as a dataset too small for it). A stop that comes during the last step leaves the final
# model unwritten (the step is saved with its validation loss; `model.safetensors` and `summary.json` are
# `finish`'s), and the stop line says that the same command writes it.
#
# The command is thin: it parses, loads the config (whose errors already say what to do), builds a
# `Trainer` (whose refusals, about the data, the run folder or a checkpoint, say so too) and calls
# `fit`. Each of these mistakes ends in the usage line and one line that says what to do, exit
# status 2, and no run folder. Values are read as YAML, so `wandb=true`, `moe_capacity_factor=null`
# and `mtp_loss_weights=[0.5,0.2]` all work, except that a key holding text keeps what was typed:
# YAML would read `run_dir=007` as 7, `run_dir=2024-12-05` as a date, `moe_balance=off` as
# False, `sample_prompt=JULIET:` as a mapping and `sample_prompt='Chapter #1'` as `Chapter` (the
# rest a comment). `null` (or `~`) is the default there, as is `none` where a setting may be
# null; a value in YAML's quotes is read as YAML (`data_dir="'my data'"`), except a prompt's, which
# keeps every character typed, quotes and spaces included, and may be empty (`sample_prompt=`; for
# the other keys an empty value is refused, as an unset shell variable would give). `--config` and `--resume` may be given once each (argparse would keep the last without a
# word), and a bare preset name, `python -m hymo.train hymo_750m`, is pointed to `--config`.
#
# Once training has begun, the other ways a run ends are one line too, each with its exit status:
#
# | how | exit status | what is on disk |
# |---|---|---|
# | finished | 0 | final checkpoint, `summary.json`, `model.safetensors` |
# | Ctrl-C or SIGTERM (chapter 70) | 130 or 143 (128 + the signal) | a checkpoint of the last finished step |
# | SIGHUP (the terminal closed, unless under `nohup`; under `torchrun` see chapter 70), or SIGPIPE (the program reading its output, such as `head`, exited) | 129 or 141 | a checkpoint of the last finished step |
# | a second Ctrl-C (run directly; under `torchrun` it reaches the ranks as SIGTERM) | 130 | the checkpoints written so far |
# | too many non-finite steps in a row | 1 | the last good checkpoint, named in the message |
# | no space, quota, a read-only or forbidden file | 1 | the checkpoints written so far (no partial one) |
# | a damaged shard, found as it is read (an id beyond the vocabulary) | 1 | the checkpoints written so far |
#
# These are the exit statuses of `python -m hymo.train`, which is each rank under `torchrun`; a rank
# that stops only because another rank was signalled exits 143, as if sent SIGTERM (rank 0 given
# SIGPIPE exits 141, the others 143). Given
# the signal itself, `torchrun` waits for its ranks (who write the checkpoint and print the resume
# line as above), then prints a `SignalException` traceback of its own and exits with status 1: the
# ranks' line above that traceback is the one to read, and the checkpoint is there.
#
# `torch.distributed.checkpoint` wraps any exception raised while it reads or writes, a Ctrl-C or a
# full disk included, in its own `CheckpointException`; the trainer's `save` and resume look inside
# it (`wrapped`, chapter 70) and raise what they find as itself, so those end the same way.

# %%
#| export
from __future__ import annotations

import argparse
import dataclasses
import errno
import os
import re
import shlex
import signal
import sys
import warnings
from pathlib import Path

import yaml

from hymo.config import Config, ConfigError, ModelConfig, TrainingConfig, _Yaml12Dumper, _Yaml12Ints, checkpoint_folder, load_config, null_is_default, presets, shell_word, takes_text
from hymo.training.data import DataError

# %%
import contextlib
import io
import tempfile

from fastcore.test import test_eq, test_fail


# %%
#| export
def _yaml_value(v) -> str:
    "A value as `key=value` and `--help` write it: [0.3, 0.1], true, null."
    return yaml.dump(v, Dumper=_Yaml12Dumper, default_flow_style=True).strip().removesuffix("...").strip()


def _options_help() -> str:
    "Every config field with the default preset's value (and hymo_750m's where it differs) and its docment, for `--help`."
    from fastcore.docments import docments
    tiny, big = load_config("hymo_tiny").to_dict(), load_config("hymo_750m").to_dict()
    lines = []
    for sec, cls in (("model", ModelConfig), ("train", TrainingConfig)):
        docs = docments(cls)
        lines.append(f"\n{sec} options (key=value, or {sec}.key=value), with hymo_tiny's values (the default preset):")
        pairs = [f"{f.name}={_yaml_value(tiny[sec][f.name])}" for f in dataclasses.fields(cls)]
        width = max(map(len, pairs))  # one column for the descriptions
        for f, pair in zip(dataclasses.fields(cls), pairs):
            a, b = tiny[sec][f.name], big[sec][f.name]
            doc = re.sub(r"\bNone\b", "null", docs.get(f.name) or "")  # as the values are written (YAML)
            lines.append(f"  {pair:<{width}}  {doc}" + (f" [hymo_750m: {_yaml_value(b)}]" if a != b else ""))
    return "\n".join(lines)


def parse_overrides(items: list[str]) -> dict:
    "`['dim=64', 'train.wandb=true']` → `{'dim': 64, 'train.wandb': True}` (values parsed as YAML)."
    out = {}
    for item in items:
        if "=" not in item or item.startswith("="):
            named = Path(item).stem in presets() or item.endswith((".yaml", ".yml"))  # `python -m hymo.train hymo_750m`
            raise ConfigError(f"'{item}' is not an override: " + (f"to train a preset or a YAML file, give --config {item}" if named
                              else "write key=value, e.g. max_steps=100 (see --help)"))
        k, v = item.split("=", 1)
        k, prompt = k.strip(), k.strip().split(".")[-1] == "sample_prompt"  # a prompt: every character counts, '' too
        if k in out: raise ConfigError(f"'{k}' is given twice on the command line: give it once")
        if not v.strip() and not prompt:  # data_dir=$DATA with DATA unset would silently train on the bundled corpus
            raise ConfigError(f"'{item}' has no value (an unset shell variable?): give one, or " +
                              (f"{k}=null for the default" if null_is_default(k) else "leave it out to keep the config's value"))
        if takes_text(k) and v.strip() not in ("null", "Null", "NULL", "~"):  # text as typed: YAML would read
            value = v if prompt else v.strip()  # run_dir=007 as 7, 2024-12-05 as a date, off as False, JULIET: as a mapping,
            if not prompt and v.strip()[:1] in ("'", '"'):  # 'Chapter #1' as 'Chapter' (a comment), a newline as a space;
                try: value = _quoted_text(v)    # a prompt keeps even its quotes ("Hello," said Alice.), others are read
                except yaml.YAMLError: pass     # as YAML when quoted for it: data_dir="'my data'"
            out[k] = value
            continue
        try: value = yaml.load(v, Loader=_Yaml12Ints)  # 'none' stays a word: None for an optional setting, moe_balance's 'none'
        except yaml.YAMLError:
            raise ConfigError(f"'{item}': the value is not valid YAML; quote it for the shell, e.g. "
                              f"'{k}={_written(k)}'") from None
        out[k] = value
    return out



def _quoted_text(v: str) -> str:
    "A value in YAML's quotes as YAML reads it, if that is text; else `v` stripped (`'a': 'b'` is no mapping here)."
    value = yaml.load(v, Loader=_Yaml12Ints)
    return value if isinstance(value, str) else v.strip()


def _written(key: str) -> str:
    "The default preset's value of the setting `key` names, as an override writes it, for an example ('...' if none)."
    name, sections = key.split(".")[-1], load_config("hymo_tiny").to_dict()
    value = next((s[name] for s in (sections["model"], sections["train"]) if name in s), None)
    return "..." if value is None else _yaml_value(value)


class _Once(argparse.Action):
    "An option that may be given once: argparse would keep the last of two without a word."
    def __call__(self, parser, namespace, values, option_string=None):
        if getattr(namespace, f"_given_{self.dest}", False):
            parser.error(f"{self.option_strings[0]} is given twice ({getattr(namespace, self.dest)}, then {values}): give it once")
        setattr(namespace, f"_given_{self.dest}", True); setattr(namespace, self.dest, values)


def build_parser(prog: str = "python -m hymo.train", # The command, as usage lines name it (`hymo-train` for the console script)
                ) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=prog, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False,  # --resum is no --resume
        description="Train HyMo. With no arguments: hymo_tiny on the bundled Shakespeare corpus, on CPU in minutes.",
        epilog=f"presets: {', '.join(presets())}\n" + _options_help())
    p.add_argument("--config", default="hymo_tiny", action=_Once, help="preset name or path to a YAML file (default: hymo_tiny); a file "
                   "changes the design defaults (hymo_750m's), or the preset it names as 'base:'; or a checkpoint folder, "
                   "for the settings its run trained with")
    start = p.add_mutually_exclusive_group()  # --resume X --no-resume would silently drop X
    start.add_argument("--resume", default=None, metavar="CHECKPOINT", action=_Once,
                       help="resume from this checkpoint folder (default: the latest one in run_dir, if any)")
    start.add_argument("--no-resume", action="store_true",
                       help="start afresh, in a run_dir without checkpoints (one that holds them is refused)")
    p.add_argument("--print-config", action="store_true",
                   help="print the settings this command would train with, as a YAML file --config reads back, with the "
                        "model's size, the tokens of a step and the run folder in comments; then exit: nothing is trained "
                        "or written (WORLD_SIZE=N checks the batch splits over N processes)")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides (listed below)")
    return p


# %% [markdown]
# An unknown `--option` gets the closest real one, like an unknown config key does. Under
# `torchrun`, `main` ends by leaving the process group it joined on every rank together (a barrier,
# then `destroy_process_group`), so that NCCL does not warn of leaked resources at exit. It drops the
# trainer first, whose model holds the group as well, so that the group is gone before the interpreter
# shuts down. A group the caller created is left to the caller:

# %%
#| export
def _resume_from(trainer, cfg, args) -> str:
    "The command that resumes from the newest checkpoint, for the one-line endings of `main`."
    from hymo.training.trainer import cut_short_renames, list_checkpoints
    run_dir = trainer.run_dir if trainer is not None else cfg.train.run_dir  # None: a new, timestamped folder
    run_dir = Path(run_dir).expanduser() if run_dir else None  # a .tmp left complete is renamed and resumed from
    last = list_checkpoints(run_dir) + [t.with_suffix("") for t in cut_short_renames(run_dir)] if run_dir else []
    if not last: return "no checkpoint was written"
    change = [f"without {o}" for o, given in (("--resume", args.resume), ("--no-resume", args.no_resume)) if given]
    if not cfg.train.run_dir: change.append(f"with run_dir={shell_word(run_dir)}")  # run again as it was, it would start a new folder
    named = Path(args.config).expanduser()  # a checkpoint's folder (or meta.json), which this run's saves may have pruned:
    if (checkpoint_folder(args.config) or named.parent.name == "checkpoints") and (run_dir / "config.yaml").is_file():
        change.append(f"with --config {shell_word(run_dir / 'config.yaml')}")  # config.yaml holds the same settings
    return f"the same command{' ' + ' and '.join(change) if change else ''} resumes from {last[-1]}"


def design_defaults_note(config: str) -> str | None:
    "A note when `--config` is a YAML file whose chain of `base:` files ends without a preset and leaves values unset: those are hymo_750m's, not hymo_tiny's."
    from hymo.config import PRESET_DIR, _read_with_bases
    if config in presets() or checkpoint_folder(config): return None  # a checkpoint's settings are whole, as it trained
    _, chain = _read_with_bases(config)
    root = chain[-1][1]  # the deepest file: a preset sets the rest
    if root.resolve().parent == PRESET_DIR.resolve(): return None
    unset = [(sec, f.name) for sec, cls in (("model", ModelConfig), ("train", TrainingConfig)) for f in dataclasses.fields(cls)
             if not any(f.name in (raw.get(sec) or {}) for raw, _ in chain)]
    tiny, design = load_config("hymo_tiny"), Config()
    if all(getattr(getattr(tiny, s), n) == getattr(getattr(design, s), n) for s, n in unset):
        return None  # a printed config sets every value; a preset, or a copy of hymo_tiny, leaves only values they share
    alone = len(chain) == 1
    return (f"note: {config if alone else f'{config} rests on {root}, which'} has no 'base:', so the {len(unset)} values "
            f"{'it does' if alone else 'they do'} not set are the design defaults (hymo_750m's: seq_len={TrainingConfig.seq_len}, "
            f"dim={ModelConfig.dim}, ...); to change hymo_tiny instead, add the line 'base: hymo_tiny'{'' if alone else f' to {root}'}")


def _in_its_run_folder(cfg, args):
    """`--config RUN/config.yaml` (or a checkpoint of RUN: `RUN/checkpoints/step_N`) without run_dir=...: continue the run
    in RUN, not a new one where its run_dir (null or relative) says."""
    from hymo.training.trainer import is_run_folder
    if args.config in presets() or "run_dir" in {k.split(".")[-1] for k in parse_overrides(args.overrides)}: return cfg
    given = Path(args.config).expanduser()
    ckpt = checkpoint_folder(args.config)  # named as given: a checkpoints/ folder linked elsewhere is still its run's
    ckpt = ckpt if ckpt and ckpt.parent.name == "checkpoints" else None
    home = ckpt.parent.parent if ckpt else given.resolve().parent
    if not (given.name == "config.yaml" or ckpt) or not is_run_folder(home) or args.no_resume:  # a new run from it ...
        named = cfg.train.run_dir  # ... unless it names a run folder (a run's config.yaml copied to start an experiment)
        if named and not args.no_resume and is_run_folder(Path(named).expanduser()) and os.environ.get("RANK", "0") == "0":
            print(f"note: {args.config} sets run_dir={named}, an existing run's folder: continuing that run (give "
                  "run_dir=... to start a new run from these settings)", flush=True)
        return cfg
    if args.resume and Path(args.resume).expanduser().resolve().parent != (home / "checkpoints").resolve(): return cfg  # a branch
    if cfg.train.run_dir and Path(cfg.train.run_dir).expanduser().resolve() == home.resolve(): return cfg
    if os.environ.get("RANK", "0") == "0":
        what, newest = ("a checkpoint of a run", " from its newest checkpoint (--resume names another)") if ckpt else (
            "a run folder's config", "")
        print(f"note: {args.config} is {what}: continuing that run, run_dir={shell_word(home)}{newest} (give run_dir=... "
              "to start a new run from its settings)", flush=True)
    return load_config(args.config, **parse_overrides(args.overrides), run_dir=str(home))


def main(argv: list[str] | None = None, # The arguments; None: the command line's
         prog: str = "python -m hymo.train", # The command, for usage and error lines
        ) -> dict:
    "Parse `argv`, train, and return the run's summary."
    import difflib
    parser = build_parser(prog)
    if "LOCAL_RANK" in os.environ: parser.print_usage = lambda file=None: None  # torchrun: one line a rank, not the usage too
    args, unknown = parser.parse_known_intermixed_args(argv)  # key=value before and after the options alike
    for u in unknown:
        near = difflib.get_close_matches(u.split("=")[0], ["--config", "--resume", "--no-resume", "--help"], n=1)
        parser.error(f"unknown option {u}" + (f"; did you mean {near[0]}?" if near else ".") +
                     " Config values are written key=value without dashes, e.g. max_steps=100.")
    try: note = design_defaults_note(args.config)
    except ConfigError: note = None  # the file itself cannot be read: load_config says so
    try:
        cfg = load_config(args.config, **parse_overrides(args.overrides))
    except ConfigError as e:  # a file without 'base:' may fail on a design default it never set: the note says why
        parser.error(str(e) + (f"\n{note}" if note else ""))
    if note and os.environ.get("RANK", "0") == "0": print(note, file=sys.stderr if args.print_config else sys.stdout, flush=True)
    if args.resume is not None and not args.resume.strip():  # e.g. --resume "$CKPT" with CKPT unset: not a fresh start
        parser.error("--resume was given an empty path (an unset variable?): give a checkpoint folder, or leave out "
                     "--resume to continue from the run folder's newest checkpoint")
    try: from hymo.training.trainer import guarded_output  # torch: seconds, the usual Ctrl-C moment
    except KeyboardInterrupt: parser.exit(130, "interrupted before training began\n")
    from hymo.data import _one_line
    with guarded_output(), warnings.catch_warnings():  # a reader that goes away (`| head`) turns its stream off: no
        warnings.showwarning = _one_line(warnings.showwarning)  # traceback, nothing lost; a dataset's warnings (a damaged
        if args.print_config: return _print_config(parser, args, cfg, sys.argv[1:] if argv is None else argv)
        return _train(parser, args, cfg)                         # cache prepared again) one line each, as hymo.data's


def _train(parser, args, cfg) -> dict:
    "`main` from the `Trainer` on: train, say how it ended, return the summary (or exit with the stop's status)."
    from hymo.training.trainer import DISK_ERRORS, NonFiniteError, Trainer
    resume = False if args.no_resume else (args.resume or True)
    cfg = _in_its_run_folder(cfg, args)
    trainer = None
    try:
        try:
            trainer = Trainer(cfg.model, cfg.train, resume=resume, name=cfg.name)
        except (ConfigError, DataError) as e:  # the data, the run folder or a checkpoint does not fit what was asked
            parser.error(str(e))
        trainer.log(f"run folder: {trainer.run_dir.resolve()}")
        trainer.log(trainer.data_summary())
        trainer.log("model: " + "; ".join(describe(cfg, trainer.d.world_size)[:2]))  # its blocks and size, as --print-config says
        trainer.fit()
    except NonFiniteError as e:
        parser.exit(1, f"error: {e}\n")
    except DataError as e:  # a shard damaged on disk, found as training reads it
        then = _resume_from(trainer, cfg, args)
        parser.exit(1, f"error: {e}; " + (f"then {then}\n" if then.startswith("the same") else f"{then}\n"))
    except KeyboardInterrupt:  # a second Ctrl-C in training, or one before it began
        parser.exit(130, "interrupted " + (f"at step {trainer.step}; {_resume_from(trainer, cfg, args)}\n" if trainer is not None
                                            else "before training began\n"))
    except OSError as e:  # the trainer unwraps DCP's CheckpointException around the disk errors it reports
        if e.errno not in DISK_ERRORS: raise
        fix = {errno.ENOSPC: "Free space", errno.EDQUOT: "Free space (the disk quota is full)",
               errno.EROFS: "The file system is read-only: make it writable"}.get(e.errno, "Fix the permissions")
        then = _resume_from(trainer, cfg, args)
        then = f"once it is fixed, {then}" if then.startswith("the same command") else then
        parser.exit(1, f"error: {e.filename or 'the run folder'}: {e.strerror}. {fix} (or give another run_dir=...); {then}\n")
    stop = trainer.stopped_by  # a signal, or output without a reader (SIGPIPE): fit wrote a checkpoint of the step it finished
    say = trainer.log
    if getattr(sys.stdout, "gone", False):  # stdout lost its reader (`| head`): say it where it can still be read
        say = lambda line: trainer.d.is_main and print(line, file=sys.stderr, flush=True)
    if stop is None: say(f"done. run folder: {trainer.run_dir.resolve()}")
    elif trainer.step < cfg.train.max_steps:
        say(f"stopped by {getattr(stop, 'name', stop)} at step {trainer.step}; {_resume_from(trainer, cfg, args)}")
    else:  # the last step is trained, validated and saved; model.safetensors and summary.json are not written yet
        say(f"stopped by {getattr(stop, 'name', stop)} after the last step ({trainer.step}), before the final model "
            f"was written; {_resume_from(trainer, cfg, args)} and writes it")
    summary = getattr(trainer, "summary", {})
    if trainer.d.joined:  # every rank finished: leave the group we joined, together (NCCL warns of a leak otherwise)
        import gc
        import torch.distributed as dist
        dist.barrier()
        # The model's FSDP state holds the group too; left to the interpreter's exit, the group is torn down with it
        # (a rank of a finished two-rank test run once aborted there, "terminate called without an active exception")
        trainer = None; gc.collect()
        dist.destroy_process_group()
    if stop is not None: sys.exit(128 + int(getattr(stop, "value", signal.SIGTERM)))  # as if the signal had killed it
    return summary


# %% [markdown]
# ### Before a long run: `--print-config`
#
# A run of hymo_750m is days of GPU time, so it is worth seeing what a command will train before it
# starts. `--print-config` prints the settings the command would train with, after the preset, its
# `base:` files and the overrides, and exits without training or writing anything:
#
# ```sh
# python -m hymo.train --config hymo_750m data_dir=/data/shards --print-config > run.yaml   # look, change, then:
# python -m hymo.train --config run.yaml
# WORLD_SIZE=8 python -m hymo.train --config hymo_750m --print-config   # does the batch split over 8 GPUs?
# ```
#
# The output is the file the run writes as its `config.yaml` (with `data_dir` made absolute, so that
# the data is found from any folder), and `--config` reads it back. Comments at the top say what the
# settings make: the blocks, the parameters stored and those one token uses, the training FLOPs per
# token, the tokens of a step and of the run, the data (its tokens, windows and the epochs the run
# reads, counted as the trainer counts them, or why training would refuse it, which is also said on
# stderr; the bundled corpus once it is in the cache) and the run folder, as an absolute path: a new
# one, the checkpoint it continues from, or why training would refuse it (a file, a folder of
# someone else's files, `--no-resume` where there are checkpoints; a run that has reached
# `max_steps` is finished). Checks that need the run itself, such as whether a `--resume` checkpoint
# fits these settings, are left to training. For the parameters, the model is
# built on PyTorch's `meta` device, which records shapes and holds no memory, so even hymo_750m's
# count takes a second on a laptop. Notes, such as the one for a YAML file without `base:`, go to
# stderr, so the output stays valid YAML (an argument holding a line break is written escaped, on
# the comment's one line). Under `torchrun` (`WORLD_SIZE` above 1) only rank 0 prints.

# %%
#| export
def _count(n: float) -> str:
    "A count as a reader says it, to three figures: 918K, 542M, 1.24B."
    n = float(f"{n:.3g}")  # rounded first: 999 999 is 1M, not 1e+03K
    return next(f"{n / s:.3g}{u}" for s, u in ((1e9, "B"), (1e6, "M"), (1e3, "K"), (1, "")) if abs(n) >= s or s == 1)


def describe(cfg: Config, # The settings
             world_size: int = 1, # The processes the global batch is split over (torchrun's WORLD_SIZE)
            ) -> list[str]:
    """What `cfg` trains, in three lines: its blocks; its parameters and FLOPs per token (the model is built on the meta
    device, which holds no memory); the tokens of a step and of the run. A `ConfigError` if the batch does not split."""
    import torch
    from hymo.models.model import HyMo
    from hymo.training.trainer import split_micro_batches
    m, t = cfg.model, cfg.train
    accum = split_micro_batches(t, world_size)
    with torch.device("meta"): model = HyMo(m)
    n_mla, step = m.layer_types.count("mla"), t.global_batch_size * t.seq_len
    moe = f" ({m.moe_n_routed} routed experts, top {m.moe_top_k}, {m.moe_n_shared} shared)" if n_mla else ""
    return [f"{m.n_layers} blocks: {m.n_layers - n_mla} Gated DeltaNet + SwiGLU, {n_mla} MLA + MoE{moe}; "
            f"{m.mtp_depth} MTP head{'s' * (m.mtp_depth != 1)}",
            f"{_count(model.num_params())} parameters stored, {_count(model.num_params(active=True))} active per token; "
            f"{model.flops_per_token(t.seq_len) / 1e9:.3g} GFLOPs per training token",
            f"{step:,} tokens a step ({t.global_batch_size} sequences of {t.seq_len}: {accum} micro-batch"
            f"{'es' * (accum != 1)} of {t.micro_batch_size} on each of {world_size} process{'es' * (world_size != 1)}), "
            f"{_count(step * t.max_steps)} tokens in {t.max_steps:,} steps"]


def _print_config(parser, args, cfg, argv: list[str]) -> dict:
    "`--print-config`: the settings as the YAML file `--config` reads back, what they make in comments; nothing is written."
    import contextlib
    from hymo.training.trainer import checkpoint_step, list_checkpoints, split_micro_batches
    with contextlib.redirect_stdout(sys.stderr): cfg = _in_its_run_folder(cfg, args)  # its note is not YAML
    world = os.environ.get("WORLD_SIZE", "1")
    if not (world.isdigit() and int(world) >= 1):
        parser.error(f"WORLD_SIZE={world!r} must be a whole number >= 1: the processes the batch is split over (torchrun sets it)")
    world = int(world)
    try: about, accum = describe(cfg, world), split_micro_batches(cfg.train, world)
    except ConfigError as e: parser.error(str(e))
    if cfg.train.data_dir:  # as the run's config.yaml holds it: the file then works from any folder
        cfg = Config(cfg.model, dataclasses.replace(cfg.train, data_dir=os.path.abspath(os.path.expanduser(cfg.train.data_dir))),
                     name=cfg.name)
    run_dir = Path(os.path.abspath(Path(cfg.train.run_dir).expanduser())) if cfg.train.run_dir else None  # as training says it
    newest = list_checkpoints(run_dir)[-1:] if run_dir else []
    if run_dir is None: where = f"a new folder, runs/{cfg.name}-<date>-<time>" + (f", from {args.resume}" if args.resume else "")
    elif run_dir.exists() and not run_dir.is_dir(): where = f"{run_dir} (but it is a file: training refuses it)"
    elif args.resume: where = f"{run_dir}, from {args.resume}"
    elif newest and args.no_resume: where = f"{run_dir} (but --no-resume refuses a folder that holds checkpoints)"
    elif newest and checkpoint_step(newest[0]) >= cfg.train.max_steps:
        where = f"{run_dir}, finished at step {checkpoint_step(newest[0])}: nothing to train (raise max_steps to train further)"
    elif newest: where = f"{run_dir}, continuing from {newest[0].name}"
    elif _foreign_folder(run_dir): where = f"{run_dir} (but it holds files and is no HyMo run folder: training refuses it)"
    else: where = f"{run_dir}, from step 0"
    if args.resume and not (Path(args.resume).expanduser() / "meta.json").is_file():
        where += f" (but {args.resume} is no checkpoint: training would refuse it)"
    if world > 1 and os.environ.get("RANK", "0") != "0": return {}  # under torchrun, rank 0 says it
    data = _data_line(cfg, world, accum)
    if data.startswith("data: not ready: "):  # said where it is seen with the output in a file
        print(f"warning: the data is not ready: {data.removeprefix('data: not ready: ')}", file=sys.stderr, flush=True)
    said = "".join(c if c.isprintable() else c.encode("unicode_escape").decode() for c in shlex.join(argv))  # one line
    print("\n".join([f"# the settings of: {parser.prog} {said}".rstrip(), "# (give this file as --config FILE to train with them)",
                     *(f"# {line}" for line in about), f"# {data}", f"# run folder: {where}", str(cfg).rstrip()]), flush=True)
    return {}


def _foreign_folder(d: Path) -> bool:
    "Whether folder `d` holds files but nothing of a run (training refuses it); False where it cannot be read (training says why)."
    from hymo.training.trainer import is_run_folder
    try: return d.is_dir() and not is_run_folder(d) and any(not f.name.startswith(".") for f in d.iterdir())
    except OSError: return False


def _data_line(cfg, world_size: int, accum: int) -> str:
    """The data a config trains on, for `--print-config`: its tokens and the epochs the run reads (as the trainer's first
    lines count them), or why training would refuse it. The bundled corpus is described once it is in the cache."""
    from hymo.training.data import TokenLoader, check_compatible, default_cache_dir
    t, data_dir = cfg.train, cfg.train.data_dir
    if not data_dir:  # where `prepare_default` puts it for this vocabulary
        data_dir = default_cache_dir() / "data" / f"tinyshakespeare-bpe{cfg.model.vocab_size}"
        if not (data_dir / "manifest.json").is_file():
            return (f"data: the bundled corpus (Shakespeare), prepared into the cache as training starts ({data_dir}); "
                    "its size in tokens is known then")
    try:
        m = check_compatible(Path(data_dir), cfg.model.vocab_size)  # as the trainer checks it (contents aside)
        L = TokenLoader(Path(data_dir), "train", t.seq_len, t.micro_batch_size, world_size=world_size, seed=t.seed,
                        doc_masking=t.doc_masking, accum=accum)  # the trainer's loader: refuses a split too small for a step
    except DataError as e: return f"data: not ready: {e}"
    epochs = t.max_steps * accum / L.steps_per_epoch  # as `Trainer.data_summary` counts them
    return (f"data: {data_dir}{'' if t.data_dir else ' (the bundled corpus)'} ({L.n_tokens:,} training tokens, "
            f"{L.n_windows:,} windows of seq_len {t.seq_len}, a vocabulary of {m['vocab_size']:,}): max_steps={t.max_steps:,} "
            f"reads {f'{epochs:,.0f}' if epochs >= 100 else f'{epochs:.3g}'} epoch{'s' * (epochs != 1)}")


# %% [markdown]
# The preset of the full run, as `--print-config` shows it (the first lines; the settings go on, one a line):

# %%
with contextlib.redirect_stdout(io.StringIO()) as printed: main(["--config", "hymo_750m", "--print-config"])
print("\n".join(printed.getvalue().splitlines()[:13]) + "\n  ...")
with tempfile.TemporaryDirectory() as d:  # the file reads back as the same settings
    (Path(d) / "run.yaml").write_text(printed.getvalue())
    test_eq(load_config(str(Path(d) / "run.yaml")).to_dict(), load_config("hymo_750m").to_dict())


# %% [markdown]
# `main` returns the run's summary, for scripts and tests. The `hymo-train` command that installing
# the package provides calls `cli` instead: a console script exits with whatever its function
# returns, and a returned dict would be printed and read as a failure (status 1).

# %%
#| export
def cli() -> None:
    "The `hymo-train` console script: `main`, whose summary is not returned, so that a finished run exits with status 0."
    main(prog="hymo-train")


def _in_ipython() -> bool:
    "True inside Jupyter/IPython (where `__name__` is also '__main__')."
    import builtins
    return hasattr(builtins, "get_ipython")


if __name__ == "__main__" and not _in_ipython():
    main()

# %%
test_eq(parse_overrides(["dim=64", "train.wandb=true", "moe_capacity_factor=none", "mtp_loss_weights=[0.5,0.2]"]),
        {"dim": 64, "train.wandb": True, "moe_capacity_factor": "none", "mtp_loss_weights": [0.5, 0.2]})
# 'none' is None for an optional setting (dropless routing) and the word itself for a choice that has it
cfg = load_config("hymo_tiny", **parse_overrides(["moe_capacity_factor=none", "moe_balance=none"])).model
test_eq((cfg.moe_capacity_factor, cfg.moe_balance), (None, "none"))
test_eq(load_config("hymo_tiny", **parse_overrides(["moe_capacity_factor=None"])).model.moe_capacity_factor, None)
test_fail(lambda: parse_overrides(["max_steps"]), contains="key=value")
test_fail(lambda: parse_overrides(["data_dir="]), contains="no value (an unset shell variable?)")
test_eq(parse_overrides(["data_dir=null"]), {"data_dir": None})
test_fail(lambda: parse_overrides(["mtp_loss_weights=[0.3,"]), contains="not valid YAML")
test_eq(parse_overrides(["run_dir=007", "wandb_project=2024-12-05", "seed=007"]), {"run_dir": "007", "wandb_project": "2024-12-05", "seed": 7})
test_fail(lambda: parse_overrides(["hymo_750m"]), contains="give --config hymo_750m")
test_eq(parse_overrides(["run_dir=runs/hymo_tiny.yaml"]), {"run_dir": "runs/hymo_tiny.yaml"})  # a value may end so
test_eq(parse_overrides(["sample_prompt=JULIET:", "train.sample_prompt=[Enter]"]), {"sample_prompt": "JULIET:", "train.sample_prompt": "[Enter]"})
test_eq(parse_overrides(["sample_prompt=", "train.seed=1"]), {"sample_prompt": "", "train.seed": 1})  # the empty prompt
test_eq([parse_overrides([f"sample_prompt={p}"])["sample_prompt"] for p in
         ("Chapter #1", " Q: a: b", "'Tis", "*ROMEO*", ">", "a\nb", '"Hello," said Alice. "How are you?"', '"To be"', "null")],
        ["Chapter #1", " Q: a: b", "'Tis", "*ROMEO*", ">", "a\nb", '"Hello," said Alice. "How are you?"', '"To be"', None])
test_eq([parse_overrides([f"data_dir={p}"])["data_dir"] for p in ("'my data'", "'a': 'b'", '"x" y')], ["my data", "'a': 'b'", '"x" y'])

# %%
h = build_parser().format_help()
print(h[:600])
assert "muon_lr=0.03" in h and "[hymo_750m: 0.02]" in h and "gdn_kernel=auto" in h
assert "data_dir=null" in h and "None" not in h  # written as YAML, as the values are

# %% [markdown]
# ## Interview questions
#
# ::: {.callout-tip collapse="true"}
# ## Why does `--no-resume` refuse a run folder that holds checkpoints?
# Because the folder would then hold two runs. Checkpoints are named by step and pruned by step, so
# the new run's `step_000010` would sort below the old run's `step_000050` and be deleted as soon as
# it was written, `metrics.jsonl` would interleave the two, and the next plain resume would continue
# the old run. Nothing is lost by refusing: give the new run its own `run_dir`, or resume the old
# one. A run that crashed before its first checkpoint has nothing to mix, so it simply starts again,
# and its metrics lines move to `metrics.discarded.jsonl`.
# :::
#
# ::: {.callout-tip collapse="true"}
# ## Why is an unknown `key=value` an error rather than a warning?
# A typo such as `max_step=100` that was only warned about would start the preset's full run,
# 57,220 steps of it for `hymo_750m`, and the warning would scroll away in the first second of the
# log. Refusing costs the user one retry; the message names the closest real key. The same goes for
# values: they are read as YAML, so `wandb=true` is a boolean and `mtp_loss_weights=[0.5,0.2]` a list,
# and `load_config` then checks each against its field (a shape that does not divide, an unknown
# choice) before any work starts.
# :::
