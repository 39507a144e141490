// The book's memory calculator (book/appendix/memory-calculator.md): reads the traced points the page
// embeds (bp_mech.book.calculator_page.page_data) and shows, for the point and budget the reader picks,
// each strategy's peak, what it needs, whether it fits, and the plan's pick (bp_mech.planner.plan.recommend,
// ported below). Bytes are integers below 2**53, exact in a JS number; a budget is whole GiB.
(function () {
  "use strict";
  const data = JSON.parse(document.getElementById("bp-calc-data").textContent);
  const form = document.getElementById("bp-calc-form");
  const GiB = 1073741824;
  const field = (name) => form.elements[name];

  function options(select, values, labels) {
    const keep = select.value;
    select.textContent = "";
    values.forEach((v, i) => {
      const o = document.createElement("option");
      o.value = String(v);
      o.textContent = labels ? labels[i] : String(v);
      select.appendChild(o);
    });
    if (values.map(String).includes(keep)) select.value = keep;
  }

  // plan.recommend: of the rows that fit, the least counted extra time; ties go to float32, then to fewer
  // mechanisms, then to the lower peak; the first such row in the plan's order
  function key(r) { return [r.extra, r.keepsFloat32 ? 0 : 1, r.mechanisms, r.peak]; }
  function less(a, b) {
    for (let i = 0; i < a.length; i++) if (a[i] !== b[i]) return a[i] < b[i];
    return false;
  }
  function recommend(rows, budget) {
    let best = null;
    for (const r of rows) {
      if (r.needs <= budget && (best === null || less(key(r), key(best)))) best = r;
    }
    return best === null ? null : best.strategy;
  }

  // the table's unit: GiB, MiB or KiB, whichever the largest need asks for (planner.report's rule)
  function unit(rows) {
    const top = Math.max(0, ...rows.map((r) => r.needs));
    return top >= GiB ? [GiB, "GiB"] : top >= 1048576 ? [1048576, "MiB"] : [1024, "KiB"];
  }
  function grouped(n) { return n.toLocaleString("en-US"); }

  // the bp-mech plan command of a point (a public model: its config.json, planner.shapes.SHAPES' fields)
  function command(f, budget) {
    const src = data.workloads.includes(f.model) ? "--workload " + f.model + "-b" + f.batch + "s" + f.seq :
      "--config " + f.model + "/config.json --batch " + f.batch + " --seq " + f.seq;
    const lines = ["bp-mech plan " + src, "--budget " + budget / GiB + "GiB"];
    if (f.mode !== "full") lines[1] += " --dtype bf16";
    if (f.mode === "lora") lines[1] += " --lora-rank " + data.loraRank;
    lines.push((f.gpus !== "1" ? "--gpus " + f.gpus + " --shard fsdp2 " : "") + "--strategies $S");
    const half = Math.ceil(data.strategies.length / 2);
    return "S=" + data.strategies.slice(0, half).join(",") + "\nS=$S," + data.strategies.slice(half).join(",") +
      "\n" + lines.join(" \\\n    ");
  }

  function rowsOf(point) {
    return (data.points[point] || []).map((r) => ({
      strategy: r[0], peak: r[1], needs: r[2], extra: r[3], keepsFloat32: r[4], mechanisms: r[5],
    }));
  }
  // the pick at any point and budget in bytes (the browser test asks it at every point's thresholds)
  window.bpCalcPick = (point, budget) => recommend(rowsOf(point), budget);

  function show() {
    if (form.dataset.model !== field("model").value) {  // the model's own GPUs, sequences and batches
      const m = data.models[field("model").value];
      options(field("gpus"), m.gpus);
      options(field("seq"), m.seqs);
      options(field("batch"), m.batches);
      form.dataset.model = field("model").value;
    }
    const f = {};
    for (const k of ["model", "mode", "gpus", "seq", "batch"]) f[k] = field(k).value;
    const point = [f.model, f.mode, f.gpus, f.seq, f.batch].join("|");
    const budget = Math.max(1, Math.floor(Number(field("budget").value) || 1)) * GiB;
    const rows = rowsOf(point);
    const [k, u] = unit(rows);
    document.querySelectorAll("#bp-calc-table th[data-unit]").forEach((th) => {
      th.textContent = th.dataset.unit + " (" + u + ")";
    });
    const body = document.querySelector("#bp-calc-table tbody");
    body.textContent = "";
    for (const r of rows) {
      const tr = document.createElement("tr");
      tr.dataset.strategy = r.strategy;
      tr.dataset.peak = String(r.peak);
      tr.dataset.needs = String(r.needs);
      tr.dataset.fits = String(r.needs <= budget);
      const cells = [r.strategy, (r.peak / k).toFixed(2), grouped(r.peak), (r.needs / k).toFixed(2),
        r.needs <= budget ? "yes" : "no",
        (r.extra >= 0 ? "+" : "") + Math.round(r.extra * 100) + "%"];
      for (const c of cells) {
        const td = document.createElement("td");
        td.textContent = c;
        tr.appendChild(td);
      }
      body.appendChild(tr);
    }
    const pick = recommend(rows, budget);
    const out = document.getElementById("bp-calc-pick");
    out.dataset.pick = pick === null ? "" : pick;
    out.dataset.point = point;
    out.dataset.budget = String(budget);
    out.textContent = rows.length === 0 ? "This point is not in the calculator's table." :
      pick === null ? "Nothing fits this budget." :
      "The plan's pick for " + budget / GiB + " GiB per GPU: " + pick + ".";
    document.getElementById("bp-calc-cmd").textContent = command(f, budget);
    const absent = data.strategies.filter((n) => !rows.some((r) => r.strategy === n));
    document.getElementById("bp-calc-absent").textContent = absent.length === 0 ? "" :
      "Not in the plan at this point (the command says why): " + absent.join(", ") + ".";
  }

  options(field("model"), Object.keys(data.models), Object.values(data.models).map((m) => m.label));
  options(field("mode"), data.modes.map((m) => m.name), data.modes.map((m) => m.label));
  form.addEventListener("input", show);
  form.addEventListener("change", show);
  form.addEventListener("submit", (e) => { e.preventDefault(); show(); });
  if (data.start) {  // the point the page opens at (calculator_page.START): its model first, whose choices follow
    const at = data.start.split("|");
    field("model").value = at[0];
    field("mode").value = at[1];
    show();
    ["gpus", "seq", "batch"].forEach((k, i) => { field(k).value = at[i + 2]; });
  }
  show();
})();
