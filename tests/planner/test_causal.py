"""``bp-mech plan`` plans causal LMs only (``bp_mech.planner.causal``): an encoder that Transformers' causal-LM
mapping lists (BERT, ELECTRA, XLM with its default ``is_encoder``) exits 2 with one line, and the sweep records
it as refused; the same family as a decoder (``is_decoder=True``) is planned."""

import json
import re

import pytest
import torch

from bp_mech import cli
from bp_mech.planner import causal, plan, sweep
from bp_mech.planner.inputs import PlanError
from tests.planner.test_plan import CPU

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: tiny steps, one intra-op thread

SMALL = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128, vocab_size=384,
             max_position_embeddings=128)


def _config(model_type, **changes):
    from transformers import AutoConfig

    return AutoConfig.for_model(model_type, **dict(SMALL, **changes))


def test_a_bert_config_exits_2_with_one_line(tmp_path, capsys):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(dict(SMALL, model_type="bert")))
    rc = cli.main(["plan", "--workers", "1", "--config", str(path), "--batch", "2", "--seq", "32", "--budget", "1GiB"])
    out, err = capsys.readouterr()
    said = [line for line in re.split(r"[\r\n]", err) if line.strip()]
    assert rc == 2 and not out and len(said) == 1, err
    assert said[0].startswith("bp-mech: error: 'bert' does not attend causally"), said


@pytest.mark.parametrize("model_type,changes", [("electra", dict(embedding_size=64)), ("xlm", dict(emb_dim=64,
                                                                                             n_layers=2, n_heads=4))])
def test_other_encoders_are_refused(model_type, changes):
    with pytest.raises(PlanError, match="does not attend causally"):
        plan.plan(_config(model_type, **changes), 2, 32, 2**30, options=CPU, candidates=[plan.PLAIN])


def test_the_same_family_as_a_decoder_is_planned():
    p = plan.plan(_config("bert", is_decoder=True), 2, 32, 2**30, options=CPU, candidates=[plan.PLAIN])
    assert [r.strategy for r in p.rows] == ["plain"] and p.recommended == "plain"


def test_the_sweep_records_an_encoder_as_refused():
    kind, detail = sweep.outcome("bert", candidates=(plan.PLAIN,))
    assert kind == "refused" and "does not attend causally" in detail


def test_flags_are_read_in_and_above_the_blocks_only():
    """A causal decoder says so; a vision tower's own non-causal attention beside the text blocks (GIT) does
    not make the model an encoder; a model without flags is left to the mapping (None)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        llama = AutoModelForCausalLM.from_config(_config("llama", num_key_value_heads=2))
        git = AutoModelForCausalLM.from_config(sweep.two_layers(AutoConfig.for_model("git")))
        bert = AutoModelForCausalLM.from_config(_config("bert"))
    assert causal.attends_causally(llama) is True and causal.attends_causally(bert) is False
    assert causal.attends_causally(git) is not False
    assert causal.attends_causally(torch.nn.Linear(2, 2)) is None  # no decoder blocks: nothing says
