"""griffe extension for the API reference (mkdocs.yml, mkdocstrings ``extensions``): per-argument sections and
links in every docstring.

* A function whose docstring has no ``Args:`` section gets one, built from its signature: every parameter with its
  type annotation and default (rendered by mkdocstrings as a table) and the meaning from :data:`MEANINGS`, the one
  glossary of the parameter names the operators share, each pointing to the page that decides it. A parameter the
  glossary does not know points to its operator's page. New functions are covered without editing anything here.
* Plain-text paths to documentation pages (``docs/semantics/masks.md``) become links.
"""

from __future__ import annotations

import re

import griffe

MASKS, LAYOUTS, PSE = "semantics/masks.md", "semantics/layouts.md", "semantics/pse.md"
STATS, DROPOUT, PAGED = "semantics/softmax-stats.md", "semantics/dropout.md", "semantics/paged-kv.md"
SINKS, BACKENDS, CP = "semantics/sinks.md", "guides/backends.md", "guides/context_parallel.md"

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
}
_OPERATOR_PAGES = {
    "flash_attention_score": "operators/flash_attention_score.md",
    "flash_attention_score_grad": "operators/flash_attention_score_grad.md",
    "prompt_flash_attention": "operators/prompt_flash_attention.md",
    "fused_infer_attention_score": "operators/fused_infer_attention_score.md",
    "incre_flash_attention": "operators/incre_flash_attention.md",
    "sparse_flash_attention": "operators/sparse_flash_attention.md",
    "lightning_indexer": "operators/lightning_indexer.md",
    "dense_indexer": "operators/dense_lightning_indexer.md",
    "ring_attention_update": "operators/ring_attention_update.md",
    "attention_update": "operators/attention_update.md",
    "distributed": CP,
    "torch_npu": "guides/torch_npu.md",
}
_DOC_PATH = re.compile(r"`?docs/((?:semantics|operators|guides)/[\w.-]+\.md|[\w-]+\.md)`?")


def _link(path: str, text: str | None = None) -> str:
    return f"[{text or path.rsplit('/', 1)[-1].removesuffix('.md')}]({path})"


def _page_of(func: griffe.Function) -> str | None:
    for part in reversed(func.path.split(".")):
        for name, page in _OPERATOR_PAGES.items():
            if part == name or part.startswith(name):
                return page
    return None


def _meaning(name: str, func: griffe.Function) -> str:
    if name in MEANINGS:
        text, page = MEANINGS[name]
        return f"{text} ({_link(page)})."
    page = _page_of(func)
    return f"See {_link(page, 'the operator page')}." if page else ""


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
