"""AMX simulated present: ``torch.cpu._is_amx_tile_supported()`` returns True in this process.

Not a test module. tests/vllm_plugin/test_amx.py puts this directory on
``PYTHONPATH`` for one pytest run of the vLLM tests and the demo's engine
runs. Python imports ``sitecustomize`` at start-up, so the answer changes in
that pytest process and in every Python process started from it: the
demo's generation runs and vLLM's engine-core and worker processes, which
its CPU platform starts with multiprocessing's spawn, included. vLLM reads
the function at each of its AMX decisions (demo/cpu_stand_ins.py lists them),
so on a CPU without AMX that run meets the decisions a CPU with AMX meets,
and shows that every process here hides AMX from vLLM again.

Only the answer changes, not the CPU: code that acts on it by executing AMX
instructions (Inductor's CPU code generation reads the same function) must
not run in such a process while AMX is reported present.
"""

try:
    import torch
except ImportError:  # an interpreter without torch (e.g. the system Python of scripts/env.sh): nothing to report to
    pass
else:
    torch.cpu._is_amx_tile_supported = lambda: True
