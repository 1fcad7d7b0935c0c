/**
 * A circuit's view: the graph of its edges instead of a heatmap, shared by the anywidget view
 * (widget.ts) and the JupyterLab MIME renderer (mime.ts), which pick it by `viewFor` (views.ts).
 *
 * The state's `circuit` part (`CIRCUIT_SCHEMA`, made by `pipatch/_results/views/circuit.py`) places the
 * nodes: the embeddings at the bottom, each layer's heads and its MLP in a row, the logits at
 * the top; a receiver's q/k/v inputs are ports on its head node's lower side. The scores are
 * the grid's `edges/raw_mean` less the corrupt baseline (the estimated change of the metric);
 * `circuitEdges` ranks them as `circuit_edges` does in Python (checked by the parity test) and
 * the slider keeps the top n. An edge is a cubic from its sender's top to its receiver's port,
 * control points 45 % of the rise from each end (as `draw_circuit` in
 * `pipatch/_results/views/render.py`), coloured on the one diverging map (`divergingColor`).
 *
 * Hover shows an edge's estimate and, where it was checked, the exact patch's change; a click
 * sends the same selection a grid cell does (row = receiver, col = sender), which the kernel
 * answers with that edge's exact patch's top-5. Every string is set as text (`textContent`,
 * attributes); no HTML is parsed.
 */

import type { Circuit, GridState, Selection } from './data';
import { selectMatrix } from './data';
import { divergingColor, formatDuration, formatValue, symmetricMax, tooltipLabel } from './format';
import { drawColorBar, h, rgb, standaloneSvg, svg, SVG_NS } from './dom';
import { CodePanel, detailBody, StopButton, View, type GridCallbacks } from './view';

/** Edges drawn at first when there is no faithful circuit (the static figure's default too: `TOP_EDGES` in render.py). */
export const DEFAULT_TOP = 50;
/** The slider's largest value: more curves than this are no longer read one by one. */
export const MAX_TOP = 2000;


/** One edge: its grid cell, its score (estimated change of the metric), normalized recovery and
 * the exact patch's change (NaN where not checked). */
export interface Edge {
  row: number;
  col: number;
  score: number;
  recovery: number;
  exact: number;
}

/** Whether a state is a circuit's (drawn as a graph). */
export function isCircuit(s: GridState): boolean {
  return (s.circuit?.nodes?.length ?? 0) > 0;
}

/**
 * Every finite edge, largest |score| first (ties: row-major order). As `circuit_edges` in
 * `pipatch/_results/views/circuit.py`: score = `edges/raw_mean` − the corrupt baseline, in doubles.
 */
export function circuitEdges(s: GridState): Edge[] {
  const view = s.views[0] ?? '';
  const raw = selectMatrix(s, view, -1, 'raw');
  if (!raw.data) return [];
  const rec = selectMatrix(s, view, -1, 'recovery').data;
  const corrupt = Number.isFinite(s.baselines.corrupt) ? s.baselines.corrupt : 0;
  const exact = new Map<number, number>();
  for (const c of s.circuit?.checked ?? []) exact.set(c.row * raw.cols + c.col, c.exact);
  const out: (Edge & { i: number })[] = [];
  for (let i = 0; i < raw.data.length; i++) {
    const score = raw.data[i] - corrupt;
    if (!Number.isFinite(score)) continue;
    out.push({ i, row: Math.floor(i / raw.cols), col: i % raw.cols, score, recovery: rec ? rec[i] : NaN, exact: exact.get(i) ?? NaN });
  }
  out.sort((a, b) => Math.abs(b.score) - Math.abs(a.score) || a.i - b.i);
  return out.map(({ i: _i, ...e }) => e);
}

/** The first `n` edges (at least 0, at most all). */
export function topEdges(edges: Edge[], n: number): Edge[] {
  return edges.slice(0, Math.max(0, Math.min(edges.length, Math.floor(n))));
}

/**
 * How many edges are drawn at first: the faithful circuit's size (the smallest that reaches the
 * share) where the curve found one, else `DEFAULT_TOP`. As `default_top` in render.py.
 */
export function defaultTop(state: GridState): number {
  const size = state.circuit?.faithfulness?.size;
  return size !== undefined && Number.isFinite(size) && size > 0 ? Math.floor(size) : DEFAULT_TOP;
}

