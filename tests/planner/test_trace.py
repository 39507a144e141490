"""``planner.trace``: an exception in one line, a strategy's trace or why it has none, and the ledgers in
the strategies' order (in this process; the forked pool is ``planner.pool``'s)."""

from bp_mech.bench.oom import Failed
from bp_mech.bench.strategy import parse
from bp_mech.planner.trace import ledgers, one_line, traced


def test_an_exception_in_one_line():
    assert one_line(ValueError("first line\nsecond")) == "ValueError: first line"
    assert one_line(KeyError()) == "KeyError"
    assert one_line(RuntimeError("x" * 500), width=10) == "RuntimeError: " + "x" * 10


def test_a_trace_gets_its_definition_and_a_failure_names_the_strategy():
    seen = []
    trace = lambda sess, s, d: seen.append((sess, s.name, d)) or "ledger"  # noqa: E731
    assert traced("sess", trace, (parse("offload"), "def")) == "ledger" and seen == [("sess", "offload", "def")]
    assert traced("sess", trace, parse("fp16")) == "ledger" and seen[-1] == ("sess", "fp16", None)
    failed = traced(None, lambda sess, s, d: [][1], parse("micro2"))
    assert failed == Failed("IndexError: list index out of range", "micro2")


def test_ledgers_keep_the_strategies_order_and_each_failure_in_its_place():
    names = ["plain", "checkpoint-all+offload", "micro4", "fp16"]

    def trace(sess, s, d):
        if s.name == "micro4":
            raise MemoryError("no")
        return s.name

    out = list(ledgers(None, [parse(n) for n in names], workers=1, trace=trace))
    assert out[:2] + out[3:] == ["plain", "checkpoint-all+offload", "fp16"]
    assert out[2] == Failed("MemoryError: no", "micro4")
