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
* **True headers.** A chapter's header line is the directive ``{experiment-header} <ID>`` (the
  ID, the fixed comparison and the main metrics from ``bp_mech.records.registry``, and the evidence
  ``registry.status`` computes from the cached records); the role ``{evidence}`ID``` is that evidence
  alone. Pages that use either are read again on every build (cheap: the notebook cache still
  spares the execution), so the evidence follows the records, not the page's text.
* **A clean console.** Each script once on a page (see ``drop_duplicate_scripts``).
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

from docutils import nodes
from sphinx import addnodes
from sphinx.application import Sphinx
from sphinx.errors import ExtensionError
from sphinx.util.docutils import SphinxDirective, SphinxRole
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


COMPUTED = re.compile(r"\{(experiment-header|evidence)\}")  # the directive and the role below


def uses_registry(path: Path) -> bool:
    """Does this page's header (or text) compute from the registry (``{experiment-header}``, ``{evidence}``)?"""
    return path.suffix == ".md" and bool(COMPUTED.search(path.read_text(encoding="utf-8")))


def always_read(app: Sphinx, env, added, changed, removed) -> list[str]:
    """Sphinx re-reads only pages whose text changed; these compute from other files (the records,
    the code). Re-reading a page whose code cells did not change takes its outputs from the
    notebook cache: nothing runs again."""
    return [doc for doc in env.found_docs
            if forces_execution(Path(env.doc2path(doc))) or uses_registry(Path(env.doc2path(doc)))]


# --- the header line, from the registry -------------------------------------------------------

def experiment_fields(app: Sphinx, semantic_id: str) -> tuple:
    """(registry.Experiment, its status) with the records of ``bp_book_results_dir`` (default
    ``bp_mech.RESULTS_DIR``). Raises ``RegistryError`` for an unknown ID."""
    from bp_mech import RESULTS_DIR, ROOT
    from bp_mech.records import registry

    e = registry.get(semantic_id)
    results_dir = Path(app.config.bp_book_results_dir or RESULTS_DIR)
    return e, registry.status(e, ROOT, results_dir)


def evidence_node(status: str) -> nodes.inline:
    return nodes.inline(status, status, classes=["evidence"])


class ExperimentHeader(SphinxDirective):
    """``{experiment-header} TRAIN-CHECKPOINT``: the chapter's header line, **ID** · fixed
    comparison (``project:`` on a project page) · main metrics · evidence, all from the registry."""

    required_arguments = 1
    has_content = False

    def run(self) -> list[nodes.Node]:
        try:
            e, status = experiment_fields(self.env.app, self.arguments[0])
        except ValueError as err:  # registry.RegistryError
            raise self.error(f"experiment-header: {err}") from None
        what = "project" if e.doc.startswith("book/projects/") else "fixed comparison"
        para = nodes.paragraph(classes=["experiment-header"])
        para += nodes.strong(e.semantic_id, e.semantic_id)
        para += nodes.Text(f" · {what}: {e.comparison} · main metrics: {e.metrics} · ")
        label = nodes.inline("evidence", "evidence")
        target = self.config.bp_book_evidence_doc
        if target and target in self.env.found_docs:  # where the status is computed and explained
            ref = addnodes.pending_xref("", refdomain="std", reftype="doc", reftarget="/" + target,
                                        refexplicit=True, refwarn=True, refdoc=self.env.docname)
            ref += label
            label = ref
        para += label
        para += nodes.Text(": ")
        para += evidence_node(status)
        para += nodes.Text(".")
        self.set_source_info(para)
        return [para]


class Evidence(SphinxRole):
    """``{evidence}`TRAIN-CHECKPOINT```: the experiment's evidence, as ``registry.status`` computes it."""

    def run(self) -> tuple[list[nodes.Node], list[nodes.system_message]]:
        try:
            _, status = experiment_fields(self.env.app, self.text.strip())
        except ValueError as err:
            msg = self.inliner.reporter.error(f"evidence: {err}", line=self.lineno)
            return [self.inliner.problematic(self.rawtext, self.rawtext, msg)], [msg]
        return [evidence_node(status)], []


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


# Two extensions jupyter-book loads declare nothing about parallel reading, so Sphinx would read one page at a time
# (and warn): sphinx_jupyterbook_latex (its transforms edit each page's own doctree; the rest acts for LaTeX builds
# only) and sphinx_multitoc_numbering (it numbers sections in the main process, after every page is read). Both are
# safe to read side by side; ``tools/book_build.py`` asks for two pages at a time.
PROSE_WORDS = 4  # a glued text of this many words or more is a phrase the code chose, not a value


def unbold_glued_prose(app: Sphinx, doctree, docname: str) -> None:
    """MyST-NB sets every glued text in bold (``span.pasted-text``): right for a measured value, wrong for a
    sentence chosen from the run. Such a span gets the class ``pasted-prose`` (bp-book.css: normal weight)."""
    for node in doctree.findall(nodes.inline):
        if "pasted-text" in node["classes"] and len(node.astext().split()) >= PROSE_WORDS:
            node["classes"].append("pasted-prose")


PARALLEL_SAFE = ("sphinx_jupyterbook_latex", "sphinx_multitoc_numbering")


def declare_parallel_safe(app: Sphinx) -> None:
    """Mark ``PARALLEL_SAFE``'s extensions as safe to read pages in parallel (``builder-inited``)."""
    for name in PARALLEL_SAFE:
        ext = app.extensions.get(name)
        if ext is not None and ext.parallel_read_safe is None:
            ext.parallel_read_safe = True


def setup(app: Sphinx) -> dict:
    app.add_config_value("bp_book_results_dir", None, "env")  # the records the evidence reads (None: bp_mech.RESULTS_DIR)
    app.add_config_value("bp_book_evidence_doc", "book/registry", "env")  # "evidence" links there, when built
    app.add_directive("experiment-header", ExperimentHeader)
    app.add_role("evidence", Evidence())
    app.connect("config-inited", use_local_mathjax)
    app.connect("builder-inited", declare_parallel_safe)
    app.connect("html-page-context", drop_duplicate_scripts)
    app.connect("build-finished", copy_mathjax)
    app.connect("doctree-resolved", unbold_glued_prose)
    app.connect("env-get-outdated", always_read)
    app.connect("html-page-context", offer_notebook, priority=400)
    return {"version": "1.0", "parallel_read_safe": True, "parallel_write_safe": True}
