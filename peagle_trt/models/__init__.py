"""Reference models in PyTorch (CPU and CUDA): the target (`models.target.TargetModel`) and the
P-EAGLE / EAGLE-3 drafter (`models.drafter.DrafterModel`).

Both run a padded batch of rows at absolute positions over a paged `KVCache` (block tables):
writes go to each row's own position, reads are causal up to it, so rejected speculative
entries are simply overwritten by the next step (no rollback).
"""
