# %% [markdown]
# # Generating text from a run
#
# > `python -m hymo.generate RUN_DIR`: load a finished run's weights and tokenizer, and continue a prompt.

# %%
#| default_exp generate

# %% [markdown]
# A finished run folder is self-contained: `config.yaml` (the model it trained), `model.safetensors`
# (the final weights, gathered from every rank) and `tokenizer.json` (a copy of the dataset's). That
# is all generation needs, so the folder can be copied to another machine and used there.
#
# ```sh
# python -m hymo.generate runs/hymo_tiny-20261204-101500 --prompt "ROMEO:" --tokens 200
# python -m hymo.generate RUN --temperature 0       # greedy: the most likely token every time
# python -m hymo.generate RUN --top-k 0 --top-p 0.9  # nucleus sampling: the likeliest tokens holding 90 % of the mass
# ```
#
# The prompt is the start of a document, so `generate_text` puts the end-of-text token before it,
# as the training data has one before every document but a split's first (chapter 60): the
# model's first prediction is then conditioned the way it learned, not on a prompt that seems to
# begin mid-text. An empty prompt is allowed and gives an unconditional sample. Without `--prompt`, the
# command continues the run's own `sample_prompt`, as its end-of-run sample did: "ROMEO:" on the
# bundled corpus, the start of a document on other data. The text ends where the
# model draws the end-of-text token, or after `max_new_tokens`.
#
# Sampling is `HyMo.generate` (chapter 41). The prompt runs through the stack once, and each new
# token then costs one token's work: the GDN blocks carry their recurrent state and the MLA blocks
# their latent cache (`HyMo.decode`, with the state of chapters 12 and 21). Once the text is longer
# than the run's training length (`train.seq_len`, which `trained_length` reads from its
# config.yaml; `hymo_tiny` trains on 128 tokens, though it accepts up to `max_seq_len` = 256),
# each token re-runs the last `train.seq_len` tokens instead, so the model never sees a position it
# was not trained on: its loss rises past that length, context or not. `load_run` records that
# length on the model it returns (`model.trained_len`), so `generate_text` and `HyMo.generate` keep
# to it unless given another `window`, as the command line does.

# %%
#| export
from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import sys
from pathlib import Path
from typing import Callable

import torch

from hymo.config import TRITON_CHUNK, ConfigError, load_config, shell_word
from hymo.models.model import HyMo, build_hymo
from hymo.training.data import EOT, to_devnull

# %%
import contextlib
import io
import subprocess
import tempfile

from fastcore.test import test_eq, test_fail

# %% [markdown]
# ## Loading a run
#
# The weights are loaded strictly: a file that lacks a tensor the config's model has, or holds one
# it lacks, is an error that names the first few, never a half-loaded model.

# %%
#| export
RUN_FILES = ("config.yaml", "model.safetensors", "tokenizer.json")


def run_config(run_dir: str | Path): # A run folder with its config.yaml
    "The run's settings, with a GDN kernel that can load anywhere: the kernel is not part of the weights."
    cfg = load_config(Path(run_dir) / "config.yaml")
    kernel = "auto" if cfg.model.gdn_kernel == "triton" else cfg.model.gdn_kernel  # a GPU run loads on a CPU
    if kernel == "auto" and cfg.model.gdn_chunk_size != TRITON_CHUNK: kernel = "torch"  # Triton runs chunks of 64 only
    return load_config(Path(run_dir) / "config.yaml", gdn_kernel=kernel)