/** The slider's range and starting value (`start`, from `defaultTop`) for `total` edges. */
export function sliderRange(total: number, start: number = DEFAULT_TOP): { max: number; value: number } {
  const max = Math.max(1, Math.min(total, MAX_TOP));
  return { max, value: Math.min(start, max) };
}

export interface Point {
  x: number;
  y: number;
}

/** Where the graph's nodes are drawn, in pixels. */
export interface GraphLayout {
  width: number;
  height: number;
  left: number;
  innerWidth: number;
  rowGap: number;
  radius: number;
  nodes: Point[];
}

const LEFT = 84; // the row names
const PAD = 22;

/**
 * Pixel positions for the state's nodes in `width` pixels: graph `x` across the width after the
 * row names, graph `y` upwards (the embeddings at the bottom); rows 34–90 px apart, a node's
 * radius from the widest row's slot (3–9 px).
 */
export function layoutGraph(c: Circuit, width: number): GraphLayout {
  const nodes = c.nodes ?? [];
  const maxY = nodes.reduce((m, n) => Math.max(m, n.y), 0);
  const perRow = new Map<number, number>();
  for (const n of nodes) perRow.set(n.layer, (perRow.get(n.layer) ?? 0) + 1);
  const widest = Math.max(1, ...perRow.values());
  const w = Math.max(width, 240);
  const innerWidth = w - LEFT - PAD;
  const rowGap = Math.max(34, Math.min(90, 620 / Math.max(1, maxY)));
  const radius = Math.max(3, Math.min(9, (innerWidth / widest) * 0.28));
  const height = Math.ceil(maxY * rowGap + 2 * PAD + 10);
  const place = (x: number, y: number): Point => ({ x: LEFT + x * innerWidth, y: PAD + 6 + (maxY - y) * rowGap });
  return { width: w, height, left: LEFT, innerWidth, rowGap, radius, nodes: nodes.map((n) => place(n.x, n.y)) };
}

/** An edge's two ends and control points: from its sender's top to its receiver's port. */
export function edgeGeometry(c: Circuit, layout: GraphLayout, e: Edge): { from: Point; to: Point; c1: Point; c2: Point } {
  const s = layout.nodes[c.senders?.[e.col] ?? 0];
  const t = layout.nodes[c.receivers?.[e.row] ?? 0];
  const r = layout.radius;
  const from = { x: s.x, y: s.y - r };
  const to = { x: t.x + (c.ports?.[e.row] ?? 0) * layout.innerWidth, y: t.y + r };
  const rise = Math.max(from.y - to.y, 0.3 * layout.rowGap) * 0.45;
  return { from, to, c1: { x: from.x, y: from.y - rise }, c2: { x: to.x, y: to.y + rise } };
}

/** The SVG path of an edge. */
export function edgePath(c: Circuit, layout: GraphLayout, e: Edge): string {
  const { from, to, c1, c2 } = edgeGeometry(c, layout, e);
  const f = (p: Point) => `${p.x.toFixed(1)} ${p.y.toFixed(1)}`;
  return `M ${f(from)} C ${f(c1)} ${f(c2)} ${f(to)}`;
}

/** A stroke as wide as the edge's share of the largest |score|. */
export function strokeWidth(score: number, vmax: number): number {
  return 0.8 + 3.4 * Math.min(1, Math.abs(score) / (vmax > 0 ? vmax : 1));
}

/** The edge's lines of text (tooltip, detail): its ends, estimate, recovery and exact change. */
export function edgeInfo(s: GridState, e: Edge, rank: number, total: number): string[] {
  const metric = s.metric || 'metric';
  const lines = [
    `${tooltipLabel(s.col_labels[e.col] ?? String(e.col))} → ${tooltipLabel(s.row_labels[e.row] ?? String(e.row))}`,
    `estimate: ${formatValue(e.score, 4)} (change of ${metric})`,
  ];
  if (Number.isFinite(e.recovery)) lines.push(`normalized recovery: ${formatValue(e.recovery)}`);
  lines.push(Number.isFinite(e.exact) ? `exact patch: ${formatValue(e.exact, 4)}` : 'exact patch: not checked');
  if (rank >= 0) lines.push(`rank ${rank + 1} of ${total} by |estimate|`);
  return lines;
}

