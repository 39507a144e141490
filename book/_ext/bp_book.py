"""The book's own Sphinx glue, loaded by ``_config.yml`` (``sphinx.local_extensions``).

* **Math offline.** MathJax 3 comes from the ``sphinx-mathjax-offline`` package (PyPI,
  requirements/book.txt) and is copied into ``_build/html/_static/mathjax``; pages load it from
  there, so formulas typeset with no network (no CDN at read time).
* **Computed pages stay computed.** A page whose front matter asks for
  ``mystnb: execution_mode: force`` (the landing map, the registry: they read the records and the
  code) is read and executed on every build, also when its own text has not changed.
* **Notebooks to take away.** MyST-NB writes each executed chapter to
  ``_build/jupyter_execute/<page>.ipynb``; it is copied to ``_build/html/_sources/<page>.ipynb``
  and the theme's download button (the ``.ipynb`` entry) links to it.
* **A clean console.** Each script once on a page (see ``drop_duplicate_scripts``).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from sphinx.application import Sphinx
from sphinx.errors import ExtensionError
from sphinx.util.fileutil import copy_asset

MATHJAX_ENTRY = "mathjax/tex-chtml.js"  # MathJax 3 component: TeX input (with AMS) -> CommonHTML output


def mathjax_source() -> Path:
    """The MathJax 3 tree shipped by ``sphinx-mathjax-offline`` (its module name has dashes)."""
    spec = importlib.util.find_spec("sphinx-mathjax-offline")
    if spec is None or spec.origin is None:
        raise ExtensionError("bp_book: the offline MathJax is missing; pip install -r requirements/book.txt "
                             "(package sphinx-mathjax-offline)")
    source = Path(spec.origin).parent / "static" / "mathjax"
    if not (source / "tex-chtml.js").is_file():
        raise ExtensionError(f"bp_book: {source / 'tex-chtml.js'} is missing from sphinx-mathjax-offline")
    return source


def use_local_mathjax(app: Sphinx, config) -> None:
    mathjax_source()  # fail at the start of the build, not after it
    config.mathjax_path = MATHJAX_ENTRY  # relative: served from _static/


def copy_mathjax(app: Sphinx, exc: Exception | None) -> None:
    if exc is None and app.builder.format == "html":
        copy_asset(str(mathjax_source()), str(Path(app.outdir) / "_static" / "mathjax"))


def forces_execution(path: Path) -> bool:
    """Does this MyST notebook's front matter say ``mystnb: execution_mode: force``?"""
    import yaml

    if path.suffix != ".md":
        return False
    text = path.read_text(encoding="utf-8")
    if not text.startswith("---\n") or "\n---" not in text[4:]:
        return False
    front = yaml.safe_load(text[4:text.index("\n---", 4)]) or {}
    return (front.get("mystnb") or {}).get("execution_mode") == "force"


def always_read(app: Sphinx, env, added, changed, removed) -> list[str]:
    """Sphinx re-reads only pages whose text changed; these compute from other files."""
    return [doc for doc in env.found_docs if forces_execution(Path(env.doc2path(doc)))]


def executed_notebook(app: Sphinx, pagename: str) -> Path | None:
    config = getattr(app.env, "mystnb_config", None)
    folder = Path(config.output_folder) if config is not None else Path(app.outdir).parent / "jupyter_execute"
    path = folder / f"{pagename}.ipynb"
    return path if path.is_file() else None


def with_outputs(app: Sphinx, path: Path):
    """The executed notebook at ``path``. Where MyST-NB took a page from its execution cache it
    writes the notebook *without* the cached outputs (it merges them into a copy it renders from),
    so those are merged back from the same cache here."""
    import nbformat

    nb = nbformat.read(path, as_version=4)
    config = getattr(app.env, "mystnb_config", None)
    if any(c.get("outputs") for c in nb.cells if c.cell_type == "code"):
        return nb
    if config is None or config.execution_mode != "cache" or not config.execution_cache_path:
        return nb
    from jupyter_cache import get_cache

    try:
        _, nb = get_cache(config.execution_cache_path).merge_match_into_notebook(nb)
    except KeyError:  # not in the cache: the page was not executed
        pass
    return nb


def offer_notebook(app: Sphinx, pagename: str, templatename: str, context: dict, doctree) -> None:
    """Before the theme builds its header buttons (priority 501): put the executed notebook in
    ``_sources`` and name it, so the download button offers ``.ipynb``."""
    import nbformat

    notebook = executed_notebook(app, pagename)
    if notebook is None or app.builder.format != "html":
        return
    target = Path(app.outdir) / "_sources" / f"{pagename}.ipynb"
    target.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(with_outputs(app, notebook), target)
    context["ipynb_source"] = f"{pagename}.ipynb"


def drop_duplicate_scripts(app: Sphinx, pagename: str, templatename: str, context: dict, doctree) -> None:
    """Each script once. Inline scripts added while the docs are read (sphinx-thebe's
    ``const THEBE_JS_URL = ...``, togglebutton's selector) reach the page twice, once with the file
    name None and once with ""; the second ``const`` is a SyntaxError in the reader's console."""
    scripts = context.get("script_files")
    if not isinstance(scripts, list):
        return
    seen, kept = set(), []
    for js in scripts:
        key = (getattr(js, "filename", js) or "", tuple(sorted(getattr(js, "attributes", {}).items())))
        if key not in seen:
            seen.add(key)
            kept.append(js)
    scripts[:] = kept


def setup(app: Sphinx) -> dict:
    app.connect("config-inited", use_local_mathjax)
    app.connect("html-page-context", drop_duplicate_scripts)
    app.connect("build-finished", copy_mathjax)
    app.connect("env-get-outdated", always_read)
    app.connect("html-page-context", offer_notebook, priority=400)
    return {"version": "1.0", "parallel_read_safe": True, "parallel_write_safe": True}