def load_run(run_dir: str | Path, # A finished run folder (`python -m hymo.train` prints it)
             device: str | torch.device = "cpu", # Where the weights go
            ) -> tuple[HyMo, "tokenizers.Tokenizer"]:
    "The trained model (in eval mode) and its tokenizer from a finished run folder."
    from safetensors.torch import load_file
    from tokenizers import Tokenizer
    run = Path(run_dir)
    if not run.is_dir(): raise ConfigError(f"{run} {'is a file' if run.exists() else 'does not exist'}: give a finished run's folder")
    if missing := [f for f in RUN_FILES if not (run / f).exists()]:
        from hymo.training.trainer import is_run_folder, run_dir_holder
        # as given (a checkpoints/ linked elsewhere), or resolved (`.` inside a checkpoint)
        home = next((p.parent.parent for p in (Path(os.path.abspath(run)), run.resolve()) if p.parent.name == "checkpoints"
                     and (p.parent.parent / "config.yaml").is_file()), None)
        if home is not None:  # a checkpoint of a run
            whole = all((home / f).exists() for f in RUN_FILES)
            raise ConfigError(f"{run} is one of a run's checkpoints: " + (f"give the run folder, {home}" if whole else
                              f"generate loads a finished run, and {home} has not finished: resume it to the end "
                              f"(python -m hymo.train --config {shell_word(home / 'config.yaml')} run_dir={shell_word(home)})"))
        if who := run_dir_holder(run):  # training there now: it writes them when it finishes
            raise ConfigError(f"{run} has no {', '.join(missing)} yet: a run is training there now ({who}); it writes "
                              "them when it finishes, and generate loads them then")
        if (run / "meta.json").is_file() and (run / ".metadata").is_file():  # a checkpoint copied out of its run
            raise ConfigError(f"{run} is a training checkpoint, not a run folder: generate loads a finished run's model; "
                              f"train it to the end in a run folder of its own (python -m hymo.train --config {shell_word(run)} "
                              f"--resume {shell_word(run)} run_dir=NEW: the settings it trained with, from its meta.json), "
                              "then give that folder")
        if (run / "summary.json").exists() and is_run_folder(run):  # finished, its files since deleted
            if "config.yaml" in missing:  # what `write_again` would give to the trainer
                raise ConfigError(f"{run} has no config.yaml, but the run finished (summary.json): {config_back(run)}")
            raise ConfigError(f"{run} has no {', '.join(missing)}, but the run finished (summary.json): {write_again(run)}")
        raise ConfigError(f"{run} has no {', '.join(missing)}: give the folder of a finished run (python -m hymo.train "
                          "prints it at the end; a run that has not finished has only checkpoints: resume it to the end"
                          + (f", python -m hymo.train --config {shell_word(run / 'config.yaml')})" if is_run_folder(run) else ")"))
    from hymo.training.trainer import _json_dict, file_crc, is_run_folder, model_drift, run_dir_holder
    try: cfg = run_config(run)
    except ConfigError as e:  # damaged: a finished run's has a way back
        if not ((run / "summary.json").exists() and is_run_folder(run)): raise
        raise ConfigError(f"{run / 'config.yaml'} cannot be read ({e}); the run finished (summary.json): {config_back(run)}") from None
    summary = _json_dict(run / "summary.json")
    if summary is None and (run / "summary.json").exists():  # its sums lost, the model's bytes unchecked: not silently
        if who := run_dir_holder(run):  # a finish writing it now
            raise ConfigError(f"{run / 'summary.json'} is being written: a run is training in {run} now ({who}); try "
                              "again once it has finished")
        raise ConfigError(f"{run / 'summary.json'} cannot be read (damaged, or not a JSON object): it holds the sums that "
                          "model.safetensors and tokenizer.json are checked against. Copy it back from a copy of the run "
                          "folder, or delete it to load the model without those checks")
    summary = summary or {}  # a run that has none: loaded unchecked; one from before it held the sums: no such key
    if isinstance(trained := summary.get("model_config"), dict) and (drift := model_drift(cfg, trained)):
        raise ConfigError(f"{run / 'config.yaml'} has model settings these weights did not train with ({', '.join(drift)}; "
                          "summary.json records those they did): set them back in config.yaml. To try other settings "
                          "with these weights on purpose, copy the run folder and delete model_config from the copy's "
                          "summary.json")
    model = build_hymo(cfg.model, device=device)
    weights = run / "model.safetensors"
    if isinstance(saved := summary.get("model_file"), dict) and (now := file_crc(weights)) != saved:
        if who := run_dir_holder(run):  # a finish between writing the model and its summary.json
            raise ConfigError(f"{weights} is being written: a run is training in {run} now ({who}); try again once it "
                              "has finished")
        raise ConfigError(f"{weights} has changed since the run wrote it ({now['size']} bytes, CRC-32 {now['crc32']}; "
                          f"summary.json: {saved.get('size')} bytes, {saved.get('crc32')}): its bytes were damaged on the "
                          f"disk or in a copy. Copy it again, or delete it: {write_again(run)}")
    try: state = load_file(str(weights), device=str(device))
    except Exception as e:  # safetensors' own error for a cut or damaged file
        raise ConfigError(f"{weights} cannot be read ({e}): copy it again, or delete it: {write_again(run)}") from None
    fix = ("config.yaml's model: section is not the one these weights trained with: put back the run's own config.yaml "
           "(a finished-step_* copy has one; each checkpoint's meta.json holds the settings under 'config')")
    try: wrong = model.load_state_dict(state, strict=False)
    except RuntimeError as e:  # a tensor of another shape
        raise ConfigError(f"{run / 'model.safetensors'} does not fit {run / 'config.yaml'} "
                          f"({str(e).strip().splitlines()[-1].strip()}): {fix}") from None
    if wrong.missing_keys or wrong.unexpected_keys:
        raise ConfigError(f"{run / 'model.safetensors'} does not fit {run / 'config.yaml'} ("
                          + ", ".join(f"{what} {keys[:3]}" for what, keys in (("missing", wrong.missing_keys),
                                      ("unexpected", wrong.unexpected_keys)) if keys) + f"): {fix}")
    again = "copy it again from the run's data folder (data_dir in config.yaml; the bundled corpus is prepared under $HYMO_CACHE)"
    try: tok = Tokenizer.from_file(str(run / "tokenizer.json"))
    except Exception as e:  # tokenizers' own error for a cut or damaged file
        raise ConfigError(f"{run / 'tokenizer.json'} cannot be read ({e}): {again}") from None
    want = summary.get("tokenizer_sha256")  # runs before it was recorded: None
    if want and hashlib.sha256((run / "tokenizer.json").read_text(encoding="utf-8").encode("utf-8")).hexdigest() != want:
        raise ConfigError(f"{run / 'tokenizer.json'} is not the tokenizer this run trained with (its sha256 differs from "
                          f"summary.json's): {again}, from the dataset whose manifest.json has that tokenizer_sha256")
    if tok.get_vocab_size() > cfg.model.vocab_size:
        raise ConfigError(f"{run / 'tokenizer.json'} has {tok.get_vocab_size()} tokens, more than the model's vocab_size="
                          f"{cfg.model.vocab_size}: it is not this run's tokenizer; {again}")
    tok.encode_special_tokens = True  # "<|endoftext|>" typed in a prompt is text, as in training
    model.trained_len = trained_length(run)  # `generate`'s window, unless one is given: no position it never trained on
    return model.eval(), tok


