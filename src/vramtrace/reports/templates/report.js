"use strict";
// vramtrace HTML report: hand-written canvas drawing (tens of thousands of storages), no network.
(function () {
  const D = JSON.parse(document.getElementById("vramtrace-data").textContent);
  const CATS = D.categories;
  const COLORS = D.colors;
  const MiB = 1048576, GiB = 1073741824;
  const fmt = (b) => b >= GiB ? (b / GiB).toFixed(2) + " GiB" : b >= MiB ? (b / MiB).toFixed(2) + " MiB"
    : b >= 1024 ? (b / 1024).toFixed(1) + " KiB" : b + " B";
  const el = (tag, text, cls) => { const e = document.createElement(tag); if (text !== undefined) e.textContent = text; if (cls) e.className = cls; return e; };
  const tip = document.getElementById("tip");

  // -- per report: curves by category, from the storages' lifetimes --------------------------------------
  for (const R of D.reports) {
    const n = R.num_steps, T = R.tensors, m = T.bytes.length;
    R.curves = CATS.map(() => new Float64Array(n + 1));
    for (let i = 0; i < m; i++) {
      const c = R.curves[T.cat[i]];
      c[T.birth[i]] += T.bytes[i];
      c[T.death[i] + 1] -= T.bytes[i];
    }
    R.total = new Float64Array(n);
    for (const c of R.curves) { let acc = 0; for (let s = 0; s < n; s++) { acc += c[s]; c[s] = acc; R.total[s] += acc; } }
    R.max = 0; for (let s = 0; s < n; s++) if (R.total[s] > R.max) R.max = R.total[s];
  }
  const yMax = Math.max(...D.reports.map((R) => R.max)) || 1;  // one scale for every timeline

  const legend = document.getElementById("legend");
  CATS.forEach((c, k) => { const s = el("span"); const i = el("i"); i.style.background = COLORS[k]; s.append(i, c); legend.append(s); });

  // -- timelines ---------------------------------------------------------------------------------------------
  const holder = document.getElementById("timelines");
  const width = D.reports.length > 1 ? Math.max(420, Math.floor((window.innerWidth - 80) / Math.min(D.reports.length, 3))) : Math.max(600, window.innerWidth - 60);
  D.reports.forEach((R, ri) => {
    const fig = el("figure"); const cap = el("figcaption", R.label + " (peak " + fmt(R.peak_bytes) + ")");
    const cv = el("canvas"); cv.width = width; cv.height = 240; cv.dataset.report = ri; cv.className = "timeline";
    fig.append(cap, cv); holder.append(fig);
    drawTimeline(R, cv);
    cv.addEventListener("mousemove", (ev) => {
      const s = stepAt(R, cv, ev);
      const st = R.steps;
      tip.style.display = "block"; tip.style.left = (ev.clientX + 12) + "px"; tip.style.top = (ev.clientY + 12) + "px";
      tip.textContent = "step " + s + " · " + R.strings[st.op[s]] + " · " + (R.strings[st.module[s]] || "(root)") +
        " · " + R.strings[st.phase[s]] + " · live " + fmt(R.total[s]);
    });
    cv.addEventListener("mouseleave", () => { tip.style.display = "none"; });
    cv.addEventListener("click", (ev) => showLiveSet(R, stepAt(R, cv, ev)));
  });

  function stepAt(R, cv, ev) {
    const x = ev.clientX - cv.getBoundingClientRect().left;
    return Math.min(R.num_steps - 1, Math.max(0, Math.floor(x / cv.width * R.num_steps)));
  }

  function drawTimeline(R, cv) {
    const g = cv.getContext("2d"), W = cv.width, H = cv.height, n = R.num_steps;
    g.clearRect(0, 0, W, H);
    const bandColors = { forward: "#eef5ff", backward: "#fff3e8", optimizer: "#eefbea", optimizer_first: "#eefbea", zero_grad: "#f4f4f4" };
    for (const [phase, a, b] of R.bands) {
      g.fillStyle = bandColors[phase] || "#f8f8f8";
      g.fillRect(a / n * W, 0, (b - a + 1) / n * W, H);
      g.fillStyle = "#999"; g.font = "11px sans-serif"; g.fillText(phase, a / n * W + 3, 12);
    }
    // one column per pixel: the step with the most live bytes in the column, stacked by category
    for (let x = 0; x < W; x++) {
      const s0 = Math.floor(x / W * n), s1 = Math.max(s0 + 1, Math.floor((x + 1) / W * n));
      let best = s0; for (let s = s0; s < s1 && s < n; s++) if (R.total[s] > R.total[best]) best = s;
      let y = H;
      for (let k = 0; k < CATS.length; k++) {
        const h = R.curves[k][best] / yMax * (H - 18);
        g.fillStyle = COLORS[k]; g.fillRect(x, y - h, 1, h); y -= h;
      }
    }
    const px = (R.peak_step + 0.5) / n * W;
    g.strokeStyle = "#c00"; g.beginPath(); g.moveTo(px, 14); g.lineTo(px, H); g.stroke();
    g.fillStyle = "#c00"; g.fillText("peak " + fmt(R.peak_bytes), Math.min(px + 4, W - 120), 26);
  }

  // -- live set table (sortable) --------------------------------------------------------------------------------
  let liveRows = [], sortKey = "bytes", sortDir = -1;
  const COLS = [["name", "storage"], ["cat", "category"], ["module", "module"], ["op", "op"], ["shape", "shape"],
    ["dtype", "dtype"], ["bytes", "bytes"], ["birth", "birth"], ["death", "death"]];
  function showLiveSet(R, s) {
    const T = R.tensors; liveRows = [];
    for (let i = 0; i < T.bytes.length; i++) {
      if (T.birth[i] <= s && s <= T.death[i]) liveRows.push({
        name: R.strings[T.name[i]] || ("#" + T.id[i]), cat: CATS[T.cat[i]], module: R.strings[T.module[i]] || "(root)",
        op: R.strings[T.op[i]] || "(exists at start)", shape: R.strings[T.shape[i]], dtype: R.strings[T.dtype[i]],
        bytes: T.bytes[i], birth: T.birth[i], death: T.death[i] });
    }
    document.getElementById("livetitle").textContent = "Live set at step " + s + " of " + R.label + ": " +
      liveRows.length + " storages, " + fmt(R.total[s]);
    document.getElementById("livehint").textContent = R.strings[R.steps.op[s]] + " in " + (R.strings[R.steps.module[s]] || "(root)");
    renderLive();
  }
  function renderLive() {
    const t = document.getElementById("liveset"); t.textContent = "";
    const head = el("tr");
    for (const [k, label] of COLS) {
      const th = el("th", label + (k === sortKey ? (sortDir < 0 ? " ▼" : " ▲") : ""), ["bytes", "birth", "death"].includes(k) ? "n" : "");
      th.addEventListener("click", () => { sortDir = k === sortKey ? -sortDir : -1; sortKey = k; renderLive(); });
      head.append(th);
    }
    t.append(head);
    liveRows.sort((a, b) => (a[sortKey] < b[sortKey] ? -1 : a[sortKey] > b[sortKey] ? 1 : 0) * sortDir);
    for (const r of liveRows.slice(0, 2000)) {
      const tr = el("tr");
      for (const [k] of COLS) tr.append(el("td", k === "bytes" ? fmt(r.bytes) : String(r[k]), ["bytes", "birth", "death"].includes(k) ? "n" : ""));
      t.append(tr);
    }
  }

  // -- lifetimes: one bar per storage, grouped by module, virtualised on a canvas ----------------------------
  const R0 = D.reports[0], T0 = R0.tensors, ROW = 4;
  const order = Array.from(T0.bytes.keys()).sort((a, b) => {
    const ma = R0.strings[T0.module[a]], mb = R0.strings[T0.module[b]];
    return ma < mb ? -1 : ma > mb ? 1 : T0.birth[a] - T0.birth[b];
  });
  const shown = new Set(CATS.map((_, k) => k));
  let minBytes = 0, highlight = null, rows = order;
  const filters = document.getElementById("filters");
  CATS.forEach((c, k) => {
    const lab = el("label"); const cb = el("input"); cb.type = "checkbox"; cb.checked = true;
    cb.addEventListener("change", () => { cb.checked ? shown.add(k) : shown.delete(k); refilter(); });
    lab.append(cb, " " + c); filters.append(lab);
  });
  const minLab = el("label", "min size (MiB) "); const minIn = el("input"); minIn.type = "number"; minIn.value = "0"; minIn.min = "0"; minIn.step = "any"; minIn.style.width = "70px";
  minIn.addEventListener("input", () => { minBytes = (parseFloat(minIn.value) || 0) * MiB; refilter(); });
  minLab.append(minIn); filters.append(minLab);
  const scroller = document.getElementById("lifescroll"), lc = document.getElementById("lifecanvas"), spacer = document.getElementById("lifespacer");
  lc.width = Math.max(600, window.innerWidth - 70); lc.height = 420;
  function refilter() {
    rows = order.filter((i) => shown.has(T0.cat[i]) && T0.bytes[i] >= minBytes);
    spacer.style.height = Math.max(0, rows.length * ROW - lc.height) + "px";
    drawLifetimes();
  }
  function drawLifetimes() {
    const g = lc.getContext("2d"), W = lc.width, n = R0.num_steps;
    g.clearRect(0, 0, W, lc.height);
    const first = Math.floor(scroller.scrollTop / ROW), count = Math.ceil(lc.height / ROW);
    for (let r = 0; r < count && first + r < rows.length; r++) {
      const i = rows[first + r];
      const mod = R0.strings[T0.module[i]];
      const on = highlight === null || mod === highlight || mod.startsWith(highlight + ".");
      g.fillStyle = on ? COLORS[T0.cat[i]] : "#e4e4e4";
      const x0 = T0.birth[i] / n * W, x1 = (T0.death[i] + 1) / n * W;
      g.fillRect(x0, r * ROW, Math.max(1, x1 - x0), ROW - 1);
    }
    const px = (R0.peak_step + 0.5) / n * W;
    g.strokeStyle = "#c00"; g.beginPath(); g.moveTo(px, 0); g.lineTo(px, lc.height); g.stroke();
  }
  scroller.addEventListener("scroll", () => requestAnimationFrame(drawLifetimes));

  // -- modules tree ---------------------------------------------------------------------------------------------------
  const ACT = CATS.indexOf("activation");
  const sums = new Map();
  for (let i = 0; i < T0.bytes.length; i++) {
    if (T0.cat[i] !== ACT) continue;
    const parts = (R0.strings[T0.module[i]] || "").split(".").filter(Boolean);
    sums.set("", (sums.get("") || 0) + T0.bytes[i]);
    for (let k = 1; k <= parts.length; k++) { const p = parts.slice(0, k).join("."); sums.set(p, (sums.get(p) || 0) + T0.bytes[i]); }
  }
  const children = new Map();
  for (const p of sums.keys()) {
    if (p === "") continue;
    const parent = p.includes(".") ? p.slice(0, p.lastIndexOf(".")) : "";
    if (!children.has(parent)) children.set(parent, []);
    children.get(parent).push(p);
  }
  let selected = null;
  function node(path) {
    const kids = (children.get(path) || []).sort((a, b) => sums.get(b) - sums.get(a));
    const label = (path ? path.slice(path.lastIndexOf(".") + 1) : "(model)") + " · " + fmt(sums.get(path) || 0);
    const box = kids.length ? el("details") : el("div");
    const head = el(kids.length ? "summary" : "span", label);
    head.dataset.module = path;
    head.addEventListener("click", () => {
      if (selected) selected.classList.remove("sel");
      selected = head; head.classList.add("sel"); highlight = path || null; drawLifetimes();
    });
    box.append(head);
    if (kids.length) { box.open = path === "" ; box.addEventListener("toggle", () => { if (box.open && box.childNodes.length === 1) for (const k of kids) box.append(node(k)); }, { once: false }); }
    if (path === "") for (const k of kids) box.append(node(k));
    if (kids.length && path === "") box.dataset.filled = "1";
    return box;
  }
  document.getElementById("tree").append(node(""));

  refilter();
  window.vramtraceReady = true;
})();
