// The swarm dashboard page: polls the JSON API every 2 s and draws with plain SVG.
// No dependencies and no build step; every value from the API is inserted as text.
"use strict";

const POLL_MS = 2000;
const PAGE_SIZE = 50; // peers per page; every total and the summary cover the whole swarm
const MAX_TIMELINE = 80;
const PALETTE = [
  "#2563eb", "#16a34a", "#d97706", "#9333ea", "#0891b2",
  "#db2777", "#4f46e5", "#65a30d", "#dc2626", "#0d9488",
];
const SWARM_COLOR = "#111827";
const MIN_SPAN_S = 30;
const TIME_STEPS_S = [5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200, 14400];
const SVG_NS = "http://www.w3.org/2000/svg";
const colors = new Map();
let page = 1;

// ---- small helpers -------------------------------------------------------------------------

const $ = (id) => document.getElementById(id);

function el(tag, attrs = {}, text = null) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs)) node.setAttribute(key, value);
  if (text !== null) node.textContent = text;
  return node;
}

function svg(tag, attrs = {}, text = null) {
  const node = document.createElementNS(SVG_NS, tag);
  for (const [key, value] of Object.entries(attrs)) node.setAttribute(key, value);
  if (text !== null) node.textContent = text;
  return node;
}

function colorOf(peerId) {
  if (!colors.has(peerId)) colors.set(peerId, PALETTE[colors.size % PALETTE.length]);
  return colors.get(peerId);
}

const shortId = (id) => (id.length > 16 ? "…" + id.slice(-8) : id);
const isNum = (x) => typeof x === "number" && Number.isFinite(x);

function fmtNum(x, digits = 3) {
  return isNum(x) ? x.toFixed(digits) : "–";
}

function fmtCount(x) {
  if (!isNum(x)) return "–";
  if (Math.abs(x) >= 1e6) return (x / 1e6).toFixed(1) + "M";
  if (Math.abs(x) >= 1e4) return (x / 1e3).toFixed(1) + "k";
  return Math.round(x).toLocaleString("en-US");
}

function fmtBytes(x) {
  if (!isNum(x)) return "–";
  const units = ["B", "KB", "MB", "GB", "TB"];
  let i = 0;
  while (Math.abs(x) >= 1000 && i < units.length - 1) { x /= 1000; i += 1; }
  return (i ? x.toFixed(1) : String(Math.round(x))) + " " + units[i];
}

const fmtPct = (x) => (isNum(x) ? (100 * x).toFixed(1) + "%" : "–");

function fmtDrift(x) {
  if (!isNum(x)) return "–";
  if (x === 0) return "0";
  return x < 1e-3 ? x.toExponential(1) : x.toFixed(4);
}

function fmtAgo(seconds) {
  if (!isNum(seconds)) return "–";
  if (seconds < 1.5) return "now";
  if (seconds < 90) return Math.round(seconds) + " s ago";
  if (seconds < 5400) return Math.round(seconds / 60) + " min ago";
  return Math.round(seconds / 3600) + " h ago";
}

function fmtEta(seconds) {
  if (!isNum(seconds)) return "–";
  if (seconds < 90) return Math.round(seconds) + " s";
  if (seconds < 5400) return Math.round(seconds / 60) + " min";
  return (seconds / 3600).toFixed(1) + " h";
}

function fmtClock(t, withSeconds = true) {
  const d = new Date(t * 1000);
  const pad = (n) => String(n).padStart(2, "0");
  const hm = pad(d.getHours()) + ":" + pad(d.getMinutes());
  return withSeconds ? hm + ":" + pad(d.getSeconds()) : hm;
}

function niceStep(range, count) {
  const raw = range / Math.max(count, 1);
  const magnitude = 10 ** Math.floor(Math.log10(raw));
  const norm = raw / magnitude;
  return (norm < 1.5 ? 1 : norm < 3 ? 2 : norm < 7 ? 5 : 10) * magnitude;
}

function fmtTick(value, step) {
  if (Math.abs(value) >= 1e4) return fmtCount(value);
  const digits = Math.max(0, Math.min(4, -Math.floor(Math.log10(step))));
  return value.toFixed(digits);
}

// ---- charts --------------------------------------------------------------------------------

