"""The live view's page: one HTML file with its script inline (no build step, no external files)."""

PAGE = r"""<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>k2edge: streams</title>
<link rel="icon" href="data:,">
<style>
 body { font-family: system-ui, sans-serif; margin: 1rem; background: #f6f6f4; color: #222; }
 h1 { font-size: 1.3rem; } h2 { font-size: 1.1rem; margin: 0 0 .4rem; }
 .stream { background: #fff; border: 1px solid #ddd; border-radius: 6px; padding: .8rem; margin-bottom: 1rem; }
 .row { display: flex; gap: 1rem; flex-wrap: wrap; }
 img.frame { max-width: 640px; width: 100%; background: #333; min-height: 120px; }
 table.figures td { padding: 0 .6rem 0 0; font-size: .9rem; }
 .warning { color: #a40; } .state-up { color: #080; } .state-reconnecting, .state-down { color: #a00; }
 .state-paused { color: #a40; }
 ul.events { list-style: none; padding: 0; margin: 0; max-height: 520px; overflow-y: auto; }
 ul.events li { display: flex; gap: .5rem; align-items: center; border-bottom: 1px solid #eee; padding: .2rem 0; font-size: .85rem; }
 img.snapshot { width: 120px; }
 pre { font-size: .8rem; margin: 0; }
</style>
</head>
<body>
<h1>k2edge: streams</h1>
<div id="streams"><p>loading...</p></div>
<script>
"use strict";
const el = (tag, attrs = {}, ...kids) => {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) e.setAttribute(k, v);
  for (const k of kids) e.append(k);
  return e;
};
const boxes = {};
function box(name) {
  if (boxes[name]) return boxes[name];
  const img = el("img", {class: "frame", alt: "newest processed frame of " + name, "data-stream": name, "data-frame": ""});
  const figures = el("table", {class: "figures"});
  const warnings = el("div", {class: "warnings"});
  const events = el("ul", {class: "events", "data-stream": name});
  const div = el("div", {class: "stream", id: "stream-" + name},
                 el("h2", {}, name), warnings,
                 el("div", {class: "row"}, img, el("div", {}, figures, el("h3", {}, "recent events"), events)));
  document.getElementById("streams").append(div);
  boxes[name] = {div, img, figures, warnings, events, known: new Set(), busy: false};
  return boxes[name];
}
function counts(c) {
  const parts = [];
  for (const [z, v] of Object.entries(c.zones || {})) parts.push("zone " + z + ": inside " + JSON.stringify(v.inside) + ", entered " + JSON.stringify(v.entered));
  for (const [l, v] of Object.entries(c.lines || {})) parts.push("line " + l + ": in " + JSON.stringify(v.in) + ", out " + JSON.stringify(v.out));
  return parts.join("; ") || "no zones or lines";
}
function limit(l) {
  if (!l) return "-";
  const since = l.since ? " (since " + new Date(l.since * 1000).toLocaleTimeString() + ")" : "";
  return (l.max_fps === null ? "its own rate" : l.max_fps + " fps") + ": " + l.reason + since;
}
async function refreshStatus() {
  const streams = await (await fetch("api/streams")).json();
  const root = document.getElementById("streams");
  if (!Object.keys(streams).length) { root.textContent = "no streams configured"; return; }
  if (root.firstElementChild && root.firstElementChild.tagName === "P") root.textContent = "";
  for (const [name, s] of Object.entries(streams)) {
    const b = box(name);
    const age = s.frame_age_ms || {};
    const rows = [["state", s.state], ["fps in / processed", s.fps_in + " / " + s.fps_processed],
                  ["frame age p50 / p99", age.p50 === null ? "-" : age.p50 + " / " + age.p99 + " ms"],
                  ["frame size", s.frame_size ? s.frame_size.join("x") : "-"],
                  ["max fps (thermal)", limit(s.limit)], ["dropped / shed", s.dropped + " / " + (s.shed || 0)],
                  ["reconnects", s.reconnects], ["last error", s.last_error || "-"],
                  ["counts", counts(s.counts || {})]];
    b.figures.replaceChildren(...rows.map(([k, v]) => el("tr", {}, el("td", {}, k), el("td", {class: k === "state" ? "state-" + v : ""}, String(v)))));
    b.warnings.replaceChildren(...(s.warnings || []).map(w => el("div", {class: "warning"}, "warning: " + w)));
  }
}
async function refreshEvents() {
  const events = await (await fetch("api/events?limit=100")).json();
  for (const e of events.slice().reverse()) {
    const b = boxes[e.stream];
    if (!b || b.known.has(e.event_id)) continue;
    b.known.add(e.event_id);
    const text = [e.event, e.label !== undefined ? e.label + " #" + e.track_id : "", e.zone || e.line || "",
                  e.direction || "", e.reason || "", new Date(e.time * 1000).toLocaleTimeString()].filter(Boolean).join(" ");
    const li = el("li", {class: "event", "data-event": e.event_id, "data-kind": e.event});
    if (e.snapshot) li.append(el("a", {href: "events/" + e.event_id + "/snapshot.jpg"},
                                 el("img", {class: "snapshot", src: "events/" + e.event_id + "/snapshot.jpg", alt: "snapshot"})));
    else if (e.snapshot_error) li.append(el("span", {class: "warning"}, e.snapshot_error));
    if (e.event === "clip_ready" && e.clip) li.append(el("a", {class: "clip", href: "events/" + e.for_event + "/clip.mp4"}, "clip"));
    else if (e.clip_error) li.append(el("span", {class: "warning"}, e.clip_error));
    li.append(el("span", {}, text));
    b.events.prepend(li);
  }
}
async function refreshFrame(name) {
  const b = boxes[name];
  if (b.busy) return;
  b.busy = true;
  try {
    const r = await fetch("streams/" + encodeURIComponent(name) + "/frame.jpg", {cache: "no-store"});
    if (r.ok) {
      const index = r.headers.get("X-Frame-Index");
      if (index !== b.img.getAttribute("data-frame")) {
        const url = URL.createObjectURL(await r.blob());
        const old = b.img.src;
        b.img.onload = () => { b.img.setAttribute("data-frame", index); if (old.startsWith("blob:")) URL.revokeObjectURL(old); };
        b.img.src = url;
      }
    }
  } catch (err) { /* the daemon restarting: the next turn tries again */ }
  b.busy = false;
}
async function tick() {
  try { await refreshStatus(); await refreshEvents(); } catch (err) { /* try again next turn */ }
}
tick();
setInterval(tick, 1000);
setInterval(() => { if (!document.hidden) for (const name of Object.keys(boxes)) refreshFrame(name); }, 200);
</script>
</body>
</html>
"""
