"""The curated mutants of scripts/mutation.py: realistic bugs, each of which the CPU suite must catch.

One entry per bug: ``Mutant(id, file, original, replacement, tests, why)``.

- ``original`` must occur exactly once in ``file`` (the driver reports an error otherwise,
  so an entry whose code moved is fixed, never silently skipped); give enough context to
  make it unique.
- ``tests`` are pytest arguments (paths, node ids, ``-k``): the tests meant to catch the bug,
  as few as will do, so that the whole list runs in minutes.
- ``why`` says what the bug is, in a few words.

Add an entry with every test that claims to catch a bug: plant it here, see it killed.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Mutant:
    id: str
    file: str
    original: str
    replacement: str
    tests: str
    why: str


K = "vllm_mla_fusion/backends/triton.py"
V = "vllm_mla_fusion/validation.py"
F = "vllm_mla_fusion/fp8.py"
REF = "vllm_mla_fusion/backends/reference.py"
A = "vllm_mla_fusion/backends/aiter.py"
OPS = "tests/test_ops.py"
VAL = "tests/test_validation.py"

MUTANTS = [
    # ---- the Triton kernel and its host code -----------------------------------------------
    Mutant("slot-int32", K,
           "slot = tl.load(slot_ptr + t, mask=t_mask, other=-1).to(tl.int64)",
           "slot = tl.load(slot_ptr + t, mask=t_mask, other=-1).to(tl.int32)",
           f"{OPS} -k 2_to_the_31", "32-bit slot arithmetic"),
    Mutant("slot-not-widened", K,
           "slot = tl.load(slot_ptr + t, mask=t_mask, other=-1).to(tl.int64)",
           "slot = tl.load(slot_ptr + t, mask=t_mask, other=-1)",
           f"{OPS} -k 2_to_the_31", "int32 slot_mapping multiplied in 32 bits"),
    Mutant("cache-tail-loop-skipped", K,
           "for l0 in tl.static_range(BLOCK_L, L, BLOCK_L):  # latent widths past BLOCK_L (> 512)\n"
           "        col = l0 + tl.arange(0, BLOCK_L)\n        m = write[:, None]",
           "for l0 in tl.static_range(L, L, BLOCK_L):  # latent widths past BLOCK_L (> 512)\n"
           "        col = l0 + tl.arange(0, BLOCK_L)\n        m = write[:, None]",
           f"{OPS} -k '640 or 1024'", "cache latent columns past 512 never written"),
    Mutant("query-tail-loop-skipped", K,
           "for l0 in tl.static_range(BLOCK_L, L, BLOCK_L):  # latent widths past BLOCK_L (> 512)\n"
           "            col = l0 + tl.arange(0, BLOCK_L)\n            m = r_mask[:, None]",
           "for l0 in tl.static_range(L, L, BLOCK_L):  # latent widths past BLOCK_L (> 512)\n"
           "            col = l0 + tl.arange(0, BLOCK_L)\n            m = r_mask[:, None]",
           f"{OPS} -k 'decode_layouts and (640 or 1024)'", "q_out latent columns past 512 never written"),
    Mutant("fp8-residual-dropped", K,
           "x = tl.where((tl.abs(q) < 2 * FP8_MAX) & (q != 0), tl.fma(r, inv_scale, q), q)",
           "x = q",
           f"{OPS} -k scaled_fp8", "scaled fp8: the bare reciprocal product, within an ulp only"),
    Mutant("fp8-residual-unfused", K,
           "r = tl.fma(-q, scale, x)",
           "r = x - q * scale",
           f"{OPS} -k scaled_fp8", "scaled fp8: residual rounded twice (no fma)"),
    Mutant("fp8-zero-sign-lost", K,
           "x = tl.where((tl.abs(q) < 2 * FP8_MAX) & (q != 0), tl.fma(r, inv_scale, q), q)",
           "x = tl.where(tl.abs(q) < 2 * FP8_MAX, tl.fma(r, inv_scale, q), q)",
           f"{OPS} -k scaled_fp8", "scaled fp8: -0 stored as +0"),
    Mutant("fp8-ties-away-normal", K,
           "normal = (v + ((1 << (shift - 1)) - 1) + ((v >> shift) & 1)) >> shift",
           "normal = (v + (1 << (shift - 1))) >> shift",
           f"{OPS} -k 'fp8_rounding_matches or scaled_fp8'", "fp8 bit encoder rounds ties away from zero"),
    Mutant("fp8-ties-away-subnormal", K,
           "q = q + ((rem > half) | ((rem == half) & ((q & 1) == 1))).to(tl.int32)",
           "q = q + (rem >= half).to(tl.int32)",
           f"{OPS} -k 'fp8_rounding_matches or scaled_fp8'", "fp8 subnormals round ties away from zero"),
    Mutant("rope-inner-stride-ignored", K,
           "x = tl.load(x_ptr + row_off[:, None] + r[None, :] * stride_x, mask=mr, other=0.0).to(tl.float32)",
           "x = tl.load(x_ptr + row_off[:, None] + r[None, :], mask=mr, other=0.0).to(tl.float32)",
           f"{OPS} -k 'any_layout and inner_stride'", "q_pe/k_pe inner stride ignored (GPT-J load)"),
    Mutant("cache-inner-stride-ignored", K,
           "tl.store(cache_ptr + row[:, None] + col[None, :] * stride_kv_d, c, mask=write[:, None] & (col < L)[None, :])",
           "tl.store(cache_ptr + row[:, None] + col[None, :], c, mask=write[:, None] & (col < L)[None, :])",
           f"{OPS} -k 'any_layout and kv_cache-inner_stride'", "cache inner stride ignored (latent store)"),
    Mutant("cos-sin-stride-ignored", K,
           "cos = tl.load(cos_ptr + cs_off[:, None] + i[None, :] * stride_cs, mask=m2, other=1.0)",
           "cos = tl.load(cos_ptr + cs_off[:, None] + i[None, :], mask=m2, other=1.0)",
           f"{OPS} -k 'any_layout and cos_sin_cache'", "cos/sin column stride ignored"),
    Mutant("index-stride-ignored", K,
           "positions, slot_mapping = (x if x.stride(0) == 1 else x[:T].contiguous() for x in (positions, slot_mapping))",
           "positions, slot_mapping = positions, slot_mapping",
           f"{OPS} -k 'any_layout and (positions or slot_mapping)'", "strided positions/slot_mapping read densely"),
    Mutant("kv_c-3d-not-squeezed", K,
           "kv_c2 = kv_c.select(1, 0) if kv_c.dim() == 3 else kv_c",
           "kv_c2 = kv_c",
           f"{OPS} -k kv_c_3d", "kv_c [T, 1, L] passed with three strides"),
    Mutant("slot-guard-missing", K,
           "write = t_mask & (slot >= 0) & (slot < num_slots)",
           "write = t_mask & (slot >= 0)",
           f"{OPS} -k 'past_the_cache and in_guard'", "slots past the cache written after it"),
    Mutant("slot-guard-off-by-one", K,
           "write = t_mask & (slot >= 0) & (slot < num_slots)",
           "write = t_mask & (slot >= 0) & (slot <= num_slots)",
           f"{OPS} -k 'past_the_cache and in_guard'", "slot == capacity written"),
    Mutant("padding-slot-written", K,
           "write = t_mask & (slot >= 0) & (slot < num_slots)",
           "write = t_mask & (slot < num_slots)",
           f"{OPS} -k 'layouts and pad_every'", "slot -1 written (to row 0)"),
    Mutant("cache-position-clamp-off-by-one", K,
           "pos = tl.minimum(tl.maximum(pos, 0), max_pos - 1)  # clamp: never read past the table",
           "pos = tl.minimum(tl.maximum(pos, 0), max_pos)  # clamp: never read past the table",
           f"{OPS} -k 'layouts and out_of_range'", "k_pe rotated with the row past the table"),
    Mutant("query-position-clamp-off-by-one", K,
           "pos = tl.minimum(tl.maximum(pos, 0), max_pos - 1)\n    q_off",
           "pos = tl.minimum(tl.maximum(pos, 0), max_pos)\n    q_off",
           f"{OPS} -k 'layouts and out_of_range'", "q_pe rotated with the row past the table"),
    Mutant("neox-pairing-power-of-two", K,
           "x2 = tl.load(x_ptr + row_off[:, None] + (i[None, :] + R // 2) * stride_x, mask=m2, other=0.0)",
           "x2 = tl.load(x_ptr + row_off[:, None] + (i[None, :] + BLOCK_R2) * stride_x, mask=m2, other=0.0)",
           f"{OPS} -k 'layouts and 48'", "NeoX second half at the padded tile width"),
    Mutant("gptj-pairs-swapped", K,
           "x1, x2 = tl.split(tl.reshape(x, [ROWS, BLOCK_R2, 2]))",
           "x2, x1 = tl.split(tl.reshape(x, [ROWS, BLOCK_R2, 2]))",
           f"{OPS} -k 'sizes and 1-1'", "GPT-J pair (x[2i], x[2i+1]) taken in the wrong order"),
    Mutant("neox-flag-inverted", K,
           "H=H, L=L, R=R, IS_NEOX=is_neox,",
           "H=H, L=L, R=R, IS_NEOX=not is_neox,",
           f"{OPS} -k 'sizes and 1-1'", "GPT-J and NeoX swapped at launch"),
    Mutant("q_out-order-swapped", K,
           "DECODE=decode, NOPE_FIRST=is_nope_first,",
           "DECODE=decode, NOPE_FIRST=not is_nope_first,",
           f"{OPS} -k 'decode_sizes and 1-1'", "q_out written rope-first when nope-first was asked"),
    Mutant("q_scale-ignored", K,
           'Q_MODE=qmeta["MODE"], Q_HAS_SCALE=qmeta["HAS_SCALE"],',
           'Q_MODE=qmeta["MODE"], Q_HAS_SCALE=False,',
           f"{OPS} -k 'decode_dtypes'", "fp8 q_out stored unscaled"),
    # ---- validation -----------------------------------------------------------------------
    Mutant("kv_c-head-check-missing", V,
           "    if kv_c.dim() == 3 and kv_c.shape[1] != 1:\n        raise",
           "    if False:\n        raise",
           f"{VAL} -k 'kv_c and two and heads'", "kv_c [T, 2, L] accepted (Triton writes head 0)"),
    Mutant("k_pe-head-check-missing", V,
           "    if k_pe.dim() == 3 and k_pe.shape[1] != 1:\n        raise",
           "    if False:\n        raise",
           f"{VAL} -k 'k_pe and two and heads'", "k_pe [T, 2, R] accepted"),
    Mutant("positions-length-check-missing", V,
           "    if positions.shape[0] < T:\n        raise",
           "    if False:\n        raise",
           f"{VAL} -k 'positions and short'", "positions shorter than T read past their end"),
    Mutant("device-check-missing", V,
           "        if t.device != device:\n            raise",
           "        if False:\n            raise",
           f"{VAL} -k 'another and device'", "tensors on different devices accepted"),
    Mutant("block-size-check-missing", V,
           "    if kv_cache.shape[1] < 1:\n        raise",
           "    if False:\n        raise",
           f"{VAL} -k 'block and size and zero'", "a cache of block size 0 (division by zero in the kernel)"),
    Mutant("flag-type-check-missing", V,
           "        if name in (\"is_neox\", \"is_nope_first\"):\n            if not isinstance(value, bool):",
           "        if name in (\"is_neox\", \"is_nope_first\"):\n            if False:",
           f"{VAL} -k 'is_neox and int or is_nope_first and int'", "is_neox=1 silently taken as True"),
    Mutant("debug-slot-range-off-by-one", V,
           "bad = (slots >= num_slots).nonzero()",
           "bad = (slots > num_slots).nonzero()",
           f"{VAL} -k 'Debug and slots_past'", "debug mode lets slot == capacity through"),
    Mutant("cache-dtype-name-check-missing", F,
           "        if _FLOAT_NAMES[name] != dtype:\n            raise",
           "        if False:\n            raise",
           f"{VAL} -k 'float and name and mismatch'", "kv_cache_dtype='float16' accepted for a bf16 cache"),
    # ---- the reference backend (the definition of the semantics) -------------------------
    Mutant("reference-slot-guard-missing", REF,
           "keep = (slots >= 0) & (slots < cache.shape[0] * block_size)",
           "keep = slots >= 0",
           f"{OPS} -k 'past_the_cache and torch'", "torch backend indexes past the cache"),
    Mutant("reference-pairing-swapped", REF,
           "x1, x2 = x[..., 0::2], x[..., 1::2]",
           "x1, x2 = x[..., 1::2], x[..., 0::2]",
           f"{OPS} -k 'sizes and 1-1 and torch'", "GPT-J pairs swapped in the reference"),
    Mutant("reference-clamp-off-by-one", REF,
           "pos = positions[:num_tokens].long().clamp(0, cos_sin_cache.shape[0] - 1)",
           "pos = positions[:num_tokens].long().clamp(0, cos_sin_cache.shape[0])",
           f"{OPS} -k 'layouts and out_of_range and torch'", "reference clamps to max_pos"),
    Mutant("reference-q_out-order", REF,
           "parts = (ql_nope.float(), q_rot) if is_nope_first else (q_rot, ql_nope.float())",
           "parts = (q_rot, ql_nope.float()) if is_nope_first else (ql_nope.float(), q_rot)",
           f"{OPS} -k 'decode_sizes and 1-1 and torch'", "reference q_out rope-first"),
    Mutant("reference-fp8-reciprocal", F,
           "x = x / scale.to(x.dtype)",
           "x = x * (1 / scale.to(x.dtype))",
           f"{OPS} -k 'scaled_fp8 and torch'", "reference multiplies by 1/scale instead of dividing"),
    # ---- the AITER adapter (CPU-testable logic) --------------------------------------------
    Mutant("aiter-slot-guard-missing", A,
           "slot_mapping=guard_slots(as_int64_index(slot_mapping, T), num_slots),",
           "slot_mapping=as_int64_index(slot_mapping, T),",
           "tests/backends/test_aiter_adapter.py -k 'past_the_cache'", "AITER writes slots past the cache"),
    Mutant("aiter-capacity-of-the-view", A,
           "num_slots = kv_cache.shape[0] * kv_cache.shape[1]",
           "num_slots = kv_cache.shape[0]",
           "tests/backends/test_aiter_adapter.py -k 'guards_slots'", "capacity counted in blocks, not slots"),
    # ---- the vLLM plugin -------------------------------------------------------------------
    Mutant("plugin-decode-rows-written-twice", "vllm_mla_fusion/vllm_plugin/attention.py",
           "rows = slice(num_decode, end)",
           "rows = slice(0, end)",
           "tests/vllm_plugin/test_layer.py -k 'schedule_matches_vllm and decode and not triton'",
           "op 1 also writes (and rotates) the decode tokens"),
    Mutant("plugin-cache-also-written-by-vllm", "vllm_mla_fusion/vllm_plugin/layer.py",
           "            dep = torch.ops.mla_fusion_vllm.rope_kv_cache_update(",
           "            torch.ops.vllm.unified_mla_kv_cache_update(kv_c_normed, k_pe, layer_name, attn.kv_cache_dtype,\n"
           "                                                       attn._k_scale)\n"
           "            dep = torch.ops.mla_fusion_vllm.rope_kv_cache_update(",
           "tests/vllm_plugin/test_layer.py -k 'schedule_matches_vllm and rope_cache and not triton'",
           "vLLM's cache update runs as well as the fused write"),
    Mutant("plugin-decode-query-not-marked", "vllm_mla_fusion/vllm_plugin/attention.py",
           "        step.assembled = True\n",
           "",
           "tests/vllm_plugin/test_layer.py -k 'schedule_matches_vllm and decode and not triton'",
           "decode query assembled but the step not marked"),
    Mutant("plugin-no-slot-mapping-not-handled", "vllm_mla_fusion/vllm_plugin/custom_ops.py",
           "if slot_mapping is not None and kv_cache.numel() > 0:",
           "if kv_cache.numel() > 0:",
           "tests/vllm_plugin/test_layer.py -k no_slot_mapping",
           "a layer without a slot mapping passes None slots to the op"),
    Mutant("plugin-fallback-warning-rank-0-only", "vllm_mla_fusion/vllm_plugin/layer.py",
           'scope="process",  # every rank: a failure on rank 3 alone must not go unseen',
           'scope="local",',
           "tests/vllm_plugin/test_eligibility.py -k another_rank", "setup failure on another rank not logged"),
    Mutant("plugin-info-rank-0-only", "vllm_mla_fusion/vllm_plugin/layer.py",
           'scope="process",  # one line per rank, so ranks that chose differently are visible',
           'scope="local",',
           "tests/vllm_plugin/test_eligibility.py -k every_rank_logs", "chosen backend/mode logged by rank 0 only"),
]  # fmt: skip
