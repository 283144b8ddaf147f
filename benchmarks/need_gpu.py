"""What a GPU benchmark checks before it starts: where it cannot run, a one-line message, not a traceback."""
import os

import torch


def need_gpu(on_cpu: str = "",  # What a CPU can run instead, said in the message
             interpreter_ok: bool = False,  # The script has a CPU smoke run under TRITON_INTERPRET=1 (small shapes)
            ):
    "Exit with status 1 unless a CUDA GPU is visible (or, with `interpreter_ok`, TRITON_INTERPRET=1 is set)."
    if torch.cuda.is_available() or (interpreter_ok and os.environ.get("TRITON_INTERPRET") == "1"): return
    raise SystemExit("this benchmark needs a CUDA GPU" + (f"; on a CPU, {on_cpu}" if on_cpu else ""))
