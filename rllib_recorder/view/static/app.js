// rllib-recorder view: the page. Three views by URL: the runs (/), a run (?run=ID), an episode
// (?run=ID&file=NAME&episode=ID&t=STEP). Part of rllib-recorder (Apache-2.0, see LICENSE.txt).
// Every string read from a recording is put on the page as text (textContent, attribute values, canvas text):
// nothing from a recording is ever parsed as markup.
"use strict";

(function () {
  const {Chart, COLORS, fmt} = window.Charts;
  const main = document.getElementById("main");
  const crumbs = document.getElementById("crumbs");
  const params = new URLSearchParams(location.search);

  // ------------------------------------------------------------------------------------------- helpers

  function el(tag, props, ...children) {
    const node = document.createElement(tag);
    for (const [key, value] of Object.entries(props || {})) {
      if (value === undefined || value === null) continue;
      if (key === "text") node.textContent = value;
      else if (key === "class") node.className = value;
      else if (key.startsWith("on")) node.addEventListener(key.slice(2), value);
      else node.setAttribute(key, value);
    }
    for (const child of children) {
      if (child === null || child === undefined) continue;
      node.append(child instanceof Node ? child : document.createTextNode(String(child)));
    }
    return node;
  }

  function href(values) {
    const q = new URLSearchParams();
    for (const [k, v] of Object.entries(values)) if (v !== undefined && v !== null) q.set(k, v);
    return "?" + q.toString();
  }

  async function api(path, values) {
    const response = await fetch("/api/" + path + href(values || {}));
    const data = await response.json();
    if (data && data.error !== undefined && !Array.isArray(data)) throw new Error(data.error);
    return data;
  }

  const B64 = new Uint8Array(128);
  "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/".split("").forEach((c, i) => {
    B64[c.charCodeAt(0)] = i;
  });

  function unbase64(text) {
    let n = text.length;
    while (n && text[n - 1] === "=") n--;
    const out = new Uint8Array(Math.floor(n * 3 / 4));
    let j = 0;
    for (let i = 0; i < n; i += 4) {
      const a = B64[text.charCodeAt(i)], b = B64[text.charCodeAt(i + 1)];
      const c = B64[text.charCodeAt(i + 2)], d = B64[text.charCodeAt(i + 3)];
      out[j++] = (a << 2) | (b >> 4);
      if (j < out.length) out[j++] = ((b & 15) << 4) | (c >> 2);
      if (j < out.length) out[j++] = ((c & 3) << 6) | d;
    }
    return out;
  }

  const TYPES = {f4: Float32Array, f8: Float64Array, i4: Int32Array, u1: Uint8Array};

  function typed(spec) {
    if (!spec) return null;
    const bytes = unbase64(spec.b64);
    return new TYPES[spec.type](bytes.buffer, 0, bytes.length / TYPES[spec.type].BYTES_PER_ELEMENT);
  }

  // the shortest text that reads back as the same float32
  function f32(v) {
    if (!isFinite(v)) return String(v);
    for (let p = 1; p <= 9; p++) {
      const s = v.toPrecision(p);
      if (Math.fround(Number(s)) === v) return String(Number(s));
    }
    return String(v);
  }

  function number(v) {
    if (v === null || v === undefined) return "—";
    if (typeof v === "string") return v;
    return Math.abs(v) >= 1000 ? v.toLocaleString("en-US", {maximumFractionDigits: 1}) : String(+v.toPrecision(4));
  }

  function bytes(n) {
    if (n === null || n === undefined) return "—";
    const units = ["B", "kB", "MB", "GB", "TB"];
    let i = 0;
    while (n >= 1000 && i < units.length - 1) { n /= 1000; i++; }
    return (i ? n.toFixed(n >= 100 ? 0 : 1) : n) + " " + units[i];
  }

  function setCrumbs(...items) {
    crumbs.replaceChildren(...items.flatMap((item, i) => (i ? [el("span", {class: "sep", text: "›"}), item] : [item])));
  }

  function ready(name) {
    requestAnimationFrame(() => { document.body.dataset.ready = name; window.__painted = performance.now(); });
  }

  function failed(error) {
    main.replaceChildren(el("p", {class: "error", text: "error: " + error.message}));
    ready("error");
  }

  function verdictCell(cell, runId) {
    cell.textContent = "…";
    return api("verdict", {run: runId}).then((v) => {
      cell.textContent = v.verdict;
      cell.className = "verdict verdict-" + v.verdict.replace(" ", "-");
      const why = v.problems.concat(v.notes).slice(0, 5).join("\n");
      cell.title = (v.summary ? v.summary + "\n" : "") + why;
      return v;
    }).catch((e) => { cell.textContent = "unreadable"; cell.title = e.message; });
  }

  // -------------------------------------------------------------------------------------------- runs

  async function runsPage() {
    setCrumbs(el("span", {text: "runs"}));
    const data = await api("runs");
    const picked = new Set(params.getAll("compare"));
    const table = el("table", {class: "runs", id: "runs"});
    table.append(el("thead", {}, el("tr", {}, ...["", "run", "algorithm on env", "status", "env steps", "episodes",
      "finished", "return mean", "on disk", "verify"].map((h) => el("th", {text: h})))));
    const body = el("tbody");
    table.append(body);
    const cells = new Map();
    let group = null;
    for (const run of data.runs) {
      if (run.group !== group) {
        group = run.group;
        body.append(el("tr", {class: "group"}, el("td", {colspan: 10, text: group || "(runs given)"})));
      }
      const box = el("input", {type: "checkbox", "data-run": run.id});
      box.checked = picked.has(run.id);
      const row = el("tr", {class: "run", "data-run": run.id},
        el("td", {}, box), el("td", {class: "name"}, el("a", {href: href({run: run.id}), text: run.name})));
      if (run.error) {
        row.append(el("td", {class: "error", colspan: 8, text: "unreadable: " + run.error}));
      } else {
        const c = {
          status: el("td", {class: "status"}), steps: el("td", {class: "num steps"}),
          episodes: el("td", {class: "num episodes"}), finished: el("td", {class: "num finished"}),
          ret: el("td", {class: "num return"}), disk: el("td", {class: "num disk"}), verdict: el("td", {class: "verdict"}),
        };
        row.append(el("td", {class: "what", text: (run.algorithm || "?") + " on " + (run.env || "?")}),
                   c.status, c.steps, c.episodes, c.finished, c.ret, c.disk, c.verdict);
        cells.set(run.id, c);
        fillRun(c, run);
      }
      body.append(row);
    }
    const compare = el("div", {id: "compare"});
    const button = el("button", {text: "overlay the return curves of the picked runs", onclick: () => overlay(table, compare)});
    main.replaceChildren(
      el("h1", {text: "Runs"}),
      el("p", {class: "meta", text: (data.runs.length ? data.runs.length + " run(s) below " : "no runs yet below ") + data.roots.join(", ")}),
      table, el("div", {class: "controls"}, button), compare);
    ready("runs");
    if (picked.size) overlay(table, compare);
    (async () => { for (const [id, c] of cells) await verdictCell(c.verdict, id); })();
    setTimeout(() => refreshRuns(data.runs, cells), data.runs.some((r) => r.recording) ? 2000 : 10000);
  }

  function fillRun(c, run) {
    c.status.textContent = run.status;
    c.status.className = "status" + (run.recording ? " recording" : "") + (run.damaged.length ? " damaged" : "");
    if (run.damaged.length) c.status.textContent += " (damaged: " + run.damaged.join(", ") + ")";
    c.steps.textContent = number(run.env_steps);
    c.episodes.textContent = String(run.episodes);
    c.finished.textContent = String(run.finished);
    c.ret.textContent = number(run.return_mean);
    c.disk.textContent = bytes(run.disk_bytes);
  }

  // the runs' counts follow while any records (every 2 s), and a run that appears is listed (every 10 s)
  async function refreshRuns(before, cells) {
    const data = await api("runs").catch(() => null);
    if (!data) return;
    if (data.runs.map((r) => r.id).join("\0") !== before.map((r) => r.id).join("\0")) {
      runsPage();
      return;
    }
    for (const run of data.runs) if (cells.has(run.id) && !run.error) fillRun(cells.get(run.id), run);
    setTimeout(() => refreshRuns(data.runs, cells), data.runs.some((r) => r.recording) ? 2000 : 10000);
  }

  async function overlay(table, box) {
    const ids = [...table.querySelectorAll("input[data-run]")].filter((b) => b.checked).map((b) => b.dataset.run);
    const q = new URLSearchParams();
    ids.forEach((id) => q.append("compare", id));
    history.replaceState(null, "", ids.length ? "?" + q.toString() : location.pathname);
    box.replaceChildren();
    if (!ids.length) return;
    const chart = new Chart(box, {title: "episode return (moving mean of 1/50 of the episodes) against the run's env steps",
                                  kind: "line", height: 260, alwaysLegend: true});
    const series = [];
    for (const [i, id] of ids.entries()) {
      const run = await api("run", {run: id}).catch(() => null);
      if (!run) continue;
      const points = [];
      for (const c of run.curves) {
        if (c.evaluation) continue;
        const x = typed(c.x), y = typed(c.ret);
        for (let k = 0; k < x.length; k++) points.push([x[k], y[k]]);
      }
      points.sort((a, b) => a[0] - b[0]);
      const window_ = Math.max(1, Math.round(points.length / 50));
      const xs = new Float64Array(points.length), ys = new Float64Array(points.length);
      let sum = 0;
      points.forEach(([x, y], k) => {
        sum += y;
        if (k >= window_) sum -= points[k - window_][1];
        xs[k] = x;
        ys[k] = sum / Math.min(k + 1, window_);
      });
      series.push({name: run.name, x: xs, y: ys, color: COLORS[i % COLORS.length], width: 2});
    }
    chart.set(series);
  }

  // --------------------------------------------------------------------------------------------- run

  async function runPage(runId) {
    const run = await api("run", {run: runId});
    setCrumbs(el("a", {href: "/", text: "runs"}), el("span", {text: run.name}));
    const status = el("span", {id: "run-status", class: run.recording ? "recording" : "", text: run.status});
    const counts = el("span", {id: "run-counts"});
    const verdict = el("span", {class: "verdict"});
    const head = el("section", {class: "head"},
      el("h1", {text: run.name}),
      el("p", {class: "meta"}, status, " · ", el("span", {text: run.algorithm || "?"}), " on ",
         el("span", {text: run.env || "?"}), run.trial ? " · trial " : "", run.trial ? el("span", {text: run.trial}) : null,
         " · ", el("span", {text: (run.api_stack || "?") + " API stack"}),
         run.started_at ? " · started " : "", run.started_at ? el("span", {text: run.started_at}) : null),
      el("p", {class: "meta"}, counts, " · verify: ", verdict));
    const files = el("ul", {class: "files"});
    for (const f of run.worker_files) {
      files.append(el("li", {class: f.error ? "error" : ""},
        el("span", {class: "mono", text: f.name}),
        f.error ? ": damaged: " : " · " + (f.evaluation ? "evaluation " : "") + "worker " + f.worker + " · " + bytes(f.disk_bytes),
        f.error ? el("span", {text: f.error}) : (f.agents.length > 1 || (f.agents[0] && f.agents[0] !== "default_agent")
          ? el("span", {text: " · agents " + f.agents.join(", ")}) : null)));
    }
    for (const problem of run.problems) files.append(el("li", {class: "error", text: problem}));
    const grid = el("section", {class: "grid"});
    const table = el("section", {id: "episodes-section"});
    main.replaceChildren(head, files, grid, table);
    const charts = runCharts(grid, run);
    const state = {run: runId, sort: "end", order: "desc", offset: 0, finished: false, evaluation: "all", limit: 50};
    const episodes = episodeTable(table, state);
    showCounts(counts, run);
    await episodes.load();
    ready("run");
    verdictCell(verdict, runId);
    if (run.recording) follow(run, charts, episodes, counts, status, verdict);
  }

  function showCounts(node, s) {
    node.replaceChildren(
      el("b", {id: "run-steps", text: number(s.env_steps)}), " env steps · ",
      el("b", {id: "run-episodes", text: String(s.episodes)}), " episodes (",
      el("b", {id: "run-finished", text: String(s.finished)}), " finished) · return mean ",
      el("b", {text: number(s.return_mean)}), " · " + bytes(s.disk_bytes) + " in " + s.files + " file(s)");
  }

  function runCharts(grid, run) {
    const charts = {
      ret: new Chart(grid, {title: "episode return against the run's env steps", kind: "points", height: 200}),
      len: new Chart(grid, {title: "episode length against the run's env steps", kind: "points", height: 200}),
      lag: new Chart(grid, {title: "policy lag per step (learner version − behaviour version)", kind: "bars", height: 200}),
      rates: new Chart(grid, {title: "env steps against the run's seconds: the slopes are the rates", kind: "line",
                              height: 200, alwaysLegend: true}),
    };
    charts.curves = run.curves.map((c, i) => ({name: c.name, color: COLORS[i % COLORS.length],
                                               x: Array.from(typed(c.x)), ret: Array.from(typed(c.ret)),
                                               length: Array.from(typed(c.length))}));
    drawCurves(charts);
    charts.lag.set([{name: "steps", x: run.lags.lag, y: run.lags.steps, color: COLORS[0]}]);
    const r = run.rates;
    const rate = (key) => (r[key] ? " (" + number(r[key]) + "/s)" : "");
    const series = [{name: "produced" + rate("produced_steps_per_s"), x: r.produced.t_s, y: r.produced.steps, color: COLORS[0]},
                    {name: "stored" + rate("stored_steps_per_s"), x: r.stored.t_s, y: r.stored.steps, color: COLORS[1], dashed: true}];
    if (r.consumed) series.push({name: "consumed" + rate("consumed_steps_per_s"), x: r.consumed.t_s, y: r.consumed.steps, color: COLORS[2]});
    charts.rates.set(series);
    return charts;
  }

  function drawCurves(charts) {
    charts.ret.set(charts.curves.map((c) => ({name: c.name, color: c.color, x: c.x, y: c.ret})));
    charts.len.set(charts.curves.map((c) => ({name: c.name, color: c.color, x: c.x, y: c.length})));
  }

  function follow(run, charts, episodes, counts, status, verdict) {
    const source = new EventSource("/api/events" + href({run: run.id, cursor: JSON.stringify(run.cursor)}));
    let pending = null;
    source.addEventListener("update", (event) => {
      const data = JSON.parse(event.data);
      showCounts(counts, data.summary);
      status.textContent = data.summary.status;
      for (const c of data.curves) {
        let mine = charts.curves.find((s) => s.name === c.name);
        if (!mine) {
          mine = {name: c.name, color: COLORS[charts.curves.length % COLORS.length], x: [], ret: [], length: []};
          charts.curves.push(mine);
        }
        mine.x.push(...typed(c.x));
        mine.ret.push(...typed(c.ret));
        mine.length.push(...typed(c.length));
      }
      if (data.curves.length) drawCurves(charts);
      if (data.episodes.length && !pending) pending = setTimeout(() => { pending = null; episodes.load(); }, 300);
    });
    const stop = (text) => {
      source.close();
      status.textContent = text;
      status.className = "";
      verdictCell(verdict, run.id);
      episodes.load();
    };
    source.addEventListener("end", (event) => stop(JSON.parse(event.data).status || "ended"));
    source.addEventListener("failed", (event) => stop("stopped following: " + JSON.parse(event.data).error));
  }

  function episodeTable(section, state) {
    const total = el("span", {id: "episodes-total"});
    const finished = el("input", {type: "checkbox", id: "only-finished"});
    const evaluation = el("select", {id: "evaluation"},
      ...["all", "training", "evaluation"].map((v) => el("option", {value: v, text: v + " episodes"})));
    const best = el("span", {id: "best"});
    const prev = el("button", {text: "‹ newer"}), next = el("button", {text: "older ›"});
    const heads = [["eps_id", "episode"], ["worker", "worker"], ["agent", "agent"], ["length", "length"],
                   ["return", "return"], ["end", "end (env steps)"]];
    const headRow = el("tr");
    for (const [key, label] of heads) {
      const sortable = key !== "eps_id";
      const th = el("th", {text: label, class: sortable ? "sortable" : "", "data-sort": key});
      if (sortable) th.addEventListener("click", () => {
        state.order = state.sort === key && state.order === "desc" ? "asc" : "desc";
        state.sort = key;
        state.offset = 0;
        load();
      });
      headRow.append(th);
    }
    const body = el("tbody");
    section.replaceChildren(
      el("h2", {text: "Episodes"}),
      el("div", {class: "controls"}, el("label", {}, finished, " finished only"), evaluation, prev, next, total, best),
      el("table", {class: "episodes", id: "episodes"}, el("thead", {}, headRow), body));
    finished.addEventListener("change", () => { state.finished = finished.checked; state.offset = 0; load(); });
    evaluation.addEventListener("change", () => { state.evaluation = evaluation.value; state.offset = 0; load(); });
    prev.addEventListener("click", () => { state.offset = Math.max(0, state.offset - state.limit); load(); });
    next.addEventListener("click", () => { state.offset += state.limit; load(); });

    async function load() {
      const page = await api("episodes", {run: state.run, sort: state.sort, order: state.order, offset: state.offset,
                                          limit: state.limit, finished: state.finished ? 1 : 0,
                                          evaluation: state.evaluation});
      for (const th of headRow.children) {
        th.classList.toggle("sorted", th.dataset.sort === state.sort);
        th.dataset.order = th.dataset.sort === state.sort ? state.order : "";
      }
      body.replaceChildren(...page.rows.map((r) => {
        const link = href({run: state.run, file: r.file, episode: r.eps_id});
        return el("tr", {"data-eps": r.eps_id, "data-file": r.file},
          el("td", {class: "mono"}, el("a", {href: link, text: r.eps_id})),
          el("td", {text: (r.evaluation ? "eval " : "") + r.worker}), el("td", {text: r.agent}),
          el("td", {class: "num", text: String(r.length)}), el("td", {class: "num", text: number(r["return"])}),
          el("td", {text: (r.end || "open") + " · " + number(r.x)}));
      }));
      const last = Math.min(page.total, state.offset + page.rows.length);
      total.textContent = page.total ? `${state.offset + 1}–${last} of ${page.total}` : "none";
      prev.disabled = state.offset === 0;
      next.disabled = last >= page.total;
      best.replaceChildren();
      if (page.best) best.append("best: ", el("a", {href: href({run: state.run, file: page.best.file, episode: page.best.eps_id}),
                                                   text: number(page.best["return"]) + " (" + page.best.eps_id + ")"}));
    }
    return {load};
  }

  // ----------------------------------------------------------------------------------------- episode

  class Frames {
    // stored frames of one agent, fetched in chunks as the cursor needs them (a bounded number kept)
    constructor(base, picture) {
      this.base = base;
      this.p = picture;
      this.size = picture.height * picture.width * picture.channels;
      this.chunk = 128;
      this.chunks = new Map();
      this.loading = new Map();
      this.keep = 48;
      // the frames the episode came with: its first picture needs no request of its own
      this.first = picture.first ? {start: picture.first.start, data: unbase64(picture.first.b64)} : null;
    }
    get(k) {
      const f = this.first;
      if (f && k >= f.start && (k - f.start + 1) * this.size <= f.data.length) {
        return f.data.subarray((k - f.start) * this.size, (k - f.start + 1) * this.size);
      }
      const c = this.chunks.get(Math.floor(k / this.chunk));
      if (!c) return null;
      const i = k % this.chunk;
      return i < c.length / this.size ? c.subarray(i * this.size, (i + 1) * this.size) : null;
    }
    load(index) {
      if (index < 0 || index * this.chunk >= this.p.count) return Promise.resolve();
      if (this.chunks.has(index)) return Promise.resolve();
      if (!this.loading.has(index)) {
        const url = "/api/frames" + href(Object.assign({}, this.base, {start: index * this.chunk, count: this.chunk}));
        this.loading.set(index, fetch(url).then(async (r) => {
          if (r.headers.get("Content-Type") !== "application/octet-stream") throw new Error((await r.json()).error);
          this.chunks.set(index, new Uint8Array(await r.arrayBuffer()));
          while (this.chunks.size > this.keep) this.chunks.delete(this.chunks.keys().next().value);
        }).finally(() => this.loading.delete(index)));
      }
      return this.loading.get(index);
    }
    async ensure(k, ahead) {
      const index = Math.floor(k / this.chunk);
      for (let a = 1; a <= (ahead || 0); a++) this.load(index + a);
      await this.load(index);
    }
  }

  class Pictures {
    // the env's pictures, re-simulated on the server, fetched as PNG one step at a time (a bounded number kept)
    constructor(base, count) {
      this.base = base;
      this.count = count;
      this.images = new Map();
      this.keep = 600;
    }
    get(k) { const v = this.images.get(k); return v instanceof ImageBitmap ? v : null; }
    load(k) {
      if (k < 0 || k >= this.count) return Promise.resolve();
      if (!this.images.has(k)) {
        const url = "/api/picture" + href(Object.assign({}, this.base, {t: k}));
        this.images.set(k, fetch(url).then(async (r) => {
          if (r.headers.get("Content-Type") !== "image/png") throw new Error((await r.json()).error);
          const bitmap = await createImageBitmap(await r.blob());
          this.images.set(k, bitmap);
          while (this.images.size > this.keep) this.images.delete(this.images.keys().next().value);
        }).catch((e) => { this.images.delete(k); throw e; }));
      }
      const v = this.images.get(k);
      return v instanceof ImageBitmap ? Promise.resolve() : v;
    }
    async ensure(k, ahead) {
      for (let a = 1; a <= (ahead || 0); a++) this.load(k + a).catch(() => {});
      await this.load(k);
    }
  }

  function stepOf(track, t) {
    // the agent's step at timeline position t: its last step at or before t (null: it has not acted yet)
    if (!track.xs) return t < track.length ? t : null;
    let lo = 0, hi = track.xs.length - 1, found = null;
    while (lo <= hi) {
      const mid = (lo + hi) >> 1;
      if (track.xs[mid] <= t) { found = mid; lo = mid + 1; } else hi = mid - 1;
    }
    return found;
  }

  function valueText(column, k) {
    if (column.text) return column.text[k];
    if (!column.data) return column.dtype + "[" + column.shape.join("×") + "]" + (column.name === "obs" ? " (the picture)" : "");
    const d = column.dims, out = [];
    if (column.name === "policy_lag" && column.data[k] !== column.data[k]) return "unknown (no learner version)";
    for (let j = 0; j < Math.min(d, 16); j++) {
      const v = column.data[k * d + j];
      out.push(column.dtype === "bool" ? String(!!v) : column.values.type === "f4" ? f32(v) : String(v));
    }
    if (d > 16) out.push("… (" + d + " values)");
    return d === 1 && !column.shape.length ? out[0] : "[" + out.join(", ") + "]";
  }

  // every agent's track, its columns' values as typed arrays, and the series a chart draws of them
  function trackSeries(data) {
    const tracks = data.tracks.map((track, i) => {
      const columns = track.columns.map((c) => Object.assign({}, c, {data: c.values ? typed(c.values) : null}));
      return Object.assign({}, track, {columns, xs: typed(track.x), color: COLORS[i % COLORS.length]});
    });
    const multi = tracks.length > 1;
    const names = [];
    for (const tr of tracks) for (const c of tr.columns) if (!names.includes(c.name)) names.push(c.name);
    const dimsOf = (name) => Math.max(...tracks.map((tr) => (tr.columns.find((c) => c.name === name) || {dims: 0}).dims));
    // one series per agent of dimension dim of column name (x: the agent's env steps, multi-agent)
    const seriesOf = (name, dim, transform) => tracks.map((tr) => {
      const column = tr.columns.find((c) => c.name === name);
      if (!column || !column.data) return null;
      let y = column.dims === 1 ? column.data : column.data.filter((_, k) => k % column.dims === dim);
      if (transform) y = transform(y);
      return {name: multi ? tr.agent : "", x: tr.xs, y, color: tr.color};
    }).filter(Boolean);
    const label = (name, d) => name.replace("extra_model_outputs/", "") + (dimsOf(name) > 1 ? "[" + d + "]" : "");
    return {tracks, multi, names, dimsOf, seriesOf, label};
  }

  function cumsum(y) {
    const out = new Float64Array(y.length);
    let sum = 0;
    y.forEach((v, k) => { sum += v; out[k] = sum; });
    return out;
  }

  // reward, return so far, each action dimension, every model output and the policy lag: one cursor at t
  function episodeCharts(box, ts, n, pick) {
    const charts = [];
    const chart = (title, series) => {
      const c = new Chart(box, {title, kind: "steps", height: 110, xDomain: [0, n], onPick: pick});
      c.set(series);
      charts.push(c);
    };
    chart("reward", ts.seriesOf("rewards", 0));
    chart("return so far", ts.seriesOf("rewards", 0, cumsum));
    const charted = (name) => name.startsWith("actions") || name.startsWith("extra_model_outputs/");
    for (const name of ts.names.filter(charted)) {
      for (let d = 0; d < Math.min(ts.dimsOf(name), 8); d++) {
        const series = ts.seriesOf(name, d);
        if (series.length) chart(ts.label(name, d), series);
      }
    }
    chart("policy lag", ts.seriesOf("policy_lag", 0));
    return {setCursor: (t) => charts.forEach((c) => c.setCursor(t))};
  }

  // the value of every stored column, and the info, of each agent at t
  function valuesTable(ts) {
    const table = el("table", {class: "values", id: "values"});
    const cells = [];
    for (const tr of ts.tracks) {
      if (ts.multi) table.append(el("tr", {class: "group"}, el("td", {colspan: 2, text: "agent " + tr.agent})));
      for (const column of tr.columns) {
        const cell = el("td", {class: "mono", "data-column": column.name, "data-agent": tr.agent});
        table.append(el("tr", {}, el("th", {text: column.name}), cell));
        cells.push([tr, cell, (k) => valueText(column, k)]);
      }
      const info = el("td", {class: "mono info", "data-column": "infos", "data-agent": tr.agent});
      table.append(el("tr", {}, el("th", {text: "infos"}), info));
      cells.push([tr, info, (k) => (k < tr.infos.length ? JSON.stringify(tr.infos[k]) : "—")]);
    }
    const show = (t) => {
      for (const [tr, cell, text] of cells) {
        const k = stepOf(tr, t);
        const acted = k !== null && (!tr.xs || tr.xs[k] === t);
        cell.textContent = k === null ? "—" : text(k) + (acted ? "" : "  (last acted at " + tr.xs[k] + ")");
      }
    };
    return {table, show};
  }

  class PictureView {
    // the picture at step k of the picture's agent: a stored frame, a re-simulated picture, or the observation
    // as a strip chart (also when re-simulating fails)
    constructor(picture, base, ts, n, pick) {
      this.p = picture;
      this.ts = ts;
      this.n = n;
      this.pick = pick;
      this.box = el("div", {class: "picture"});
      this.canvas = el("canvas", {id: "frame"});
      this.note = el("p", {class: "note"});
      this.store = null;
      this.strip = null;
      this.shown = -1;
      if (picture.kind === "frames") {
        this.canvas.width = picture.width;
        this.canvas.height = picture.height;
        this.canvas.style.width = picture.width * 4 + "px";
        this.image = this.canvas.getContext("2d").createImageData(picture.width, picture.height);
        this.store = new Frames(Object.assign({agent: picture.agent}, base), picture);
        this.box.append(this.canvas, el("p", {class: "note", text: "stored frame" + (ts.multi ? " of agent " : "")},
                                        ts.multi ? el("span", {text: picture.agent}) : null));
      } else if (picture.kind === "simulated") {
        this.store = new Pictures(base, picture.count);
        this.box.append(this.canvas, el("p", {class: "note", text: "re-simulated from the stored start state with the stored actions"}));
      }
      this.box.append(this.note);
      if (picture.kind === "obs") this.observations(picture.why);
    }

    observations(why) {
      this.note.textContent = why;
      this.canvas.remove();
      this.store = null;
      const series = [];
      for (const name of this.ts.names.filter((name) => name.startsWith("obs"))) {
        for (let d = 0; d < Math.min(this.ts.dimsOf(name), 16); d++) {
          for (const s of this.ts.seriesOf(name, d)) {
            series.push(Object.assign(s, {name: (this.ts.multi ? s.name + " " : "") + this.ts.label(name, d),
                                          color: COLORS[series.length % COLORS.length]}));
          }
        }
      }
      this.strip = new Chart(this.box, {title: "observation", kind: "steps", height: 220, xDomain: [0, this.n],
                                        onPick: this.pick});
      this.box.insertBefore(this.strip.box, this.note);
      this.strip.set(series);
    }

    draw(k) {
      if (!this.store || k === null) return false;
      const thing = this.store.get(k);
      if (!thing) return false;
      const g = this.canvas.getContext("2d");
      if (this.p.kind === "frames") {
        const px = this.image.data, c = this.p.channels;
        for (let i = 0, j = 0; i < px.length; i += 4, j += c) {
          px[i] = thing[j];
          px[i + 1] = thing[c === 3 ? j + 1 : j];
          px[i + 2] = thing[c === 3 ? j + 2 : j];
          px[i + 3] = 255;
        }
        g.putImageData(this.image, 0, 0);
      } else {
        if (this.canvas.width !== thing.width) {
          this.canvas.width = thing.width;
          this.canvas.height = thing.height;
          this.canvas.style.width = Math.min(thing.width, 600) + "px";
        }
        this.canvas.getContext("2d").drawImage(thing, 0, 0);
      }
      this.shown = k;
      return true;
    }

    // draws step k, fetching its picture first when it is not here; false once the step asked for moved on
    async show(k, ahead, stillWanted) {
      if (this.strip) return true;
      if (!this.store || k === null) return true;
      if (this.draw(k)) {
        if (ahead) this.store.ensure(k, ahead).catch(() => {});
        return true;
      }
      try {
        await this.store.ensure(k, ahead);
      } catch (e) {
        if (this.p.kind === "simulated") this.observations("could not re-simulate this episode: " + e.message + "; its observations are drawn");
        else this.note.textContent = "error: " + e.message;
        return true;
      }
      return stillWanted() ? this.draw(k) : false;
    }
  }

  function playerControls(n, t, seek) {
    const slider = el("input", {type: "range", min: 0, max: Math.max(0, n - 1), value: t, id: "slider"});
    const play = el("button", {id: "play", text: "▶ play"});
    const speed = el("select", {id: "speed"}, ...[1, 2, 5, 10, 15, 30, 60, 120].map((v) =>
      el("option", {value: v, text: v + " steps/s"})));
    speed.value = "15";
    const where = el("span", {id: "where"});
    const box = el("div", {class: "player"},
      el("button", {text: "|◀", title: "first step (Home)", onclick: () => seek.to(0)}),
      el("button", {text: "◀", title: "step back (←)", onclick: () => seek.by(-1)}), play,
      el("button", {text: "▶|", title: "step on (→)", onclick: () => seek.by(1)}), slider, where, speed);
    slider.addEventListener("input", () => seek.to(parseInt(slider.value, 10)));
    let playing = false;
    // play: steps advance with the clock at the chosen speed, waiting for a picture not here yet
    const toggle = () => {
      playing = !playing;
      play.textContent = playing ? "❚❚ pause" : "▶ play";
      if (!playing) return;
      if (seek.now() >= n - 1) seek.to(0);
      let last = performance.now(), owed = 0, busy = false;
      const tick = async (now) => {
        if (!playing) return;
        owed += (now - last) / 1000 * Number(speed.value);
        last = now;
        if (!busy && owed >= 1) {
          const steps = Math.floor(owed);
          owed -= steps;
          busy = true;
          await seek.to(seek.now() + steps, 2);
          busy = false;
          if (seek.now() >= n - 1) { toggle(); return; }
        }
        requestAnimationFrame(tick);
      };
      requestAnimationFrame(tick);
    };
    play.addEventListener("click", toggle);
    document.addEventListener("keydown", (e) => {
      if (e.target.tagName === "SELECT" || e.target.tagName === "INPUT" && e.target.type !== "range") return;
      const keys = {ArrowLeft: () => seek.by(e.shiftKey ? -10 : -1), ArrowRight: () => seek.by(e.shiftKey ? 10 : 1),
                    " ": toggle, Home: () => seek.to(0), End: () => seek.to(n - 1)};
      if (keys[e.key]) {
        e.preventDefault();
        keys[e.key]();
      }
    });
    const show = (t) => {
      slider.value = t;
      where.textContent = `step ${t} / ${n - 1}`;
    };
    return {box, show};
  }

  function episodeHeader(data, ts, epsId, file, n) {
    return el("section", {class: "head"},
      el("h1", {}, "episode ", el("span", {class: "mono", text: epsId})),
      el("p", {class: "meta"}, el("span", {class: "mono", text: file}), " · " + (data.evaluation ? "evaluation " : "") +
         "worker " + data.worker + " · " + n + " " + (data.timeline === "env_t" ? "env steps" : "steps"),
         ...ts.tracks.flatMap((tr) => [" · ", ts.multi ? el("span", {text: "agent " + tr.agent + ": "}) : "",
                                        "return " + number(tr["return"]) + (ts.multi ? ", " + tr.length + " steps" : "") +
                                        (tr.terminated ? ", terminated" : tr.truncated ? ", truncated" : ", not finished")])));
  }

  // the step t drives the picture, the charts' cursor, the value table and the URL together
  async function episodePage(runId, file, epsId) {
    const asked = Math.max(0, parseInt(params.get("t") || "0", 10) || 0);
    const data = await api("episode", {run: runId, file: file, episode: epsId, t: asked});
    const n = data.steps;
    let t = Math.min(n - 1, asked);
    setCrumbs(el("a", {href: "/", text: "runs"}), el("a", {href: href({run: runId}), text: runId.split("/").pop()}),
              el("span", {text: "episode " + epsId}));
    const ts = trackSeries(data);
    const pictureTrack = ts.tracks.find((tr) => tr.agent === data.picture.agent) || ts.tracks[0];
    const seek = {
      to: (to, ahead) => go(to, ahead), by: (steps) => go(t + steps), now: () => t,
    };
    const pick = (x) => go(Math.floor(x));
    const picture = new PictureView(data.picture, {run: runId, file: file, episode: epsId}, ts, n, pick);
    const player = playerControls(n, t, seek);
    const values = valuesTable(ts);
    const chartBox = el("div", {class: "episode-charts"});
    main.replaceChildren(episodeHeader(data, ts, epsId, file, n), player.box,
      el("div", {class: "episode"}, el("div", {class: "left"}, picture.box, values.table), chartBox));
    const charts = episodeCharts(chartBox, ts, n, pick);

    let urlTimer = null;
    const keepInUrl = () => {
      if (urlTimer) return;
      urlTimer = setTimeout(() => {
        urlTimer = null;
        const q = new URLSearchParams(location.search);
        q.set("t", t);
        history.replaceState(null, "", "?" + q.toString());
      }, 250);
    };
    async function go(to, ahead) {
      t = Math.max(0, Math.min(n - 1, to));
      player.show(t);
      values.show(t);
      charts.setCursor(t);
      if (picture.strip) picture.strip.setCursor(t);
      keepInUrl();
      const k = stepOf(pictureTrack, t);
      await picture.show(k, ahead, () => stepOf(pictureTrack, t) === k);
      if (picture.strip) picture.strip.setCursor(t);
    }

    window.viewer = {steps: n, seek: (to) => go(to, 1), get t() { return t; }, get shown() { return picture.shown; }};
    await go(t);
    ready("episode");
    if (picture.store) picture.store.ensure(stepOf(pictureTrack, t) || 0, 1).catch(() => {});  // then the frames around t
  }

  // ------------------------------------------------------------------------------------------- route

  const run = params.get("run");
  const episode = params.get("episode");
  const page = !run ? runsPage() : episode ? episodePage(run, params.get("file") || "", episode) : runPage(run);
  page.catch(failed);
})();
