"""``bp-mech plan`` for fine-tuning (``planner.finetune``, ``StepOptions.optimizer``): half-precision weights
without a master copy, frozen parameters, LoRA through peft, SGD / Adafactor / 8-bit AdamW. Each mode's fake
plan against the tracked-CPU peak of a real step at tiny size (the issue's 2 %; in fact equal, the fake
step being the same program), each mode's gradients and optimizer state against their exact byte count
(so a mode that did nothing would fail), and the command's flags, header and one-line errors."""

import json
import math
import re
import subprocess
import sys

import pytest
import torch

from bp_mech import ROOT, cli
from bp_mech.planner import build, inputs, lifecycle, plan
from bp_mech.bench import strategy as S
from bp_mech.planner.definitions import StepDefinition
from bp_mech.planner.finetune import FineTune, FineTuneError, apply
from bp_mech.bench.optimizer import StepOptions, make_optimizer
from tests.planner.test_plan import FAMILY_FIELDS, PEAK_TOL, TINY, tiny_config

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: tiny steps, one intra-op thread

STRATEGIES = [S.PLAIN, S.parse("checkpoint-all")]  # plain and one checkpointing strategy
FAMILIES = ("qwen2", "llama")  # tied and untied embeddings
# mode -> (optimizer, weights, fine-tuning)
MODES = {
    "bf16": ("adamw", "bfloat16", None),
    "fp16": ("adamw", "float16", None),
    "freeze": ("adamw", None, FineTune(freeze=r"embed|layers\.0\.")),
    "lora": ("adamw", None, FineTune(lora_rank=4)),
    "lora-qv": ("adamw", None, FineTune(lora_rank=4, lora_targets=("q_proj", "v_proj"))),
    "lora-mlp-bf16": ("adamw", "bfloat16", FineTune(lora_rank=4, lora_targets=("gate_proj", "up_proj", "down_proj"))),
    "sgd": ("sgd", None, None),
    "adafactor": ("adafactor", None, None),
    "adamw8bit": ("adamw8bit", None, None),
}


def _trainable(model) -> list:
    return [p for p in model.parameters() if p.requires_grad]


def optimizer_bytes(kind: str, params) -> int:
    """The optimizer state's exact bytes: AdamW two moments and a float32 step per tensor; SGD one momentum
    buffer; Adafactor a step and, per matrix, a row and a column of second moments (a vector: all of it);
    AdamW8bit one byte per element for each moment plus a float32 absmax per 256-block (tensors under 4096
    elements: two float32 moments), and its two 256-entry quantization maps, shared."""
    nbytes = [p.numel() * p.element_size() for p in params]
    if kind == "adamw":
        return 2 * sum(nbytes) + 4 * len(params)
    if kind == "sgd":
        return sum(nbytes)
    if kind == "adafactor":
        return sum(4 + (sum(p.shape[-2:]) if p.dim() >= 2 else p.numel()) * p.element_size() for p in params)
    return 2 * 256 * 4 + sum(2 * p.numel() + 8 * math.ceil(p.numel() / 256) if p.numel() >= 4096 else 8 * p.numel()
                             for p in params)


def _setup(family: str, mode: str):
    kind, weights, ft = MODES[mode]
    return tiny_config(family), StepOptions(optimizer=kind).for_device("cpu"), StepDefinition(weights=weights), ft


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("family", FAMILIES)
def test_each_mode_plans_the_real_steps_peak(family, mode):
    """The fake plan of plain and checkpoint-all against the tracked-CPU ledger of the real step in the
    same mode; the real step's gradients are the trainable parameters' bytes, its optimizer state the
    optimizer's exact count."""
    config, options, d, ft = _setup(family, mode)
    p = plan.plan(config, 2, 32, 2**30, candidates=STRATEGIES, options=options, definition=d, finetune=ft)
    assert [r.strategy for r in p.rows] == [s.name for s in STRATEGIES] and p.finetune == ft
    sess = lifecycle.Session(build.ConfigWorkload(config, 2, 32, finetune=ft), "cpu", options=options, definition=d)
    assert type(sess.opt).__name__.lower() == options.optimizer
    trainable = _trainable(sess.model)
    assert p.model["trainable"] == sum(x.numel() for x in trainable)
    assert (p.model["trainable"] < p.model["parameters"]) == (ft is not None)
    for s, row in zip(STRATEGIES, p.rows):
        real = sess.ledger(s)
        # (float16 AdamW: its eps, 1e-8, is 0 in float16, so an unseen token's row goes 0/0 in the warm-up
        # update; the bytes do not depend on the values)
        assert real.source == "tracked-cpu" and (real.finite or d.weights == "float16")
        assert abs(row.peak / real.peak - 1) <= PEAK_TOL, (family, mode, s.name, row.peak, real.peak)
        assert row.stages == real.totals(), (family, mode, s.name)  # the same program: the same bytes
        after = real.stages["backward"]
        assert after["gradients"] == sum(x.numel() * x.element_size() for x in trainable), (mode, s.name)
        assert after["optimizer_states"] == optimizer_bytes(options.optimizer, trainable), (mode, s.name)
    if d.weights and ft is None:  # no float32 master copy: every parameter in the half dtype
        assert {x.dtype for x in sess.model.parameters()} == {getattr(torch, d.weights)}