def config_back(run: Path) -> str:
    "How a finished run's config.yaml, deleted or damaged, is put back."
    from hymo.training.trainer import list_checkpoints
    back = "copy it back from a copy of the run folder, or from its finished-step_* copy if it has one"
    if not list_checkpoints(run): return back
    final = list_checkpoints(run)[-1]
    return (f"{back}; or `python -m hymo.train --config {shell_word(final)}` (the settings the run trained with, as its "
            "final checkpoint's meta.json records them), which writes config.yaml again from that checkpoint")


def write_again(run: Path) -> str:
    "How a finished run's deleted model.safetensors (or tokenizer.json) is written again: from its final checkpoint, if one is left."
    from hymo.training.trainer import list_checkpoints
    if list_checkpoints(run):
        return (f"python -m hymo.train --config {shell_word(run / 'config.yaml')} run_dir={shell_word(run)} writes the missing files again from "
                "the final checkpoint")
    return (f"{run} has no checkpoint left to write them from, so copy them back from a copy of the run folder, or train "
            "the run again in a new run_dir=...")


def trained_length(run_dir: str | Path) -> int:
    "The longest sequence the run trained on (its train.seq_len): how much text the model reads at once when generating."
    cfg = run_config(run_dir)
    return min(cfg.train.seq_len, cfg.model.max_seq_len)


def prompt_ids(tok, prompt: str) -> list[int]:
    "The ids the model reads for `prompt`: the end-of-text token first, as it opens every training document (chapter 60)."
    eot = tok.token_to_id(EOT)
    return ([] if eot is None else [eot]) + tok.encode(prompt).ids


def generate_text(model: HyMo, tok, # From `load_run`
                  prompt: str = "ROMEO:", # Text to continue
                  max_new_tokens: int = 200, # Tokens to add
                  temperature: float = 0.8, # 0: greedy
                  top_k: int | None = 50, # Sample among the k most likely tokens; None: all
                  seed: int = 0, # The same seed gives the same text
                  stop: bool = True, # End at the end-of-text token; False runs all `max_new_tokens` forwards (as every FSDP rank must) and cuts after
                  stream: Callable[[str], None] | None = None, # Called with each new piece of the text as it is drawn, the prompt first
                  cache: bool = True, # Carry the decode state (`HyMo.decode`); False re-runs the forward per token (compiled or FSDP models)
                  window: int | None = None, # Most tokens one forward reads; None: the run's train.seq_len (`load_run` sets `model.trained_len`), else max_seq_len
                  top_p: float | None = None, # Then among the fewest most likely tokens whose probabilities add up to p (`keep_likely`); None: all
                 ) -> str:
    "The prompt and its continuation up to the end-of-text token (or `max_new_tokens`), decoded."
    eot, ids = tok.token_to_id(EOT), prompt_ids(tok, prompt)
    if not ids: raise ValueError("the prompt is empty and the tokenizer has no end-of-text token to start from")
    shown = _Stream(tok, ids[eot is not None:], eot, stream)
    dev = next(model.parameters()).device
    with torch.random.fork_rng(devices=[dev] if dev.type == "cuda" else []):
        torch.manual_seed(seed)
        out = model.generate(torch.tensor([ids], device=dev), max_new_tokens, temperature=temperature, top_k=top_k,
                             top_p=top_p, vocab=tok.get_vocab_size(), stop=eot if stop else None,  # vocab: only ids it decodes
                             on_token=shown.add if stream else None, cache=cache, window=window)
    new = out[0, len(ids):].tolist()
    if eot in new: new = new[:new.index(eot)]  # the same text whether generation stopped there or ran on
    text = tok.decode(ids[eot is not None:] + new)
    shown.finish(text)
    return text


