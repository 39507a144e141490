"""``bp-mech plan``'s exit codes (0: a candidate fits; 1: none does, the plan printed with what would fit
instead; 2: bad input, one line), and its options beyond the config: the loop (``--keep-outputs``) and
AdamW's implementation (``--optimizer-impl``), each checked against the tracked-CPU peak of a real step
at tiny size."""

import json
import re
import subprocess
import sys

import pytest

from bp_mech import ROOT, cli
from bp_mech.planner import build, lifecycle, plan
from bp_mech.bench import strategy as S
from bp_mech.planner.definitions import StepDefinition
from bp_mech.instruments.adamw import torch_default_adamw
from tests.planner.test_plan import CPU, FAMILY_FIELDS, PEAK_TOL, TINY, tiny_config

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: tiny steps, one intra-op thread

FEW = ("--batch", "2", "--seq", "32")


def _config_file(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(dict(TINY, **FAMILY_FIELDS["llama"], model_type="llama")))
    return str(path)


def _cli(capsys, *args):
    rc = cli.main(["plan", "--workers", "1", *args])
    out, err = capsys.readouterr()
    return rc, out, err


def test_exit_0_when_a_candidate_fits(tmp_path, capsys):
    rc, out, err = _cli(capsys, "--config", _config_file(tmp_path), *FEW, "--budget", "1GiB")
    assert rc == 0 and "recommended: plain" in out and "bp-mech:" not in err


def test_exit_1_when_none_fits_with_the_plan_and_what_would_fit(tmp_path):
    """Through the installed command's entry point, in its own process: the table, the no-fit line and
    what would fit instead, no traceback, status 1 (bad input would be 2)."""
    cmd = [sys.executable, "-m", "bp_mech.cli", "plan", "--workers", "1", "--config", _config_file(tmp_path),
           "--batch", "8", "--seq", "32", "--budget", "2MiB"]
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert r.returncode == 1, r.stderr
    assert "Traceback" not in r.stderr and "\nplain " in r.stdout and "no strategy fits" in r.stdout
    said = [line for line in re.split(r"[\r\n]", r.stderr) if line.startswith("bp-mech")]  # (not the progress bar)
    assert len(said) == 1 and said[0].startswith("bp-mech: no strategy fits") and "the leanest" in said[0]
    js = subprocess.run([*cmd, "--json"], capture_output=True, text=True, cwd=ROOT, timeout=300)
    p = json.loads(js.stdout)
    assert js.returncode == 1 and p["recommended"] is None and p["fits_instead"]["strategy"]
    assert p["fits_instead"]["needs"] > 2 * 2**20


@pytest.mark.parametrize("args,message", [
    (("--budget", "lots"), "cannot read the budget"),
    (("--budget", "1GiB", "--seq", "1"), "seq >= 2"),
    (("--budget", "1GiB", "--optimizer-impl", "sgd"), "invalid choice"),
])
def test_exit_2_for_bad_input(tmp_path, capsys, args, message):
    base = dict(zip(FEW[::2], FEW[1::2]))
    base.update(dict(zip(args[::2], args[1::2])))
    rc, _, err = _cli(capsys, "--config", _config_file(tmp_path), *[x for kv in base.items() for x in kv])
    said = [line for line in re.split(r"[\r\n]", err) if line.strip()]
    assert rc == 2 and len(said) == 1 and said[0].startswith("bp-mech: error: ") and message in said[0], err


# --- the loop: outputs dropped before backward (Trainer) or kept through it (--keep-outputs) ----------

def _memtracker_peak(config, s, options, keep: bool) -> int:
    """PyTorch's own ``MemTracker`` (another measuring path than the storage tracker) around a real
    steady-state CPU step of ``s``: a warm-up update first (AdamW's moments, and the outputs the loop's
    ``out`` still holds when the step starts)."""
    import torch
    from torch.distributed._tools.mem_tracker import MemTracker

    from bp_mech.bench.step import train_step

    sess = lifecycle.Session(build.ConfigWorkload(config, 2, 32), "cpu", options=options)
    held = [] if keep else None
    train_step(sess.model, sess.opt, sess.batch, s, outputs=held)
    mt = MemTracker()
    mt.track_external(sess.model, sess.opt, *sess.batch.values(), *[t for o in held or () for t in o.values()])
    with mt:
        train_step(sess.model, sess.opt, sess.batch, s, outputs=held)
    return mt.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]


