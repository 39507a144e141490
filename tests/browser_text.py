"""What the browser test reads in a page's text (tests/test_browser.py, run by ``browser_pages.open_page``
after the layout audit): broken formulas, paragraphs that break off, code lines wider than the column.

* ``math_errors``: formulas MathJax could not typeset (its error nodes, ``merror``) and undefined
  macros (MathJax's ``noundefined`` shows ``\\foo`` in red instead of failing), read from MathJax's
  own list of the formulas it typeset and their trees.
* ``broken_math``: a formula whose TeX holds a control character (a tab, a carriage return, a form
  feed, a backspace ...) or a stray ``ext{``, ``rac{``, ``ight``, ``eft``: what ``\\text``, ``\\frac``,
  ``\\right``, ``\\left`` become when ``\\t``, ``\\f``, ``\\r``, ``\\b`` are escapes of a non-raw Python
  string (the HTML parser turns a carriage return into a line break; the fragment still shows it).
* ``unterminated``: a paragraph of the main text (an admonition's body included) that does not end
  with terminal punctuation (``.``, ``:``, ``?``, ``!``, perhaps followed by closing brackets or
  quotes), unless its sentence runs on into a display formula (of more than a symbol or two).
  Not paragraphs: list items, definition terms, table cells, captions, titles of admonitions and
  sidebars, rubrics, headings, cell outputs (what the code printed), navigation.
* ``raw_markdown``: a paragraph, in the text or in a cell's output, that shows a Markdown table's
  syntax (``| a | b |`` then ``|---|``): the table did not render (a ``|`` inside a cell).
* ``long_code_lines``: a line of code shown to readers (a code cell's input, shown or folded
  behind a toggle; a literalinclude; a code block) longer than ``MAX_CODE_LINE`` characters.
  Outputs are not code the reader reads as source; removed inputs are not in the page.
"""

MAX_CODE_LINE = 88  # characters (black's line length); at browser_pages.WINDOW the code box shows about 76

TEXT_AUDIT = r"""
const maxLine = arguments[0];
const col = document.querySelector('article.bd-article') || document.querySelector('main');
const out = {math_errors: [], broken_math: [], unterminated: [], raw_markdown: [], long_code_lines: []};
const clip = (s, n) => s.length > n ? s.slice(0, n) + '…' : s;

// --- formulas: MathJax's list of what it typeset, with the TeX source and the tree of each ---
const doc = window.MathJax && MathJax.startup && MathJax.startup.document;
const items = doc && doc.math ? Array.from(doc.math).filter(i => i.typesetRoot && col.contains(i.typesetRoot)) : [];
const source = new Map(items.map(i => [i.typesetRoot, i.math]));
const CONTROL = /[\u0000-\u0009\u000b-\u001f\u007f]/;   // every control character but the line feed
const FRAGMENT = /(?<![A-Za-z\\])(?:ext\{|rac\{|ight|eft)/;  // \text, \frac, \right, \left without \t \f \r \b
for (const item of items) {
  const tex = item.math;  // shown with its control characters named: g_<U+0009>ext{...}
  const shown = '"' + clip(tex.replace(/[\u0000-\u001f\u007f]/g,
      c => c === '\n' ? ' ' : `<U+${c.charCodeAt(0).toString(16).toUpperCase().padStart(4, '0')}>`), 100) + '"';
  if (CONTROL.test(tex)) out.broken_math.push('control character in ' + shown);
  else if (FRAGMENT.test(tex)) out.broken_math.push(`stray "${tex.match(FRAGMENT)[0]}" in ` + shown);
  if (!item.root) continue;
  item.root.walkTree(node => {
    if (node.isKind('merror'))
      out.math_errors.push((node.attributes.get('data-mjx-error') || 'error') + ' in ' + shown);
    else if (node.isKind('mtext') && node.attributes.getExplicit('mathcolor') === 'red') {
      const text = node.childNodes.map(c => c.getText ? c.getText() : '').join('');
      if (text.startsWith('\\')) out.math_errors.push(`undefined ${text} in ` + shown);
    }
  });
}
for (const e of col.querySelectorAll('mjx-merror'))   // an error node outside the list, all the same
  if (!items.some(i => i.typesetRoot.contains(e))) out.math_errors.push(e.getAttribute('data-mjx-error') || e.textContent);

// --- paragraphs of the main text that break off -----------------------------------------------
const NOT_BODY = 'li, dt, table, figure, figcaption, .caption, .admonition-title, .sidebar-title, .topic-title, ' +
                 '.rubric, .cell_output, nav, footer, .prev-next-area, .toctree-wrapper, header, summary';
const END = /[.:?!…]["'”’»)\]]*$/;
function display(p) {   // the display formula this paragraph runs into, if any: its TeX
  let next = p.nextElementSibling;
  while (next && next.tagName === 'SPAN' && !next.textContent.trim()) next = next.nextElementSibling;  // equation targets
  const m = next && next.matches('div.math') && next.querySelector('mjx-container');
  return m ? (source.get(m) || '') : null;
}
for (const p of col.querySelectorAll('p')) {
  if (p.closest(NOT_BODY)) continue;
  const formula = display(p);   // a sentence may run on into a display formula, not into one symbol
  if (formula !== null && formula.replace(/\s+/g, '').length > 2) continue;
  const copy = p.cloneNode(true);
  for (const a of copy.querySelectorAll('.headerlink')) a.remove();
  const live = [...p.querySelectorAll('mjx-container')], copies = [...copy.querySelectorAll('mjx-container')];
  copies.forEach((m, k) => m.replaceWith(document.createTextNode(source.get(live[k]) || 'x')));  // a formula: its TeX
  const text = copy.textContent.replace(/\s+/g, ' ').trim();
  if (text && !END.test(text)) out.unterminated.push('…' + text.slice(-80));
}

// a Markdown table that did not render (a stray "|" in a cell splits its columns): shown as a paragraph
for (const p of col.querySelectorAll('p'))
  if (!p.closest('table, pre') && /\|\s*[-—–:]{1,}[-—–:\s]*\|/.test(p.textContent) && /^\s*\|/.test(p.textContent))
    out.raw_markdown.push(clip(p.textContent.replace(/\s+/g, ' ').trim(), 100));

// --- code shown to readers that does not fit the column ---------------------------------------
for (const pre of col.querySelectorAll('pre')) {
  if (pre.closest('.cell_output')) continue;
  for (const line of pre.textContent.split('\n'))
    if (line.trimEnd().length > maxLine) out.long_code_lines.push(`${line.trimEnd().length} > ${maxLine}: ${clip(line.trim(), 70)}`);
}
return out;
"""