/** The kernel's exact patch of the clicked edge (`detail.exact`, the mean change of the metric
 * over `detail.exact_pairs` pairs), as one line; '' while it is not answered. */
export function clickedExact(s: GridState, sel: Selection): string {
  const d = s.detail || {};
  if (d.row !== sel.row || d.col !== sel.col || typeof d.exact !== 'number' || !Number.isFinite(d.exact)) return '';
  const pairs = d.exact_pairs ?? 1;
  const over = pairs > 1 ? `, mean over ${pairs} pairs` : '';
  return `exact patch, run on this click: ${formatValue(d.exact, 4)} (change of ${s.metric || 'metric'}${over}); top-5 of the first pair below`;
}

/** The status line: status, edges, checks and their agreement, time. */
export function circuitStatus(s: GridState, total: number): string {
  const c = s.circuit ?? {};
  const parts = [s.message ? `${s.status}: ${s.message}` : s.status || 'done', `${total} edges`];
  const checked = c.checked ?? [];
  if (checked.length) {
    const exact = checked.filter((x) => Number.isFinite(x.exact)).length;
    let t = exact === checked.length ? `${exact} checked by exact patches` : `${exact} / ${checked.length} checked`;
    const rho = c.agreement?.spearman;
    if (rho !== undefined && Number.isFinite(rho)) t += ` (Spearman ${formatValue(rho, 2)} with the estimates)`;
    parts.push(t);
  }
  if (s.elapsed > 0) parts.push(`${formatDuration(s.elapsed)} elapsed`);
  return parts.join(' · ');
}

/** The faithfulness chart's scales: x symmetric-log (linear to 1, then log), y linear over the
 * values and [0, 1]. */
export function faithfulnessScale(sizes: number[], values: number[], share: number, w: number, h: number, pad = 30) {
  const sx = (n: number) => Math.log1p(Math.max(0, n));
  const maxX = Math.max(1, ...sizes.map(sx));
  const finite = values.filter(Number.isFinite);
  const lo = Math.min(0, ...finite, Number.isFinite(share) ? share : 0);
  const hi = Math.max(1, ...finite);
  return {
    x: (n: number) => pad + (sx(n) / maxX) * (w - pad - 8),
    y: (v: number) => 8 + (1 - (v - lo) / (hi - lo || 1)) * (h - pad - 8),
    lo,
    hi,
  };
}

const ROW_NAMES: Record<string, string> = { emb: 'embeddings', logits: 'logits' };

/** A circuit's edges as a graph of its nodes, the top n by |estimate|, beside its colour bar and
 * faithfulness curve; a click on an edge asks the kernel for its exact patch. */
export class CircuitView extends View {
  private edges: Edge[] = [];
  private rank = new Map<number, number>();
  private top = DEFAULT_TOP;
  private topTouched = false;
  private vmax = 1;
  private hover: Edge | null = null;

  private slider = h('input', 'pipatch-top-n');
  private sliderLabel = h('span', 'pipatch-top-n-label');
  private svgBtn = h('button', 'pipatch-svg', 'SVG');
  private stop = new StopButton('stop the exact patches after the current chunk (keeps the estimates)', () => this.cb.onStop?.(), this.signal);
  private code = new CodePanel('circuit', this.signal);
  private body = h('div', 'pipatch-circuit-body');
  private graph = svg('svg', { class: 'pipatch-graph' });
  private side = h('div', 'pipatch-circuit-side');
  private barCanvas = h('canvas', 'pipatch-colorbar');
  private barMin = h('span', 'pipatch-bar-min');
  private barMax = h('span', 'pipatch-bar-max');
  private barName = h('div', 'pipatch-bar-name');
  private faithful = h('div', 'pipatch-faithfulness');