class _Stream:
    """Hands `show` the text of the ids drawn so far, piece by piece, never a piece that later ids would change.
    Each piece is the new ids decoded after the last shown chunk, and minus that chunk's text: some decoders (Metaspace,
    WordPiece) drop the space before the first token of a decode, so a token needs its left neighbour to decode right.
    Only those few ids are decoded again, so each token costs the same however long the text."""
    def __init__(self, tok, ids: list[int], eot: int | None, show: Callable[[str], None] | None):
        self.tok, self.eot, self.show, self.ended = tok, eot, show, False
        self.ids, self.done = list(ids), ""  # every id drawn (the prompt's first); the text shown so far
        self.ctx = self.mark = 0  # ids[ctx:mark]: the last chunk shown, the left context; ids[mark:]: not shown yet
        self._advance()

    def _advance(self):
        if self.show is None: return
        before, now = self.tok.decode(self.ids[self.ctx:self.mark]), self.tok.decode(self.ids[self.ctx:])
        cut = len(self.ids)
        if now.endswith("\ufffd") and cut - self.mark > 4:  # bytes that are no character (a model drawing junk): a
            cut -= 4                                          # character is at most 4 byte tokens, so all but the last 4
            part = self.tok.decode(self.ids[self.ctx:cut])    # ids are final, if the cut splits nothing: the ids after
            if part + self.tok.decode(self.ids[cut:]) != now: return  # it decode alone as within `now` (a truncated
            now = part                                                # character split there would count one U+FFFD more)
        elif now.endswith("\ufffd"): return  # byte-level BPE: a character split over tokens is U+FFFD until complete
        if not now.startswith(before): return  # the decoder rewrote the context: wait (`finish` sends the rest)
        if len(now) > len(before):
            self.show(now[len(before):]); self.done += now[len(before):]
        if cut > self.mark: self.ctx, self.mark = self.mark, cut

    def add(self, i: int):
        self.ended = self.ended or i == self.eot  # after the end-of-text token nothing is shown (FSDP ranks run on)
        if not self.ended:
            self.ids.append(i)
            self._advance()

    def finish(self, text: str):
        "Show what is left of `text`, the returned text, so the pieces always add up to it."
        if self.show is not None and text.startswith(self.done) and len(text) > len(self.done): self.show(text[len(self.done):])


# %% [markdown]
# ## The command line
#
# `--tokens` is an upper bound: the text ends where the model draws the end-of-text token. The
# command reads the folder's exported model, which `finish` writes at the end of a run; a finished
# run that was resumed to more steps and stopped before its end still holds the old model beside
# newer checkpoints, and one being resumed now holds it until it finishes; the command says so on
# stderr rather than pass the old model off as the run's latest. The text is printed as it is drawn;
# a reader that stops reading (`python -m hymo.generate RUN | head -c 200`) ends the generation quietly,
# with status 0, as `python -m hymo.data info DIR | head` does.

# %%
#| export
def newer_checkpoint_note(run_dir: str | Path) -> str | None:
    """A note when the run's exported model may not be its latest: a finished run resumed to more steps (newer
    checkpoints beside it), or a process training in the folder now."""
    from hymo.training.trainer import _json_dict, checkpoint_step, list_checkpoints, run_dir_holder
    run = Path(run_dir)
    step, ckpts = (_json_dict(run / "summary.json") or {}).get("step"), list_checkpoints(run)
    if who := run_dir_holder(run):
        return (f"note: a run is training in {run} now ({who}): {run / 'model.safetensors'} is the model of step {step}, "
                f"the last one it exported")
    if not isinstance(step, int) or not ckpts or checkpoint_step(ckpts[-1]) <= step: return None
    return (f"note: {run / 'model.safetensors'} is the model of step {step}, but the run has checkpoints up to step "
            f"{checkpoint_step(ckpts[-1])}: it was resumed and has not finished; the train command that resumed it "
            f"finishes it and writes the newer model")


