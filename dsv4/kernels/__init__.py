"""Custom GPU ops, each a plain-MLX reference plus one Metal/CUDA kernel body (see dialect.py).

Dispatchers the model calls (kernel or reference by backend and by flags.py's kernel_* switches):
  sparse_attention.sparse_attention   window + selected compressed rows, one softmax with sink
                                      (optionally rotating the queries and de-rotating the output)
  experts.experts                     routed + shared experts for 1-8 tokens (optionally + mHC expand)
  experts.routed_experts (through dsv4.moe.MoE)   the same from the router's logits, its tail
                                      (router.route) run inside the gate/up kernel
  mhc.hc_mixes_collapse_norm / hc_mixes / hc_collapse_norm / hc_expand
  qdq (through dsv4.quant.qdq_fp8 / qdq_fp4_pow2)   fp8/fp4 rounding, power-of-two scale per 32
  rows.row_tail (through dsv4.attention.finish_rows: the fixed-shape step, prefill chunks)   norm -> RoPE
                                      -> rounding; a prefill's inverse RoPE of the attention output
  matvec.quantized_matvec (through dsv4.linear: QuantizedLinear, fp8_linear)   quantized projection
                                      of 1-8 tokens, with the fp8 input rounding fused
  matvec_tail.projection_tail (through dsv4.linear.fp8_linear_tail: the fixed-shape step's wq_a
                                      and wkv)   a projection and its row tail in one launch (CUDA)
  router.route (through dsv4.moe.Router)   scores, biased top-k and weights after the gate matmul
  head.head_logits (through Model.logits, dsv4.moe.Router)   fp32 logits of 1-8 tokens from a bf16
                                      weight (the output head, the router's gate)
  indexer.indexer_scores (through dsv4.attention.Indexer)   the indexer's masked scores of every
                                      compressed row for 1-8 queries
  topk.topk_visible (through dsv4.attention.Indexer)   its top-k rows, -1 where not visible
  selection.indexer_can_be_skipped / select_all_visible   skip indexer scoring when k >= rows
"""