def test_lora_and_freezing_change_what_they_should():
    """LoRA's gradients and optimizer state are a small fraction of full fine-tuning's (its adapters float32
    beside bf16 weights, as peft's autocast_adapter_dtype makes them); a frozen embedding has no gradient."""
    config = tiny_config("llama")  # untied: the embedding is a parameter of its own
    led = {}
    for name, ft in (("full", None), ("lora", FineTune(lora_rank=4)), ("frozen", FineTune(freeze="embed_tokens"))):
        sess = lifecycle.Session(build.ConfigWorkload(config, 2, 32, finetune=ft), fake=True,
                                 options=StepOptions().for_device("cpu"))
        led[name] = sess.ledger().stages["backward"], sess.model
    state = {k: v[0]["gradients"] + v[0]["optimizer_states"] for k, v in led.items()}
    assert state["lora"] < 0.05 * state["full"]
    embed = led["full"][1].get_input_embeddings().weight
    assert led["frozen"][0]["gradients"] == led["full"][0]["gradients"] - embed.numel() * embed.element_size()
    assert not led["frozen"][1].get_input_embeddings().weight.requires_grad
    bf16 = lifecycle.Session(build.ConfigWorkload(config, 2, 32, finetune=FineTune(lora_rank=4)), fake=True,
                             definition=StepDefinition(weights="bfloat16"))
    assert {p.dtype for p in _trainable(bf16.model)} == {torch.float32}
    assert {p.dtype for p in bf16.model.parameters() if not p.requires_grad} == {torch.bfloat16}


def test_bad_fine_tuning_is_a_clear_value_error():
    model = torch.nn.Sequential(torch.nn.Embedding(8, 4), torch.nn.Linear(4, 8))
    with pytest.raises(FineTuneError, match="matches no parameter"):
        apply(model, FineTune(freeze="nothing"))
    with pytest.raises(FineTuneError, match="matches every parameter"):
        apply(model, FineTune(freeze="."))
    with pytest.raises(FineTuneError, match="not a regular expression"):
        FineTune(freeze="(")
    with pytest.raises(FineTuneError, match="already"):
        FineTune(freeze="embed", lora_rank=4)
    with pytest.raises(FineTuneError, match="without a LoRA rank"):
        FineTune(lora_targets=("q_proj",))
    from transformers import AutoModelForCausalLM

    lm = AutoModelForCausalLM.from_config(tiny_config("qwen2"))
    with pytest.raises(FineTuneError, match="'wq' matches no module"):
        apply(lm, FineTune(lora_rank=4, lora_targets=("q_proj", "wq")))


def test_the_optimizer_takes_only_what_trains_and_its_implementations():
    w, frozen = torch.nn.Parameter(torch.zeros(3, 2)), torch.nn.Parameter(torch.zeros(3), requires_grad=False)
    for kind, impl, cls in (("adamw", "fused", "AdamW"), ("sgd", "for-loop", "SGD"), ("adafactor", "foreach", "Adafactor")):
        opt = make_optimizer([w, frozen], StepOptions(optimizer=kind, adamw=impl), "cpu")
        assert type(opt).__name__ == cls and opt.param_groups[0]["params"] == [w]
    adamw = make_optimizer([w], StepOptions(adamw="foreach"), "cpu")  # AdamW as before: flags as given
    assert (adamw.defaults["foreach"], adamw.defaults["fused"], adamw.defaults["lr"]) == (True, None, 1e-4)
    assert make_optimizer([w], StepOptions(optimizer="sgd", adamw="fused"), "cpu").defaults["momentum"] == 0.9
    with pytest.raises(ValueError, match="adafactor has no implementation 'fused'"):
        make_optimizer([w], StepOptions(optimizer="adafactor", adamw="fused"), "cpu")
    with pytest.raises(ValueError, match="unknown optimizer"):
        StepOptions(optimizer="lion")
    assert StepOptions(optimizer="adafactor").for_device("cuda").adamw == "foreach"  # (no fused Adafactor)


