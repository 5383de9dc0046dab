"""griffe extension for the API reference (mkdocs.yml, mkdocstrings ``extensions``): per-argument sections and
links in every docstring.

* A function whose docstring has no ``Args:`` section gets one, built from its signature: every parameter with its
  type annotation and default (rendered by mkdocstrings as a table) and the meaning from :data:`MEANINGS`, the one
  glossary of the parameter names the operators share, each pointing to the page that decides it (with
  ``_FOR_OPERATOR`` for the names one operator uses in its own sense). tests/test_docs_api.py fails on a public
  parameter the glossary does not know, so a new parameter comes with its meaning.
* Plain-text paths to documentation pages (``docs/semantics/masks.md``) become links.
"""

from __future__ import annotations

import re

import griffe

MASKS, LAYOUTS, PSE = "semantics/masks.md", "semantics/layouts.md", "semantics/pse.md"
STATS, DROPOUT, PAGED = "semantics/softmax-stats.md", "semantics/dropout.md", "semantics/paged-kv.md"
SINKS, BACKENDS, CP = "semantics/sinks.md", "guides/backends.md", "guides/context_parallel.md"
FIA, PFA_INT8 = "operators/fused_infer_attention_score.md", "operators/prompt_flash_attention.md#int8-quantisation"
FIA_KV, SFA = FIA + "#kv-anti-quantisation", "operators/sparse_flash_attention.md"
INDEXER, DENSE_IDX = "operators/lightning_indexer.md", "operators/dense_lightning_indexer.md"
QUANT_DSA, ATB = "operators/quant_dsa.md", "operators/atb_attention.md#parameters-and-constraints"
UPDATE, RING = "operators/attention_update.md#parameters", "operators/ring_attention_update.md#parameters"
MLA = "operators/mla_prolog.md"

