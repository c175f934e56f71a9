"""``vllm serve``, with the CPU stand-ins where vLLM lacks its kernels: ``python -m demo.serve MODEL [options]``.

On a GPU machine this is plain ``vllm serve``. On a CPU-only machine with
vLLM's CUDA-only PyPI wheel, the server's processes need the stand-ins of
demo/cpu_stand_ins.py: vLLM's CPU platform starts its engine core and worker
with multiprocessing's *spawn* method, and spawn imports the parent's main
module in every child (as ``__mp_main__``), so the module-level lines below
run in the API server, the engine core and the worker alike. They register
nothing where vLLM has its own kernels, and hide AMX from vLLM in each of
those processes (why: demo/cpu_stand_ins.py; pass ``--attention-backend
CPU_MLA`` too, as docs/vllm.md does).
"""

from __future__ import annotations

import os
import sys

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # a local model directory; never ask the Hub
    from demo import cpu_stand_ins

    cpu_stand_ins.prepare()


def main(argv: list[str]) -> None:
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv = ["vllm", "serve", *argv]
    vllm_main()


if __name__ == "__main__":
    main(sys.argv[1:])
