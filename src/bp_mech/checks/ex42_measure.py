"""Checks of exercises/ex42_offload.py, the shared part: the toy model every ex42 check runs, the life of a hooks
object (both classes), the scenario driver, and ``predict_d2h_bytes`` (the prediction) against the D2H bytes the
package's ``ActivationOffload`` counts on a small MLP stack (exact: the hooks count bytes). The declarations are
``ex42``'s (``CHECKS``).
"""

import torch
from torch import nn

from bp_mech.checks.common import CheckFailed
from bp_mech.checks.engine import Contract
from bp_mech.checks.properties import max_change
from bp_mech.offload import ActivationOffload, OffloadConfig

MIN_BYTES = 1024  # CountingOffload's threshold in every ex42 check


def toy_params(seed):
    """The toy model of every ex42 check: saved storages of several sizes, views sharing one storage.

    Args:
        seed: the generator's seed.

    Returns:
        ([W1, W2, b], scale, x), float64 tensors that require grad: ``toy_loss``'s arguments.

    Example:
        >>> [p.shape for p in toy_params(0)[0]]
        [torch.Size([32, 128]), torch.Size([64, 32]), torch.Size([32])]
    """
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: (torch.randn(*s, generator=g, dtype=torch.float64) / s[0] ** 0.5).requires_grad_()  # noqa: E731
    W1, W2, b = r(32, 128), r(64, 32), r(32)
    scale = torch.full((1,), 0.7, dtype=torch.float64, requires_grad=True)  # 8 bytes: stays resident
    x = torch.randn(4, 16, 32, generator=g, dtype=torch.float64, requires_grad=True)
    return [W1, W2, b], scale, x


def toy_loss(x, W1, W2, b, scale):
    """The toy model's loss; what each operation saves for backward is said beside it.

    Args:
        x, W1, W2, b, scale: ``toy_params``'s tensors.

    Returns:
        The scalar loss.

    Example:
        >>> (W1, W2, b), scale, x = toy_params(0)
        >>> toy_loss(x, W1, W2, b, scale).shape
        torch.Size([])
    """
    h = x @ W1  # (B, T, 128); saves x and W1
    a, gate = h.chunk(2, -1)  # two views of h's storage
    y = torch.sigmoid(a) * gate  # sigmoid saves its output; mul saves it and `gate`, a view of h
    z = (y @ W2 + b).tanh() * scale  # saves y, W2, tanh's output, scale
    return z.pow(2).sum()  # saves z


