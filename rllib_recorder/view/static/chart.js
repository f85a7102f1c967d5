// rllib-recorder view: small canvas charts of our own (lines, steps, points, bars) with a cursor on an overlay.
// Part of rllib-recorder (Apache-2.0, see LICENSE.txt); no third-party code. Text from a recording only ever
// reaches the page as textContent (legends, titles) or canvas fillText, never as markup.
"use strict";

(function () {
  const COLORS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f",
                  "#bcbd22", "#17becf"];
  const PAD = {left: 52, right: 10, top: 8, bottom: 22};

  function fmt(v) {
    if (!isFinite(v)) return String(v);
    const a = Math.abs(v);
    if (a !== 0 && (a >= 1e6 || a < 1e-3)) return v.toExponential(1);
    if (a >= 1000) return (v / 1000).toFixed(a >= 1e4 ? 0 : 1) + "k";
    return String(+v.toPrecision(3));
  }

  function ticks(lo, hi, count) {
    if (!(hi > lo)) return [lo];
    const raw = (hi - lo) / count;
    const mag = Math.pow(10, Math.floor(Math.log10(raw)));
    const step = [1, 2, 5, 10].map((m) => m * mag).find((s) => s >= raw) || 10 * mag;
    const out = [];
    for (let v = Math.ceil(lo / step) * step; v <= hi + step * 1e-9; v += step) out.push(+v.toPrecision(12));
    return out;
  }

  function extent(series, key, fallback) {
    let lo = Infinity, hi = -Infinity;
    for (const s of series) {
      const values = s[key];
      if (!values) {
        if (key === "x") { lo = Math.min(lo, 0); hi = Math.max(hi, s.y.length); }
        continue;
      }
      for (let i = 0; i < values.length; i++) {
        const v = values[i];
        if (v < lo) lo = v;
        if (v > hi) hi = v;
      }
    }
    if (lo === Infinity) return fallback;
    if (lo === hi) return [lo - 0.5, hi + 0.5];
    return [lo, hi];
  }

  class Chart {
    // opts: title, kind ("line" | "points" | "steps" | "bars"), height, xLabel, onPick(x), xDomain
    constructor(parent, opts) {
      this.opts = Object.assign({kind: "line", height: 160}, opts);
      this.box = document.createElement("div");
      this.box.className = "chart";
      const title = document.createElement("div");
      title.className = "chart-title";
      title.textContent = this.opts.title || "";
      this.legend = document.createElement("div");
      this.legend.className = "legend";
      this.wrap = document.createElement("div");
      this.wrap.className = "plot";
      this.wrap.style.height = this.opts.height + "px";
      this.base = document.createElement("canvas");
      this.over = document.createElement("canvas");
      this.over.className = "overlay";
      this.wrap.append(this.base, this.over);
      this.box.append(title, this.wrap, this.legend);
      parent.append(this.box);
      this.series = [];
      this.cursor = null;
      this.lines = [];
      this.width = 0;
      if (this.opts.onPick) this._pickable();
      new ResizeObserver(() => { if (this.wrap.clientWidth !== this.width) this.draw(); }).observe(this.wrap);
    }

    _pickable() {
      let down = false;
      const pick = (e) => {
        const r = this.over.getBoundingClientRect();
        const x = this._unx(e.clientX - r.left);
        if (isFinite(x)) this.opts.onPick(x);
      };
      this.over.addEventListener("pointerdown", (e) => { down = true; this.over.setPointerCapture(e.pointerId); pick(e); });
      this.over.addEventListener("pointermove", (e) => { if (down) pick(e); });
      this.over.addEventListener("pointerup", () => { down = false; });
      this.over.style.cursor = "crosshair";
    }

    // series: [{name, x (array or null: the index), y, color, dashed}]; lines: [{y, name, color}] (horizontal)
    set(series, lines) {
      this.series = series;
      this.lines = lines || [];
      this._legend();
      this.draw();
    }

    _legend() {
      this.legend.replaceChildren();
      const named = this.series.filter((s) => s.name).concat(this.lines.filter((l) => l.name));
      if (named.length < 2 && !this.opts.alwaysLegend) return;
      for (const s of named) {
        const item = document.createElement("span");
        const swatch = document.createElement("i");
        swatch.style.background = s.color;
        item.append(swatch, document.createTextNode(s.name));
        this.legend.append(item);
      }
    }

    _x(v) { return PAD.left + (v - this.xd[0]) / (this.xd[1] - this.xd[0]) * this.pw; }
    _unx(px) { return this.xd ? this.xd[0] + (px - PAD.left) / this.pw * (this.xd[1] - this.xd[0]) : NaN; }
    _y(v) { return PAD.top + (1 - (v - this.yd[0]) / (this.yd[1] - this.yd[0])) * this.ph; }

    draw() {
      const dpr = window.devicePixelRatio || 1;
      const w = this.wrap.clientWidth, h = this.opts.height;
      if (!w) return;
      this.width = w;
      for (const c of [this.base, this.over]) {
        c.width = Math.round(w * dpr);
        c.height = Math.round(h * dpr);
        c.style.width = w + "px";
        c.style.height = h + "px";
      }
      this.pw = w - PAD.left - PAD.right;
      this.ph = h - PAD.top - PAD.bottom;
      const kind = this.opts.kind;
      this.xd = this.opts.xDomain || extent(this.series, "x", [0, 1]);
      if (kind === "bars") this.xd = [this.xd[0] - 0.5, this.xd[1] + 0.5];
      if (kind === "steps") this.xd = [this.xd[0], Math.max(this.xd[1], this.xd[0] + 1)];
      let yd = extent(this.series.concat(this.lines.map((l) => ({y: [l.y], x: []}))), "y", [0, 1]);
      if (kind === "bars") yd = [0, Math.max(yd[1], 1)];
      const pad = (yd[1] - yd[0]) * 0.05;
      this.yd = kind === "bars" ? [0, yd[1] * 1.05] : [yd[0] - pad, yd[1] + pad];
      const g = this.base.getContext("2d");
      g.setTransform(dpr, 0, 0, dpr, 0, 0);
      g.clearRect(0, 0, w, h);
      this._axes(g, w, h);
      g.save();
      g.beginPath();
      g.rect(PAD.left, PAD.top, this.pw, this.ph);
      g.clip();
      this.series.forEach((s, i) => this._series(g, s, s.color || COLORS[i % COLORS.length]));
      for (const l of this.lines) {
        g.strokeStyle = l.color;
        g.setLineDash([5, 4]);
        g.beginPath();
        g.moveTo(PAD.left, this._y(l.y));
        g.lineTo(PAD.left + this.pw, this._y(l.y));
        g.stroke();
        g.setLineDash([]);
      }
      g.restore();
      this.setCursor(this.cursor);
    }

    _axes(g, w, h) {
      g.strokeStyle = "#ccc";
      g.fillStyle = "#555";
      g.font = "11px system-ui, sans-serif";
      g.lineWidth = 1;
      g.textAlign = "right";
      g.textBaseline = "middle";
      for (const v of ticks(this.yd[0], this.yd[1], 4)) {
        const y = Math.round(this._y(v)) + 0.5;
        g.beginPath();
        g.moveTo(PAD.left, y);
        g.lineTo(PAD.left + this.pw, y);
        g.stroke();
        g.fillText(fmt(v), PAD.left - 4, y);
      }
      g.textAlign = "center";
      g.textBaseline = "top";
      for (const v of ticks(this.xd[0], this.xd[1], Math.max(2, Math.floor(this.pw / 90)))) {
        g.fillText(fmt(v), this._x(v), PAD.top + this.ph + 5);
      }
      if (this.opts.xLabel) {
        g.textAlign = "right";
        g.fillText(this.opts.xLabel, PAD.left + this.pw, PAD.top + this.ph + 5 + 0);
      }
    }

    _series(g, s, color) {
      const kind = s.kind || this.opts.kind;
      g.strokeStyle = color;
      g.fillStyle = color;
      g.lineWidth = s.width || 1.25;
      if (s.dashed) g.setLineDash([5, 4]);
      if (kind === "points") this._points(g, s);
      else if (kind === "bars") this._bars(g, s);
      else this._line(g, s, kind === "steps");
      g.setLineDash([]);
    }

    _points(g, s) {
      const n = s.y.length;
      for (let i = 0; i < n; i++) {
        const y = s.y[i];
        if (y !== y) continue;
        g.fillRect(this._x(s.x ? s.x[i] : i) - 1, this._y(y) - 1, 2.2, 2.2);
      }
    }

    _bars(g, s) {
      const half = Math.max(1, this.pw / (this.xd[1] - this.xd[0]) * 0.4);
      for (let i = 0; i < s.y.length; i++) {
        const x = this._x(s.x ? s.x[i] : i), y = this._y(s.y[i]);
        g.fillRect(x - half, y, 2 * half, this._y(0) - y);
      }
    }

    // A value per x from x to x + 1 (steps) or at x (line); no value (NaN), or a jump in x past the next
    // step, leaves a gap. Wider than the plot: each pixel column shows the min and max of its values.
    _line(g, s, steps) {
      const n = s.y.length, xs = s.x, ys = s.y;
      const span = this.xd[1] - this.xd[0];
      const dense = n > this.pw * 1.5;
      g.beginPath();
      let open = false, lastX = NaN;
      if (dense) {
        let col = -1, lo = 0, hi = 0, prev = NaN;
        const flush = () => {
          if (col < 0) return;
          const px = PAD.left + col + 0.5;
          if (open && prev === col - 1) g.lineTo(px, this._y(lo)); else g.moveTo(px, this._y(lo));
          g.lineTo(px, this._y(hi));
          open = true;
          prev = col;
        };
        for (let i = 0; i < n; i++) {
          const y = ys[i];
          if (y !== y) continue;
          const x = xs ? xs[i] : i;
          const c = Math.floor((x - this.xd[0]) / span * this.pw);
          if (c !== col) { flush(); col = c; lo = hi = y; } else { if (y < lo) lo = y; if (y > hi) hi = y; }
        }
        flush();
      } else {
        for (let i = 0; i < n; i++) {
          const y = ys[i];
          const x = xs ? xs[i] : i;
          if (y !== y) { open = false; continue; }
          const py = this._y(y);
          const joined = open && (!steps || x === lastX + 1);
          if (joined) g.lineTo(this._x(x), py); else g.moveTo(this._x(x), py);
          if (steps) g.lineTo(this._x(x + 1), py);
          open = true;
          lastX = x;
        }
      }
      g.stroke();
    }

    // the cursor at x (steps: in the middle of step x), or none
    setCursor(x) {
      this.cursor = x;
      if (!this.xd) return;
      const dpr = window.devicePixelRatio || 1;
      const g = this.over.getContext("2d");
      g.setTransform(dpr, 0, 0, dpr, 0, 0);
      g.clearRect(0, 0, this.over.width, this.over.height);
      if (x === null || x === undefined) return;
      const px = Math.round(this._x(this.opts.kind === "steps" ? x + 0.5 : x)) + 0.5;
      g.strokeStyle = "#d00";
      g.lineWidth = 1;
      g.beginPath();
      g.moveTo(px, PAD.top);
      g.lineTo(px, PAD.top + this.ph);
      g.stroke();
    }
  }

  window.Charts = {Chart, COLORS, fmt};
})();