def test_a_missing_package_is_refused_in_one_line(monkeypatch):
    import importlib.util

    find = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name in ("peft", "bitsandbytes")
                        else find(name, *a))
    with pytest.raises(inputs.PlanError, match="adamw8bit needs bitsandbytes, which is not installed"):
        plan.plan(tiny_config("llama"), 2, 32, 2**30, options=StepOptions(optimizer="adamw8bit"))
    with pytest.raises(inputs.PlanError, match="LoRA needs peft"):
        plan.plan(tiny_config("llama"), 2, 32, 2**30, finetune=FineTune(lora_rank=4))


def test_the_command_and_the_planner_import_without_peft_or_bitsandbytes():
    code = ("import sys; sys.modules.update(peft=None, bitsandbytes=None); "
            "import bp_mech.cli, bp_mech.planner.plan, bp_mech.planner.lifecycle; print('ok')")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr


# --- the command: --dtype, --freeze, --lora-rank, --lora-targets, --optimizer ----------------------------

FEW = ("--batch", "2", "--seq", "32", "--budget", "1GiB")


def _cli(capsys, tmp_path, *args):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(dict(TINY, **FAMILY_FIELDS["llama"], model_type="llama")))
    rc = cli.main(["plan", "--workers", "1", "--config", str(path), *FEW, *args])
    out, err = capsys.readouterr()
    return rc, out, err


def test_the_command_traces_the_flags_and_states_them(tmp_path, capsys):
    rc, out, _ = _cli(capsys, tmp_path, "--dtype", "bf16", "--freeze", r"embed|layers\.0\.", "--optimizer", "sgd",
                      "--json")
    p = json.loads(out)
    assert rc == 0 and p["options"]["optimizer"] == "sgd" and p["options"]["adamw"] == "foreach"
    assert p["definition"]["weights"] == "bfloat16" and p["finetune"]["freeze"] == r"embed|layers\.0\."
    assert 0 < p["model"]["trainable"] < p["model"]["parameters"]
    rc, out, _ = _cli(capsys, tmp_path, "--lora-rank", "4", "--lora-targets", "q_proj,v_proj", "--optimizer",
                      "adafactor")
    head = out.splitlines()[0]
    assert rc == 0 and "foreach Adafactor, PyTorch's default on CUDA" in head and "float32 weights" in head
    assert re.search(r"1,792 of [\d,]+ parameters trained \(\d\.\d\d%, lora-r4\[q_proj,v_proj\]\)", head), head


@pytest.mark.parametrize("args,message", [
    (("--dtype", "int8"), "invalid choice"),
    (("--optimizer", "lion"), "invalid choice"),
    (("--lora-rank", "x"), "invalid int value"),
    (("--lora-rank", "0"), "LoRA rank must be >= 1"),
    (("--lora-targets", "q_proj"), "without a LoRA rank"),
    (("--freeze", "("), "not a regular expression"),
    (("--freeze", "no_such_weight"), "matches no parameter"),
    (("--freeze", "."), "matches every parameter"),
    (("--lora-rank", "4", "--lora-targets", "q_proj,wq"), "'wq' matches no module"),
    (("--optimizer", "adafactor", "--optimizer-impl", "fused"), "adafactor has no fused implementation"),
    (("--optimizer", "adamw8bit", "--optimizer-impl", "fused"), "adamw8bit has one implementation"),
])
def test_bad_fine_tuning_input_exits_2_in_one_line(tmp_path, capsys, args, message):
    rc, _, err = _cli(capsys, tmp_path, *args)
    said = [line for line in re.split(r"[\r\n]", err) if line.strip()]
    assert rc == 2 and len(said) == 1 and said[0].startswith("bp-mech: error: ") and message in said[0], err
