"""``planner.inputs``: sizes with their units by hand, configs read from a file or a directory, and the
shapes a config refuses. The command's one-line errors: ``tests/planner/test_plan.py``."""

import json

import pytest

from bp_mech.planner.inputs import PlanError, check_shape, load_config, parse_size


@pytest.mark.parametrize("text, size", [("1.5G", 1_500_000_000), ("0.5KiB", 512), (" 3 mb ", 3_000_000),
                                        ("2tib", 2 * 2**40), ("7b", 7), (".25GiB", 2**28)])
def test_sizes_by_hand(text, size):
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["8 GiB/s", "-1GiB", "GiB", "1e9", "0.0001"])
def test_what_is_not_a_positive_size_is_refused(text):
    with pytest.raises(PlanError):
        parse_size(text)


def _write(path, **fields):
    path.write_text(json.dumps(dict(model_type="llama", hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                    num_attention_heads=4, num_key_value_heads=2, vocab_size=100,
                                    max_position_embeddings=64, **fields)))
    return path


def test_a_config_file_or_its_directory(tmp_path):
    _write(tmp_path / "config.json")
    for where in (tmp_path, tmp_path / "config.json"):
        config = load_config(where)
        assert (config.model_type, config.hidden_size, config.num_key_value_heads) == ("llama", 32, 2)


def test_an_unreadable_or_unknown_config_is_one_plan_error(tmp_path):
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(PlanError, match="cannot read config"):
        load_config(tmp_path / "bad.json")
    with pytest.raises(PlanError, match="cannot read config"):
        load_config(tmp_path / "missing")
    (tmp_path / "list.json").write_text(json.dumps([dict(model_type="llama")]))  # (a traceback, exit 1, before)
    with pytest.raises(PlanError, match="cannot read config .*list.json: a config.json holds one JSON object, "
                                        "this one a list"):
        load_config(tmp_path / "list.json")
    (tmp_path / "t.json").write_text(json.dumps(dict(model_type="no-such-model")))
    with pytest.raises(PlanError, match="unknown architecture 'no-such-model'"):
        load_config(tmp_path / "t.json")


def test_the_shapes_a_config_refuses(tmp_path):
    config = load_config(_write(tmp_path / "c.json"))
    check_shape(config, 1, 64)  # at the limit
    for batch, seq, message in ((0, 8, "batch must be >= 1"), (1, 1, "seq >= 2"), (1, 65, "exceeds")):
        with pytest.raises(PlanError, match=message):
            check_shape(config, batch, seq)
