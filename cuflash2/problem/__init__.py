"""Attention problems described and checked, framework-free and without a GPU: tensors and shapes
(tensors), optional features (features), the options of a call (options), variable-length and
KV-cache calls (varlen, kvcache)."""
