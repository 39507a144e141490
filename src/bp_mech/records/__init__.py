"""The record keeping: what a run leaves behind and how the book trusts it.

``results`` (the ``Record``, its JSON schema, save/load/validate), ``provenance`` (the code hash of an
experiment and the modules it imports, the commit, staleness), ``environment`` (the machine and its
packages), ``references`` (the figures of the course's reference run, RTX 5070 Ti and
Qwen2.5-0.5B, by strategy), ``registry`` (every experiment's ID, chapter and module;
``make_context``, ``run``, ``dry_run``, ``chapter_map``).
"""
