"""``bp-mech plan --ask``: the plan, then the next questions in the same process.

An engineer asks a planner the same question again and again with one thing changed ("and with batch 8?
and with LoRA?"). Each ``bp-mech plan`` pays the interpreter's start and the imports of PyTorch and
Transformers first, over two seconds on two cores, more than the plan of a small model takes. With
``--ask`` the command stays, prompts on stderr (stdout holds the plans alone, so ``--json`` stays JSON)
and answers each line as ``bp-mech plan`` would answer the flags it names:

    $ bp-mech plan --workload qwen05-b2s512 --budget 16GiB --ask
    ...the plan...
    plan> --batch 8
    ...the plan at batch 8, the other flags as before...
    plan> --lora-rank 16 --dtype bf16
    plan> plan --config my/config.json --batch 1 --seq 4096 --budget 80GiB
    plan> quit

A line of flags changes the last question (a flag given again takes its new value; one without a value, such
as ``--keep-outputs``, stays given); a line that starts with ``plan`` asks a new one (also the way from a
``--workload`` to a ``--config``); an empty line, ``quit``, Ctrl-C at the prompt or the end of the input ends
the session. A question with bad input (or ``--help``) prints its one line (its help) and is forgotten: the
next line changes the question before it. Each question is echoed on stderr as the one command that asks it
alone (``merged``). At a terminal the line is read with line editing and history.
"""

from __future__ import annotations

import shlex
import sys
from typing import Callable, TextIO

PROMPT = "plan> "
HELP = ("next question: flags that change the last one (e.g. --batch 8, --lora-rank 16, --gpus 8 --shard fsdp2), "
        "'plan FLAGS' for a new one, an empty line or 'quit' to stop")
BAD_INPUT = 2  # the command's exit status for bad input (its one line is printed on stderr)
STOP = ("", "q", "quit", "exit")
ASK = "--ask"  # the flag that opens a session (left out of the questions asked in it)


def follow_up(flags: list[str], line: str) -> list[str]:
    """The flags of the question ``line`` asks after the one whose flags are ``flags``.

    Args:
        flags: the last question's flags (``bp-mech plan``'s, without the word ``plan``).
        line: the next question: flags that change the last one's (``merged``), or ``plan`` and a whole new
            question's flags; shell quoting as in a shell (``--freeze 'embed|lm_head'``).

    Returns:
        The new question's flags.

    Raises:
        ValueError: quotes that do not close.

    Example:
        >>> follow_up(["--workload", "tiny-b2s64", "--budget", "1GiB", "--batch", "4"], "--batch 8")
        ['--workload', 'tiny-b2s64', '--budget', '1GiB', '--batch', '8']
        >>> follow_up(["--workload", "tiny-b2s64", "--budget", "1GiB"], "plan --config c.json --budget 8GiB")
        ['--config', 'c.json', '--budget', '8GiB']
    """
    words = [w for w in shlex.split(line) if w != ASK]  # (a session is already open)
    return words[1:] if words[:1] == ["plan"] else merged(flags, words)


def merged(flags: list[str], words: list[str]) -> list[str]:
    """``flags`` changed by ``words``: of each option (``--name value``, ``--name=value`` or a switch ``--name``)
    given more than once in ``[*flags, *words]``, only the last, where it stands. The command reads the result as
    it reads ``[*flags, *words]``, in which the later value wins (an abbreviated option, another name, keeps its
    place among them). The result is the question as one command to copy.

    Example:
        >>> merged(["--workload", "w", "--batch", "4", "--keep-outputs"], ["--batch=8", "--keep-outputs", "--json"])
        ['--workload', 'w', '--batch=8', '--keep-outputs', '--json']
    """
    parts, i, ws = [], 0, [*flags, *words]
    while i < len(ws):  # (name, its words): an option and its value, a switch, or a word on its own (no name)
        takes = ws[i].startswith("--") and "=" not in ws[i] and i + 1 < len(ws) and not ws[i + 1].startswith("--")
        parts.append((ws[i].split("=")[0] if ws[i].startswith("--") else None, ws[i:i + 1 + takes]))
        i += 1 + takes
    last = {name: k for k, (name, _) in enumerate(parts) if name is not None}
    return [w for k, (name, part) in enumerate(parts) if name is None or last[name] == k for w in part]


def terminal_line(prompt: str) -> str:
    """The next line a person types at a terminal, after ``prompt``, with line editing and the session's history
    (the up arrow brings the last question back to change it); ``""`` at the end of the input (Ctrl-D)."""
    import readline  # noqa: F401 (imported, it gives ``input`` its editing and history)

    try:
        return input(prompt) + "\n"
    except EOFError:
        return ""


def session(flags: list[str], answer: Callable[[list[str]], int], status: int,
            read: Callable[[], str] | None = None, err: TextIO | None = None) -> int:
    """Ask the questions ``read`` gives after the one of ``flags``, until an empty line, ``quit`` or the end.

    Args:
        flags: the first question's flags (answered already, with ``status``).
        answer: ``bp-mech plan`` on a question's flags: prints the plan and returns its exit status (``BAD_INPUT``
            after printing its one line for bad input).
        status: the first question's exit status.
        read: the next line (``""`` at the end of the input; None: standard input's, through ``terminal_line``
            where both standard input and output are a terminal, so the prompt is written there).
        err: where the prompt, the help and the unreadable lines go (None: standard error).

    Returns:
        The exit status of the last question answered (bad input aside: such a question is forgotten).
    """
    err, flags = err or sys.stderr, [w for w in flags if w != ASK]
    if read is None and sys.stdin.isatty() and sys.stdout.isatty():
        line_after = terminal_line
    else:
        def line_after(prompt: str) -> str:  # the prompt on stderr, where the progress bars are
            err.write(prompt)
            err.flush()
            return (read or sys.stdin.readline)()
    print(HELP, file=err)
    while True:
        sys.stdout.flush()  # the last plan before the prompt, where stdout is a pipe
        try:
            line = line_after(PROMPT)
        except KeyboardInterrupt:  # Ctrl-C at the prompt ends the session as quit would
            print(file=err)
            return status
        if line.strip().lower() in STOP:
            return status
        if line.strip().lower() in ("?", "help"):
            print(HELP, file=err)
            continue
        try:
            asked = follow_up(flags, line)
        except ValueError as e:  # (shlex: "No closing quotation")
            print(f"bp-mech: error: {e}", file=err)
            continue
        print(f"bp-mech plan {shlex.join(asked)}", file=err)  # the question asked, as one command to copy
        try:
            s = answer(asked)
        except SystemExit as e:  # --help: printed; the question is forgotten, as bad input is
            if e.code not in (0, None):
                raise
            continue
        if s != BAD_INPUT:
            flags, status = asked, s