@pytest.mark.parametrize("keep", [False, True], ids=["outputs-dropped", "outputs-kept"])
def test_each_loop_plans_the_real_steps_peak(keep):
    """Every candidate, fake against the tracked-CPU peak of the real step in the same loop (to the
    GradScaler's 8 bytes); plain also against PyTorch's MemTracker; the saving of dropping the outputs
    is the difference of the two loops' plain peaks."""
    config, d = tiny_config("llama"), StepDefinition(keep_outputs=keep)
    p = plan.plan(config, 2, 32, 2**30, options=CPU, definition=d)
    assert p.definition.keep_outputs is keep and [r.strategy for r in p.rows] == [s.name for s in S.CANDIDATES]
    sess = lifecycle.Session(build.ConfigWorkload(config, 2, 32), "cpu", options=CPU, definition=d)
    for s, row in zip(S.CANDIDATES, p.rows):
        real = sess.ledger(s)
        assert real.source == "tracked-cpu" and abs(row.peak / real.peak - 1) <= PEAK_TOL, (s.name, row.peak, real.peak)
        assert 0 <= real.peak - row.peak <= (8 if s.amp == "float16" else 0), s.name
    plain = p.rows[0]
    assert abs(plain.peak / _memtracker_peak(config, S.PLAIN, CPU, keep) - 1) <= PEAK_TOL
    other = plan.plan(config, 2, 32, 2**30, candidates=[S.PLAIN], options=CPU, definition=d.replace(keep_outputs=not keep))
    kept, dropped = (plain.peak, other.rows[0].peak) if keep else (other.rows[0].peak, plain.peak)
    assert p.outputs_saving == other.outputs_saving == kept - dropped > 0


def test_the_command_states_the_loop_and_what_dropping_the_outputs_saves(tmp_path, capsys):
    args = ("--config", _config_file(tmp_path), *FEW, "--budget", "1GiB")
    rc, out, _ = _cli(capsys, *args)
    assert rc == 0 and "loop: outputs dropped before backward" in out and "dropping the outputs saves" in out
    rc, out, _ = _cli(capsys, *args, "--keep-outputs")
    assert rc == 0 and "loop: outputs kept through backward" in out and "dropping the outputs saves" in out
    rc, out, _ = _cli(capsys, *args, "--keep-outputs", "--json")
    p = json.loads(out)
    assert rc == 0 and p["definition"]["keep_outputs"] is True and p["outputs_saving"] > 0


# --- AdamW's implementation: --optimizer-impl default|foreach|fused|for-loop --------------------------

def test_the_for_loop_adamw_is_an_implementation_like_the_others():
    import torch

    from bp_mech.instruments.adamw import ADAMW_IMPLS
    from bp_mech.bench.optimizer import StepOptions, make_optimizer

    assert set(ADAMW_IMPLS) == {"fused", "foreach", "for-loop"}
    assert StepDefinition(adamw="for-loop").name == "steady+for-loop-adamw"
    opt = make_optimizer([torch.nn.Parameter(torch.zeros(3))], StepOptions(adamw="for-loop"), "cpu")
    assert (opt.defaults["foreach"], opt.defaults["fused"]) == (False, False)
    with pytest.raises(ValueError, match="unknown AdamW implementation"):
        StepOptions(adamw="default")
    # what PyTorch picks when told nothing: foreach on CUDA, the for-loop one on the CPU
    assert torch_default_adamw("cuda") == "foreach" and torch_default_adamw("cpu") == "for-loop"


@pytest.mark.parametrize("impl", ["foreach", "fused", "for-loop"])
def test_each_adamw_implementation_plans_the_real_steps_peak(impl):
    """The fake plan of each implementation against the tracked-CPU peak of a real step with the same
    AdamW (to the GradScaler's 8 bytes), and plain against PyTorch's MemTracker."""
    from bp_mech.bench.optimizer import StepOptions

    config, options = tiny_config("llama"), StepOptions(adamw=impl).for_device("cpu")
    some = [S.PLAIN, *(S.parse(n) for n in ("checkpoint-all", "offload", "fp16", "micro2", "chunked-loss"))]
    p = plan.plan(config, 2, 32, 2**30, candidates=some, options=options)
    assert p.options.adamw == impl
    sess = lifecycle.Session(build.ConfigWorkload(config, 2, 32), "cpu", options=options)
    for s, row in zip(some, p.rows):
        real = sess.ledger(s)
        assert abs(row.peak / real.peak - 1) <= PEAK_TOL, (impl, s.name, row.peak, real.peak)
        assert 0 <= real.peak - row.peak <= (8 if s.amp == "float16" else 0), (impl, s.name)
    assert abs(p.rows[0].peak / _memtracker_peak(config, S.PLAIN, options, False) - 1) <= PEAK_TOL


def test_the_command_states_the_adamw_it_traced(tmp_path, capsys):
    args = ("--config", _config_file(tmp_path), *FEW, "--budget", "1GiB", "--json")
    peaks = {}
    for impl, traced in (("default", "foreach"), ("fused", "fused"), ("for-loop", "for-loop")):
        rc, out, _ = _cli(capsys, *args, *(() if impl == "default" else ("--optimizer-impl", impl)))
        p = json.loads(out)
        assert rc == 0 and p["options"]["adamw"] == traced
        peaks[traced] = p["rows"][0]["peak"]
    assert peaks["foreach"] > peaks["fused"]  # foreach's update holds its temporaries all at once
    rc, out, _ = _cli(capsys, *args[:-1])
    assert rc == 0 and "foreach AdamW, PyTorch's default on CUDA" in out
    rc, out, _ = _cli(capsys, *args[:-1], "--optimizer-impl", "fused")
    assert rc == 0 and "fused AdamW, not PyTorch's default on CUDA (foreach)" in out
