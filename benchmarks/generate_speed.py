"""Decoding speed of `HyMo.generate`, with the decode state (`cache=True`) and re-running the forward per token.

    python benchmarks/generate_speed.py [--config hymo_750m] [--prompt 512] [--tokens 256] [--bf16] [--out generate_speed.json]

Builds the preset's model with its initial weights (the speed does not depend on what the weights
have learned), feeds a random prompt of --prompt tokens and draws --tokens more, greedily, at
batch 1: first with the decode state (the GDN blocks carry S and the convolution window, the MLA
blocks their latent cache; on a GPU each one-token step is replayed as a CUDA graph,
`DecodeGraph`), on a GPU also with the state but eager steps (`graph=False`), then without the
state (`cache=False`: the whole context again for every token). Reports tokens per second of each
whole `generate` call, as a user waits for it: the prompt's prefill and, with the graph, its capture
(once per call) are in the time, so the per-token decode rate is somewhat higher, the more so for
short --tokens (after one untimed warm-up generation of 16 tokens per mode), their ratios, the peak memory on a
GPU, and how many leading tokens the state and the re-run drew alike (bf16 rounding differs
between the paths, and initial weights give near-equal logits, so greedy choices may part after a
while: the parity checks are `tests/test_model.py`'s, on unit-scale weights). The model runs in
fp32, as `python -m hymo.generate` runs a finished model; with --bf16 (a GPU only) under bf16
autocast with fp32 weights, as the trainer's sample runs. The default config is hymo_750m on a GPU
and hymo_tiny on a CPU. At batch 1 the eager paths are bound by the host's kernel launches (a few
thousand per token for the 750M model), not by the GPU; the graph launches a step's kernels at once.
"""
import argparse
import time

import torch

from hymo.config import ConfigError, load_config
from hymo.models.model import build_hymo
from need_gpu import add_row, check_out, device_arg, provenance  # the script beside this one


def timed_generate(model, prompt, n: int, cache: bool, graph: bool, device: torch.device, bf16: bool) -> tuple[torch.Tensor, float]:
    "Greedy `generate` of `n` tokens; the drawn ids and the seconds it took (the GPU synchronised at both ends)."
    if device.type == "cuda": torch.cuda.synchronize()
    t0 = time.perf_counter()
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=bf16):
        out = model.generate(prompt, n, temperature=0, cache=cache, graph=graph)
    if device.type == "cuda": torch.cuda.synchronize()
    return out[0, prompt.shape[1]:], time.perf_counter() - t0


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default=None, help="preset or YAML (default: hymo_750m on a GPU, hymo_tiny on a CPU)")
    p.add_argument("--prompt", type=int, default=None, help="prompt tokens (default 512, at most half of max_seq_len)")
    p.add_argument("--tokens", type=int, default=None, help="tokens to draw (default 256, at most what max_seq_len leaves)")
    p.add_argument("--device", default="auto", type=lambda d: d if d == "auto" else device_arg(d), help="cpu, cuda or auto (default)")
    p.add_argument("--bf16", action="store_true", help="bf16 autocast (a GPU only); default fp32")
    p.add_argument("--out", default=None, help="add the results to this JSON list, first (the results page reads newest first)")
    a = p.parse_args(argv)
    check_out(p, a.out, adds=list)
    device = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if a.device == "auto" else a.device)
    if device.type == "cuda" and not torch.cuda.is_available(): p.error("--device cuda, but this machine has no CUDA GPU")
    if a.bf16 and device.type != "cuda": p.error("--bf16 needs a CUDA GPU (bf16 autocast); on a CPU the benchmark runs fp32")
    config = a.config or ("hymo_750m" if device.type == "cuda" else "hymo_tiny")
    try: cfg = load_config(config).model
    except ConfigError as e: p.error(str(e))
    if a.prompt is None: a.prompt = min(512, cfg.max_seq_len // 2)  # hymo_tiny (a CPU's default) holds 256 tokens
    if a.tokens is None: a.tokens = min(256, cfg.max_seq_len - a.prompt)
    if a.prompt < 1 or a.tokens < 1 or a.prompt + a.tokens > cfg.max_seq_len:
        p.error(f"--prompt and --tokens must be positive and add up to at most max_seq_len={cfg.max_seq_len}")
    torch.manual_seed(0)
    model = build_hymo(cfg, device).eval()
    prompt = torch.randint(0, cfg.vocab_size, (1, a.prompt), device=device)
    result = {"config": config, "device":
              torch.cuda.get_device_name() if device.type == "cuda" else "cpu", **provenance(),
              "prompt_tokens": a.prompt, "new_tokens": a.tokens,
              "precision": "bf16 autocast, fp32 weights" if a.bf16 else "fp32", "greedy": True}
    drawn = {}
    modes = {"with_state": (True, True), "forward_per_token": (False, False)}  # key: (cache, graph)
    if device.type == "cuda": modes = {"with_state": (True, True), "with_state_eager": (True, False), "forward_per_token": (False, False)}
    for key, (cache, graph) in modes.items():
        timed_generate(model, prompt, 16, cache, graph, device, a.bf16)  # warm-up: kernels compiled and tuned, memory pooled
        if device.type == "cuda": torch.cuda.reset_peak_memory_stats()
        drawn[key], s = timed_generate(model, prompt, a.tokens, cache, graph, device, a.bf16)
        result[key] = {"seconds": round(s, 3), "tokens_per_s": round(a.tokens / s, 2)}
        if device.type == "cuda": result[key]["peak_memory_gb"] = round(torch.cuda.max_memory_allocated() / 1e9, 2)
        print(f"{key:18s} {a.tokens} tokens in {s:7.2f} s: {a.tokens / s:8.1f} tokens/s", flush=True)
    result["speedup"] = round(result["with_state"]["tokens_per_s"] / result["forward_per_token"]["tokens_per_s"], 2)
    if "with_state_eager" in result:
        result["graph_speedup"] = round(result["with_state"]["tokens_per_s"] / result["with_state_eager"]["tokens_per_s"], 2)
        print(f"the CUDA graph: {result['graph_speedup']}x the eager decoding steps")
    same = (drawn["with_state"] != drawn["forward_per_token"]).nonzero()
    result["leading_tokens_alike"] = int(same[0, 0]) if len(same) else a.tokens
    print(f"speed-up {result['speedup']}x; the first {result['leading_tokens_alike']} of {a.tokens} tokens drawn alike")
    if a.out: add_row(a.out, result)
    return result


if __name__ == "__main__": main()
