"""``checks.engine``: from one declaration, every derived property rejects the function that breaks it, with its
one-line message (a mutated input, an alias, a default ignored, a leaked switch, a module left in eval mode or
hooked, a wrong type), a stub passes through, the cases are the examples first and then the same drawn ones
every run, and a check's outcome does not depend on the state it starts from."""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import strategies as st

from bp_mech.checks.common import autograd_grads
from bp_mech.checks.engine import Contract, Raises, check, checks
from bp_mech.checks.global_state import clean, restore, state


def _x(c):
    return {"x": torch.linspace(-2, 2, c["n"], dtype=torch.float64), "dy": torch.ones(c["n"], dtype=torch.float64),
            "k": c.get("k", 2.0)}


def _ref(x, dy, k):
    return autograd_grads(lambda x: k * F.silu(x), [x], dy)[0], dy * k


K = Contract("f", _x, _ref, ("dx", "dk"), defaults={"k": 2.0}, dtypes={torch.float32: 1e-5}, ref_name="autograd",
             draw=st.fixed_dictionaries({"n": st.integers(1, 6)}), examples={"": [{"n": 3}], "one": [{"n": 1}]})
(RUN, ONE) = check(K)


def right(x, dy, k=2.0):
    s = torch.sigmoid(x)
    return k * dy * s * (1 + x * (1 - s)), dy * k


def _m(f):
    return type("Solutions", (), {"f": staticmethod(f), "g": staticmethod(f)})


def test_a_right_function_passes_and_the_checks_are_named_by_their_declaration():
    RUN(_m(right)), ONE(_m(right))
    assert [c.__name__ for c in checks(K)] == ["check_f", "check_f__one"] and RUN.tests == ONE.tests == "f"


def _mutates(x, dy, k=2.0):
    out = right(x, dy, k)
    dy.zero_()
    return out


def _leak(switch):
    def f(x, dy, k=2.0):
        switch()
        return right(x, dy, k)
    return f


@pytest.mark.parametrize("f, message", [
    (_mutates, r"^f: dy was modified in place, max change 1 at x shape \(3,\), dy shape \(3,\), k left out"),
    (lambda x, dy, k=3.0: right(x, dy, k), r"dx differs from autograd, max rel error .* > 1e-10 at .*k left out "
                                           r"\(default 2.0\)"),
    (lambda x, dy, k: right(x, dy, k), "raised TypeError at .*k left out"),
    (lambda x, dy, k=2.0: [*right(x, dy, k)], r"returned a list, expected a tuple \(dx, dk\)"),
    (lambda x, dy, k=2.0: tuple(t.double() for t in right(x, dy, k)), "dx has dtype torch.float64, expected "
                                                                      "torch.float32 at float32 inputs"),
    (lambda x, dy, k=2.0: tuple(t * x.is_contiguous() for t in right(x, dy, k)),
     "differs .* as non-contiguous slice views"),
    (lambda x, dy, k=2.0: tuple(t.requires_grad_() * 1 for t in right(x, dy, k)), "attached to the autograd graph"),
    (lambda x, dy, k=2.0: tuple(t * torch.nan for t in right(x, dy, k)), "dx has 3 non-finite values"),
    (_leak(lambda: torch.set_grad_enabled(False)), "left the grad mode changed"),
    (_leak(lambda: torch.set_default_dtype(torch.float64)), "left the default dtype changed"),
    (_leak(lambda: torch.rand(1)), r"left the torch RNG state changed \(its state before, another after"),
    (_leak(lambda: torch.set_autocast_enabled("cpu", True)), "left the CPU autocast changed"),
    (_leak(lambda: (torch.set_grad_enabled(False), 1 / 0)), "grad mode changed .* also when raising"),
])
def test_each_derived_property_rejects_the_function_that_breaks_it(f, message):
    with pytest.raises(AssertionError, match=f"^f: .*{message}" if not message.startswith("^") else message):
        RUN(_m(f))
    assert torch.is_grad_enabled() and torch.get_default_dtype() == torch.float32  # put back by the engine
    assert not torch.is_autocast_enabled("cpu")


ALIAS = Contract("h", lambda c: {"x": torch.ones(3, dtype=torch.float64)}, lambda x: (x.clone(), x.clone()),
                 ("y", "z"), ref_name="x", examples={"": [{}]})