# name -> (meaning, page that decides it)
MEANINGS: dict[str, tuple[str, str]] = {
    "query": ("the queries (laid out as the layout argument says)", LAYOUTS),
    "key": ("the keys (N2 heads; N1 a multiple of N2)", LAYOUTS),
    "value": ("the values (same layout as key; its head dim may be smaller)", LAYOUTS),
    "head_num": ("N1, the number of query heads", LAYOUTS),
    "num_heads": ("N1, the number of query heads", LAYOUTS),
    "num_key_value_heads": ("N2, the number of key/value heads (0: N1)", LAYOUTS),
    "input_layout": ("the tensor layout: BSH, SBH, BSND, BNSD, TND, ...", LAYOUTS),
    "layout": ("the tensor layout (BSND or TND)", LAYOUTS),
    "layout_query": ("the query's layout (BSND or TND)", LAYOUTS),
    "layout_key": ("the key's layout (BSND, TND or PA_BSND for a paged cache)", PAGED),
    "layout_kv": ("the key/value layout (BSND, TND or PA_BSND for a paged cache)", PAGED),
    "atten_mask": ("boolean or uint8 mask, True / 1 = masked; compressed 2048 x 2048 for modes 2, 3, 4, 7, 8", MASKS),
    "sparse_mode": ("which mask: 0..8", MASKS),
    "pre_tokens": ("band limit before the diagonal (modes 0 and 4)", MASKS),
    "next_tokens": ("band limit after the diagonal (modes 0, 4, 7, 8)", MASKS),
    "pre_tockens": ("torch_npu's v1 spelling of pre_tokens", MASKS),
    "next_tockens": ("torch_npu's v1 spelling of next_tokens", MASKS),
    "prefix": ("per-batch prefix lengths (modes 5 and 6)", MASKS),
    "scale_value": ("the factor applied to Q K^T", PSE),
    "scale": ("the factor applied to Q K^T", PSE),
    "keep_prob": ("the dropout keep probability (1: no dropout)", DROPOUT),
    "drop_mask": ("the bit-packed keep mask (uint8), one bit per score", DROPOUT),
    "dropout_mask": ("the bit-packed keep mask (uint8), one bit per score", DROPOUT),
    "pse": ("position encoding added to the scores, or ALiBi slopes (pse_type 2, 3)", PSE),
    "pse_type": ("how pse enters: 0 added after the scale, 1 before it, 2 / 3 generated ALiBi", PSE),
    "pse_shift": ("position encoding added to the scaled scores", PSE),
    "q_start_idx": ("query position offset of generated ALiBi", PSE),
    "kv_start_idx": ("key position offset of generated ALiBi", PSE),
    "actual_seq_qlen": ("TND: cumulative query ends, no leading 0", LAYOUTS),
    "actual_seq_kvlen": ("TND: cumulative key ends, no leading 0", LAYOUTS),
    "actual_seq_klen": ("TND: cumulative key ends, no leading 0", LAYOUTS),
    "actual_seq_lengths": ("per-batch query lengths (TND: cumulative ends)", LAYOUTS),
    "actual_seq_lengths_query": ("per-batch query lengths (TND: cumulative ends)", LAYOUTS),
    "actual_seq_lengths_kv": ("per-batch key lengths (plain counts with a paged cache)", LAYOUTS),
    "actual_seq_lengths_key": ("per-batch key lengths (plain counts with a paged cache)", LAYOUTS),
    "softmax_max": ("the row maxima of the forward ([B, N1, Sq, 8] or TND [T, N1, 8])", STATS),
    "softmax_sum": ("the row sums of exp(score - max) of the forward", STATS),
    "softmax_in": ("reserved (the forward's empty softmax_out)", STATS),
    "softmax_layout": ("TND statistics layout: '' (per sequence) or 'TND' (token-major)", STATS),
    "input_softmax_layout": ("TND statistics layout of the inputs: '' / 'SBH' or 'TND'", STATS),
    "attention_in": ("the forward's output", STATS),
    "dy": ("the gradient of the output", STATS),
    "sink": ("float32 [N1]: one extra softmax logit per query head", SINKS),
    "sinks": ("float32 [N1]: one extra softmax logit per query head", SINKS),
    "learnable_sink": ("bfloat16 [Q_N] (float32 too): one extra softmax logit per query head", SINKS),
    "block_table": ("int32 [B, W]: the physical cache blocks of each sequence, in order", PAGED),
    "block_size": ("the number of tokens per cache block", PAGED),
    "query_rope": ("the rope part of the query (MLA), concatenated to it along the head dim", LAYOUTS),
    "key_rope": ("the rope part of the key (MLA), concatenated to it along the head dim", LAYOUTS),
    "inner_precise": ("Ascend's precision switch: accepted, no effect on the results", "semantics/precision.md"),
    "padding_mask": ("reserved by Ascend: accepted and ignored", MASKS),
    "gen_mask_parallel": ("accepted, no effect (torch_npu's scheduling switch)", DROPOUT),
    "sync": ("accepted, no effect (torch_npu's scheduling switch)", DROPOUT),
    "seed": ("dropout seed (torch_npu protocol: the mask is regenerated from seed and offset)", DROPOUT),
    "offset": ("dropout offset in the generator's stream", DROPOUT),
    "numels": ("the number of dropout mask elements the forward drew", DROPOUT),
    "generator": ("the torch.Generator that draws the dropout mask", DROPOUT),
    "backend": ("'auto', 'reference' or 'triton'", BACKENDS),
    "deterministic": ("bitwise reproducible gradients (fixed accumulation order)", BACKENDS),
    "group": ("the torch.distributed process group (None: the default group)", CP),
    "load_balance": ("how sequences were sharded: 'head_tail' or None", CP),
    "timeout": ("seconds (or a timedelta) every collective may wait", CP),
    "seq_dim": ("the axis that holds the sequence", CP),
    "actual_seq_len": ("cumulative ends of the packed sequences, no leading 0", CP),
    "release": ("a torch_npu release: '7.1', '7.2', '7.3', '26.0' or 'current'", "guides/torch_npu.md"),
    # Quantisation of the FA inference family (PromptFlashAttention, IncreFlashAttention, FusedInferAttentionScore).
    "dequant_scale1": ("int8 pipeline: dequantisation factor after Q K^T (BMM1), per tensor; fp32, or uint64 words "
                       "from trans_quant_param", PFA_INT8),
    "deq_scale1": ("int8 pipeline: dequantisation factor after Q K^T (BMM1), per tensor; fp32, or uint64 words from "
                   "trans_quant_param (PromptFlashAttention's name of dequant_scale1)", PFA_INT8),
    "deq_scale2": ("int8 pipeline: dequantisation factor after P V (BMM2), per tensor; fp32 or uint64 words "
                   "(PromptFlashAttention's name of dequant_scale2)", PFA_INT8),
    "quant_scale1": ("int8 pipeline: quantisation factor of P before P V (BMM2), per tensor, fp32", PFA_INT8),
    "dequant_scale2": ("int8 pipeline: dequantisation factor after P V (BMM2), per tensor; fp32 or uint64 words",
                       PFA_INT8),
    "quant_scale2": ("int8 output: quantisation factor of the output, per tensor or per channel (N * D values)",
                     PFA_INT8),
    "quant_offset2": ("int8 output: quantisation offset, the shape and dtype of quant_scale2 (None: 0)", PFA_INT8),
    "antiquant_scale": ("int8 / int4 key and value: dequantisation factors, key and value stacked on a leading axis "
                        "of 2 (per channel, per tensor or, with antiquant_mode 1, per token)", FIA_KV),
    "antiquant_offset": ("int8 / int4 key and value: dequantisation offsets, shaped as antiquant_scale (None: "
                         "symmetric, no offset)", FIA_KV),
    "antiquant_mode": ("how antiquant_scale / antiquant_offset apply: 0 per channel (or per tensor), 1 per token",
                       FIA_KV),
    "key_antiquant_scale": ("the key's own dequantisation factors (separate key and value factors)", FIA_KV),
    "key_antiquant_offset": ("the key's own dequantisation offsets (None: symmetric)", FIA_KV),
    "value_antiquant_scale": ("the value's own dequantisation factors (separate key and value factors)", FIA_KV),
    "value_antiquant_offset": ("the value's own dequantisation offsets (None: symmetric)", FIA_KV),
    "key_antiquant_mode": ("how the key's factors apply: 0 per channel (or per tensor), 1 per token, 2 per tensor and "
                           "head, 3 per token and head, 4 / 5 per token (and head) with factors in the paged layout",
                           FIA_KV),
    "value_antiquant_mode": ("how the value's factors apply, numbered as key_antiquant_mode; equal to it except key "
                             "0 with value 1", FIA_KV),
    "key_rope_antiquant_scale": ("reserved by the documentation: any value but None raises", FIA),
    "query_padding_size": ("left padding: int tensor with one value, the number of query rows after each batch's "
                           "last real row (Q_S > 1)", FIA + "#left-padding"),
    "kv_padding_size": ("left padding: int tensor with one value, the number of cache positions after each "
                        "batch's last real key", FIA + "#left-padding"),
    "key_shared_prefix": ("keys every batch attends to before its own ([1, ...] in the key's layout)",
                          FIA + "#shared-prefix"),
    "value_shared_prefix": ("values of the shared prefix, laid out as key_shared_prefix", FIA + "#shared-prefix"),
    "actual_shared_prefix_len": ("the shared prefix's real length (None: its whole S)", FIA + "#shared-prefix"),
    "softmax_lse_flag": ("also return the log-sum-exp of each query row (else a [1] zero tensor)",
                         FIA + "#the-log-sum-exp-output"),
    # FusedInferAttentionScore v2 spellings.
    "num_query_heads": ("N1, the number of query heads (v2 name of num_heads)", LAYOUTS),
    "softmax_scale": ("the factor applied to Q K^T (v2 name of scale)", PSE),
    "return_softmax_lse": ("also return the log-sum-exp of each query row (v2 name of softmax_lse_flag)",
                           FIA + "#the-log-sum-exp-output"),
    "dequant_scale_key": ("v2 name of key_antiquant_scale", FIA_KV),
    "dequant_offset_key": ("v2 name of key_antiquant_offset", FIA_KV),
    "dequant_scale_value": ("v2 name of value_antiquant_scale", FIA_KV),
    "dequant_offset_value": ("v2 name of value_antiquant_offset", FIA_KV),
    "dequant_scale_query": ("the int8 MLA query's float32 scales, per token and head (query_quant_mode 3)",
                            FIA + "#quantised-queries-and-fp8-caches"),
    "quant_scale_out": ("v2 name of quant_scale2 (int8 output)", PFA_INT8),
    "quant_offset_out": ("v2 name of quant_offset2", PFA_INT8),
    "quant_scale_p": ("not given a meaning by the documentation: any value but None raises",
                      FIA + "#quantised-queries-and-fp8-caches"),
    "dequant_scale_key_rope": ("reserved by the documentation: any value but None raises", FIA + "#v2"),
    "out_dtype": ("the output dtype (torch.dtype or its ScalarType number); other than the query's only with a "
                  "quantised output", FIA + "#v2"),
    **{f"{part}_dtype": ("reserved: only None is accepted (the value would name a type torch has no tensor type "
                         "for, such as hifloat8)", FIA + "#v2")
       for part in ("query", "key", "value", "query_rope", "key_rope", "dequant_scale_query", "dequant_scale_key",
                    "dequant_scale_value", "dequant_scale_key_rope", "key_shared_prefix", "value_shared_prefix",
                    "token_x", "weight_dq", "weight_uq_qr", "weight_dkv_kr", "kv_cache")},
    # The DSA operators.
    "sparse_indices": ("int32 [B, S1, 1, K] or [T1, 1, K]: the entries (key blocks) each query row selects, -1 "
                       "after the last", SFA),
    "sparse_block_size": ("how many consecutive keys one entry of sparse_indices names", SFA + "#which-entries-count"),
    "d_out": ("the gradient of attention_out", SFA + "#the-gradients"),
    "attention_mode": ("0, or 2 for MLA-absorb (the query holds q_nope ++ q_rope, the key the latent cache)", SFA),
    "query_index": ("the indexer's queries, [B, S1, Nidx, D] or [T1, Nidx, D]", INDEXER),
    "key_index": ("the indexer's keys, [B, S2, 1, D] or [T2, 1, D] (one head)", INDEXER),
    "weights": ("the indexer's per-head weights w[t, h], [B, S1, Nidx] or [T1, Nidx]; the caller folds any scale "
                "into them", INDEXER + "#the-index-score"),
    "sparse_count": ("K, how many keys each query row selects (the top K index scores)", INDEXER),
    "return_value": ("also return the selected index scores", INDEXER),
    "reduction": ("'sum' or 'mean' of the per-token losses", INDEXER + "#the-differentiable-form"),
    "softmax_max_index": ("the row maxima of the index scores (from dense_lightning_indexer_softmax_lse)", DENSE_IDX),
    "softmax_sum_index": ("the row sums of exp(score - max) of the index scores", DENSE_IDX),
    "query_dequant_scale": ("per query token and head: the query's dequantisation factor", QUANT_DSA),
    "key_dequant_scale": ("per key token: the key's dequantisation factor", QUANT_DSA),
    "value_dequant_scale": ("reserved: only None (the scales travel inside the packed cache)",
                            QUANT_DSA + "#parameters"),
    "query_quant_mode": ("how the query is quantised: 0 (per token and head) only", QUANT_DSA),
    "quant_scale_repo_mode": ("where the cache's scales are stored: 1 (inside each packed row) only",
                              QUANT_DSA + "#parameters"),
    "tile_size": ("channels per dequantisation scale of the cache: 128 only", QUANT_DSA + "#parameters"),
    "rope_head_dim": ("the rope part's head dim in the packed cache: 64 only", QUANT_DSA + "#parameters"),
    # The merge operators.
    "lse": ("list of the sp shards' log-sum-exp, float32 [batch * seqLen * headNum] each", UPDATE),
    "local_out": ("list of the sp shards' outputs, [batch * seqLen * headNum, headDim] each", UPDATE),
    "update_type": ("0: return the merged output only; 1: also the merged lse", UPDATE),
    "prev_attn_out": ("the output merged so far (SBH [S, B, H] or TND [T, N, D])", RING),
    "prev_softmax_max": ("its row maxima (float32, [B, N, S, 8] or [T, N, 8])", RING),
    "prev_softmax_sum": ("its row sums of exp(score - max)", RING),
    "cur_attn_out": ("the output of the new block, shaped as prev_attn_out", RING),
    "cur_softmax_max": ("the new block's row maxima", RING),
    "cur_softmax_sum": ("the new block's row sums", RING),
    # ATB.
    "key_cache": ("the paged key cache [num_blocks, block_size, num_kv_heads, head_size]", ATB),
    "value_cache": ("the paged value cache [num_blocks, block_size, num_kv_heads, head_size_v]", ATB),
    "context_lens": ("1-D int32, the number of keys of each sequence", ATB),
    "seq_len": ("1-D int32, the number of packed query tokens of each sequence", ATB),
    "num_kv_heads": ("the key/value heads (0: num_heads), dividing num_heads", ATB),
    "mask": ("additive mask in the query's dtype, added after the scale (0 visible, a large negative masked)", ATB),
    "out": ("the tensor the result is written into (and returned), [tokens, num_heads, head_size_v]", ATB),
    # Dropout, context parallelism and the helpers.
    "dropout_p": ("the dropout probability, 1 - keep_prob (give one of the two)", DROPOUT),
    "dropout_seed": ("the dropout seed (default: drawn from generator)", CP + "#dropout"),
    "method": ("'ring' or 'ulysses'", CP),
    "overlap": ("ring: post the next exchange before computing the current block", CP + "#ring"),
    "x": ("the tensor to gather from every rank's shard", CP),
    "batch": ("B of a dense layout", DROPOUT),
    "seq_q": ("Sq of a dense layout", DROPOUT),
    "seq_kv": ("Skv of a dense layout", DROPOUT),
    "numel": ("the number of mask elements (drop_mask_numel)", DROPOUT),
    "device": ("where the tensor is made (default: CPU)", BACKENDS),
    "mode": ("'exact' or 'npu'", "semantics/precision.md#precision-modes-exact-and-npu"),
    "round_mode": ("0: truncate the fp32 scale to the 19 bits the word keeps; 1: round to nearest, ties to even",
                   PFA_INT8),
    "state": ("a state from get_rng_state (int64 [seed, offset]) or torch_npu's 16-byte one", "guides/torch_npu.md"),
    "schemas": ("op-plugin schema text per tuple of torch_npu releases ('current' required)",
                "guides/torch_npu.md#adding-an-operator"),
    "namespace": ("the torch.library namespace install() defines it in: 'npu' or 'atb'",
                  "guides/torch_npu.md#adding-an-operator"),
    "renamed": ("cann_attn parameter name -> the torch_npu name it is passed as, so errors name the caller's "
                "spelling", "guides/torch_npu.md#adding-an-operator"),
    # Storage formats.
    "self": ("the tensor", "guides/torch_npu.md#storage-formats"),
    "src": ("the format to record: an int, a Format, or a tensor whose format to take",
            "guides/torch_npu.md#storage-formats"),
    "acl_format": ("the storage format: an int (2 ND, 29 FRACTAL_NZ, ...) or a Format; values never change",
                   "guides/torch_npu.md#storage-formats"),
    "customize_dtype": ("the NZ chunk's dtype on the NPU; changes no value here",
                        "guides/torch_npu.md#storage-formats"),
    # MlaProlog.
    "token_x": ("the new tokens' hidden states, [T, He] or [B, S, He]", MLA),
    "weight_dq": ("W^DQ [He, Hcq], the query down-projection (plain or NZ-cast)", MLA),
    "weight_uq_qr": ("the two query up-projections side by side, [Hcq, N (D + Dr)]: per head D no-rope then Dr rope "
                     "columns", MLA),
    "weight_uk": ("W^UK [N, D, Hckv], the key up-projection absorbed into the query", MLA),
    "weight_dkv_kr": ("[He, Hckv + Dr]: the latent and rope-key down-projection", MLA),
    "rmsnorm_gamma_cq": ("the query latent's RmsNorm weights [Hcq]", MLA + "#rmsnorm"),
    "rmsnorm_gamma_ckv": ("the key/value latent's RmsNorm weights [Hckv]", MLA + "#rmsnorm"),
    "rmsnorm_epsilon_cq": ("epsilon of the query latent's RmsNorm", MLA + "#rmsnorm"),
    "rmsnorm_epsilon_ckv": ("epsilon of the key/value latent's RmsNorm", MLA + "#rmsnorm"),
    "rope_sin": ("one row of Dr sines per token (half-split form, entries i and Dr/2 + i equal)", MLA + "#rope"),
    "rope_cos": ("one row of Dr cosines per token, as rope_sin", MLA + "#rope"),
    "kv_cache": ("the latent cache, updated in place at the tokens' slots (layout: cache_mode)", MLA + "#the-caches"),
    "kr_cache": ("the rope-key cache, updated in place like kv_cache", MLA + "#the-caches"),
    "cache_index": ("int64, one cache slot per token (the paged cache modes)", MLA + "#the-caches"),
    "cache_mode": ("the caches' layout: 'PA_BSND', 'PA_NZ', 'BSND' or 'TND'", MLA + "#the-caches"),
    "query_norm_flag": ("also return c^Q, the query latent after its RmsNorm", MLA + "#the-computation"),
    "qc_qr_scale": ("alpha_q, multiplies the query latent (so query and query_rope)", MLA + "#scales"),
    "kc_scale": ("alpha_kv, multiplies the cached latent (not the rope key)", MLA + "#scales"),
    "weight_quant_mode": ("quantised weights: 0 (none) only; 1 / 2 / 3 are refused", MLA + "#not-supported"),
    "kv_cache_quant_mode": ("quantised caches: 0 (none) only; 1 / 2 / 3 are refused", MLA + "#not-supported"),
    "ckvkr_repo_mode": ("latent and rope key packed into one cache row: 0 only", MLA + "#not-supported"),
    **{name: ("a scale of the quantised scenarios, which are not supported: only None is accepted",
              MLA + "#not-supported")
       for name in ("dequant_scale_x", "dequant_scale_w_dq", "dequant_scale_w_uq_qr", "dequant_scale_w_dkv_kr",
                    "quant_scale_ckv", "quant_scale_ckr", "smooth_scales_cq", "k_nope_clip_alpha")},
}
_DOC_PATH = re.compile(r"`?docs/((?:semantics|operators|guides)/[\w.-]+\.md|[\w-]+\.md)`?")