  constructor(el: HTMLElement, callbacks: GridCallbacks = {}) {
    super(el, callbacks, 'pipatch-circuit');
    this.slider.type = 'range';
    this.slider.min = '1';
    this.slider.title = 'how many edges to draw: the largest |estimate| first';
    // Arrow keys, Home and End move the slider, not the notebook's cell selection.
    this.slider.setAttribute('data-lm-suppress-shortcuts', 'true');
    this.svgBtn.title = 'download the graph as SVG';
    this.svgBtn.type = 'button';
    const sliderBox = h('label', 'pipatch-top-n-box');
    sliderBox.append(h('span', undefined, 'edges '), this.slider, this.sliderLabel);
    this.toolbar.append(sliderBox, this.svgBtn, this.code.button, this.stop.button);
    const bar = h('div', 'pipatch-bar-wrap');
    bar.append(this.barMin, this.barCanvas, this.barMax);
    this.side.append(this.barName, bar, this.faithful);
    this.body.append(this.graph, this.side);
    this.mount(el, [this.code.panel, this.body]);

    this.listen(this.slider, 'input', () => {
      this.top = Number(this.slider.value);
      this.topTouched = true;
      this.render();
    });
    this.listen(this.svgBtn, 'click', () => this.downloadSvg());
    this.listen(this.graph, 'mousemove', (e) => this.onMove(e));
    this.listen(this.graph, 'mouseleave', () => this.setHover(null));
    this.listen(this.graph, 'click', (e) => this.onClick(e));
  }

  /** The state's edges, ranked, and the colour scale's end. */
  protected accept(state: GridState): void {
    this.edges = circuitEdges(state);
    this.rank = new Map(this.edges.map((e, i) => [e.row * state.col_labels.length + e.col, i]));
    this.vmax = symmetricMax(this.edges.map((e) => e.score));
  }

  /** The edges drawn now. */
  shown(): Edge[] {
    return topEdges(this.edges, this.top);
  }

  protected availWidth(): number {
    return Math.max(320, this.rootWidth(900) - 300);
  }

  protected render(): void {
    const s = this.state;
    if (!s) return;
    this.renderFrame(s, circuitStatus(s, this.edges.length));
    const { max, value } = sliderRange(this.edges.length, defaultTop(s));
    if (!this.topTouched) this.top = value;
    this.top = Math.min(this.top, max);
    this.slider.max = String(max);
    this.slider.value = String(this.top);
    this.sliderLabel.textContent = `top ${this.top} of ${this.edges.length} by |estimate|`;
    this.stop.update(s);
    this.code.update(s.code);
    this.drawGraph(s);
    this.drawLegend(s);
    this.drawFaithfulness(s);
    this.renderDetail(s);
  }

  private drawGraph(s: GridState): void {
    const c = s.circuit ?? {};
    const layout = layoutGraph(c, this.measure());
    const g = this.graph;
    g.setAttribute('width', String(layout.width));
    g.setAttribute('height', String(layout.height));
    g.setAttribute('viewBox', `0 0 ${layout.width} ${layout.height}`);
    g.setAttribute('xmlns', SVG_NS);
    const shown = this.shown();
    const sel = this.ui.selected as Partial<Selection>;
    const used = new Set<number>();
    const edges = svg('g', { class: 'pipatch-edges', fill: 'none' });
    for (let i = shown.length - 1; i >= 0; i--) {
      // The smallest first: the largest is drawn (and hit) on top.
      const e = shown[i];
      used.add(c.senders?.[e.col] ?? -1);
      used.add(c.receivers?.[e.row] ?? -1);
      const d = edgePath(c, layout, e);
      const item = svg('g', { class: 'pipatch-edge', 'data-row': e.row, 'data-col': e.col, 'data-rank': i });
      if (sel.row === e.row && sel.col === e.col) item.classList.add('pipatch-edge-selected');
      const colour = rgb(divergingColor(e.score, this.vmax));
      const width = strokeWidth(e.score, this.vmax);
      if (item.classList.contains('pipatch-edge-selected')) item.append(svg('path', { d, stroke: '#000000', 'stroke-width': width + 3, 'stroke-opacity': 0.8 }));
      item.append(
        svg('path', { class: 'pipatch-edge-line', d, stroke: colour, 'stroke-width': width, 'stroke-opacity': 0.92 }),
        svg('path', { class: 'pipatch-edge-hit', d, stroke: 'transparent', 'stroke-width': Math.max(8, width + 4) }),
      );
      edges.append(item);
    }
    const rows = svg('g', { class: 'pipatch-rows', 'font-size': 11, fill: '#616161' });
    const seen = new Set<number>();
    const nodesG = svg('g', { class: 'pipatch-nodes' });
    const labels = svg('g', { class: 'pipatch-node-labels', 'font-size': 10, 'font-family': 'sans-serif' });
    const nodes = c.nodes ?? [];
    const named = nodes.length <= 48;
    nodes.forEach((n, i) => {
      const p = layout.nodes[i];
      if (!seen.has(n.layer) && n.kind !== 'mlp') {
        seen.add(n.layer);
        rows.append(svg('text', { x: 4, y: p.y + 4, 'font-family': 'sans-serif' }, ROW_NAMES[n.kind] ?? `layer ${n.layer}`));
      }
      const busy = used.has(i);
      const r = busy ? layout.radius : Math.max(2, layout.radius * 0.55);
      const style = { fill: busy ? '#ffffff' : '#d9d9d9', stroke: busy ? '#212121' : '#9e9e9e', 'stroke-width': busy ? 1.2 : 0.6 };
      const shape = n.kind === 'head'
        ? svg('circle', { cx: p.x, cy: p.y, r, ...style })
        : svg('rect', { x: p.x - r, y: p.y - r, width: 2 * r, height: 2 * r, ...style });
      shape.setAttribute('class', 'pipatch-node');
      shape.setAttribute('data-node', String(i));
      shape.append(svg('title', {}, n.name));
      nodesG.append(shape);
      if (busy || named) {
        const label = svg('text', { x: p.x + r + 3, y: p.y + 3.5, fill: busy ? '#212121' : '#9e9e9e' }, tooltipLabel(n.name, 16));
        if (!busy) label.setAttribute('class', 'pipatch-idle');
        labels.append(label);
      }
    });
    g.replaceChildren(rows, edges, nodesG, labels);
    this.root.setAttribute('data-edges', String(shown.length));
    this.root.setAttribute('data-edges-total', String(this.edges.length));
  }

