"""The identity of a saved training state: the run it was made by, which a resumed run must equal.

The manifest of a saved state (``bp_mech.state_format.FIELDS``) keeps, in its ``IDENTITY`` sections, the
workload, the model's architecture fields (``model_config_identity``), the training phase's config and the
data (the text's sha256 and length, batch, seq): ``identity`` builds them from their parts,
``trainer_identity`` from a live trainer. ``state_format.read_manifest`` compares them field by field.
"""

from __future__ import annotations

import dataclasses

import torch

from bp_mech.continual_data import text_sha256

MODEL_CONFIG_KEYS = ("model_type", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "vocab_size", "max_position_embeddings", "rms_norm_eps",
                     "tie_word_embeddings")


def model_config_identity(config) -> dict:
    """The architecture fields of a model config (``MODEL_CONFIG_KEYS``): the manifest's ``model_config``.

    Args:
        config: a Transformers model config; a field it lacks is None.

    Returns:
        ``{key: getattr(config, key, None)}`` for every key of ``MODEL_CONFIG_KEYS``.

    Example:
        >>> from bp_mech.instruments.workload import qwen2_config
        >>> fields = model_config_identity(qwen2_config("tiny"))
        >>> fields["hidden_size"], fields["num_hidden_layers"], fields["tie_word_embeddings"]
        (64, 2, True)
    """
    return {k: getattr(config, k, None) for k in MODEL_CONFIG_KEYS}


def identity(workload: dict, train_config, ids: torch.Tensor, batch: int, seq: int, model_config=None) -> dict:
    """The sections of ``IDENTITY``: what a saved state must share with the run that resumes it.

    Args:
        workload: the record's workload group (``instruments.workload.workload_fields``), kept as it is.
        train_config: the phase's ``continual_pretrain.TrainConfig``, kept as a dict.
        ids: (N,) token ids of the training text, kept as its ``text_sha256`` and token count.
        batch: sequences per batch of the data stream.
        seq: tokens per sequence of the data stream.
        model_config: a config object, kept as its ``model_config_identity`` (None: not compared).

    Returns:
        ``{"workload", "train_config", "data": {"text_sha256", "text_tokens", "batch", "seq"}, "model_config"}``.

    Example:
        >>> from bp_mech.continual_pretrain import TrainConfig
        >>> ident = identity({"workload_id": "tiny-b1s8"}, TrainConfig(), torch.arange(64), 1, 8)
        >>> sorted(ident), ident["data"]["text_tokens"], ident["model_config"]
        (['data', 'model_config', 'train_config', 'workload'], 64, None)
    """
    return dict(workload=workload, train_config=dataclasses.asdict(train_config),
                data=dict(text_sha256=text_sha256(ids), text_tokens=len(ids), batch=batch, seq=seq),
                model_config=None if model_config is None else model_config_identity(model_config))


def trainer_identity(trainer, workload: dict) -> dict:
    """The ``identity`` of a live trainer: its config, its data stream's text, batch and seq, its model's config.

    Args:
        trainer: a ``bench.trainer.Trainer`` (``phase_trainer``'s).
        workload: the record's workload group.

    Returns:
        The ``IDENTITY`` sections, as ``identity`` returns them.

    Example:
        >>> from bp_mech.instruments.workload import build_model, parse_workload
        >>> from bp_mech.bench.trainer import phase_trainer
        >>> from bp_mech.continual_data import TextStream
        >>> from bp_mech.continual_pretrain import TrainConfig
        >>> t = phase_trainer(build_model(parse_workload("tiny-b1s8")), TrainConfig(),
        ...                   TextStream(torch.arange(64), 1, 8, 0))
        >>> ident = trainer_identity(t, {"workload_id": "tiny-b1s8"})
        >>> ident["data"]["batch"], ident["data"]["seq"], ident["model_config"]["hidden_size"]
        (1, 8, 64)
    """
    return identity(workload, trainer.cfg, trainer.data.ids, trainer.data.batch, trainer.data.seq, trainer.model.config)