function prepare(node) {
  const width = node.clientWidth || 400;
  const height = node.clientHeight || 190;
  node.replaceChildren();
  node.setAttribute("viewBox", `0 0 ${width} ${height}`);
  return { width, height, m: { l: 46, r: 10, t: 8, b: 22 } };
}

function emptyChart(node, box, message) {
  node.dataset.points = "0";
  node.appendChild(svg("text", {
    x: box.width / 2, y: box.height / 2, "text-anchor": "middle", class: "empty",
  }, message));
}

// series: [{color, width, points: [[t, y], ...], dots}]; y may be null (a gap).
function lineChart(node, series, opts = {}) {
  const box = prepare(node);
  const { m, width, height } = box;
  const drawn = series.flatMap((s) => s.points.filter((p) => isNum(p[1])));
  if (!drawn.length) return emptyChart(node, box, opts.empty || "waiting for data…");
  node.dataset.points = String(drawn.length);

  let [t0, t1] = opts.domain || [
    Math.min(...drawn.map((p) => p[0])), Math.max(...drawn.map((p) => p[0])),
  ];
  if (t1 - t0 < MIN_SPAN_S) t0 = t1 - MIN_SPAN_S;
  let y0 = Math.min(...drawn.map((p) => p[1]));
  let y1 = Math.max(...drawn.map((p) => p[1]));
  if (opts.zero) y0 = Math.min(0, y0);
  if (opts.max !== undefined) y1 = Math.max(y1, opts.max);
  if (y1 - y0 < 1e-9) { y1 += Math.abs(y1) * 0.05 || 1; y0 -= opts.zero ? 0 : Math.abs(y0) * 0.05 || 1; }
  const yStep = niceStep(y1 - y0, 4);
  y0 = Math.floor(y0 / yStep) * yStep;
  y1 = Math.ceil(y1 / yStep) * yStep;

  const X = (t) => m.l + ((t - t0) / (t1 - t0)) * (width - m.l - m.r);
  const Y = (y) => height - m.b - ((y - y0) / (y1 - y0)) * (height - m.t - m.b);

  for (let y = y0; y <= y1 + yStep / 2; y += yStep) {
    node.appendChild(svg("line", { x1: m.l, x2: width - m.r, y1: Y(y), y2: Y(y), class: "grid" }));
    const label = opts.percent ? Math.round(100 * y) + "%" : fmtTick(y, yStep);
    node.appendChild(svg("text", { x: m.l - 6, y: Y(y) + 4, "text-anchor": "end" }, label));
  }
  const maxTicks = Math.max(2, Math.floor((width - m.l - m.r) / 80));
  const tStep = TIME_STEPS_S.find((s) => (t1 - t0) / s <= maxTicks) || TIME_STEPS_S.at(-1);
  for (let t = Math.ceil(t0 / tStep) * tStep; t <= t1; t += tStep) {
    if (X(t) < m.l + 20 || X(t) > width - m.r - 20) continue; // it would spill over an edge
    node.appendChild(svg("text", {
      x: X(t), y: height - 6, "text-anchor": "middle",
    }, fmtClock(t, tStep < 60)));
  }
  node.appendChild(svg("line", {
    x1: m.l, x2: width - m.r, y1: height - m.b, y2: height - m.b, class: "axis",
  }));

  for (const s of series) {
    let d = "";
    let pen = "M";
    for (const [t, y] of s.points) {
      if (!isNum(y)) { pen = "M"; continue; }
      d += `${pen}${X(t).toFixed(1)},${Y(y).toFixed(1)}`;
      pen = "L";
    }
    if (s.area && d) {
      const first = s.points.find((p) => isNum(p[1]));
      const last = s.points.filter((p) => isNum(p[1])).at(-1);
      const base = Y(Math.max(y0, 0));
      node.appendChild(svg("path", {
        d: `${d}L${X(last[0]).toFixed(1)},${base}L${X(first[0]).toFixed(1)},${base}Z`,
        fill: s.color, "fill-opacity": "0.1", stroke: "none",
      }));
    }
    node.appendChild(svg("path", {
      d, fill: "none", stroke: s.color, "stroke-width": s.width || 1.5,
      "stroke-linejoin": "round", "stroke-linecap": "round", opacity: s.faded ? 0.35 : 1,
    }));
    if (s.dots) {
      for (const [t, y] of s.points) {
        if (isNum(y)) node.appendChild(svg("circle", {
          cx: X(t), cy: Y(y), r: 2.4, fill: s.color, opacity: s.faded ? 0.35 : 1, class: "point",
        }));
      }
    }
  }
}

