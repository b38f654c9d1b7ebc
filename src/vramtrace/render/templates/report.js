"use strict";
// vramtrace HTML report: hand-written canvas drawing (tens of thousands of storages), no network. Every name from
// the data is set with textContent or drawn on a canvas, never parsed as HTML.
(function () {
  const D = JSON.parse(document.getElementById("vramtrace-data").textContent);
  const CATS = D.categories;
  const COLORS = D.colors;
  const KiB = 1024, MiB = 1048576, GiB = 1073741824;
  const CAPACITY_COLOR = "#d00000", RESERVED_COLOR = "#222222", PEAK_COLOR = "#8a1c7c";
  const fmt = (b) => b >= GiB ? (b / GiB).toFixed(2) + " GiB" : b >= MiB ? (b / MiB).toFixed(2) + " MiB"
    : b >= KiB ? (b / KiB).toFixed(1) + " KiB" : b + " B";
  const el = (tag, text, cls) => {
    const e = document.createElement(tag);
    if (text !== undefined) e.textContent = text;
    if (cls) e.className = cls;
    return e;
  };
  const tip = document.getElementById("tip");
  const showTip = (ev, text) => {
    tip.style.display = "block"; tip.style.left = (ev.clientX + 12) + "px"; tip.style.top = (ev.clientY + 12) + "px";
    tip.textContent = text;
  };
  const hideTip = () => { tip.style.display = "none"; };
  const DPR = window.devicePixelRatio || 1;
  // size a canvas to w x h CSS pixels, drawn in CSS pixels
  function sizeCanvas(cv, w, h) {
    cv.width = Math.round(w * DPR); cv.height = Math.round(h * DPR);
    cv.style.width = w + "px"; cv.style.height = h + "px";
    const g = cv.getContext("2d"); g.setTransform(DPR, 0, 0, DPR, 0, 0);
    return g;
  }

  // -- per report: curves by category (from the storages' lifetimes), the reserved curve ----------------------
  for (const R of D.reports) {
    const n = R.num_steps, T = R.tensors, m = T.bytes.length;
    R.curves = CATS.map(() => new Float64Array(n + 1));
    for (let i = 0; i < m; i++) {
      const c = R.curves[T.cat[i]];
      c[T.birth[i]] += T.bytes[i];
      c[T.death[i] + 1] -= T.bytes[i];
    }
    R.total = new Float64Array(n);
    for (const c of R.curves) {
      let acc = 0;
      for (let s = 0; s < n; s++) { acc += c[s]; c[s] = acc; R.total[s] += acc; }
    }
    R.max = 0; for (let s = 0; s < n; s++) if (R.total[s] > R.max) R.max = R.total[s];
    R.res = null; R.resMax = 0;
    if (R.reserved) {  // change points -> one value per step
      R.res = new Float64Array(n);
      const S = R.reserved.step, B = R.reserved.bytes;
      let k = -1;
      for (let s = 0; s < n; s++) {
        while (k + 1 < S.length && S[k + 1] <= s) k++;
        R.res[s] = k >= 0 ? B[k] : 0;
        if (R.res[s] > R.resMax) R.resMax = R.res[s];
      }
    }
    R.usable = R.capacity ? R.capacity.capacity_bytes - R.capacity.context_bytes : null;
    R.view = [0, n];  // the steps shown: [from, to)
  }
  // one y scale for every timeline: the largest curve, and the capacity when it is not far above the curves
  const dataMax = Math.max(1, ...D.reports.map((R) => Math.max(R.max, R.resMax)));
  const capMax = Math.max(0, ...D.reports.map((R) => R.usable !== null && R.usable <= 4 * dataMax ? R.usable : 0));
  const Y_MAX = Math.max(dataMax, capMax) * 1.06;
  const UNIT = Y_MAX >= 2 * GiB ? ["GiB", GiB] : Y_MAX >= 2 * MiB ? ["MiB", MiB] : ["KiB", KiB];
  function niceStep(range, count) {
    const raw = range / count, p = Math.pow(10, Math.floor(Math.log10(raw)));
    for (const k of [1, 2, 2.5, 5, 10]) if (k * p >= raw) return k * p;
    return 10 * p;
  }
  const TICK = niceStep(Y_MAX / UNIT[1], 6) * UNIT[1];
  const tickText = (v) => {
    const x = v / UNIT[1];
    return (Number.isInteger(x) ? String(x) : x.toFixed(1)) + " " + UNIT[0];
  };

  const legend = document.getElementById("legend");
  const used = new Set();
  for (const R of D.reports) for (let i = 0; i < R.tensors.cat.length; i++) used.add(R.tensors.cat[i]);
  CATS.forEach((c, k) => {
    if (!used.has(k)) return;
    const s = el("span"); const i = el("i"); i.style.background = COLORS[k]; s.append(i, c); legend.append(s);
  });

  // -- timelines: stacked live bytes, reserved, capacity, phase bands, brush to zoom ---------------------------------
  const BAND_COLORS = { forward: "#e8f1fd", backward: "#fdf0e4", optimizer: "#e7f6e3", optimizer_first: "#e7f6e3",
    zero_grad: "#f0f0f0", clip_grad_norm: "#f3ecf8", step: "#f4f4f4" };
  const M = { left: 62, right: 12, top: 18, bottom: 22 };
  const timelines = [];
  document.querySelectorAll(".col").forEach((col) => {
    const R = D.reports[Number(col.dataset.report)];
    const box = col.querySelector(".tlbox"), reset = col.querySelector(".reset"), zoom = col.querySelector(".zoom");
    const lines = col.querySelector(".lines");
    const cv = el("canvas", undefined, "timeline"); cv.dataset.report = col.dataset.report;
    const axis = el("div", undefined, "yaxis"), cap = el("div", undefined, "caplabel");
    const brush = el("div", undefined, "brush");
    box.append(cv, axis, cap, brush);
    const line = (color, text) => {
      const s = el("span"); const i = el("i"); i.style.borderTopColor = color;
      if (color === PEAK_COLOR) i.style.borderTopStyle = "dashed";  // as the peak's marker
      s.append(i, text); lines.append(s);
    };
    line(PEAK_COLOR, "peak");
    if (R.res) line(RESERVED_COLOR, D.reports.length > 1 ? "reserved" : "reserved (caching-allocator model)");
    if (R.capacity) line(CAPACITY_COLOR, R.capacity.gpu + " capacity");
    const T = { R, cv, axis, cap, brush, box, reset, zoom, col };
    timelines.push(T);
    reset.addEventListener("click", () => { setView(T, 0, R.num_steps); });
    let down = null;
    const xOf = (ev) => ev.clientX - cv.getBoundingClientRect().left;
    cv.addEventListener("mousedown", (ev) => { down = xOf(ev); ev.preventDefault(); });
    cv.addEventListener("mousemove", (ev) => {
      const x = xOf(ev), s = stepAt(T, x);
      if (down !== null && Math.abs(x - down) > 3) {
        const a = Math.max(M.left, Math.min(x, down)), b = Math.min(T.w - M.right, Math.max(x, down));
        brush.style.display = "block"; brush.style.left = a + "px"; brush.style.width = (b - a) + "px";
        brush.style.top = M.top + "px"; brush.style.height = (T.h - M.top - M.bottom) + "px";
      }
      const st = R.steps;
      showTip(ev, "step " + s + " · " + R.strings[st.op[s]] + " · " + (R.strings[st.module[s]] || "(root)") + " · " +
        R.strings[st.phase[s]] + " · live " + fmt(R.total[s]) + (R.res ? " · reserved " + fmt(R.res[s]) : ""));
    });
    cv.addEventListener("mouseleave", hideTip);
    window.addEventListener("mouseup", (ev) => {
      if (down === null) return;
      const x = xOf(ev), from = down; down = null; brush.style.display = "none";
      if (Math.abs(x - from) <= 3) { if (ev.target === cv) showLiveSet(R, stepAt(T, x)); return; }
      const a = stepAt(T, Math.min(x, from)), b = stepAt(T, Math.max(x, from));
      setView(T, a, Math.max(b + 1, a + 2));
    });
    cv.addEventListener("dblclick", () => setView(T, 0, R.num_steps));
  });

  function stepAt(T, x) {
    const [v0, v1] = T.R.view, pw = T.w - M.left - M.right;
    const s = v0 + Math.floor((x - M.left) / pw * (v1 - v0));
    return Math.min(v1 - 1, Math.max(v0, s));
  }
  function setView(T, a, b) {
    const R = T.R;
    R.view = [Math.max(0, a), Math.min(R.num_steps, b)];
    const zoomed = R.view[0] > 0 || R.view[1] < R.num_steps;
    T.reset.hidden = !zoomed;
    T.zoom.textContent = zoomed ? "steps " + R.view[0] + "–" + (R.view[1] - 1) + " of " + R.num_steps
      : "drag to zoom";
    drawTimeline(T);
    if (R === LR) drawLifetimes();
  }

  function drawTimeline(T) {
    const R = T.R, n = R.num_steps, [v0, v1] = R.view, span = v1 - v0;
    const W = Math.max(300, Math.floor(T.box.clientWidth)), H = D.reports.length > 1 ? 280 : 330;
    T.w = W; T.h = H;
    const g = sizeCanvas(T.cv, W, H);
    const x0 = M.left, pw = W - M.left - M.right, y0 = H - M.bottom, ph = H - M.top - M.bottom;
    const X = (s) => x0 + (s - v0) / span * pw, Y = (b) => y0 - b / Y_MAX * ph;
    g.clearRect(0, 0, W, H);
    g.font = "11px system-ui, sans-serif";
    // phase bands, labelled where wide enough
    for (const [phase, a, b] of R.bands) {
      if (b < v0 || a >= v1) continue;
      const xa = X(Math.max(a, v0)), xb = X(Math.min(b + 1, v1));
      g.fillStyle = BAND_COLORS[phase] || "#f6f6f6"; g.fillRect(xa, M.top, xb - xa, ph);
      if (xb - xa > 50) { g.fillStyle = "#555"; g.fillText(phase, xa + 4, M.top - 5); }
    }
    // gridlines and ticks (the labels are DOM text beside the canvas)
    T.axis.textContent = "";
    const ticks = [];
    for (let v = 0; v <= Y_MAX + 1; v += TICK) {
      const y = Math.round(Y(v)) + 0.5;
      g.strokeStyle = v === 0 ? "#888" : "#e2e2e2"; g.lineWidth = 1;
      g.beginPath(); g.moveTo(x0 - 4, y); g.lineTo(x0 + pw, y); g.stroke();
      const lab = el("span", tickText(v)); lab.style.top = y + "px"; lab.style.right = (W - x0 + 7) + "px";
      lab.dataset.bytes = String(v); T.axis.append(lab); ticks.push(v);
    }
    T.cv.dataset.ticks = ticks.join(",");
    // stacked live bytes: one column per pixel, the step with the most live bytes in it
    const cols = Math.max(1, Math.floor(pw));
    for (let x = 0; x < cols; x++) {
      const s0 = v0 + Math.floor(x / cols * span), s1 = Math.max(s0 + 1, v0 + Math.floor((x + 1) / cols * span));
      let best = s0; for (let s = s0; s < s1 && s < n; s++) if (R.total[s] > R.total[best]) best = s;
      let y = y0;
      for (let k = 0; k < CATS.length; k++) {
        const h = R.curves[k][best] / Y_MAX * ph;
        if (h <= 0) continue;
        g.fillStyle = COLORS[k]; g.fillRect(x0 + x, y - h, 1, h); y -= h;
      }
    }
    // the reserved curve: the largest reserved value in each pixel column, as steps
    if (R.res) {
      g.strokeStyle = RESERVED_COLOR; g.lineWidth = 1.5; g.beginPath();
      for (let x = 0; x < cols; x++) {
        const s0 = v0 + Math.floor(x / cols * span), s1 = Math.max(s0 + 1, v0 + Math.floor((x + 1) / cols * span));
        let r = 0; for (let s = s0; s < s1 && s < n; s++) if (R.res[s] > r) r = R.res[s];
        const y = Y(r);
        if (x === 0) g.moveTo(x0, y); else g.lineTo(x0 + x, y);
        g.lineTo(x0 + x + 1, y);
      }
      g.stroke();
    }
    // the peak
    const pk = R.peak_step;
    if (pk >= v0 && pk < v1) {
      const px = Math.round(X(pk + 0.5)) + 0.5;
      g.strokeStyle = PEAK_COLOR; g.lineWidth = 1; g.setLineDash([4, 3]);
      g.beginPath(); g.moveTo(px, M.top); g.lineTo(px, y0); g.stroke(); g.setLineDash([]);
      const text = "peak " + fmt(R.peak_bytes) + " (step " + pk + ")";
      g.font = "600 11px system-ui, sans-serif"; g.fillStyle = PEAK_COLOR;
      const tw = g.measureText(text).width;
      g.fillText(text, px + 4 + tw < x0 + pw ? px + 4 : px - 4 - tw, Math.max(M.top + 12, Y(R.peak_bytes) - 6));
      g.font = "11px system-ui, sans-serif";
    }
    // the capacity of the target GPU (less the CUDA context: what the allocator can reserve)
    T.cap.style.display = "none"; delete T.cv.dataset.capacityY;
    if (R.capacity) {
      const C = R.capacity, above = R.usable > Y_MAX ? " (above the scale)" : "";
      const short = C.gpu + " " + fmt(R.usable) + (C.context_bytes ? " usable" : "") + above;
      T.cap.title = C.gpu + " " + fmt(C.capacity_bytes) + (C.context_bytes ? " less the CUDA context " +
        fmt(C.context_bytes) + ": " + fmt(R.usable) + " for PyTorch's allocator" : "");
      T.cap.textContent = C.context_bytes ? T.cap.title + above : short;
      T.cap.style.display = "block"; T.cap.style.left = (x0 + 6) + "px";
      if (T.cap.offsetWidth > pw - 12) T.cap.textContent = short;
      if (!above) {
        const y = Math.round(Y(R.usable));
        g.fillStyle = CAPACITY_COLOR; g.fillRect(x0, y - 1, pw, 2);
        T.cv.dataset.capacityY = String(y);
        T.cap.style.top = (y - 2) + "px";
      } else {
        T.cap.style.top = (M.top + 14) + "px";
      }
    }
    // x axis: step numbers
    g.fillStyle = "#444"; g.strokeStyle = "#888"; g.lineWidth = 1;
    const xs = niceStep(span, Math.max(2, Math.floor(pw / 110)));
    for (let s = Math.ceil(v0 / xs) * xs; s < v1; s += xs) {
      const x = Math.round(X(s)) + 0.5;
      g.beginPath(); g.moveTo(x, y0); g.lineTo(x, y0 + 4); g.stroke();
      const t = String(Math.round(s)), tw = g.measureText(t).width;
      g.fillText(t, Math.min(x - tw / 2, W - tw - 1), y0 + 15);
    }
    g.fillText("step", 4, y0 + 15);
    T.cv.dataset.view = v0 + "," + v1;
    T.cv.dataset.yMax = String(Y_MAX);
    T.cv.dataset.plot = [x0, M.top, pw, ph].join(",");
  }

  // -- live set table (sortable) --------------------------------------------------------------------------------
  let liveRows = [], sortKey = "bytes", sortDir = -1;
  const COLS = [["name", "storage"], ["cat", "category"], ["module", "module"], ["op", "op"], ["shape", "shape"],
    ["dtype", "dtype"], ["bytes", "bytes"], ["birth", "birth"], ["death", "death"]];
  const NUM = ["bytes", "birth", "death"];
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
    document.getElementById("livehint").textContent = R.strings[R.steps.op[s]] + " in " +
      (R.strings[R.steps.module[s]] || "(root)");
    renderLive();
  }
  function renderLive() {
    const t = document.getElementById("liveset"); t.textContent = "";
    const head = el("tr");
    for (const [k, label] of COLS) {
      const th = el("th", label + (k === sortKey ? (sortDir < 0 ? " ▼" : " ▲") : ""), NUM.includes(k) ? "n" : "");
      th.addEventListener("click", () => { sortDir = k === sortKey ? -sortDir : -1; sortKey = k; renderLive(); });
      head.append(th);
    }
    t.append(head);
    liveRows.sort((a, b) => (a[sortKey] < b[sortKey] ? -1 : a[sortKey] > b[sortKey] ? 1 : 0) * sortDir);
    for (const r of liveRows.slice(0, 2000)) {
      const tr = el("tr");
      for (const [k] of COLS) {
        tr.append(el("td", k === "bytes" ? fmt(r.bytes) : String(r[k]), NUM.includes(k) ? "n" : ""));
      }
      t.append(tr);
    }
  }

  // -- lifetimes: the first report's modules as rows, identical layers folded, the whole-step band collapsed -------
  const LR = D.reports[0], LT = LR.tensors, G = LR.groups, NG = G.label.length, ROW = 18;
  const kids = Array.from({ length: NG }, () => []);  // child nodes
  const own = Array.from({ length: NG }, () => []);  // storages placed directly in a node
  const members = Array.from({ length: NG }, () => []);  // storages in a node's subtree
  const roots = [];
  G.parent.forEach((p, k) => (p < 0 ? roots : kids[p]).push(k));
  for (let i = 0; i < LT.bytes.length; i++) {
    own[LT.group[i]].push(i);
    for (let k = LT.group[i]; k >= 0; k = G.parent[k]) members[k].push(i);
  }
  for (const list of own) list.sort((a, b) => LT.birth[a] - LT.birth[b] || LT.bytes[b] - LT.bytes[a]);
  const shown = new Set(CATS.map((_, k) => k));
  let minBytes = 0, highlight = null;
  const expanded = new Set();
  const keep = (i) => shown.has(LT.cat[i]) && LT.bytes[i] >= minBytes;
  // per node, its live bytes at each step over the storages that pass the filters (computed when drawn)
  let profiles = new Map();
  function profile(k) {
    if (profiles.has(k)) return profiles.get(k);
    const n = LR.num_steps, d = new Float64Array(n + 1), byCat = new Map();
    let count = 0;
    for (const i of members[k]) {
      if (!keep(i)) continue;
      const c = LT.cat[i];
      if (!byCat.has(c)) byCat.set(c, new Float64Array(n + 1));
      const dc = byCat.get(c);
      d[LT.birth[i]] += LT.bytes[i]; d[LT.death[i] + 1] -= LT.bytes[i];
      dc[LT.birth[i]] += LT.bytes[i]; dc[LT.death[i] + 1] -= LT.bytes[i]; count++;
    }
    let max = 0;
    for (const a of [d, ...byCat.values()]) { let acc = 0; for (let s = 0; s < n; s++) { acc += a[s]; a[s] = acc; } }
    for (let s = 0; s < n; s++) if (d[s] > max) max = d[s];
    const cats = [...byCat.keys()].sort((a, b) => a - b);  // stacked in the timeline's order
    const p = { live: d, max, count, cats, byCat };
    profiles.set(k, p);
    return p;
  }
  let rows = [];  // the visible rows: {node, depth} or {t (a storage), depth}
  function rebuild() {
    rows = [];
    const walk = (k, depth) => {
      if (profile(k).count === 0) return;
      rows.push({ node: k, depth });
      if (!expanded.has(k)) return;
      for (const c of kids[k]) walk(c, depth + 1);
      for (const i of own[k]) if (keep(i)) rows.push({ t: i, depth: depth + 1 });
    };
    for (const k of roots) walk(k, 0);
    spacer.style.height = Math.max(0, rows.length * ROW + 4 - LIFE_H) + "px";
    labels.dataset.rows = String(rows.length);
    drawLifetimes();
  }
  const filters = document.getElementById("filters");
  if (D.reports.length > 1) filters.append(el("span", "Lifetimes of " + LR.label + ". ", "muted"));
  CATS.forEach((c, k) => {
    if (!LT.cat.includes(k)) return;
    const lab = el("label"); const cb = el("input"); cb.type = "checkbox"; cb.checked = true;
    cb.addEventListener("change", () => {
      if (cb.checked) shown.add(k); else shown.delete(k);
      profiles = new Map(); rebuild();
    });
    lab.append(cb, " " + c); filters.append(lab);
  });
  const minLab = el("label", "min size (MiB) "); const minIn = el("input");
  minIn.type = "number"; minIn.value = "0"; minIn.min = "0"; minIn.step = "any"; minIn.style.width = "70px";
  minIn.addEventListener("input", () => {
    minBytes = (parseFloat(minIn.value) || 0) * MiB; profiles = new Map(); rebuild();
  });
  minLab.append(minIn); filters.append(minLab);
  const scroller = document.getElementById("lifescroll"), labels = document.getElementById("lifelabels");
  const lc = document.getElementById("lifecanvas"), spacer = document.getElementById("lifespacer"), LIFE_H = 440;
  function rowText(r) {
    if (r.node !== undefined) {
      const p = profile(r.node);
      const count = p.count.toLocaleString("en") + (p.count === 1 ? " storage" : " storages");
      return [G.label[r.node], "max " + fmt(p.max) + " · " + count];
    }
    const i = r.t, S = LR.strings;
    const name = S[LT.name[i]] || S[LT.op[i]] || "#" + LT.id[i];
    return [name + " " + S[LT.shape[i]] + " " + S[LT.dtype[i]], fmt(LT.bytes[i])];
  }
  function drawLifetimes() {
    const W = Math.max(200, lc.clientWidth || 600), H = LIFE_H, n = LR.num_steps, [v0, v1] = LR.view, span = v1 - v0;
    const g = sizeCanvas(lc, W, H);
    g.clearRect(0, 0, W, H);
    const top = scroller.scrollTop, first = Math.floor(top / ROW), off = top - first * ROW;
    const count = Math.ceil(H / ROW) + 1;
    labels.textContent = "";
    const X = (s) => (s - v0) / span * W;
    for (let r = 0; r < count && first + r < rows.length; r++) {
      const row = rows[first + r], y = r * ROW - off;
      const [name, bytes] = rowText(row);
      const div = el("div", undefined, "lrow " + (row.node !== undefined ? "node" : "leaf"));
      div.style.top = y + "px"; div.style.paddingLeft = (4 + 14 * row.depth) + "px";
      const tw = el("span", row.node !== undefined ? (expanded.has(row.node) ? "▾" : "▸") : "", "tw");
      const nm = el("span", name, "lname"); nm.title = name;
      div.append(tw, nm, el("span", bytes, "lbytes"));
      if (row.node !== undefined) {
        div.dataset.node = String(row.node); div.dataset.kind = G.kind[row.node];
        div.addEventListener("click", () => {
          expanded.has(row.node) ? expanded.delete(row.node) : expanded.add(row.node);
          rebuild();
        });
      }
      labels.append(div);
      if ((first + r) % 2) { g.fillStyle = "#fafafa"; g.fillRect(0, y, W, ROW); }
      if (row.node !== undefined) {  // the node's live bytes over the step, scaled to its own maximum
        const p = profile(row.node);
        for (let x = 0; x < W; x++) {
          const s0 = v0 + Math.floor(x / W * span), s1 = Math.max(s0 + 1, v0 + Math.floor((x + 1) / W * span));
          let best = s0; for (let s = s0; s < s1 && s < n; s++) if (p.live[s] > p.live[best]) best = s;
          let yb = y + ROW - 2;
          for (const c of p.cats) {
            const h = p.max > 0 ? p.byCat.get(c)[best] / p.max * (ROW - 4) : 0;
            if (h > 0) { g.fillStyle = COLORS[c]; g.fillRect(x, yb - h, 1, h); yb -= h; }
          }
        }
      } else {
        const i = row.t, mod = LR.strings[LT.module[i]];
        const on = highlight === null || mod === highlight || mod.startsWith(highlight + ".");
        const xa = X(LT.birth[i]), xb = X(LT.death[i] + 1);
        if (xb >= 0 && xa <= W) {
          g.fillStyle = on ? COLORS[LT.cat[i]] : "#e4e4e4";
          g.fillRect(xa, y + 4, Math.max(1, xb - xa), ROW - 8);
        }
      }
    }
    const pk = LR.peak_step;
    if (pk >= v0 && pk < v1) {
      const px = Math.round(X(pk + 0.5)) + 0.5;
      g.strokeStyle = PEAK_COLOR; g.setLineDash([4, 3]); g.beginPath(); g.moveTo(px, 0); g.lineTo(px, H); g.stroke();
      g.setLineDash([]);
    }
  }
  scroller.addEventListener("scroll", () => requestAnimationFrame(drawLifetimes));
  lc.addEventListener("mousemove", (ev) => {
    const rect = lc.getBoundingClientRect(), y = ev.clientY - rect.top, x = ev.clientX - rect.left;
    const row = rows[Math.floor((y + scroller.scrollTop) / ROW)];
    const [v0, v1] = LR.view, s = Math.min(v1 - 1, v0 + Math.floor(x / rect.width * (v1 - v0)));
    if (!row) { hideTip(); return; }
    if (row.node !== undefined) {
      showTip(ev, G.label[row.node] + " · step " + s + " · live " + fmt(profile(row.node).live[s]));
    } else {
      const i = row.t, S = LR.strings;
      showTip(ev, rowText(row)[0] + " · " + CATS[LT.cat[i]] + " · " + (S[LT.module[i]] || "(root)") + " · " +
        (S[LT.op[i]] || "(exists at start)") + " · " + fmt(LT.bytes[i]) + " · steps " + LT.birth[i] + "–" +
        LT.death[i]);
    }
  });
  lc.addEventListener("mouseleave", hideTip);

  // -- modules tree ---------------------------------------------------------------------------------------------------
  const ACT = CATS.indexOf("activation");
  const sums = new Map();
  for (let i = 0; i < LT.bytes.length; i++) {
    if (LT.cat[i] !== ACT) continue;
    const parts = (LR.strings[LT.module[i]] || "").split(".").filter(Boolean);
    sums.set("", (sums.get("") || 0) + LT.bytes[i]);
    for (let k = 1; k <= parts.length; k++) {
      const p = parts.slice(0, k).join(".");
      sums.set(p, (sums.get(p) || 0) + LT.bytes[i]);
    }
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
    const sub = (children.get(path) || []).sort((a, b) => sums.get(b) - sums.get(a));
    const label = (path ? path.slice(path.lastIndexOf(".") + 1) : "(model)") + " · " + fmt(sums.get(path) || 0);
    const box = sub.length ? el("details") : el("div");
    const head = el(sub.length ? "summary" : "span", label);
    head.dataset.module = path;
    head.addEventListener("click", () => {
      if (selected) selected.classList.remove("sel");
      selected = head; head.classList.add("sel"); highlight = path || null; drawLifetimes();
    });
    box.append(head);
    if (sub.length) {
      box.open = path === "";
      box.addEventListener("toggle", () => {
        if (box.open && box.childNodes.length === 1) for (const k of sub) box.append(node(k));
      });
    }
    if (path === "") for (const k of sub) box.append(node(k));
    return box;
  }
  document.getElementById("tree").append(node(""));

  for (const T of timelines) setView(T, 0, T.R.num_steps);
  rebuild();
  let pending = 0;
  window.addEventListener("resize", () => {
    cancelAnimationFrame(pending);
    pending = requestAnimationFrame(() => { for (const T of timelines) drawTimeline(T); drawLifetimes(); });
  });
  window.vramtraceReady = true;
})();