@pytest.mark.parametrize("h, message", [
    (lambda x: (x, x.clone()), r"^h: y shares its storage with the input x \(return a new tensor"),
    (lambda x: (lambda y: (y, y))(x.clone()), "^h: z shares its storage with y"),
    (lambda x: (x.clone(), x.clone()[None]), r"^h: z has shape \(1, 3\), x gives \(3,\)")])
def test_results_are_new_tensors_of_their_own(h, message):
    with pytest.raises(AssertionError, match=message):
        check(ALIAS)[0](type("S", (), {"h": staticmethod(h)}))


def test_a_stub_passes_through_as_not_implemented():
    def stub(x, dy, k=2.0):
        raise NotImplementedError("ex: f")

    with pytest.raises(NotImplementedError, match="ex: f"):
        RUN(_m(stub))


def test_the_examples_come_first_and_the_drawn_cases_are_the_same_every_run():
    seen = []

    def spy(x, dy, k=2.0):
        seen.append(len(x))
        return right(x, dy, k)

    RUN(_m(spy))
    first, seen[:] = list(seen), []
    RUN(_m(spy))
    assert first == seen and first[:3] == [3, 3, 3] and len(set(first)) > 2  # the example, its view, float32


def _module_case(c):
    return {"net": c["net"], "x": torch.ones(2, 3, dtype=torch.float64)}


NET = Contract("g", _module_case, lambda net, x: (x.sum(),), ("y",), strides=False,
               examples={"": [{"net": torch.nn.Sequential(torch.nn.Linear(3, 3))}]})


@pytest.mark.parametrize("touch, message", [
    (lambda net: net.eval(), r"left the net.training changed \(True before, False after"),
    (lambda net: net[0].register_forward_hook(lambda *a: None), "left the net.0's forward hooks changed"),
])
def test_modules_passed_in_keep_their_train_flags_and_hooks(touch, message):
    (run,) = check(NET)
    net = NET.examples[""][0]["net"]

    def g(net, x):
        touch(net)
        return x.sum()

    with pytest.raises(AssertionError, match=f"^g: {message}"):
        run(type("S", (), {"g": staticmethod(g)}))
    assert net.training and not net[0]._forward_hooks  # restored by the engine
    run(type("S", (), {"g": staticmethod(lambda net, x: x.sum())}))


def test_a_check_starts_clean_whatever_the_caller_left_and_gives_the_caller_its_state_back():
    torch.set_default_dtype(torch.float64)
    torch.set_grad_enabled(False)
    torch.manual_seed(3)
    before = state({})
    try:
        with clean():
            assert torch.get_default_dtype() == torch.float32 and torch.is_grad_enabled()
            assert torch.get_num_threads() == 1
        RUN(_m(right))
        with pytest.raises(AssertionError, match="^f: dx differs"):  # dx through the default dtype: float32 here
            RUN(_m(lambda x, dy, k=2.0: (right(x, dy, k)[0].to(torch.get_default_dtype()).to(x.dtype), dy * k)))
        assert state({}) == before
    finally:
        restore({**before, "grad mode": True, "default dtype": torch.float32}, {})


# --- results that are not tensors, refused inputs, classes ------------------------------------


def _weights(c):
    return {"counts": [torch.tensor(float(n), dtype=torch.float64) for n in c["counts"]], "k": c.get("k", 1)}


def _weights_ref(counts, k):
    if k < 1:
        return Raises(ValueError, "k < 1")
    total = sum(float(n) for n in counts)
    return ([float(n) / total for n in counts], {"total": int(total)})


W = Contract("weights", _weights, _weights_ref, ("w", "info"), ref_name="a brute force", dtypes={torch.float32: 1e-6},
             examples={"": [{"counts": [1, 3]}, {"counts": [2, 2], "k": 0}]})


def right_weights(counts, k=1):
    if k < 1:
        raise ValueError("k")
    total = sum(float(n) for n in counts)
    return [float(n) / total for n in counts], {"total": int(total)}