# Where a name means something else for one operator: operator (a function name without torch_npu's "npu_"
# prefix, matched by its start) -> name -> (meaning, page).
_FOR_OPERATOR: dict[str, dict[str, tuple[str, str]]] = {
    "fused_infer_attention_score_v2": {
        "key_quant_mode": ("v2 name of key_antiquant_mode", FIA_KV),
        "value_quant_mode": ("v2 name of value_antiquant_mode", FIA_KV),
        "query_quant_mode": ("3: int8 MLA query with per-token per-head dequant_scale_query; 0: a float query",
                             FIA + "#quantised-queries-and-fp8-caches"),
        **{f"{part}_dtype": ("reserved: None, or its tensor's own dtype (a torch.dtype or its ScalarType number); "
                             "anything else raises", FIA + "#quantised-queries-and-fp8-caches")
           for part in ("query", "key", "value", "query_rope", "key_rope", "dequant_scale_query",
                        "dequant_scale_key", "dequant_scale_value")},
        "actual_seq_qlen": ("per-batch query lengths (TND: cumulative ends); v2 name of actual_seq_lengths", LAYOUTS),
        "actual_seq_kvlen": ("per-batch key lengths (TND: cumulative ends); v2 name of actual_seq_lengths_kv",
                             LAYOUTS),
    },
    "kv_quant_sparse_flash_attention": {
        "key_quant_mode": ("how the cache is quantised: 2 (one fp32 scale per tile of 128 channels) only",
                           QUANT_DSA + "#parameters"),
        "value_quant_mode": ("as key_quant_mode: 2 only", QUANT_DSA + "#parameters"),
        "key_dequant_scale": ("reserved: only None (the scales travel inside the packed cache)",
                              QUANT_DSA + "#parameters"),
        "attention_mode": ("2 (MLA-absorb) only: the query holds q_nope ++ q_rope", QUANT_DSA + "#parameters"),
    },
    "quant_lightning_indexer": {
        "key_quant_mode": ("how the key is quantised: 0 (per token and head) only", QUANT_DSA),
    },
    "sparse_flash_attention": {
        "return_softmax_lse": ("also return softmax_max and softmax_sum (the statistics the grad takes)", SFA),
    },
    "mla_prolog": {
        "query_quant_mode": ("quantised query: 0 (none) only; 1 is refused", MLA + "#not-supported"),
        "quant_scale_repo_mode": ("scales packed into the cache rows: 0 only", MLA + "#not-supported"),
        "tile_size": ("channels per scale of a per-tile quantised cache; no effect without one",
                      MLA + "#not-supported"),
        "actual_seq_len": ("the per-block cache modes' lengths: only None (those modes are refused)",
                           MLA + "#the-caches"),
    },
    "installed": {
        "device": ("what the npu device maps to: 'cpu', 'cuda' or 'cuda:i' (None: CUDA when available)",
                   "guides/torch_npu.md#the-npu-device"),
    },
}


