// radixkv dashboard: polls /dashboard/api/summary and /dashboard/api/tree, draws SVG charts.
// No library and no network beyond this origin (the page's Content-Security-Policy holds it to
// that). The key comes from the URL fragment (#key=...; a fragment is never sent to a server)
// or the form, and goes out as a bearer header. State is on window.radixkvDashboard for tests.
"use strict";
(function () {
  const SVG = "http://www.w3.org/2000/svg";
  const MAX_SAMPLES = 300;
  const W = 640, H = 180, PAD_L = 46, PAD_R = 8, PAD_T = 8, PAD_B = 18;
  const fragment = new URLSearchParams(window.location.hash.slice(1));
  const intervalMs = Math.min(60000, Math.max(250, parseInt(fragment.get("interval") || "1000", 10) || 1000));
  let key = fragment.get("key") || window.sessionStorage.getItem("radixkv-key") || "";
  if (fragment.has("key")) {  // keep the key out of the history and the address bar
    window.sessionStorage.setItem("radixkv-key", key);
    window.history.replaceState(null, "", window.location.pathname);
  }

  const state = {
    intervalMs, polls: 0, treePolls: 0, samples: [], summary: null, tree: null,
    selectedNode: null, nodeDetail: null, lastError: null, scope: null,
  };
  window.radixkvDashboard = state;

  const $ = (id) => document.getElementById(id);

  function fmt(value, digits) {
    if (value === null || value === undefined || Number.isNaN(value)) return "–";
    if (typeof value !== "number") return String(value);
    const d = digits === undefined ? 3 : digits;
    const a = Math.abs(value);
    if (a >= 1e15) return (value / 1e15).toPrecision(d) + "P";
    if (a >= 1e12) return (value / 1e12).toPrecision(d) + "T";
    if (a >= 1e9) return (value / 1e9).toPrecision(d) + "G";
    if (a >= 1e6) return (value / 1e6).toPrecision(d) + "M";
    if (a >= 1e4) return (value / 1e3).toPrecision(d) + "k";
    if (Number.isInteger(value)) return String(value);
    return value.toPrecision(d);
  }
  const pct = (v) => (v === null || v === undefined ? "–" : (100 * v).toFixed(1) + " %");

  async function getJSON(path) {
    const headers = key ? { Authorization: "Bearer " + key } : {};
    const resp = await fetch(path, { headers, cache: "no-store" });
    let body = null;
    try { body = await resp.json(); } catch (e) { body = null; }
    if (!resp.ok) {
      const msg = body && body.error ? body.error.message : "HTTP " + resp.status;
      const err = new Error(msg);
      err.status = resp.status;
      throw err;
    }
    return body;
  }

  function el(tag, text, cls) {
    const node = document.createElement(tag);
    if (text !== undefined && text !== null) node.textContent = text;
    if (cls) node.className = cls;
    return node;
  }

  function svgEl(tag, attrs) {
    const node = document.createElementNS(SVG, tag);
    for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, String(v));
    return node;
  }

  // ---------------------------------------------------------------- charts
  // series: [{name, color, values: [number|null, ...]}]; one value per sample.
  // opts.stacked: areas stacked in series order; opts.yMax: fixed top of the axis.
  function drawChart(svgId, legendId, series, opts) {
    const svg = $(svgId);
    while (svg.firstChild) svg.removeChild(svg.firstChild);
    const n = Math.max(0, ...series.map((s) => s.values.length));
    const stackedTop = [];
    if (opts.stacked) {
      for (let i = 0; i < n; i++) {
        let sum = 0;
        for (const s of series) sum += s.values[i] || 0;
        stackedTop.push(sum);
      }
    }
    let yMax = opts.yMax || 0;
    if (!yMax) {
      const all = opts.stacked ? stackedTop : series.flatMap((s) => s.values.filter((v) => v !== null && v !== undefined));
      yMax = Math.max(0, ...all);
    }
    if (!(yMax > 0)) yMax = 1;
    const x = (i) => PAD_L + (n <= 1 ? 0 : (i * (W - PAD_L - PAD_R)) / (n - 1));
    const y = (v) => H - PAD_B - (v / yMax) * (H - PAD_T - PAD_B);
    for (const frac of [0, 0.5, 1]) {
      const yy = y(frac * yMax);
      svg.appendChild(svgEl("line", { x1: PAD_L, x2: W - PAD_R, y1: yy, y2: yy, class: "grid" }));
      const label = svgEl("text", { x: PAD_L - 4, y: yy + 3, "text-anchor": "end" });
      label.textContent = fmt(frac * yMax);
      svg.appendChild(label);
    }
    const base = new Array(n).fill(0);
    for (const s of series) {
      if (opts.stacked) {
        const upper = [];
        for (let i = 0; i < n; i++) upper.push(base[i] + (s.values[i] || 0));
        const poly = [];
        for (let i = 0; i < n; i++) poly.push(x(i) + "," + y(upper[i]));
        for (let i = n - 1; i >= 0; i--) poly.push(x(i) + "," + y(base[i]));
        if (n > 0) {
          svg.appendChild(svgEl("polygon", { points: poly.join(" "), fill: s.color,
                                             "fill-opacity": 0.55, stroke: s.color,
                                             "data-series": s.name, "data-points": n }));
        }
        for (let i = 0; i < n; i++) base[i] = upper[i];
      } else {
        let segment = [];
        const flush = () => {
          if (segment.length > 0) {
            svg.appendChild(svgEl("polyline", { points: segment.join(" "), class: "series",
                                                stroke: s.color, "data-series": s.name }));
          }
          segment = [];
        };
        let last = -1;
        for (let i = 0; i < n; i++) {
          const v = s.values[i];
          if (v === null || v === undefined || Number.isNaN(v)) { flush(); continue; }
          segment.push(x(i) + "," + y(v));
          last = i;
        }
        flush();
        if (last >= 0) {  // the newest point, visible even when it is a segment of one
          svg.appendChild(svgEl("circle", { cx: x(last), cy: y(s.values[last]), r: 3,
                                            fill: s.color, "data-series": s.name }));
        }
      }
    }
    svg.setAttribute("data-samples", String(n));
    const legend = $(legendId);
    while (legend.firstChild) legend.removeChild(legend.firstChild);
    for (const s of series) {
      const item = el("span");
      const sw = el("span", null, "swatch");
      sw.style.background = s.color;
      item.appendChild(sw);
      const last = s.values.length ? s.values[s.values.length - 1] : null;
      item.appendChild(document.createTextNode(s.name + " " + (opts.format || fmt)(last)));
      item.setAttribute("data-series", s.name);
      item.setAttribute("data-last", last === null || last === undefined ? "" : String(last));
      legend.appendChild(item);
    }
    if (opts.note) legend.appendChild(el("span", opts.note, "muted"));
  }

  // ---------------------------------------------------------------- summary
  function sampleOf(summary) {
    const s = summary.stats || {};
    const miss = s.miss_tokens || {};
    const lat = s.latency_ms || {};
    return {
      t: summary.time_s, occ: summary.occupancy_blocks || null,
      requests: s.requests_total, hitRequests: s.requests_with_hit_total,
      prompt: s.prompt_tokens_total, cached: s.cached_prompt_tokens_total,
      savedFlops: s.saved_prefill_flops_total, evicted: s.evicted_blocks_total,
      ghost: miss.evicted, ttft50: lat.ttft_p50, ttft99: lat.ttft_p99, itl50: lat.itl_p50,
      itl99: lat.itl_p99,
    };
  }

  function delta(field, i) {
    const a = state.samples[i - 1], b = state.samples[i];
    if (!a || typeof a[field] !== "number" || typeof b[field] !== "number") return null;
    return b[field] - a[field];
  }
  function ratio(num, den, i) {
    const dn = delta(den, i);
    return dn ? delta(num, i) / dn : null;
  }

  const KNOWN = new Set(["requests_total", "requests_with_hit_total", "prompt_tokens_total",
    "cached_prompt_tokens_total", "computed_prompt_tokens_total", "token_hit_rate",
    "request_hit_rate", "saved_prefill_flops_total", "evicted_blocks_total"]);

  function flatten(obj, prefix, out) {
    for (const [k, v] of Object.entries(obj || {})) {
      const name = prefix ? prefix + "." + k : k;
      if (typeof v === "number" || typeof v === "boolean" || typeof v === "string") {
        if (!KNOWN.has(name)) out.push([name, v]);
      } else if (v && typeof v === "object" && !Array.isArray(v) && name !== "tenants") {
        flatten(v, name, out);
      }
    }
    return out;
  }

  function renderCards(summary) {
    const s = summary.stats || {};
    const occ = summary.occupancy_blocks;
    const cards = [
      ["requests", fmt(s.requests_total)],
      ["token hit rate", pct(s.token_hit_rate)],
      ["request hit rate", pct(s.request_hit_rate)],
      ["cached prompt tokens", fmt(s.cached_prompt_tokens_total)],
      ["computed prompt tokens", fmt(s.computed_prompt_tokens_total)],
      ["saved prefill FLOPs", fmt(s.saved_prefill_flops_total)],
      ["TTFT p50 / p99 ms", fmt((s.latency_ms || {}).ttft_p50) + " / " + fmt((s.latency_ms || {}).ttft_p99)],
      ["ITL p50 / p99 ms", fmt((s.latency_ms || {}).itl_p50) + " / " + fmt((s.latency_ms || {}).itl_p99)],
      ["evicted blocks", fmt(s.evicted_blocks_total)],
      ["ghost-hit tokens", fmt((s.miss_tokens || {}).evicted)],
    ];
    if (occ) {
      cards.push(["blocks live / cached / free", occ.live + " / " + occ.cached + " / " + occ.free]);
      if (occ.store !== null && occ.store !== undefined) cards.push(["store blocks", fmt(occ.store)]);
    }
    const root = $("cards");
    while (root.firstChild) root.removeChild(root.firstChild);
    for (const [name, value] of cards) {
      const card = el("div", null, "card");
      card.setAttribute("data-card", name);
      card.appendChild(el("div", value, "value"));
      card.appendChild(el("div", name, "name"));
      root.appendChild(card);
    }
  }

  function renderTenants(summary) {
    const section = $("tenants-section");
    const tenants = summary.tenants;
    if (!tenants || Object.keys(tenants).length === 0) { section.hidden = true; return; }
    section.hidden = false;
    const byTenant = ((summary.stats || {}).retention || {}).by_tenant || {};
    const body = $("tenants").tBodies[0];
    while (body.firstChild) body.removeChild(body.firstChild);
    for (const [name, t] of Object.entries(tenants)) {
      const tr = el("tr");
      tr.setAttribute("data-tenant", name);
      const lat = t.latency_ms || {};
      for (const v of [name, fmt(t.requests_total), pct(t.token_hit_rate),
                       fmt(t.cached_prompt_tokens_total), fmt(t.computed_prompt_tokens_total),
                       fmt(lat.ttft_p50), fmt(lat.itl_p50),
                       fmt((byTenant[name] || {}).retained_blocks || 0)]) tr.appendChild(el("td", v));
      body.appendChild(tr);
    }
  }

  function renderOther(summary) {
    const rows = flatten(summary.stats, "", []);
    const section = $("other-section");
    section.hidden = rows.length === 0;
    const body = $("other").tBodies[0];
    while (body.firstChild) body.removeChild(body.firstChild);
    for (const [name, v] of rows) {
      const tr = el("tr");
      tr.setAttribute("data-key", name);
      tr.appendChild(el("td", name));
      tr.appendChild(el("td", typeof v === "number" ? fmt(v, 4) : String(v)));
      body.appendChild(tr);
    }
  }

  function renderCharts() {
    const samples = state.samples;
    const idx = samples.map((_, i) => i);
    const occ = (f) => samples.map((s) => (s.occ ? s.occ[f] : null));
    const hasPool = samples.some((s) => s.occ);
    const total = hasPool ? Math.max(...samples.map((s) => (s.occ ? s.occ.total : 0))) : 0;
    const occSeries = [
      { name: "live", color: "#d92d20", values: occ("live") },
      { name: "retained", color: "#7a5af8", values: occ("retained") },
      { name: "cached", color: "#2e90fa", values: occ("cached") },
      { name: "free", color: "#d0d5dd", values: occ("free") },
    ];
    if (samples.some((s) => s.occ && s.occ.store !== null && s.occ.store !== undefined)) {
      occSeries.push({ name: "store", color: "#12b76a", values: occ("store") });
    }
    drawChart("chart-occupancy", "legend-occupancy", hasPool ? occSeries.slice(0, 4) : [],
              { stacked: true, yMax: total, note: hasPool ? null : "pool gauges need an admin key" });
    if (occSeries.length > 4) {  // the store tier is not part of the pool: drawn over it
      const store = occSeries[4];
      const legend = $("legend-occupancy");
      const item = el("span", "store " + fmt(store.values[store.values.length - 1]));
      item.setAttribute("data-series", "store");
      legend.appendChild(item);
    }
    drawChart("chart-hits", "legend-hits", [
      { name: "token hit rate", color: "#2e90fa", values: idx.map((i) => ratio("cached", "prompt", i)) },
      { name: "request hit rate", color: "#f79009", values: idx.map((i) => ratio("hitRequests", "requests", i)) },
    ], { yMax: 1, format: pct });
    drawChart("chart-saved", "legend-saved", [
      { name: "cached tokens/s", color: "#12b76a", values: idx.map((i) => {
        const dt = delta("t", i);
        const d = delta("cached", i);
        return dt && d !== null ? d / dt : null;
      }) },
    ], {});
    drawChart("chart-latency", "legend-latency", [
      { name: "TTFT p50", color: "#2e90fa", values: samples.map((s) => s.ttft50 ?? null) },
      { name: "TTFT p99", color: "#84adff", values: samples.map((s) => s.ttft99 ?? null) },
      { name: "ITL p50", color: "#f79009", values: samples.map((s) => s.itl50 ?? null) },
      { name: "ITL p99", color: "#fec84b", values: samples.map((s) => s.itl99 ?? null) },
    ], {});
    drawChart("chart-evictions", "legend-evictions", [
      { name: "evicted blocks", color: "#d92d20", values: idx.map((i) => delta("evicted", i)) },
      { name: "ghost-hit tokens", color: "#7a5af8", values: idx.map((i) => delta("ghost", i)) },
    ], {});
  }

  async function pollSummary() {
    const summary = await getJSON("/dashboard/api/summary");
    state.summary = summary;
    state.scope = summary.scope === "tenant" ? "tenant " + summary.tenant : "whole server";
    $("scope").textContent = state.scope;
    state.samples.push(sampleOf(summary));
    if (state.samples.length > MAX_SAMPLES) state.samples.shift();
    renderCards(summary);
    renderTenants(summary);
    renderOther(summary);
    renderCharts();
    state.polls += 1;
  }

  // ---------------------------------------------------------------- tree explorer
  function policyKey(key) {  // numbers to 6 significant digits: the key is for reading
    if (key === null || key === undefined) return "–";
    const short = (v) => (typeof v === "number" && !Number.isInteger(v) ? Number(v.toPrecision(6)) : v);
    return JSON.stringify(Array.isArray(key) ? key.map(short) : short(key));
  }

  function stateOf(row) {
    const parts = [];
    if (row.retained) parts.push("retained");
    if (row.locks > 0) parts.push("in use");
    if (row.evictable) parts.push("evictable");
    return parts.join(", ") || "cached";
  }

  function renderTree(tree) {
    $("tree-summary").textContent = tree.num_nodes + " nodes, " + tree.num_blocks +
      " blocks, policy " + tree.eviction_policy + (tree.tenant ? ", tenant " + tree.tenant : "");
    const body = $("tree").tBodies[0];
    while (body.firstChild) body.removeChild(body.firstChild);
    for (const row of tree.top) {
      const tr = el("tr");
      tr.setAttribute("data-node", String(row.id));
      if (row.id === state.selectedNode) tr.className = "selected";
      for (const v of [row.id, row.tenant ?? "–", row.depth_tokens, row.num_blocks,
                       row.subtree_blocks, row.prefix_tokens, row.hit_count,
                       fmt(row.saved_prefill_flops), fmt(row.last_access_age_s),
                       row.locks, stateOf(row),
                       policyKey(row.policy_key)]) {
        tr.appendChild(el("td", String(v)));
      }
      tr.addEventListener("click", () => { state.selectedNode = row.id; pollTree().catch(showError); });
      body.appendChild(tr);
    }
  }

  function renderDetail(detail) {
    const box = $("node-detail");
    state.nodeDetail = detail;
    if (!detail) { box.hidden = true; return; }
    box.hidden = false;
    $("node-title").textContent = "node " + detail.id;
    const dl = $("node-fields");
    while (dl.firstChild) dl.removeChild(dl.firstChild);
    const fields = [["tenant", detail.tenant ?? "–"], ["path (ancestors)", detail.path.join(" › ") || "(top level)"],
      ["depth", detail.depth_tokens + " tokens"], ["blocks", detail.num_blocks + " (" + detail.num_tokens + " tokens)"],
      ["subtree blocks", detail.subtree_blocks], ["hits", detail.hit_count],
      ["saved prefill FLOPs", fmt(detail.saved_prefill_flops)], ["last use", fmt(detail.last_access_age_s) + " s ago"],
      ["locks", detail.locks], ["state", stateOf(detail)],
      ["policy key", detail.policy_key === null ? "– (not an evictable leaf)" : policyKey(detail.policy_key)]];
    if (detail.cache_salt !== undefined) fields.push(["cache salt", detail.cache_salt ?? "(none)"]);
    for (const [k, v] of fields) { dl.appendChild(el("dt", k)); dl.appendChild(el("dd", String(v))); }
    const body = $("node-children").tBodies[0];
    while (body.firstChild) body.removeChild(body.firstChild);
    for (const c of detail.children) {
      const tr = el("tr");
      tr.setAttribute("data-node", String(c.id));
      for (const v of [c.id, c.num_blocks, c.subtree_blocks, c.hit_count, fmt(c.last_access_age_s)]) tr.appendChild(el("td", String(v)));
      tr.addEventListener("click", () => { state.selectedNode = c.id; pollTree().catch(showError); });
      body.appendChild(tr);
    }
    const hasText = typeof detail.text === "string";
    $("node-text-title").hidden = !hasText;
    $("node-text").hidden = !hasText;
    $("node-text").textContent = hasText ? detail.text + (detail.tokens_truncated ? " …" : "") : "";
  }

  async function pollTree() {
    const params = new URLSearchParams({ sort: $("tree-sort").value, top: String(treeTop()) });
    if (state.selectedNode !== null) params.set("node", String(state.selectedNode));
    let tree;
    try {
      tree = await getJSON("/dashboard/api/tree?" + params.toString());
    } catch (err) {
      if (err.status === 404 && state.selectedNode !== null) {  // evicted meanwhile
        state.selectedNode = null;
        return pollTree();
      }
      throw err;
    }
    state.tree = tree;
    renderTree(tree);
    renderDetail(tree.node);
    state.treePolls += 1;
  }

  function treeTop() {
    const v = parseInt($("tree-top").value, 10);
    return Number.isInteger(v) ? Math.min(500, Math.max(1, v)) : 20;
  }

  // ---------------------------------------------------------------- loop
  function showError(err) {
    state.lastError = String(err && err.message ? err.message : err);
    const status = $("status");
    status.textContent = state.lastError + (err && err.status === 401 ? " (enter a key)" : "");
    status.className = "error";
  }

  async function tick() {
    try {
      await pollSummary();
      await pollTree();
      state.lastError = null;
      const status = $("status");
      status.textContent = "updated " + new Date().toLocaleTimeString() + ", every " + intervalMs + " ms";
      status.className = "muted";
    } catch (err) {
      showError(err);
    }
    window.setTimeout(tick, intervalMs);
  }

  $("key-form").addEventListener("submit", (ev) => {
    ev.preventDefault();
    key = $("key-input").value.trim();
    window.sessionStorage.setItem("radixkv-key", key);
    state.samples.length = 0;
  });
  $("tree-sort").addEventListener("change", () => pollTree().catch(showError));
  $("tree-top").addEventListener("change", () => pollTree().catch(showError));
  tick();
})();