@pytest.mark.parametrize("wrong, message", [
    (lambda counts, k=1: right_weights(counts, max(k, 1)), "returned a tuple for k < 1, expected ValueError"),
    (lambda counts, k=1: right_weights(counts, k) if k else [][0], "raised IndexError for k < 1, expected ValueError"),
    (lambda counts, k=1: (right_weights(counts, k)[0][:1], right_weights(counts, k)[1]), r"w has 1 entries, .* 2"),
    (lambda counts, k=1: ([w + 1e-3 for w in right_weights(counts, k)[0]], right_weights(counts, k)[1]),
     r"w\[0\] is 0.251, a brute force gives 0.25"),
    (lambda counts, k=1: (right_weights(counts, k)[0], {"total": float(right_weights(counts, k)[1]["total"])}),
     r"info\['total'\] is a float, expected an int"),
    (lambda counts, k=1: (right_weights(counts, k)[0], {"sum": 4}), r"info has \['sum'\] entries"),
])
def test_results_that_are_not_tensors_and_refused_inputs_are_held_element_by_element(wrong, message):
    (run,) = check(W)
    run(type("S", (), {"weights": staticmethod(right_weights)}))
    with pytest.raises(AssertionError, match=f"^weights: .*{message}"):
        run(type("S", (), {"weights": staticmethod(wrong)}))


class Counter:
    """A class graded through a driver: add(n) then total()."""

    def __init__(self, start=0):
        self.n = start

    def add(self, n):
        self.n += n

    def total(self):
        return self.n


def _drive(cls):
    def run(steps):
        c = cls()
        for s in steps:
            c.add(s)
        return c.total()
    return run


C = Contract("Counter", lambda c: {"steps": c["steps"]}, lambda steps: (sum(steps),), ("total",), returns=int,
             use=_drive, ref_name="sum", examples={"": [{"steps": [1, 2]}, {"steps": []}]})


def test_a_class_is_graded_through_its_driver():
    (run,) = check(C)
    run(type("S", (), {"Counter": Counter}))
    off_by_one = type("Counter", (Counter,), {"total": lambda self: self.n + 1})
    with pytest.raises(AssertionError, match=r"^Counter: total is 4, sum gives 3 at steps \[1, 2\]"):
        run(type("S", (), {"Counter": off_by_one}))


ORDERLESS = check(Contract("g", lambda c: {"xs": [3, 1, 2], "w": {"a": {"p": 1, "q": 4}, "b": {"r": 2}}},
                           lambda xs, w: (max(xs) * 10 + max(v for r in w.values() for v in r.values()),), ("m",),
                           returns=int, orderless=("xs", "w"), examples={"": [{}]}, ref_name="a max"))[0]


@pytest.mark.parametrize("wrong", [lambda xs, w: xs[0] * 10 + 4,  # the list's first item
                                   lambda xs, w: max(xs) * 10 + list(w["a"].values())[-1],  # an inner dict's last
                                   lambda xs, w: max(xs) * 10 + list(w)[0].count("a") + 3])  # the outer dict's first
def test_a_documented_order_invariance_rejects_what_reads_the_order(wrong):
    """Each ``orderless`` argument is reversed (a list's items; a dict's keys, inner dicts too): a result that read
    the given order differs there, and the message says so; the max of all passes."""
    ORDERLESS(_m(lambda xs, w: max(xs) * 10 + max(v for r in w.values() for v in r.values())))
    with pytest.raises(AssertionError, match=r"in reverse order"):
        ORDERLESS(_m(wrong))


def test_a_case_with_its_own_tolerance_is_held_to_it_also_in_views():
    """An ill-conditioned case names its float64 tolerance ("tol"); every other case keeps the declaration's."""
    def off(rel):
        return lambda x, dy, k=2.0: tuple(t * (1 + rel) for t in right(x, dy, k))

    loose, = check(Contract("f", _x, _ref, ("dx", "dk"), defaults={"k": 2.0}, ref_name="autograd",
                            examples={"": [{"n": 3, "tol": 1e-6}]}))
    loose(_m(off(1e-8)))  # within its own tolerance, outside the declaration's 1e-10
    strict, = check(Contract("f", _x, _ref, ("dx", "dk"), defaults={"k": 2.0}, ref_name="autograd",
                             examples={"": [{"n": 3}]}))
    with pytest.raises(AssertionError, match=r"max rel error 1\.0e-08 > 1e-10"):
        strict(_m(off(1e-8)))

    def worse_in_views(x, dy, k=2.0):
        return off(0 if x.is_contiguous() else 1e-5)(x, dy, k)

    with pytest.raises(AssertionError, match=r"max rel error 1\.0e-05 > 1e-06 at x, dy as non-contiguous"):
        loose(_m(worse_in_views))