def main(argv: list[str] | None = None) -> str:
    "Parse `argv`, load the run, print and return the generated text."
    p = argparse.ArgumentParser(prog="python -m hymo.generate", description="Continue a prompt with a trained HyMo.")
    p.add_argument("run_dir", metavar="RUN_DIR", help="a finished run folder (config.yaml, model.safetensors, tokenizer.json)")
    p.add_argument("--prompt", default=None, help="text to continue (default: the run's train.sample_prompt, the end-of-run "
                   "sample's: ROMEO: on the bundled corpus, else the start of a document; one that starts with a dash: --prompt=-...)")
    p.add_argument("--tokens", type=int, default=200, help="at most this many tokens: the text ends earlier where the model "
                   "draws the end-of-text token (default: 200)")
    p.add_argument("--temperature", type=float, default=0.8, help="softmax temperature; 0 is greedy (default: 0.8)")
    p.add_argument("--top-k", type=int, default=50, help="sample among the k most likely tokens; 0: all (default: 50)")
    p.add_argument("--top-p", type=float, default=1.0, help="then among the fewest most likely tokens whose probabilities "
                   "add up to p (nucleus sampling), in (0, 1]; 1: all (default: 1)")
    p.add_argument("--seed", type=int, default=None, help="the same seed gives the same text (default: the run's train.seed, "
                   "which its end-of-run sample used)")
    p.add_argument("--device", default="auto", help="cpu, cuda, or auto: cuda when there is one (default: auto)")
    a, extra = p.parse_known_args(argv)
    if extra: p.error(f"unrecognized arguments: {' '.join(extra)}" + ("; a prompt is given as --prompt \"...\""
                                                                       if not extra[0].startswith("-") else ""))
    for flag, v in (("--tokens", a.tokens), ("--temperature", a.temperature), ("--top-k", a.top_k)):
        if not v >= 0: p.error(f"{flag} must be a number >= 0, got {v}")  # `not >=` also refuses nan
    if not math.isfinite(a.temperature): p.error("--temperature must be finite (0 is greedy)")
    if not 0 < a.top_p <= 1: p.error(f"--top-p must be in (0, 1] (1 keeps every token), got {a.top_p}")
    if a.seed is not None and not 0 <= a.seed < 2 ** 64: p.error(f"--seed must be in 0..2**64-1, got {a.seed}")
    try: (a.prompt or "").encode("utf-8")  # bytes that are not UTF-8 reach Python as lone surrogates
    except UnicodeEncodeError: p.error("--prompt is not valid UTF-8 text: check the terminal's or the script's encoding")
    device = ("cuda" if torch.cuda.is_available() else "cpu") if a.device == "auto" else a.device
    try: device = torch.device(device)
    except RuntimeError: p.error(f"--device {a.device}: give cpu, cuda, cuda:N or auto")
    if device.type not in ("cpu", "cuda"): p.error(f"--device {a.device}: HyMo generates on cpu or cuda")
    if device.type == "cuda" and not torch.cuda.is_available(): p.error(f"--device {a.device}, but this machine has no CUDA GPU")
    if device.type == "cpu" and device.index: p.error(f"--device {a.device}: the CPU is one device, give cpu")
    if device.type == "cpu": device = torch.device("cpu")  # cpu:0 is the CPU too (safetensors takes only "cpu")
    if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
        p.error(f"--device {a.device}: this machine has {torch.cuda.device_count()} CUDA GPU(s), cuda:0 to cuda:{torch.cuda.device_count() - 1}")
    shown = []
    def show(piece: str):  # the text appears as it is drawn, so a Ctrl-C keeps what was printed
        shown.append(piece)
        print(piece, end="", flush=True)
    try:
        model, tok = load_run(a.run_dir, device)
        run_train = run_config(a.run_dir).train  # (load_run has checked the folder)
        if a.prompt is None: a.prompt = run_train.prompt
        if a.seed is None: a.seed = run_train.seed
        if note := newer_checkpoint_note(a.run_dir): print(note, file=sys.stderr)
        n, L = len(prompt_ids(tok, a.prompt)), model.trained_len  # n: with the end-of-text token that opens it; L: `load_run`'s
        if n > L: print(f"note: the prompt is {n} tokens with the end-of-text token that opens it ({len(tok.encode(a.prompt).ids)} "
                        f"as typed), more than the {L} the model trained on (train.seq_len): it "
                        f"sees only the last {L}", file=sys.stderr)
        text = generate_text(model, tok, a.prompt, a.tokens, a.temperature, a.top_k or None, a.seed, stream=show, window=L,
                             top_p=a.top_p if a.top_p < 1 else None)
    except (ConfigError, ValueError) as e:
        p.error(str(e))
    except BrokenPipeError:  # `... | head`: the reader has what it wanted and closed the pipe
        to_devnull(sys.stdout)
        return "".join(shown)
    except KeyboardInterrupt:
        if shown: print(flush=True)
        drawn = len(shown) > (1 if shown and a.prompt else 0)  # the first piece is the prompt itself
        p.exit(130, "interrupted: " + ("the text so far is above\n" if drawn else "nothing was generated\n"))
    if not text.endswith("\n"): print()  # the output ends in one line break, not an empty line
    return text


# %% [markdown]
# `python -m hymo.generate` runs `main`; in a notebook kernel, also named `__main__` but without a
# `__file__`, the cell does nothing.

# %%
#| export
if __name__ == "__main__" and "__file__" in globals(): main()

# %% [markdown]
# ## A run, then its text
#
# A few steps of the tiny model (chapter 70's settings), then generation from the folder alone. The
# loaded model gives the logits of the trainer's own, and the text is the trainer's sample: both
# use the run's seed (`train.seed`, 0 here), top-50 and temperature 0.8.

# %%
from hymo.training.trainer import Trainer

# %%
torch.set_num_threads(1)
work = Path(tempfile.mkdtemp())
small = dict(seq_len=32, micro_batch_size=4, global_batch_size=8, max_steps=6, warmup_steps=2, eval_every=0,
             ckpt_every=0, sample_tokens=16)
cfg = load_config("hymo_tiny", **small)
trainer = Trainer(cfg.model, cfg.train, run_dir=work / "run", quiet=True)
trainer.fit()

model, tok = load_run(work / "run")
x = torch.randint(0, cfg.model.vocab_size, (1, 24))
torch.testing.assert_close(model(x), trainer.model.eval()(x))
text = generate_text(model, tok, "ROMEO:", max_new_tokens=16, seed=cfg.train.seed)
print(text)
test_eq(text, trainer.summary["sample"])

# %% [markdown]
# Greedy decoding needs no seed, and the command line prints the same text as the function:

# %%
greedy = generate_text(model, tok, "ROMEO:", 12, temperature=0)
test_eq(greedy, generate_text(model, tok, "ROMEO:", 12, temperature=0, seed=1))
r = subprocess.run([sys.executable, "-m", "hymo.generate", str(work / "run"), "--tokens", "12", "--temperature", "0",
                    "--device", "cpu"], capture_output=True, text=True)
test_eq((r.returncode, r.stdout.strip()), (0, greedy.strip()))