function barChart(node, buckets) {
  const box = prepare(node);
  const { m, width, height } = box;
  const total = buckets.reduce((sum, b) => sum + b.count, 0);
  if (!total) return emptyChart(node, box, "no update merged yet");
  node.dataset.points = String(total);
  const top = Math.max(...buckets.map((b) => b.count));
  const slot = (width - m.l - m.r) / buckets.length;
  const Y = (c) => height - m.b - (c / top) * (height - m.t - m.b - 14);
  node.appendChild(svg("line", {
    x1: m.l, x2: width - m.r, y1: height - m.b, y2: height - m.b, class: "axis",
  }));
  buckets.forEach((b, i) => {
    const x = m.l + i * slot + slot * 0.15;
    const w = slot * 0.7;
    if (b.count) {
      node.appendChild(svg("rect", {
        x, y: Y(b.count), width: w, height: height - m.b - Y(b.count), rx: 2, class: "bar",
      }));
    }
    node.appendChild(svg("text", {
      x: x + w / 2, y: Y(b.count) - 4, "text-anchor": "middle", class: "bar-label",
    }, fmtCount(b.count)));
    node.appendChild(svg("text", {
      x: x + w / 2, y: height - 6, "text-anchor": "middle",
    }, b.label));
  });
  node.appendChild(svg("text", { x: m.l - 6, y: height - 6, "text-anchor": "end" }, "stale:"));
}

// ---- rendering -----------------------------------------------------------------------------

function renderHeader(swarm) {
  $("run-id").textContent = swarm.run_id;
  $("fingerprint").textContent = swarm.fingerprint ? swarm.fingerprint.slice(0, 12) : "";
  const local = swarm.peers.find((p) => p.local);
  $("mode").textContent = swarm.mode === "embedded"
    ? "embedded in " + (local ? shortId(local.peer_id) : "this node")
    : "standalone observer";
  document.title = `${swarm.totals.peers_alive} alive · ${swarm.run_id} · diloco-node`;
}

function renderKpis(swarm, history) {
  const t = swarm.totals;
  const dead = t.peers_known - t.peers_alive;
  $("peers-alive").textContent = String(t.peers_alive);
  $("peers-known").textContent = `of ${t.peers_known} seen` + (dead ? ` · ${dead} dead` : "");
  $("tokens-per-s").textContent = fmtCount(t.tokens_per_s);
  $("val-loss").textContent = fmtNum(t.val_loss, 4);
  $("goodput").textContent = fmtPct(t.goodput);
  $("goodput-sub").textContent = t.updates_published
    ? `${fmtCount(t.updates_merged)} of ${fmtCount(t.updates_published)} updates everywhere`
    : "no update published yet";
  $("drift").textContent = fmtDrift(t.drift);
  $("wire-bytes").textContent = fmtBytes(t.bytes_sent);
  $("wire-bytes-sub").textContent = `sent by live peers · ${fmtBytes(t.bytes_received)} received`;
  const rate = history.merges_per_minute.at(-1);
  $("merge-rate").textContent = rate ? rate.updates_per_min.toFixed(1) : "–";
  const s = swarm.summary;
  $("learners").textContent = String(s.learners);
  $("learners-sub").textContent = `${s.groups} learner group${s.groups === 1 ? "" : "s"} of peers`
    + (Object.keys(s.shards).length ? ` · ${Object.keys(s.shards).length} shards` : "");
  $("updates-lost").textContent = fmtCount(s.lost);
  $("updates-lost-sub").textContent = s.need_state
    ? `${fmtCount(s.need_state)} waiting for a state · ${s.peers_need_state} peer${s.peers_need_state === 1 ? "" : "s"}`
    : "summed over live peers";
  const q = s.val_loss || s.loss;
  $("loss-spread").textContent = q ? fmtNum(q.median, 4) : "–";
  $("loss-spread-sub").textContent = q
    ? `${s.val_loss ? "val loss" : "loss"} median · p10 ${fmtNum(q.p10, 3)} · p90 ${fmtNum(q.p90, 3)}`
    : "no loss reported yet";
}

