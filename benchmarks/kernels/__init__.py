"""The ops alone on a GPU: CUDA-graph timing against the unfused chain, peers and the hardware floor
(benchmarks/kernels/README.md)."""