  private drawLegend(s: GridState): void {
    this.barName.textContent = `estimated change of ${s.metric || 'metric'}`;
    this.barMin.textContent = formatValue(-this.vmax, 3);
    this.barMax.textContent = formatValue(this.vmax, 3);
    drawColorBar(this.barCanvas, 'diverging', -this.vmax, this.vmax);
  }

  private drawFaithfulness(s: GridState): void {
    const f = s.circuit?.faithfulness;
    if (!f || !f.sizes.length) {
      this.faithful.replaceChildren();
      this.faithful.style.display = 'none';
      return;
    }
    this.faithful.style.display = '';
    const W = 260;
    const H = 170;
    const pad = 30;
    const sc = faithfulnessScale(f.sizes, f.recovery, f.share, W, H, pad);
    const chart = svg('svg', { class: 'pipatch-faithfulness-chart', width: W, height: H, viewBox: `0 0 ${W} ${H}`, 'font-family': 'sans-serif', 'font-size': 9 });
    const x0 = sc.x(0);
    const x1 = sc.x(Math.max(...f.sizes));
    chart.append(
      svg('line', { x1: x0, y1: sc.y(sc.lo), x2: x1, y2: sc.y(sc.lo), stroke: '#9e9e9e' }),
      svg('line', { x1: x0, y1: sc.y(sc.lo), x2: x0, y2: sc.y(sc.hi), stroke: '#9e9e9e' }),
      svg('text', { x: 2, y: sc.y(1) + 3, fill: '#616161' }, '1'),
      svg('text', { x: 2, y: sc.y(0) + 3, fill: '#616161' }, '0'),
      svg('text', { x: x0, y: H - 4, fill: '#616161' }, 'edges kept (top n)'),
      svg('text', { x: x1, y: H - 4, fill: '#616161', 'text-anchor': 'end' }, String(Math.max(...f.sizes))),
    );
    if (Number.isFinite(f.share)) {
      chart.append(svg('line', { class: 'pipatch-share', x1: x0, x2: x1, y1: sc.y(f.share), y2: sc.y(f.share), stroke: '#b2182b', 'stroke-dasharray': '4 3' }));
    }
    const drawn = Math.min(this.top, Math.max(...f.sizes));
    chart.append(svg('line', { class: 'pipatch-drawn', x1: sc.x(drawn), x2: sc.x(drawn), y1: sc.y(sc.lo), y2: sc.y(sc.hi), stroke: '#bdbdbd' }));
    if (Number.isFinite(f.size)) {
      chart.append(svg('line', { class: 'pipatch-size', x1: sc.x(f.size), x2: sc.x(f.size), y1: sc.y(sc.lo), y2: sc.y(sc.hi), stroke: '#b2182b', 'stroke-dasharray': '1 2' }));
    }
    const pts = f.sizes.map((n, i) => [n, f.recovery[i]] as const).filter(([, v]) => Number.isFinite(v));
    chart.append(svg('polyline', { class: 'pipatch-curve', points: pts.map(([n, v]) => `${sc.x(n).toFixed(1)},${sc.y(v).toFixed(1)}`).join(' '), fill: 'none', stroke: '#2166ac', 'stroke-width': 1.4 }));
    for (const [n, v] of pts) chart.append(svg('circle', { cx: sc.x(n), cy: sc.y(v), r: 2, fill: '#2166ac' }, undefined));
    const share = Number.isFinite(f.share) ? `${Math.round(f.share * 100)} %` : 'the share';
    const reached = Number.isFinite(f.size)
      ? `recovery ≥ ${share} with ${f.size} of ${f.edges || Math.max(...f.sizes)} edges`
      : `no circuit size reaches ${share} recovery`;
    this.faithful.replaceChildren(h('div', 'pipatch-faithfulness-title', 'faithfulness: recovery vs edges kept'), chart, h('div', 'pipatch-faithfulness-size', reached));
  }

