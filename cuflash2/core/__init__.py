"""The framework-free core: attention operations on described device tensors (ops, kvcache) and
the one record/replay mechanism every call kind uses (replay)."""