def _link(path: str, text: str | None = None) -> str:
    return f"[{text or path.rsplit('/', 1)[-1].split('#')[0].removesuffix('.md')}]({path})"


def meaning_of(name: str, function: str) -> tuple[str, str] | None:
    """The (meaning, page) of parameter `name` of the public function named `function`, or None."""
    operator = function.removeprefix("npu_")
    for prefix, names in sorted(_FOR_OPERATOR.items(), key=lambda item: -len(item[0])):
        if operator.startswith(prefix) and name in names:
            return names[name]
    return MEANINGS.get(name)


def _meaning(name: str, func: griffe.Function) -> str:
    found = meaning_of(name, func.name)
    if found is None:  # tests/test_docs_api.py lists every public parameter without one
        return ""
    text, page = found
    return f"{text} ({_link(page)})."


class ApiReference(griffe.Extension):
    """Adds the Args section and the links (see the module docstring)."""

    def on_instance(self, *, node, obj: griffe.Object, agent, **kwargs) -> None:
        if obj.docstring is not None:
            obj.docstring.value = _DOC_PATH.sub(lambda match: _link(match[1]), obj.docstring.value)

    def on_function_instance(self, *, node, func: griffe.Function, agent, **kwargs) -> None:
        if func.docstring is None or func.name.startswith("_"):
            return
        text = func.docstring.value
        parameters = [p for p in func.parameters if p.name not in ("self", "cls") and not p.name.startswith("*")
                      and p.kind not in (griffe.ParameterKind.var_positional, griffe.ParameterKind.var_keyword)]
        if parameters and not re.search(r"^\s*(Args|Arguments|Parameters):\s*$", text, flags=re.MULTILINE):
            lines = [f"    {p.name}: {_meaning(p.name, func)}".rstrip() for p in parameters]
            text = text.rstrip() + "\n\nArgs:\n" + "\n".join(lines) + "\n"
        func.docstring.value = text