# %% [markdown]
# With `stream`, the text arrives piece by piece as it is drawn (the command line prints each piece
# at once, so a long generation shows progress and a Ctrl-C keeps what was printed). The pieces add
# up to the returned text. A byte-level BPE token can hold part of a character: `☃` is three bytes,
# which this small tokenizer keeps as separate tokens, and a prefix that ends inside it decodes to
# the replacement character `�`. `_Stream` holds such a piece back until the character is complete:

# %%
pieces = []
streamed = generate_text(model, tok, "ROMEO:", max_new_tokens=16, seed=cfg.train.seed, stream=pieces.append)
test_eq(("".join(pieces), pieces[0]), (streamed, "ROMEO:"))
test_eq(streamed, text)  # streaming changes nothing drawn
snow = tok.encode("snow ☃ and é").ids
print([tok.decode([i]) for i in snow])
assert any("\ufffd" in tok.decode(snow[:n]) for n in range(len(snow)))  # some prefix ends inside a character
pieces = []
s = _Stream(tok, [], tok.token_to_id(EOT), pieces.append)
for i in snow: s.add(i)
s.finish(tok.decode(snow))
test_eq("".join(pieces), "snow ☃ and é")
assert not any("\ufffd" in piece for piece in pieces), pieces


# %% [markdown]
# Each new token decodes only the ids since the last whole character, not the whole text again, so
# streaming a long generation costs the same per token at the end as at the start:

# %%
class Counting:
    "A tokenizer that records how many ids each decode is given."
    def __init__(self, tok): self.tok, self.sizes = tok, []
    def decode(self, ids): self.sizes.append(len(ids)); return self.tok.decode(ids)

counting, pieces = Counting(tok), []
s = _Stream(counting, [], None, pieces.append)
long_ids = tok.encode("snow ☃ and é, " * 200).ids
for i in long_ids: s.add(i)
test_eq("".join(pieces), tok.decode(long_ids))
assert max(counting.sizes) <= 6, max(counting.sizes)  # the last chunk shown (☃ is at most 3 tokens) and the new ids

# %% [markdown]
# Two harder cases. A model that draws bytes that are no character (an undertrained one may) leaves
# the text ending in `�` for as long as it goes on; the pieces still come, a few ids behind, each
# ending where the text splits cleanly (lossy UTF-8 decoding writes one `�` per maximal ill-formed
# sequence: a truncated character such as F0 A9 98 is one, each stray byte its own; cut inside such a
# character, the pieces would show one `�` more than the returned text has). And a
# dataset may be prepared with another kind of tokenizer (`--tokenizer`): a decoder that strips the
# space before the first token of each decode (Metaspace's, or the Replace + ByteFallback + Fuse +
# Strip sequence of Llama 2's `tokenizer.json`) is why a piece is decoded with the chunk before it
# as context.

# %%
from tokenizers import Tokenizer as HFTokenizer, decoders as hf_decoders, models as hf_models

# %%
junk = [tok.token_to_id("â")] * 50 + tok.encode(" and on").ids  # 50 times the first byte of a 3-byte character
counting, pieces = Counting(tok), []
s = _Stream(counting, [], None, pieces.append)
for i in junk: s.add(i)
s.finish(tok.decode(junk))
test_eq("".join(pieces), tok.decode(junk))
assert len(pieces) > 10 and max(counting.sizes) <= 10, (len(pieces), max(counting.sizes))

class ByteTokens:  # the 256 bytes as tokens, decoded as a byte-level BPE decodes: joined, then UTF-8 with U+FFFD for junk
    def decode(self, ids): return bytes(ids).decode("utf-8", "replace")
bad = [0xF0, 0xA9, 0x98, 0xE2, 0xA9, 0xE2, 0xC3, 0x20] * 3  # F0 A9 98 is one U+FFFD; the 98 alone would be another
pieces = []
s = _Stream(ByteTokens(), [], None, pieces.append)
for i in bad: s.add(i)
shown = len(pieces)
s.finish(ByteTokens().decode(bad))
test_eq("".join(pieces), ByteTokens().decode(bad))
assert shown > 1, pieces  # streamed as it came, not all at the end

words = {"▁Hello": 0, "▁world": 1, "▁again": 2}
meta_tok = HFTokenizer(hf_models.WordLevel(words, unk_token="▁Hello")); meta_tok.decoder = hf_decoders.Metaspace()
test_eq(meta_tok.decode([0, 1, 2]), "Hello world again")
pieces = []
s = _Stream(meta_tok, [0], None, pieces.append)
for i in (1, 2): s.add(i)
s.finish(meta_tok.decode([0, 1, 2]))
test_eq(pieces, ["Hello", " world", " again"])


# %% [markdown]
# A Ctrl-C during generation ends in one line on stderr, exit status 130, with the text so far
# printed above it. Here the "Ctrl-C" comes after the fourth token:

# %%
def interrupted_after_4(self, tokens, *a, on_token=None, **k):
    for i in tok.encode(" a good day").ids[:4]: on_token(i)
    raise KeyboardInterrupt
