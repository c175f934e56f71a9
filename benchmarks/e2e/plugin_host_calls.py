"""Host microseconds per call of each piece of one MLA layer's attention step, plugin on and off,
on vLLM's CPU platform (issue 20: where does the plugin's extra Python per layer and step go?).

Builds one DeepSeek-V3 attention layer each way (tests/vllm_plugin/harness.py: vLLM's own
``DeepseekV2MLAAttention``, CPU_MLA metadata from its builder, same weights), runs a step of
T prompt tokens (prefill-only: the step the TTFT figures are about) once to capture every
call's arguments, then times each piece alone on those arguments, back to back
(``timeit``, median of rounds):

- whole layer (``MultiHeadLatentAttentionWrapper.forward``) on and off, and the attention ops'
  dispatch and context lookup alone (their bodies stubbed);
- the plugin: forward_fused (total, and without the forward_impl it calls), write_target,
  ``_fuse_prefill_key`` / the per-step rule it binds (``eligibility.prefill_key_step_rule``), the q_pe slice, ``_rows``,
  ``_PrefillStep(...)``, assemble_prefill_key, ``ops.eager``, the layer's ``binding.BoundOp``
  (whole, and with its site stubbed: the layout tuple and rows check), the validation a layout's
  first call runs, the torch backend, and the Triton backend's bound launch with the launch
  stubbed, and its launch-hook check;
- vLLM: RoPE (the layer's rotary_emb), the cache write (``update_kv_cache``), the key concat.

Also counts, per layer call, the Python function calls (cProfile) and the net number of
objects the garbage collector tracks afterwards. CPU compute (the torch backend, CPU_MLA's
attention) is in the totals; the pieces that are pure Python are what a GPU host pays too.

    python -m benchmarks.e2e.plugin_host_calls --tokens 64 --out /tmp/calls.json    # from the repository root
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import gc
import json
import os
import pstats
import statistics
import sys
import tempfile
import timeit
from pathlib import Path

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from demo import cpu_stand_ins  # noqa: E402


def per_call_us(fn, number: int, rounds: int = 7) -> dict:
    """Median and minimum over ``rounds`` of the mean time per call of ``number`` calls, in us."""
    fn()
    times = [t / number * 1e6 for t in timeit.repeat(fn, number=number, repeat=rounds)]
    return {"median_us": statistics.median(times), "min_us": min(times)}


def capture(obj, name: str, into: dict):
    """Replace ``obj.name`` (an instance attribute) by a wrapper that stores its first call's
    arguments in ``into[name]``; returns the original."""
    original = getattr(obj, name)

    def recording(*args, **kwargs):
        into.setdefault(name, (args, kwargs))
        return original(*args, **kwargs)

    setattr(obj, name, recording)
    return original


def calls_per_layer(fn) -> tuple[int, dict]:
    """Python function calls of one ``fn()`` (cProfile): total, and per function of the plugin."""
    prof = cProfile.Profile()
    prof.runcall(fn)
    stats = pstats.Stats(prof).stats
    total = sum(v[1] for v in stats.values())
    plugin = {f"{Path(k[0]).name}:{k[2]}": v[1] for k, v in stats.items() if "vllm_mla_fusion" in k[0]}
    return total, dict(sorted(plugin.items(), key=lambda kv: -kv[1]))


def net_tracked_objects(fn, calls: int = 50) -> float:
    """Net objects the garbage collector tracks per ``fn()`` (allocations minus frees of
    container objects), with collection paused."""
    gc.collect()
    gc.disable()
    try:
        before = len(gc.get_objects())
        for _ in range(calls):
            fn()
        return (len(gc.get_objects()) - before) / calls
    finally:
        gc.enable()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=64, help="prompt tokens of the prefill step")
    ap.add_argument("--heads", type=int, default=16, help="attention heads (16: a TP8 rank of DeepSeek-V3)")
    ap.add_argument("--number", type=int, default=200, help="calls per timing round of the small pieces")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch's CPU threads: 1, because on a shared 2-core machine OpenMP's spinning threads "
                    "made the same layer call vary 5-50x from round to round")
    ap.add_argument("--out", type=Path, default=None, help="JSON of every figure")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)

    cpu_stand_ins.install()
    from vllm.forward_context import set_forward_context
    from vllm.model_executor.custom_op import op_registry_oot

    from tests.vllm_plugin import harness as H
    from vllm_mla_fusion import binding, dispatch, opcodes, validation
    from vllm_mla_fusion import ops as plugin_ops
    from vllm_mla_fusion.backends import reference
    from vllm_mla_fusion.backends import triton as tb
    from vllm_mla_fusion.vllm_plugin import attention as plugin_attention
    from vllm_mla_fusion.vllm_plugin import custom_ops, register
    from vllm_mla_fusion.vllm_plugin.compat import WRAPPER_KEY

    tmp = tempfile.mkdtemp(prefix="plugin_host_calls_")
    env = H.VllmCpu(H.write_model_dir(tmp, num_attention_heads=args.heads, num_key_value_heads=args.heads))
    op_registry_oot.pop(WRAPPER_KEY, None)
    off = env.build_attention()
    state = env.finish_weights(off, seed=0)
    register()
    on = env.build_attention()
    env.finish_weights(on, state)
    op_registry_oot.pop(WRAPPER_KEY, None)
    wrap_off, mla_off = H.mla_layer(off)
    wrap_on, mla_on = H.mla_layer(on)
    assert wrap_on.fusion_mode == "decode" and mla_on._prefill_key_fused, "the plugin's layer is not fused"
    for mla in (mla_off, mla_on):
        mla.bind_kv_cache(H.new_kv_cache(seed=7))

    T = args.tokens
    blocks = list(range((T + H.BLOCK_SIZE - 1) // H.BLOCK_SIZE))
    step = H.Step("prefill", [(0, T)])
    common = H.prepare_step(step, {0: H.Request(blocks=blocks)})
    builder = env.builder([mla_off.layer_name, mla_on.layer_name])
    with env.active():
        md = builder.build(0, common)
    hidden = torch.randn((T, env.model_config.hf_config.hidden_size)).to(H.DTYPE)
    names = [mla_off.layer_name, mla_on.layer_name]

    @contextlib.contextmanager
    def step_context():
        with env.active(), set_forward_context({n: md for n in names}, env.config,
                                               slot_mapping={n: step.slots for n in names}):  # fmt: skip
            yield

    results: dict = {"tokens": T, "heads": args.heads, "threads": args.threads, "torch": torch.__version__, "us": {}}
    us = results["us"]

    def timed(label: str, fn, number: int | None = None) -> None:
        us[label] = per_call_us(fn, number or args.number)
        print(f"{label:78s} {us[label]['median_us']:9.2f} us (min {us[label]['min_us']:.2f})", flush=True)

    with step_context():
        layer_off = lambda: wrap_off(step.positions, hidden)  # noqa: E731
        layer_on = lambda: wrap_on(step.positions, hidden)  # noqa: E731
        # Arguments of every piece, from one real step each way.
        got: dict = {}
        originals = [
            (mla_on, "forward_fused", capture(mla_on, "forward_fused", got)),
            (mla_on, "assemble_prefill_key", capture(mla_on, "assemble_prefill_key", got)),
            (mla_off, "forward_impl", capture(mla_off, "forward_impl", got)),
            (mla_off, "update_kv_cache", capture(mla_off, "update_kv_cache", got)),
            (mla_off.impl, "_concat_k_nope_k_pe", capture(mla_off.impl, "_concat_k_nope_k_pe", got)),
            (wrap_off.rotary_emb, "forward", capture(wrap_off.rotary_emb, "forward", got)),
        ]
        layer_off(), layer_on()
        for obj, name, original in originals:
            if name in obj.__dict__:
                delattr(obj, name)
            if getattr(obj, name) is not original:
                setattr(obj, name, original)

        print(f"-- one layer, prefill-only step of {T} tokens, {args.heads} heads (CPU; median of rounds)")
        timed("layer: wrapper forward, plugin OFF", layer_off, 20)
        timed("layer: wrapper forward, plugin ON", layer_on, 20)

        (q, kv_c_normed, k_pe, positions, cos_sin_cache, is_neox, kv_cache, slot_mapping, attn_md, output), _ = \
            got["forward_fused"]  # fmt: skip
        rope_dim = mla_on.qk_rope_head_dim
        timed("plugin: forward_fused (total, forward_impl and op 3 included)", lambda: mla_on.forward_fused(
            *got["forward_fused"][0]), 20)  # fmt: skip
        # forward_fused without vLLM's forward_impl: a stand-in that only builds the key, as
        # forward_mha does first, so that the plugin's own work (op 3 included) stays.
        k_nope_on, k_pe_on = got["assemble_prefill_key"][0][:2]
        impl_on = mla_on.impl

        def forward_impl_key_only(*a, **k):
            impl_on._concat_k_nope_k_pe(k_nope_on, k_pe_on)

        mla_on.forward_impl = forward_impl_key_only
        timed("plugin: forward_fused, forward_impl reduced to building the key", lambda: mla_on.forward_fused(
            *got["forward_fused"][0]), 50)  # fmt: skip
        # The same with the Triton backend's host path and the launch stubbed: everything the
        # plugin's Python costs a GPU host per layer, on CPU tensors (no CUDA calls). The layer's
        # bound ops are rebuilt so that their sites are the Triton backend's.
        real_load, real_slow = dispatch.load, tb.BoundLaunch._launch_through_triton
        dispatch.load = lambda name: tb
        tb.BoundLaunch._launch_through_triton = lambda *a: None
        layer_ops = mla_on._bound_ops
        mla_on._bound_ops = binding.BoundOps(layer_ops.backend, layer_ops.debug)
        try:
            timed("plugin: forward_fused, key only, Triton host path with the launch stubbed",
                  lambda: mla_on.forward_fused(*got["forward_fused"][0]))  # fmt: skip
        finally:
            dispatch.load, tb.BoundLaunch._launch_through_triton = real_load, real_slow
            mla_on._bound_ops = layer_ops
        mla_on.forward_impl = lambda *a, **k: None
        mla_on._prefill_key_fused = False  # no key step prepared: nothing asks for it
        timed("plugin: forward_fused, forward_impl a no-op, key step off (op 1 instead of op 3)",
              lambda: mla_on.forward_fused(*got["forward_fused"][0]), 50)  # fmt: skip
        mla_on._prefill_key_fused = True
        del mla_on.forward_impl

        timed("plugin: write_target", lambda: custom_ops.write_target(
            kv_cache, slot_mapping, mla_on.kv_cache_dtype, T, mla_on.kv_lora_rank + rope_dim, kv_c_normed))  # fmt: skip
        timed("plugin: _fuse_prefill_key (per-step eligibility)", lambda: mla_on._fuse_prefill_key(attn_md))
        timed("plugin: the layer's bound per-step rule (eligibility.prefill_key_step_rule)",
              lambda: mla_on._prefill_key_step_rule(attn_md))  # fmt: skip
        timed("plugin: q[..., -R:] slice", lambda: q[..., -rope_dim:])
        q_pe = q[..., -rope_dim:]
        rows_args = (positions, q, k_pe_on, kv_c_normed, slot_mapping)
        timed("plugin: _rows (prefill-only: q_pe alone sliced)", lambda: plugin_attention._rows(
            0, T, T, rope_dim, *rows_args))  # fmt: skip
        timed("plugin: _rows (a padded step: rows from 0)", lambda: plugin_attention._rows(
            0, T, T + 1, rope_dim, *rows_args))  # fmt: skip
        timed("plugin: _rows (rows from the decode count, as in a mixed step)", lambda: plugin_attention._rows(
            1, T, T, rope_dim, *rows_args))  # fmt: skip

        def prefill_step():
            return plugin_attention._PrefillStep(positions, q_pe, k_pe_on, kv_c_normed, slot_mapping, kv_cache,
                                                 mla_on.kv_cache_dtype, cos_sin_cache, is_neox, 0)  # fmt: skip

        timed("plugin: _PrefillStep(...) construction", prefill_step)

        def set_step_attribute():
            mla_on._steps.prefill = None  # forward_fused sets two such attributes twice a step

        timed("plugin: one step attribute set (a plain object's slot)", set_step_attribute)
        vllm_concat = type(impl_on)._concat_k_nope_k_pe.__get__(impl_on)

        def assemble_key():
            mla_on._steps.prefill = prefill_step()
            mla_on.assemble_prefill_key(k_nope_on, k_pe_on, vllm_concat)

        timed("plugin: assemble_prefill_key (+ a _PrefillStep; op 3 on the torch backend)", assemble_key, 50)
        mla_on._steps.prefill = None
        k_out = torch.empty((T, args.heads, k_nope_on.shape[-1] + rope_dim), dtype=k_nope_on.dtype)
        timed("plugin: torch.empty(k_out)", lambda: torch.empty(
            (T, args.heads, k_nope_on.shape[-1] + rope_dim), dtype=k_nope_on.dtype, device=k_nope_on.device))  # fmt: skip
        op3_args = (positions, q_pe, k_pe_on, kv_c_normed, k_nope_on, cos_sin_cache, is_neox, slot_mapping,
                    kv_cache, k_out, mla_on.kv_cache_dtype, mla_on._k_scale)  # fmt: skip
        timed("plugin: ops.eager.mla_prefill_rope_cache_write (torch backend)",
              lambda: plugin_ops.eager.mla_prefill_rope_cache_write(*op3_args), 50)  # fmt: skip
        bound_args = (positions, q_pe, k_pe_on, kv_c_normed, cos_sin_cache, slot_mapping, kv_cache, mla_on._k_scale,
                      k_nope_on, k_out, None)  # fmt: skip
        bound = binding.BoundOp(opcodes.OP_PREFILL, is_neox=is_neox, kv_cache_dtype=mla_on.kv_cache_dtype,
                                backend="torch")  # fmt: skip
        timed("plugin: BoundOp call (torch backend)", lambda: bound(*bound_args), 50)
        (key, (site, name)), = bound.sites.items()
        bound.sites[key] = (lambda *a: None, name)
        timed("plugin: BoundOp call, its site a no-op (layout tuple, rows check)", lambda: bound(*bound_args))
        timed("plugin: binding._layout (the per-call layout tuple)", lambda: binding._layout(*bound_args))
        timed("plugin: validation.check_prefill_rope_cache_write (a layout's first call only)",
              lambda: validation.check_prefill_rope_cache_write(*op3_args))  # fmt: skip
        p = validation.check_prefill_rope_cache_write(*op3_args)
        timed("plugin: torch backend prefill_rope_cache_write (CPU compute)", lambda: reference.prefill_rope_cache_write(
            p, positions, q_pe, k_pe_on, kv_c_normed, k_nope_on, cos_sin_cache, is_neox, slot_mapping, kv_cache,
            k_out, mla_on._k_scale), 50)  # fmt: skip
        site = tb.bind(p, opcodes.OP_PREFILL, is_neox, True, *bound_args)
        real_slow = tb.BoundLaunch._launch_through_triton
        tb.BoundLaunch._launch_through_triton = lambda *a: None
        try:
            timed("plugin: Triton site call, launch stubbed (plan lookup, index copies)",
                  lambda: site(T, *bound_args))  # fmt: skip
        finally:
            tb.BoundLaunch._launch_through_triton = real_slow
        timed("plugin: Triton launch-hook check (per launch)", tb._no_launch_hooks)

        # vLLM's pieces the plugin replaces.
        rope_args, rope_kwargs = got["forward"]
        timed("vLLM: RoPE (rotary_emb.forward, CPU native)", lambda: wrap_off.rotary_emb.forward(
            *rope_args, **rope_kwargs), 50)  # fmt: skip
        upd_args, upd_kwargs = got["update_kv_cache"]
        timed("vLLM: update_kv_cache (CPU_MLA do_kv_cache_update)", lambda: mla_off.update_kv_cache(
            *upd_args, **upd_kwargs), 50)  # fmt: skip
        mla_off.impl.do_kv_cache_update = lambda *a, **k: None
        timed("vLLM: update_kv_cache, do_kv_cache_update stubbed (its Python around the kernel)",
              lambda: mla_off.update_kv_cache(*upd_args, **upd_kwargs))  # fmt: skip
        del mla_off.impl.do_kv_cache_update
        cat_args, _ = got["_concat_k_nope_k_pe"]
        timed("vLLM: _concat_k_nope_k_pe", lambda: mla_off.impl._concat_k_nope_k_pe(*cat_args), 50)
        impl_args, impl_kwargs = got["forward_impl"]
        timed("vLLM: forward_impl (CPU_MLA prefill attention)", lambda: mla_off.forward_impl(
            *impl_args, **impl_kwargs), 20)  # fmt: skip

        # The attention ops' own cost: dispatcher, context lookup, decorators (bodies stubbed).
        from vllm.utils.torch_utils import _encode_layer_name

        mla_on.forward_fused = lambda *a, **k: None
        name_on = _encode_layer_name(mla_on.layer_name)
        timed("plugin op mla_attention_with_output, body stubbed (dispatch + context)",
              lambda: torch.ops.mla_fusion_vllm.mla_attention_with_output(
                  q, kv_c_normed, k_pe, positions, cos_sin_cache, is_neox, output, name_on))  # fmt: skip
        del mla_on.forward_fused
        mla_off.forward_impl = lambda *a, **k: None
        mla_off.update_kv_cache = lambda *a, **k: None
        name_off = _encode_layer_name(mla_off.layer_name)
        timed("vLLM op unified_mla_kv_cache_update, body stubbed (dispatch + context)",
              lambda: torch.ops.vllm.unified_mla_kv_cache_update(kv_c_normed, k_pe, name_off, "auto",
                                                                  mla_off._k_scale))  # fmt: skip
        timed("vLLM op unified_mla_attention_with_output, body stubbed (dispatch + context)",
              lambda: torch.ops.vllm.unified_mla_attention_with_output(q, kv_c_normed, k_pe, output, name_off))  # fmt: skip
        del mla_off.forward_impl, mla_off.update_kv_cache

        results["python_calls_per_layer"] = {}
        results["gc_tracked_objects_per_layer"] = {}
        for side, fn in (("off", layer_off), ("on", layer_on)):
            total, plugin = calls_per_layer(fn)
            results["python_calls_per_layer"][side] = {"total": total, "plugin_functions": plugin}
            results["gc_tracked_objects_per_layer"][side] = net_tracked_objects(fn)
        print(f"-- Python function calls per layer call: off {results['python_calls_per_layer']['off']['total']}, "
              f"on {results['python_calls_per_layer']['on']['total']}; plugin functions on: "
              f"{results['python_calls_per_layer']['on']['plugin_functions']}")  # fmt: skip
        print(f"-- net gc-tracked objects per layer call: {results['gc_tracked_objects_per_layer']}")
    if args.out:
        args.out.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