  private edgeAt(target: EventTarget | null): Edge | null {
    const item = (target as Element | null)?.closest?.('.pipatch-edge');
    if (!item || !this.state) return null;
    const i = this.rank.get(Number(item.getAttribute('data-row')) * this.state.col_labels.length + Number(item.getAttribute('data-col')));
    return i === undefined ? null : this.edges[i];
  }

  private setHover(e: Edge | null): void {
    if (this.hover === e) return;
    this.graph.querySelector('.pipatch-edge-hover')?.classList.remove('pipatch-edge-hover');
    this.hover = e;
    if (!e) {
      this.tip(null);
      return;
    }
    this.graph.querySelector(`.pipatch-edge[data-row="${e.row}"][data-col="${e.col}"]`)?.classList.add('pipatch-edge-hover');
    const rank = this.rank.get(e.row * this.state!.col_labels.length + e.col) ?? -1;
    this.tip(edgeInfo(this.state!, e, rank, this.edges.length));
  }

  private onMove(ev: MouseEvent): void {
    const e = this.edgeAt(ev.target);
    this.setHover(e);
    if (!e) return;
    this.placeTip(ev);
  }

  private onClick(ev: MouseEvent): void {
    const e = this.edgeAt(ev.target);
    const s = this.state;
    if (!e || !s) return;
    const sel: Selection = { view: this.ui.view, seed: -1, row: e.row, col: e.col };
    this.ui = { ...this.ui, selected: sel };
    this.cb.onUiChange?.({ selected: sel });
    this.cb.onSelect?.(sel);
    this.render();
  }

  private renderDetail(s: GridState): void {
    const sel = this.ui.selected as Partial<Selection>;
    if (typeof sel.row !== 'number' || typeof sel.col !== 'number') {
      this.detailEl.replaceChildren(h('div', 'pipatch-detail-hint', this.cb.live ? 'Click an edge to patch it exactly: its change of the metric over every pair, and the patched run’s top-5 next tokens.' : ''));
      return;
    }
    const i = this.rank.get(sel.row * s.col_labels.length + sel.col);
    const e = i === undefined ? null : this.edges[i];
    const head = e ? edgeInfo(s, e, i!, this.edges.length) : [`${s.col_labels[sel.col] ?? sel.col} → ${s.row_labels[sel.row] ?? sel.row}`];
    const kids = [h('div', 'pipatch-detail-head', head.join(' · '))];
    const ran = clickedExact(s, sel as Selection);
    if (ran) kids.push(h('div', 'pipatch-detail-exact', ran));
    this.detailEl.replaceChildren(...kids, ...detailBody(s, sel as Selection, !!this.cb.live));
  }

  /** The graph as a standalone SVG document (what the SVG button saves). */
  svgText(): string {
    return standaloneSvg(this.graph, 'pipatch-edge-hit');
  }

  downloadSvg(): void {
    if (!this.state) return;
    this.save(new Blob([this.svgText()], { type: 'image/svg+xml' }), 'svg');
  }
}
