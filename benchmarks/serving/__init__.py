"""Serving benchmark: vLLM's own client (``vllm bench serve``) against ``vllm serve``, plugin on and off.

What a user runs to judge a serving change, on one tensor-parallel rank of DeepSeek-V3:

    python -m benchmarks.serving --out OUT [--model dense|fp8-moe] [--sides on off on@PATH] ...

Modules, in the order a run uses them:

- ``models``: the stand-ins (config + locally built tokenizer; dummy weights);
- ``sides``: off / on / on@PATH, their server environments, the alternating server order;
- ``loads``: the loads as ``vllm bench serve`` argument lists;
- ``plan``: what fits the time budget, from guesses and then measured times;
- ``server``: one ``vllm serve`` process, its health and the plugin's log line;
- ``client``: the process that runs vLLM's ``bench serve`` for one server's loads;
- ``step_profile`` and ``host_samples``: where a profiled or sampled load's time went;
- ``report``: vLLM's result files gathered per side, compared, as JSON, markdown and a plot;
- ``run``: the driver that ties them together.

README.md beside this file describes the measurements and the GPU-machine procedure.
"""