// One time axis for every chart: from the oldest sample kept to the latest reading.
function timeDomain(swarm, history) {
  const starts = [history.swarm[0], ...history.peers.map((s) => s.points[0])]
    .filter(Boolean).map((p) => p.t);
  const t1 = swarm.generated_at;
  return [Math.min(t1, ...starts), t1];
}

function renderCharts(swarm, history) {
  const domain = timeDomain(swarm, history);
  // Only this page's peers are known here: a series fades when its peer is dead on this page.
  const dead = new Set(swarm.peers.filter((p) => !p.alive).map((p) => p.peer_id));
  const peerSeries = history.peers.map((s) => ({
    color: colorOf(s.peer_id),
    faded: dead.has(s.peer_id),
    dots: true,
    points: s.points.map((p) => [p.t, isNum(p.val_loss) ? p.val_loss : null]),
  }));
  const swarmLoss = {
    color: SWARM_COLOR, width: 2.5,
    points: history.swarm.map((p) => [p.t, p.val_loss]),
  };
  lineChart($("loss-chart"), [...peerSeries, swarmLoss], {
    domain, empty: "waiting for a finished round…",
  });
  renderLegend(history.peers, dead);

  lineChart($("throughput-chart"), [{
    color: "#2563eb", width: 2, area: true,
    points: history.swarm.map((p) => [p.t, p.tokens_per_s]),
  }], { domain, zero: true });
  lineChart($("merge-chart"), [{
    color: "#9333ea", width: 2, area: true,
    points: history.merges_per_minute.map((p) => [p.t, p.updates_per_min]),
  }], { domain, zero: true });
  lineChart($("goodput-chart"), [{
    color: "#16a34a", width: 2, area: true,
    points: history.swarm.map((p) => [p.t, p.goodput]),
  }], { domain, zero: true, max: 1, percent: true, empty: "no update published yet" });
  barChart($("staleness-chart"), swarm.staleness_histogram);
}

function renderLegend(peers, dead) {
  const legend = $("loss-legend");
  legend.replaceChildren();
  const swarmItem = el("span");
  swarmItem.append(el("span", { class: "swatch", style: `background:${SWARM_COLOR}` }), "swarm mean");
  legend.append(swarmItem);
  for (const s of peers) {
    const item = el("span", { title: s.peer_id, class: dead.has(s.peer_id) ? "dead" : "" });
    item.append(el("span", { class: "swatch", style: `background:${colorOf(s.peer_id)}` }));
    item.append((s.org ? s.org + " " : "") + shortId(s.peer_id));
    legend.append(item);
  }
}

function fmtPaths(paths) {
  // "1 direct · 2 relayed": each path with at least one connected peer; "–" if none reported.
  const kinds = ["direct", "holepunched", "relayed"].filter((k) => (paths || {})[k] > 0);
  return kinds.length ? kinds.map((k) => `${paths[k]} ${k}`).join(" · ") : "–";
}

function fmtCodec(p) {
  // "topk (auto) · 625.0 KB/s" from a peer's heartbeat (node.status.codec_label); "?" for
  // what it does not report, alone when it reports neither (a node of an earlier version).
  const measured = isNum(p.uplink_bytes_per_s);
  if (!p.codec && !measured) return "?";
  const sends = p.codec ? p.codec + (p.codec_auto ? " (auto)" : "") : "?";
  return `${sends} · ${measured ? fmtBytes(p.uplink_bytes_per_s) + "/s" : "?"}`;
}

function peerOrder(a, b) {
  return (b.alive - a.alive) || (b.local - a.local) || a.org.localeCompare(b.org)
    || a.peer_id.localeCompare(b.peer_id);
}