def saved_storages(seed):
    """The distinct non-parameter storages one toy forward saves, in the order autograd saves them, and the bytes
    of every saved tensor's storage (views and repeats counted each time).

    Args:
        seed: ``toy_params``'s seed.

    Returns:
        ([nbytes of each distinct storage, in order], [nbytes of each saved tensor's storage]).

    Example:
        >>> len(saved_storages(0)[0]) > 3
        True
    """
    params, scale, x = toy_params(seed)
    ptrs, order, kept, per = {p.untyped_storage().data_ptr() for p in params}, {}, [], []

    def pack(t):
        st = t.untyped_storage()
        kept.append(t)  # alive: no address is reused while counting
        if st.data_ptr() not in ptrs:
            order.setdefault(st.data_ptr(), st.nbytes())
            per.append(st.nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        toy_loss(x, *params, scale)
    return list(order.values()), per


def toy_step(make, seed, as_generator):
    """One toy forward under ``make(params)``'s hooks, then two backwards (a retained graph's second one).

    Args:
        make: params -> the hooks object.
        seed: ``toy_params``'s seed.
        as_generator: the parameters given as a generator (iterable once) rather than a list.

    Returns:
        (the hooks object, the first backward's gradients, the second's).

    Example:
        >>> _, first, second = toy_step(lambda p: torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t),
        ...                             0, False)
        >>> all(torch.equal(a, b) for a, b in zip(first, second))
        True
    """
    params, scale, x = toy_params(seed)
    leaves = [x, *params, scale]
    hooks = make((p for p in params) if as_generator else params)
    with hooks:
        loss = toy_loss(x, *params, scale)
    first = torch.autograd.grad(loss, leaves, retain_graph=True)
    return hooks, list(first), list(torch.autograd.grad(loss, leaves))


def plain_grads(seed):
    """The toy loss's gradients by plain float64 autograd (dx, dW1, dW2, db, dscale).

    Args:
        seed: ``toy_params``'s seed.

    Returns:
        a list of five tensors.

    Example:
        >>> len(plain_grads(0))
        5
    """
    params, scale, x = toy_params(seed)
    return list(torch.autograd.grad(toy_loss(x, *params, scale), [x, *params, scale]))


def within(value, lo, hi=None) -> str:
    """``value`` in words against a range: ``"within [lo, hi]"`` when inside, else the value itself.

    Args:
        value: the observed count.
        lo, hi: the range (hi None: no upper bound).

    Returns:
        a str, the same for every value inside.

    Example:
        >>> within(5, 2, 8), within(9, 2, 8), within(3, 2)
        ('within [2, 8]', '9', 'at least 2')
    """
    inside = type(value) is int and lo <= value and (hi is None or value <= hi)
    return (f"within [{lo}, {hi}]" if hi is not None else f"at least {lo}") if inside else f"{value!r}"


def _clear_hooks():
    """Pop saved-tensor hooks a wrong solution left installed: they must not leak into the next check."""
    while torch._C._autograd._top_saved_tensors_default_hooks(True) is not None:
        torch._C._autograd._pop_saved_tensors_default_hooks()


def lifecycle(make, t, fn: str) -> dict:
    """What a reader sees of a hooks object's life: ``pack`` on ``t``, two instances side by side, two forwards
    under one instance, a ``with`` block whose body raises, a forward after it.

    Args:
        make: params -> a fresh hooks object (the class under its documented threshold or budget).
        t: a float64 tensor of 32 KiB (pack must leave it as it was).
        fn: the class's name, for the message.

    Returns:
        {what, in words: the value seen}; ``lifecycle_ref`` gives what the docstring promises.

    Example:
        >>> class Keep(torch.autograd.graph.saved_tensors_hooks):  # moves nothing, counts nothing
        ...     def __init__(self, params):
        ...         self.d2h_bytes = self.h2d_bytes = 0
        ...         super().__init__(self.pack, lambda t: t)
        ...     def pack(self, t):
        ...         return t
        >>> lifecycle(Keep, torch.zeros(4096, dtype=torch.float64), "Keep")["d2h_bytes after two forwards"]
        0
    """
    try:
        before = t.clone()
        make([]).pack(t)
        if change := max_change(before, t):  # (the engine sees it after the whole run: the forward would fail first)
            raise CheckFailed(f"{fn}: pack modified its tensor in place (given['t'] was modified in place, max change "
                              f"{change:.2g}; the forward still reads it) at a fresh 32 KiB float64 tensor")
        a, b = make([]), make([])
        u = torch.randn(64, 64, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
        a.pack(u), b.pack(u)
        obs = {"d2h_bytes of two instances that each packed one 32 KiB storage": [a.d2h_bytes, b.d2h_bytes]}
        params, scale, x = toy_params(4)
        hooks, once = make(params), make(params)
        for h in (hooks, hooks, once):
            with h:
                loss = toy_loss(x, *params, scale)
            loss.backward()
        obs["the counters' types"] = [type(hooks.d2h_bytes).__name__, type(hooks.h2d_bytes).__name__]
        obs["d2h_bytes after two forwards"] = hooks.d2h_bytes
        twice = hooks.h2d_bytes == 2 * once.h2d_bytes
        obs["h2d_bytes after two forwards"] = "twice one forward's" if twice else (
            f"{hooks.h2d_bytes!r}, one forward of a fresh instance: {once.h2d_bytes!r}")
        before = hooks.d2h_bytes
        try:
            with hooks:
                raise KeyError("the forward failed")
        except KeyError:
            obs["what comes out of a with block whose body raises KeyError"] = "KeyError"
        except Exception as e:  # noqa: BLE001 (the learner's code may raise anything)
            obs["what comes out of a with block whose body raises KeyError"] = type(e).__name__
        else:
            obs["what comes out of a with block whose body raises KeyError"] = "nothing: it was swallowed"
        toy_loss(x, *params, scale).backward()  # outside any with block: plain autograd
        obs["d2h_bytes moved by a forward after the with block (its hooks removed on exit)"] = hooks.d2h_bytes - before
        return obs
    finally:
        _clear_hooks()


def lifecycle_ref(one_forward: int) -> dict:
    """What ``lifecycle`` must see, for a class whose one toy forward moves ``one_forward`` bytes.

    Args:
        one_forward: the bytes one toy forward moves, counted independently.

    Returns:
        the observations a right solution gives.

    Example:
        >>> lifecycle_ref(10)["d2h_bytes after two forwards"]
        20
    """
    return {"d2h_bytes of two instances that each packed one 32 KiB storage": [32768, 32768],
            "the counters' types": ["int", "int"], "d2h_bytes after two forwards": 2 * one_forward,
            "h2d_bytes after two forwards": "twice one forward's",
            "what comes out of a with block whose body raises KeyError": "KeyError",
            "d2h_bytes moved by a forward after the with block (its hooks removed on exit)": 0}


def scenarios(table) -> dict:
    """The ``use`` and ``ref`` of a class graded by scenarios: ``table`` maps a scenario's name to (its driver
    ``(cls, **given) -> observations``, its reference ``(**given) -> observations``).

    Args:
        table: {scenario: (driver, reference)}.

    Returns:
        the Contract keyword arguments ``use`` and ``ref`` (inputs: ``{"scenario": name, "given": {...}}``).

    Example:
        >>> k = scenarios({"s": (lambda cls, n: cls(n), lambda n: n)})
        >>> k["use"](str)("s", {"n": 3}), k["ref"]("s", {"n": 3})
        ('3', (3,))
    """
    return {"use": lambda cls: lambda scenario, given: table[scenario][0](cls, **given),
            "ref": lambda scenario, given: (table[scenario][1](**given),)}


def measured_d2h_bytes(batch, seq, width, expansion, layers, min_bytes, element_bytes) -> int:
    """The D2H bytes the package's ``ActivationOffload`` moves in one forward of the exercise's MLP stack.

    Args:
        batch, seq, width, expansion, layers, min_bytes: the workload of ``predict_d2h_bytes``.
        element_bytes: 4 (float32) or 8 (float64).

    Returns:
        the bytes its hooks count, an int.

    Example:
        >>> measured_d2h_bytes(1, 1, 2, 1, 1, 10**6, 4)
        0
    """
    dtype = {4: torch.float32, 8: torch.float64}[element_bytes]
    g = torch.Generator().manual_seed(batch * 100 + width)
    stack = nn.ModuleList(nn.Sequential(nn.Linear(width, expansion * width), nn.SiLU(),
                                        nn.Linear(expansion * width, width)) for _ in range(layers)).to(dtype)
    x = torch.randn(batch, seq, width, generator=g, dtype=dtype, requires_grad=True)
    hooks = ActivationOffload(list(stack.parameters()), OffloadConfig(min_bytes=min_bytes), device="cpu")
    with hooks:
        h = x
        for layer in stack:
            h = layer(h)
    h.sum().backward()
    return hooks.d2h_bytes


PREDICT = Contract(  # below, at and above the threshold; the last two: a block input of 96 B above it, an inner
    # tensor of 288 B at it, and sizes whose bits overlap (96 + 576 is not 96 | 576)
    "predict_d2h_bytes", lambda c: dict(zip(("batch", "seq", "width", "expansion", "layers", "min_bytes",
                                             "element_bytes"), c["args"])),
    lambda **a: (measured_d2h_bytes(**a),), ("the prediction",), returns=int,
    ref_name="the offload hooks' count", note=lambda c: "exact: the hooks count bytes",
    examples={"": [{"args": a} for a in ((2, 3, 4, 4, 3, 256, 4), (1, 5, 8, 2, 4, 400, 8), (2, 2, 4, 3, 2, 64, 4),
                                         (2, 4, 4, 2, 3, 128, 4), (1, 2, 4, 2, 2, 10**6, 4), (2, 3, 4, 3, 2, 64, 4),
                                         (1, 3, 4, 3, 2, 288, 8))]})
