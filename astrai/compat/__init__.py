"""Entry points that take other libraries' argument names and meanings, over astrai's one op:

- ``astrai.compat.flash_attn``: ``flash_attn_func``, ``flash_attn_varlen_func``,
  ``flash_attn_with_kvcache`` (flash-attn 2's conventions: bottom-right causal masks,
  ``cache_seqlens`` counted before the append, ``window_size=(left, right)``);
- ``astrai.compat.flashinfer``: ``merge_state`` (FlashInfer's base-2 log-sum-exp).

README.md ("Switching from flash-attn / FlashInfer") maps each argument and lists every
difference. Each call is resolved like any other (``attn_backend`` contexts, ``ASTR_BACKEND``).
"""