function renderPeers(swarm) {
  const body = $("peers").tBodies[0];
  body.replaceChildren();
  const peers = [...swarm.peers].sort(peerOrder);
  if (!peers.length) {
    const row = el("tr", { class: "empty-row" });
    row.append(el("td", { colspan: "15" }, "no peer has sent a heartbeat yet"));
    body.append(row);
  }
  for (const p of peers) {
    const row = el("tr", { "data-peer-id": p.peer_id, class: p.alive ? "alive" : "dead" });
    const peer = el("td", { title: p.peer_id });
    const label = el("span", { class: "peer" });
    label.append(el("span", { class: "swatch", style: `background:${colorOf(p.peer_id)}` }));
    label.append(el("code", {}, shortId(p.peer_id)));
    if (p.local) label.append(el("span", { class: "tag" }, "this node"));
    peer.append(label);
    const state = el("td");
    state.append(el("span", { class: "badge " + p.state }, p.state));
    row.append(peer, el("td", {}, p.org || "–"), state,
      el("td", { class: "num" }, String(p.round)),
      el("td", { class: "num" }, fmtCount(p.tokens_per_s)),
      el("td", { class: "num" }, fmtNum(p.loss, 4)),
      el("td", { class: "num" }, fmtNum(p.val_loss, 4)),
      el("td", { class: "num" }, fmtCount(p.updates_published)),
      el("td", { class: "num" }, fmtCount(p.updates_merged)),
      el("td", { class: "num" }, fmtNum(p.staleness_mean, 2)),
      el("td", { class: "num" }, fmtDrift(p.drift)),
      el("td", { class: "num lost", title: "updates lost; +N waiting for a state download (not lost)" },
        p.num_need_state ? `${p.num_lost} +${p.num_need_state}` : String(p.num_lost)),
      el("td", { class: "paths", title: "connected peers: direct, hole-punched, relayed" },
        fmtPaths(p.paths)),
      el("td", { class: "codec", title: "the codec it sends with (auto: picked from its measured uplink) · its uplink" },
        fmtCodec(p)),
      el("td", { class: "num seen" }, fmtAgo(p.last_seen_s)));
    body.append(row);
  }
  const t = swarm.totals;
  const dead = t.peers_known - t.peers_alive;
  $("peers-hint").textContent = `${t.peers_alive} alive` + (dead ? `, ${dead} dead` : "");
  const pg = swarm.page;
  const first = pg.total ? (pg.number - 1) * pg.size + 1 : 0;
  $("page-label").textContent =
    `peers ${first}–${first + peers.length - (pg.total ? 1 : 0)} of ${pg.total} · page ${pg.number} / ${pg.pages}`;
  $("page-prev").disabled = pg.number <= 1;
  $("page-next").disabled = pg.number >= pg.pages;
}

function renderRejections(swarm) {
  const body = $("rejections").tBodies[0];
  body.replaceChildren();
  const rows = swarm.rejections; // summed over every peer by the server, most refused first
  if (!rows.length) {
    const row = el("tr", { class: "empty-row" });
    row.append(el("td", { colspan: "4" }, "no peer has refused anything"));
    body.append(row);
  }
  for (const r of rows) {
    const row = el("tr", { "data-offender": r.offender });
    const who = el("td", { title: r.offender });
    who.append(el("code", {}, shortId(r.offender)));
    const reasons = el("td", { class: "reasons" });
    for (const [reason, count] of Object.entries(r.reasons).sort((a, b) => b[1] - a[1])) {
      reasons.append(el("span", { class: "reason", "data-reason": reason, "data-count": String(count) },
        `${fmtCount(count)} ${reason}`));
    }
    const by = el("td");
    for (const peerId of r.reporters) {
      by.append(el("code", { title: peerId, style: `color:${colorOf(peerId)}` }, shortId(peerId)), " ");
    }
    if (r.reporters_total > r.reporters.length) by.append(`+${r.reporters_total - r.reporters.length} more`);
    row.append(who, el("td", { class: "num" }, fmtCount(r.total)), reasons, by);
    body.append(row);
  }
}

function renderOrgs(swarm) {
  const body = $("orgs").tBodies[0];
  body.replaceChildren();
  const total = swarm.totals.tokens_per_s;
  for (const o of swarm.orgs) {
    const share = total > 0 ? o.tokens_per_s / total : 0;
    const bar = el("div", { class: "share" });
    const track = el("div", { class: "track" });
    track.append(el("div", { class: "fill", style: `width:${(100 * share).toFixed(1)}%` }));
    bar.append(track, el("span", { class: "pct" }, fmtPct(share)));
    const cell = el("td");
    cell.append(bar);
    const row = el("tr");
    row.append(el("td", {}, o.org || "(no org)"),
      el("td", { class: "num" }, `${o.peers_alive} / ${o.peers_known}`), cell,
      el("td", { class: "num" }, fmtCount(o.updates_published)),
      el("td", { class: "num" }, fmtCount(o.updates_merged)),
      el("td", { class: "num" }, fmtPct(o.goodput)));
    body.append(row);
  }
}