generate_once = HyMo.generate
HyMo.generate = interrupted_after_4
with contextlib.redirect_stdout(io.StringIO()) as out, contextlib.redirect_stderr(io.StringIO()) as err:
    test_fail(lambda: main([str(work / "run"), "--device", "cpu"]), exc=SystemExit)
HyMo.generate = generate_once
print(out.getvalue() + err.getvalue())
assert out.getvalue().startswith("ROMEO:") and len(out.getvalue()) > len("ROMEO:\n"), out.getvalue()
test_eq(err.getvalue(), "interrupted: the text so far is above\n")
def interrupted_at_once(self, *a, **k): raise KeyboardInterrupt  # the prompt is printed, no token drawn yet
HyMo.generate = interrupted_at_once
with contextlib.redirect_stdout(io.StringIO()) as out, contextlib.redirect_stderr(io.StringIO()) as err:
    test_fail(lambda: main([str(work / "run"), "--device", "cpu"]), exc=SystemExit)
HyMo.generate = generate_once
test_eq((out.getvalue(), err.getvalue()), ("ROMEO:\n", "interrupted: nothing was generated\n"))

# %% [markdown]
# Every sample starts from the end-of-text token, which the decoded text leaves out; an empty prompt
# is a sample from nothing but that token:

# %%
seen = []
generate_once = model.generate
model.generate = lambda tokens, *a, **k: seen.append(tokens) or generate_once(tokens, *a, **k)
unprompted = generate_text(model, tok, "", 12, seed=2)
model.generate = generate_once
test_eq(seen[0].tolist(), [[tok.token_to_id(EOT)]])
test_eq(generate_text(model, tok, "", 12, seed=2, stop=False), unprompted)  # ran on to 12 tokens, then cut: the same text
print(repr(unprompted))
assert EOT not in unprompted

# %% [markdown]
# A folder that is not a finished run says what it lacks and what to give instead:

# %%
r = subprocess.run([sys.executable, "-m", "hymo.generate", str(work)], capture_output=True, text=True)
print(r.stderr.strip().splitlines()[-1])
assert r.returncode == 2 and "has no config.yaml" in r.stderr and "Traceback" not in r.stderr

# %% [markdown]
# So do options that cannot work (checked before the model is loaded):

# %%
for args, says in [(["--temperature", "nan"], "--temperature must be a number >= 0, got nan"), (["--temperature", "inf"], "must be finite"),
                   (["--device", "tpu"], "give cpu, cuda"), (["--device", "meta"], "on cpu or cuda"),
                   (["--device", "cpu:3"], "the CPU is one device"), (["--seed", "99999999999999999999"], "--seed must be in"),
                   (["--seed", "-1"], "--seed must be in"), (["--top-p", "0"], "--top-p must be in (0, 1]"),
                   (["--top-p", "1.5"], "--top-p must be in (0, 1]"), (["--top-p", "nan"], "--top-p must be in (0, 1]")]:
    with contextlib.redirect_stderr(io.StringIO()) as err:
        test_fail(lambda: main([str(work / "run"), *args]), exc=SystemExit)
    assert says in err.getvalue(), err.getvalue()

# %% [markdown]
# The run's `tokenizer.json` is the dataset's, and `summary.json` records its sha256: a tokenizer
# copied in from another dataset (the cache holds several side by side) would turn the model's ids
# into other text, or into ids it has no row for. It is refused, saying where the right one is. A
# prompt longer than the training length is not an error (the model reads its last `train.seq_len`
# tokens, as it does once a long generation outgrows that), but the command line says so.
#
# `summary.json` also records `model.safetensors`' size and CRC-32 (`model_file`), as a
# checkpoint's `meta.json` records its files' (chapter 70): safetensors keeps no checksum, and a
# bit flipped on a disk or in a copy loads without an error into a weight that differs. A file
# that has changed is refused, with the way back: copy it again, or delete it and let the train
# command write it again from the final checkpoint (`write_again` says so only while a checkpoint
# is left to write it from). A run from before the sums loads unchecked. A `summary.json` that
# cannot be read is refused rather than read as such a run, which would drop both checks without
# a word: copy it back, or delete it to load unchecked. `summary.json` records the model settings the
# weights trained with (`model_config`): a `config.yaml` whose model section differs is refused, with
# what differs and was trained (an edit that keeps every shape, `moe_top_k: 3`, loaded into another
# model than the one trained); the GDN kernel and chunk size say how it runs, and settings only
# training uses change nothing here: those may differ (`FREE_TO_EDIT`). To try other settings with
# the weights on purpose, copy the folder and delete `model_config` from the copy's summary. A
# `config.yaml` that is missing or cannot be read is copied back, or written again by the train
# command given the settings the run trained with (`config_back`): it writes the final files again
# from the final checkpoint, the damaged ones set aside (chapter 70). A checkpoint folder given for the run (as a
# path inside `checkpoints/`, or copied elsewhere) is told which folder to give instead.

# %%
import shutil
from tokenizers import Tokenizer, models, pre_tokenizers

# %%
test_eq(json.loads((work / "run" / "summary.json").read_text())["tokenizer_sha256"],
        hashlib.sha256((work / "run" / "tokenizer.json").read_bytes()).hexdigest())
