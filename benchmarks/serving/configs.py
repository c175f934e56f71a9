"""Serving configurations: how the servers are set up and the client talks to them, named.

A serving result holds for the configuration it was measured in. Issue 40 found the plugin at
parity under vLLM's defaults and 1.6x slower in median TTFT under another common set-up
(``--max-num-seqs 128``, prefix caching off): the options that decide which steps run in CUDA
graphs, how many sequences share a step and what the prefix cache serves are part of what a run
measures, so they are named here, recorded in every report, and part of a run's identity (a
resumed run never mixes two configurations).

A configuration fixes, beyond the stand-in model:

- ``server_args``: `vllm serve` options on top of the benchmark's own (dummy weights, seed,
  JIT monitor: ``run.GPU_SERVER_ARGS``), and ``max_model_len``;
- ``tokenizer_vocab``: the word tokenizer's size (None: the model's whole vocabulary, so that
  the random dataset's prompts share no prefix-cache block; a small one repeats words, and with
  prefix caching on, prompt blocks);
- ``client_backend``: `vllm bench serve --backend` (``openai``: /v1/completions streamed by the
  OpenAI-compatible client; ``vllm``: the same route through vLLM's own request function);
- ``loads``: the default loads (``--loads`` replaces them), warm-ups first.

``--server-arg`` and ``--max-model-len`` on the command line still add to or replace the
configuration's; the report states the configuration's name, what it sets, and the whole
server command line.
"""

from __future__ import annotations

from dataclasses import dataclass

from .loads import DEFAULT_LOADS


@dataclass(frozen=True)
class Configuration:
    name: str
    description: str
    server_args: tuple[str, ...] = ()
    max_model_len: int = 8192
    tokenizer_vocab: int | None = None  # None: the model's whole vocabulary
    client_backend: str = "openai"
    loads: tuple[str, ...] = DEFAULT_LOADS

    def settings(self, max_model_len: int, loads: list[str]) -> dict[str, object]:
        """What a run of this configuration used, for the report: its options with the command line's
        ``--max-model-len`` and ``--loads`` where they replaced the configuration's."""
        return {
            "vllm serve": " ".join([*self.server_args, "--max-model-len", str(max_model_len)]),
            "tokenizer": "the model's whole vocabulary" if self.tokenizer_vocab is None
            else f"{self.tokenizer_vocab} words",  # fmt: skip
            "vllm bench serve --backend": self.client_backend,
            "loads": " ".join(loads),
        }


CONFIGURATIONS: dict[str, Configuration] = {
    c.name: c
    for c in (
        Configuration(
            "defaults",
            "vLLM's defaults: max-num-seqs and max-num-batched-tokens from the GPU's memory (1024 and 8192 "
            "on an H100 or H200: CUDA graphs up to 512 tokens), prefix caching on; 8k context",
        ),
        # Issue 40's independent check (H100, 2026-12-05): median TTFT 1.64-1.68x worse with the
        # plugin at rate16 here while "defaults" read parity. --max-num-seqs 128 caps CUDA graphs at
        # 256 tokens; its warm-up is 20 prompts of rate16's length, no more than a user's first requests.
        Configuration(
            "seqs128",
            "--max-num-seqs 128 (CUDA graphs up to 256 tokens), prefix caching off, 4k context, a 512-word "
            "tokenizer, vLLM's `vllm` client backend, a warm-up of 20 prompts of 1k",
            server_args=("--max-num-seqs", "128", "--no-enable-prefix-caching"),
            max_model_len=4096,
            tokenizer_vocab=512,
            client_backend="vllm",
            loads=("warm1k", "rate16", "saturate"),
        ),
    )
}
DEFAULT_CONFIGURATION = "defaults"