function renderTimeline(history) {
  const list = $("timeline");
  list.replaceChildren();
  const events = history.timeline.slice(-MAX_TIMELINE).reverse();
  if (!events.length) list.append(el("li", { class: "none" }, "nothing has happened yet"));
  for (const e of events) {
    const item = el("li", { "data-kind": e.kind });
    const who = el("code", { title: e.peer_id, style: `color:${colorOf(e.peer_id)}` }, shortId(e.peer_id));
    item.append(el("time", {}, fmtClock(e.t)), el("span", { class: "kind " + e.kind }, e.kind), who,
      el("span", { class: "detail", title: e.detail }, e.detail));
    list.append(item);
  }
}

// A state download in progress (embedded: the node's own), hidden otherwise.
function renderDownload(node) {
  const d = node && node.state_download;
  $("download").hidden = !d;
  if (!d) return;
  const total = d.total_bytes ? ` of ${fmtBytes(d.total_bytes)}` : "";
  const rate = isNum(d.bytes_per_s) ? ` · ${fmtBytes(d.bytes_per_s)}/s` : "";
  const eta = isNum(d.eta_s) ? ` · ${fmtEta(d.eta_s)} left` : "";
  $("download-text").textContent =
    `downloading the replica from ${shortId(d.peer_id)}: ${fmtBytes(d.num_bytes)}${total}${rate}${eta}`;
  $("download-bar").value = d.total_bytes ? d.num_bytes / d.total_bytes : 0;
}

// The codec this node sends with and the uplink measured from its sends (embedded only).
function renderCodec(node) {
  const codec = node && node.codec;
  const uplink = node && isNum(node.uplink_bytes_per_s)
    ? ` · uplink ${fmtBytes(node.uplink_bytes_per_s)}/s`
    : "";
  $("codec").textContent = codec ? `sends ${codec}${node.codec_auto ? " (auto)" : ""}${uplink}` : "";
}

// ---- polling -------------------------------------------------------------------------------

class Unauthorized extends Error {}

async function getJSON(path) {
  const response = await fetch(path, { cache: "no-store", credentials: "same-origin" });
  if (response.status === 401) throw new Unauthorized();
  if (!response.ok) throw new Error(`${path}: HTTP ${response.status}`);
  return response.json();
}

function setConnection(kind, text) {
  $("connection").className = "connection " + kind;
  $("connection-text").textContent = text;
}

function setBanner(text) {
  const banner = $("banner");
  banner.hidden = !text;
  banner.textContent = text || "";
}

async function refresh() {
  const asked = page;
  try {
    const [swarm, history] = await Promise.all([
      getJSON(`/api/swarm?page=${asked}&page_size=${PAGE_SIZE}`),
      getJSON("/api/history?max_points=400"),
    ]);
    if (page !== asked) return; // the page was turned meanwhile: its own refresh draws it
    page = swarm.page.number; // the last page, when the swarm shrank below the one asked for
    // Colors follow the order peers were first seen, so they stay put across refreshes.
    [...swarm.peers].sort(peerOrder).forEach((p) => colorOf(p.peer_id));
    renderHeader(swarm);
    renderKpis(swarm, history);
    renderCharts(swarm, history);
    renderPeers(swarm);
    renderRejections(swarm);
    renderOrgs(swarm);
    renderTimeline(history);
    const node = swarm.mode === "embedded" ? await getJSON("/api/node").catch(() => null) : null;
    renderDownload(node);
    renderCodec(node);
    setBanner(null);
    setConnection("live", "live · " + fmtClock(swarm.generated_at));
  } catch (error) {
    if (error instanceof Unauthorized) {
      setBanner("This dashboard needs its token: open /?token=TOKEN once in this browser.");
    }
    setConnection("down", "disconnected · retrying");
  }
}

async function tick() {
  await refresh();
  setTimeout(tick, POLL_MS);
}

function turnPage(step) {
  page = Math.max(1, page + step);
  refresh();
}

$("page-prev").addEventListener("click", () => turnPage(-1));
$("page-next").addEventListener("click", () => turnPage(1));
tick();
