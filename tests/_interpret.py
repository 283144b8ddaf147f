"""Run kernel checks in Triton's interpreter, in a fresh process.

TRITON_INTERPRET=1 is read when a kernel is decorated, so the kernels run in a child Python that sets
it before importing anything (another test module may already have imported triton and the kernel
modules in this process, compiled for a GPU). The child prints `RESULT` and a JSON object of errors.
"""
import json
import os
import subprocess
import sys


def run_child(code: str, timeout: int = 600) -> dict:
    "Run `code` with TRITON_INTERPRET=1 and return the JSON object it prints after `RESULT`."
    env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}  # the interpreter runs on CPU tensors, GPU or not
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=timeout)
    if p.returncode and "only 0-dimensional arrays can be converted to Python scalars" in p.stderr:
        import numpy, pytest, triton  # seen with Triton 3.6 and NumPy 2.5: the interpreter's loop bounds are 1-element arrays
        pytest.skip(f"Triton {triton.__version__}'s interpreter cannot run under NumPy {numpy.__version__}; "
                    "on a GPU, benchmarks/gdn_verify.py checks the kernels against the loop instead")
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.split("RESULT", 1)[1])
