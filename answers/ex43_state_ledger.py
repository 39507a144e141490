"""Answers for Part 02 · 43: the package's own ledger formulas are the reference solution.

Read them in ``src/bp_mech/state_bytes.py`` (``param_bytes``, ``grad_bytes``,
``adam_state_bytes``, ``block_saved_bytes``); the chapter shows them folded after each
exercise. The variant (``gelu_mlp_saved_bytes``) and the prediction
(``predict_forward_bytes``) are written here.
"""

from bp_mech.state_bytes import adam_state_bytes, block_saved_bytes, grad_bytes, param_bytes  # noqa: F401


def gelu_mlp_saved_bytes(hidden: int, intermediate: int, batch: int, seq: int,
                         bytes_per_value: int = 4) -> int:
    """x (saved by the up projection, for its weight's gradient), h (saved by GELU,
    whose derivative is taken at h) and g = GELU(h) (saved by the down projection):
    three storages, n (C + 2 I) values. The output y is saved by nobody."""
    n = batch * seq
    return int(n * (hidden + 2 * intermediate) * bytes_per_value)


def predict_forward_bytes(cfg, batch: int, seq: int) -> int:
    """The ledger's lines alive when the forward returns: the parameters W; AdamW's two
    moments 2W (it stepped before); no gradients (``zero_grad`` freed them); what the L
    layers saved; the final RMSNorm's saves 4 n (3C + 1); the float32
    log-probabilities 4 n V."""
    n, C, V = batch * seq, cfg.hidden_size, cfg.vocab_size
    W = param_bytes(cfg)
    saved = cfg.num_hidden_layers * block_saved_bytes(cfg, batch, seq)
    return int(3 * W + saved + 4 * n * (3 * C + 1) + 4 * n * V)