other = work / "other_tokenizer"
shutil.copytree(work / "run", other)
wrong = Tokenizer(models.BPE()); wrong.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
wrong.add_special_tokens([EOT]); wrong.save(str(other / "tokenizer.json"))
test_fail(lambda: load_run(other), contains="is not the tokenizer this run trained with")
(other / "summary.json").unlink()  # a run from before summary.json had the sha256: the vocabulary is still checked
wrong.add_tokens([f"w{i}" for i in range(3000)]); wrong.save(str(other / "tokenizer.json"))
test_fail(lambda: load_run(other), contains="tokens, more than the model's vocab_size=2048: it is not this run's tokenizer")
test_eq(trained_length(work / "run"), small["seq_len"])  # 32 here; max_seq_len is 256

# %%
flipped = work / "flipped_model"
shutil.copytree(work / "run", flipped)
weights = bytearray((flipped / "model.safetensors").read_bytes()); weights[-6] ^= 0x40  # one bit of the last tensor
(flipped / "model.safetensors").write_bytes(bytes(weights))
test_fail(lambda: load_run(flipped), contains="model.safetensors has changed since the run wrote it")
test_eq(set(json.loads((work / "run" / "summary.json").read_text())["model_file"]), {"size", "crc32"})
edited = work / "edited_config"
shutil.copytree(work / "run", edited)
text = (edited / "config.yaml").read_text()
(edited / "config.yaml").write_text(text.replace("moe_top_k: 2", "moe_top_k: 3"))  # every shape as trained
test_fail(lambda: load_run(edited), contains="has model settings these weights did not train with (moe_top_k: 3 (trained: 2)")

# %% [markdown]
# The GDN kernel a run was trained with is not part of its weights. `run_config` turns `triton`
# into `auto`, so a GPU run loads on a CPU, and keeps the PyTorch chunked path for a run whose
# chunks are not the Triton kernels' 64 tokens (on a GPU, `auto` would pick Triton and refuse them):

# %%
import re

# %%
kernels = {}
for kernel, chunk in (("triton", 64), ("auto", 32), ("torch", 32), ("torch", 64), ("naive", 64), ("auto", 64)):
    (other / "config.yaml").write_text(re.sub(r"gdn_kernel: \w+", f"gdn_kernel: {kernel}", re.sub(
        r"gdn_chunk_size: \d+", f"gdn_chunk_size: {chunk}", (work / "run" / "config.yaml").read_text())))
    m = run_config(other).model
    kernels[kernel, chunk] = (m.gdn_kernel, m.gdn_chunk_size)
test_eq(list(kernels.values()), [("auto", 64), ("torch", 32), ("torch", 32), ("torch", 64), ("naive", 64), ("auto", 64)])
long_prompt = "ROMEO: " * 30  # about 60 tokens
with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()) as err:
    main([str(work / "run"), "--prompt", long_prompt, "--tokens", "2", "--device", "cpu"])
assert f"more than the 32 the model trained on (train.seq_len): it sees only the last 32" in err.getvalue(), err.getvalue()

# %% [markdown]
# ## Interview questions
#
# ::: {.callout-tip collapse="true"}
# ## What does the 1000th token cost, with the decode state and without it?
# Without it (`cache=False`) every token re-runs the model on the whole context, so each pays for
# the prefix again: quadratic in the length for MLA, and linear per token even for GDN, whose
# recurrence can carry the prefix in a fixed-size state. With it (the default), each GDN layer
# keeps the state $S$ (40 heads of 32 × 32 fp32 numbers at the 750M size) and the last three inputs
# of the short convolution, and each MLA layer the latent cache $c_t$ with the shared rope key. A
# new token then costs one step of the recurrence in each GDN layer, the same at token 10 and token
# 4 000, and one attention row against the cache in each MLA layer. That row grows with the context
# in principle; HyMo scores the whole cache it allocated (prompt + new tokens) and masks the cache
# slots not yet written, so that every step has the same shapes and replays as one CUDA graph: its cost is the
# longest text's from the first token, still one row per layer.
# That is the point of the hybrid: 24 of the 32 layers carry a constant-size state. (HyMo steps the
# recurrence itself, with the fused recurrent kernel of chapter 13 on a GPU. This holds up to the
# training length, 4 096 tokens for `hymo_750m`: past it, `generate` re-runs the last 4 096 tokens
# for every new one, since the model was never trained on later positions.)
# :::
#
# ::: {.callout-tip collapse="true"}
# ## Why do temperature, top-k and top-p exist, if the model already gives a distribution?
# Sampling from the model's distribution exactly makes long texts drift: each token has a small
# chance of being an unlikely one, and over hundreds of tokens some are, after which the text
# follows them. Temperature below 1 sharpens the distribution and top-k removes the long tail
# outright; both trade diversity for coherence. Top-p (nucleus sampling) cuts the tail by mass
# instead of by count: after "The capital of France is" the nucleus may be one token, after "I
# like" hundreds, where a fixed $k$ is too many for the first and too few for the second.
# Temperature 0 (greedy) removes the randomness and tends to loop on small models, which is why the
# default is 0.8 with the top 50.
# :::
